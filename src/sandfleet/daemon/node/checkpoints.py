"""Checkpoints: states of one sandbox that it goes back to in place.

A checkpoint is taken as a snapshot is (`Snapshots.capture`: the tier's images of the processes and
their memory, the writable layer, the sessions and background processes), but it belongs to its
sandbox: it is listed with it, counted against its disk, and removed when it stops. A rollback puts
the same sandbox (same id, resources, labels, network policy and handles of the sessions and
background processes the checkpoint held) back to that state: the tier's live part is replaced by a
restore of the checkpoint. What was opened after the checkpoint is gone with it, and said so.

Checkpoints are kept under the node's state directory, one folder per sandbox, each with its
`checkpoint.json`; a restarted daemon finds those of the sandboxes it adopts again and removes the
rest.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import os
import shutil
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandfleet.backends.base import LiveSandbox, Snapshottable, StandbyTier, offers, unsupported
from sandfleet.daemon import failpoints
from sandfleet.daemon.net.sandbox_network import Networking
from sandfleet.daemon.node.core import LIVENESS_TIMEOUT, NodeCore, log
from sandfleet.daemon.node.lifecycle import RUNNING, Sandbox, stopped_meanwhile
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.snapshot_files import check_intact, write_json
from sandfleet.daemon.node.snapshots import Snapshots
from sandfleet.daemon.node.standbys import Standbys
from sandfleet.errors import NotFoundError, ResourceExhaustedError, SandboxError, UnavailableError, WrongStateError
from sandfleet.ids import new_id
from sandfleet.images import fsutil
from sandfleet.models import CheckpointInfo, RollbackResult, shown

# A search keeps its frontier as checkpoints; past this many the oldest goes (each is whole, so
# dropping one loses nothing the others need).
MAX_CHECKPOINTS = 32
ROLLBACK_TIMEOUT = 300.0  # how long a rollback keeps its sandbox from its idle TTL, at most


@dataclass
class CheckpointRecord:
    info: CheckpointInfo
    path: Path
    meta: dict[str, Any]


class Checkpoints:
    def __init__(
        self,
        core: NodeCore,
        pauser: Pauser,
        snapshots: Snapshots,
        networking: Networking,
        root: Path,
        *,
        standbys: bool = True,
    ) -> None:
        self.core = core
        self.pauser = pauser
        self.snapshots = snapshots
        self.networking = networking
        self.root = root
        self.of: dict[str, builtins.list[CheckpointRecord]] = {}  # sandbox id -> its checkpoints, oldest first
        self.standbys = Standbys(core, enabled=standbys)
        core.table.on_stopped(self._stopped)
        snapshots.images.layer_users.append(self._layers)

    def _layers(self) -> set[str]:
        return {str(d) for recs in self.of.values() for rec in recs for d in rec.meta.get("layers", [])}

    def _tier(self, sb: Sandbox, doing: str) -> Snapshottable:
        tier = self.core.tier(sb)
        if not isinstance(tier, Snapshottable) or not offers(tier, "snapshot"):
            raise unsupported(tier, doing)
        return tier

    def _record(self, sandbox_id: str, checkpoint_id: str) -> CheckpointRecord:
        for rec in self.of.get(sandbox_id, []):
            if rec.info.id == checkpoint_id:
                return rec
        raise NotFoundError(f"checkpoint {shown(checkpoint_id)} not found in sandbox {sandbox_id}")

    # -- checkpoint, list, delete ---------------------------------------------------------------------

    async def checkpoint(self, sandbox_id: str, labels: dict[str, str] | None = None) -> CheckpointInfo:
        """Record the sandbox's state (a paused one is resumed for it); it keeps running."""
        self._tier(self.core.sandbox(sandbox_id), "checkpoint a sandbox")
        async with self.pauser.holding(sandbox_id) as (sb, live):
            checkpoint_id = new_id("cp", self.core.node_key)
            path = self.root / sb.id / checkpoint_id
            t0 = time.perf_counter()
            try:
                with stopped_meanwhile(sb, "its checkpoint was taken"):
                    await asyncio.to_thread(path.parent.mkdir, 0o700, True, True)
                    meta = await self.snapshots.capture(sb, live, path)
                    seconds = time.perf_counter() - t0
                    size = await asyncio.to_thread(fsutil.disk_usage, path)
                    if size > sb.spec.resources.disk:
                        raise ResourceExhaustedError(
                            f"a checkpoint of sandbox {sb.id} takes {size} bytes, more than its disk "
                            f"({sb.spec.resources.disk}): free memory or files, or give it more disk"
                        )
                    info = CheckpointInfo(
                        id=checkpoint_id,
                        sandbox_id=sb.id,
                        created_at=time.time(),
                        size_bytes=size,
                        seconds=round(seconds, 4),
                        labels=labels or {},
                    )
                    record = {"info": info.model_dump(mode="json"), "meta": meta}
                    await asyncio.to_thread(write_json, path / "checkpoint.json", record)
                    if sb.state != RUNNING:  # stopped meanwhile (stop does not wait for the freeze lock)
                        raise WrongStateError(f"sandbox {sandbox_id} stopped while its checkpoint was taken")
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, path, True)
                if sb.state != RUNNING:  # its stop removed the folder of its checkpoints: not made again
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(path.parent.rmdir)
                raise
            kept = self.of.setdefault(sb.id, [])
            kept.append(CheckpointRecord(info, path, meta))
            await self._bound(sb, kept)
            self.standbys.prepare(sb, checkpoint_id, path, meta, size)
            self.core.touch(sb)
            self.core.journal.record(sb.id, "checkpoint", {"checkpoint": checkpoint_id, "bytes": size,
                                                           "seconds": info.seconds})  # fmt: skip
            self.core.metrics.snapshot_seconds.observe(seconds)
        return info

    async def _bound(self, sb: Sandbox, kept: builtins.list[CheckpointRecord]) -> None:
        """At most MAX_CHECKPOINTS, together within the sandbox's disk: the oldest go first."""
        while len(kept) > 1 and (
            len(kept) > MAX_CHECKPOINTS or sum(r.info.size_bytes for r in kept) > sb.spec.resources.disk
        ):
            old = kept.pop(0)
            self.standbys.drop(sb.id, old.info.id)
            await asyncio.to_thread(shutil.rmtree, old.path, True)
            self.core.journal.record(sb.id, "checkpoint_dropped", {"checkpoint": old.info.id})

    async def list_checkpoints(self, sandbox_id: str) -> builtins.list[CheckpointInfo]:
        self.core.sandbox(sandbox_id)
        return [rec.info for rec in self.of.get(sandbox_id, [])]

    async def delete_checkpoint(self, sandbox_id: str, checkpoint_id: str) -> None:
        sb = self.core.sandbox(sandbox_id)
        async with sb.freeze_lock:  # not while a rollback reads it
            rec = self._record(sandbox_id, checkpoint_id)
            self.of[sandbox_id].remove(rec)
            self.standbys.drop(sandbox_id, checkpoint_id)
            await asyncio.to_thread(shutil.rmtree, rec.path, True)

    # -- rollback -------------------------------------------------------------------------------------

    async def rollback(self, sandbox_id: str, checkpoint_id: str) -> RollbackResult:
        """Put the sandbox back to the checkpoint's state, in place. Runs to its end once begun
        (a caller that goes away does not leave the sandbox half replaced)."""
        t0 = time.perf_counter()
        sb = self.core.sandbox(sandbox_id)
        tier = self._tier(sb, "roll a sandbox back")
        async with self.pauser.holding(sandbox_id) as (sb, live):
            rec = self._record(sandbox_id, checkpoint_id)
            checked = not self.standbys.ready(sandbox_id, checkpoint_id)  # (a standby's restore read them)
            if checked:
                with stopped_meanwhile(sb, "it was rolled back"):  # its stop removes its checkpoints
                    await asyncio.to_thread(check_intact, rec.path, rec.meta)  # before the sandbox is taken down
            if sb.state != RUNNING:
                raise WrongStateError(f"sandbox {sandbox_id} stopped while it was rolled back")
            self.core.busy(sb, ROLLBACK_TIMEOUT)  # its idle TTL does not stop it meanwhile
            try:
                task = asyncio.ensure_future(self._replace(sb, live, tier, rec, checked))
                dropped_sessions, dropped_processes, swapped = await asyncio.shield(task)
            finally:
                self.core.idle_done(sb)
        seconds = time.perf_counter() - t0
        self.core.journal.record(
            sb.id, "rolled_back", {"checkpoint": checkpoint_id, "seconds": round(seconds, 4), "standby": swapped}
        )
        return RollbackResult(
            sandbox_id=sb.id,
            checkpoint_id=checkpoint_id,
            seconds=round(seconds, 4),
            dropped_sessions=dropped_sessions,
            dropped_processes=dropped_processes,
        )

    async def _replace(
        self, sb: Sandbox, live: LiveSandbox, tier: Snapshottable, rec: CheckpointRecord, checked: bool
    ) -> tuple[builtins.list[str], builtins.list[str], bool]:
        """The sandbox's live part replaced by the checkpoint's: what was dropped, and whether a
        standby took its place (else a restore). `checked`: the images' sizes were checked."""
        # Our own teardown: the old agent's channel closing is no lost sandbox. A stop meanwhile
        # finds no live part and leaves the new one to us (below).
        live.channel.on_close = None
        sb.live = None
        inherit = rec.meta.get("inherit", {})
        kept_sessions = {str(s["id"]) for s in inherit.get("sessions", [])}
        kept_processes = {str(p["id"]) for p in inherit.get("processes", [])}
        dropped_sessions = sorted(i for i, s in sb.sessions.items() if not s.dead and i not in kept_sessions)
        dropped_processes = sorted(
            i for i, p in sb.processes.items() if not p.done.is_set() and i not in kept_processes
        )
        standby: tuple[StandbyTier, LiveSandbox] | None = None
        new: LiveSandbox | None = None
        retired = swapped = done = False
        try:
            self.networking.detach(sb)
            # A standby of this checkpoint (restored ahead, frozen) takes the sandbox's place instead
            # of a restore begun now. One that is made: the old part stays the sandbox's on record
            # until the standby's is written (a daemon that dies before adopts it again, and the
            # standby is residue), then goes in the background. One whose restore runs is waited
            # for, the old part first set aside as for a restore (below): a stop meanwhile waits for
            # its destroy.
            if not self.standbys.ready(sb.id, rec.info.id):
                retired = True
                await self._retire_first(sb, live, rec)
            standby = await self.standbys.take(sb.id, rec.info.id)
            if standby is not None and sb.state == RUNNING:
                tried, standby = standby, None  # promoted, or destroyed by the failed promotion
                new = await self._promote(sb, rec, None if retired else live, *tried)
                swapped = new is not None
                if swapped and not retired:
                    failpoints.hit("rollback_before_retire")
                    retired = True
                    await self.standbys.retire(sb, live, replaced=True)
            if new is None and sb.state == RUNNING:
                if not retired:
                    retired = True
                    await self._retire_first(sb, live, rec)
                await self.standbys.retired(sb.id, sb.id)  # (an old part of its own name: the restore's)
                if not checked:  # (skipped for the standby, whose restore checked them)
                    await asyncio.to_thread(check_intact, rec.path, rec.meta)
                new = await tier.restore(sb.id, sb.spec, rec.path, rec.meta)
                failpoints.hit("rollback_before_record")
            done = True
        except SandboxError as exc:
            log.warning("rollback of %s to %s failed: %s", sb.id, rec.info.id, exc)
            await self.core.stop(sb.id, reason=f"rollback failed: {exc.message}"[:200])
            raise UnavailableError(f"sandbox {sb.id} could not be rolled back and was stopped: {exc.message}") from exc
        except BaseException as exc:
            await self.core.stop(sb.id, reason="rollback failed")
            raise UnavailableError(f"sandbox {sb.id} could not be rolled back and was stopped: {exc}") from exc
        finally:
            if not retired:  # (its stop found no live part)
                await asyncio.shield(self.core.tier(sb).destroy(live))
            if standby is not None:  # never tried: it goes
                await asyncio.shield(standby[0].destroy(standby[1]))
            if new is not None and not done:  # (put in place, then the rollback failed: never the sandbox's)
                await asyncio.shield(self.core.tier(sb).destroy(new))
        if sb.state != RUNNING or new is None:
            if new is not None:
                await self.core.tier(sb).destroy(new)
            raise WrongStateError(f"sandbox {sb.id} stopped while it was rolled back")
        sb.live = new
        new.channel.on_close = lambda _ch: self.core.on_agent_lost(sb.id)
        sb.sessions, sb.processes = {}, {}  # the old handles' shells are gone; the checkpoint's come back
        self.snapshots.inherit(sb, new, inherit)
        self.core.watch_agent(sb.id, new)
        if not swapped:  # (a standby's was recorded as it was checked)
            await self.core.state.update(sb.id, runtime=new.runtime)
        await self.networking.attach(sb)
        self.core.touch(sb)
        # For the next rollback to it (a search goes back to one node again and again).
        self.standbys.prepare(sb, rec.info.id, rec.path, rec.meta, rec.info.size_bytes)
        return dropped_sessions, dropped_processes, swapped

    async def _retire_first(self, sb: Sandbox, live: LiveSandbox, rec: CheckpointRecord) -> None:
        """Before anything new goes in the sandbox's place: recorded as rolled back (no agent to
        adopt: a daemon that dies from here finds a half-made sandbox, and its restart removes
        whatever is in its cgroup) while the old part is set aside (out of the sandbox's cgroup: a
        restart does not adopt it), or destroyed in place after the record."""
        if self.standbys.sets_aside(sb):
            await _together(self._record_rolling_back(sb, rec), self.standbys.retire(sb, live))
        else:
            await self._record_rolling_back(sb, rec)
            await self.standbys.retire(sb, live)

    async def _record_rolling_back(self, sb: Sandbox, rec: CheckpointRecord) -> None:
        await self.core.state.update(sb.id, runtime={"layers": rec.meta.get("layers", []), "rolling_back": 1})

    async def _promote(
        self, sb: Sandbox, rec: CheckpointRecord, old: LiveSandbox | None, tier: StandbyTier, standby: LiveSandbox
    ) -> LiveSandbox | None:
        """The standby as the sandbox's live part in place of `old` (None: retired already),
        recorded as it; None (restore instead) if it could not take its place."""
        t0 = time.perf_counter()
        try:
            await tier.promote(standby, sb.id, sb.spec, old)
        except SandboxError as exc:
            log.info("sandbox %s: its standby did not take its place (%s): restoring instead", sb.id, exc.message)
            return None
        failpoints.hit("rollback_before_record")
        # Its agent is asked whether it answers while it is recorded as the sandbox's (one round trip
        # less on the way of a rollback; an agent that does not answer is rare, and undone here).
        answered, recorded = await asyncio.gather(
            standby.channel.ping(timeout=LIVENESS_TIMEOUT),
            self.core.state.update(sb.id, runtime=standby.runtime),
            return_exceptions=True,
        )
        if isinstance(recorded, BaseException) or isinstance(answered, BaseException):
            await asyncio.shield(tier.destroy(standby))
            if isinstance(recorded, BaseException):
                raise recorded
            log.info("sandbox %s: its standby's agent did not answer (%r): restoring instead", sb.id, answered)
            if old is None:  # (else the restore's own record comes first)
                await self._record_rolling_back(sb, rec)
            return None
        log.debug("sandbox %s: standby promoted in %.1f ms", sb.id, (time.perf_counter() - t0) * 1000)
        return standby

    # -- the end of a sandbox, a restart ---------------------------------------------------------------

    def _stopped(self, sb: Sandbox) -> None:
        if self.of.pop(sb.id, None) is not None or (self.root / sb.id).exists():
            remove = asyncio.to_thread(shutil.rmtree, self.root / sb.id, True)
            with contextlib.suppress(UnavailableError):  # shutting down: the next start's `recover` removes them
                self.core.spawn(remove, name=f"checkpoints-{sb.id}")

    async def recover(self) -> None:
        """Keep the checkpoints of the sandboxes this daemon runs again; remove the rest."""
        await asyncio.to_thread(self.root.mkdir, 0o700, True, True)
        await asyncio.to_thread(os.chmod, self.root, 0o700)  # they hold sandboxes' memory and files
        for folder in await asyncio.to_thread(lambda: sorted(self.root.iterdir())):
            sb = self.core.table.find(folder.name)
            if sb is None or sb.live is None:
                await asyncio.to_thread(shutil.rmtree, folder, True)
                continue
            recs = await asyncio.to_thread(_load_all, folder)
            self.of[sb.id] = sorted(recs, key=lambda r: r.info.created_at)


def _load_all(folder: Path) -> builtins.list[CheckpointRecord]:
    out = []
    for path in folder.iterdir():
        try:
            raw = json.loads((path / "checkpoint.json").read_text())
            out.append(CheckpointRecord(CheckpointInfo.model_validate(raw["info"]), path, dict(raw["meta"])))
        except (OSError, ValueError, KeyError, TypeError, ValidationError):
            log.warning("checkpoint %s is unreadable: removing it", path)
            shutil.rmtree(path, True)
    return out


async def _together(*steps: Awaitable[None]) -> None:
    """Run the steps at once, each to its end (none is cancelled by another's failure); then raise
    the first failure, if any."""
    for outcome in await asyncio.gather(*steps, return_exceptions=True):
        if isinstance(outcome, BaseException):
            raise outcome
