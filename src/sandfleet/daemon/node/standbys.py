"""Standbys: a sandbox's checkpoint restored ahead of its rollback and kept frozen.

A rollback to that checkpoint is then a swap: the tier renames the standby into the sandbox's place
(cgroup and directory) and thaws it, instead of restoring the checkpoint while the caller waits.
The restore's CPU is the same; it is spent while the caller does something else (a model
thinking about its next action).

A sandbox has at most one, for the checkpoint it last took or last rolled back to (a search rolls
back to the same node again and again). It is made in the background, only while the node has the
memory to spare (a standby holds the checkpoint's memory until it is used or dropped), and dropped
with its checkpoint, with its sandbox and when the daemon stops. A daemon killed meanwhile leaves
names no sandbox has, which the next start's recovery removes as residue.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import itertools
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.backends.base import Standbys as StandbyTier
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.lifecycle import Sandbox
from sandfleet.daemon.node.snapshot_files import check_intact
from sandfleet.errors import SandboxError, UnavailableError

# In a standby's name (`<sandbox id>.standby-<daemon run>-<n>`): never a sandbox id, so recovery
# never adopts one; the daemon run's token tells this daemon's own from a killed one's.
STANDBY_MARK = ".standby-"
# Seconds after start, then between, sweeps for a killed daemon's standbys (a restore it began can
# finish after the new daemon's recovery).
SWEEP_AFTER, SWEEP_EVERY = 5.0, 30.0
# A standby is made only if the node keeps this share of its memory available after it.
RESERVE = 0.25


def is_standby(name: str) -> bool:
    return STANDBY_MARK in name


@dataclass
class Standby:
    checkpoint_id: str
    tier: StandbyTier
    task: asyncio.Task[LiveSandbox | None]


class Standbys:
    def __init__(self, core: NodeCore, *, enabled: bool = True, meminfo: Path = Path("/proc/meminfo")) -> None:
        self.core = core
        self.enabled = enabled
        self.meminfo = meminfo
        self.of: dict[str, Standby] = {}  # sandbox id -> its standby (made or being made)
        self._closing: list[Standby] = []  # dropped while the daemon stopped: `close` destroys them
        self._retiring: dict[str, set[asyncio.Task[Any]]] = {}  # sandbox id -> its old parts being destroyed
        self._serial = itertools.count(1)
        self._run = secrets.token_hex(4)
        core.stop_hooks.append(self.release)

    def _name(self, sandbox_id: str) -> str:
        return f"{sandbox_id}{STANDBY_MARK}{self._run}-{next(self._serial)}"

    def prepare(self, sb: Sandbox, checkpoint_id: str, path: Path, meta: dict[str, Any]) -> None:
        """Start making a standby of this checkpoint of `sb` (in place of any other it had)."""
        self.drop(sb.id)
        tier = self.core.tier(sb)
        if not self.enabled or not isinstance(tier, StandbyTier) or not tier.standbys_possible():
            return
        name = self._name(sb.id)
        try:
            task = self.core.spawn(self._make(tier, name, sb, path, meta), name=f"standby-{name}")
        except UnavailableError:
            return  # shutting down
        self.of[sb.id] = Standby(checkpoint_id, tier, task)

    async def _make(
        self, tier: StandbyTier, name: str, sb: Sandbox, path: Path, meta: dict[str, Any]
    ) -> LiveSandbox | None:
        if not await asyncio.to_thread(self._room_for, path):
            log.info("no standby %s: the node's memory is short", name)
            return None
        try:
            await asyncio.to_thread(check_intact, path, meta)  # (criu may hang on damaged images)
            return await tier.restore_standby(name, sb.spec, path, meta)
        except SandboxError as exc:  # the rollback restores as it would have anyway
            log.info("standby %s was not made: %s", name, exc.message)
            return None

    def ready(self, sandbox_id: str, checkpoint_id: str) -> bool:
        """Whether a standby of this checkpoint is made (a rollback to it is a swap)."""
        st = self.of.get(sandbox_id)
        return (
            st is not None
            and st.checkpoint_id == checkpoint_id
            and st.task.done()
            and not st.task.cancelled()
            and st.task.result() is not None
        )

    async def take(self, sandbox_id: str, checkpoint_id: str) -> tuple[StandbyTier, LiveSandbox] | None:
        """The standby of this checkpoint, now the caller's (waiting for one still being made: it
        is further along than a restore begun now); None if there is none."""
        st = self.of.get(sandbox_id)
        if st is None or st.checkpoint_id != checkpoint_id:
            return None
        del self.of[sandbox_id]
        live = await asyncio.shield(st.task)
        return None if live is None else (st.tier, live)

    async def retire(self, sb: Sandbox, live: LiveSandbox) -> None:
        """Destroy the live part a rollback replaces. Where the tier can, it is first set aside under
        a standby's kind of name and destroyed in the background: the rollback does not wait for
        its processes to exit and their memory to be freed (10-20 ms for 200 MiB)."""
        tier = self.core.tier(sb)
        if isinstance(tier, StandbyTier) and tier.standbys_possible():
            live.channel.close()
            try:
                await tier.set_aside(live, self._name(sb.id))
                task = self.core.spawn(tier.destroy(live), name=f"retire-{live.id}")
            except SandboxError:
                pass  # in its place still (or set aside while the daemon stops): destroyed now
            else:
                tasks = self._retiring.setdefault(sb.id, set())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                return
        await tier.destroy(live)

    async def release(self, sb: Sandbox) -> None:
        """The sandbox stops: its standby and old parts go before its stop returns."""
        st = self.of.pop(sb.id, None)
        try:
            if st is not None:
                await self._discard(st)
            for task in list(self._retiring.pop(sb.id, ())):
                await asyncio.shield(task)
        except Exception:  # (the sandbox itself is stopped; the next daemon start removes what is left)
            log.exception("sandbox %s: destroying its standby failed", sb.id)

    def drop(self, sandbox_id: str, checkpoint_id: str | None = None) -> None:
        """Destroy the sandbox's standby (only if it is of `checkpoint_id`, when given)."""
        st = self.of.get(sandbox_id)
        if st is None or (checkpoint_id is not None and st.checkpoint_id != checkpoint_id):
            return
        del self.of[sandbox_id]
        try:
            self.core.spawn(self._discard(st), name=f"standby-drop-{sandbox_id}")
        except UnavailableError:  # shutting down: `close` (or the next start's recovery) has it
            self._closing.append(st)

    @staticmethod
    async def _discard(st: Standby) -> None:
        live = await asyncio.shield(st.task)
        if live is not None:
            await st.tier.destroy(live)

    async def close(self) -> None:
        """The daemon stops: every standby goes (none is a sandbox anyone will roll back)."""
        pending = [*self.of.values(), *self._closing]
        self.of.clear()
        self._closing = []
        for st in pending:
            with contextlib.suppress(Exception):
                await self._discard(st)

    async def run(self) -> None:
        await asyncio.sleep(SWEEP_AFTER)
        while True:
            try:
                await self.sweep()
            except Exception:  # (the next sweep tries again)
                log.exception("sweeping standbys failed")
            await asyncio.sleep(SWEEP_EVERY)

    async def sweep(self) -> builtins.list[str]:
        """Remove what standbys of another daemon run left (a daemon killed while it made, dropped
        or set one aside); this run's own are its to destroy. Returns their names."""
        swept = []
        for tier in self.core.backends.values():
            if not isinstance(tier, StandbyTier):
                continue
            for name in sorted(await asyncio.to_thread(tier.residue)):
                if is_standby(name) and f"{STANDBY_MARK}{self._run}-" not in name:
                    log.info("removing %s, a standby a previous daemon run left", name)
                    await tier.cleanup(name, {})
                    swept.append(name)
        return swept

    def _room_for(self, path: Path) -> bool:
        """Whether the node keeps RESERVE of its memory available with the checkpoint's pages restored."""
        try:
            fields = dict(line.split(":", 1) for line in self.meminfo.read_text().splitlines() if ":" in line)
            total = int(fields["MemTotal"].split()[0]) * 1024
            available = int(fields["MemAvailable"].split()[0]) * 1024
            pages = sum(p.stat().st_size for p in (path / "img").glob("pages-*.img"))
        except (OSError, KeyError, ValueError, IndexError):
            return False
        return available - pages >= total * RESERVE
