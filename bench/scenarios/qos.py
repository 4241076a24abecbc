"""QoS: exec latency of a latency-sensitive sandbox while best-effort ones hog every core."""

from __future__ import annotations

import os
import time
from typing import Any

from common import _timed, stats


def bench_qos(fleet: Any, n: int, labels: dict[str, str]) -> dict[str, Any]:
    """exec("true") into a latency-sensitive sandbox: unloaded, then with both cores saturated by
    CPU hogs in best-effort sandboxes, then by the same hogs without QoS (latency-sensitive too)."""
    from sandfleet import Resources

    ncpu = os.cpu_count() or 2
    hog = " & ".join(["while :; do :; done"] * 2) + " & wait"
    probe = fleet.create(image="busybox", labels=labels)

    def measure() -> dict[str, Any]:
        for _ in range(10):
            probe.exec("true")
        return stats([_timed(lambda: probe.exec("true")) for _ in range(n)])

    def loaded(qos: str) -> dict[str, Any]:
        hogs = [
            fleet.create(image="busybox", labels=labels, qos=qos, resources=Resources(cpu=2)) for _ in range(4 * ncpu)
        ]
        try:
            for h in hogs:
                h.start(hog)
            time.sleep(1)
            return measure()
        finally:
            for h in hogs:
                h.stop()

    try:
        unloaded = measure()
        with_qos = loaded("best_effort")
        without_qos = loaded("latency_sensitive")
    finally:
        probe.stop()
    return {
        "hogs": f"{4 * ncpu} sandboxes x 2 busy loops (cpu limit 2 each)",
        "unloaded": unloaded,
        "hogs_best_effort": with_qos,
        "hogs_latency_sensitive": without_qos,
        "ratio_p50_with_qos": round(with_qos["p50_ms"] / unloaded["p50_ms"], 2),
        "ratio_p50_without_qos": round(without_qos["p50_ms"] / unloaded["p50_ms"], 2),
    }
