"""Pause (freeze + memory reclaim) and resume, and the transparent resume every request does:
`Pauser.ready` hands out a running sandbox, resuming a paused one first; `Pauser.holding` hands one out
with its freezer held, for what freezes it (a snapshot, an export of its writable layer)."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from sandfleet.backends.base import LiveSandbox, Pausable, unsupported
from sandfleet.daemon.node.core import NodeCore, is_busy, log
from sandfleet.daemon.node.lifecycle import PAUSED, RUNNING, Sandbox, stopped_meanwhile
from sandfleet.errors import SandboxError, UnavailableError, WrongStateError
from sandfleet.models import SandboxInfo


class Pauser:
    def __init__(self, core: NodeCore) -> None:
        self.core = core

    def _tier(self, sb: Sandbox, doing: str) -> Pausable:
        if not isinstance(backend := self.core.tier(sb), Pausable):
            raise unsupported(backend, doing)
        return backend

    async def ready(self, sandbox_id: str) -> tuple[Sandbox, LiveSandbox]:
        """The sandbox, running: a paused one is resumed first (any request resumes it)."""
        sb = self.core.sandbox(sandbox_id)
        if not sb.acked:
            self.core.ack_one(sb)
        if sb.state == PAUSED:
            await self._resume(sb, transparent=True)
        return self.running(sandbox_id)

    @contextlib.asynccontextmanager
    async def holding(self, sandbox_id: str) -> AsyncIterator[tuple[Sandbox, LiveSandbox]]:
        """The sandbox, running, its freezer ours until the block ends: a paused one is resumed first,
        and no pause, resume, snapshot or export of it runs meanwhile (a pause between a resume and
        the freeze would make the block fail for nothing)."""
        sb = self.core.sandbox(sandbox_id)
        if not sb.acked:
            self.core.ack_one(sb)
        async with sb.freeze_lock:
            if sb.state == PAUSED:
                await self._resume_held(sb, transparent=True)
            yield self.running(sandbox_id)

    def running(self, sandbox_id: str) -> tuple[Sandbox, LiveSandbox]:
        sb = self.core.sandbox(sandbox_id)
        if sb.state == RUNNING and sb.live is None:  # between its old and its new processes
            raise UnavailableError(f"sandbox {sandbox_id} is being rolled back: try again")
        if sb.state != RUNNING or sb.live is None:
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
        return sb, sb.live

    async def pause(self, sandbox_id: str, *, by_policy: bool = False, force: bool = False) -> SandboxInfo:
        """Freeze the sandbox and push its memory out (to swap / dropped page cache). `force`: also
        with requests in flight (a detector's finding: what they run is what must stop)."""
        sb = self.core.sandbox(sandbox_id)
        self._tier(sb, "pause")
        async with sb.freeze_lock:
            if sb.state == PAUSED:
                if not by_policy and not sb.held:
                    sb.held = True
                    await self.core.state.update(sb.id, held=1)
                return sb.info()
            if sb.state != RUNNING or sb.live is None:
                raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
            if not force and is_busy(sb, time.time()):
                raise WrongStateError(f"sandbox {sandbox_id} has {sb.inflight} request(s) in flight")
            t0 = time.perf_counter()
            tier, live = self._tier(sb, "pause"), sb.live
            with stopped_meanwhile(sb, "it was paused"):
                before, after = await tier.pause(live)
            if sb.state != RUNNING:  # stopped meanwhile (a stop does not wait for the freeze lock)
                with contextlib.suppress(Exception):
                    await tier.resume(live)  # its processes, killed, must be able to die
                raise WrongStateError(f"sandbox {sandbox_id} stopped while it was paused")
            self.core.table.move(sb, PAUSED)
            sb.held, sb.memory_seen, sb.cpu_rate = not by_policy, after, 0.0
            await self.core.state.update(sb.id, state=PAUSED, held=int(sb.held))
            seconds = time.perf_counter() - t0
            self.core.journal.record(
                sb.id, "paused", {"memory_before": before, "memory_after": after, "seconds": round(seconds, 4)}
            )
            self.core.metrics.paused.inc()
            return sb.info()

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self.core.sandbox(sandbox_id)
        self.core.table.require(sb, (PAUSED, RUNNING), "resume")
        if sb.state == PAUSED:
            await self._resume(sb, transparent=False)
        return sb.info()

    async def _resume(self, sb: Sandbox, *, transparent: bool) -> None:
        async with sb.freeze_lock:
            await self._resume_held(sb, transparent=transparent)

    async def _resume_held(self, sb: Sandbox, *, transparent: bool) -> None:
        if sb.state != PAUSED or sb.live is None:
            return
        t0 = time.perf_counter()
        with stopped_meanwhile(sb, "it was resumed"):
            await self._tier(sb, "resume").resume(sb.live)
        self.core.table.move(sb, RUNNING)
        sb.held = False
        self.core.touch(sb)
        await self.core.state.update(sb.id, state=RUNNING, held=0)
        seconds = round(time.perf_counter() - t0, 4)
        self.core.journal.record(sb.id, "resumed", {"transparent": transparent, "seconds": seconds})
        self.core.metrics.resumed.labels(transparent=str(transparent).lower()).inc()

    async def pause_many(self, labels: dict[str, str], concurrency: int = 16) -> builtins.list[str]:
        """Pause every running sandbox with these labels (busy ones are skipped); the ids paused."""
        return await self._for_each(self.core.matching(labels, (RUNNING,)), self.pause, concurrency)

    async def resume_many(self, labels: dict[str, str], concurrency: int = 16) -> builtins.list[str]:
        return await self._for_each(self.core.matching(labels, (PAUSED,)), self.resume, concurrency)

    async def _for_each(
        self, sandboxes: builtins.list[Sandbox], op: Callable[[str], Awaitable[SandboxInfo]], concurrency: int
    ) -> builtins.list[str]:
        limit = asyncio.Semaphore(concurrency)
        done: builtins.list[str] = []

        async def one(sb: Sandbox) -> None:
            async with limit:
                try:
                    await op(sb.id)
                    done.append(sb.id)
                except SandboxError as exc:
                    log.info("%s of %s skipped: %s", getattr(op, "__name__", "op"), sb.id, exc)

        async with asyncio.TaskGroup() as tg:
            for sb in sandboxes:
                tg.create_task(one(sb))
        return done
