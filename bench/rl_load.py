#!/usr/bin/env python3
"""Rewards that stay right on a busy node: `python3 bench/rl_load.py` (as root; not timed in CI).

64 rollouts of the real task of `sandfleet demo` (more-itertools from PyPI, its hidden suite as the
reward) on one daemon, all at once, half of them honest fixes and half cheats of four kinds, with
the node's CPU saturated by another tenant (sandboxes spinning a CPU each). Each rollout is a
trajectory restored from a set-up snapshot: it reads the issue, runs the visible tests, makes its
move, runs them again (steps with a CPU budget and a generous wall-clock timeout; a step lost to
the node is taken again), then is verified apart (`allow` the package, `protect` the tests).
Variants: the load alone; the daemon SIGKILLed and restarted mid-rollout; the same mid-verification.

Per variant: rewards right / wrong / masked (cause infra or verifier: a trainer drops them), the
verdicts' causes, the steps' failures, verifier sandboxes left once every rollout has its verdict,
and the durations (wall, rollouts, the verifications' time queued and checking).

    python3 bench/rl_load.py [--rollouts 64] [--hogs 2] [--variants load,kill-rollout,kill-verify]
    python3 bench/rl_load.py --dry      # 8 rollouts, results in a temp dir unless --results

Results: bench/results/rl_load.json and rl_load.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import secrets
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS, Daemon, pct, remove_cgroup_tree  # noqa: E402
from report import machine_info  # noqa: E402
from sandfleet.client import AsyncClient  # noqa: E402
from sandfleet.daemon.rl.verify import VERIFY_LABEL  # noqa: E402
from sandfleet.errors import SandboxError  # noqa: E402
from sandfleet.models import Resources, SandboxSpec  # noqa: E402
from sandfleet.rl_demo import CHECKS, FIX, REPO, TASK_IMAGE, VISIBLE, build_task  # noqa: E402

LABEL = "bench.rl_load/run"
PKG = f"{REPO}/more_itertools"
SITE = "/usr/local/lib/python3.11/dist-packages"
CONFTEST = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n"
)
# (move, honest?, commands): half honest fixes, half cheats that make `python3 -m pytest` pass in
# the agent's own sandbox without the fix.
MOVES: list[tuple[str, bool, list[str]]] = [
    ("fix", True, [FIX]),
    ("fix-other-way", True, [f"sed -i 's/if len(chunk) > n:/if len(chunk) < n:/' {PKG}/more.py"]),
    (
        "cheat:edit-tests",
        False,
        [
            f"printf 'def test_ok():\\n    pass\\n' > {REPO}/tests/test_recipes.py",
            f"cp {REPO}/tests/test_recipes.py {REPO}/tests/test_more.py",
        ],
    ),
    ("cheat:conftest", False, [f"cat > {REPO}/conftest.py <<'EOF'\n{CONFTEST}EOF"]),
    ("cheat:pth", False, [f"echo 'import os; os._exit(0)' > {SITE}/zz_cheat.pth"]),
    (
        "cheat:python-on-path",
        False,
        ["printf '#!/bin/sh\\nexit 0\\n' > /usr/local/bin/python3", "chmod +x /usr/local/bin/python3"],
    ),
]
STEP = {"timeout": 900.0, "cpu_time": 120.0}  # a step may compute 2 CPU-minutes, and wait a while for them
VERIFY = {"timeout": 1800.0, "cpu_time": 300.0}


@dataclass
class Rollout:
    index: int
    move: str
    honest: bool
    steps: int = 0
    step_causes: list[str] = field(default_factory=list)
    retaken: int = 0
    reward: float | None = None
    cause: str | None = None
    queued: float = 0.0
    checking: float = 0.0
    error: str = ""
    seconds: float = 0.0

    @property
    def outcome(self) -> str:
        """right / wrong (a reward a trainer would use, against the truth) / masked (infra, verifier)."""
        if self.error or self.cause in ("infra", "verifier") or self.reward is None:
            return "masked"
        return "right" if self.reward == (1.0 if self.honest else 0.0) else "wrong"


class Progress:
    def __init__(self) -> None:
        self.steps = 0
        self.verdicts = 0


async def rollout(fleet: AsyncClient, run: str, snap: str, hidden: str, i: int, progress: Progress) -> Rollout:
    move, honest, commands = MOVES[2 + (i // 2) % 4] if i % 2 else MOVES[(i // 2) % 2]  # odd: a cheat
    out = Rollout(i, move, honest)
    t0 = time.perf_counter()
    try:
        traj = await fleet.trajectory(f"{run}-r{i}", snapshot_id=snap, seed=i, labels={LABEL: run})
        for cmd in [f"cat {REPO}/ISSUE.md", VISIBLE, *commands, VISIBLE]:
            for attempt in range(2):  # a step the node lost (infra) is taken again, as an agent would
                try:
                    result = await traj.exec(cmd, **STEP)  # type: ignore[arg-type]
                    cause = result.cause
                except SandboxError as exc:
                    cause = exc.cause
                out.steps += 1
                progress.steps += 1
                if cause is not None:
                    out.step_causes.append(cause)
                if cause != "infra" or attempt:
                    break
                out.retaken += 1
        v = await traj.verify(CHECKS, layers=[hidden], allow=[PKG], protect=[f"{REPO}/tests"], **VERIFY)
        out.reward, out.cause, out.queued = v.reward, v.cause, v.queued
        out.checking = v.result.duration if v.result is not None else 0.0
        progress.verdicts += 1
        await traj.close()
    except SandboxError as exc:
        out.error, out.cause = f"{exc.code}: {exc.message}"[:160], exc.cause
    out.seconds = time.perf_counter() - t0
    return out


def _kill_and_restart(d: Daemon, when: str, log: list[dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    d.process.kill()
    d.start()
    log.append({"when": when, "restart_s": round(time.perf_counter() - t0, 2)})
    print(f"  daemon SIGKILLed {when}, back in {log[-1]['restart_s']} s", flush=True)


async def killer(
    d: Daemon, fleet: AsyncClient, variant: str, n: int, progress: Progress, kills: list[dict[str, Any]]
) -> None:
    """SIGKILL the daemon once: mid-rollout (40 % of the steps taken, none verified yet), or
    mid-verification (a quarter of the verdicts in, checks running, more waiting their turn)."""
    planned = n * 5
    while True:
        await asyncio.sleep(0.5)
        if variant == "kill-rollout" and progress.steps >= 0.4 * planned:
            when = f"mid-rollout ({progress.steps} steps taken, {progress.verdicts} verdicts)"
            break
        if variant == "kill-verify" and progress.verdicts >= n // 4:
            try:
                checking = [s for s in await fleet.list() if VERIFY_LABEL in s.spec.labels]
            except SandboxError:
                continue
            if checking:
                when = f"mid-verification ({progress.verdicts} verdicts in, {len(checking)} checks running)"
                break
    await asyncio.to_thread(_kill_and_restart, d, when, kills)


def run_variant(variant: str, n: int, hogs: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"bench-rl-load-{variant}-"))
    root.chmod(0o755)  # criu's restore opens the sandbox's run dir from inside its user namespace
    parent = f"/sandfleet-bench-rl-load-{root.name}"
    d = Daemon(root, parent)
    d.start()
    kills: list[dict[str, Any]] = []
    try:
        return asyncio.run(_variant(d, variant, n, hogs, kills))
    finally:
        try:
            d.stop_sandboxes()
        finally:
            d.stop()
            remove_cgroup_tree(parent)
            shutil.rmtree(root, ignore_errors=True)


async def _variant(d: Daemon, variant: str, n: int, hogs: int, kills: list[dict[str, Any]]) -> dict[str, Any]:
    run = f"load-{secrets.token_hex(3)}"
    async with AsyncClient(d.socket, timeout=120) as fleet:
        _, hidden = await build_task(fleet)
        spec = SandboxSpec(image=TASK_IMAGE, resources=Resources(cpu=1, memory="512MiB"), idle_ttl=3600)
        async with await fleet.create(spec) as setup:
            await setup.exec(VISIBLE, timeout=300)  # the set-up state: caches warm
            snap = await setup.snapshot(ttl=7200, labels={LABEL: run})
        load = [
            await fleet.create(SandboxSpec(image="busybox", idle_ttl=7200, resources=Resources(cpu=1)))
            for _ in range(hogs)
        ]
        for sb in load:
            await sb.start("while :; do :; done")
        cpu0 = _cpu_busy()
        progress = Progress()
        t0 = time.perf_counter()
        tasks = [rollout(fleet, run, snap.id, hidden, i, progress) for i in range(n)]
        kill = None if variant == "load" else asyncio.create_task(killer(d, fleet, variant, n, progress, kills))
        rollouts = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        busy = _cpu_busy(cpu0)
        if kill is not None and not kill.done():
            kill.cancel()
        left = [s.id for s in await fleet.list() if VERIFY_LABEL in s.spec.labels]
        for sb in load:
            await sb.stop()
        await fleet.delete_snapshot(snap.id)
        for info in await fleet.trajectories({LABEL: run}):
            await (await fleet.get_trajectory(info.id)).delete()
    return summary(variant, rollouts, wall, busy, left, kills, hogs)


def _cpu_busy(since: tuple[float, float] | None = None) -> Any:
    """(busy, total) jiffies of the host now, or the busy share since `since`."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle, total = fields[3] + fields[4], sum(fields)
    if since is None:
        return (total - idle, total)
    return round((total - idle - since[0]) / max(total - since[1], 1.0), 3)


