#!/usr/bin/env python3
"""The isolation tiers side by side, in one run on one daemon: `python3 bench/tiers.py` (as root).

fncall: stateless calls of a trivial Python snippet through the SDK, one at a time (latency) and 32
in flight (rate), against a fresh sandbox per call on sandfleet's container tier, `crun run` and
`bwrap` of the same python image's tree (sandfleet's own OCI config for crun), and an unisolated
`python3 -c` on the host. microvm and vm (when the host can run them): create-to-first-exec and
the host memory each idle VM holds, against the container tier in the same run.

Results: bench/results/tiers.json and tiers.md (SPECIFICATION.md quotes them).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import IMAGES, Daemon, in_cgroup_ns_wrapper, pss_kib, stats  # noqa: E402
from peers import sandfleet_oci  # noqa: E402
from sandfleet import AsyncClient, Client  # noqa: E402
from sandfleet.runtime.cgroups import CGROUP_ROOT, Cgroups  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SNIPPET = "print(1)"


def _calls_one_at_a_time(fleet: Client, n: int) -> list[float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = fleet.run_code(SNIPPET)
        xs.append(time.perf_counter() - t0)
        if r.stdout != "1\n":
            raise RuntimeError(f"run_code gave {r}")
    return xs


async def _calls_in_flight(sock: Path, n: int, width: int) -> float:
    async with AsyncClient(sock, timeout=300) as c:
        sem = asyncio.Semaphore(width)

        async def one() -> None:
            async with sem:
                r = await c.run_code(SNIPPET)
                if r.stdout != "1\n":
                    raise RuntimeError(f"run_code gave {r}")

        await asyncio.gather(*(one() for _ in range(width * 2)))  # the pool grows to its size first
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0)


async def _fresh_sandbox_rate(sock: Path, n: int, width: int) -> float:
    async with AsyncClient(sock, timeout=300) as c:
        sem = asyncio.Semaphore(width)

        async def one() -> None:
            async with sem:
                sb = await c.create(image="python", labels={"bench": "tiers"})
                try:
                    r = await sb.exec(["python3", "-c", SNIPPET])
                    if r.stdout != "1\n":
                        raise RuntimeError(f"exec gave {r}")
                finally:
                    await sb.stop()

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(n)))
        return n / (time.perf_counter() - t0)


def _fresh_sandbox_one(fleet: Client, n: int) -> list[float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        with fleet.create(image="python", labels={"bench": "tiers"}) as sb:
            r = sb.exec(["python3", "-c", SNIPPET])
        xs.append(time.perf_counter() - t0)
        if r.stdout != "1\n":
            raise RuntimeError(f"exec gave {r}")
    return xs


def _subprocess_peer(argv: list[str] | Any, n: int, width: int) -> dict[str, Any]:
    """One-at-a-time latency and `width`-wide rate of a per-call subprocess."""

    def once(i: int) -> float:
        cmd = argv(i) if callable(argv) else argv
        t0 = time.perf_counter()
        # Pipes for all three: crun 1.8.1 chowns its stdio to the container's root (containers/crun#1845),
        # which must never be the host's /dev/null.
        r = subprocess.run(cmd, capture_output=True, input=b"")
        if r.returncode != 0 or r.stdout != b"1\n":
            raise RuntimeError(f"{cmd[:6]} exited {r.returncode}: {r.stderr.decode(errors='replace')[-500:]}")
        return time.perf_counter() - t0

    once(-1)
    one = [once(i) for i in range(n)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(width) as ex:
        list(ex.map(once, range(n, 2 * n)))
    return {"one_at_a_time": stats(one), "rate_per_s": n / (time.perf_counter() - t0), "width": width}


def peers_worker(params: Path) -> None:
    """Inside `unshare -m` without the cgroup2 mount (crun 1.8 needs that): time the per-call peers
    on the python image's tree (the root of a running sandfleet sandbox of that image)."""
    p = json.loads(params.read_text())
    n, width, tmp = p["n"], p["width"], Path(p["tmp"])
    os.chmod(tmp, 0o755)  # the peers' root (a user namespace's uid) must reach the tree
    # The python image's tree: its EROFS layers under a read-only overlay (this namespace's only).
    lowers = []
    for i, layer in enumerate(p["layers"]):
        (tmp / f"l{i}").mkdir()
        subprocess.run(["mount", "-t", "erofs", "-o", "ro", layer, str(tmp / f"l{i}")], check=True)
        lowers.insert(0, str(tmp / f"l{i}"))
    rootfs = tmp / "root"
    rootfs.mkdir()
    opts = "ro,lowerdir=" + ":".join(lowers)
    subprocess.run(["mount", "-t", "overlay", "-o", opts, "overlay", str(rootfs)], check=True)
    out: dict[str, Any] = {}
    python = shutil.which("python3", path="/usr/bin") or sys.executable

    def attempt(name: str, argv: list[str] | Any) -> None:
        try:
            out[name] = _subprocess_peer(argv, n, width)
        except Exception as exc:  # a peer failing is a result
            out[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:800]}

    attempt("python3 -c on the host (no isolation)", [python, "-c", SNIPPET])
    bwrap = ["bwrap", "--unshare-all", "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev"]
    bwrap += ["--tmpfs", "/tmp", "python3", "-c", SNIPPET]
    attempt("bwrap --unshare-all, python3 -c", bwrap)
    bundle = tmp / "bundle"
    crun_root = tmp / "crun-root"

    def crun(i: int) -> list[str]:
        cid = f"sfb-tiers-{i + 10}"
        b = bundle / cid
        b.mkdir(parents=True, exist_ok=True)
        cfg = sandfleet_oci(rootfs, ["python3", "-c", SNIPPET], f"{p['cgroup_parent']}/{cid}")
        cfg["root"]["readonly"] = True
        (b / "config.json").write_text(json.dumps(cfg))
        return ["crun", "--root", str(crun_root), "run", "--bundle", str(b), cid]

    try:
        attempt("crun run (sandfleet's config), python3 -c", crun)
    finally:
        remove_peer_cgroups(p["cgroup_parent"])
    Path(p["out"]).write_text(json.dumps(out))


