"""The garbage collector's policy (sandfleet/collector.py) with CPython's own collector: what survives
a full collection is frozen, so later ones scan only newer objects; a reference cycle among frozen
objects is still collected, once the frozen heap has grown by the policy's factor."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from sandfleet.collector import Collector

pytestmark = pytest.mark.unit
TICK = 0.02 * 1.5  # (the collector's tick, and a half): the loop has looked for a full collection since


class Cycle:
    """An object only a reference cycle keeps: reference counting never frees it."""

    def __init__(self) -> None:
        self.me = self


async def test_survivors_are_frozen_and_a_frozen_cycle_is_collected_once_the_heap_grew() -> None:
    collector = Collector(asyncio.get_running_loop(), growth=1.1, tick=0.02, check_every=0)
    collector.install()
    try:
        kept = [[i] for i in range(50_000)]  # long-lived objects, as a node's sandboxes
        cycle = Cycle()
        gone = weakref.ref(cycle)
        gc.collect()  # a full collection: the policy freezes its survivors next, on the loop
        await asyncio.sleep(TICK)
        frozen = gc.get_freeze_count()
        assert frozen >= 50_000 and abs(collector.baseline - frozen) < 1_000
        assert len(gc.get_objects(2)) < 5_000  # what a full collection scans now: newer objects only
        assert kept[-1] == [49_999]

        del cycle  # garbage now, but frozen: collections leave it
        gc.collect()
        await asyncio.sleep(TICK)
        assert gone() is not None and collector.collections == 0

        more = [[i] for i in range(frozen // 5)]  # the frozen heap grows past the factor
        gc.collect()
        await asyncio.sleep(TICK)  # (frozen: the baseline and `more`)
        assert gc.get_freeze_count() > 1.1 * collector.baseline
        gc.collect()
        await asyncio.sleep(TICK)  # a collection of everything, then a freeze again
        assert gone() is None and collector.collections == 1
        assert abs(collector.baseline - gc.get_freeze_count()) < 1_000 and len(more) == frozen // 5
        gc.collect()  # (one more due as it stops: never acted on)
    finally:
        collector.uninstall()
    await asyncio.sleep(TICK)
    assert gc.get_freeze_count() == 0
    assert not any(getattr(cb, "__self__", None) is collector for cb in gc.callbacks)


async def test_a_collection_in_another_thread_freezes_on_the_loop() -> None:
    collector = Collector(asyncio.get_running_loop(), tick=0.02)
    collector.install()
    try:
        await asyncio.to_thread(gc.collect)
        await asyncio.sleep(TICK)
        assert gc.get_freeze_count() > 0 and collector.baseline > 0
    finally:
        collector.uninstall()
