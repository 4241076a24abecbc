#!/usr/bin/env python3
"""Cluster mode's gateway, in one run: `python3 bench/cluster.py` (as root).

  G1) what a gateway adds to a create and an exec: one real node daemon (TCP, a token, a fixed
      node key) and one gateway (`sandfleet gateway`, a static `nodes` list naming that daemon);
      create(busybox) p50/p90 through the gateway against straight to the daemon's TCP API,
      alternating rounds (the order flips every round), each sandbox stopped untimed; then
      exec("echo hi") on one sandbox through either, alternating. Ray is not needed: the
      request path from gateway to node is the same one a Ray-discovered cluster uses.
  G2) creates/s one gateway places against N *null nodes*: emulated node APIs (in this file, all
      in one process of their own) that answer /v1/node/load and the create calls with valid
      answers while making nothing. A load generator (a third process, the SDK's lane over TCP, C
      requests in flight) sends creates for S seconds. The gateway is pinned to a core of its
      own; the null nodes and the load generator share the other. Reported: creates/s, the
      gateway's CPU seconds per 1,000 creates (/proc/<pid>/stat), each process's CPU use (which
      one was the bottleneck), and how evenly the creates spread over the nodes (max/mean).
      Then batches of 64 as the SDK's `create_many` writes them, over the same lane, and the SDK's
      `create_many` itself (its own CPU per sandbox shows in the load generator's column).
      A null backend measures the gateway only: never proof that anything works.
      Where the gateway's CPU goes: a separate pass of the same load with py-spy attached
      (if installed), samples grouped by package.
  R)  Ray's `ray.experimental.sandbox`, tried in the same run on a local Ray (in a child process,
      `ray.init(num_cpus=1, ...)`, RAY_AUTH_MODE=disabled): the exact error if it cannot run here;
      create/exec/delete timings if it can.

    python3 bench/cluster.py [--rounds 100] [--nodes 16] [--concurrency 64] [--seconds 10]
    python3 bench/cluster.py --dry        # small N, results in a temp dir unless --results

Results: bench/results/cluster.md. Every process and daemon it starts is stopped on the way out
(also on Ctrl-C, SIGTERM or a failure).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pydantic_core

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

TOKEN = "bench-cluster-" + "0123456789abcdef0123"  # the node's and the gateway's root token
DAEMON_KEY = "b10001"
NULL_BASE_KEY = 0xA00000
TICK = os.sysconf("SC_CLK_TCK")
PROBE_TAG = "SANDFLEET_BENCH_CLUSTER_PROBE"


# ================================================================================================
# The null node: a node's API that makes nothing (G2). Runs in its own process (`_null-nodes`).
# ================================================================================================


class NullNode:
    """One emulated node: answers load, creates and batches with valid JSON; counts what it "made"."""

    def __init__(self, key: str, capacity: int) -> None:
        self.key = key
        self.capacity = capacity
        self.live = 0
        self.created = 0
        self.acked = 0

    def load(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "group": "default",
            "labels": {},
            "draining": False,
            "sandboxes": self.live,
            "capacity": self.capacity,
            "tiers": ["container"],
            "images": ["busybox:latest"],
            "projects": {"": {"sandboxes": self.live, "cpu": float(self.live), "memory": self.live * 1024**3}}
            if self.live
            else {},
            "at": time.time(),
        }

    def sandbox(self, spec: dict[str, Any]) -> dict[str, Any]:
        self.live += 1
        self.created += 1
        now = time.time()
        return {
            "id": f"sb-{self.key}{secrets.token_hex(5)}",
            "state": "running",
            "spec": spec,
            "created_at": now,
            "last_active_at": now,
        }


class NullNodes:
    """A raw ASGI app serving every null node, one listening socket each (told apart by local port)."""

    def __init__(self, by_port: dict[int, NullNode], token: str) -> None:
        self.by_port = by_port
        self.auth = f"Bearer {token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        node = self.by_port[scope["server"][1]]
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        auth = dict(scope["headers"]).get(b"authorization")
        method, path = scope["method"], scope["path"]
        if auth != self.auth:
            data: Any
            status, data = 401, {"error": {"code": "unauthenticated", "message": "bad token"}}
        elif method == "GET" and path == "/v1/node/load":
            status, data = 200, node.load()
        elif method == "POST" and path == "/v1/sandboxes":
            status, data = 201, node.sandbox(pydantic_core.from_json(body))
        elif method == "POST" and path == "/v1/sandboxes/batch":
            specs = pydantic_core.from_json(body)["specs"]
            status, data = 200, {"results": [{"sandbox": node.sandbox(s)} for s in specs]}
        elif method == "GET" and path == "/v1/health":
            status, data = (
                200,
                {
                    "status": "ok",
                    "version": "null",
                    "sandboxes_running": node.live,
                    "backends": ["container"],
                    "pools": {},
                    "tiers": {"container": []},
                },
            )
        elif method == "POST" and path == "/v1/sandboxes/ack":  # the gateway's acks of what it passed on
            node.acked += len(pydantic_core.from_json(body)["sandboxes"])
            status, data = 200, {"ok": True}
        elif method == "GET" and path == "/_counts":
            status, data = 200, {n.key: n.created for n in self.by_port.values()}
        else:
            status, data = 404, {"error": {"code": "not_found", "message": f"null node: no {method} {path}"}}
        raw = pydantic_core.to_json(data)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": raw})


def null_nodes_main(n: int, ready: Path, capacity: int) -> None:
    import uvicorn

    from sandfleet.models import NodeLoad, SandboxInfo

    socks, by_port = [], {}
    for i in range(n):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # As a node daemon's listener (daemon/server.py): asyncio sets TCP_NODELAY only on sockets it
        # made, and without it each answer's body waited 40 ms for the gateway's delayed ACK of its
        # head (every single-create figure before 2026-12-06 was bound by that, not by the gateway).
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(1024)
        port = s.getsockname()[1]
        socks.append(s)
        by_port[port] = NullNode(f"{NULL_BASE_KEY + i:06x}", capacity)
    # What they answer is valid: checked once against the real models.
    probe = NullNode("abcdef", capacity)
    SandboxInfo.model_validate(probe.sandbox({"image": "busybox"}))
    NodeLoad.model_validate(probe.load())
    app = NullNodes(by_port, TOKEN)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=300,
            http="httptools",
            loop="asyncio",
        )
    )
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({by_port[p].key: f"http://127.0.0.1:{p}" for p in by_port}))
    tmp.rename(ready)
    asyncio.run(server.serve(sockets=socks))


# ================================================================================================
# The load generator (G2), in its own process (`_load`): prints GO when its window opens, END when it
# closes (the parent reads CPU then), then one JSON line.
# ================================================================================================


async def load_main(url: str, mode: str, concurrency: int, seconds: float, warmup: float, batch: int) -> None:
    import httpx

    from sandfleet.client import AsyncClient
    from sandfleet.models import SandboxSpec

    lat: list[float] = []
    made = errors = 0
    err_kinds: collections.Counter[str] = collections.Counter()
    measuring = False
    done = False
    window = [0.0, 0.0]

    if mode == "create_many":  # the SDK's own `create_many` (its CPU per sandbox is part of the figure)
        fleet = AsyncClient(url, token=TOKEN, timeout=60)
        specs = [SandboxSpec(image="busybox", labels={"bench": "cluster"})] * batch

        async def one(i: int) -> int:
            out = await fleet.create_many(specs, batch_size=batch, concurrency=16, retry_for=0.001)
            bad = [r for r in out if not hasattr(r, "id")]
            if bad:
                err_kinds[str(bad[0])[:120]] += len(bad)
            return len(out) - len(bad)

        closer: Any = fleet
    else:
        from sandfleet.client import _base as b
        from sandfleet.client._base import Call, lane

        # The SDK's lane over TCP (as the gateway's to its nodes): kept-alive connections. An httpx
        # client per worker cost the load generator ~0.5 ms of CPU per request, more than the
        # gateway, so it was the limit of the figure; the SDK's `create_many` (pydantic models of
        # every answer) kept the other core busy at ~35 us a sandbox, so the batches are also sent
        # as it writes them (`call_create_batch`, fresh idempotency keys each) without it.
        pool = lane.Lane[lane.AsyncConnection](
            url, {"authorization": f"Bearer {TOKEN}"}, limit=concurrency, idle=concurrency
        )
        spec = SandboxSpec(image="busybox", labels={"bench": "cluster"})
        where = httpx.URL(url)
        single = lane.encode(
            Call(
                "POST",
                "/v1/sandboxes",
                content=spec.model_dump_json(exclude_unset=True).encode(),
                headers={"content-type": "application/json"},
            ),
            pool.headers,
        )

        def connect() -> Any:
            return lane.AsyncConnection.open_tcp(where.host, where.port or 80, 10.0)

        async def one(i: int) -> int:
            if mode == "single":
                answer = await pool.call(single, connect, 60.0)
            else:
                keys = [b.new_idempotency_key() for _ in range(batch)]
                call = b.call_create_batch([spec] * batch, keys, 16, 60.0)
                answer = await pool.call(lane.encode(call, pool.headers), connect, 60.0)
            if answer is None or answer.status >= 300:
                raise RuntimeError("no connection free" if answer is None else f"HTTP {answer.status}")
            if mode == "single":
                return 1
            items = pydantic_core.from_json(answer.body)["results"]
            bad = [item for item in items if not item.get("sandbox")]
            if bad:
                err_kinds[json.dumps(bad[0])[:120]] += len(bad)
            return len(items) - len(bad)

        closer = contextlib.AsyncExitStack()
        closer.callback(pool.close)

    async def worker(i: int) -> None:
        nonlocal made, errors
        while not done:
            t = time.perf_counter()
            try:
                k = await one(i)
            except Exception as exc:  # counted, not fatal: the rate says what got through
                if measuring:
                    errors += 1
                    err_kinds[f"{type(exc).__name__}: {str(exc)[:120]}"] += 1
                continue
            end = time.perf_counter()
            if measuring:
                made += k
                lat.append(end - t)

    async with closer:
        tasks = [asyncio.create_task(worker(i)) for i in range(concurrency)]
        await asyncio.sleep(warmup)
        print("GO", flush=True)
        measuring = True
        window[0] = time.perf_counter()
        await asyncio.sleep(seconds)
        measuring = False
        window[1] = time.perf_counter()
        print("END", flush=True)
        done = True
        await asyncio.gather(*tasks, return_exceptions=True)
    from common import pct

    ms = [x * 1000 for x in lat]
    print(
        json.dumps(
            {
                "mode": mode,
                "concurrency": concurrency,
                "batch": batch if mode != "single" else 1,
                "window_s": round(window[1] - window[0], 3),
                "made": made,
                "requests": len(lat),
                "errors": errors,
                "error_kinds": dict(err_kinds.most_common(5)),
                "per_s": round(made / (window[1] - window[0]), 1),
                "latency_p50_ms": round(pct(ms, 0.5), 2),
                "latency_p90_ms": round(pct(ms, 0.9), 2),
                "latency_p99_ms": round(pct(ms, 0.99), 2),
            }
        ),
        flush=True,
    )


# ================================================================================================
# Ray's sandbox probe (`_ray-probe`), in its own process: ray.init, try, ray.shutdown.
# ================================================================================================


def ray_probe_main(out: Path, rounds: int, temp_dir: Path) -> None:
    from common import version_of

    res: dict[str, Any] = {
        "mkfs_erofs": version_of(["mkfs.erofs", "--version"]) or "not installed",
        "runsc": (version_of(["runsc", "--version"]) or "?") if shutil.which("runsc") else "not in PATH",
    }

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    try:
        import ray
        from ray.experimental import sandbox as rsb

        res["ray_version"] = ray.__version__
    except Exception as exc:
        res["error"] = f"import: {type(exc).__name__}: {exc}"
        save()
        return
    t = time.perf_counter()
    # A Ray of our own: ray.init() with no address attaches to the newest cluster on the box (its
    # <temp dir>/ray_current_cluster), which may be another user's; a temp dir of our own has none.
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        object_store_memory=80 * 1024**2,
        logging_level=40,
        log_to_driver=False,
        _temp_dir=str(temp_dir),
    )
    res["ray_init_s"] = round(time.perf_counter() - t, 2)
    save()
    try:
        creates: list[float] = []
        execs: list[float] = []
        deletes: list[float] = []
        for _ in range(rounds):
            t = time.perf_counter()
            h = rsb.create(image="busybox:latest", timeout_seconds=60)
            ray.get(h.get_instance_id.remote(), timeout=180)
            creates.append(time.perf_counter() - t)
            for _ in range(5):
                t = time.perf_counter()
                r = ray.get(h.exec.remote(["echo", "hi"]), timeout=60)
                execs.append(time.perf_counter() - t)
            res["exec_stdout"] = str(getattr(r, "stdout", r))[:80]
            t = time.perf_counter()
            ray.get(h.delete.remote(), timeout=60)
            deletes.append(time.perf_counter() - t)
            ray.kill(h)
        res["ran"] = True
        res["create_s"], res["exec_s"], res["delete_s"] = creates, execs, deletes
    except Exception as exc:
        text = str(exc)
        res["ran"] = False
        res["error_type"] = type(exc).__name__
        # The root cause (the actor's constructor failed): the Sandbox*Error line of Ray's traceback.
        cause = [ln.strip() for ln in text.splitlines() if re.match(r"\s*(ray\.\S+\.)?Sandbox\w*Error\b", ln.strip())]
        res["error"] = cause[-1] if cause else text.strip().splitlines()[-1] if text.strip() else repr(exc)
        res["error_full"] = text[-4000:]
    finally:
        t = time.perf_counter()
        ray.shutdown()
        res["ray_shutdown_s"] = round(time.perf_counter() - t, 2)
        save()


# ================================================================================================
# The parent: processes it owns, the phases, the report.
# ================================================================================================


class Procs:
    """Every child this run starts, each its own session (process group); all stopped by `close`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.items: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        argv: list[str],
        log: str,
        *,
        cpus: set[int] | None = None,
        stdout_pipe: bool = False,
        env: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        def pre() -> None:
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.root / log, "ab") as out:
            p = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if stdout_pipe else out,
                stderr=out,
                start_new_session=True,
                preexec_fn=pre,
                env=env,
            )
        self.items.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], grace: float = 5.0) -> None:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # whatever of its group is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
        if p.stdout:
            p.stdout.close()

    def close(self) -> None:
        for p in reversed(self.items):
            self.stop(p)
        self.items.clear()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def ticks(pid: int) -> int:
    from common import cpu_ticks

    try:
        return cpu_ticks(pid)
    except OSError:
        return 0