def remove_peer_cgroups(parent: str) -> None:
    """What crun made under `parent` (in the namespace without the cgroup2 mount): it removes a
    container's cgroup but not the parents it made on the way, and with the hybrid host's cgroup2
    mount hidden it writes plain directories and files into the tmpfs beneath that mount point."""
    hidden = CGROUP_ROOT / "unified"
    if not os.path.ismount(hidden):
        shutil.rmtree(hidden / parent.strip("/"), ignore_errors=True)
    Cgroups(parent).remove(parent)


def bench_fncall(d: Daemon, n: int, width: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    with Client(d.socket, timeout=300) as fleet:
        fleet.run_code(SNIPPET)  # the pool's first worker
        res["sandfleet run_code, one at a time"] = {"stats": stats(_calls_one_at_a_time(fleet, n))}
        rate = asyncio.run(_calls_in_flight(d.socket, 4 * n, width))
        res["sandfleet run_code, 32 in flight"] = {"rate_per_s": rate, "width": width}
        with fleet.create(image="python", labels={"bench": "tiers"}) as sb:
            for name, cmd in (
                ('exec("true") into a running sandbox (the SDK floor)', ["true"]),
                ("exec python3 -c into a running sandbox (no warm interpreter)", ["python3", "-c", SNIPPET]),
            ):
                for _ in range(5):
                    sb.exec(cmd)
                xs = []
                for _ in range(max(50, n // 4)):
                    t0 = time.perf_counter()
                    sb.exec(cmd)
                    xs.append(time.perf_counter() - t0)
                res[name] = {"stats": stats(xs)}
        res["sandfleet container tier, a fresh sandbox per call"] = {
            "one_at_a_time": stats(_fresh_sandbox_one(fleet, max(20, n // 10))),
            "rate_per_s": asyncio.run(_fresh_sandbox_rate(d.socket, max(64, n // 4), width)),
            "width": width,
        }
    manifest = json.loads((IMAGES / "images" / "python" / "3.11.json").read_text())
    layers = [str(IMAGES / "layers" / (x["digest"].replace(":", "-") + ".erofs")) for x in manifest["layers"]]
    tmp = Path(tempfile.mkdtemp(prefix="sfb-tiers-"))
    params = tmp / "params.json"
    params.write_text(json.dumps({
        "layers": layers, "n": max(50, n // 4), "width": 4, "tmp": str(tmp),
        "cgroup_parent": d.cgroup_parent + "-peers", "out": str(tmp / "out.json"),
    }))  # fmt: skip
    r = subprocess.run(
        in_cgroup_ns_wrapper([sys.executable, __file__, "--peers", str(params)]), capture_output=True, text=True
    )
    if r.returncode != 0:
        res["peers"] = {"status": "failed", "reason": r.stderr[-1500:]}
    else:
        res.update(json.loads((tmp / "out.json").read_text()))
    shutil.rmtree(tmp, ignore_errors=True)
    return res


def vm_figures(d: Daemon, tier: str, n: int) -> dict[str, Any]:
    """Create-to-first-exec, exec round trip and the host memory and CPU each idle sandbox of `tier`
    holds (its processes' PSS: QEMU for a VM, the agent's tree for a container)."""
    res: dict[str, Any] = {}
    with Client(d.socket, timeout=600) as fleet:
        t0 = time.perf_counter()
        fleet.create(backend=tier, image="busybox", labels={"bench": "tiers"}).stop()  # a VM base disk, caches
        res["first_create_s"] = time.perf_counter() - t0  # microvm: boots and saves the image's template
        xs = []
        for _ in range(n):
            t0 = time.perf_counter()
            sb = fleet.create(backend=tier, image="busybox", labels={"bench": "tiers"})
            r = sb.exec("true")
            xs.append(time.perf_counter() - t0)
            if r.exit_code != 0:
                raise RuntimeError(f"{tier}: exec gave {r}")
            sb.stop()
        res["create_to_first_exec"] = stats(xs)
        idle = [fleet.create(backend=tier, image="busybox", labels={"bench": "tiers"}) for _ in range(3)]
        res["idle_exec"] = stats(_execs(idle[0], 20))
        time.sleep(5)
        pids = _sandbox_pids({sb.id for sb in idle})
        res["idle_host_memory_per_sandbox_kib"] = pss_kib(pids) / len(idle) if pids else None
        t0, c0 = time.monotonic(), _cpu_ticks(pids)
        time.sleep(5)
        res["idle_cpu_percent_per_sandbox"] = (_cpu_ticks(pids) - c0) / 100 / (time.monotonic() - t0) / len(idle) * 100
        for sb in idle:
            sb.stop()
        if tier == "microvm":
            res["group"] = _idle_group(d, fleet, tier, GROUP)
        if tier in ("microvm", "vm"):
            res["fork"] = _fork(fleet, tier, FORK)
    return res


FORK = 4


def _fork(fleet: Client, tier: str, n: int) -> dict[str, Any]:
    """A fork of n from an idle VM that wrote 32 MiB into its guest RAM: the call's time, and the
    host memory of the n children (PSS) against the parent's."""
    parent = fleet.create(backend=tier, image="busybox", labels={"bench": "fork"})
    parent.exec("dd if=/dev/urandom of=/tmp/data bs=1M count=32 2>/dev/null")
    t0 = time.perf_counter()
    kids = parent.fork(n)
    seconds = time.perf_counter() - t0
    for k in kids:
        k.exec("true")
    time.sleep(3)
    own = pss_kib(_sandbox_pids({parent.id}))
    theirs = pss_kib(_sandbox_pids({k.id for k in kids}))
    for sb in [*kids, parent]:
        sb.stop()
    return {"n": n, "seconds": seconds, "parent_kib": own, "children_kib": theirs}


GROUP = 16


def _idle_group(d: Daemon, fleet: Client, tier: str, n: int) -> dict[str, Any]:
    """B6: the host memory of n idle VMs of one image against one VM's alone (PSS of their QEMUs,
    which divides a page shared by k of them by k; plus the template's memory file pages no VM maps,
    which the host pays once)."""
    one = fleet.create(backend=tier, image="busybox", labels={"bench": "group"})
    one.exec("true")
    time.sleep(5)
    alone = pss_kib(_sandbox_pids({one.id}))
    rest = [fleet.create(backend=tier, image="busybox", labels={"bench": "group"}) for _ in range(n - 1)]
    for sb in rest:
        sb.exec("true")
    time.sleep(5)
    group = [one, *rest]
    total = pss_kib(_sandbox_pids({sb.id for sb in group}))
    template = sum(f.stat().st_blocks * 512 for f in d.root.glob(f"**/{tier}-templates/*/ram")) / 1024
    for sb in group:
        sb.stop()
    return {"n": n, "one_kib": alone, "all_kib": total, "template_file_kib": template}


def _execs(sb: Any, n: int) -> list[float]:
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        sb.exec("true")
        xs.append(time.perf_counter() - t0)
    return xs


def _sandbox_pids(ids: set[str]) -> list[int]:
    """Every process in the cgroups of these sandboxes, by the host's view of the memory hierarchy
    (containers and VMs alike name their cgroup by sandbox id; a container's own processes see
    only their cgroup namespace's root in /proc/PID/cgroup)."""
    pids: list[int] = []
    root = Path("/sys/fs/cgroup/memory")
    for top in root.iterdir():
        if not top.name.startswith("sandfleet-bench"):
            continue
        for dirpath, dirnames, _files in os.walk(top):
            if Path(dirpath).name in ids:
                for f in Path(dirpath).rglob("cgroup.procs"):
                    pids += [int(x) for x in f.read_text().split()]
                dirnames.clear()
    return sorted(set(pids))


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(f[11]) + int(f[12])
    return total


def leftover_cgroups(parents: list[str]) -> list[str]:
    """The cgroup directories of these parents still present, in any hierarchy (a run leaves none)."""
    return sorted(
        str(c / parent.strip("/"))
        for parent in parents
        for c in CGROUP_ROOT.iterdir()
        if (c / parent.strip("/")).is_dir()
    )


def write_report(res: dict[str, Any], results: Path) -> None:
    results.mkdir(parents=True, exist_ok=True)
    (results / "tiers.json").write_text(json.dumps(res, indent=1))
    lines = [f"# sandfleet tiers, {res['when']} (commit {res['commit']})", ""]
    f = res.get("fncall", {})
    lines += [
        "## fncall: a trivial Python snippet per call",
        "",
        "| path | one at a time p50 / p99 | rate |",
        "|---|---|---|",
    ]
    for name, v in f.items():
        if not isinstance(v, dict) or "status" in v:
            lines.append(f"| {name} | {v} | |")
            continue
        st = v.get("stats") or v.get("one_at_a_time")
        lat = f"{st['p50_ms']:.2f} / {st['p99_ms']:.2f} ms" if st else ""
        rate = f"{v['rate_per_s']:.0f}/s ({v['width']} in flight)" if "rate_per_s" in v else ""
        lines.append(f"| {name} | {lat} | {rate} |")
    for tier in ("container", "microvm", "vm"):
        v = res.get(tier)
        if not v:
            continue
        lines += ["", f"## {tier}", ""]
        if "status" in v:
            lines.append(f"{v['status']}: {v.get('reason', '')}")
            continue
        st = v["create_to_first_exec"]
        mem = v["idle_host_memory_per_sandbox_kib"]
        lines.append(f"- create-to-first-exec p50 {st['p50_ms']:.1f} ms (p99 {st['p99_ms']:.1f}, n={st['n']})")
        size = f"{mem / 1024:.1f} MiB" if mem and mem >= 1024 else f"{mem:.0f} KiB"
        lines.append(f"- idle host memory per sandbox (PSS of its processes) {size}" if mem else "- idle memory: n/a")
        lines.append(f"- idle CPU per sandbox {v['idle_cpu_percent_per_sandbox']:.1f} % of a core")
        lines.append(f"- exec p50 into an idle one {v['idle_exec']['p50_ms']:.2f} ms")
        if "first_create_s" in v:
            firsts = {"microvm": "boots, saves its template", "vm": "base disk, boots, saves its template"}
            what = firsts.get(tier, "caches")
            lines.append(f"- the first create of the image ({what}) {v['first_create_s']:.2f} s")
        if f := v.get("fork"):
            lines.append(
                f"- fork of {f['n']} from an idle one holding 32 MiB written: {f['seconds']:.2f} s; the children "
                f"{f['children_kib'] / 1024:.1f} MiB (PSS) against the parent's {f['parent_kib'] / 1024:.1f} MiB: "
                f"{f['children_kib'] / f['parent_kib']:.2f}x"
            )
        if g := v.get("group"):
            upper = (g["all_kib"] + g["template_file_kib"]) / g["one_kib"]
            lines.append(
                f"- {g['n']} idle ones of one image: {g['all_kib'] / 1024:.1f} MiB (PSS) against one alone "
                f"{g['one_kib'] / 1024:.1f} MiB: {g['all_kib'] / g['one_kib']:.2f}x; counting the template's whole "
                f"memory file ({g['template_file_kib'] / 1024:.1f} MiB) again on top: {upper:.2f}x"
            )
    (results / "tiers.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300, help="calls one at a time (the rate uses 4x)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--vm-n", type=int, default=3, help="VM creates per VM tier")
    ap.add_argument("--tiers", default="fncall,container,microvm,vm")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--peers", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.peers:
        peers_worker(a.peers)
        return 0
    tiers = a.tiers.split(",")
    root = Path(tempfile.mkdtemp(prefix="sfb-tiers-"))
    os.chmod(root, 0o755)  # QEMU's jail (an unprivileged uid) reaches the VM directories under it
    d = Daemon(root, "/sandfleet-bench-tiers")
    parents = [d.cgroup_parent, d.cgroup_parent + "-peers", "/sandfleet-bench-microvm", "/sandfleet-bench-vm"]
    if left := leftover_cgroups(parents):
        raise SystemExit(f"cgroups of an earlier run are still there (remove them first): {left}")
    text = d.config.read_text().replace("[container]\n", '[[backends]]\ntype = "container"\n')
    text += f'[[backends]]\ntype = "fncall"\nworkers = 4\nmax_workers = {a.width // 2}\n'
    for vm in ("microvm", "vm"):
        if vm in tiers:
            text += f'[[backends]]\ntype = "{vm}"\ncgroup_parent = "/sandfleet-bench-{vm}"\n'
    d.config.write_text(text)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit}
    d.start()
    try:
        with Client(d.socket) as c:
            available = c.tiers()
        if "fncall" in tiers:
            print("fncall ...", flush=True)
            res["fncall"] = bench_fncall(d, a.n, a.width)
        for tier in ("container", "microvm", "vm"):
            if tier not in tiers:
                continue
            if tier not in available:
                res[tier] = {"status": "skipped", "reason": "the node does not run this tier"}
                continue
            print(f"{tier} ...", flush=True)
            try:
                res[tier] = vm_figures(d, tier, a.vm_n if tier != "container" else 20)
            except Exception as exc:  # a tier failing is a result
                res[tier] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:1500]}
    finally:
        d.stop_sandboxes()
        d.stop()
        shutil.rmtree(root, ignore_errors=True)
    res["leftover_cgroups"] = leftover_cgroups(parents)
    write_report(res, a.results)
    print((a.results / "tiers.md").read_text())
    if res["leftover_cgroups"]:
        print(f"LEAK: cgroups left behind: {res['leftover_cgroups']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(main())
