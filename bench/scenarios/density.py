"""Density: N idle sandboxes (memory, daemon RSS and CPU, exec latency into random ones)."""

from __future__ import annotations

import os
import random
import time
from typing import Any

from common import (
    DENSITY_MEMORY,
    IDLE_CPU_REQUEST,
    Daemon,
    cgroup_dirs,
    cgroup_tree_pids,
    cpu_ticks,
    mem_available_kib,
    pss_kib,
    read_status,
    rss_kib,
    settle,
    stats,
    stop_labelled,
)
from sandfleet.errors import SandboxError


def bench_density(fleet: Any, daemon: Daemon, n: int, n_exec: int, labels: dict[str, str]) -> dict[str, Any]:
    pid = daemon.pid
    before_pids = set(cgroup_tree_pids(daemon.cgroup_parent))
    settle(2)
    rss0 = rss_kib(pid)
    avail0 = mem_available_kib()
    fds0 = len(os.listdir(f"/proc/{pid}/fd"))
    threads0 = int(read_status(pid).get("Threads", "0"))
    from sandfleet import Resources, SandboxSpec

    spec = SandboxSpec(
        image="busybox", labels=labels, resources=Resources(memory=DENSITY_MEMORY, cpu_request=IDLE_CPU_REQUEST)
    )
    t0 = time.perf_counter()
    results = fleet.create_many([spec] * n, concurrency=32)
    create_all_s = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, SandboxError)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} density creates failed, e.g. {failed[0]!r}")
    sbs = [r for r in results if not isinstance(r, SandboxError)]
    settle(3)
    rss1 = rss_kib(pid)
    avail1 = mem_available_kib()
    fds1 = len(os.listdir(f"/proc/{pid}/fd"))
    threads1 = int(read_status(pid).get("Threads", "0"))
    # the sandboxes' processes: our daemon's cgroup tree only (other daemons may run on this host)
    pids = [p for p in cgroup_tree_pids(daemon.cgroup_parent) if p not in before_pids]
    pss = pss_kib(pids)
    cg_mem = None
    for d in cgroup_dirs(daemon.cgroup_parent):
        if d.parent.name == "memory" and (d / "memory.usage_in_bytes").exists():
            cg_mem = int((d / "memory.usage_in_bytes").read_text()) // 1024

    # daemon CPU while the sandboxes idle
    hz = os.sysconf("SC_CLK_TCK")
    c0 = cpu_ticks(pid)
    a0 = sum(cpu_ticks(p) for p in pids if os.path.exists(f"/proc/{p}"))
    w0 = time.monotonic()
    settle(10)
    c1 = cpu_ticks(pid)
    a1 = sum(cpu_ticks(p) for p in pids if os.path.exists(f"/proc/{p}"))
    wall = time.monotonic() - w0

    rng = random.Random(1234)
    xs = []
    for _ in range(n_exec):
        sb = rng.choice(sbs)
        t = time.perf_counter()
        r = sb.exec("true")
        xs.append(time.perf_counter() - t)
        if r.exit_code != 0:
            raise RuntimeError(f"exec into idle sandbox failed: {r}")
    running = len(fleet.list(labels=labels, state="running"))
    stopped, stop_error, stop_all_s = stop_labelled(daemon, fleet, labels, "density stop_many")
    return {
        "sandboxes": n,
        "running_at_measurement": running,
        "create_all_s": round(create_all_s, 3),
        "daemon_rss_before_mib": round(rss0 / 1024, 1),
        "daemon_rss_after_mib": round(rss1 / 1024, 1),
        "daemon_rss_per_sandbox_kib": round((rss1 - rss0) / n, 1),
        "host_mem_used_per_sandbox_kib": round((avail0 - avail1) / n, 1),
        "host_mem_used_total_mib": round((avail0 - avail1) / 1024, 1),
        "sandbox_processes": len(pids),
        "sandbox_pss_total_mib": round(pss / 1024, 2),
        "sandbox_pss_per_sandbox_kib": round(pss / n, 1),
        "cgroup_memory_usage_total_mib": round(cg_mem / 1024, 1) if cg_mem is not None else None,
        "daemon_fds_before": fds0,
        "daemon_fds_after": fds1,
        "daemon_threads_before": threads0,
        "daemon_threads_after": threads1,
        "daemon_idle_cpu_percent_of_one_core": round((c1 - c0) / hz / wall * 100, 2),
        "sandboxes_idle_cpu_percent_of_one_core": round((a1 - a0) / hz / wall * 100, 2),
        "idle_window_s": round(wall, 2),
        "exec_into_random_idle": stats(xs),
        "stop_all_s": round(stop_all_s, 3),
        "stopped": len(stopped),
        "stop_error": stop_error,
    }