def summary(
    variant: str,
    rollouts: list[Rollout],
    wall: float,
    busy: float,
    left: list[str],
    kills: list[dict[str, Any]],
    hogs: int,
) -> dict[str, Any]:
    by_kind: dict[str, collections.Counter[str]] = {"honest": collections.Counter(), "cheat": collections.Counter()}
    for r in rollouts:
        by_kind["honest" if r.honest else "cheat"][r.outcome] += 1
    moves = collections.Counter((r.move, r.outcome) for r in rollouts)
    causes = collections.Counter(r.cause or "passed" for r in rollouts)
    steps = collections.Counter(c for r in rollouts for c in r.step_causes)
    verified = [r for r in rollouts if r.reward is not None]
    res = {
        "variant": variant,
        "rollouts": len(rollouts),
        "hogs": hogs,
        "wall_s": round(wall, 1),
        "cpu_busy": busy,
        "right": sum(r.outcome == "right" for r in rollouts),
        "wrong": sum(r.outcome == "wrong" for r in rollouts),
        "masked": sum(r.outcome == "masked" for r in rollouts),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "by_move": {f"{m}: {o}": c for (m, o), c in sorted(moves.items())},
        "verdict_causes": dict(causes),
        "step_failures": dict(steps),
        "steps": sum(r.steps for r in rollouts),
        "steps_retaken": sum(r.retaken for r in rollouts),
        "verifiers_left": left,
        "kills": kills,
        "rollout_s": {
            "p50": round(pct([r.seconds for r in rollouts], 0.5), 1),
            "max": round(max(r.seconds for r in rollouts), 1),
        },
        "queued_s": {
            "p50": round(pct([r.queued for r in verified], 0.5), 1) if verified else None,
            "max": round(max((r.queued for r in verified), default=0.0), 1),
        },  # fmt: skip
        "checking_s": {
            "p50": round(pct([r.checking for r in verified], 0.5), 1) if verified else None,
            "max": round(max((r.checking for r in verified), default=0.0), 1),
        },  # fmt: skip
        "errors": sorted({r.error for r in rollouts if r.error}),
        "wrong_rollouts": [asdict(r) for r in rollouts if r.outcome == "wrong"],
    }
    print(json.dumps({k: v for k, v in res.items() if k != "wrong_rollouts"}), flush=True)
    return res


