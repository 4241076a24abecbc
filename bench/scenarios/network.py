"""Network egress policy: what an allowlist costs against `network="none"` (create-to-first-exec, idle
memory), and the throughput of a large download through the node's egress proxy against the host's own.

The peer is an `Upstream` (tests/upstream.py): an HTTP/HTTPS server in its own network namespace,
which the daemon's config names as the service `upstream` (see `network_config`).
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    DENSITY_MEMORY,
    IDLE_CPU_REQUEST,
    Daemon,
    cgroup_dirs,
    mem_available_kib,
    pct,
    pss_kib,
    read_status,
    rss_kib,
    settle,
    stats,
    stop_labelled,
)
from sandfleet.errors import SandboxError

SERVICE = "upstream"
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "NO_PROXY", "no_proxy")

# Downloads a URL, discarding the bytes (1 MiB reads into one buffer), and prints "<bytes> <seconds>"
# (connect + transfer, without the interpreter's start). Proxies come from the environment, as for
# any urllib user; argv[2], if given, is the CA file for HTTPS.
DOWNLOAD = r"""
import ssl, sys, time, urllib.request
url = sys.argv[1]
ctx = ssl.create_default_context(cafile=sys.argv[2]) if len(sys.argv) > 2 else None
buf = bytearray(1 << 20)
t = time.perf_counter()
r = urllib.request.urlopen(url, context=ctx, timeout=120)
n = 0
while True:
    k = r.readinto(buf)
    if not k:
        break
    n += k
print(n, time.perf_counter() - t)
"""


def network_config(up: Any) -> str:
    """The TOML appended to the daemon's config: the node resolver's static name and the service."""
    return (
        f'\n[network]\nhosts = {{ "{up.hostname}" = "{up.ip}" }}\n'
        f'[network.services.{SERVICE}]\nhosts = ["{up.hostname}"]\nports = [80, 443]\ncidrs = ["{up.cidr}"]\n'
    )


def _ms(x: float) -> float:
    return round(x * 1000, 3)


# -- correctness, before any figure ----------------------------------------------------------------


def check_policy(fleet: Any, up: Any, labels: dict[str, str]) -> dict[str, Any]:
    """What the figures rest on: an allowed sandbox reaches the upstream through the proxy (HTTP, and
    HTTPS with the upstream's CA), sees the proxy variables; a `none` sandbox and an address the
    policy does not name do not get through. Each check's outcome is recorded, not asserted."""
    out: dict[str, Any] = {}

    def run(sb: Any, cmd: Any, **kw: Any) -> dict[str, Any]:
        try:
            r = sb.exec(cmd, timeout=30, **kw)
            return {"exit": r.exit_code, "stdout": r.stdout[-300:], "stderr": r.stderr[-300:]}
        except SandboxError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:500]}

    hello = up.url("/hello", host=up.hostname)
    with fleet.create(image="busybox", labels=labels, network=[SERVICE]) as sb:
        env = sb.exec("env", timeout=30).stdout
        got = {k: v for k, v in (ln.split("=", 1) for ln in env.splitlines() if "=" in ln)}
        out["proxy_env"] = {k: got.get(k) for k in PROXY_VARS}
        r = run(sb, ["wget", "-q", "-O", "-", hello])
        out["busybox wget http://upstream.test/hello (allowed)"] = {
            **r,
            "ok": r.get("stdout") == "hello from upstream\n",
        }
        r = run(sb, ["wget", "-q", "-O", "-", up.url("/hello", host=f"{up.hostname}:8080")])
        out["wget http://upstream.test:8080/ (a port the service does not list: refused)"] = {
            **r, "ok": r.get("exit", 0) != 0
        }  # fmt: skip
        r = run(sb, ["wget", "-q", "-O", "-", up.url("/hello")])
        out["wget http://<upstream IP>/ (an address the policy does not name: refused)"] = {
            **r, "ok": r.get("exit", 0) != 0
        }  # fmt: skip
        r = run(sb, ["wget", "-q", "-O", "-", f"http://{up.host_ip}/hello"])
        out["wget http://<host's veth address>/ (refused)"] = {**r, "ok": r.get("exit", 0) != 0}
    # (busybox 1.35's wget segfaults whenever its connect fails, so these use nc)
    with fleet.create(image="busybox", labels=labels) as sb:
        r = run(sb, "nc -w 2 127.0.0.1 3128 </dev/null")
        out['network="none": nc 127.0.0.1:3128 (no proxy: refused)'] = {**r, "ok": r.get("exit", 0) != 0}
        r = run(sb, f"nc -w 2 {up.ip} 80 </dev/null")
        out['network="none": nc <upstream IP>:80 (no route)'] = {**r, "ok": r.get("exit", 0) != 0}
    with fleet.create(image="busybox", labels=labels, network=[SERVICE]) as sb:
        r = run(sb, f"nc -w 2 {up.ip} 80 </dev/null")
        out["allowed, but around the proxy: nc <upstream IP>:80 (no route)"] = {**r, "ok": r.get("exit", 0) != 0}
    with fleet.create(image="python", labels=labels, network=[SERVICE]) as sb:
        assert up.cert is not None
        sb.files.write("/tmp/upstream.pem", up.cert.read_bytes())
        url = up.url("/hello", https=True, host=up.hostname)
        code = (
            "import ssl, urllib.request; "
            "ctx = ssl.create_default_context(cafile='/tmp/upstream.pem'); "
            f"print(urllib.request.urlopen('{url}', context=ctx).read().decode(), end='')"
        )
        r = run(sb, ["python3", "-c", code])
        out["python https://upstream.test/hello through CONNECT, verified"] = {
            **r, "ok": r.get("stdout") == "hello from upstream\n"
        }  # fmt: skip
    out["all_ok"] = all(v.get("ok", True) for v in out.values() if isinstance(v, dict) and "ok" in v)
    return out