def start_gateway(
    procs: Procs, nodes: dict[str, str], name: str, *, cpus: set[int] | None = None, load_interval: float = 1.0
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = procs.root / f"{name}.toml"
    text = f'listen = "127.0.0.1:{port}"\nnode_token = "{TOKEN}"\ntoken = "{TOKEN}"\nload_interval = {load_interval}\n'
    for key, url in nodes.items():
        text += f'[[nodes]]\nkey = "{key}"\nurl = "{url}"\n'
    cfg.write_text(text)
    p = procs.start([sys.executable, "-m", "sandfleet", "gateway", "--config", str(cfg)], f"{name}.log", cpus=cpus)
    url = f"http://127.0.0.1:{port}"
    wait_alive(p, url, set(nodes), procs.root / f"{name}.log")
    return p, url


def wait_alive(p: subprocess.Popen[bytes], url: str, keys: set[str], log: Path, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"gateway exited ({p.returncode}): {log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            r = httpx.get(f"{url}/v1/cluster/nodes", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5)
            seen = {n["key"]: n["status"] for n in r.json()["nodes"]}
            if seen == dict.fromkeys(keys, "alive"):
                return
        time.sleep(0.2)
    raise RuntimeError(f"gateway not serving all nodes alive within {timeout}s: {log.read_text()[-3000:]}")


# -- G1 ------------------------------------------------------------------------------------------


def bench_overhead(procs: Procs, rounds: int, warmup: int, exec_rounds: int) -> dict[str, Any]:
    from common import Daemon, pct, remove_cgroup_tree, stats
    from sandfleet import Client

    root = Path(tempfile.mkdtemp(prefix="bench-cluster-daemon-"))
    root.chmod(0o755)
    parent = f"/sandfleet-bench-cluster-{root.name}"
    d = Daemon(root, parent)
    tcp = free_port()
    d.config.write_text(
        f'tcp = "127.0.0.1:{tcp}"\ntoken = "{TOKEN}"\nnode_key = "{DAEMON_KEY}"\n' + d.config.read_text()
    )
    direct_url = f"http://127.0.0.1:{tcp}"
    try:
        d.start()
        gw, gw_url = start_gateway(procs, {DAEMON_KEY: direct_url}, "g1-gateway")
        with Client(direct_url, token=TOKEN, timeout=120) as direct, Client(gw_url, token=TOKEN, timeout=120) as via:
            paths = {"gateway": via, "direct": direct}
            for _ in range(warmup):
                for c in paths.values():
                    c.create(image="busybox", labels={"bench": "cluster"}).stop()
            times: dict[str, list[float]] = {"gateway": [], "direct": []}
            for i in range(rounds):
                order = ("gateway", "direct") if i % 2 == 0 else ("direct", "gateway")
                for name in order:
                    t = time.perf_counter()
                    sb = paths[name].create(image="busybox", labels={"bench": "cluster"})
                    times[name].append(time.perf_counter() - t)
                    assert sb.id.startswith(f"sb-{DAEMON_KEY}"), sb.id
                    sb.stop()
            sb = direct.create(image="busybox", labels={"bench": "cluster"})
            handles = {"direct": sb, "gateway": via.get(sb.id)}
            ex: dict[str, list[float]] = {"gateway": [], "direct": []}
            for _ in range(20):
                for h in handles.values():
                    assert h.exec("echo hi").stdout.strip() == "hi"
            for i in range(exec_rounds):
                order = ("gateway", "direct") if i % 2 == 0 else ("direct", "gateway")
                for name in order:
                    t = time.perf_counter()
                    r = handles[name].exec("echo hi")
                    ex[name].append(time.perf_counter() - t)
                    assert r.exit_code == 0
            sb.stop()
        procs.stop(gw)
    finally:
        with contextlib.suppress(Exception):
            d.stop_sandboxes()
        with contextlib.suppress(Exception):
            d.stop()
        left = remove_cgroup_tree(parent)
        shutil.rmtree(root, ignore_errors=True)
        if left:
            print("cgroups left:", left)

    def summary(xs: dict[str, list[float]]) -> dict[str, Any]:
        g, dr = stats(xs["gateway"]), stats(xs["direct"])
        for s, raw in ((g, xs["gateway"]), (dr, xs["direct"])):
            s["p90_ms"] = round(pct([x * 1000 for x in raw], 0.9), 3)
            s.pop("samples_ms", None)
        paired = [(a - b) * 1000 for a, b in zip(xs["gateway"], xs["direct"], strict=True)]
        return {
            "gateway": g,
            "direct": dr,
            "delta_p50_ms": round(g["p50_ms"] - dr["p50_ms"], 3),
            "delta_p90_ms": round(g["p90_ms"] - dr["p90_ms"], 3),
            "ratio_p50": round(g["p50_ms"] / dr["p50_ms"], 3),
            "ratio_p90": round(g["p90_ms"] / dr["p90_ms"], 3),
            "paired_delta_p50_ms": round(pct(paired, 0.5), 3),
        }

    return {
        "rounds": rounds,
        "warmup": warmup,
        "exec_rounds": exec_rounds,
        "create": summary(times),
        "exec": summary(ex),
    }


# -- G2 ------------------------------------------------------------------------------------------


def start_null_nodes(procs: Procs, n: int, cpus: set[int] | None) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    ready = procs.root / f"null-{n}.json"
    p = procs.start(
        [sys.executable, str(HERE / "cluster.py"), "_null-nodes", "--n", str(n), "--ready", str(ready)],
        "null-nodes.log",
        cpus=cpus,
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"null nodes did not start: {(procs.root / 'null-nodes.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return p, json.loads(ready.read_text())


def null_counts(nodes: dict[str, str]) -> dict[str, int]:
    import httpx

    url = next(iter(nodes.values()))
    return dict(httpx.get(f"{url}/_counts", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json())


def drive(
    procs: Procs,
    gw: subprocess.Popen[bytes],
    null: subprocess.Popen[bytes],
    nodes: dict[str, str],
    url: str,
    mode: str,
    concurrency: int,
    seconds: float,
    batch: int,
    cpus: set[int] | None,
    during: Any = None,
) -> dict[str, Any]:
    """One load-generator run; the three processes' CPU over its window; the spread over the nodes."""
    lg = procs.start(
        [
            sys.executable,
            str(HERE / "cluster.py"),
            "_load",
            "--url",
            url,
            "--mode",
            mode,
            "--concurrency",
            str(concurrency),
            "--seconds",
            str(seconds),
            "--batch",
            str(batch),
        ],
        f"load-{mode}.log",
        cpus=cpus,
        stdout_pipe=True,
    )
    assert lg.stdout is not None
    pids = {"gateway": gw.pid, "null_nodes": null.pid, "load_generator": lg.pid}
    before: dict[str, int] = {}
    counts0: dict[str, int] = {}
    t0 = t1 = 0.0
    cpu: dict[str, float] = {}
    result: dict[str, Any] | None = None
    side = None
    for raw in lg.stdout:
        line = raw.decode().strip()
        if line == "GO":
            counts0 = null_counts(nodes)
            before = {k: ticks(p) for k, p in pids.items()}
            t0 = time.perf_counter()
            if during is not None:
                side = during()
        elif line == "END":
            t1 = time.perf_counter()
            cpu = {k: (ticks(p) - before[k]) / TICK for k, p in pids.items()}
        elif line.startswith("{"):
            result = json.loads(line)
    lg.wait(30)
    if result is None:
        raise RuntimeError(f"load generator failed: {(procs.root / f'load-{mode}.log').read_text()[-2000:]}")
    counts1 = null_counts(nodes)
    per_node = [counts1[k] - counts0.get(k, 0) for k in nodes]
    mean = sum(per_node) / len(per_node)
    wall = t1 - t0
    result["cpu_s"] = {k: round(v, 2) for k, v in cpu.items()}
    result["cpu_util"] = {k: round(v / wall, 2) for k, v in cpu.items()}
    made = max(1, result["made"])
    result["gateway_cpu_s_per_1000"] = round(cpu["gateway"] / made * 1000, 3)
    result["null_nodes_cpu_s_per_1000"] = round(cpu["null_nodes"] / made * 1000, 3)
    result["load_generator_cpu_s_per_1000"] = round(cpu["load_generator"] / made * 1000, 3)
    result["node_spread_max_over_mean"] = round(max(per_node) / mean, 3) if mean else None
    result["node_spread_min_over_mean"] = round(min(per_node) / mean, 3) if mean else None
    result["nodes_seen"] = sum(1 for x in per_node if x)
    result["null_nodes_counted"] = sum(per_node)
    if side is not None:
        result["side"] = side
    procs.items.remove(lg)
    if lg.stdout:
        lg.stdout.close()
    return result


def bench_throughput(
    procs: Procs, n: int, concurrency: int, seconds: float, batch: int, batch_callers: int, profile_s: float, few: int
) -> dict[str, Any]:
    ncpu = os.cpu_count() or 1
    gw_cpus = {ncpu - 1} if ncpu >= 2 else None
    rest = set(range(ncpu - 1)) if ncpu >= 2 else None
    null, nodes = start_null_nodes(procs, n, rest)
    gw, url = start_gateway(procs, nodes, "g2-gateway", cpus=gw_cpus)
    out: dict[str, Any] = {"nodes": n, "gateway_cpus": sorted(gw_cpus or []), "others_cpus": sorted(rest or [])}
    out["single"] = drive(procs, gw, null, nodes, url, "single", concurrency, seconds, 1, rest)
    print("G2 single", json.dumps(out["single"]), flush=True)
    # Batches as `create_many` writes them, sent over the lane (the gateway's limit, not the SDK's).
    out["lane_batch"] = drive(procs, gw, null, nodes, url, "lane_batch", batch_callers, seconds, batch, rest)
    print("G2 lane_batch", json.dumps(out["lane_batch"]), flush=True)
    out["create_many"] = drive(procs, gw, null, nodes, url, "create_many", batch_callers, seconds, batch, rest)
    print("G2 create_many", json.dumps(out["create_many"]), flush=True)
    spy = shutil.which("py-spy")
    if spy and profile_s > 0:
        raw = procs.root / "gateway.pyspy.txt"

        def attach() -> dict[str, Any]:
            p = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(gw.pid),
                    "--duration",
                    str(int(profile_s)),
                    "--rate",
                    "200",
                    "--nonblocking",
                    "--full-filenames",
                    "--format",
                    "raw",
                    "--output",
                    str(raw),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
            return {"pid": p.pid, "proc": p}

        prof = drive(procs, gw, null, nodes, url, "single", concurrency, profile_s + 1, 1, rest, during=attach)
        side = prof.pop("side")
        try:
            side["proc"].wait(profile_s + 30)
        except subprocess.TimeoutExpired:
            side["proc"].kill()
            side["proc"].wait()
        out["profile"] = {"run": prof, **summarise_pyspy(raw)} if raw.exists() else {"error": "py-spy wrote nothing"}
    else:
        out["profile"] = {"error": "py-spy not installed" if not spy else "skipped"}
    procs.stop(gw)
    procs.stop(null)
    if few:  # the same load on few nodes: many connections in each node's pool of the gateway
        null, nodes = start_null_nodes(procs, few, rest)
        gw, url = start_gateway(procs, nodes, "g2-gateway-few", cpus=gw_cpus)
        out["few"] = drive(procs, gw, null, nodes, url, "single", concurrency, seconds, 1, rest)
        out["few"]["nodes"] = few
        print("G2 few", json.dumps(out["few"]), flush=True)
        procs.stop(gw)
        procs.stop(null)
    return out


BUCKETS = [  # (name, what a frame's file path contains), first match wins for a leaf
    ("sandfleet.cluster.gateway", "sandfleet/cluster/gateway.py"),
    ("sandfleet.cluster.forward", "sandfleet/cluster/forward.py"),
    ("sandfleet.cluster.placement", "sandfleet/cluster/placement.py"),
    ("sandfleet.cluster.quotas", "sandfleet/cluster/quotas.py"),
    ("sandfleet.cluster.membership", "sandfleet/cluster/membership.py"),
    ("sandfleet (other)", "sandfleet/"),
    ("httpx", "/httpx/"),
    ("httpcore", "/httpcore/"),
    ("h11", "/h11/"),
    ("anyio", "/anyio/"),
    ("uvicorn", "/uvicorn/"),
    ("starlette", "/starlette/"),
    ("pydantic", "/pydantic"),
    ("prometheus_client", "/prometheus_client/"),
    ("json", "/json/"),
    ("asyncio", "/asyncio/"),
    ("ssl", "ssl.py"),
]


def bucket(path: str) -> str:
    for name, part in BUCKETS:
        if part in path:
            return name
    return "other: " + Path(path).name


def summarise_pyspy(raw: Path) -> dict[str, Any]:
    """py-spy's collapsed stacks: share of busy samples by package (self, and inclusive) and the top leaves."""
    frame_re = re.compile(r"^(.*) \((.*?)(?::\d+)?\)$")
    total = 0
    self_b: collections.Counter[str] = collections.Counter()
    incl_b: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()
    incl_fn: collections.Counter[str] = collections.Counter()
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        frames = []
        for f in stack.split(";"):
            m = frame_re.match(f.strip())
            if m:
                frames.append((m.group(1), m.group(2)))
        if not frames:
            continue
        total += n
        fn, path = frames[-1]
        self_b[bucket(path)] += n
        leaves[f"{fn} ({bucket(path)})"] += n
        for b in {bucket(p) for _, p in frames}:
            incl_b[b] += n
        entry = ("sandfleet/cli.py", "sandfleet/__main__.py", "sandfleet/cluster/cli.py", "sandfleet/cluster/server.py")
        for f in {f"{fn} ({Path(p).name})" for fn, p in frames if "sandfleet/" in p and not p.endswith(entry)}:
            incl_fn[f] += n

    def share(c: collections.Counter[str], k: int) -> list[tuple[str, float]]:
        return [(name, round(100 * v / total, 1)) for name, v in c.most_common(k)] if total else []

    return {
        "samples": total,
        "self": share(self_b, 14),
        "inclusive": share(incl_b, 14),
        "leaves": share(leaves, 15),
        "sandfleet_inclusive": share(incl_fn, 12),
    }


# -- R -------------------------------------------------------------------------------------------


def tagged_pids(tag: str) -> list[int]:
    out = []
    needle = f"{PROBE_TAG}={tag}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if needle in (d / "environ").read_bytes().split(b"\0"):
                out.append(int(d.name))
    return out


def bench_ray(procs: Procs, rounds: int, timeout: float) -> dict[str, Any]:
    out = procs.root / "ray-probe.json"
    tag = secrets.token_hex(6)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", PROBE_TAG: tag}
    t = time.perf_counter()
    temp_dir = Path(tempfile.mkdtemp(prefix="rb-", dir="/tmp"))  # short: Ray's unix socket paths live in it
    p = procs.start(
        [
            sys.executable,
            str(HERE / "cluster.py"),
            "_ray-probe",
            "--out",
            str(out),
            "--rounds",
            str(rounds),
            "--temp-dir",
            str(temp_dir),
        ],
        "ray-probe.log",
        env=env,
    )
    try:
        p.wait(timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    procs.stop(p, grace=20)
    procs.items.remove(p)
    wall = time.perf_counter() - t
    # Ray's own processes (gcs_server, raylet, workers, agents) carry the tag in their environment.
    left = tagged_pids(tag)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    time.sleep(0.5)
    shutil.rmtree(temp_dir, ignore_errors=True)
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"error": "the probe wrote nothing"}
    res.update(
        wall_s=round(wall, 1),
        timed_out=timed_out,
        exit_code=p.returncode,
        leftover_processes_killed=len(left),
        leftover_after_kill=len(tagged_pids(tag)),
    )
    if not out.exists() or "error" not in res and not res.get("ran"):
        res["log_tail"] = (procs.root / "ray-probe.log").read_text(errors="replace")[-2000:]
    return res


# -- report --------------------------------------------------------------------------------------


def write_report(res: dict[str, Any], results: Path) -> Path:
    results.mkdir(parents=True, exist_ok=True)
    m = res["meta"]
    L = [
        f"# sandfleet cluster gateway, {m['date']} (commit {m['sandfleet_commit']})",
        "",
        f"Command: `{res['command']}`",
        "",
        f"Host: {m['nproc']} cores ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, Python {m['python']}.",
        f"`uptime` before: `{res['uptime_before']}`",
        f"`uptime` after: `{res['uptime_after']}`",
        "(A shared machine: other work may have run at the same time.)",
        "",
    ]
    g1 = res.get("g1")
    if g1:
        c, e = g1["create"], g1["exec"]
        L += [
            "## G1: what the gateway adds to a call (one real node daemon)",
            "",
            f"One node daemon (TCP + token, node key `{DAEMON_KEY}`) and one gateway (static `nodes` list, "
            "no Ray: the gateway-to-node request path is the same). "
            f'create(image="busybox"), {g1["rounds"]} alternating rounds after {g1["warmup"]} warm-up each '
            "(order flips every round; only the create is timed, each sandbox stopped after). "
            f'exec("echo hi") on one sandbox, {g1["exec_rounds"]} alternating rounds after 20 warm-up. '
            "Client: the sync SDK `Client(url, token=...)` for both paths.",
            "",
            "| call | path | p50 ms | p90 ms | mean ms | p99 ms | min ms |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in (("create", c), ("exec", e)):
            for path in ("direct", "gateway"):
                x = s[path]
                label = "straight to the node (TCP)" if path == "direct" else "through the gateway"
                L.append(
                    f"| {name} | {label} | {x['p50_ms']:.2f} | {x['p90_ms']:.2f} | {x['mean_ms']:.2f} "
                    f"| {x['p99_ms']:.2f} | {x['min_ms']:.2f} |"
                )
        L += [
            "",
            "| call | overhead p50 | overhead p90 | ratio p50 | ratio p90 | median of paired differences | min - min |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in (("create", c), ("exec", e)):
            L.append(
                f"| {name} | {s['delta_p50_ms']:+.2f} ms | {s['delta_p90_ms']:+.2f} ms | {s['ratio_p50']:.3f} "
                f"| {s['ratio_p90']:.3f} | {s['paired_delta_p50_ms']:+.2f} ms "
                f"| {s['gateway']['min_ms'] - s['direct']['min_ms']:+.2f} ms |"
            )
        L += [
            "",
            "On a busy host the percentiles carry the host's noise (both paths share it, alternating); "
            "the difference of the minimums is the least-disturbed view of what the extra hop costs.",
            "",
        ]
    g2 = res.get("g2")
    if g2:
        s, b = g2["single"], g2["lane_batch"]
        L += [
            "## G2: creates one gateway places against null nodes",
            "",
            "**A null backend: this measures the gateway only, never that anything works.** "
            f"{g2['nodes']} null nodes (emulated node APIs defined in bench/cluster.py, all in one uvicorn "
            "process, one listening socket each) answer `GET /v1/node/load` (a valid NodeLoad with a live "
            'count of what they "made") and `POST /v1/sandboxes` / `/v1/sandboxes/batch` (valid SandboxInfo, '
            "id `sb-<key><10 hex>`) without making any sandbox. One gateway (`sandfleet gateway`, a static "
            f"`nodes` list, load_interval 1 s) pinned to CPU {g2['gateway_cpus']}; the null nodes and the load "
            f"generator share CPU {g2['others_cpus']}. Warm-up 1 s, then a {s['window_s']} s window.",
            "",
            "| run | rate | requests | errors | request p50 / p90 / p99 ms | gateway CPU s per 1,000 sandboxes "
            "| CPU use (cores): gateway / null nodes / load gen | spread over nodes max/mean (min/mean) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = [
            (f"single creates, kept-alive connections, {s['concurrency']} in flight", s),
            (f"batches of {b['batch']} as `create_many` writes them, {b['concurrency']} in flight", b),
        ]
        if g2.get("create_many"):
            c = g2["create_many"]
            rows.append((f"the SDK's `create_many` itself, batches of {c['batch']}, {c['concurrency']} callers", c))
        if g2.get("few"):
            f = g2["few"]
            rows.append((f"single creates, {f['concurrency']} in flight, on only {f['nodes']} null nodes", f))
        for name, r in rows:
            u = r["cpu_util"]
            L.append(
                f"| {name} | **{r['per_s']:.0f} sandboxes/s** | {r['requests']} | {r['errors']} "
                f"| {r['latency_p50_ms']} / {r['latency_p90_ms']} / {r['latency_p99_ms']} "
                f"| {r['gateway_cpu_s_per_1000']:.3f} | {u['gateway']} / {u['null_nodes']} / {u['load_generator']} "
                f"| {r['node_spread_max_over_mean']} ({r['node_spread_min_over_mean']}) |"
            )
        L += [""]
        for name, r in (("single", s), ("lane_batch", b), ("create_many", g2.get("create_many") or {})):
            if r.get("error_kinds"):
                L.append(f"Errors ({name}): `{json.dumps(r['error_kinds'])}`")
        gu = s["cpu_util"]["gateway"]
        shared = round(s["cpu_util"]["null_nodes"] + s["cpu_util"]["load_generator"], 2)
        if gu >= 0.85:
            bound = f"the gateway: it kept its core {gu:.0%} busy"
        else:
            bound = (
                f"neither of our cores: the gateway kept its own {gu:.0%} busy, the null nodes and load generator "
                f"theirs {shared:.0%}; the rest went to other work on the host (see the load averages above). "
                "Read creates/s as a floor for this host; the gateway's CPU per 1,000 creates is what carries over"
            )
        L += [
            f"Single creates: the limit was {bound}. The null nodes counted {s['null_nodes_counted']} creates in "
            f"the window over {s['nodes_seen']} of {g2['nodes']} nodes (the load generator counted {s['made']}).",
            "",
        ]
        for name, r in (("Batches over the lane", b), ("The SDK's `create_many`", g2.get("create_many") or {})):
            if r:
                L += [
                    f"{name}: the null nodes counted {r['null_nodes_counted']} creates in the window over "
                    f"{r['nodes_seen']} nodes (the load generator counted {r['made']}).",
                    "",
                ]
        pr = g2.get("profile") or {}
        if pr.get("samples"):
            run = pr["run"]
            L += [
                "### Where the gateway's CPU goes (py-spy, a separate pass of the same single-create load)",
                "",
                f"{pr['samples']} busy samples at 200 Hz while the gateway placed {run['per_s']:.0f} creates/s "
                f"(py-spy itself takes CPU: this pass's rate is not the figure above). Share of busy samples:",
                "",
                "| package (self: the frame running) | % | package (inclusive: anywhere on the stack) | % |",
                "|---|---|---|---|",
            ]
            for (a, x), (bb, y) in zip(pr["self"], pr["inclusive"], strict=False):
                L.append(f"| {a} | {x} | {bb} | {y} |")
            L += ["", "| top leaf functions | % | sandfleet functions (inclusive) | % |", "|---|---|---|---|"]
            for (a, x), (bb, y) in zip(pr["leaves"], pr["sandfleet_inclusive"] + [("", "")] * 15, strict=False):
                L.append(f"| `{a}` | {x} | {'`' + bb + '`' if bb else ''} | {y} |")
            L.append("")
        elif pr:
            L += [f"Profile: {pr.get('error')}", ""]
    r = res.get("ray")
    if r:
        L += ["## R: Ray's `ray.experimental.sandbox`, tried in this run", ""]
        L.append(
            f"Ray {r.get('ray_version', '?')}, a local Ray in a child process (`ray.init(num_cpus=1, "
            "include_dashboard=False, object_store_memory=80 MiB)`, RAY_AUTH_MODE=disabled), "
            '`ray.experimental.sandbox.create(image="busybox:latest")`. '
            f"This host: mkfs.erofs `{r.get('mkfs_erofs')}`, "
            f"runsc `{r.get('runsc')}`. A Ray temp dir of its own (`_temp_dir`): plain ray.init() would attach to "
            "the newest Ray cluster on the box, another user's. "
            f"ray.init took {r.get('ray_init_s', '?')} s, ray.shutdown "
            f"{r.get('ray_shutdown_s', '?')} s, the whole probe {r.get('wall_s')} s."
        )
        L.append("")
        if r.get("ran"):
            from common import pct

            def med(xs: list[float]) -> str:
                return f"{pct([x * 1000 for x in xs], 0.5):.1f} ms (n={len(xs)})"

            ours = g1 or {}
            L += [
                "| step | Ray sandbox p50 | sandfleet (G1, direct) p50 |",
                "|---|---|---|",
                f"| create | {med(r['create_s'])} | {ours.get('create', {}).get('direct', {}).get('p50_ms', '?')} ms |",
                f"| exec | {med(r['exec_s'])} | {ours.get('exec', {}).get('direct', {}).get('p50_ms', '?')} ms |",
                f"| delete | {med(r['delete_s'])} | (stop not timed in G1) |",
                "",
            ]
        else:
            L += [
                "**It did not run here, so it has no number.** The error, as Ray raised it "
                f"({r.get('error_type', '?')}):",
                "",
                "```",
                str(r.get("error", "?")),
                "```",
                "",
                "Stock `ray.experimental.sandbox` needs on every node: `mkfs.erofs` >= 1.7 (`--tar`; Debian 12 "
                "ships 1.5), a gVisor `runsc` that boots an EROFS root filesystem (Debian 12's 2022 runsc does not), "
                "and registry pulls (no internet here).",
                "",
            ]
        L.append(
            f"Cleanup: probe exit code {r.get('exit_code')}, timed out: {r.get('timed_out')}; "
            f"leftover Ray processes killed after it: {r.get('leftover_processes_killed')}, "
            f"left after that: {r.get('leftover_after_kill')}."
        )
        L.append("")
    L += ["## Parameters", "", "```", json.dumps(res["params"], indent=1), "```", ""]
    out_path = results / "cluster.md"
    out_path.write_text("\n".join(L))
    return out_path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=100, help="G1 create rounds per path")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--exec-rounds", type=int, default=200)
    p.add_argument("--nodes", type=int, default=16, help="G2 null nodes")
    p.add_argument("--concurrency", type=int, default=64, help="G2 creates in flight")
    p.add_argument("--seconds", type=float, default=10.0, help="G2 measurement window")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--batch-callers", type=int, default=8, help="G2 create_many calls in flight")
    p.add_argument("--few-nodes", type=int, default=2, help="G2 single creates again on this many null nodes (0: no)")
    p.add_argument("--profile-seconds", type=float, default=8.0, help="py-spy pass (0: none)")
    p.add_argument("--ray-rounds", type=int, default=5)
    p.add_argument("--ray-timeout", type=float, default=300.0)
    p.add_argument("--skip", action="append", default=[], choices=["g1", "g2", "ray"])
    p.add_argument("--dry", action="store_true")
    p.add_argument("--results", type=Path)
    a = p.parse_args()
    if a.dry:
        a.rounds, a.warmup, a.exec_rounds, a.seconds, a.profile_seconds, a.ray_rounds = 10, 2, 20, 3.0, 3.0, 1
    from common import RESULTS
    from report import machine_info

    results = a.results or (Path(tempfile.mkdtemp(prefix="bench-cluster-")) if a.dry else RESULTS)
    meta = machine_info()
    res: dict[str, Any] = {
        "meta": meta,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "uptime_before": uptime(),
        "params": {k: v for k, v in vars(a).items() if k != "results"},
    }
    root = Path(tempfile.mkdtemp(prefix="bench-cluster-run-"))
    procs = Procs(root)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    ok = False
    try:
        if "g1" not in a.skip:
            res["g1"] = bench_overhead(procs, a.rounds, a.warmup, a.exec_rounds)
            print("G1", json.dumps(res["g1"]), flush=True)
        if "g2" not in a.skip:
            res["g2"] = bench_throughput(
                procs, a.nodes, a.concurrency, a.seconds, a.batch, a.batch_callers, a.profile_seconds, a.few_nodes
            )
        if "ray" not in a.skip:
            res["ray"] = bench_ray(procs, a.ray_rounds, a.ray_timeout)
            print("R", json.dumps({k: v for k, v in res["ray"].items() if k != "error_full"}), flush=True)
        ok = True
    finally:
        procs.close()
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"logs kept in {root}", file=sys.stderr)
    res["uptime_after"] = uptime()
    print(f"wrote {write_report(res, results)}")
    return 0


def sub_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["_null-nodes", "_load", "_ray-probe"])
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--ready", type=Path)
    p.add_argument("--capacity", type=int, default=10_000_000)
    p.add_argument("--url")
    p.add_argument("--mode", default="single")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--out", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--temp-dir", type=Path)
    a = p.parse_args(argv)
    if a.what == "_null-nodes":
        null_nodes_main(a.n, a.ready, a.capacity)
    elif a.what == "_load":
        asyncio.run(load_main(a.url, a.mode, a.concurrency, a.seconds, a.warmup, a.batch))
    else:
        ray_probe_main(a.out, a.rounds, a.temp_dir)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.exit(sub_main(sys.argv[1:]))
    sys.exit(main())