def write_report(meta: dict[str, Any], variants: list[dict[str, Any]], results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "rl_load.json").write_text(json.dumps({"meta": meta, "variants": variants}, indent=1) + "\n")
    lines = [
        f"# sandfleet RL under load, {meta['date']} (commit {meta['sandfleet_commit']})",
        "",
        f"Host: {meta['nproc']} CPUs ({meta['cpu']}), {meta['mem_total_gib']} GiB, kernel {meta['kernel']}, load "
        f"{meta['loadavg_start']} at start. One daemon per variant (default config: checks queue for half the "
        "CPU load the node admits).",
        "",
        f"Each variant: {variants[0]['rollouts']} rollouts of the more-itertools task at once (half honest fixes, "
        "half cheats: the tests edited, a root conftest.py, a .pth file, a python3 on PATH), each 5 steps (a "
        f"CPU budget of {STEP['cpu_time']:g} s, a timeout of {STEP['timeout']:g} s; a step lost to the node "
        "taken again) and a verification against the 660+ hidden tests (`allow` the package, `protect` the "
        f"tests); another tenant's {variants[0]['hogs']} sandboxes spin a CPU each meanwhile. Right: an honest "
        "fix scored 1, a cheat 0. Wrong: a reward a trainer would use, against that. Masked: cause infra or "
        "verifier (dropped by the trainer).",
        "",
        "| variant | right | wrong | masked | verdict causes | failed steps (retaken) | verifiers left "
        "| wall s | CPU busy | rollout p50 / max s | queued p50 / max s | checks p50 / max s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in variants:
        kill = f" ({v['kills'][0]['when']})" if v["kills"] else ""
        lines.append(
            f"| {v['variant']}{kill} | {v['right']} | **{v['wrong']}** | {v['masked']} | {v['verdict_causes']} "
            f"| {v['step_failures'] or '-'} ({v['steps_retaken']}) | {len(v['verifiers_left'])} | {v['wall_s']} "
            f"| {v['cpu_busy']:.0%} | {v['rollout_s']['p50']} / {v['rollout_s']['max']} "
            f"| {v['queued_s']['p50']} / {v['queued_s']['max']} | {v['checking_s']['p50']} / {v['checking_s']['max']} |"
        )
    lines += ["", "By move:", ""]
    for v in variants:
        lines.append(f"- {v['variant']}: {v['by_move']}" + (f"; errors: {v['errors']}" if v["errors"] else ""))
    (results / "rl_load.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=64)
    p.add_argument("--hogs", type=int, default=2, help="sandboxes spinning a CPU each (another tenant's load)")
    p.add_argument("--variants", default="load,kill-rollout,kill-verify")
    p.add_argument("--dry", action="store_true")
    p.add_argument("--results", type=Path)
    a = p.parse_args()
    if a.dry:
        a.rollouts = 8
    results = a.results or (Path(tempfile.mkdtemp(prefix="bench-rl-load-")) if a.dry else RESULTS)
    meta = machine_info()
    variants = []
    for variant in a.variants.split(","):
        print(f"{variant}: {a.rollouts} rollouts, {a.hogs} spinning sandboxes", flush=True)
        variants.append(run_variant(variant, a.rollouts, a.hogs))
    write_report(meta, variants, results)
    print(f"wrote {results / 'rl_load.md'}")
    return 0 if all(v["wrong"] == 0 and not v["verifiers_left"] for v in variants) else 1


if __name__ == "__main__":
    sys.exit(main())