# -- a) create-to-first-exec -----------------------------------------------------------------------


def bench_create_interleaved(fleet: Any, n: int, labels: dict[str, str], policy: Any) -> dict[str, Any]:
    """`fleet.create(image="busybox", network=policy)` and `fleet.create(image="busybox")`, each then
    `exec("true")`, interleaved (the order within a pair alternates), N of each; stop not timed."""
    kinds = {"policy": {"network": policy}, "none": {}}
    samples: dict[str, dict[str, list[float]]] = {k: {"total": [], "create": [], "first_exec": []} for k in kinds}

    def once(kind: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        sb = fleet.create(image="busybox", labels=labels, **kinds[kind])
        t1 = time.perf_counter()
        r = sb.exec("true")
        t2 = time.perf_counter()
        if r.exit_code != 0:
            raise RuntimeError(f"exec true failed ({kind}): {r}")
        sb.stop()
        return t1 - t0, t2 - t1

    for _ in range(3):  # warm-up: image, connection, the proxy's first sandbox
        for k in kinds:
            once(k)
    for i in range(n):
        order = ("policy", "none") if i % 2 == 0 else ("none", "policy")
        for k in order:
            c, e = once(k)
            samples[k]["create"].append(c)
            samples[k]["first_exec"].append(e)
            samples[k]["total"].append(c + e)
    res: dict[str, Any] = {"n": n, "network": str(policy)}
    for k, s in samples.items():
        res[k] = {name: stats(xs) for name, xs in s.items()}
        res[k]["p90_ms"] = round(pct([x * 1000 for x in s["total"]], 0.9), 3)
    pol, none = res["policy"]["total"], res["none"]["total"]
    res["delta_p50_ms"] = round(pol["p50_ms"] - none["p50_ms"], 3)
    res["delta_p90_ms"] = round(res["policy"]["p90_ms"] - res["none"]["p90_ms"], 3)
    # paired difference (each policy create against the none create next to it): less noisy
    diffs = sorted((a - b) * 1000 for a, b in zip(samples["policy"]["total"], samples["none"]["total"], strict=True))
    res["paired_delta_p50_ms"] = round(pct(diffs, 0.5), 3)
    return res


# -- b) idle sandboxes -----------------------------------------------------------------------------


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            text = Path(f"/proc/{d}/stat").read_text()
            ppid = int(text[text.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append(int(d))
    out, todo = set(), [root]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.add(p)
        todo += children.get(p, [])
    return out


def _tree_pids(parent: str) -> set[int]:
    """Every process in the memory cgroup tree `parent` (any uid)."""
    pids: set[int] = set()
    for top in cgroup_dirs(parent):
        if top.parent.name not in ("memory", "fs"):
            continue
        for procs in top.rglob("cgroup.procs"):
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in procs.read_text().split())
    return pids


def _node_processes(daemon: Daemon) -> dict[str, set[int]]:
    """The node's processes split in two: sandbox processes (uid in the sandboxes' range) and the
    rest (the daemon, its helpers, launcher servers, any proxy process: whatever is not the daemon
    itself counts toward 'helpers')."""
    pids = _descendants(daemon.pid) | _tree_pids(daemon.cgroup_parent)
    sandbox, helpers = set(), set()
    for p in pids:
        uid = read_status(p).get("Uid", "").split()[:1]
        if not uid:
            continue
        (sandbox if int(uid[0]) >= 100000 else helpers).add(p)
    helpers.discard(daemon.pid)
    return {"sandbox": sandbox, "helpers": helpers}


def bench_idle(
    fleet: Any, daemon: Daemon, n: int, labels: dict[str, str], policy: Any, up: Any, n_exec: int = 100
) -> dict[str, Any]:
    """N idle busybox sandboxes (64 MiB limit, 0.01 CPU request) with `policy` (None: "none"), as in
    the density scenario: MemAvailable drop / N, daemon RSS growth / N, PSS of the sandboxes'
    processes and of the node's other processes; then execs into random ones and, with a policy,
    a fetch from the upstream in some of them (the proxy still serves with N alive)."""
    from sandfleet import Resources, SandboxSpec

    settle(2)
    before = _node_processes(daemon)
    rss0 = rss_kib(daemon.pid)
    avail0 = mem_available_kib()
    helpers0 = pss_kib(sorted(before["helpers"]))
    fds0 = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    extra = {"network": policy} if policy is not None else {}
    spec = SandboxSpec(
        image="busybox",
        labels=labels,
        resources=Resources(memory=DENSITY_MEMORY, cpu_request=IDLE_CPU_REQUEST),
        **extra,
    )
    t0 = time.perf_counter()
    results = fleet.create_many([spec] * n, concurrency=32)
    create_all_s = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, SandboxError)]
    if failed:
        with contextlib.suppress(SandboxError):
            fleet.stop_many(labels)
        raise RuntimeError(f"{len(failed)} of {n} idle creates failed, e.g. {failed[0]!r}")
    sbs = list(results)
    settle(3)
    rss1 = rss_kib(daemon.pid)
    avail1 = mem_available_kib()
    after = _node_processes(daemon)
    helpers1 = pss_kib(sorted(after["helpers"]))
    new_sandbox = sorted(after["sandbox"] - before["sandbox"])
    pss_sb = pss_kib(new_sandbox)
    fds1 = len(os.listdir(f"/proc/{daemon.pid}/fd"))
    hz = os.sysconf("SC_CLK_TCK")
    from common import cpu_ticks

    c0, w0 = cpu_ticks(daemon.pid), time.monotonic()
    settle(5)
    idle_cpu = (cpu_ticks(daemon.pid) - c0) / hz / (time.monotonic() - w0) * 100

    rng = random.Random(1234)
    xs = []
    for _ in range(n_exec):
        r = rng.choice(sbs).exec("true")
        if r.exit_code != 0:
            raise RuntimeError(f"exec into an idle sandbox failed: {r}")
    for _ in range(n_exec):
        sb = rng.choice(sbs)
        t = time.perf_counter()
        sb.exec("true")
        xs.append(time.perf_counter() - t)
    fetch: dict[str, Any] | None = None
    if policy is not None:
        ok, lat = 0, []
        for sb in rng.sample(sbs, min(20, n)):
            t = time.perf_counter()
            r = sb.exec(["wget", "-q", "-O", "-", up.url("/hello", host=up.hostname)], timeout=30)
            lat.append(time.perf_counter() - t)
            ok += r.stdout == "hello from upstream\n"
        fetch = {"tried": min(20, n), "ok": ok, "wget_exec": stats(lat)}
    stopped, stop_error, stop_s = stop_labelled(daemon, fleet, labels, "network idle stop_many")
    return {
        "sandboxes": n,
        "network": str(policy) if policy is not None else "none",
        "create_all_s": round(create_all_s, 3),
        "creations_per_s": round(n / create_all_s, 1),
        "host_mem_used_per_sandbox_kib": round((avail0 - avail1) / n, 1),
        "host_mem_used_total_mib": round((avail0 - avail1) / 1024, 1),
        "daemon_rss_before_mib": round(rss0 / 1024, 1),
        "daemon_rss_after_mib": round(rss1 / 1024, 1),
        "daemon_rss_per_sandbox_kib": round((rss1 - rss0) / n, 1),
        "sandbox_processes": len(new_sandbox),
        "sandbox_pss_per_sandbox_kib": round(pss_sb / n, 1),
        "helper_processes_before": len(before["helpers"]),
        "helper_processes_after": len(after["helpers"]),
        "helpers_pss_growth_per_sandbox_kib": round((helpers1 - helpers0) / n, 1),
        "daemon_fds_before": fds0,
        "daemon_fds_after": fds1,
        "daemon_idle_cpu_percent_of_one_core": round(idle_cpu, 2),
        "exec_into_random_idle": stats(xs),
        "fetch_from_random_idle": fetch,
        "stop_all_s": round(stop_s, 3),
        "stopped": len(stopped),
        "stop_error": stop_error,
    }


