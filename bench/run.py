"""sandfleet benchmark: sandfleet and its peers, side by side, in one run on one machine.

    python bench/run.py [--quick] [--profile FILE]      (as root)

Measures
  1. create-to-first-exec through the SDK (`fleet.create(image="busybox")` then `sb.exec("true")`),
     back to back and one every 0.1 s (what a lone create costs after an idle spell);
  2. exec round trips into a running sandbox (`true`, `echo hi`, argv `["true"]`);
  3. peers doing the same "fresh sandbox + run true" cycle (raw crun with a minimal config, crun with
     sandfleet's own config.json, bwrap, runsc, podman, docker) and the same exec (`crun exec`,
     `nsenter -a`), each timed as one subprocess from Python;
  4. density: N idle sandboxes (daemon RSS, host memory per sandbox, PSS of the sandboxes' processes,
     exec latency into random idle sandboxes, daemon CPU while idle);
  5. a burst of concurrent creates through AsyncClient.

    python bench/run.py --only checkpoint [--rounds 10]
    python bench/run.py --only density [--idle 10000]

runs only the checkpoint scenario (`sb.checkpoint()` and `sb.rollback(cp)` of a python sandbox
holding 200 MiB and of an idle busybox one, with where the time goes) and writes
bench/results/checkpoint.json and checkpoint.md instead; `--only density` runs the density scenario
alone for each N of `--idle` (H6: 10,000) and writes density.json and density.md.

Writes bench/results/latest.json and bench/results/latest.md and prints the tables. Everything it
makes (daemon, sandboxes, peer containers, cgroups, temp dirs) is removed at the end, also on error.

crun 1.8 refuses to run on a hybrid cgroup host whose cgroup2 mount offers controllers, so the peers
run in a helper process (`--peer-worker`) inside a private mount namespace where
/sys/fs/cgroup/unified is unmounted (the sandfleet daemon does the same for itself).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    DEVNULL,
    POOL_MEMORY,
    POOL_SIZE,
    RESULTS,
    TARGETS,
    Daemon,
    cgroup_dirs,
    in_cgroup_ns_wrapper,
    remove_cgroup_tree,
    restart_if_dead,
    rss_kib,
    version_of,
)
from peers import docker_skip_reason, peer_leftover_cleanup, peer_worker, stage_rootfs
from report import (
    build_tables,
    machine_info,
    print_tables,
    ratio,
    write_chart,
    write_checkpoint_markdown,
    write_markdown,
)
from sandfleet.errors import SandboxError
from scenarios.burst import bench_burst
from scenarios.checkpoint import (
    CHECKPOINT_HOLD_MIB,
    CHECKPOINT_TARGETS_MS,
    THINK_S,
    bench_checkpoint,
    checkpoint_targets,
)
from scenarios.create import bench_create, bench_pooled_groups
from scenarios.density import bench_density
from scenarios.exec import bench_exec
from scenarios.fork import bench_branch_fork, bench_fork, bench_fork_memory
from scenarios.pause import bench_pause
from scenarios.qos import bench_qos


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller N everywhere (a smoke run)")
    ap.add_argument("--profile", type=Path, help="py-spy record the daemon during the create loop into this file")
    ap.add_argument("--no-peers", action="store_true", help="skip the peer runtimes")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where latest.json / latest.md go")
    ap.add_argument("--only", choices=["checkpoint", "density"], help="run one scenario alone (its own results files)")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds of --only checkpoint (after a warm-up)")
    ap.add_argument("--idle", type=int, nargs="+", default=[10000], help="sandboxes of each --only density step")
    ap.add_argument("--peer-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_worker:
        peer_worker(args.peer_worker)
        return 0
    if os.geteuid() != 0:
        print("bench/run.py must run as root (the daemon and the peers create namespaces and cgroups)")
        return 2

    if args.only == "checkpoint":
        return run_checkpoint(args)
    if args.only == "density":
        return run_density(args)

    q = args.quick
    n_create, n_exec, n_idle_exec, n_peer = (30, 100, 100, 30) if q else (100, 500, 500, 100)
    n_idles = (50,) if q else (500, 5000)
    n_burst, n_sustained = (100, 200) if q else (1000, 3000)
    burst_in_flight = 32

    tag, tmp, daemon_cg = _begin()
    peer_cg = f"/sfbench-peers-{tag}"
    labels = {"sfbench": tag}
    # podman (cgroupfs manager) puts conmon under /libpod_parent: remove it afterwards if we made it
    cgroups_to_remove = [daemon_cg, peer_cg] + ([] if cgroup_dirs("/libpod_parent") else ["/libpod_parent"])
    res: dict[str, Any] = {
        "meta": machine_info(),
        "config": {
            "quick": q,
            "create_cycles": n_create,
            "exec_round_trips": n_exec,
            "idle_sandboxes": n_idles,
            "idle_execs": n_idle_exec,
            "burst": n_burst,
            "sustained": n_sustained,
            "burst_in_flight": burst_in_flight,
            "peer_cycles": n_peer,
            "image": "busybox",
        },
        "sandfleet": {},
        "peers": {"cycle": {}, "exec": {}},
    }
    profiler: subprocess.Popen[bytes] | None = None
    worker: subprocess.Popen[bytes] | None = None
    daemon: Daemon | None = None
    try:
        from sandfleet import Client

        daemon = Daemon(tmp / "daemon", daemon_cg)
        print(f"starting sandfleet daemon in {daemon.root}", flush=True)
        daemon.start()
        with Client(daemon.socket, timeout=600) as fleet:
            fleet.create(image="busybox", labels=labels).stop()  # builds the image once if missing
            if args.profile:
                if shutil.which("py-spy") is None:
                    raise SystemExit("--profile needs py-spy (pip install py-spy)")
                profiler = subprocess.Popen(
                    [
                        "py-spy",
                        "record",
                        "-p",
                        str(daemon.pid),
                        "-r",
                        "250",
                        "-f",
                        "raw",
                        "-o",
                        str(args.profile),
                        "--nonblocking",
                    ],
                    stdout=DEVNULL,
                    stderr=DEVNULL,
                )
            print(f"1. create-to-first-exec x{n_create}", flush=True)
            res["sandfleet"]["create_to_first_exec"] = bench_create(fleet, n_create, labels, daemon.socket)
            print(f"1a. create-to-first-exec, one cold create every 0.1 s x{n_create // 2}", flush=True)
            res["sandfleet"]["spaced_create_to_first_exec"] = bench_create(
                fleet, n_create // 2, labels, daemon.socket, pause=0.1
            )
            print(f"1b. create-to-first-exec from the warm pool x{n_create}", flush=True)
            res["sandfleet"]["pooled_create_to_first_exec"] = bench_create(
                fleet, n_create, labels, daemon.socket, memory=POOL_MEMORY, pause=0.2
            )
            print(f"1c. warm pool: groups of {POOL_SIZE} creates back to back", flush=True)
            res["sandfleet"]["pooled_groups"] = bench_pooled_groups(fleet, 2 if q else 6, labels)
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait(60)
                profiler = None
            print(f"2. exec round trips x{n_exec}", flush=True)
            res["sandfleet"]["exec"] = bench_exec(fleet, n_exec, labels, daemon.socket)
            res["sandfleet"]["density"] = []
            for n_idle in n_idles:
                print(f"4. density: {n_idle} idle sandboxes", flush=True)
                res["sandfleet"]["density"].append(bench_density(fleet, daemon, n_idle, n_idle_exec, labels))
        with Client(daemon.socket, timeout=600) as fleet:
            print("6. pause and resume of a sandbox holding 200 MiB", flush=True)
            res["sandfleet"]["pause"] = bench_pause(fleet, daemon, 3 if q else 7, labels)
            print("6b. fork of 16 children from one live sandbox", flush=True)
            res["sandfleet"]["fork"] = bench_fork(fleet, 3 if q else 7, 16, labels)
            print("6c. host memory of 16 fork children of a 200 MiB parent, with and without KSM", flush=True)
            res["sandfleet"]["fork_memory"] = bench_fork_memory(fleet, 16, 64 if q else 200, labels)
            print("7. QoS: exec latency while best-effort (or not) sandboxes saturate the cores", flush=True)
            res["sandfleet"]["qos"] = bench_qos(fleet, 50 if q else 200, labels)
        for key, n in (("burst", n_burst), ("sustained", n_sustained)):
            print(f"5. {key}: {n} creates, {burst_in_flight} in flight", flush=True)
            res["sandfleet"][key] = asyncio.run(bench_burst(daemon.socket, n, burst_in_flight, labels))
            if res["sandfleet"][key]["stop_error"]:
                with Client(daemon.socket, timeout=600) as fleet:
                    restart_if_dead(daemon, fleet, labels, f"{key} stop_many")
        res["sandfleet"]["daemon_crashes"] = daemon.crashes
        res["sandfleet"]["daemon_rss_end_mib"] = round(rss_kib(daemon.pid) / 1024, 1)

        # Peers after sandfleet, with sandfleet's sandboxes gone: same machine, quiet again.
        if not args.no_peers:
            print("3. peers (in a private mount namespace without the cgroup2 mount)", flush=True)
            stage_rootfs(tmp / "peer-rootfs")
            params = tmp / "peer-params.json"
            out = tmp / "peer-results.json"
            params.write_text(
                json.dumps(
                    {
                        "tmp": str(tmp),
                        "n": n_peer,
                        "n_exec": n_exec,
                        "cgroup_parent": peer_cg,
                        "out": str(out),
                        "docker_reason": docker_skip_reason(),
                    }
                )
            )
            worker = subprocess.Popen(
                in_cgroup_ns_wrapper([sys.executable, str(Path(__file__).resolve()), "--peer-worker", str(params)])
            )
            rc = worker.wait()
            worker = None
            if rc != 0 or not out.exists():
                raise RuntimeError(f"peer worker exited {rc}")
            res["peers"] = json.loads(out.read_text())

        base = res["sandfleet"]["create_to_first_exec"]["create_plus_first_exec"]
        ex = res["sandfleet"]["exec"]['exec("true")']["stats"]
        res["ratios"] = {
            "meaning": "peer / sandfleet: above 1 means sandfleet is faster",
            "create_cycle": {
                k: {
                    "p50": ratio(v["stats"]["p50_ms"], base["p50_ms"]),
                    "mean": ratio(v["stats"]["mean_ms"], base["mean_ms"]),
                }
                for k, v in res["peers"]["cycle"].items()
                if v["status"] == "ok"
            },
            "exec": {
                k: {
                    "p50": ratio(v["stats"]["p50_ms"], ex["p50_ms"]),
                    "mean": ratio(v["stats"]["mean_ms"], ex["mean_ms"]),
                }
                for k, v in res["peers"]["exec"].items()
                if v["status"] == "ok"
            },
        }
        d = res["sandfleet"]["density"][0]
        big = res["sandfleet"]["density"][-1]
        burst, sustained = res["sandfleet"]["burst"], res["sandfleet"]["sustained"]
        res["targets"] = [
            {
                "target": f"create-to-first-exec p50 <= {TARGETS['create_to_first_exec_p50_ms']:.0f} ms",
                "measured": base["p50_ms"],
                "met": base["p50_ms"] <= TARGETS["create_to_first_exec_p50_ms"],
            },
            {
                "target": f'exec("true") p50 <= {TARGETS["exec_p50_ms"]:.0f} ms',
                "measured": ex["p50_ms"],
                "met": ex["p50_ms"] <= TARGETS["exec_p50_ms"],
            },
            {
                "target": f"daemon RSS with {d['sandboxes']} idle sandboxes < {TARGETS['daemon_rss_idle_mib']:.0f} MiB",
                "measured": d["daemon_rss_after_mib"],
                "met": d["daemon_rss_after_mib"] < TARGETS["daemon_rss_idle_mib"],
            },
            {
                "target": f"warm pool (groups of {POOL_SIZE}): create-to-first-exec p50 <= 5 ms, p99 <= 25 ms",
                "measured": res["sandfleet"]["pooled_groups"]["create_plus_first_exec"]["p50_ms"],
                "met": res["sandfleet"]["pooled_groups"]["create_plus_first_exec"]["p50_ms"] <= 5
                and res["sandfleet"]["pooled_groups"]["create_plus_first_exec"]["p99_ms"] <= 25,
            },
            {
                "target": f"{big['sandboxes']} idle sandboxes: host memory per sandbox <= 2048 KiB",
                "measured": big["host_mem_used_per_sandbox_kib"],
                "met": big["host_mem_used_per_sandbox_kib"] <= 2048,
            },
            {
                "target": f"{big['sandboxes']} idle sandboxes: exec p99 <= 50 ms",
                "measured": big["exec_into_random_idle"]["p99_ms"],
                "met": big["exec_into_random_idle"]["p99_ms"] <= 50,
            },
            {
                "target": "pause of a sandbox holding 200 MiB: >= 90 % of it out within 1 s",
                "measured": res["sandfleet"]["pause"]["pause_s"],
                "met": res["sandfleet"]["pause"]["pause_s"] <= 1
                and res["sandfleet"]["pause"]["fraction_pushed_out"] >= 0.9,
            },
            {
                "target": "fork of 16 children from one live sandbox <= 1 s",
                "measured": res["sandfleet"]["fork"]["fork_s"],
                "met": res["sandfleet"]["fork"]["fork_s"] <= 1,
            },
            {
                "target": "16 fork children of a 200 MiB parent: host memory of all of them <= 2x the parent's",
                "measured": (res["sandfleet"].get("fork_memory") or {}).get("children_over_parent_ksm"),
                "met": ((res["sandfleet"].get("fork_memory") or {}).get("children_over_parent_ksm") or 99) <= 2,
            },
            {
                "target": "exec p50 with best-effort hogs on every core <= 2x unloaded",
                "measured": res["sandfleet"]["qos"]["ratio_p50_with_qos"],
                "met": res["sandfleet"]["qos"]["ratio_p50_with_qos"] <= 2,
            },
            {
                "target": "resume to first exec <= 50 ms",
                "measured": res["sandfleet"]["pause"]["resume_to_first_exec_ms"],
                "met": res["sandfleet"]["pause"]["resume_to_first_exec_ms"] <= 50,
            },
            {
                "target": f"burst of {burst['sandboxes']}: all exec-ready (create returned: agent HELLO) within 5 s",
                "measured": burst["created_s"],
                "met": burst["created_s"] <= 5 and not burst["failed"],
            },
            {
                "target": f"burst of {burst['sandboxes']}: all have run one exec within 5 s (stricter)",
                "measured": burst["all_exec_ready_s"],
                "met": burst["all_exec_ready_s"] <= 5 and not burst["failed"],
            },
            {
                "target": f"sustained ({sustained['sandboxes']} creates) >= 300 creations/s",
                "measured": sustained["creations_per_s"],
                "met": sustained["creations_per_s"] >= 300 and not sustained["failed"],
            },
        ]
        res["meta"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[0]

        tables = build_tables(res)
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "latest.json").write_text(json.dumps(res, indent=2) + "\n")
        write_markdown(res, tables, args.results / "latest.md")
        write_chart(res, args.results / "latest.png")
        print_tables(tables)
        print(f"wrote {args.results / 'latest.json'} and {args.results / 'latest.md'}")
        return 0
    except BaseException:
        if daemon is not None and daemon.process.started:
            print("daemon log tail:\n" + daemon.log()[-3000:], file=sys.stderr)
        raise
    finally:
        cleanup(daemon, tmp, cgroups_to_remove, profiler, worker)


def run_checkpoint(args: argparse.Namespace) -> int:
    """`--only checkpoint`: B1 (checkpoint after a small change) and B2 (rollback to it, until the
    next exec answers) for a python sandbox holding 200 MiB and for an idle busybox one (the floor).
    Writes checkpoint.json and checkpoint.md."""

    tag, tmp, daemon_cg = _begin()
    labels = {"sfbench": tag}
    rounds = 3 if args.quick else args.rounds
    hold_mib = 64 if args.quick else CHECKPOINT_HOLD_MIB
    res: dict[str, Any] = {
        "meta": machine_info(),
        "config": {"rounds": rounds, "warm_up_rounds": 1, "hold_mib": hold_mib, "quick": args.quick},
        "targets_ms": CHECKPOINT_TARGETS_MS,
    }
    daemon: Daemon | None = None
    try:
        from sandfleet import Client

        daemon = Daemon(tmp / "daemon", daemon_cg)
        print(f"starting sandfleet daemon in {daemon.root}", flush=True)
        daemon.start()
        res["meta"]["criu"] = version_of([*criu_command(), "--version"])
        with Client(daemon.socket, timeout=600) as fleet:
            for image in ("python:3.11", "busybox"):
                fleet.create(image=image, labels=labels).stop()  # builds / mounts the image once
            for image, key, mib in (("python:3.11", "python", hold_mib), ("busybox", "busybox", 0)):
                what = f"holding {mib} MiB" if mib else "no memory load (the floor)"
                res[key] = run_one(
                    f"checkpoint: {image}, {what}, rolled back at once, x{rounds}",
                    lambda image=image, mib=mib: bench_checkpoint(fleet, daemon, image, rounds, labels, mib),
                )
                res[f"{key}_think"] = run_one(
                    f"checkpoint: {image}, {what}, {THINK_S:g} s to think before the rollback, x{rounds}",
                    lambda image=image, mib=mib: bench_checkpoint(
                        fleet, daemon, image, rounds, labels, mib, think=THINK_S
                    ),
                )
            res["fork16"] = run_one(
                f"fork of 16 from the python:3.11 parent holding {hold_mib} MiB (B3, B4)",
                lambda: bench_branch_fork(fleet, 16, hold_mib, labels),
            )
        res["daemon_crashes"] = daemon.crashes
        res["meta"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[0]
        res["targets"] = checkpoint_targets(res)
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "checkpoint.json").write_text(json.dumps(res, indent=2) + "\n")
        write_checkpoint_markdown(res, args.results / "checkpoint.md")
        print((args.results / "checkpoint.md").read_text())
        print(f"wrote {args.results / 'checkpoint.json'} and {args.results / 'checkpoint.md'}")
        return 0
    except BaseException:
        if daemon is not None and daemon.process.started:
            print("daemon log tail:\n" + daemon.log()[-3000:], file=sys.stderr)
        raise
    finally:
        cleanup(daemon, tmp, [daemon_cg], None, None)


def run_density(args: argparse.Namespace) -> int:
    """`--only density --idle N [N ...]`: H6 (N idle sandboxes on one node: host memory each, exec
    p99 into random ones) alone, each N on the same daemon in turn. Writes density.json and .md."""
    tag, tmp, daemon_cg = _begin()
    labels = {"sfbench": tag}
    res: dict[str, Any] = {"meta": machine_info(), "config": {"idle": args.idle, "execs": 500}, "runs": []}
    daemon: Daemon | None = None
    try:
        from sandfleet import Client

        daemon = Daemon(tmp / "daemon", daemon_cg)
        # Each idle sandbox requests 0.01 CPU: 10,000 of them is 100 CPUs of requests, past the
        # default overcommit of 32 per core on 2 cores; the warm pool's sandboxes count too.
        most = max(args.idle) + 100
        daemon.config.write_text(f"cpu_overcommit = 64\nmax_sandboxes = {most}\n" + daemon.config.read_text())
        daemon.start()
        with Client(daemon.socket, timeout=600) as fleet:
            fleet.create(image="busybox", labels=labels).stop()  # the image mounted once
            for n in args.idle:
                print(f"density: {n} idle sandboxes", flush=True)
                res["runs"].append(bench_density(fleet, daemon, n, 500, labels))
        res["daemon_crashes"] = daemon.crashes
        res["meta"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[0]
        args.results.mkdir(parents=True, exist_ok=True)
        (args.results / "density.json").write_text(json.dumps(res, indent=2) + "\n")
        lines = [
            f"# density, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
            f"(`python3 bench/run.py --only density --idle {' '.join(map(str, args.idle))}`)",
            "",
            "| idle sandboxes | created in | host memory each | their processes' PSS each | daemon RSS each "
            "| exec into random ones p50 / p99 | daemon CPU idle | stopped in |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in res["runs"]:
            ex, host = r["exec_into_random_idle"], r["host_mem_used_per_sandbox_kib"] / 1024
            lines.append(
                f"| {r['sandboxes']:,} | {r['create_all_s']:.1f} s | {host:.2f} MiB "
                f"| {r['sandbox_pss_per_sandbox_kib']:.1f} KiB | {r['daemon_rss_per_sandbox_kib']:.1f} KiB "
                f"| {ex['p50_ms']:.1f} / {ex['p99_ms']:.1f} ms "
                f"| {r['daemon_idle_cpu_percent_of_one_core']:.1f} % of a core | {r['stop_all_s']:.1f} s |"
            )
        (args.results / "density.md").write_text("\n".join(lines) + "\n")
        print((args.results / "density.md").read_text())
        return 0
    except BaseException:
        if daemon is not None and daemon.process.started:
            print("daemon log tail:\n" + daemon.log()[-3000:], file=sys.stderr)
        raise
    finally:
        cleanup(daemon, tmp, [daemon_cg], None, None)


def _begin() -> tuple[str, Path, str]:
    """What every run starts with: SIGTERM ends it through its cleanup; its tag, scratch directory
    and the daemon's cgroup."""

    def on_term(signo: int, frame: object) -> None:
        raise SystemExit(f"interrupted by signal {signo}")

    signal.signal(signal.SIGTERM, on_term)
    tag = f"{os.getpid()}-{int(time.time())}"
    tmp = Path(tempfile.mkdtemp(prefix="sandfleet-bench-"))
    os.chmod(tmp, 0o755)
    return tag, tmp, f"/sfbench-daemon-{tag}"


