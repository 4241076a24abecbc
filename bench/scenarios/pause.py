"""Pause: how fast a sandbox's memory leaves it, and transparent resume."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from common import Daemon, cgroup_dirs


def _zram_used() -> int:
    """Bytes of memory all zram devices use (compressed data + metadata): what swapped pages cost."""
    total = 0
    for dev in Path("/sys/block").glob("zram*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((dev / "mm_stat").read_text().split()[2])
    return total


def bench_pause(fleet: Any, daemon: Daemon, n: int, labels: dict[str, str]) -> dict[str, Any]:
    """A sandbox holding 200 MiB of anonymous memory: pause (freeze + push out), then resume by exec."""
    from sandfleet import Resources

    hold = 'awk \'BEGIN { s = sprintf("%209715200s", ""); system("sleep 1000") }\''
    rows = []
    for _ in range(n):
        sb = fleet.create(image="busybox", labels=labels, resources=Resources(memory="512MiB"))
        try:
            mem = next(d for d in cgroup_dirs(daemon.cgroup_parent) if d.parent.name == "memory") / sb.id
            sb.start(hold)
            deadline = time.time() + 30
            while int((mem / "memory.usage_in_bytes").read_text()) < 200 * 1024**2 and time.time() < deadline:
                time.sleep(0.05)
            before = int((mem / "memory.usage_in_bytes").read_text())
            zram0 = _zram_used()
            t = time.perf_counter()
            sb.pause()
            pause_s = time.perf_counter() - t
            after = int((mem / "memory.usage_in_bytes").read_text())
            zram1 = _zram_used()
            t = time.perf_counter()
            r = sb.exec("true")
            resume_ms = (time.perf_counter() - t) * 1000
            if r.exit_code != 0:
                raise RuntimeError(f"exec after pause failed: {r}")
            rows.append((before, after, pause_s, resume_ms, zram1 - zram0))
        finally:
            sb.stop()

    def med(i: int) -> float:
        return sorted(r[i] for r in rows)[len(rows) // 2]

    return {
        "n": n,
        "memory_before_mib": round(med(0) / 1024**2, 1),
        "memory_after_mib": round(med(1) / 1024**2, 2),
        "fraction_pushed_out": round(1 - med(1) / med(0), 4),
        "pause_s": round(med(2), 3),
        "pause_s_max": round(max(r[2] for r in rows), 3),
        "resume_to_first_exec_ms": round(med(3), 2),
        "resume_to_first_exec_ms_max": round(max(r[3] for r in rows), 2),
        "zram_growth_mib": round(med(4) / 1024**2, 2),
        "swap": Path("/proc/swaps").read_text().splitlines()[1:],
    }
