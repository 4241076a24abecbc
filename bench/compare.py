"""This tree against earlier commits, side by side in one run: each side its own daemon (started
from its own source tree), all driven by this tree's SDK through the same scenario modules, in
rotating rounds so every side sees the same machine minute by minute.

    python3 bench/compare.py BASE_REV [BASE_REV ...] [--baseline bbfbac3] [--rounds 5]
        [--results bench/results]   (as root)

Besides the revisions named (usually the commit before a change), every run also measures the fixed
baseline (`--baseline`, by default bbfbac3, the one the hot-path issue names; `--baseline ''`: none),
so a regression that creeps in over many changes, each within 10 % of the one before, still shows.

Figures per side (medians over the rounds): create-to-first-exec p50, `exec("true")` p50, a burst
of 128 creates and a sustained run of 400 (creations/s, `create_many`, 32 in flight), pause of a
sandbox holding 200 MiB (seconds) and resume to first exec, fork into 4 children (seconds), and 100
idle sandboxes (daemon RSS and host memory per sandbox, exec p99 into random ones), the files API's
stat and list of 1,000 entries; and, interleaved (one call to each side in turn, every round),
`exec("true")` p50 over 600 calls a side and create-to-first-exec p50 over 40: the figures least
moved by the host's own swings. Writes compare.json (each figure's value in every round) and
compare.md; everything it made is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import REPO, RESULTS, Daemon, remove_cgroup_tree
from report import machine_info
from sandfleet import Client
from scenarios.burst import bench_burst
from scenarios.create import bench_create
from scenarios.density import bench_density
from scenarios.exec import bench_exec
from scenarios.files import bench_files
from scenarios.fork import bench_fork
from scenarios.pause import bench_pause

# name -> (unit, higher is better, reader of the figure from one round's results)
FIGURES: dict[str, tuple[str, bool, Callable[[dict[str, Any]], float]]] = {
    "create-to-first-exec p50": ("ms", False, lambda r: r["create"]["create_plus_first_exec"]["p50_ms"]),
    'exec("true") p50': ("ms", False, lambda r: r["exec"]['exec("true")']["stats"]["p50_ms"]),
    "burst, 128 creates": ("/s", True, lambda r: r["burst"]["creations_per_s"]),
    "sustained, 400 creates": ("/s", True, lambda r: r["sustained"]["creations_per_s"]),
    "pause of 200 MiB": ("s", False, lambda r: r["pause"]["pause_s"]),
    "resume to first exec": ("ms", False, lambda r: r["pause"]["resume_to_first_exec_ms"]),
    "fork into 4 children": ("s", False, lambda r: r["fork"]["fork_s"]),
    'exec("true") p50, interleaved': ("ms", False, lambda r: r["interleaved"]["exec_p50_ms"]),
    "create-to-first-exec p50, interleaved": ("ms", False, lambda r: r["interleaved"]["create_p50_ms"]),
    "100 idle: daemon RSS": ("MiB", False, lambda r: r["density"]["daemon_rss_after_mib"]),
    "100 idle: host memory per sandbox": ("KiB", False, lambda r: r["density"]["host_mem_used_per_sandbox_kib"]),
    "100 idle: exec p99": ("ms", False, lambda r: r["density"]["exec_into_random_idle"]["p99_ms"]),
    "files: stat p50": ("ms", False, lambda r: r["files"]["stat"]["p50_ms"]),
    "files: list of 1000 p50": ("ms", False, lambda r: r["files"]["list of 1000"]["p50_ms"]),
}


SCENARIOS = ("create", "exec", "burst", "sustained", "pause", "fork", "density", "files", "interleaved")
INTERLEAVED_EXECS, INTERLEAVED_CREATES = 600, 40  # calls per side in each round


def _turns(names: list[str], n: int, seed: int) -> list[str]:
    """n calls to each side, in cycles of one each in a shuffled order: each side comes after every
    other as often (a fixed cycle had a side always follow the slowest, whose daemon was still busy
    with the call before: +3-4 % on its exec)."""
    rng = random.Random(seed)
    turns: list[str] = []
    for _ in range(n):
        cycle = list(names)
        rng.shuffle(cycle)
        turns += cycle
    return turns


def interleaved(sides: dict[str, Daemon], round_: int) -> dict[str, dict[str, float]]:
    """`exec("true")` and create-to-first-exec, one call to each side in turn (`_turns`),
    so the host's swings, which move a side's own rounds by 10-20 % on a busy 2-core machine, fall
    on every side alike; each sandbox stopped untimed."""
    names = list(sides)
    labels = {"bench": "compare-interleaved"}
    clients = {side: Client(d.socket, timeout=300) for side, d in sides.items()}
    execs: dict[str, list[float]] = {side: [] for side in names}
    creates: dict[str, list[float]] = {side: [] for side in names}
    try:
        held = {side: c.create(image="busybox", labels=labels) for side, c in clients.items()}
        for _ in range(50):  # warm-up: connections open, caches filled
            for sb in held.values():
                sb.exec("true")
        for side in _turns(names, INTERLEAVED_EXECS, round_):
            t = time.perf_counter()
            held[side].exec("true")
            execs[side].append(time.perf_counter() - t)
        for side in _turns(names, INTERLEAVED_CREATES, round_):
            t = time.perf_counter()
            sb = clients[side].create(image="busybox", labels=labels)
            sb.exec("true")
            creates[side].append(time.perf_counter() - t)
            sb.stop()
    finally:
        for c in clients.values():
            with contextlib.suppress(Exception):
                c.stop_many(labels)
            c.close()
    ms = {side: (statistics.median(execs[side]) * 1000, statistics.median(creates[side]) * 1000) for side in names}
    return {side: {"exec_p50_ms": e, "create_p50_ms": c} for side, (e, c) in ms.items()}


def one_round(daemon: Daemon, side: str, scenarios: tuple[str, ...]) -> dict[str, Any]:
    labels = {"bench": f"compare-{side}"}
    out: dict[str, Any] = {}
    with Client(daemon.socket, timeout=300) as fleet:
        runs: dict[str, Callable[[], dict[str, Any]]] = {
            "create": lambda: bench_create(fleet, 40, labels, daemon.socket),
            "exec": lambda: bench_exec(fleet, 200, labels, daemon.socket),
            "burst": lambda: asyncio.run(bench_burst(daemon.socket, 128, 32, labels)),
            "sustained": lambda: asyncio.run(bench_burst(daemon.socket, 400, 32, labels)),
            "pause": lambda: bench_pause(fleet, daemon, 3, labels),
            "fork": lambda: bench_fork(fleet, 1, 4, labels),
            "density": lambda: bench_density(fleet, daemon, 100, 100, labels),
            "files": lambda: bench_files(fleet, 200, labels),
        }
        for name in scenarios:
            out[name] = runs[name]()
        fleet.stop_many(labels)
    return out


def _has(read: Callable[[dict[str, Any]], float], result: dict[str, Any]) -> bool:
    try:
        read(result)
    except KeyError:
        return False
    return True


BASELINE = "bbfbac3"  # the fixed baseline of the hot-path work (issue 30): before its first change


def _rev(rev: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", nargs="+", help="the commits to compare with (git revisions of this repository)")
    ap.add_argument("--baseline", default=BASELINE, help="a fixed baseline measured in every run ('': none)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS, help="scenarios to run (default: all)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    bases: list[str] = []
    for rev in [*args.base, *([args.baseline] if args.baseline else [])]:
        if (short := _rev(rev)) not in bases:
            bases.append(short)
    this_rev = _rev("HEAD")
    if subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True, check=True).stdout.strip():  # fmt: skip
        this_rev += " + uncommitted changes"  # "this" runs the working tree
    elif this_rev in bases:
        bases.remove(this_rev)  # HEAD against itself: only when "this" is the working tree
    tmp = Path(tempfile.mkdtemp(prefix="sandfleet-compare-"))
    os.chmod(tmp, 0o755)  # criu, as a sandbox's user-namespace owner, walks down to its sandbox's files
    stamp = f"{os.getpid()}-{int(dt.datetime.now().timestamp())}"
    trees = {rev: tmp / f"tree-{rev}" for rev in bases}
    for rev, tree in trees.items():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)  # fmt: skip
    sides = {rev: Daemon(tmp / rev, f"/sfcompare-{rev}-{stamp}", src=tree / "src") for rev, tree in trees.items()}
    sides["this"] = Daemon(tmp / "this", f"/sfcompare-this-{stamp}", src=REPO / "src")
    names = list(sides)
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in names}
    try:
        for d in sides.values():
            d.start()
        for i in range(args.rounds):
            order = names[i % len(names) :] + names[: i % len(names)]  # each side leads in turn
            for side in order:
                print(f"round {i + 1}/{args.rounds}: {side}", flush=True)
                rounds[side].append(one_round(sides[side], side, tuple(x for x in args.only if x != "interleaved")))
            if "interleaved" in args.only:
                print(f"round {i + 1}/{args.rounds}: every side in turn", flush=True)
                for side, figures in interleaved(sides, i).items():
                    rounds[side][-1]["interleaved"] = figures
    finally:
        for d in sides.values():
            if d.alive():
                with contextlib.suppress(Exception):
                    d.stop_sandboxes()
            with contextlib.suppress(Exception):
                d.stop()
            remove_cgroup_tree(d.cgroup_parent)
        for tree in trees.values():
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    table = []
    for name, (unit, higher, read) in FIGURES.items():
        if not all(_has(read, r) for side in names for r in rounds[side]):
            continue
        value = {side: statistics.median(read(r) for r in rounds[side]) for side in names}
        change = {rev: (value["this"] - value[rev]) / value[rev] * 100 if value[rev] else 0.0 for rev in bases}
        worse = max([(-c if higher else c) for c in change.values()], default=0.0)
        table.append({"figure": name, "unit": unit, "values": value,
                      "change_percent": {rev: round(c, 1) for rev, c in change.items()},
                      "worse_percent": round(worse, 1),
                      "rounds": {side: [read(r) for r in rounds[side]] for side in names}})  # fmt: skip
    res = {
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "bases": bases,
        "baseline": _rev(args.baseline) if args.baseline else None,
        "this": this_rev,
        "rounds": args.rounds,
        "machine": machine_info(),
        "table": table,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compare.json").write_text(json.dumps(res, indent=2) + "\n")
    against = " and ".join(bases)
    lines = [
        f"# Side by side: {this_rev} against {against} ({res['when']}, {args.rounds} rotating rounds)",
        "",
        "| figure | "
        + " | ".join(bases)
        + f" | {this_rev} | "
        + " | ".join(f"change vs {r}" for r in bases)
        + " | worse by (most) |",
        "|---|" + "---|" * (2 * len(bases) + 2),
    ]
    for row in table:
        cells = [f"{row['values'][side]:.2f} {row['unit']}" for side in [*bases, "this"]]
        cells += [f"{row['change_percent'][rev]:+.1f} %" for rev in bases]
        lines.append(f"| {row['figure']} | " + " | ".join(cells) + f" | {max(0.0, row['worse_percent']):.1f} % |")
    only = "" if tuple(args.only) == SCENARIOS else " --only " + " ".join(args.only)
    named = " ".join(args.base) + ("" if args.baseline == BASELINE else f" --baseline '{args.baseline}'")
    lines += ["", f"Command: `python3 bench/compare.py {named} --rounds {args.rounds}{only}`", ""]
    (args.results / "compare.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
