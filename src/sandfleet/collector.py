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
run when the frozen heap has grown by `growth` since the last such collection: such cycles never
hold more memory than the live heap, and that pause comes once per doubling, not every few seconds.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class Collector:
    """The policy above, for the process whose event loop is `loop` (the freeze runs there, between
    callbacks, never inside a collection)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, growth: float = 2.0) -> None:
        self.loop = loop
        self.growth = growth
        self.baseline = 0  # objects frozen after the last collection of everything (0: none yet)
        self.collections = 0  # collections of everything run
        self._asked = False  # a freeze is scheduled

    def install(self) -> None:
        gc.callbacks.append(self._after)

    def uninstall(self) -> None:
        """Back to CPython's own policy: nothing frozen."""
        if self._after in gc.callbacks:
            gc.callbacks.remove(self._after)
        gc.unfreeze()

    def _after(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collection, in whatever thread allocated: only schedule the freeze.
        if phase != "stop" or info["generation"] != 2 or self._asked or self.loop.is_closed():
            return
        self._asked = True
        try:
            self.loop.call_soon_threadsafe(self.freeze)
        except RuntimeError:  # the loop closed meanwhile
            self._asked = False

    def freeze(self) -> None:
        """Freeze what is alive now; first collect everything if the frozen heap has grown by `growth`."""
        self._asked = False
        frozen = gc.get_freeze_count()
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
        if full or not self.baseline:
            self.baseline = gc.get_freeze_count()
