#!/usr/bin/env python3
"""Where a hot path's time goes: CPU per operation by process, and flame graphs of the Python parts.

    python3 bench/flame.py [--paths exec create run_code] [--n 2000] [--results bench/results/flame]

For each path, a daemon of this tree (bench/common.py's, its own cgroup parent) and this process as
the SDK's caller run the operation N times one at a time, twice:
  1. unprofiled: wall time per operation (p50, mean), and CPU per operation of the caller (the SDK,
     its HTTP client and the kernel's work for its calls), the daemon (its HTTP server, the API, the
     node; with the helpers it starts and reaps, e.g. the launcher on a create), the sandboxes (the
     in-sandbox agent and the command: the cgroup parent's CPU accounting) and the rest of the host
     (kernel threads, softirqs, other work: /proc/stat's busy time less the three);
  2. under py-spy (sampling both Python processes, 500 Hz): `<path>-sdk.svg` and `<path>-daemon.svg`
     flame graphs, and each one's busy samples grouped by layer (the SDK, the HTTP client, the HTTP
     server and framework, the daemon's API, its node, the runtime, pydantic, the event loop).
Paths: `exec` (`sb.exec("true")` into one busybox sandbox), `create` (create busybox + first exec,
stop untimed but counted in CPU), `run_code` (`run_code("print(1)")` on the fncall tier).
Writes `<results>/flame.md` and `flame.json` and the SVGs. Needs py-spy (`pip install py-spy`) for 2.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import RESULTS, Daemon, cgroup_dirs, remove_cgroup_tree
from report import machine_info
from sandfleet import Client

TICK = os.sysconf("SC_CLK_TCK")
PATHS = ("exec", "create", "run_code")
# A frame's file -> its layer, first match wins (py-spy's frame text: "function (path:line)").
LAYERS = (
    ("sandfleet/client/", "SDK (sandfleet.client)"),
    ("httpx/", "HTTP client (httpx, httpcore, h11)"),
    ("httpcore/", "HTTP client (httpx, httpcore, h11)"),
    ("h11/", "HTTP client (httpx, httpcore, h11)"),
    ("uvicorn/", "HTTP server and framework (uvicorn, starlette, fastapi, anyio)"),
    ("starlette/", "HTTP server and framework (uvicorn, starlette, fastapi, anyio)"),
    ("fastapi/", "HTTP server and framework (uvicorn, starlette, fastapi, anyio)"),
    ("anyio/", "HTTP server and framework (uvicorn, starlette, fastapi, anyio)"),
    # py-spy names a file by its shortest path under sys.path: the daemon's may come as "node/..."
    ("sandfleet/daemon/api/", "daemon API (sandfleet.daemon.api)"),
    ("(api/", "daemon API (sandfleet.daemon.api)"),
    ("sandfleet/daemon/", "daemon node (sandfleet.daemon)"),
    ("(node/", "daemon node (sandfleet.daemon)"),
    ("(net/", "daemon node (sandfleet.daemon)"),
    ("(security/", "daemon node (sandfleet.daemon)"),
    ("(rl/", "daemon node (sandfleet.daemon)"),
    ("(service.py", "daemon node (sandfleet.daemon)"),
    ("sandfleet/runtime/", "runtime (sandfleet.runtime: agent channel, launcher)"),
    ("sandfleet/backends/", "runtime (sandfleet.runtime: agent channel, launcher)"),
    ("(backends/", "runtime (sandfleet.runtime: agent channel, launcher)"),
    ("(runtime/", "runtime (sandfleet.runtime: agent channel, launcher)"),
    ("concurrent/futures/", "worker threads (blocking calls off the event loop)"),
    ("pydantic", "models (pydantic, sandfleet.models)"),
    ("sandfleet/models/", "models (pydantic, sandfleet.models)"),
    ("asyncio/", "event loop (asyncio, selectors)"),
    ("selectors", "event loop (asyncio, selectors)"),
)


def _proc_cpu(pid: int, children: bool = False) -> tuple[float, float]:
    """(user, system) CPU seconds of a process (all threads; with `children`, the reaped children's too)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    user, system = int(f[11]) + (int(f[13]) if children else 0), int(f[12]) + (int(f[14]) if children else 0)
    return user / TICK, system / TICK


def _cgroup_cpu(parent: str) -> float:
    """CPU seconds of everything under the cgroup `parent` (v1 cpuacct or v2 cpu.stat)."""
    for d in cgroup_dirs(parent):
        if (d / "cpuacct.usage").exists():
            return int((d / "cpuacct.usage").read_text()) / 1e9
        if (d / "cpu.stat").exists():
            for line in (d / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
    return 0.0


def _host_busy() -> float:
    """CPU seconds the whole host spent not idle (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(f[:8]) - f[3] - f[4]) / TICK  # all but idle and iowait; guest time is in user already


class HotPath:
    """One hot path: `setup` (untimed) returns the operation to repeat; `teardown` ends it."""

    def __init__(self, fleet: Client, name: str) -> None:
        self.fleet, self.name = fleet, name
        self.sandbox: Any = None

    def setup(self) -> Callable[[], None]:
        if self.name == "exec":
            self.sandbox = self.fleet.create(image="busybox", labels={"bench": "flame"})
            sb = self.sandbox
            return lambda: _check(sb.exec("true"))
        if self.name == "create":

            def cycle() -> None:
                sb = self.fleet.create(image="busybox", labels={"bench": "flame"})
                _check(sb.exec("true"))
                sb.stop()

            return cycle
        if self.name == "run_code":
            return lambda: _check(self.fleet.run_code("print(1)"), "1\n")
        raise ValueError(self.name)

    def teardown(self) -> None:
        if self.sandbox is not None:
            self.sandbox.stop()


def _check(result: Any, stdout: str = "") -> None:
    if result.exit_code != 0 or result.stdout != stdout:
        raise RuntimeError(f"unexpected result: {result}")


def measure(op: Callable[[], None], n: int, daemon: Daemon, cgroup: str) -> dict[str, Any]:
    me = os.getpid()
    xs = []
    c0, d0, s0, h0 = _proc_cpu(me), _proc_cpu(daemon.pid, True), _cgroup_cpu(cgroup), _host_busy()
    w0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        op()
        xs.append(time.perf_counter() - t)
    wall = time.perf_counter() - w0
    c1, d1, s1, h1 = _proc_cpu(me), _proc_cpu(daemon.pid, True), _cgroup_cpu(cgroup), _host_busy()
    per = {
        "caller (SDK + HTTP client): user": (c1[0] - c0[0]) / n,
        "caller: kernel": (c1[1] - c0[1]) / n,
        "daemon (HTTP server + API + node + helpers): user": (d1[0] - d0[0]) / n,
        "daemon: kernel": (d1[1] - d0[1]) / n,
        "sandbox (agent + command), user and kernel": (s1 - s0) / n,
    }
    per["rest of the host (kernel threads, softirqs, other)"] = max(0.0, (h1 - h0) / n - sum(per.values()))
    return {
        "n": n,
        "wall_p50_ms": statistics.median(xs) * 1e3,
        "wall_mean_ms": wall / n * 1e3,
        "cpu_ms_per_op": {k: round(v * 1e3, 4) for k, v in per.items()},
    }


def profile(op: Callable[[], None], n: int, daemon: Daemon, out: Path, name: str) -> dict[str, Any]:
    spy = shutil.which("py-spy")
    if spy is None:
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    procs, raws = {}, {}
    for who, pid in (("sdk", os.getpid()), ("daemon", daemon.pid)):
        raws[who] = out / f".{name}-{who}.txt"
        for fmt, dest in (("flamegraph", out / f"{name}-{who}.svg"), ("raw", raws[who])):
            procs[(who, fmt)] = subprocess.Popen(
                [spy, "record", "-r", "500", "--nonblocking", "-f", fmt, "-o", str(dest), "-p", str(pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
    time.sleep(1.0)  # py-spy attached
    try:
        for _ in range(n):
            op()
    finally:
        for p in procs.values():
            p.send_signal(2)
        for p in procs.values():
            p.wait(timeout=60)
    res = {who: _layers(raw) for who, raw in raws.items()}
    for raw in raws.values():
        raw.unlink(missing_ok=True)
    return res


# Leaf frames blocked in a socket call: waiting for the peer, or preempted by the peer the call woke
# (on 2 cores a send often hands the CPU to its receiver: the agent, the daemon).
SOCKET_IO = (
    "SyncStream.read (",  # httpx's (the caller on TCP, streams)
    "SyncStream.write (",
    "Connection.exchange (sandfleet/client/_base/lane.py",  # the SDK's lane: its send and recv
    "AgentChannel._send_unlocked (",  # the daemon's datagram to the agent
    "sock_sendall (",
)
WAITING = ("select (", "epoll", "poll (", "wait (", "get (queue.py")  # idle (an idle worker thread too)


def _layers(raw: Path) -> dict[str, Any]:
    """Busy samples by layer: each sample counted once, under the innermost frame with a layer."""
    counts: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        if any(w in frames[-1] for w in WAITING):
            continue
        if any(w in frames[-1] for w in SOCKET_IO):
            layer = "in a socket call (waiting, or preempted by the peer it woke)"
        else:
            layer = next((name for f in reversed(frames) for key, name in LAYERS if key in f), "other")
        counts[layer] += int(n)
        total += int(n)
    return {"busy_samples": total, "percent": {k: round(100 * v / total, 1) for k, v in counts.most_common()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--paths", nargs="+", default=["exec", "create", "run_code"], choices=["exec", "create", "run_code"]
    )
    ap.add_argument("--n", type=int, default=2000, help="operations per pass (create: a tenth)")
    ap.add_argument("--results", type=Path, default=RESULTS / "flame")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    args.results.mkdir(parents=True, exist_ok=True)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="sandfleet-flame-"))
    cgroup = f"/sfflame-{os.getpid()}"
    daemon = Daemon(tmp / "d", cgroup)
    res: dict[str, Any] = {"when": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": rev,
                           "machine": machine_info(), "load": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
                           "paths": {}}  # fmt: skip
    try:
        daemon.start()
        with Client(daemon.socket, timeout=120) as fleet:
            for name in args.paths:
                n = max(50, args.n // 10) if name == "create" else args.n
                path = HotPath(fleet, name)
                op = path.setup()
                try:
                    for _ in range(min(100, n // 5)):
                        op()
                    print(f"{name}: measuring {n}", flush=True)
                    figures = measure(op, n, daemon, cgroup)
                    print(f"{name}: profiling {n}", flush=True)
                    figures["profile"] = profile(op, n, daemon, args.results, name)
                finally:
                    path.teardown()
                res["paths"][name] = figures
    finally:
        with contextlib.suppress(Exception):
            daemon.stop()
        remove_cgroup_tree(cgroup)
        shutil.rmtree(tmp, ignore_errors=True)
    (args.results / "flame.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.results / "flame.md").write_text(report(res))
    print(report(res))
    return 0


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [f"# Where the hot paths' time goes ({res['commit']}, {res['when']})", "",
             f"Command: `python3 bench/flame.py`. Host: {m['nproc']} cores ({m['cpu']}), load before: {res['load']}.",
             "CPU per operation from /proc and the sandboxes' cgroup; flame graphs (py-spy, 500 Hz) next to this",
             "file: `<path>-sdk.svg` (the caller) and `<path>-daemon.svg`.", ""]  # fmt: skip
    for name, f in res["paths"].items():
        cpu = f["cpu_ms_per_op"]
        lines += [f"## {name}: p50 {f['wall_p50_ms']:.3f} ms, mean {f['wall_mean_ms']:.3f} ms ({f['n']} one at a time)",
                  "", "| CPU per operation | ms | share of the wall mean |", "|---|---|---|"]  # fmt: skip
        for k, v in cpu.items():
            lines.append(f"| {k} | {v:.3f} | {100 * v / f['wall_mean_ms']:.0f} % |")
        lines.append(f"| all | {sum(cpu.values()):.3f} | {100 * sum(cpu.values()) / f['wall_mean_ms']:.0f} % |")
        prof = f.get("profile", {})
        if "skipped" in prof:
            lines += ["", f"Flame graphs: {prof['skipped']}."]
        for who in ("sdk", "daemon"):
            if who in prof:
                lines += [
                    "",
                    f"`{name}-{who}.svg`: {prof[who]['busy_samples']} busy samples, by layer (innermost):",
                    "",
                ]
                lines += [f"- {k}: {v} %" for k, v in prof[who]["percent"].items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
