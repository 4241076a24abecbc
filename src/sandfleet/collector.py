"""The cyclic garbage collector's policy for a long-running server that holds many objects: a node's
thousands of sandboxes and open trajectories, a gateway's tables.

CPython runs a full collection, which scans every tracked object, each time the objects that
survived younger collections reach a quarter of those the previous full one left. A node holding
5,000 sandboxes and recording 1,000 trajectories (bench/console.py) had some 660,000 objects: a full
collection took 350 ms and came every 1-2 s, each finding a few hundred objects of garbage, and
every request waited behind it (the idle daemon's slowest health check: 364 ms).

`Collector`: after each full collection the objects that survived it are frozen (`gc.freeze()`: left
out of every later collection), so the next one scans only what is newer than the last freeze: a
pause in proportion to what survived since, not to the heap (2-5 ms in the same run). A frozen
object whose last reference goes is still freed at once (reference counting); only a reference
cycle among frozen objects waits, for a collection of everything (`gc.unfreeze()`, then a full one),
run when the number of frozen objects has grown by `growth` since the last such collection: so such
cycles are at most as many objects as that collection left, and that pause comes once per doubling,
not every few seconds. (CPython 3.11-3.13's collector; 3.14's incremental one needs none of this.)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import time
from typing import Any

log = logging.getLogger(__name__)


class Collector:
    """The policy above, for the process whose event loop is `loop`. A collection's callback (which
    runs inside it, in whatever thread allocated) only notes that a full one ran; the loop looks
    every `tick` seconds and freezes there, between its callbacks, never inside a collection nor
    while another thread is in one."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, growth: float = 2.0, tick: float = 0.5, check_every: float = 30.0
    ) -> None:
        self.loop = loop
        self.growth = growth
        self.tick = tick
        # Counting the frozen objects walks their list (3.6 ms for 700,000): not at every freeze.
        self.check_every = check_every
        self._checked = -math.inf  # when they were last counted (monotonic)
        self.baseline = 0  # objects frozen after the last collection of everything (0: none yet)
        self.collections = 0  # collections of everything run
        self._due = False  # a full collection ran since the last freeze
        self._timer: asyncio.TimerHandle | None = None

    def install(self) -> None:
        gc.callbacks.append(self._after)
        self._timer = self.loop.call_later(self.tick, self._tick)

    def uninstall(self) -> None:
        """Back to CPython's own policy: nothing frozen, nothing scheduled."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._after in gc.callbacks:
            gc.callbacks.remove(self._after)
        gc.unfreeze()

    def _after(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "stop" and info["generation"] == 2:
            self._due = True

    def _tick(self) -> None:
        if self._timer is None:  # uninstalled
            return
        if self._due:
            self.freeze()
        self._timer = self.loop.call_later(self.tick, self._tick)

    def freeze(self) -> None:
        """Freeze what is alive now; first collect everything if the frozen heap has grown by `growth`
        (looked at every `check_every` seconds)."""
        now = time.monotonic()
        frozen = -1
        if now - self._checked >= self.check_every or not self.baseline:
            self._checked, frozen = now, gc.get_freeze_count()
        full = self.baseline > 0 and frozen > self.growth * self.baseline
        if full:
            t0 = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            self.collections += 1
            log.info(
                "collected everything (%d frozen objects, %d garbage) in %.0f ms",
                frozen,
                found,
                (time.perf_counter() - t0) * 1000,
            )
        gc.freeze()
        self._due = False  # (the collection just run included)
        if full or not self.baseline:
            self.baseline = gc.get_freeze_count()
