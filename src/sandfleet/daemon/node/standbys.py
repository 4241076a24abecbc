"""Standbys: a sandbox's checkpoint restored ahead of its rollback and kept frozen.

A rollback to that checkpoint is then a swap: the tier thaws the standby, which stays under its own
name (cgroup and directory: the sandbox's record names its live part, `part_of`), and the old part
is destroyed in the background once the record is written, instead of restoring the checkpoint
while the caller waits. The restore's CPU is the same; it is spent while the caller does something
else (a model thinking about its next action).

A sandbox has at most one, for the checkpoint it last took or last rolled back to (a search rolls
back to the same node again and again). Its restore begins DELAY after that, only while the node
has the memory to spare (a standby holds the checkpoint's memory until it is used or dropped); it is
dropped with its checkpoint, with its sandbox (its stop waits for it) and when the daemon stops.
A daemon killed meanwhile leaves names no sandbox's record has: the next start's recovery removes
them as residue (it adopts a standby only as the live part a record names), and its sweeps remove
those a restore finished after that.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import itertools
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox, StandbyTier
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.lifecycle import FAILED, RUNNING, STOPPED, Sandbox
from sandfleet.daemon.node.snapshot_files import check_intact
from sandfleet.errors import SandboxError, UnavailableError
from sandfleet.models import SandboxSpec

# In a standby's name (`<sandbox id>.standby-<daemon run>-<n>`): never a sandbox id, so recovery
# never adopts one; the daemon run's token tells this daemon's own from a killed one's.
STANDBY_MARK = ".standby-"
# Seconds after start of the sweeps for a killed daemon's standbys: a restore it began can finish
# after this daemon's recovery, within a launch's timeout (60 s).
SWEEPS_AT = (5.0, 35.0, 65.0, 95.0, 125.0)
# A standby is made only if the node keeps this share of its memory available with it.
RESERVE = 0.25
# Seconds a standby's restore waits to begin: a caller that deletes the checkpoint, takes another or
# rolls back at once (a restore then, either way) never pays a restore's CPU for nothing.
DELAY = 0.2
MAKING_AT_ONCE = 2  # standby restores at once (the node's restores for callers are not held up)
# Seconds a part a standby replaced waits, frozen, for its destroy: the rollback's answer and the
# caller's next call (right after it, as a rule) do not share the node with its teardown (the exit
# of its processes frees their memory: 10-20 ms of CPU for 200 MiB).
RETIRE_AFTER = 0.05


def is_standby(name: str) -> bool:
    return STANDBY_MARK in name


@dataclass
class Standby:
    checkpoint_id: str
    name: str
    tier: StandbyTier
    spec: SandboxSpec  # its sandbox's
    size: int  # the checkpoint's bytes: what the standby may hold in memory
    task: asyncio.Task[LiveSandbox | None] = field(init=False)
    started: bool = False  # its restore has begun (before: a wait, cancelled by a drop or a take)
    hurried: bool = False  # someone waits for it: its restore gets its full CPU share


class Standbys:
    def __init__(
        self, core: NodeCore, *, enabled: bool = True, meminfo: Path = Path("/proc/meminfo"), delay: float = DELAY
    ) -> None:
        self.core = core
        self.enabled = enabled
        self.meminfo = meminfo
        self.delay = delay
        self.of: dict[str, Standby] = {}  # sandbox id -> its standby (made or being made)
        # sandbox id -> its old parts being destroyed (and their names)
        self._retiring: dict[str, dict[asyncio.Task[Any], str]] = {}
        self._making = asyncio.Semaphore(MAKING_AT_ONCE)
        self._serial = itertools.count(1)
        self._run = secrets.token_hex(4)
        core.stop_hooks.append(self.release)

    def _name(self, sandbox_id: str) -> str:
        return f"{sandbox_id}{STANDBY_MARK}{self._run}-{next(self._serial)}"

    def _tier(self, sb: Sandbox) -> StandbyTier | None:
        tier = self.core.tier(sb)
        return tier if isinstance(tier, StandbyTier) and tier.standbys_possible() else None

    def sets_aside(self, sb: Sandbox) -> bool:
        """Whether `retire` moves the sandbox's live part out of its cgroup before destroying it."""
        return self._tier(sb) is not None and not self.core.shutting_down

    # -- made, taken, dropped -----------------------------------------------------------------------------

    def prepare(self, sb: Sandbox, checkpoint_id: str, path: Path, meta: dict[str, Any], size: int) -> None:
        """Start making a standby of this checkpoint of `sb` (in place of any other it had)."""
        self.drop(sb.id)
        tier = self._tier(sb)
        if not self.enabled or tier is None or self.core.shutting_down or sb.state != RUNNING:
            return
        st = Standby(checkpoint_id, self._name(sb.id), tier, sb.spec, size)
        try:
            st.task = self.core.spawn(self._make(st, sb, path, meta), name=f"standby-{st.name}")
        except UnavailableError:
            return  # shutting down
        self.of[sb.id] = st

    async def _make(self, st: Standby, sb: Sandbox, path: Path, meta: dict[str, Any]) -> LiveSandbox | None:
        """The restore, on CPU no one else wants (a busy node's sandboxes are not slowed for a
        rollback that may not come) unless someone waits for it."""
        await asyncio.sleep(self.delay)
        async with self._making:
            st.started = True  # (not before: one queued behind others is still cancelled by a take)
            if not await asyncio.to_thread(self._room_for, st):
                log.info("no standby %s: the node's memory is short", st.name)
                return None
            try:
                await asyncio.to_thread(check_intact, path, meta)  # (criu may hang on damaged images)
                return await st.tier.restore_standby(st.name, st.spec, path, meta, idle=not st.hurried)
            except SandboxError as exc:  # the rollback restores as it would have anyway
                log.info("standby %s was not made: %s", st.name, exc.message)
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
        """The standby of this checkpoint, now the caller's (waiting for one whose restore runs: it is
        further along than a restore begun now); None if there is none. Any other standby stays."""
        st = self.of.get(sandbox_id)
        if st is None or st.checkpoint_id != checkpoint_id:
            return None
        del self.of[sandbox_id]
        live = await self._result(st)
        return None if live is None else (st.tier, live)

    @staticmethod
    async def _result(st: Standby) -> LiveSandbox | None:
        """The standby once made (None if it was not); one whose restore had not begun is cancelled.
        A restore that runs is waited for, never cancelled (the launcher would finish it unseen).
        Someone waits for it, so it gets its sandbox's CPU weight (again and again until done: a
        weight written before its launcher made the cgroup is lost)."""
        if not st.started:
            st.task.cancel()
            return None
        try:
            while not st.task.done():
                st.hurried = True
                await st.tier.hurry(st.name, st.spec)
                await asyncio.wait([st.task], timeout=0.02)
            return await asyncio.shield(st.task)
        except asyncio.CancelledError:
            if st.task.cancelled():  # (by the daemon's stop: its restore cleaned up after itself)
                return None
            raise

    def drop(self, sandbox_id: str, checkpoint_id: str | None = None) -> None:
        """Destroy the sandbox's standby (only if it is of `checkpoint_id`, when given); a restore
        that runs finishes first, hurried (on a busy node one left on idle CPU would hold its memory,
        a place of MAKING_AT_ONCE and the sandbox's stop for as long as the node stays busy)."""
        st = self.of.get(sandbox_id)
        if st is None or (checkpoint_id is not None and st.checkpoint_id != checkpoint_id):
            return
        del self.of[sandbox_id]
        with contextlib.suppress(UnavailableError):  # shutting down: `close` ran, the next start removes it
            task = self.core.spawn(self._discard(st), name=f"standby-drop-{sandbox_id}")
            self._track(sandbox_id, st.name, task)

    @classmethod
    async def _discard(cls, st: Standby) -> None:
        live = await cls._result(st)
        if live is not None:
            await st.tier.destroy(live)

    # -- the live part a rollback replaces ---------------------------------------------------------------

    async def retire(self, sb: Sandbox, live: LiveSandbox, *, replaced: bool = False) -> None:
        """Destroy the live part a rollback replaces. Where the tier can, it is destroyed in the
        background (the rollback does not wait for its processes to exit and their memory to be
        freed: 10-20 ms for 200 MiB): RETIRE_AFTER later if `replaced` (by a standby, which froze
        it; its sandbox's record names the standby already), else first set aside under a standby's
        kind of name (out of the sandbox's way: a restore takes its id's name)."""
        tier = self._tier(sb)
        if tier is not None and self.sets_aside(sb):
            live.channel.close()
            try:
                if not replaced:
                    await tier.set_aside(live, self._name(sb.id))
            except SandboxError:
                pass  # still in its place: destroyed now
            else:
                if sb.state != RUNNING:  # stopped meanwhile: its stop's `release` may have run already
                    await tier.destroy(live)
                    return
                destroy = self._retire_later(tier, live, sb.id) if replaced else tier.destroy(live)
                with contextlib.suppress(UnavailableError):
                    self._track(sb.id, live.id, self.core.spawn(destroy, name=f"retire-{live.id}"))
                    return
                destroy.close()  # (never awaited: shutting down)
        await self.core.tier(sb).destroy(live)

    async def _retire_later(self, tier: StandbyTier, live: LiveSandbox, sandbox_id: str) -> None:
        """RETIRE_AFTER on: an old part under the sandbox's own id is first set aside (whatever its
        destroy might leave never stands in the way of a restore into that name), then destroyed."""
        await asyncio.sleep(RETIRE_AFTER)
        if live.id == sandbox_id:
            with contextlib.suppress(SandboxError):
                await tier.set_aside(live, self._name(sandbox_id))
        await tier.destroy(live)

    async def retired(self, sandbox_id: str, name: str) -> None:
        """Wait until no old part of the sandbox named `name` is being destroyed (a restore is about
        to take that name)."""
        for task, part in list(self._retiring.get(sandbox_id, {}).items()):
            if part == name:
                with contextlib.suppress(Exception):  # (a failure is logged by the task's guard)
                    await asyncio.shield(task)

    def _track(self, sandbox_id: str, name: str, task: asyncio.Task[Any]) -> None:
        """A destroy in the background (of a part named `name`) that the sandbox's stop (`release`)
        and `close` wait for."""
        tasks = self._retiring.setdefault(sandbox_id, {})
        tasks[task] = name

        def done(t: asyncio.Task[Any]) -> None:
            tasks.pop(t, None)
            if not tasks and self._retiring.get(sandbox_id) is tasks:
                del self._retiring[sandbox_id]

        task.add_done_callback(done)

    async def release(self, sb: Sandbox) -> None:
        """The sandbox stops: its standby and the old parts its rollbacks set aside go before its
        stop returns. (A standby a rollback took is the rollback's: it destroys it once it sees the
        stop, as it does a restore it made.)"""
        self.drop(sb.id)
        for task in list(self._retiring.get(sb.id, ())):
            await asyncio.shield(task)  # (a failure is logged by the task's guard)

    async def close(self) -> None:
        """The daemon stops: every standby goes (none is a sandbox anyone will roll back), and every
        old part being destroyed is."""
        for sandbox_id in list(self.of):
            self.drop(sandbox_id)
        for task in [t for tasks in self._retiring.values() for t in tasks]:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    # -- what a killed daemon left ----------------------------------------------------------------------

    async def run(self) -> None:
        if not self.enabled:
            return
        waited = 0.0
        for at in SWEEPS_AT:
            await asyncio.sleep(at - waited)
            waited = at
            try:
                await self.sweep()
            except Exception:  # (the next sweep tries again)
                log.exception("sweeping standbys failed")

    async def sweep(self) -> builtins.list[str]:
        """Remove what standbys of another daemon run left (a daemon killed while it made, dropped
        or set one aside); this run's own are its to destroy. Returns their names."""
        swept = []
        # Not residue: a live part (a standby a rollback promoted), one this run destroys already, nor
        # any part of a sandbox being rolled back or stopped (its old part and its standby are the
        # rollback's or the stop's).
        live = {sb.live.id for sb in self.core.table if sb.live is not None}
        live |= {name for tasks in self._retiring.values() for name in tasks.values()}  # (being destroyed)
        rolling = {sb.id for sb in self.core.table if sb.live is None and sb.state not in (STOPPED, FAILED)}
        for tier in self.core.backends.values():
            if not isinstance(tier, StandbyTier) or not tier.standbys_possible():
                continue
            for name in sorted(await asyncio.to_thread(tier.residue)):
                ours = f"{STANDBY_MARK}{self._run}-" in name
                if is_standby(name) and not ours and name not in live and name.split(STANDBY_MARK)[0] not in rolling:
                    log.info("removing %s, a standby a previous daemon run left", name)
                    await tier.cleanup(name, {})
                    swept.append(name)
        return swept

    def _room_for(self, st: Standby) -> bool:
        """Whether the node keeps RESERVE of its memory available with this standby and the others
        being made (what is made already is in MemAvailable)."""
        try:
            fields = dict(line.split(":", 1) for line in self.meminfo.read_text().splitlines() if ":" in line)
            total = int(fields["MemTotal"].split()[0]) * 1024
            available = int(fields["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError, IndexError):
            return False
        making = sum(o.size for o in self.of.values() if o is not st and o.started and not o.task.done())
        return available - making - st.size >= total * RESERVE
