"""Burst and sustained creation through AsyncClient.create_many."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from common import DENSITY_MEMORY, IDLE_CPU_REQUEST
from sandfleet.errors import SandboxError


async def bench_burst(sock: Path, n: int, concurrency: int, labels: dict[str, str]) -> dict[str, Any]:
    """n creates through `create_many` (batched requests), then one exec into each: all exec-ready when?"""
    from sandfleet import AsyncClient, Resources, SandboxSpec

    async with AsyncClient(sock, timeout=600) as fleet:
        spec = SandboxSpec(
            image="busybox", labels=labels, resources=Resources(memory=DENSITY_MEMORY, cpu_request=IDLE_CPU_REQUEST)
        )
        t0 = time.perf_counter()
        results = await fleet.create_many([spec] * n, concurrency=concurrency)
        created_s = time.perf_counter() - t0
        sbs = [r for r in results if not isinstance(r, SandboxError)]
        failed = [r for r in results if isinstance(r, SandboxError)]
        sem = asyncio.Semaphore(32)

        async def first_exec(sb: Any) -> None:
            async with sem:
                r = await sb.exec("true")
                if r.exit_code != 0:
                    raise RuntimeError(f"exec after burst create failed: {r}")

        await asyncio.gather(*(first_exec(sb) for sb in sbs))
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        stop_error = None
        try:
            stopped = await fleet.stop_many(labels)
        except SandboxError as exc:
            stopped, stop_error = [], f"{type(exc).__name__}: {exc}"
        stop_s = time.perf_counter() - t1
    return {
        "sandboxes": n,
        "in_flight": concurrency,
        "failed": len(failed),
        "created_s": round(created_s, 3),
        "creations_per_s": round(n / created_s, 1),
        "all_exec_ready_s": round(elapsed, 3),
        "stop_many_s": round(stop_s, 3),
        "stopped": len(stopped),
        "stop_error": stop_error,
    }
