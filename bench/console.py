#!/usr/bin/env python3
"""The web console's pages with thousands of sandboxes on the node: `python3 bench/console.py` (as root).

  1) A daemon of its own (temp root, socket, state and run dirs, cgroup parent; TCP on 127.0.0.1 with
     an `[iam]` admin token; admission loose enough for the run) and N real busybox sandboxes made
     with the SDK's `create_many` in batches (labels bench=console, job=job-0..job-49, team=a/b;
     small resources, a long idle_ttl so the reaper leaves them be). Timed; the daemon's RSS before
     and after. The first --baseline (200) are measured on their own first (steps 2-4), then the rest
     are made and everything is measured again: the same daemon with few and with many.
  2) The daemon left alone: GET /v1/health every 50 ms for --idle-seconds; its CPU per thread (event
     loop, others), the host's busy cores and its PID 1.
  3) The API calls the pages make, timed from Python (httpx, keep-alive, the admin token).
  4) Every page of the console in headless Chromium (Playwright, /usr/bin/chromium), three ways:
       cold    a new browser context (empty cache, new tab) and `page.goto(<url>/console/#/...)`
       reload  the same tab, about:blank then `page.goto` of the full URL (the HTTP cache as it is)
       hash    in-app: from an empty route, `location.hash = "#/..."` (what a click on a link does)
     The time is the browser's own clock: from navigation start (cold, reload) or from setting the
     hash, until the page's data is in the DOM ("dom": a MutationObserver sees the marker element)
     and until the frame after it ("painted": requestAnimationFrame, then a task). The fetches of
     each load (Resource Timing), its long tasks and the renderer's main-thread time (CDP) say where
     the time went: the console's files, the API, or the browser itself.
  5) --profile: py-spy on the daemon, alone and under each slow page's call, in a loop.
  The host's CPU during each phase is split into this benchmark's process tree and the rest (named).

    python3 bench/console.py [--sandboxes 5000] [--rounds 10] [--api-rounds 30] [--profile]
    python3 bench/console.py --dry        # 400 sandboxes (100 first), 3 rounds, results in a temp dir
    python3 bench/console.py --from-json bench/results/console.json   # the report again, from a run's figures

Results: bench/results/console.md (and console.json). Everything it starts is stopped on the way out
(also on Ctrl-C, SIGTERM or a failure): the browser, every sandbox, the daemon, its cgroups, the temp dir.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TOKEN = "bench-console-admin-0123456789abcdef"
TOKEN_NAME = "bench-console-admin"
TOKEN_KEY = "sandfleet.token"  # the console keeps its token in sessionStorage under this key (static/api.js)
CHROMIUM = "/usr/bin/chromium"
BUDGET_MS = 300.0  # the promise: a page loads in under 300 ms with 5,000 sandboxes on the node
JOBS = 50
BASE_LABELS = {"bench": "console"}
FILTER_JOB = "job-7"
TRAJECTORY = "bench-7"  # a trajectory of FILTER_JOB's (record_steps)
RECORDED = False  # whether record_steps has run (the baseline is measured before)
TRAJECTORIES = 0  # how many (--trajectories): the first sandboxes made are theirs
BLANK = "#/bench-blank"  # a route the console does not have: an empty page to navigate from

# page name -> (hash, what it shows; the marker: the element that appears once its data is drawn).
# The detail page draws in steps; its extra marks are reported as columns of their own.
MARKERS = {
    "node": "#node-live",
    "list": "#sandboxes tbody tr[data-id]",
    "sandbox": "#sb-id",
    "jobs": "#jobs-table tbody tr[data-job]",
    "images": "#images-table tbody tr",
    "audit": "#audit-table tbody tr",
    "job": "#slowest-table tbody tr[data-id]",
    "trajectory": "#steps-table tbody tr.step-row",
    "alerts": "#alerts-table",
    # the detail page's later parts
    "sb-usage": "#usage-now dl",
    "sb-events": "#events table",
    "sb-files": "#files tbody tr",
    "sb-terminal": ("#term-status", "^connected"),
}
DETAIL_EXTRA = ("sb-usage", "sb-events", "sb-files", "sb-terminal")
# the renderer's main-thread time by kind (CDP Performance.getMetrics)
MAIN_THREAD = ("TaskDuration", "ScriptDuration", "LayoutDuration", "RecalcStyleDuration")


def code_state() -> dict[str, Any]:
    """What was measured: the commit, whether the tree differs from it, and a fingerprint of the console's
    files and of the daemon's (another session may be editing either while this runs)."""
    import hashlib

    from common import REPO

    def digest(top: Path, pattern: str) -> tuple[str, float]:
        h = hashlib.sha256()
        newest = 0.0
        for f in sorted(top.rglob(pattern)):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(top)).encode() + b"\0" + f.read_bytes())
                newest = max(newest, f.stat().st_mtime)
        return h.hexdigest()[:12], newest

    def git(*args: str) -> str:
        r = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)
        return r.stdout.strip()

    src = REPO / "src" / "sandfleet"
    console, console_t = digest(src / "console" / "static", "*")
    daemon, daemon_t = digest(src, "*.py")
    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "changed_files": len(git("status", "--porcelain", "--", "src").splitlines()),
        "console_static": console,
        "console_newest": time.strftime("%H:%M:%S", time.localtime(console_t)),
        "python_sources": daemon,
        "python_newest": time.strftime("%H:%M:%S", time.localtime(daemon_t)),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def summary(ms: list[float]) -> dict[str, Any]:
    from common import pct

    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 0.5), 1),
        "p90_ms": round(pct(ms, 0.9), 1),
        "max_ms": round(max(ms), 1),
        "min_ms": round(min(ms), 1),
    }


def host_busy_ticks() -> int:
    """All CPUs' busy time so far (/proc/stat: user..steal less idle and iowait), clock ticks."""
    vals = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return sum(vals) - vals[3] - vals[4]


def proc_table() -> dict[int, tuple[int, str, int, int]]:
    """Every process: pid -> (ppid, comm, its own utime + stime, and with its reaped children's cutime +
    cstime), clock ticks."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            text = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        rest = text[text.rindex(")") + 2 :].split()
        comm = text[text.index("(") + 1 : text.rindex(")")]
        own = int(rest[11]) + int(rest[12])
        out[int(d)] = (int(rest[1]), comm, own, own + int(rest[13]) + int(rest[14]))
    return out


def tree_of(table: dict[int, tuple[int, str, int, int]], root: int) -> set[int]:
    kids: dict[int, list[int]] = collections.defaultdict(list)
    for pid, (ppid, *_) in table.items():
        kids[ppid].append(pid)
    seen, todo = set(), [root]
    while todo:
        pid = todo.pop()
        seen.add(pid)
        todo += kids.get(pid, [])
    return seen


class CpuWatch:
    """Cores busy on the host over a phase, and how much of that was this benchmark's own process tree
    (this script, its daemon and sandboxes, Playwright and the browser); the rest is other work, of
    which the processes that used the most are named (by comm, kernel threads included)."""

    def __init__(self) -> None:
        self.t = time.monotonic()
        self.host = host_busy_ticks()
        self.table = proc_table()

    def done(self) -> dict[str, Any]:
        tick = os.sysconf("SC_CLK_TCK")
        dt = time.monotonic() - self.t
        host = (host_busy_ticks() - self.host) / tick / dt
        now = proc_table()
        ours = tree_of(now, os.getpid())
        before_ours = tree_of(self.table, os.getpid())

        def used(pid: int) -> int:  # its own CPU only: what the host's init reaps is others' work, not its own
            return now[pid][2] - (self.table[pid][2] if pid in self.table else 0)

        # ours: with what our processes reaped (closed browser contexts, finished helpers)
        mine = (sum(now[p][3] for p in ours) - sum(self.table[p][3] for p in before_ours)) / tick / dt
        others: collections.Counter[str] = collections.Counter()
        for pid, (_, comm, *_) in now.items():
            if pid not in ours:
                others[re.sub(r"/\d+.*$|[-:]\d.*$", "", comm)] += used(pid)
        init = used(1) / tick / dt if 1 in now else 0.0
        top = [(name, round(v / tick / dt, 2)) for name, v in others.most_common(6) if v > 0]
        return {"seconds": round(dt, 1), "host_cores": round(host, 2), "ours": round(mine, 2),
                "others": round(max(0.0, host - mine), 2), "pid1": round(init, 2), "top_others": top}  # fmt: skip


def pid_ticks(pid: int, tid: int | None = None) -> int:
    """utime + stime of a process (or one of its threads), clock ticks; 0 if it is gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        text = Path(path).read_text()
    except OSError:
        return 0
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def thread_ticks(pid: int) -> dict[int, int]:
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            out[int(tid)] = pid_ticks(pid, int(tid))
    return out


