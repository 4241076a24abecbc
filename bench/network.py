#!/usr/bin/env python3
"""Network egress policy, in one run on one daemon: `python3 bench/network.py` (as root).

The peer is an upstream service on this host (tests/upstream.py: HTTP and HTTPS in a network
namespace behind a veth, 10.213.N.2, named `upstream.test`), which the benchmark's daemon config
names as the service `upstream`. Measured:

  a) create-to-first-exec p50/p90, `fleet.create(image="busybox", network=["upstream"])` against
     `fleet.create(image="busybox")` (network "none"), interleaved, N each (target: <= 3 ms more at p50);
  b) N idle sandboxes at once with `network=["upstream"]` and N with "none": host memory each
     (MemAvailable drop / N), the daemon's RSS growth / N, PSS of the sandboxes and of the node's
     other processes;
  c) a 256 MiB download from the upstream (python3 urllib, bytes discarded) inside a `python`
     sandbox through the egress proxy against the same command on the host straight to the
     upstream, MiB/s, 3 rounds each, interleaved; HTTP, and HTTPS (CONNECT in the sandbox).

Before the figures, the policy's behaviour is checked (allowed fetch, refused ones, the proxy
variables) and recorded.

    python3 bench/network.py [--n 100] [--idle 1000] [--size-mib 256] [--rounds 3]
    python3 bench/network.py --dry     # small N; sandbox halves only if the daemon has network policy

Results: bench/results/network.json and network.md (with --dry: a temp dir, unless --results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from common import RESULTS, Daemon, remove_cgroup_tree, settle  # noqa: E402
from report import machine_info  # noqa: E402
from sandfleet import Client  # noqa: E402
from sandfleet.errors import SandboxError  # noqa: E402
from scenarios.network import (  # noqa: E402
    SERVICE,
    bench_create_interleaved,
    bench_download,
    bench_idle,
    check_policy,
    network_config,
)
from upstream import Upstream, free_subnet  # noqa: E402

TARGET_DELTA_P50_MS = 3.0


def load() -> str:
    """The 1-minute load average (the host is shared: say how busy it was)."""
    return Path("/proc/loadavg").read_text().split()[0]


def has_network_policy() -> tuple[bool, str]:
    try:
        from sandfleet.models import NetworkPolicy, SandboxSpec  # noqa: F401
    except ImportError as exc:
        return False, f"the SDK has no NetworkPolicy ({exc})"
    if "network" not in SandboxSpec.model_fields:
        return False, "SandboxSpec has no network field"
    return True, ""


def write_report(res: dict[str, Any], results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "network.json").write_text(json.dumps(res, indent=1) + "\n")
    m = res["meta"]
    lines = [
        f"# sandfleet network egress policy, {m['date']} (commit {m['sandfleet_commit']})",
        "",
        f"{m['nproc']} cores ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}; "
        f"load average {m['loadavg_start']} at start, {m.get('loadavg_end', '?')} at end.",
        f"Peer: an upstream in a network namespace behind a veth ({res['upstream']['ip']}, "
        f"`{res['upstream']['hostname']}`), set up in {res['upstream']['setup_ms']:.0f} ms; "
        f"policy `network={res['config']['policy']}`.",
        "",
    ]
    if res.get("load"):
        lines += ["Load average at the start of each phase: "
                  + ", ".join(f"{k} {v}" for k, v in res["load"].items()) + ".", ""]  # fmt: skip
    if res.get("skipped"):
        lines += [f"**Sandbox figures skipped**: {res['skipped']}", ""]
    chk = res.get("checks")
    if chk:
        lines += ["## Policy checks", "", "| check | ok | detail |", "|---|---|---|"]
        for k, v in chk.items():
            if isinstance(v, dict) and "ok" in v:
                detail = (
                    v.get("error") or f"exit {v.get('exit')}; {(v.get('stdout') or v.get('stderr') or '').strip()[:80]}"
                )
                lines.append(f"| {k} | {'yes' if v['ok'] else '**no**'} | {detail.replace('|', '/')} |")
        lines += ["", f"Proxy variables in an allowed sandbox: `{json.dumps(chk.get('proxy_env'))}`", ""]
    c = res.get("create")
    if c:
        lines += [
            f"## a) create-to-first-exec, busybox, interleaved, n={c['n']} each",
            "",
            "| network | p50 | p90 | p99 | mean | create p50 | first exec p50 |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in ("policy", "none"):
            t = c[k]["total"]
            name = f"`{c['network']}`" if k == "policy" else "`none`"
            lines.append(
                f"| {name} | {t['p50_ms']:.2f} ms | {c[k]['p90_ms']:.2f} ms | {t['p99_ms']:.2f} ms | "
                f"{t['mean_ms']:.2f} ms | {c[k]['create']['p50_ms']:.2f} ms | {c[k]['first_exec']['p50_ms']:.2f} ms |"
            )
        lines += [
            "",
            f"Difference at p50 {c['delta_p50_ms']:+.2f} ms, at p90 {c['delta_p90_ms']:+.2f} ms; "
            f"median of the paired differences {c['paired_delta_p50_ms']:+.2f} ms.",
            "",
        ]
    d = res.get("download")
    if d:
        lines += [
            f"## c) download of {d['bytes'] >> 20} MiB (python3 urllib, bytes discarded), "
            f"{d['rounds']} rounds, interleaved",
            "",
            "| scheme | host, straight to the upstream | sandbox, through the egress proxy | sandbox / host "
            "| daemon CPU per GiB relayed |",
            "|---|---|---|---|---|",
        ]
        for scheme in ("http", "https"):
            r = d.get(scheme)
            if not r:
                continue
            hs = ", ".join(f"{x:.0f}" for x in r["host_mib_s"])
            sb = (
                f"{r['sandbox_median_mib_s']:.0f} MiB/s ({', '.join(f'{x:.0f}' for x in r['sandbox_mib_s'])})"
                if "sandbox_mib_s" in r
                else "skipped"
            )
            ratio = f"{r['sandbox_over_host']:.2f}" if "sandbox_over_host" in r else ""
            cpu = f"{r['daemon_cpu_s_per_gib']:.2f} s" if "daemon_cpu_s_per_gib" in r else ""
            lines.append(f"| {scheme} | {r['host_median_mib_s']:.0f} MiB/s ({hs}) | {sb} | {ratio} | {cpu} |")
        lines += ["", "Medians, the rounds in brackets. HTTPS in the sandbox: a CONNECT tunnel (TLS end to end).", ""]
    idle = res.get("idle") or []
    if idle:
        lines += [
            f"## b) {idle[0]['sandboxes']} idle busybox sandboxes at once (64 MiB limit each)",
            "",
            "| network | host memory / sandbox (MemAvailable) | daemon RSS growth / sandbox | sandbox PSS / sandbox "
            "| node helpers' PSS growth / sandbox | daemon RSS after | created in | exec p50 / p99 into random ones |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for v in idle:
            if "status" in v:
                lines.append(f"| `{v.get('network')}` | {v['status']}: {v.get('reason', '')[:200]} | | | | | | |")
                continue
            e = v["exec_into_random_idle"]
            lines.append(
                f"| `{v['network']}` | {v['host_mem_used_per_sandbox_kib']:.0f} KiB "
                f"| {v['daemon_rss_per_sandbox_kib']:.1f} KiB "
                f"| {v['sandbox_pss_per_sandbox_kib']:.0f} KiB | {v['helpers_pss_growth_per_sandbox_kib']:.1f} KiB "
                f"| {v['daemon_rss_after_mib']:.0f} MiB | {v['create_all_s']:.1f} s "
                f"| {e['p50_ms']:.2f} / {e['p99_ms']:.2f} ms |"
            )
        for v in idle:
            if v.get("fetch_from_random_idle"):
                f = v["fetch_from_random_idle"]
                lines.append(
                    f"\nWith {v['sandboxes']} alive: `wget http://upstream.test/hello` from {f['tried']} random "
                    f"networked sandboxes: {f['ok']} ok, p50 {f['wget_exec']['p50_ms']:.1f} ms per exec."
                )
        lines.append("")
    if res.get("targets"):
        lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
        for t in res["targets"]:
            lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |")
        lines.append("")
    if res.get("errors"):
        lines += ["## Errors", ""] + [f"- {k}: `{v}`" for k, v in res["errors"].items()] + [""]
    if res.get("daemon_crashes"):
        lines += ["## Daemon crashes", "", "```", json.dumps(res["daemon_crashes"], indent=1)[:4000], "```", ""]
    (results / "network.md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="create-to-first-exec cycles of each kind")
    ap.add_argument("--idle", type=int, default=1000, help="idle sandboxes of each kind")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="checks,create,download,idle", help="which parts (comma-separated)")
    ap.add_argument("--dry", action="store_true", help="small N; sandbox halves only if the SDK has network policy")
    ap.add_argument("--results", type=Path)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/network.py must run as root (network namespaces, the daemon)")
        return 2
    if a.dry:
        a.n, a.idle, a.size_mib, a.rounds = min(a.n, 10), min(a.idle, 20), min(a.size_mib, 32), min(a.rounds, 2)
    results = a.results or (Path(tempfile.mkdtemp(prefix="sfb-network-results-")) if a.dry else RESULTS)
    parts = set(a.only.split(","))

    def on_term(signo: int, frame: object) -> None:
        raise SystemExit(f"interrupted by signal {signo}")

    signal.signal(signal.SIGTERM, on_term)
    tag = f"{os.getpid()}-{int(time.time())}"
    labels = {"sfbench-net": tag}
    cgroup_parent = f"/sfbench-net-{tag}"
    policy = [SERVICE]
    res: dict[str, Any] = {
        "meta": machine_info(),
        "config": {
            "n": a.n, "idle": a.idle, "size_mib": a.size_mib, "rounds": a.rounds, "dry": a.dry,
            "policy": policy, "image": "busybox (a, b), python (c, checks)",
        },
        "errors": {},
        "load": {},
    }  # fmt: skip
    supported, why = has_network_policy()
    tmp = Path(tempfile.mkdtemp(prefix="sfb-network-"))
    os.chmod(tmp, 0o755)
    up: Upstream | None = None
    d: Daemon | None = None
    try:
        up = Upstream(free_subnet())
        res["upstream"] = {
            "ip": up.ip, "hostname": up.hostname, "cidr": up.cidr, "netns": up.name,
            "setup_ms": round((up.setup_s or 0) * 1000, 1),
        }  # fmt: skip
        print(f"upstream {up.name} at {up.ip} ({res['upstream']['setup_ms']:.0f} ms)", flush=True)
        d = Daemon(tmp / "daemon", cgroup_parent)
        if supported:
            d.config.write_text(d.config.read_text() + network_config(up))
        else:
            res["skipped"] = why
            if not a.dry:
                raise SystemExit(f"cannot measure: {why} (use --dry for the host's side only)")
        res["daemon_config"] = d.config.read_text()
        d.start()
        with Client(d.socket, timeout=600) as fleet:
            fleet.create(image="busybox", labels=labels).stop()  # images built / mounted once
            fleet.create(image="python", labels=labels).stop()
            if supported and "checks" in parts:
                print("policy checks", flush=True)
                res["load"]["checks"] = load()
                try:
                    res["checks"] = check_policy(fleet, up, labels)
                    print(f"  all ok: {res['checks']['all_ok']}", flush=True)
                except Exception as exc:  # a failing check is a result; the figures may still say something
                    res["errors"]["checks"] = f"{type(exc).__name__}: {exc}"[:1500]
                    print(f"  failed: {res['errors']['checks']}", flush=True)
            if supported and "create" in parts:
                print(f"a) create-to-first-exec, network={policy} vs none, x{a.n} each, interleaved", flush=True)
                res["load"]["create"] = load()
                try:
                    res["create"] = bench_create_interleaved(fleet, a.n, labels, policy)
                    c = res["create"]
                    print(f"  p50 {c['policy']['total']['p50_ms']:.2f} vs {c['none']['total']['p50_ms']:.2f} ms "
                          f"(delta {c['delta_p50_ms']:+.2f}, paired {c['paired_delta_p50_ms']:+.2f})",
                          flush=True)  # fmt: skip
                except Exception as exc:
                    res["errors"]["create"] = f"{type(exc).__name__}: {exc}"[:1500]
                    print(f"  failed: {res['errors']['create']}", flush=True)
            if "download" in parts:
                print(f"c) download {a.size_mib} MiB x{a.rounds}, host vs sandbox", flush=True)
                res["load"]["download"] = load()
                try:
                    res["download"] = bench_download(
                        fleet if supported else None, up, a.size_mib, a.rounds, labels, d.pid
                    )
                    for s in ("http", "https"):
                        r = res["download"][s]
                        print(f"  {s}: host {r['host_median_mib_s']} MiB/s, sandbox {r.get('sandbox_median_mib_s')}",
                              flush=True)  # fmt: skip
                except Exception as exc:
                    res["errors"]["download"] = f"{type(exc).__name__}: {exc}"[:1500]
                    print(f"  failed: {res['errors']['download']}", flush=True)
        if "idle" in parts:
            res["idle"] = []
            for pol in [None, policy] if supported else [None]:
                name = "none" if pol is None else str(pol)
                print(f"b) {a.idle} idle sandboxes, network={name}", flush=True)
                # A fresh daemon for each kind: after the other kind's run, its RSS says little (the
                # freed memory stays in its heap and is reused).
                d.stop_sandboxes()
                d.stop()
                d.start()
                settle(5)  # its warm pool fills
                res["load"][f"idle {name}"] = load()
                with Client(d.socket, timeout=600) as fleet:
                    try:
                        v = bench_idle(fleet, d, a.idle, labels, pol, up)
                        print(f"  host {v['host_mem_used_per_sandbox_kib']} KiB each, daemon RSS "
                              f"+{v['daemon_rss_per_sandbox_kib']} KiB each", flush=True)  # fmt: skip
                    except Exception as exc:
                        v = {"network": name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:1500]}
                        print(f"  failed: {v['reason']}", flush=True)
                        with_stop(fleet, labels)
                res["idle"].append(v)
        res["daemon_crashes"] = d.crashes
        res["meta"]["loadavg_end"] = Path("/proc/loadavg").read_text().split()[0]
        c = res.get("create")
        targets = []
        if c:
            targets.append({
                "target": f"create-to-first-exec with a policy: p50 <= {TARGET_DELTA_P50_MS:.0f} ms more than none",
                "measured": c["delta_p50_ms"], "met": c["delta_p50_ms"] <= TARGET_DELTA_P50_MS,
            })  # fmt: skip
        if res.get("checks"):
            targets.append(
                {"target": "policy checks", "measured": res["checks"]["all_ok"], "met": res["checks"]["all_ok"]}
            )
        res["targets"] = targets
        write_report(res, results)
        print((results / "network.md").read_text())
        print(f"wrote {results / 'network.json'} and {results / 'network.md'}")
        return 0
    except BaseException:
        if d is not None and d.process.started:
            print("daemon log tail:\n" + d.log()[-3000:], file=sys.stderr)
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        left: list[str] = []
        if d is not None:
            if d.alive():
                try:
                    d.stop_sandboxes()
                except (SandboxError, OSError) as exc:
                    print(f"cleanup: stopping sandboxes failed: {exc}", file=sys.stderr)
            d.stop()
        left += remove_cgroup_tree(cgroup_parent)
        if up is not None:
            try:
                up.close()
            except Exception as exc:
                left.append(str(exc))
        shutil.rmtree(tmp, ignore_errors=True)
        if left:
            print(f"cleanup: could not remove {left}", file=sys.stderr)


def with_stop(fleet: Any, labels: dict[str, str]) -> None:
    try:
        fleet.stop_many(labels)
    except SandboxError as exc:
        print(f"  stop_many failed too: {exc}", flush=True)


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