# -- c) download throughput ------------------------------------------------------------------------


def _parse(stdout: str, size: int, where: str) -> float:
    try:
        got, seconds = stdout.split()
    except ValueError:
        raise RuntimeError(f"{where}: unexpected output {stdout[-300:]!r}") from None
    if int(got) != size:
        raise RuntimeError(f"{where}: got {got} bytes, expected {size}")
    return size / float(seconds) / 2**20


def host_download(url: str, size: int, cafile: str | None = None) -> float:
    """MiB/s of DOWNLOAD run by the host's python3, straight to the upstream (no proxy)."""
    env = {k: v for k, v in os.environ.items() if k not in PROXY_VARS}
    r = subprocess.run(
        [sys.executable, "-c", DOWNLOAD, url, *([cafile] if cafile else [])],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    if r.returncode != 0:
        raise RuntimeError(f"host download of {url}: exit {r.returncode}: {r.stderr[-800:]}")
    return _parse(r.stdout, size, "host")


def sandbox_download(sb: Any, url: str, size: int, cafile: str | None = None) -> float:
    """MiB/s of DOWNLOAD run in the sandbox (through the proxy its environment names)."""
    r = sb.exec(["python3", "-c", DOWNLOAD, url, *([cafile] if cafile else [])], timeout=300)
    if r.exit_code != 0:
        raise RuntimeError(f"sandbox download of {url}: exit {r.exit_code}: {r.stderr[-800:]}")
    return _parse(r.stdout, size, "sandbox")


def bench_download(
    fleet: Any | None, up: Any, size_mib: int, rounds: int, labels: dict[str, str], daemon_pid: int | None = None
) -> dict[str, Any]:
    """`size_mib` MiB from /bytes/N, `rounds` rounds of host then sandbox (HTTP; then HTTPS, through
    CONNECT in the sandbox), in a `python` sandbox allowed the upstream service. `fleet` None: the
    host's side only (a dry run). `daemon_pid`: also the daemon's CPU seconds per GiB relayed (the
    proxy runs in its event loop)."""
    from common import cpu_ticks

    hz = os.sysconf("SC_CLK_TCK")
    size = size_mib << 20
    res: dict[str, Any] = {"bytes": size, "rounds": rounds}
    sb = None
    if fleet is not None:
        sb = fleet.create(image="python", labels=labels, network=[SERVICE])
        assert up.cert is not None
        sb.files.write("/tmp/upstream.pem", up.cert.read_bytes())
    try:
        for scheme in ("http", "https"):
            https = scheme == "https"
            host_url = up.url(f"/bytes/{size}", https=https)
            sb_url = up.url(f"/bytes/{size}", https=https, host=up.hostname)
            ca_host = str(up.cert) if https else None
            ca_sb = "/tmp/upstream.pem" if https else None
            # warm-up (page cache of the interpreter, the proxy's first connection): 16 MiB each
            host_download(up.url(f"/bytes/{16 << 20}", https=https), 16 << 20, ca_host)
            if sb is not None:
                sandbox_download(sb, up.url(f"/bytes/{16 << 20}", https=https, host=up.hostname), 16 << 20, ca_sb)
            h, s, cpu = [], [], []
            for i in range(rounds):
                pair = ("host", "sandbox") if i % 2 == 0 else ("sandbox", "host")
                for who in pair:
                    if who == "host":
                        h.append(host_download(host_url, size, ca_host))
                    elif sb is not None:
                        c0 = cpu_ticks(daemon_pid) if daemon_pid else 0
                        s.append(sandbox_download(sb, sb_url, size, ca_sb))
                        if daemon_pid:
                            cpu.append((cpu_ticks(daemon_pid) - c0) / hz / (size / 2**30))
            row: dict[str, Any] = {
                "host_url": host_url,
                "host_mib_s": [round(x, 1) for x in h],
                "host_median_mib_s": round(pct(h, 0.5), 1),
            }
            if s:
                row |= {
                    "sandbox_url": sb_url,
                    "sandbox_mib_s": [round(x, 1) for x in s],
                    "sandbox_median_mib_s": round(pct(s, 0.5), 1),
                    "sandbox_over_host": round(pct(s, 0.5) / pct(h, 0.5), 3),
                }
                if cpu:
                    row["daemon_cpu_s_per_gib"] = round(pct(cpu, 0.5), 2)
            res[scheme] = row
    finally:
        if sb is not None:
            with contextlib.suppress(SandboxError):
                sb.stop()
    return res