def idle_probe(node: Node, seconds: float) -> dict[str, Any]:
    """The daemon with no client but this probe: GET /v1/health every 50 ms (one at a time); the daemon's
    CPU split between its event-loop thread and its other threads; the host's busy cores and its PID 1."""
    import httpx

    from common import pct

    tick = os.sysconf("SC_CLK_TCK")
    th0, init0, host0, t0 = thread_ticks(node.pid), pid_ticks(1), host_busy_ticks(), time.monotonic()
    lat: list[float] = []
    with httpx.Client(base_url=node.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60) as c:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            c.get("/v1/health").raise_for_status()
            dt = time.perf_counter() - t
            lat.append(dt * 1000)
            time.sleep(max(0.0, 0.05 - dt))
    wall = time.monotonic() - t0
    th1 = thread_ticks(node.pid)
    main = (th1.get(node.pid, 0) - th0.get(node.pid, 0)) / tick / wall
    others = sum(v - th0.get(k, 0) for k, v in th1.items() if k != node.pid) / tick / wall
    return {
        "seconds": round(wall, 1),
        "probes": len(lat),
        "p50_ms": round(pct(lat, 0.5), 1),
        "p90_ms": round(pct(lat, 0.9), 1),
        "p99_ms": round(pct(lat, 0.99), 1),
        "max_ms": round(max(lat), 1),
        "over_50ms": sum(1 for x in lat if x > 50),
        "over_100ms": sum(1 for x in lat if x > 100),
        "daemon_main_cores": round(main, 2),
        "daemon_other_threads_cores": round(others, 2),
        "pid1_cores": round((pid_ticks(1) - init0) / tick / wall, 2),
        "host_cores": round((host_busy_ticks() - host0) / tick / wall, 2),
        "rss_mib": node.rss_mib(),
    }


# ================================================================================================
# The daemon and its sandboxes
# ================================================================================================


class Node:
    """A daemon of its own: TCP on 127.0.0.1:<free port> with an admin token, admission for `capacity`."""

    def __init__(self, root: Path, capacity: int) -> None:
        from common import IMAGES
        from sandfleet.daemon.node.process import DaemonProcess

        self.root = root
        self.socket = root / "sandfleet.sock"
        self.config = root / "config.toml"
        self.cgroup_parent = f"/sfbench-console-{root.name}"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config.write_text(
            f'socket = "{self.socket}"\nstate_dir = "{root / "state"}"\nrun_dir = "{root / "run"}"\n'
            f'image_dir = "{IMAGES}"\nstopped_retention = 0\n'
            f'tcp = "127.0.0.1:{self.port}"\n'
            # Admission: room for `capacity` tiny sandboxes (16 MiB limits, 0.01 CPU requests) with margin.
            f"max_sandboxes = {capacity + 500}\ncpu_overcommit = 256\nmemory_overcommit = 64\n"
            f'[[iam.tokens]]\nname = "{TOKEN_NAME}"\ntoken = "{TOKEN}"\nrole = "admin"\n'
            f'[container]\ncgroup_parent = "{self.cgroup_parent}"\n'
        )
        self.process = DaemonProcess(["--config", str(self.config)], workdir=root, log=root / "daemon.log")

    def start(self) -> None:
        self.process.start(120)

    @property
    def pid(self) -> int:
        return self.process.pid

    def rss_mib(self) -> float:
        from common import rss_kib

        return round(rss_kib(self.pid) / 1024, 1)

    def client(self, timeout: float = 600) -> Any:
        from sandfleet import Client

        return Client(self.socket, timeout=timeout)

    def stop_everything(self) -> dict[str, Any]:
        """Stop every sandbox (by label, then whatever is left), the daemon; remove its cgroups."""
        from common import remove_cgroup_tree

        out: dict[str, Any] = {}
        t = time.perf_counter()
        if self.process.started and self.process.alive():
            try:
                with self.client(timeout=900) as c:
                    out["stopped_by_label"] = len(c.stop_many(BASE_LABELS))
                    left = c.list()
                    for s in left:
                        with contextlib.suppress(Exception):
                            c.get(s.id).stop()
                    out["stopped_one_by_one"] = len(left)
            except Exception as exc:  # noqa: BLE001 - cleanup goes on whatever failed
                out["stop_error"] = f"{type(exc).__name__}: {exc}"
        out["stop_s"] = round(time.perf_counter() - t, 1)
        with contextlib.suppress(Exception):
            self.process.stop()
        out["cgroups_left"] = remove_cgroup_tree(self.cgroup_parent)
        return out


STEPPED_CPU = 0.1  # the CPU of the sandboxes trajectories run on: at 0.01 each step waits ~100 ms for its quota


def spec_for(i: int, cpu: float, memory: str, idle_ttl: float) -> Any:
    from sandfleet import Resources, SandboxSpec

    if i < TRAJECTORIES:
        cpu = max(cpu, STEPPED_CPU)
    return SandboxSpec(
        image="busybox",
        labels={**BASE_LABELS, "job": f"job-{i % JOBS}", "team": "ab"[i % 2]},
        resources=Resources(cpu=cpu, memory=memory),
        idle_ttl=idle_ttl,
    )


def create_sandboxes(
    node: Node, out: dict[str, Any], first: int, stop: int, batch: int, cpu: float, memory: str, idle_ttl: float
) -> None:
    """Sandboxes number `first` to `stop - 1`, `batch` specs to a create_many call; figures added to `out`."""
    from common import mem_available_kib
    from sandfleet.errors import SandboxError

    out.setdefault("rss_before_mib", node.rss_mib())
    out.update(requested=stop, batch=batch, cpu=cpu, memory=memory, idle_ttl=idle_ttl)
    made: list[str] = out.setdefault("ids", [])
    errors: dict[str, int] = out.setdefault("errors", {})
    batches: list[dict[str, Any]] = out.setdefault("batches", [])
    avail0 = mem_available_kib()
    t0 = time.perf_counter()
    with node.client(timeout=900) as fleet:
        for start in range(first, stop, batch):
            specs = [spec_for(i, cpu, memory, idle_ttl) for i in range(start, min(stop, start + batch))]
            t = time.perf_counter()
            results = fleet.create_many(specs, concurrency=32, retry_for=30)
            dt = time.perf_counter() - t
            ok = [r.id for r in results if not isinstance(r, SandboxError)]
            for r in results:
                if isinstance(r, SandboxError):
                    key = f"{type(r).__name__}: {str(r)[:200]}"
                    errors[key] = errors.get(key, 0) + 1
            made += ok
            batches.append({"first": start, "n": len(specs), "ok": len(ok), "s": round(dt, 2)})
            print(
                f"  created {len(made)}/{stop}  (batch of {len(specs)}: {dt:.1f} s, {len(specs) / dt:.0f}/s; "
                f"daemon RSS {node.rss_mib()} MiB)",
                flush=True,
            )
            if len(ok) < len(specs) and not ok:
                print("  a whole batch failed: stopping here", flush=True)
                break
        seconds = time.perf_counter() - t0
        live = len(fleet.list())
    out["seconds"] = round(out.get("seconds", 0) + seconds, 1)
    out["made"] = len(made)
    out["live"] = live
    out["per_s"] = round(len(made) / out["seconds"], 1) if out["seconds"] else None
    out["rss_after_mib"] = node.rss_mib()
    used = (avail0 - mem_available_kib()) / 1024
    out["host_memory_used_mib"] = round(out.get("host_memory_used_mib", 0) + used, 1)


