"""This tree against an earlier commit, side by side in one run: each side its own daemon (started
from its own source tree), both driven by this tree's SDK through the same scenario modules, in
alternating rounds so both see the same machine minute by minute.

    python3 bench/compare.py BASE_REV [--rounds 5] [--results bench/results]   (as root)

Figures per side (medians over the rounds): create-to-first-exec p50, `exec("true")` p50, a burst
of 128 creates and a sustained run of 400 (creations/s, `create_many`, 32 in flight), pause of a
sandbox holding 200 MiB (seconds) and resume to first exec, fork into 4 children (seconds), and 100
idle sandboxes (daemon RSS and host memory per sandbox, exec p99 into random ones), the files API's
stat and list of 1,000 entries. Writes
compare.json (each figure's value in every round) and compare.md; everything it made is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import os
import statistics
import subprocess
import tempfile
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
    "100 idle: daemon RSS": ("MiB", False, lambda r: r["density"]["daemon_rss_after_mib"]),
    "100 idle: host memory per sandbox": ("KiB", False, lambda r: r["density"]["host_mem_used_per_sandbox_kib"]),
    "100 idle: exec p99": ("ms", False, lambda r: r["density"]["exec_into_random_idle"]["p99_ms"]),
    "files: stat p50": ("ms", False, lambda r: r["files"]["stat"]["p50_ms"]),
    "files: list of 1000 p50": ("ms", False, lambda r: r["files"]["list of 1000"]["p50_ms"]),
}


SCENARIOS = ("create", "exec", "burst", "sustained", "pause", "fork", "density", "files")


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", help="the commit to compare with (a git revision of this repository)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--only", nargs="+", choices=SCENARIOS, default=SCENARIOS, help="scenarios to run (default: all)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    base_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.base], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    this_rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    if subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                      text=True, check=True).stdout.strip():  # fmt: skip
        this_rev += " + uncommitted changes"  # "this" runs the working tree
    tmp = Path(tempfile.mkdtemp(prefix="sandfleet-compare-"))
    os.chmod(tmp, 0o755)  # criu, as a sandbox's user-namespace owner, walks down to its sandbox's files
    base_tree = tmp / "base-tree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_tree), args.base], check=True,
                   capture_output=True)  # fmt: skip
    stamp = f"{os.getpid()}-{int(dt.datetime.now().timestamp())}"
    sides = {
        "base": Daemon(tmp / "base", f"/sfcompare-base-{stamp}", src=base_tree / "src"),
        "this": Daemon(tmp / "this", f"/sfcompare-this-{stamp}", src=REPO / "src"),
    }
    rounds: dict[str, list[dict[str, Any]]] = {"base": [], "this": []}
    try:
        for d in sides.values():
            d.start()
        for i in range(args.rounds):
            order = ["base", "this"] if i % 2 == 0 else ["this", "base"]
            for side in order:
                print(f"round {i + 1}/{args.rounds}: {side}", flush=True)
                rounds[side].append(one_round(sides[side], side, tuple(args.only)))
    finally:
        for d in sides.values():
            if d.alive():
                with contextlib.suppress(Exception):
                    d.stop_sandboxes()
            with contextlib.suppress(Exception):
                d.stop()
            remove_cgroup_tree(d.cgroup_parent)
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_tree)], capture_output=True)
        subprocess.run(["rm", "-rf", str(tmp)], check=False)
    table = []
    for name, (unit, higher, read) in FIGURES.items():
        if not all(_has(read, r) for r in rounds["base"] + rounds["this"]):
            continue
        a = statistics.median(read(r) for r in rounds["base"])
        b = statistics.median(read(r) for r in rounds["this"])
        change = (b - a) / a * 100 if a else 0.0
        worse = -change if higher else change
        table.append({"figure": name, "unit": unit, "base": a, "this": b, "change_percent": round(change, 1),
                      "worse_percent": round(worse, 1),
                      "rounds": {side: [read(r) for r in rounds[side]] for side in rounds}})  # fmt: skip
    res = {
        "when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "base": base_rev,
        "this": this_rev,
        "rounds": args.rounds,
        "machine": machine_info(),
        "table": table,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "compare.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = [
        f"# Side by side: {this_rev} against {base_rev} ({res['when']}, {args.rounds} alternating rounds)",
        "",
        f"| figure | {base_rev} | {this_rev} | change | worse by |",
        "|---|---|---|---|---|",
    ]
    for row in table:
        lines.append(
            f"| {row['figure']} | {row['base']:.2f} {row['unit']} | {row['this']:.2f} {row['unit']} "
            f"| {row['change_percent']:+.1f} % | {max(0.0, row['worse_percent']):.1f} % |"
        )
    only = "" if tuple(args.only) == SCENARIOS else " --only " + " ".join(args.only)
    lines += ["", f"Command: `python3 bench/compare.py {args.base} --rounds {args.rounds}{only}`", ""]
    (args.results / "compare.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
