"""The reaper: once a second, TTLs (idle, max lifetime, never claimed), idle pauses, retention of
stopped sandboxes, retries of failed stops, the last-activity flush, snapshot expiry, the image
cache cap, orphan reaping and the CPU accounting admission reads."""

from __future__ import annotations

import asyncio
import contextlib
import time

from sandfleet.daemon.node.core import ACTIVITY_FLUSH, NodeCore, is_busy, log
from sandfleet.daemon.node.image_service import Images
from sandfleet.daemon.node.lifecycle import FAILED, HOLDING_STATES, PAUSED, RUNNING, STOPPED, Sandbox
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.snapshots import Snapshots
from sandfleet.errors import WrongStateError
from sandfleet.runtime import proc as procmod

CACHE_TRIM_INTERVAL = 60.0


def spec_expired(sb: Sandbox, now: float) -> bool:
    return sb.spec.max_lifetime is not None and now - sb.created_at > sb.spec.max_lifetime


class Reaper:
    def __init__(self, core: NodeCore, pauser: Pauser, images: Images, snapshots: Snapshots) -> None:
        self.core = core
        self.pauser = pauser
        self.images = images
        self.snapshots = snapshots
        self._last_trim = time.monotonic()

    async def run(self) -> None:
        last_flush = time.monotonic()
        last_retry = time.monotonic()
        while True:
            await asyncio.sleep(self.core.reaper_interval)
            try:
                last_flush, last_retry = await self._sweep(last_flush, last_retry)
            except Exception:
                log.exception("reaper sweep failed; retrying at the next one")

    async def _sweep(self, last_flush: float, last_retry: float) -> tuple[float, float]:
        """One pass of the reaper: TTLs, retention, stop retries, activity flush, orphan reaping."""
        now = time.time()
        retry_stops = time.monotonic() - last_retry > 10
        if retry_stops:
            last_retry = time.monotonic()
        for sb in self.core.table:
            if sb.stop_failed:
                if retry_stops and sb.stop_task is not None and sb.stop_task.done():
                    self.core.spawn(self.core.stop(sb.id, reason="retry"), name=f"retry-stop-{sb.id}")
                continue
            if sb.state in HOLDING_STATES and not is_busy(sb, now):
                spec = sb.spec
                idle = now - sb.last_active_at
                if not sb.acked and now > sb.claim_by:
                    self.core.spawn(self.core.stop(sb.id, reason="never claimed"), name=f"unclaimed-{sb.id}")
                elif spec.idle_ttl is not None and idle > spec.idle_ttl and not (sb.state == PAUSED and sb.held):
                    self.core.spawn(self.core.stop(sb.id, reason="idle_ttl"), name=f"ttl-{sb.id}")
                elif spec.max_lifetime is not None and now - sb.created_at > spec.max_lifetime:
                    self.core.spawn(self.core.stop(sb.id, reason="max_lifetime"), name=f"ttl-{sb.id}")
                elif sb.state == RUNNING and spec.pause_after is not None and idle > spec.pause_after:
                    self.core.spawn(self._auto_pause(sb.id), name=f"pause-{sb.id}")
            elif sb.state == RUNNING and spec_expired(sb, now):
                self.core.spawn(self.core.stop(sb.id, reason="max_lifetime"), name=f"ttl-{sb.id}")
            elif sb.state in (STOPPED, FAILED) and sb.stopped_at and now - sb.stopped_at > self.core.stopped_retention:
                await self.core.state.delete([sb.id])
                self.core.drop(sb)
        if time.monotonic() - last_flush > ACTIVITY_FLUSH:
            dirty, self.core.dirty_activity = self.core.dirty_activity, {}
            try:
                await self.core.state.touch_many(dirty)
            except BaseException:
                self.core.dirty_activity = dirty | self.core.dirty_activity
                raise
            last_flush = time.monotonic()
        if self.core.pools is not None:
            await self.core.pools.shrink()
        await self.snapshots.expire(now)
        if self.core.store.cache_max is not None and time.monotonic() - self._last_trim > CACHE_TRIM_INTERVAL:
            self._last_trim = time.monotonic()
            await self.images.trim_cache(set())
        procmod.reap_orphans()
        with contextlib.suppress(OSError):
            self.core.observe_cpu()
        return last_flush, last_retry

    async def _auto_pause(self, sandbox_id: str) -> None:
        with contextlib.suppress(WrongStateError):  # a request came in meanwhile
            await self.pauser.pause(sandbox_id, by_policy=True)
