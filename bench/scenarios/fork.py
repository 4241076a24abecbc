"""Fork: children of a live sandbox, and what their memory costs with and without KSM."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from common import mem_available_kib, settle

KSM = Path("/sys/kernel/mm/ksm")


def _ksm(name: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((KSM / name).read_text())
    return 0


def _ksm_settle(limit: float) -> float:
    """Seconds until ksmd has stopped finding new pages to share (or `limit`)."""
    t0 = time.monotonic()
    last, still = _ksm("pages_sharing"), 0.0
    while time.monotonic() - t0 < limit:
        time.sleep(1.0)
        now = _ksm("pages_sharing")
        still = still + 1.0 if now - last < 256 else 0.0  # < 1 MiB more in a second
        last = now
        if still >= 3 and _ksm("full_scans") > 0:
            break
    return round(time.monotonic() - t0, 1)


def bench_fork(fleet: Any, n: int, children: int, labels: dict[str, str]) -> dict[str, Any]:
    """Fork `children` sandboxes from one live sandbox (a counter running, a few files written):
    seconds from the fork call until every child is exec-ready, and until each has run one exec
    that reads the counter it inherited."""
    from sandfleet import SandboxError

    counter = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.01; done"
    rows = []
    for _ in range(n):
        parent = fleet.create(image="busybox", labels=labels)
        kids: list[Any] = []
        try:
            parent.exec("mkdir -p /task && seq 1 1000 > /task/data && echo setup > /task/state")
            parent.start(counter)
            time.sleep(0.3)
            t = time.perf_counter()
            kids = parent.fork(children, labels=labels)
            fork_s = time.perf_counter() - t
            failed = [k for k in kids if isinstance(k, SandboxError)]
            if failed:
                raise RuntimeError(f"{len(failed)} of {children} forks failed: {failed[0]}")
            # Empty when the snapshot caught the shell between truncating and writing the file.
            counts = [int(k.exec("cat /tmp/count").stdout.strip() or 0) for k in kids]
            all_s = time.perf_counter() - t
            snaps = [e for e in parent.events() if e.kind == "snapshot"]
            rows.append((fork_s, all_s, snaps[-1].data["seconds"] if snaps else 0.0, min(counts)))
        finally:
            for k in kids:
                if not isinstance(k, SandboxError):
                    k.stop()
            parent.stop()

    def med(i: int) -> float:
        return sorted(r[i] for r in rows)[len(rows) // 2]

    return {
        "n": n,
        "children": children,
        "fork_s": round(med(0), 3),
        "fork_s_max": round(max(r[0] for r in rows), 3),
        "fork_and_one_exec_each_s": round(med(1), 3),
        "snapshot_s": round(med(2), 3),
        "min_inherited_count": min(r[3] for r in rows),
    }


def bench_fork_memory(fleet: Any, children: int, mib: int, labels: dict[str, str]) -> dict[str, Any]:
    """A parent holding `mib` MiB of random bytes (identical in every child, unlike in other
    sandboxes), forked `children` times: host memory the children take, with the kernel's
    same-page merging (the daemon's default) and, side by side in the same run, without it
    (ksmd stopped, its merged pages split again)."""
    from sandfleet import SandboxError

    hold = f"import os, time; d = os.urandom({mib} << 20); time.sleep(10**6)"
    out: dict[str, Any] = {"children": children, "parent_mib": mib}
    saved_run = (KSM / "run").read_text().strip() if KSM.exists() else "0"
    try:
        for mode in ("ksm", "no_ksm"):
            if KSM.exists():
                (KSM / "run").write_text("1" if mode == "ksm" else "2")
            parent = fleet.create(image="python:3.11", resources={"memory": f"{mib * 2}MiB"}, labels=labels)
            kids: list[Any] = []
            try:
                parent.start(["python3", "-c", hold])
                wait = time.monotonic() + 60
                while parent.usage().memory_bytes < mib << 20 and time.monotonic() < wait:
                    time.sleep(0.2)
                parent_bytes = parent.usage().memory_bytes
                settle(2)
                before = mem_available_kib()
                t = time.perf_counter()
                kids = parent.fork(children, labels=labels)
                fork_s = time.perf_counter() - t
                failed = [k for k in kids if isinstance(k, SandboxError)]
                if failed:
                    raise RuntimeError(f"{len(failed)} of {children} forks failed: {failed[0]}")
                right_after = mem_available_kib()
                settle_s = _ksm_settle(120) if mode == "ksm" else 0.0
                after = mem_available_kib()
                out[mode] = {
                    "fork_s": round(fork_s, 3),
                    "parent_mib": round(parent_bytes / 2**20, 1),
                    "children_mib_right_after_fork": round((before - right_after) / 1024, 1),
                    "children_mib": round((before - after) / 1024, 1),
                    "per_child_mib": round((before - after) / 1024 / children, 1),
                    "ksm_settle_s": settle_s,
                    "ksm_pages_sharing": _ksm("pages_sharing"),
                }
            finally:
                for k in kids:
                    if not isinstance(k, SandboxError):
                        k.stop()
                parent.stop()
    finally:
        if KSM.exists():
            (KSM / "run").write_text(saved_run if saved_run != "2" else "1")
    if "ksm" in out and "no_ksm" in out and out["ksm"]["children_mib"] > 0:
        out["memory_ratio_no_ksm_over_ksm"] = round(out["no_ksm"]["children_mib"] / out["ksm"]["children_mib"], 2)
        out["children_over_parent_ksm"] = round(out["ksm"]["children_mib"] / max(1.0, out["ksm"]["parent_mib"]), 2)
    return out


def bench_branch_fork(fleet: Any, children: int, hold_mib: int, labels: dict[str, str]) -> dict[str, Any]:
    """B3 and B4: a fork of `children` from the issue's parent (`make_parent`: python:3.11 with a
    session, a background process holding `hold_mib` MiB of random bytes and a repo). B3: the fork
    call until every child is exec-ready (the call returns once each child's agent answered), then
    one exec in each. B4: the host memory the children take right after the fork, with ksmd stopped
    (no merging yet), against the parent's: the sum of the children's memory cgroups and the drop
    of MemAvailable."""
    from sandfleet import SandboxError
    from scenarios.checkpoint import make_parent

    saved_run = (KSM / "run").read_text().strip() if KSM.exists() else "0"
    parent, _shell, _bg = make_parent(fleet, "python:3.11", labels, hold_mib)
    kids: list[Any] = []
    try:
        if KSM.exists():
            (KSM / "run").write_text("0")  # stopped, merged pages kept: nothing merges meanwhile
        parent_bytes = parent.usage().memory_bytes
        settle(2)
        before = mem_available_kib()
        t = time.perf_counter()
        kids = parent.fork(children, labels=labels)
        fork_s = time.perf_counter() - t
        failed = [k for k in kids if isinstance(k, SandboxError)]
        if failed:
            raise RuntimeError(f"{len(failed)} of {children} forks failed: {failed[0]}")
        for k in kids:
            k.exec("true")
        one_exec_s = time.perf_counter() - t
        children_bytes = sum(k.usage().memory_bytes for k in kids)
        after = mem_available_kib()
        snaps = [e for e in parent.events() if e.kind == "snapshot"]
        snapshot_s = snaps[-1].data["seconds"] if snaps else 0.0
        return {
            "children": children,
            "hold_mib": hold_mib,
            "fork_ms": round(fork_s * 1000, 1),
            "fork_and_one_exec_each_ms": round(one_exec_s * 1000, 1),
            "snapshot_ms": round(snapshot_s * 1000, 1),
            "restores_ms": round((fork_s - snapshot_s) * 1000, 1),
            "parent_mib": round(parent_bytes / 2**20, 1),
            "children_cgroups_mib": round(children_bytes / 2**20, 1),
            "children_mem_available_drop_mib": round((before - after) / 1024, 1),
            "children_over_parent": round(children_bytes / max(1, parent_bytes), 2),
        }
    finally:
        for k in kids:
            if not isinstance(k, SandboxError):
                with contextlib.suppress(Exception):
                    k.stop()
        with contextlib.suppress(Exception):
            parent.stop()
        if KSM.exists():
            (KSM / "run").write_text(saved_run if saved_run != "2" else "1")