def record_steps(node: Node, out: dict[str, Any], ids: list[str], trajectories: int, steps: int) -> None:
    """`trajectories` trajectories on the first sandboxes made (labelled with their sandbox's job),
    `steps` steps each (commands; every tenth fails with exit 1, the agent's fault), 16 at a time, every
    other one closed (its sandbox kept): what the job and trajectory pages show. Figures added to `out`."""
    from concurrent.futures import ThreadPoolExecutor

    from sandfleet.models import ExecAction, ExecRequest

    def one(i: int) -> float:
        with node.client() as fleet:
            sandbox = fleet.get(ids[i])
            labels = {**BASE_LABELS, "job": sandbox.info.spec.labels["job"]}
            traj = fleet.trajectory(f"bench-{i}", sandbox_id=ids[i], labels=labels)
            t = time.perf_counter()
            for k in range(steps):
                command = "exit 1" if k % 10 == 9 else f"echo step {k}"
                traj.step(ExecAction(exec=ExecRequest(command=command)), step=k)
            if i % 2:  # half of them done (a rollout that ended: read from its log when asked)
                traj.close(stop_sandbox=False)
            return time.perf_counter() - t

    n = min(trajectories, len(ids))
    t0 = time.perf_counter()
    done = 0
    with ThreadPoolExecutor(16) as pool:
        for _ in pool.map(one, range(n)):
            done += 1
            if done % max(1, n // 10) == 0:
                rate = done * steps / (time.perf_counter() - t0)
                print(f"  trajectories {done}/{n} ({rate:.0f} steps/s)", flush=True)
    seconds = time.perf_counter() - t0
    out.update(trajectories=n, steps_each=steps, steps=n * steps, seconds=round(seconds, 1))
    out["steps_per_s"] = round(n * steps / seconds, 1) if seconds else None
    global RECORDED
    RECORDED = True
    out["rss_after_mib"] = node.rss_mib()


# ================================================================================================
# The API calls, from Python
# ================================================================================================

AUDIT_WINDOWS = (10, 120, 3600, 86400, None)  # pages/audit.js: WINDOWS
AUDIT_SHOWN = 300
AUDIT_PAGE = 5000


def api_calls(sandbox_id: str) -> list[tuple[str, str, str]]:
    """(name, the page that makes it, path) of each single call timed."""
    sid = quote(sandbox_id)
    job = quote(f"job={FILTER_JOB}")
    return [
        ("GET /v1/whoami", "every page (sign-in)", "/v1/whoami"),
        ("GET /v1/health", "node", "/v1/health"),
        ("GET /v1/node/load", "node", "/v1/node/load"),
        ("GET /v1/sandboxes?state=live&limit=200", "sandboxes", "/v1/sandboxes?state=live&limit=200"),
        (
            f"GET /v1/sandboxes?label=job={FILTER_JOB}&state=live&limit=200",
            "filtered list",
            f"/v1/sandboxes?label={job}&state=live&limit=200",
        ),
        ("GET /v1/jobs?key=job&state=live", "jobs", "/v1/jobs?key=job&state=live"),
        (
            "GET /v1/sandboxes?state=live&limit=1000",
            "(the jobs page before /v1/jobs: one of its pages)",
            "/v1/sandboxes?state=live&limit=1000",
        ),
        ("GET /v1/sandboxes?state=live (all, no paging)", "(none: the SDK's list())", "/v1/sandboxes?state=live"),
        ("GET /v1/sandboxes/{id}", "sandbox", f"/v1/sandboxes/{sid}"),
        ("GET /v1/sandboxes/{id}/usage", "sandbox", f"/v1/sandboxes/{sid}/usage"),
        (
            "GET /v1/sandboxes/{id}/events?after=0&limit=1000",
            "sandbox",
            f"/v1/sandboxes/{sid}/events?after=0&limit=1000",
        ),
        ("GET /v1/sandboxes/{id}/files/list?path=/", "sandbox", f"/v1/sandboxes/{sid}/files/list?path=%2F"),
        ("GET /v1/images", "images", "/v1/images"),
        ("GET /console/ (index.html)", "every cold load", "/console/"),
        ("GET /console/static/app.js", "every cold load", "/console/static/app.js"),
        (
            "GET /console/static/vendor/xterm.js",
            "a cold load that needs it (the terminal)",
            "/console/static/vendor/xterm.js",
        ),
        ("GET /v1/audit?newest=true&limit=300", "audit", "/v1/audit?newest=true&limit=300"),
        (f"GET /v1/jobs/{FILTER_JOB}", "job", f"/v1/jobs/{FILTER_JOB}"),
        (f"GET /v1/trajectories?label=job={FILTER_JOB}&limit=200", "job", f"/v1/trajectories?label={job}&limit=200"),
        ("GET /v1/trajectories/{id}", "trajectory", f"/v1/trajectories/{TRAJECTORY}"),
        ("GET /v1/trajectories/{id}/steps", "trajectory", f"/v1/trajectories/{TRAJECTORY}/steps"),
        ("GET /v1/trajectories/{id}/record", "trajectory", f"/v1/trajectories/{TRAJECTORY}/record"),
        ("GET /v1/alerts", "alerts, every page (its badge)", "/v1/alerts"),
    ]


def list_all_pages(c: Any) -> tuple[int, int]:
    """What the jobs page does (api.js listAllSandboxes): pages of 1000 with the cursor. (calls, bytes)."""
    after = None
    calls = size = 0
    while True:
        params: dict[str, Any] = {"state": "live", "limit": 1000}
        if after:
            params["after"] = after
        r = c.get("/v1/sandboxes", params=params)
        r.raise_for_status()
        calls += 1
        size += len(r.content)
        page = r.json()
        after = page.get("next")
        if not after:
            return calls, size


def audit_newest(c: Any) -> tuple[int, int]:
    """What the audit page does first (pages/audit.js newest()): the shortest window back from now that
    holds 300 records, each window read to its end in pages of 5000. (calls, bytes)."""
    calls = size = 0
    for seconds in AUDIT_WINDOWS:
        params: dict[str, Any] = {"since": 0, "limit": AUDIT_PAGE}
        if seconds:
            params["since_time"] = math.floor(time.time() - seconds)
        since, tail = 0, 0
        for _ in range(20):
            params["since"] = since
            r = c.get("/v1/audit", params=params)
            r.raise_for_status()
            calls += 1
            size += len(r.content)
            page = r.json()
            tail = min(AUDIT_SHOWN, tail + len(page["records"]))
            since = page["last_seq"]
            if len(page["records"]) < AUDIT_PAGE:
                break
        if tail >= AUDIT_SHOWN:
            break
    return calls, size


def time_api(node: Node, sandbox_id: str, rounds: int) -> list[dict[str, Any]]:
    import httpx

    out = []
    with httpx.Client(base_url=node.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=120) as c:

        def one(path: str) -> tuple[int, int]:
            r = c.get(path)
            if r.status_code == 404 and r.json().get("error", {}).get("code") != "not_found":
                raise LookupError(path)  # a route this daemon does not have (not a sandbox that is gone)
            r.raise_for_status()
            return 1, len(r.content)

        timed: list[tuple[str, str, Any]] = [
            (n, p, lambda path=path: one(path)) for n, p, path in with_steps(api_calls(sandbox_id))
        ]
        timed.insert(
            8,
            (
                "every live sandbox, pages of 1000 with the cursor (api.js listAllSandboxes)",
                "(the jobs page before /v1/jobs)",
                lambda: list_all_pages(c),
            ),
        )
        timed.append(
            (
                "windows of 10 s, 120 s, 1 h ... back from now until 300 records",
                "(the audit page before newest=true)",
                lambda: audit_newest(c),
            )
        )
        timed.append(
            (
                "GET /v1/audit?since=0&since_time=<now-10s>&limit=5000",
                "(the audit page before newest=true: its first call)",
                lambda: one(f"/v1/audit?since=0&since_time={math.floor(time.time() - 10)}&limit={AUDIT_PAGE}"),
            )
        )
        for name, page, fn in timed:
            try:
                for _ in range(3):
                    fn()
            except (LookupError, httpx.HTTPStatusError) as exc:
                out.append({"name": name, "page": page, "missing": f"{type(exc).__name__}: {exc}"[:200]})
                print(f"  {name}: not served here ({exc})", flush=True)
                continue
            ms = []
            calls = size = 0
            for _ in range(rounds):
                t = time.perf_counter()
                calls, size = fn()
                ms.append((time.perf_counter() - t) * 1000)
            row = {"name": name, "page": page, "calls": calls, "bytes": size, **summary(ms)}
            out.append(row)
            print(f"  {name}: p50 {row['p50_ms']} ms, p90 {row['p90_ms']} ms ({calls} calls, {size} bytes)", flush=True)
    return out


def profile_calls(node: Node, paths: list[str], seconds: float, root: Path) -> dict[str, Any]:
    """py-spy on the daemon while these calls run one after another, in a loop: where its time goes."""
    import httpx

    spy = shutil.which("py-spy")
    if not spy:
        return {"error": "py-spy is not installed"}
    raw = root / "daemon.pyspy.txt"
    p = subprocess.Popen(
        [spy, "record", "--pid", str(node.pid), "--duration", str(int(seconds)), "--rate", "250", "--nonblocking",
         "--full-filenames", "--format", "raw", "--output", str(raw)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    stop = threading.Event()
    done = collections.Counter[str]()

    def load() -> None:
        with httpx.Client(base_url=node.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=120) as c:
            while not stop.is_set() and not paths:
                stop.wait(0.1)
            while not stop.is_set():
                for path in paths:
                    c.get(path)
                    done[path] += 1

    th = threading.Thread(target=load, daemon=True)
    time.sleep(0.5)
    th.start()
    try:
        p.wait(seconds + 30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    stop.set()
    th.join(60)
    if not raw.exists():
        return {"error": "py-spy wrote nothing"}
    res = summarise_pyspy(raw)
    res["calls"] = dict(done)
    res["seconds"] = seconds
    return res


def summarise_pyspy(raw: Path) -> dict[str, Any]:
    """Collapsed stacks -> share of busy samples: leaf functions, and functions anywhere on the stack."""
    frame_re = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")
    total = 0
    leaves: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    entry = ("sandfleet/cli.py", "sandfleet/__main__.py")
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = [(m.group(1), m.group(2)) for f in stack.split(";") if (m := frame_re.match(f.strip()))]
        if not frames:
            continue
        total += n

        def where(path: str) -> str:
            for part in ("sandfleet/", "pydantic", "starlette/", "fastapi/", "uvicorn/", "asyncio/", "json/", "sqlite"):
                i = path.find(part)
                if i >= 0:
                    return path[i:]
            return Path(path).name

        fn, path = frames[-1]
        leaves[f"{fn} ({where(path)})"] += n
        worker = any(f.endswith("_worker") and p.endswith("thread.py") for f, p in frames)
        monitor = any(f.endswith("_read_all") and p.endswith("monitor.py") for f, p in frames)
        threads["a worker thread: the monitor's sweep" if monitor else "a worker thread: other" if worker
                else "the event-loop thread"] += n  # fmt: skip
        for f in {
            f"{fn} ({where(p)})" for fn, p in frames if ("sandfleet/" in p or "pydantic" in p) and not p.endswith(entry)
        }:
            incl[f] += n

    def share(c: collections.Counter[str], k: int) -> list[tuple[str, float]]:
        return [(name, round(100 * v / total, 1)) for name, v in c.most_common(k)] if total else []

    return {"samples": total, "leaves": share(leaves, 15), "inclusive": share(incl, 25), "threads": share(threads, 5)}


# ================================================================================================
# The browser
# ================================================================================================

INIT_SCRIPT = """
(() => {
  try { sessionStorage.setItem(%(key)s, %(token)s); } catch (e) {}
  try { performance.setResourceTimingBufferSize(20000); } catch (e) {}
  const MARKERS = %(markers)s;
  const b = (window.__bench = { dom: {}, painted: {}, long: [] });
  try {
    new PerformanceObserver((l) => { for (const e of l.getEntries()) b.long.push([e.startTime, e.duration]); })
      .observe({ type: "longtask", buffered: true });
  } catch (e) {}
  const afterPaint = (fn) => requestAnimationFrame(() => {
    const ch = new MessageChannel();
    ch.port1.onmessage = fn;
    ch.port2.postMessage(0);
  });
  const check = () => {
    for (const [name, spec] of Object.entries(MARKERS)) {
      if (b.dom[name] !== undefined) continue;
      const [sel, re] = Array.isArray(spec) ? spec : [spec, null];
      const el = document.querySelector(sel);
      if (!el || (re && !new RegExp(re).test(el.textContent))) continue;
      const gen = b.gen;
      b.dom[name] = performance.now();
      afterPaint(() => { if (b.gen === gen) b.painted[name] = performance.now(); });
    }
  };
  b.gen = 0;
  b.reset = () => { b.gen += 1; b.dom = {}; b.painted = {}; b.long = []; performance.clearResourceTimings(); };
  new MutationObserver(check).observe(document, {
    childList: true, subtree: true, characterData: true, attributes: true, attributeFilter: ["hidden"],
  });
})();
"""

# What one load's timings are read as (browser clock, ms): the marks, the fetches, the navigation.
COLLECT = """
(t0) => {
  const b = window.__bench;
  const rel = (x) => (x === undefined ? null : x - t0);
  const marks = {};
  for (const k of Object.keys(b.dom)) marks[k] = { dom: rel(b.dom[k]), painted: rel(b.painted[k]) };
  const res = performance.getEntriesByType("resource").map((e) => ({
    url: e.name.replace(location.origin, ""), type: e.initiatorType, start: e.startTime - t0,
    end: e.responseEnd - t0, ttfb: e.responseStart - e.requestStart, size: e.encodedBodySize,
    transfer: e.transferSize,
  }));
  const long = b.long.map(([s, d]) => [s - t0, d]);
  const nav = performance.getEntriesByType("navigation")[0];
  const navt = nav && t0 === 0
    ? { doc_end: nav.responseEnd, dcl: nav.domContentLoadedEventEnd, load: nav.loadEventEnd } : null;
  const err = document.getElementById("error");
  return {
    marks, res, long, nav: navt,
    error: err && !err.hidden ? document.getElementById("error-text").textContent : null,
    login: !document.getElementById("login").hidden,
    term: document.getElementById("term-status")?.textContent ?? null,
    rows: document.querySelectorAll("#sandboxes tbody tr[data-id]").length,
  };
}
"""


def with_steps(items: list[tuple[str, ...]]) -> list[Any]:
    """The calls or pages: those of trajectories only once `record_steps` has made them."""
    return [x for x in items if RECORDED or not any("trajector" in part for part in x)]


def page_list(sandbox_id: str) -> list[tuple[str, str, str, str]]:
    """(name, hash, marker key, what it waits on)."""
    return [
        ("node", "#/", "node", "GET /v1/health + /v1/node/load, then its cards (`#node-live`)"),
        ("sandboxes", "#/sandboxes", "list", "a page of 200 live sandboxes (`#sandboxes tbody tr[data-id]`)"),
        (
            f"sandboxes, label job={FILTER_JOB}",
            "#/sandboxes?" + "label=" + quote(f"job={FILTER_JOB}"),
            "list",
            f"the {FILTER_JOB} rows (`#sandboxes tbody tr[data-id]`)",
        ),
        (
            "one sandbox",
            f"#/sandboxes/{quote(sandbox_id)}",
            "sandbox",
            "its head and spec (`#sb-id`); later parts below",
        ),
        (
            "jobs",
            "#/jobs",
            "jobs",
            "its table of jobs, one row per value of label `job` (`#jobs-table tbody tr[data-job]`)",
        ),
        ("images", "#/images", "images", "GET /v1/images (`#images-table tbody tr`)"),
        ("audit", "#/audit", "audit", "the newest audit records (`#audit-table tbody tr`)"),
        (
            f"job {FILTER_JOB}",
            f"#/jobs/{FILTER_JOB}",
            "job",
            "GET /v1/jobs/{job}: its figures, charts and slowest sandboxes (`#slowest-table tbody tr[data-id]`)",
        ),
        (
            "one trajectory",
            f"#/trajectories/{TRAJECTORY}",
            "trajectory",
            "its info, steps and record (`#steps-table tbody tr.step-row`)",
        ),
        ("alerts", "#/alerts", "alerts", "GET /v1/alerts (`#alerts-table`)"),
    ]


class Browser:
    def __init__(self, pw: Any, url: str, timeout_ms: float) -> None:
        self.url = url
        self.timeout_ms = timeout_ms
        self.browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        self.version = self.browser.version
        self.script = INIT_SCRIPT % {
            "key": json.dumps(TOKEN_KEY),
            "token": json.dumps(TOKEN),
            "markers": json.dumps({k: list(v) if isinstance(v, tuple) else v for k, v in MARKERS.items()}),
        }
        self.problems: list[str] = []
        self.tab_context, self.tab, self.tab_cdp = self.new_tab()

    def new_tab(self) -> tuple[Any, Any, Any]:
        ctx = self.browser.new_context(viewport={"width": 1440, "height": 1000})
        ctx.add_init_script(self.script)
        page = ctx.new_page()
        page.set_default_timeout(self.timeout_ms)
        page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        cdp = ctx.new_cdp_session(page)
        cdp.send("Performance.enable")
        return ctx, page, cdp

    @staticmethod
    def metrics(cdp: Any) -> dict[str, float]:
        """The renderer's main-thread time so far (CDP Performance.getMetrics), ms."""
        try:
            m = {x["name"]: x["value"] for x in cdp.send("Performance.getMetrics")["metrics"]}
        except Exception:  # noqa: BLE001 - a figure less, not a failed load
            return {}
        return {k: m.get(k, 0.0) * 1000 for k in MAIN_THREAD}

    @staticmethod
    def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        if not after:
            return {}
        if any(after[k] < before.get(k, 0.0) for k in after):  # a new renderer process: its own count
            return after
        return {k: after[k] - before.get(k, 0.0) for k in after}

    def wait(self, page: Any, key: str) -> None:
        page.wait_for_function("(k) => window.__bench && window.__bench.painted[k] !== undefined", arg=key)

    def wait_extra(self, page: Any) -> None:
        with contextlib.suppress(Exception):
            page.wait_for_function(
                "(ks) => ks.every((k) => window.__bench.painted[k] !== undefined)",
                arg=list(DETAIL_EXTRA),
                timeout=15000,
            )

    def cold(self, hash_: str, key: str, detail: bool) -> dict[str, Any]:
        ctx, page, cdp = self.new_tab()
        try:
            return self._load(page, cdp, hash_, key, detail)
        finally:
            ctx.close()

    def reload(self, hash_: str, key: str, detail: bool) -> dict[str, Any]:
        self.tab.goto("about:blank")
        return self._load(self.tab, self.tab_cdp, hash_, key, detail)

    def _load(self, page: Any, cdp: Any, hash_: str, key: str, detail: bool) -> dict[str, Any]:
        before = self.metrics(cdp)
        page.goto(f"{self.url}/console/{hash_}", wait_until="commit")
        self.wait(page, key)
        main = self.delta(self.metrics(cdp), before)
        if detail:
            self.wait_extra(page)
        return {**page.evaluate(COLLECT, 0), "main": main}

    def hash_nav(self, hash_: str, key: str, detail: bool) -> dict[str, Any]:
        page = self.tab
        if not page.url.startswith(f"{self.url}/console/"):
            page.goto(f"{self.url}/console/{BLANK}")
            page.locator("#whoami").wait_for(state="visible")
        page.evaluate("(h) => { location.hash = h; }", BLANK)
        page.locator("#app p.note").wait_for()
        page.wait_for_timeout(50)  # let the blank page settle (nothing polls on it)
        before = self.metrics(self.tab_cdp)
        t0 = page.evaluate(
            "(h) => { window.__bench.reset(); const t = performance.now(); location.hash = h; return t; }", hash_
        )
        self.wait(page, key)
        main = self.delta(self.metrics(self.tab_cdp), before)
        if detail:
            self.wait_extra(page)
        return {**page.evaluate(COLLECT, t0), "main": main}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.tab_context.close()
        with contextlib.suppress(Exception):
            self.browser.close()


def breakdown(load: dict[str, Any], key: str) -> dict[str, Any]:
    """One load: its marks, the API fetches made before the marker (each: start, end), the static files."""
    m = load["marks"].get(key) or {}
    dom, painted = m.get("dom"), m.get("painted")
    api = [r for r in load["res"] if r["url"].startswith("/v1/") and dom is not None and r["start"] <= dom]
    static = [r for r in load["res"] if r["url"].startswith("/console/") and dom is not None and r["start"] <= dom]
    # what the marker waited on: the calls that had ended when it appeared (a poll may have begun already)
    last_api_end = max((r["end"] for r in api if r["end"] <= dom), default=None)
    whoami = [r["end"] for r in api if r["url"].startswith("/v1/whoami")]
    return {
        "dom": dom,
        "painted": painted,
        "api": [(re.sub(r"sb-[0-9a-f]+", "{id}", r["url"]), r["start"], r["end"], r["size"]) for r in api],
        "static_n": len(static),
        "static_end": max((r["end"] for r in static), default=None),
        "static_bytes": sum(r["transfer"] or 0 for r in static),
        "static": [(r["url"], r["start"], r["end"], r["transfer"] or 0) for r in static],
        "whoami_end": whoami[0] if whoami else None,
        "long_ms": sum(d for st, d in load.get("long", []) if dom is not None and 0 <= st < dom),
        "long_n": sum(1 for st, _ in load.get("long", []) if dom is not None and 0 <= st < dom),
        "last_api_end": last_api_end,
        "draw_ms": (dom - last_api_end) if dom is not None and last_api_end is not None else None,
        "extra": {k: (load["marks"].get(k) or {}).get("painted") for k in DETAIL_EXTRA},
        "nav": load.get("nav"),
        "main": load.get("main") or {},
        "error": load.get("error"),
        "login": load.get("login"),
        "rows": load.get("rows"),
        "term": load.get("term"),
    }


def browse(node: Node, sandbox_id: str, rounds: int, modes: list[str], timeout_ms: float) -> dict[str, Any]:
    from playwright.sync_api import sync_playwright

    pages = with_steps(page_list(sandbox_id))
    out: dict[str, Any] = {"pages": [p[:4] for p in pages], "modes": modes, "loads": {}}
    with sync_playwright() as pw:
        b = Browser(pw, node.url, timeout_ms)
        out["browser"] = b.version
        try:
            for mode in modes:
                fn = {"cold": b.cold, "reload": b.reload, "hash": b.hash_nav}[mode]
                for r in range(rounds + 1):  # round 0: warm-up, not recorded
                    for name, hash_, key, _ in pages:
                        try:
                            load = fn(hash_, key, name == "one sandbox")
                            row = breakdown(load, key)
                        except Exception as exc:  # noqa: BLE001 - a page that never drew is a result too
                            row = {"failed": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
                        if r:
                            out["loads"].setdefault(mode, {}).setdefault(name, []).append(row)
                    if r:
                        line = ", ".join(
                            f"{n} {out['loads'][mode][n][-1].get('painted') or 'FAIL'!s:.6}" for n, *_ in pages
                        )
                        print(f"  {mode} round {r}: {line}", flush=True)
        finally:
            out["problems"] = b.problems[:50]
            b.close()
    return out


# ================================================================================================
# The report
# ================================================================================================


def fmt(x: float | None, digits: int = 0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def p50_of(xs: list[float | None]) -> float | None:
    from common import pct

    ys = [x for x in xs if x is not None]
    return round(pct(ys, 0.5), 1) if ys else None


def page_stats(rows: list[dict[str, Any]]) -> dict[str, Any]:
    from common import pct

    ok = [r for r in rows if "failed" not in r and r.get("painted") is not None]
    painted = [r["painted"] for r in ok]
    navs = [r.get("nav") or {} for r in ok]
    out = {
        "n": len(rows),
        "failed": [r["failed"] for r in rows if "failed" in r],
        "painted": summary(painted),
        "dom": summary([r["dom"] for r in ok]),
        "over": sum(1 for x in painted if x >= BUDGET_MS),
        "errors": sorted({r["error"] for r in ok if r.get("error")}),
        "draw_p50": p50_of([r["draw_ms"] for r in ok]),
        "last_api_end_p50": p50_of([r["last_api_end"] for r in ok]),
        "static_end_p50": p50_of([r["static_end"] for r in ok]),
        "whoami_end_p50": p50_of([r.get("whoami_end") for r in ok]),
        "doc_end_p50": p50_of([n.get("doc_end") for n in navs]),
        "dcl_p50": p50_of([n.get("dcl") or None for n in navs]),
        "long_ms_p50": p50_of([r.get("long_ms") for r in ok]),
        "long_n_p50": p50_of([r.get("long_n") for r in ok]),
        "static_kib_p50": p50_of([r.get("static_bytes", 0) / 1024 for r in ok]),
        "main_p50": {k: p50_of([r.get("main", {}).get(k) for r in ok]) for k in MAIN_THREAD},
        "rows_p50": pct([r["rows"] for r in ok], 0.5) if ok else None,
        "term": dict(collections.Counter(re.sub(r"\d+", "N", r["term"]) for r in ok if r.get("term"))),
    }
    # each API call the page made before drawing: its duration (end - start) and when it ended
    calls: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
    for r in ok:
        seen: collections.Counter[str] = collections.Counter()
        for url, s, e, size in r["api"]:
            base = re.sub(r"since_time=\d+", "since_time=<t>", url)
            base = re.sub(r"since=[1-9]\d*", "since=<last seq>", base)
            base = re.sub(r"after=[^&]+", "after=<cursor>", base) if "/events" not in base else base
            seen[base] += 1
            calls[f"{base}" + (f" (#{seen[base]})" if seen[base] > 1 else "")].append((e - s, e, size))
    out["calls"] = [
        {
            "call": k,
            "n": len(v),
            "dur_p50": round(pct([d for d, _, _ in v], 0.5), 1),
            "dur_max": round(max(d for d, _, _ in v), 1),
            "end_p50": round(pct([e for _, e, _ in v], 0.5), 1),
            "bytes": int(pct([b for _, _, b in v], 0.5)),
        }
        for k, v in calls.items()
    ]
    files: dict[str, list[tuple[float, float, int]]] = collections.defaultdict(list)
    for r in ok:
        for url, st, e, transfer in r.get("static", []):
            files[url].append((st, e, transfer))
    out["static"] = [
        {
            "file": k,
            "n": len(v),
            "start_p50": round(pct([st for st, _, _ in v], 0.5), 1),
            "end_p50": round(pct([e for _, e, _ in v], 0.5), 1),
            "dur_p50": round(pct([e - st for st, e, _ in v], 0.5), 1),
            "transfer": int(pct([t for _, _, t in v], 0.5)),
        }
        for k, v in files.items()
    ]
    if any(v is not None for r in ok for v in (r.get("extra") or {}).values()):
        out["extra"] = {
            k: summary([r["extra"][k] for r in ok if r.get("extra", {}).get(k) is not None]) for k in DETAIL_EXTRA
        }
    return out


MODE_TEXT = {
    "cold": "**cold**: a new browser context (empty cache, new tab), `page.goto(<url>/console/#/...)`; "
    "0 = navigation start",
    "reload": "**reload**: the same tab, `about:blank` then `page.goto` of the full URL (the static files "
    "revalidated: `Cache-Control: no-cache`, 304s); 0 = navigation start",
    "hash": "**hash**: in-app, from an empty route (`#/bench-blank`), `location.hash = ...` as a link does; "
    "0 = the hash set",
}


def _code_lines(res: dict[str, Any]) -> list[str]:
    a, b = res.get("code_before") or {}, res.get("code_after") or {}
    if not a:
        return []
    out = [
        f"Code measured: commit {a['commit']} with {a['changed_files']} files under src/ changed or new (a working "
        f"tree being edited); fingerprint of `src/sandfleet/console/static/` {a['console_static']} (newest file "
        f"{a['console_newest']}), of `src/sandfleet/**/*.py` {a['python_sources']} (newest {a['python_newest']}). "
        "The daemon runs the Python of the start; the browser loads the console's files as they are at each load.",
        "",
    ]
    if b and b["console_static"] != a["console_static"]:
        out += [
            f"**The console's files changed during the run** (after: {b['console_static']}, newest "
            f"{b['console_newest']}): page loads from before and after the change are mixed.",
            "",
        ]
    if b and b["python_sources"] != a["python_sources"]:
        out += [
            f"The Python sources changed during the run (after: {b['python_sources']}, newest {b['python_newest']}); "
            "the daemon and this script had loaded theirs at the start, so the figures are of the code above.",
            "",
        ]
    return out


def write_report(res: dict[str, Any], results: Path) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    m = res["meta"]
    c = res.get("create", {})
    L = [
        f"# sandfleet console: page loads with {c.get('live', '?')} sandboxes, {m['date']} "
        f"(commit {m['sandfleet_commit']})",
        "",
        f"Command: `{res['command']}` — the whole run took {fmt(res.get('wall_s'))} s.",
        "",
        *_code_lines(res),
        f"Host: {m['nproc']} cores ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, Python {m['python']}; "
        f"browser: headless Chromium {res.get('browse', {}).get('browser', '?')} (`{CHROMIUM}`, Playwright).",
        f"`uptime` before: `{res['uptime_before']}`",
        f"`uptime` after: `{res.get('uptime_after', '?')}`",
        "(A shared machine: other work may have run at the same time; the daemon, the browser and this script "
        "share its cores.)",
        "",
        *(
            [
                "Cores busy on the host during each phase (/proc/stat), and how many of them this benchmark's own "
                "processes used (script, daemon, sandboxes, Playwright, Chromium); *others* is other work on the "
                "machine at the same time:",
                "",
                "| phase | seconds | host cores busy | ours | others | of which the host's PID 1 "
                "| the others that used the most (cores) |",
                "|---|---|---|---|---|---|---|",
                *[
                    f"| {k} | {v['seconds']} | {v['host_cores']} | {v['ours']} | {v['others']} "
                    f"| {v.get('pid1', '–')} | " + ", ".join(f"`{n}` {c}" for n, c in v.get("top_others", [])) + " |"
                    for k, v in [
                        *(("baseline: " + k, v) for k, v in res.get("baseline", {}).get("cpu", {}).items()),
                        *res.get("cpu", {}).items(),
                    ]
                ],
                "",
            ]
            if res.get("cpu")
            else []
        ),
        "## Setup",
        "",
        "A daemon of its own (temp root, own socket/state/run dirs and cgroup parent; TCP on 127.0.0.1 with one "
        f"`[[iam.tokens]]` admin token; `max_sandboxes = {c.get('requested', 0) + 500}`, `cpu_overcommit = 256`, "
        "`memory_overcommit = 64`, `stopped_retention = 0`, no warm pool), the shared image store.",
        "",
    ]
    if c:
        stepped = res["params"].get("trajectories", 0)
        L += [
            f"Sandboxes: **{c['made']} of {c['requested']} made, {c['live']} live** when measured: real busybox "
            f'containers, `Resources(cpu={c["cpu"]}, memory="{c["memory"]}")` (the first {stepped}, which '
            f"trajectories run on: cpu={STEPPED_CPU}), `idle_ttl={c['idle_ttl']:.0f}`, labels "
            f"`bench=console`, `job=job-0..job-{JOBS - 1}` ({c['requested'] // JOBS} each), `team=a|b`. Made with the "
            f"sync SDK over the unix socket, `fleet.create_many(specs, concurrency=32, retry_for=30)` in calls of "
            f"{c['batch']} specs (the SDK sends 64 to a request, 2 requests in flight).",
            "",
            "| create | figure |",
            "|---|---|",
            f"| all {c['made']} made in | **{c['seconds']} s** ({c['per_s']} sandboxes/s) |",
            f"| first / last call of {c['batch']} | {c['batches'][0]['s']} s / {c['batches'][-1]['s']} s |",
            f"| daemon RSS before / after | {c['rss_before_mib']} MiB / **{c['rss_after_mib']} MiB** |",
            f"| daemon RSS after the page loads | {res.get('rss_end_mib', '?')} MiB |",
            f"| host memory used (MemAvailable delta) | {c['host_memory_used_mib']} MiB "
            f"({c['host_memory_used_mib'] / max(1, c['made']) * 1024:.0f} KiB per sandbox) |",
            f"| errors | {json.dumps(c['errors']) if c['errors'] else 'none'} |",
            "",
        ]
    st = res.get("steps")
    if st:
        L += [
            f"Trajectories: **{st['trajectories']} of {st['steps_each']} steps each, {st['steps']} steps recorded** "
            f"in {st['seconds']} s ({st['steps_per_s']} steps/s, 16 at a time), on the first sandboxes made, labelled "
            "with their sandbox's job; every tenth step `exit 1` (an agent failure), every other trajectory closed "
            f"(its log read again when asked). The trajectory page shows `{TRAJECTORY}` ({FILTER_JOB}); daemon RSS "
            f"after: {st['rss_after_mib']} MiB.",
            "",
        ]
    idle = [(x["live"], x["idle"]) for x in (res.get("baseline"), res) if x and x.get("idle")]
    if idle:
        L += [
            "## The daemon left alone",
            "",
            "Before the API and page timings: one client calls `GET /v1/health` every 50 ms (one at a time) "
            "and nothing else runs against the daemon. Its CPU is read per thread (/proc/<pid>/task): the "
            "event-loop thread, and the others (the monitor's sweep and other `asyncio.to_thread` work).",
            "",
            "| sandboxes | seconds | health p50 | p90 | p99 | max | over 50 ms / 100 ms | daemon event loop "
            "| daemon other threads | host busy | host PID 1 | daemon RSS |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for live, x in idle:
            L.append(
                f"| {live} | {x['seconds']} | {x['p50_ms']} ms | {x['p90_ms']} ms | {x['p99_ms']} ms "
                f"| {x['max_ms']} ms "
                f"| {x['over_50ms']} / {x['over_100ms']} of {x['probes']} | {x['daemon_main_cores']} cores "
                f"| {x['daemon_other_threads_cores']} cores | {x['host_cores']} cores | {x['pid1_cores']} cores "
                f"| {x['rss_mib']} MiB |"
            )
        L += [""]
    base = res.get("baseline")
    if base and base.get("page_stats") and res.get("page_stats"):
        L += [
            f"## {base['live']} against {res.get('live', '?')} sandboxes (same daemon, same run)",
            "",
            f"First with {base['live']} sandboxes ({base['rounds']} rounds), then with all of them "
            f"({res['rounds']} rounds). Painted, ms:",
            "",
            f"| page | mode | p50 with {base['live']} | p50 with {res['live']} | p90 with {base['live']} "
            f"| p90 with {res['live']} |",
            "|---|---|---|---|---|---|",
        ]
        for name, *_ in res["browse"]["pages"]:
            for mode in res["browse"]["modes"]:
                b0 = base["page_stats"].get(mode, {}).get(name, {}).get("painted", {})
                b1 = res["page_stats"][mode][name]["painted"]
                L.append(
                    f"| {name} | {mode} | {fmt(b0.get('p50_ms'))} | {fmt(b1.get('p50_ms'))} | {fmt(b0.get('p90_ms'))} "
                    f"| {fmt(b1.get('p90_ms'))} |"
                )
        L += [""]
    br = res.get("browse")
    if br:
        stats = res["page_stats"]
        L += [
            f"## Page loads with {res.get('live')} sandboxes ({res['rounds']} rounds each, after one warm-up round; "
            f"budget {BUDGET_MS:.0f} ms)",
            "",
            "The time is the browser's own clock (`performance.now()`), until the page's data is drawn: the page's "
            "marker element (below) is in the DOM (*dom*, a MutationObserver) and the frame after it has run "
            "(*painted*: requestAnimationFrame, then a task). The three ways a page is opened:",
            "",
            *[f"- {MODE_TEXT[mo]}" for mo in br["modes"]],
            "",
            "| page | marker (what it waited on) |",
            "|---|---|",
            *[
                f"| {name} (`{hash_ if len(hash_) < 40 else hash_[:30] + '…'}`) | {what} |"
                for name, hash_, _, what in br["pages"]
            ],
            "",
            "| page | mode | painted p50 | p90 | max | dom p50 | loads over 300 ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, *_ in br["pages"]:
            for mode in br["modes"]:
                s = stats[mode][name]
                p = s["painted"]
                flag = "**" if p.get("p50_ms", 0) >= BUDGET_MS or p.get("p90_ms", 0) >= BUDGET_MS else ""
                L.append(
                    f"| {name} | {mode} | {flag}{fmt(p.get('p50_ms'))}{flag} | {fmt(p.get('p90_ms'))} "
                    f"| {fmt(p.get('max_ms'))} | {fmt(s['dom'].get('p50_ms'))} | {s['over']}/{s['n']}"
                    + (f" ({len(s['failed'])} failed)" if s["failed"] else "")
                    + " |"
                )
        L += [
            "",
            "### Where a load's time goes (p50 of each point, ms from the same 0)",
            "",
            "*HTML*: the document received; *static*: the last of the console's own files (CSS, scripts, ES "
            "modules) received; *DCL*: DOMContentLoaded (the document's scripts have run); "
            "*whoami*: the sign-in call done (the page's own calls start after it); *API*: the last call the "
            "page waited on done; *dom*: its data in the DOM; *painted*: the frame after. *Long tasks*: main-thread "
            "tasks over 50 ms before the marker (count, total ms). *Main thread*: the renderer's busy time until "
            "the marker (CDP Performance.getMetrics): all tasks / of which script / layout / style.",
            "",
            "| page | mode | HTML | static (KiB moved) | DCL | whoami | API | dom | painted | long tasks "
            "| main thread: tasks / script / layout / style |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, *_ in br["pages"]:
            for mode in br["modes"]:
                s = stats[mode][name]
                kib = f" ({fmt(s['static_kib_p50'])})" if s.get("static_end_p50") is not None else ""
                L.append(
                    f"| {name} | {mode} | {fmt(s['doc_end_p50'])} | {fmt(s['static_end_p50'])}{kib} | "
                    f"{fmt(s['dcl_p50'])} | {fmt(s['whoami_end_p50'])} | {fmt(s['last_api_end_p50'])} "
                    f"| {fmt(s['dom'].get('p50_ms'))} | {fmt(s['painted'].get('p50_ms'))} "
                    f"| {fmt(s['long_n_p50'])}, {fmt(s['long_ms_p50'])} | "
                    + " / ".join(fmt(s["main_p50"].get(k)) for k in MAIN_THREAD)
                    + " |"
                )
        L += [""]
        for mode in [mo for mo in ("cold", "reload") if mo in br["modes"]]:
            files: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
            for name, *_ in br["pages"]:
                for f in stats[mode][name].get("static", []):
                    files[f["file"]].append(f)
            if not files:
                continue
            L += [
                f"The console's files in a **{mode}** load (p50 over all its loads: requested at, received at, "
                "bytes over the wire):",
                "",
                "| file | requested | received | took | transfer bytes |",
                "|---|---|---|---|---|",
            ]

            def med(fs: list[dict[str, Any]], k: str) -> Any:
                return sorted(x[k] for x in fs)[len(fs) // 2]

            for file, fs in sorted(files.items(), key=lambda kv: med(kv[1], "start_p50")):
                L.append(
                    f"| `{file}` | {fmt(med(fs, 'start_p50'))} | {fmt(med(fs, 'end_p50'))} "
                    f"| {fmt(med(fs, 'dur_p50'))} | {med(fs, 'transfer'):,} |"
                )
            L += [""]
        det = {mo: stats[mo]["one sandbox"].get("extra") for mo in br["modes"]}
        if any(det.values()):
            L += [
                "The sandbox page's later parts (painted, ms from the same 0; they come after its head and spec):",
                "",
                "| mode | usage chart facts (`#usage-now dl`) | events (`#events table`) | files (`#files tbody tr`) "
                "| terminal connected (`#term-status`) |",
                "|---|---|---|---|---|",
            ]
            for mo, ex in det.items():
                if ex:
                    L.append(
                        f"| {mo} | "
                        + " | ".join(
                            f"{fmt(ex[k].get('p50_ms'))} / {fmt(ex[k].get('p90_ms'))} / {fmt(ex[k].get('max_ms'))}"
                            for k in DETAIL_EXTRA
                        )
                        + " |"
                    )
            L += ["", "(p50 / p90 / max)", ""]
            terms = {mo: stats[mo]["one sandbox"].get("term") for mo in br["modes"]}
            L += [
                "The terminal's status line when the load was read: "
                + "; ".join(f"{mo}: {json.dumps(t, ensure_ascii=False)}" for mo, t in terms.items() if t),
                "",
            ]
        L += [
            "### What each page waited on (the API calls it made before its marker, from Resource Timing)",
            "",
            "Duration = the fetch's responseEnd - startTime (p50 / max over the page's loads); *ends at* = when it "
            "finished, ms from the same 0 as above (p50). Calls of all three modes together.",
            "",
            "| page | call | loads | duration p50 | max | ends at (p50, hash / reload / cold) | response bytes |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, *_ in br["pages"]:
            merged: dict[str, dict[str, Any]] = {}
            for mode in br["modes"]:
                for cl in stats[mode][name]["calls"]:
                    e = merged.setdefault(cl["call"], {"n": 0, "dur": [], "max": 0.0, "end": {}, "bytes": cl["bytes"]})
                    e["n"] += cl["n"]
                    e["dur"].append(cl["dur_p50"])
                    e["max"] = max(e["max"], cl["dur_max"])
                    e["end"][mode] = cl["end_p50"]
            for call, e in merged.items():
                ends = " / ".join(fmt(e["end"].get(mo)) for mo in ("hash", "reload", "cold") if mo in br["modes"])
                L.append(
                    f"| {name} | `{call[:110]}` | {e['n']} | {fmt(sorted(e['dur'])[len(e['dur']) // 2], 1)} "
                    f"| {fmt(e['max'], 1)} | {ends} | {e['bytes']} |"
                )
        L += [""]
        errs = {
            f"{mo}/{n}": stats[mo][n]["errors"] + stats[mo][n]["failed"] for mo in br["modes"] for n, *_ in br["pages"]
        }
        errs = {k: v for k, v in errs.items() if v}
        if errs or br.get("problems"):
            L += ["Errors seen (the console's error banner, failed waits, page errors):", "", "```"]
            L += [f"{k}: {v}" for k, v in errs.items()] + [str(p) for p in br.get("problems", [])]
            L += ["```", ""]
    api = res.get("api")
    if api:
        L += [
            f"## The API calls, from Python ({res['api_rounds']} rounds each after 3 warm-up)",
            "",
            f"httpx.Client over TCP with the admin token, keep-alive, one call at a time, {res.get('live', '?')} live "
            "sandboxes. A row of several calls is the whole sequence (with the cursor, or window after window). "
            "Rows marked *before ...* are what an earlier version of the console called: kept for comparison.",
            "",
            "| call | page | calls | p50 ms | p90 ms | max ms | response bytes | p50 ms with "
            f"{(base or {}).get('live', '–')} sandboxes |",
            "|---|---|---|---|---|---|---|---|",
        ]
        before = {r["name"]: r for r in (base or {}).get("api", [])}
        for r in api:
            if "missing" in r:
                L.append(f"| `{r['name']}` | {r['page']} | – | not served by this daemon ({r['missing']}) | | | | |")
                continue
            flag = "**" if r["p50_ms"] >= BUDGET_MS / 3 else ""
            b = before.get(r["name"], {})
            L.append(
                f"| `{r['name']}` | {r['page']} | {r['calls']} | {flag}{r['p50_ms']}{flag} | {r['p90_ms']} "
                f"| {r['max_ms']} | {r['bytes']:,} | {b.get('p50_ms', '–')} |"
            )
        L += [""]
    prof = res.get("profile")
    if prof:
        L += ["## Where the daemon's time goes (py-spy)", ""]
        for name, pr in prof.items():
            if pr.get("error"):
                L += [f"{name}: {pr['error']}", ""]
                continue
            L += [
                f"**{name}**: {pr['samples']} busy samples at 250 Hz over {pr['seconds']} s"
                + (f" while one client called it in a loop ({sum(pr['calls'].values())} calls)" if pr["calls"] else "")
                + ". Where the samples were: "
                + ", ".join(f"{k} {v} %" for k, v in pr.get("threads", []))
                + ". Share of busy samples:",
                "",
                "| leaf function | % | sandfleet / pydantic function anywhere on the stack | % |",
                "|---|---|---|---|",
            ]
            inc = pr["inclusive"] + [("", "")] * 30
            for (a, x), (bb, y) in zip(pr["leaves"], inc, strict=False):
                L.append(f"| `{a}` | {x} | {'`' + bb + '`' if bb else ''} | {y} |")
            L += [""]
    if res.get("findings"):
        L += ["## Over the budget, and why", "", *res["findings"], ""]
    cl = res.get("cleanup")
    if cl:
        L += [
            "## Cleanup",
            "",
            f"Stopped {cl.get('stopped_by_label', '?')} by label (+{cl.get('stopped_one_by_one', '?')} one by one) in "
            f"{cl.get('stop_s')} s, the daemon stopped, cgroups left: {cl.get('cgroups_left') or 'none'}"
            + (f", error: {cl['stop_error']}" if cl.get("stop_error") else "")
            + ".",
            "",
        ]
    L += ["## Parameters", "", "```", json.dumps(res["params"], indent=1), "```", ""]
    out = results / "console.md"
    out.write_text("\n".join(L))
    (results / "console.json").write_text(json.dumps(res, indent=1, default=str))
    return out


def findings(res: dict[str, Any]) -> list[str]:
    """The pages over the budget, and which of their calls took the time."""
    out = []
    stats = res.get("page_stats", {})
    base = (res.get("baseline") or {}).get("page_stats", {})
    for mode, pages in stats.items():
        for name, s in pages.items():
            p = s["painted"]
            if not p.get("n") or p["p90_ms"] < BUDGET_MS:
                continue
            slow = sorted(s["calls"], key=lambda cl: -cl["dur_p50"])[:3]
            why = "; ".join(f"`{cl['call'][:90]}` {cl['dur_p50']} ms (ends at {cl['end_p50']})" for cl in slow)
            b = base.get(mode, {}).get(name, {}).get("painted", {})
            then = (
                f" (with {res['baseline']['live']} sandboxes: p50 {b['p50_ms']}, p90 {b['p90_ms']})"
                if b.get("n")
                else ""
            )
            out.append(
                f"- {name} ({mode}): painted p50 {p['p50_ms']} ms, p90 {p['p90_ms']} ms{then}. Its p50 timeline: HTML "
                f"{fmt(s['doc_end_p50'])}, static files {fmt(s['static_end_p50'])}, DCL {fmt(s['dcl_p50'])}, whoami "
                f"{fmt(s['whoami_end_p50'])}, the page's API calls {fmt(s['last_api_end_p50'])}, in the DOM "
                f"{fmt(s['dom'].get('p50_ms'))}, painted {fmt(p['p50_ms'])}; long tasks {fmt(s['long_n_p50'])} "
                f"({fmt(s['long_ms_p50'])} ms). Slowest calls: {why}."
            )
    return out


# ================================================================================================


def measure(node: Node, sandbox_id: str, a: argparse.Namespace, rounds: int, api_rounds: int) -> dict[str, Any]:
    """With the sandboxes there are now: the idle probe, the API calls, the page loads."""
    with node.client() as fleet:
        live = len(fleet.list())
    out: dict[str, Any] = {"live": live, "rounds": rounds, "api_rounds": api_rounds}
    time.sleep(2)
    print(f"idle probe ({a.idle_seconds:.0f} s):", flush=True)
    out["idle"] = idle_probe(node, a.idle_seconds)
    print(f"  {out['idle']}", flush=True)
    print("API calls:", flush=True)
    cpu = CpuWatch()
    out["api"] = time_api(node, sandbox_id, api_rounds)
    out["cpu"] = {"api": cpu.done()}
    print("page loads:", flush=True)
    modes = [m for m in a.modes.split(",") if m]
    cpu = CpuWatch()
    out["browse"] = browse(node, sandbox_id, rounds, modes, a.timeout_ms)
    out["cpu"]["pages"] = cpu.done()
    out["page_stats"] = {
        mode: {name: page_stats(rows) for name, rows in pages.items()} for mode, pages in out["browse"]["loads"].items()
    }
    return out


def _add_cpu(x: dict[str, Any], y: dict[str, Any]) -> dict[str, Any]:
    """Two phases' CPU figures as one (weighted by their seconds; the named others: the second's)."""
    t = x["seconds"] + y["seconds"]
    if not t:
        return y
    out = {
        k: round((x[k] * x["seconds"] + y[k] * y["seconds"]) / t, 2) for k in y if k not in ("seconds", "top_others")
    }
    return {**out, "seconds": round(t, 1), "top_others": y.get("top_others", [])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sandboxes", type=int, default=5000)
    p.add_argument("--batch", type=int, default=500, help="specs per create_many call")
    p.add_argument("--cpu", type=float, default=0.01, help="each sandbox's CPU limit (and request)")
    p.add_argument("--memory", default="16MiB", help="each sandbox's memory limit")
    p.add_argument("--idle-ttl", type=float, default=86400)
    p.add_argument("--trajectories", type=int, default=1000, help="trajectories recorded on the sandboxes")
    p.add_argument("--steps", type=int, default=100, help="steps each trajectory records")
    p.add_argument("--rounds", type=int, default=10, help="page loads per page and mode")
    p.add_argument("--baseline", type=int, default=200, help="first measure with this many sandboxes (0: no baseline)")
    p.add_argument("--baseline-rounds", type=int, default=5)
    p.add_argument("--idle-seconds", type=float, default=15, help="the idle probe's length")
    p.add_argument("--modes", default="cold,reload,hash")
    p.add_argument("--api-rounds", type=int, default=30)
    p.add_argument("--timeout-ms", type=float, default=20000, help="a page not drawn by then counts as failed")
    p.add_argument("--profile", action="store_true", help="py-spy the daemon on the slowest page calls")
    p.add_argument("--profile-seconds", type=float, default=10)
    p.add_argument("--dry", action="store_true", help="200 sandboxes, 3 rounds, results in a temp dir")
    p.add_argument("--results", type=Path)
    p.add_argument("--from-json", type=Path, help="only write the report again from a console.json of a run")
    a = p.parse_args()
    if a.from_json:
        print(f"wrote {write_report(json.loads(a.from_json.read_text()), a.results or a.from_json.parent)}")
        return 0
    if a.dry:
        a.sandboxes, a.rounds, a.api_rounds, a.batch = min(a.sandboxes, 400), 3, 5, 100
        a.trajectories, a.steps = min(a.trajectories, 40), min(a.steps, 20)
        a.baseline, a.baseline_rounds, a.idle_seconds = 100, 2, 5
    global TRAJECTORIES
    TRAJECTORIES = a.trajectories if a.steps else 0
    if os.geteuid() != 0:
        print("needs root (real container sandboxes)", file=sys.stderr)
        return 2
    from common import RESULTS
    from report import machine_info

    results = a.results or (Path(tempfile.mkdtemp(prefix="bench-console-results-")) if a.dry else RESULTS)
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "meta": machine_info(),
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "uptime_before": uptime(),
        "code_before": code_state(),
        "params": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "results"},
    }
    root = Path(tempfile.mkdtemp(prefix="bench-console-"))
    root.chmod(0o755)
    node = Node(root, a.sandboxes)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    ok = False
    try:
        node.start()
        print(f"daemon {node.pid} on {node.url} (root {root})", flush=True)
        res["create"] = {}
        first = min(a.baseline, a.sandboxes) if a.baseline else 0
        cpu = CpuWatch()
        if first:
            create_sandboxes(node, res["create"], 0, first, first, a.cpu, a.memory, a.idle_ttl)
        create_cpu = cpu.done()
        ids = res["create"].get("ids", [])
        # the sandbox the detail page shows: one of the filtered job's (job-7), made in the first batch
        sandbox_id = ids[7] if len(ids) > 7 else ids[0] if ids else None
        if sandbox_id:
            print(f"baseline: {first} sandboxes", flush=True)
            res["baseline"] = measure(node, sandbox_id, a, a.baseline_rounds, max(5, a.api_rounds // 3))
        cpu = CpuWatch()
        create_sandboxes(node, res["create"], first, a.sandboxes, a.batch, a.cpu, a.memory, a.idle_ttl)
        res["cpu"] = {"create": _add_cpu(create_cpu, cpu.done())}
        ids = res["create"].pop("ids")
        if not ids:
            raise RuntimeError(f"no sandbox could be made: {res['create']['errors']}")
        if a.trajectories and a.steps:
            print(f"recording {a.trajectories} trajectories of {a.steps} steps", flush=True)
            res["steps"] = {}
            cpu = CpuWatch()
            record_steps(node, res["steps"], ids, a.trajectories, a.steps)
            res["cpu"]["steps"] = cpu.done()
        sandbox_id = sandbox_id or ids[0]
        res["sandbox_id"] = sandbox_id
        print(f"with {res['create']['live']} sandboxes", flush=True)
        full = measure(node, sandbox_id, a, a.rounds, a.api_rounds)
        res["cpu"].update(full.pop("cpu"))
        res.update(full)
        res["rss_end_mib"] = node.rss_mib()
        res["findings"] = findings(res)
        if a.profile:
            sid = quote(sandbox_id)
            targets = {
                "the daemon alone (no requests)": [],
                "the jobs page's call (GET /v1/jobs?key=job&state=live)": ["/v1/jobs?key=job&state=live"],
                "the sandboxes page's call (GET /v1/sandboxes?state=live&limit=200)": [
                    "/v1/sandboxes?state=live&limit=200"
                ],
                "the audit page's call (GET /v1/audit?newest=true&limit=300)": ["/v1/audit?newest=true&limit=300"],
                "the sandbox page's calls (info, usage, events)": [
                    f"/v1/sandboxes/{sid}",
                    f"/v1/sandboxes/{sid}/usage",
                    f"/v1/sandboxes/{sid}/events?after=0&limit=1000",
                ],
            }
            res["profile"] = {
                name: profile_calls(node, paths, a.profile_seconds, root) for name, paths in targets.items()
            }
        ok = True
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # cleanup runs to its end
        print("cleaning up ...", flush=True)
        res["cleanup"] = node.stop_everything()
        print(f"  {res['cleanup']}", flush=True)
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            log = root / "daemon.log"
            keep = Path(tempfile.gettempdir()) / f"{root.name}-daemon.log"
            with contextlib.suppress(OSError):
                shutil.copy(log, keep)
                print(f"daemon log kept in {keep}", file=sys.stderr)
            shutil.rmtree(root, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    res["uptime_after"] = uptime()
    res["code_after"] = code_state()
    res["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(f"wrote {write_report(res, results)} ({res['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