def run_one(title: str, fn: Any) -> dict[str, Any]:
    print(title, flush=True)
    out = fn()
    if "fork_ms" in out:
        print(f"  {out}", flush=True)
        return out
    cp, server = out["checkpoint_client"]["p50_ms"], out["checkpoint_server"]["p50_ms"]
    print(
        f"  checkpoint p50 {cp:.1f} ms (server {server:.1f}), "
        f"rollback to first exec p50 {out['rollback_to_first_exec']['p50_ms']:.1f} ms, "
        f"size {out['size_mib_p50']:.1f} MiB",
        flush=True,
    )
    return out


def criu_command() -> list[str]:
    from sandfleet.backends.config import ContainerBackendConfig
    from sandfleet.runtime.criu import Criu

    try:
        return Criu(ContainerBackendConfig().criu_root).command()
    except Exception:
        return ["criu"]


def cleanup(
    daemon: Daemon | None,
    tmp: Path,
    cgroup_parents: list[str],
    profiler: subprocess.Popen[bytes] | None,
    worker: subprocess.Popen[bytes] | None,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # finish cleaning up even on a second ^C
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for p in (profiler, worker):
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(30)
    if daemon is not None and daemon.alive():
        try:
            daemon.stop_sandboxes()
        except (SandboxError, OSError) as exc:
            print(f"cleanup: stopping sandboxes failed: {exc}", file=sys.stderr)
    if daemon is not None:
        daemon.stop()
    with contextlib.suppress(Exception):
        peer_leftover_cleanup(tmp)
    left = []
    for cg in cgroup_parents:
        left += remove_cgroup_tree(cg)
    shutil.rmtree(tmp, ignore_errors=True)
    if tmp.exists():
        left.append(str(tmp))
    if left:
        print(f"cleanup: could not remove {left}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
