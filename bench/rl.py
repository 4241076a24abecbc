#!/usr/bin/env python3
"""RL co-design, in one run on one daemon: `python3 bench/rl.py` (as root).

  a) the trajectory log's cost per step: `traj.exec("true")` against `sb.exec("true")` on the same
     sandbox, interleaved, N each (target: <= 1 ms more at p50);
  b) replay after a restart: a trajectory of S steps replayed by a new handle (a restarted trainer)
     with the daemon up, then again right after the daemon was stopped and started (its log read
     from disk on first use): time to the first answer and to the whole replay;
  c) the real task of `sandfleet demo` (more-itertools from PyPI, hidden suite as the reward): G
     groups of 16 rollouts forked from a set-up state, verified apart: rollouts per minute.

    python3 bench/rl.py [--n 500] [--steps 200] [--groups 1]
    python3 bench/rl.py --dry      # small N, results in a temp dir unless --results

Results: bench/results/rl.json and rl.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, Daemon, remove_cgroup_tree, settle, stats  # noqa: E402
from report import machine_info  # noqa: E402
from sandfleet import Client  # noqa: E402
from sandfleet.client import AsyncClient  # noqa: E402
from sandfleet.rl_demo import run_task  # noqa: E402

TARGET_STEP_DELTA_P50_MS = 1.0


def bench_step(fleet: Client, n: int) -> dict[str, Any]:
    with fleet.create(image="busybox", idle_ttl=600, labels={"bench": "rl"}) as sb:
        traj = fleet.trajectory(f"bench-step-{time.time_ns()}", sandbox_id=sb.id)
        for _ in range(20):  # warm both paths
            sb.exec("true")
            traj.exec("true")
        plain: list[float] = []
        logged: list[float] = []
        for _ in range(n):
            t = time.perf_counter()
            sb.exec("true")
            plain.append(time.perf_counter() - t)
            t = time.perf_counter()
            traj.exec("true")
            logged.append(time.perf_counter() - t)
        traj.close(stop_sandbox=False)
        traj.delete()
    p, g = stats(plain), stats(logged)
    return {"n": n, "exec": p, "trajectory_step": g, "delta_p50_ms": round(g["p50_ms"] - p["p50_ms"], 3)}


def bench_replay(d: Daemon, steps: int) -> dict[str, Any]:
    rid = f"bench-replay-{time.time_ns()}"
    with Client(d.socket, timeout=60) as fleet:
        traj = fleet.trajectory(rid, image_spec(), labels={"bench": "rl"})
        for i in range(steps):
            traj.exec(f"echo {i} >> /steps")
        warm = replay(fleet, rid, steps)
    d.stop()
    settle(1)
    t0 = time.perf_counter()
    d.start()
    started = time.perf_counter() - t0
    with Client(d.socket, timeout=60) as fleet:
        cold = replay(fleet, rid, steps)
        t = fleet.get_trajectory(rid)
        assert t.sandbox is not None and t.sandbox.exec("wc -l < /steps").stdout.strip() == str(steps)
        t.close()
        t.delete()
    return {"steps": steps, "daemon_up": warm, "after_restart": {**cold, "daemon_start_s": round(started, 3)}}


def image_spec() -> Any:
    from sandfleet import SandboxSpec

    return SandboxSpec(image="busybox", idle_ttl=600, labels={"bench": "rl"})


def replay(fleet: Client, rid: str, steps: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    traj = fleet.get_trajectory(rid)
    traj.exec("echo 0 >> /steps")
    first = time.perf_counter() - t0
    assert traj.last is not None and traj.last.replayed
    for i in range(1, steps):
        traj.exec(f"echo {i} >> /steps")
    total = time.perf_counter() - t0
    return {"first_answer_ms": round(first * 1000, 2), "total_s": round(total, 3),
            "per_step_ms": round(total * 1000 / steps, 3)}  # fmt: skip


def bench_task(d: Daemon, groups: int) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with AsyncClient(d.socket, timeout=120) as fleet:
            await fleet.build_image("python:3.11")
            report = await run_task(fleet, groups=groups)
        rewards = [r.reward for r in report.rollouts]
        errors = sorted({r.error for r in report.rollouts if r.error})
        if errors:
            print("rollout errors:", errors)
        return {
            "rollouts": len(report.rollouts),
            "groups": groups,
            "wall_s": round(report.wall, 2),
            "rollouts_per_min": round(report.per_minute, 2),
            "setup_snapshot_s": round(report.setup, 2),
            "task_build_s": round(report.build, 2),
            "mean_reward": round(sum(rewards) / len(rewards), 3),
            "outcomes": report.causes(),
            "rollout_p50_s": round(sorted(r.seconds for r in report.rollouts)[len(rewards) // 2], 2),
            "steps": sum(r.steps for r in report.rollouts),
            "errors": errors,
        }

    return asyncio.run(go())


def write_report(res: dict[str, Any], results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "rl.json").write_text(json.dumps(res, indent=1) + "\n")
    m, a, b, c = res["meta"], res["step"], res["replay"], res["task"]
    ok = a["delta_p50_ms"] <= TARGET_STEP_DELTA_P50_MS
    lines = [
        f"# sandfleet RL co-design, {m['date']} (commit {m['sandfleet_commit']})",
        "",
        f"Host: {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, load "
        f"{m['loadavg_start']} at start. "
        "One daemon (default config: the step log is one write(2) per record, no fsync).",
        "",
        f"## a) trajectory log per step ({a['n']} each, interleaved, same sandbox)",
        "",
        "| call | p50 ms | mean ms | p99 ms |",
        "|---|---|---|---|",
        f'| `sb.exec("true")` | {a["exec"]["p50_ms"]} | {a["exec"]["mean_ms"]} | {a["exec"]["p99_ms"]} |',
        f'| `traj.exec("true")` | {a["trajectory_step"]["p50_ms"]} | {a["trajectory_step"]["mean_ms"]} '
        f"| {a['trajectory_step']['p99_ms']} |",
        "",
        f"Overhead p50: **{a['delta_p50_ms']} ms** (target <= {TARGET_STEP_DELTA_P50_MS} ms: "
        f"{'met' if ok else 'NOT met'}).",
        "",
        f"## b) replay of a {b['steps']}-step trajectory by a restarted trainer",
        "",
        "| when | first answer ms | whole replay s | per step ms |",
        "|---|---|---|---|",
        f"| daemon up | {b['daemon_up']['first_answer_ms']} | {b['daemon_up']['total_s']} "
        f"| {b['daemon_up']['per_step_ms']} |",
        f"| daemon just restarted (log read from disk) | {b['after_restart']['first_answer_ms']} "
        f"| {b['after_restart']['total_s']} | {b['after_restart']['per_step_ms']} |",
        "",
        f"(The daemon's own restart took {b['after_restart']['daemon_start_s']} s.)",
        "",
        f"## c) the real task: {c['rollouts']} rollouts ({c['groups']} group(s) of 16)",
        "",
        f"**{c['rollouts_per_min']} rollouts/min** on this machine ({c['wall_s']} s for the rollouts, "
        f"{c['steps']} steps, each rollout verified in a fresh sandbox against 660+ hidden tests; "
        f"rollout p50 {c['rollout_p50_s']} s). Set-up + snapshot {c['setup_snapshot_s']} s; task build "
        f"{c['task_build_s']} s (cached after the first). Mean reward {c['mean_reward']}; outcomes "
        f"{c['outcomes']}.",
        "",
    ]
    (results / "rl.md").write_text("\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--dry", action="store_true")
    p.add_argument("--results", type=Path)
    a = p.parse_args()
    if a.dry:
        a.n, a.steps = 30, 20
    results = a.results or (Path(tempfile.mkdtemp(prefix="bench-rl-")) if a.dry else RESULTS)
    root = Path(tempfile.mkdtemp(prefix="bench-rl-daemon-"))
    root.chmod(0o755)  # criu's restore opens the sandbox's run dir from inside its user namespace
    parent = f"/sandfleet-bench-rl-{root.name}"
    meta = machine_info()  # at the start: its load average is the one the figures ran under
    d = Daemon(root, parent)
    d.start()
    try:
        with Client(d.socket, timeout=60) as fleet:
            step = bench_step(fleet, a.n)
        print("step", json.dumps(step))
        rep = bench_replay(d, a.steps)
        print("replay", json.dumps(rep))
        task = bench_task(d, a.groups)
        print("task", json.dumps(task))
    finally:
        try:
            d.stop_sandboxes()
        finally:
            d.stop()
            remove_cgroup_tree(parent)
    write_report({"meta": meta, "step": step, "replay": rep, "task": task}, results)
    print(f"wrote {results / 'rl.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
