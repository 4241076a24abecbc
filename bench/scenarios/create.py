"""Create-to-first-exec: cold creates, and from a warm pool (spaced and in groups)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common import POOL_MEMORY, POOL_SIZE, daemon_metrics, metrics_delta, stats


def bench_create(
    fleet: Any, n: int, labels: dict[str, str], sock: Path, *, memory: str | None = None, pause: float = 0.0
) -> dict[str, Any]:
    """Create + first exec, N times. `memory` picks the shape (the warm pool's, for pooled runs);
    `pause` between cycles lets a pool refill (an arrival rate below its refill capacity)."""
    create, first, total, stop = [], [], [], []
    shape = {"resources": {"memory": memory}} if memory else {}
    for _ in range(3):  # warm-up: image resolved, layers mounted, connection open
        with fleet.create(image="busybox", labels=labels, **shape) as sb:
            sb.exec("true")
    m0 = daemon_metrics(sock)
    for _ in range(n):
        time.sleep(pause)
        t0 = time.perf_counter()
        sb = fleet.create(image="busybox", labels=labels, **shape)
        t1 = time.perf_counter()
        r = sb.exec("true")
        t2 = time.perf_counter()
        if r.exit_code != 0:
            raise RuntimeError(f"exec true failed: {r}")
        sb.stop()
        t3 = time.perf_counter()
        create.append(t1 - t0)
        first.append(t2 - t1)
        total.append(t2 - t0)
        stop.append(t3 - t2)
    m1 = daemon_metrics(sock)
    return {
        "create_plus_first_exec": stats(total),
        "create": stats(create),
        "first_exec": stats(first),
        "stop_not_in_cycle": stats(stop),
        "daemon_side_create_mean_ms": metrics_delta(m0, m1, "create"),
        "daemon_side_exec_mean_ms": metrics_delta(m0, m1, "exec"),
    }


def bench_pooled_groups(fleet: Any, groups: int, labels: dict[str, str]) -> dict[str, Any]:
    """A trainer starting a group of rollouts: POOL_SIZE creates back to back from a full warm pool,
    each followed by its first exec; the group is stopped and the pool refills before the next."""
    from sandfleet import Resources

    create, total = [], []
    for _ in range(groups):
        time.sleep(3)  # the pool refills
        sbs = []
        for _ in range(POOL_SIZE):
            t0 = time.perf_counter()
            sb = fleet.create(image="busybox", labels=labels, resources=Resources(memory=POOL_MEMORY))
            t1 = time.perf_counter()
            if sb.exec("true").exit_code != 0:
                raise RuntimeError("exec true failed")
            create.append(t1 - t0)
            total.append(time.perf_counter() - t0)
            sbs.append(sb)
        for sb in sbs:
            sb.stop()
    return {"group": POOL_SIZE, "groups": groups, "create_plus_first_exec": stats(total), "create": stats(create)}
