"""sandfleet benchmark: sandfleet and its peers, side by side, in one run on one machine.

    python bench/run.py [--quick] [--profile FILE]      (as root)

Measures
  1. create-to-first-exec through the SDK (`fleet.create(image="busybox")` then `sb.exec("true")`);
  2. exec round trips into a running sandbox (`true`, `echo hi`, argv `["true"]`);
  3. peers doing the same "fresh sandbox + run true" cycle (raw crun with a minimal config, crun with
     sandfleet's own config.json, bwrap, runsc, podman, docker) and the same exec (`crun exec`,
     `nsenter -a`), each timed as one subprocess from Python;
  4. density: N idle sandboxes (daemon RSS, host memory per sandbox, PSS of the sandboxes' processes,
     exec latency into random idle sandboxes, daemon CPU while idle);
  5. a burst of concurrent creates through AsyncClient.

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
import datetime as dt
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sandfleet.daemon.process import DaemonProcess
from sandfleet.errors import SandboxError

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
IMAGES = Path(os.environ.get("SANDFLEET_TEST_IMAGES", "/var/lib/sandfleet/images"))
UID_BASE = 100000
ID_RANGE = 65536
POOL_MEMORY = "256MiB"
POOL_SIZE = 16  # one group of rollouts (GRPO-style: 16 samples per task)
DENSITY_MEMORY = "64MiB"  # per-sandbox limit for the density runs: 5,000 x 64 MiB fits the node's overcommit
# What an idle agent sandbox asks the scheduler for (its limit stays 1 CPU): admission counts requests,
# so the thousands of sandboxes of the density, burst and sustained runs fit on 2 cores.
IDLE_CPU_REQUEST = 0.01
TARGETS = {"create_to_first_exec_p50_ms": 30.0, "exec_p50_ms": 5.0, "daemon_rss_idle_mib": 200.0}
DEVNULL = subprocess.DEVNULL
# Peers' stdio: runtimes chown their stdio to the container user, and crun 1.8.1 does so even to the
# host's /dev/null (containers/crun#1845), so peers get a private empty file and a private sink.
PEER_STDIO = Path(tempfile.gettempdir()) / "sandfleet-bench-stdio"  # peer_worker points it into its tmp dir


# --------------------------------------------------------------------------- helpers


def pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = q * (len(s) - 1)
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def stats(seconds: Sequence[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in seconds]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 0.5), 3),
        "p99_ms": round(pct(ms, 0.99), 3),
        "mean_ms": round(sum(ms) / len(ms), 3),
        "min_ms": round(min(ms), 3),
        "max_ms": round(max(ms), 3),
        "samples_ms": [round(x, 3) for x in ms],  # for the distribution chart
    }


def write_chart(res: dict[str, Any], path: Path) -> bool:
    """Box plots of every latency distribution of the run (log scale), side by side with the peers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart", flush=True)
        return False
    sf = res["sandfleet"]
    create: list[tuple[str, list[float]]] = [
        ("sandfleet (cold)", sf["create_to_first_exec"]["create_plus_first_exec"].get("samples_ms", []))
    ]
    if "pooled_create_to_first_exec" in sf:
        create.append(
            ("sandfleet (warm pool)", sf["pooled_create_to_first_exec"]["create_plus_first_exec"]["samples_ms"])
        )
    for name, pr in res["peers"]["cycle"].items():
        if pr.get("status") == "ok" and pr["stats"].get("samples_ms"):
            create.append((name, pr["stats"]["samples_ms"]))
    execs: list[tuple[str, list[float]]] = [
        (f"sandfleet {name}", v["stats"]["samples_ms"])
        for name, v in sf["exec"].items()
        if v["stats"].get("samples_ms")
    ]
    for name, pr in res["peers"]["exec"].items():
        if pr.get("status") == "ok" and pr["stats"].get("samples_ms"):
            execs.append((name, pr["stats"]["samples_ms"]))
    fig, axes = plt.subplots(2, 1, figsize=(10, 8.5))
    for ax, title, series in (
        (axes[0], "fresh sandbox + run `true` (ms, log scale)", create),
        (axes[1], "exec into a running sandbox (ms, log scale)", execs),
    ):
        series = [(n, s) for n, s in series if s]
        ax.boxplot([s for _, s in series], vert=False, whis=(1, 99), showfliers=False)
        ax.set_yticks(range(1, len(series) + 1), [n for n, _ in series], fontsize=8)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", which="both", alpha=0.3)
    meta = res["meta"]
    fig.suptitle(f"sandfleet benchmark {meta.get('date', '')} (whiskers: p1-p99)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def timed_runs(argv: Sequence[str] | Callable[[int], Sequence[str]], n: int, *, warmup: int = 2) -> list[float]:
    """Run argv n times (after `warmup` untimed runs), each as one subprocess; fail on non-zero exit."""
    out: list[float] = []
    for i in range(-warmup, n):
        cmd = argv(i) if callable(argv) else argv
        t0 = time.perf_counter()
        with open(PEER_STDIO.with_suffix(".in"), "ab+") as stdin, open(PEER_STDIO.with_suffix(".out"), "ab") as sink:
            r = subprocess.run(cmd, stdin=stdin, stdout=sink, stderr=subprocess.PIPE)
        dt_ = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}: {r.stderr.decode(errors='replace')[-800:]}")
        if i >= 0:
            out.append(dt_)
    return out


def read_status(pid: int) -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def rss_kib(pid: int) -> int:
    return int(read_status(pid).get("VmRSS", "0 kB").split()[0])


def cpu_ticks(pid: int) -> int:
    # Fields after the parenthesised comm: utime is 14th, stime 15th of the whole line.
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def mem_available_kib(samples: int = 5) -> int:
    """Median of a few MemAvailable samples (the host is shared; single samples jump around)."""
    xs = []
    for i in range(samples):
        if i:
            time.sleep(0.2)
        xs.append(meminfo_kib("MemAvailable"))
    return int(pct(xs, 0.5))


def meminfo_kib(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def cgroup_tree_pids(parent: str, controller: str = "pids") -> list[int]:
    """Processes in the cgroup tree `parent` of one v1 controller that run as the sandbox root uid."""
    top = Path("/sys/fs/cgroup") / controller / parent.lstrip("/")
    pids: set[int] = set()
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in procs.read_text().split())
    return sorted(p for p in pids if read_status(p).get("Uid", "").split()[:1] == [str(UID_BASE)])


def pss_kib(pids: Sequence[int]) -> int:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
    return total


def version_of(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (r.stdout or r.stderr).strip().splitlines()
    return text[0] if text else None


def cgroup_dirs(parent: str) -> list[Path]:
    """Every cgroup directory named `parent` (absolute, e.g. /sfbench-x) in any mounted hierarchy."""
    out = []
    base = Path("/sys/fs/cgroup")
    with contextlib.suppress(OSError):
        for ctrl in base.iterdir():
            p = ctrl / parent.lstrip("/")
            if p.is_dir():
                out.append(p)
    if (base / "cgroup.controllers").exists() and (base / parent.lstrip("/")).is_dir():
        out.append(base / parent.lstrip("/"))
    return out


def remove_cgroup_tree(parent: str) -> list[str]:
    """Kill whatever is left in the cgroup tree `parent` and remove it; return what could not go."""
    left: list[str] = []
    for top in cgroup_dirs(parent):
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True)
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
            else:
                left.append(str(d))
    return left


def in_cgroup_ns_wrapper(argv: list[str]) -> list[str]:
    """argv run in a private mount namespace without the hybrid cgroup2 mount (crun 1.8 needs that)."""
    return [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"',
        "sh",
        *argv,
    ]


# --------------------------------------------------------------------------- peer rootfs / configs


def stage_rootfs(root: Path) -> None:
    """The same busybox tree sandfleet's busybox image is built from, owned by the sandbox root uid."""
    from sandfleet.images.builders import stage_busybox

    stage_busybox(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), UID_BASE, UID_BASE)
    os.lchown(root, UID_BASE, UID_BASE)


def minimal_oci(rootfs: Path, args: list[str], cgroup_path: str) -> dict[str, Any]:
    """A minimal OCI config: user namespace (root -> UID_BASE) plus sandfleet's other namespaces."""
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
        },
        "root": {"path": str(rootfs), "readonly": True},
        "hostname": "peer",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "mode=755"]},
        ],
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": UID_BASE, "size": ID_RANGE}],
            "gidMappings": [{"containerID": 0, "hostID": UID_BASE, "size": ID_RANGE}],
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user", "cgroup")],
            "cgroupsPath": cgroup_path,
        },
    }


def sandfleet_oci(rootfs: Path, args: list[str], cgroup_path: str) -> dict[str, Any]:
    """sandfleet's own config.json (seccomp, caps, masked paths, cgroup limits) with a different command."""
    from sandfleet.models import Resources
    from sandfleet.runtime import oci

    r = Resources()
    cfg = oci.ContainerConfig(
        rootfs=str(rootfs),
        args=args,
        hostname="peer",
        limits=oci.ContainerLimits(cpu=r.cpu, memory=int(r.memory), pids=r.pids),
        cgroup_path=cgroup_path,
        uid_base=UID_BASE,
    )
    return oci.build(cfg)


# --------------------------------------------------------------------------- peer worker (own mount ns)


def peer_worker(params_file: Path) -> None:
    """Runs inside `unshare -m` with /sys/fs/cgroup/unified unmounted; writes results JSON."""
    global PEER_STDIO
    p = json.loads(params_file.read_text())
    tmp = Path(p["tmp"])
    PEER_STDIO = tmp / "peer-stdio"
    n, n_exec, cg = p["n"], p["n_exec"], p["cgroup_parent"]
    rootfs = tmp / "peer-rootfs"
    crun_root = tmp / "crun-root"
    runsc_root = tmp / "runsc-root"
    res: dict[str, Any] = {"cycle": {}, "exec": {}}
    out_file = Path(p["out"])

    def save() -> None:
        out_file.write_text(json.dumps(res, indent=1))

    def attempt(name: str, section: str, fn: Callable[[], dict[str, Any]]) -> None:
        print(f"  peer: {name} ...", flush=True)
        try:
            res[section][name] = {"status": "ok", **fn()}
        except Exception as exc:  # a peer failing is a result, not a crash
            res[section][name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"[:1500]}
        save()

    # host baseline: fork+exec of /bin/true with no isolation at all (the floor of every timing here)
    attempt(
        "host fork+exec (no isolation)",
        "cycle",
        lambda: {"argv": ["/bin/true"], "stats": stats(timed_runs(["/bin/true"], n))},
    )

    def crun_cycle(kind: str) -> dict[str, Any]:
        bundle = tmp / f"bundle-{kind}"
        bundle.mkdir(exist_ok=True)
        make = minimal_oci if kind == "minimal" else sandfleet_oci

        def argv(i: int) -> list[str]:
            cid = f"sfb-{kind}-{i + 10}"
            cfg = make(rootfs, ["/bin/true"], f"{cg}/{cid}")
            (bundle / "config.json").write_text(json.dumps(cfg))
            return ["crun", "--root", str(crun_root), "run", "--bundle", str(bundle), cid]

        return {"argv": argv(0), "stats": stats(timed_runs(argv, n))}

    attempt("crun run (minimal config)", "cycle", lambda: crun_cycle("minimal"))
    attempt("crun run (sandfleet's config.json)", "cycle", lambda: crun_cycle("sandfleet"))

    def bwrap() -> dict[str, Any]:
        if shutil.which("bwrap") is None:
            raise FileNotFoundError("bwrap not installed (apt-get install -y bubblewrap)")
        argv = [
            "bwrap",
            "--unshare-all",
            "--ro-bind",
            str(rootfs),
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "/bin/true",
        ]
        return {"argv": argv, "stats": stats(timed_runs(argv, n))}

    attempt("bwrap --unshare-all", "cycle", bwrap)

    if shutil.which("runsc"):

        def runsc() -> dict[str, Any]:
            bundle = tmp / "bundle-runsc"
            bundle.mkdir(exist_ok=True)

            def argv(i: int) -> list[str]:
                cid = f"sfb-runsc-{i + 10}"
                (bundle / "config.json").write_text(json.dumps(minimal_oci(rootfs, ["/bin/true"], f"{cg}/{cid}")))
                return ["runsc", "--root", str(runsc_root), "--network=none", "run", "--bundle", str(bundle), cid]

            return {"argv": argv(0), "version": version_of(["runsc", "--version"]), "stats": stats(timed_runs(argv, n))}

        attempt("runsc run (gVisor)", "cycle", runsc)
    else:
        res["cycle"]["runsc run (gVisor)"] = {
            "status": "skipped",
            "reason": "runsc not installed (apt-get install -y runsc)",
        }

    if shutil.which("podman"):

        def podman() -> dict[str, Any]:
            pod = tmp / "podman"
            base = [
                "podman",
                "--root",
                str(pod / "root"),
                "--runroot",
                str(pod / "run"),
                "--tmpdir",
                str(pod / "tmp"),
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
                "--storage-driver",
                "overlay",
            ]
            tarball = tmp / "busybox.tar"
            with tarfile.open(tarball, "w") as tf:
                tf.add(rootfs, arcname=".")
            t0 = time.perf_counter()
            r = subprocess.run([*base, "import", str(tarball), "localhost/sfbench-busybox"], capture_output=True)
            if r.returncode != 0:
                raise RuntimeError(f"podman import failed: {r.stderr.decode(errors='replace')[-800:]}")
            import_s = time.perf_counter() - t0
            # This host's root lacks CAP_SYS_RESOURCE, so podman's default rlimits (nofile 1048576) fail.
            argv = [
                *base,
                "run",
                "--rm",
                "--network",
                "none",
                "--cgroup-parent",
                f"{cg}/podman",
                "--ulimit",
                "nofile=1024:1024",
                "--ulimit",
                "nproc=4096:4096",
                "localhost/sfbench-busybox",
                "true",
            ]
            return {
                "argv": argv,
                "version": version_of(["podman", "--version"]),
                "image_import_s": round(import_s, 3),
                "note": "no user namespace (podman's default as root); --network none",
                "stats": stats(timed_runs(argv, n)),
            }

        attempt("podman run --rm", "cycle", podman)
    else:
        res["cycle"]["podman run --rm"] = {
            "status": "skipped",
            "reason": "podman not installed "
            "(apt-get install -y podman); it would also need a local busybox image "
            "(no registry is reachable): the benchmark imports one from a tarball",
        }

    res["cycle"]["docker run --rm"] = {"status": "skipped", "reason": p["docker_reason"]}
    save()

    # exec into a running container
    long_bundle = tmp / "bundle-long"
    long_bundle.mkdir(exist_ok=True)
    (long_bundle / "config.json").write_text(json.dumps(minimal_oci(rootfs, ["/bin/sleep", "3600"], f"{cg}/long")))
    long_id = "sfb-long"
    try:
        errlog = tmp / "crun-long.err"  # a file, not a pipe: the detached container keeps its stderr open
        with open(errlog, "wb") as err, open(tmp / "crun-long.in", "ab+") as stdin:
            r = subprocess.run(
                ["crun", "--root", str(crun_root), "run", "--detach", "--bundle", str(long_bundle), long_id],
                stdin=stdin,
                stdout=err,
                stderr=err,
            )
        if r.returncode != 0:
            res["exec"]["crun exec"] = {"status": "failed", "reason": errlog.read_text(errors="replace")[-800:]}
        else:
            state = json.loads(
                subprocess.run(
                    ["crun", "--root", str(crun_root), "state", long_id], capture_output=True, check=True
                ).stdout
            )
            pid = int(state["pid"])
            crun_exec = ["crun", "--root", str(crun_root), "exec", long_id, "/bin/true"]
            attempt("crun exec", "exec", lambda: {"argv": crun_exec, "stats": stats(timed_runs(crun_exec, n_exec))})
            nsenter = ["nsenter", "-t", str(pid), "-a", "/bin/true"]
            attempt("nsenter -a", "exec", lambda: {"argv": nsenter, "stats": stats(timed_runs(nsenter, n_exec))})
    finally:
        subprocess.run(["crun", "--root", str(crun_root), "delete", "--force", long_id], stdout=DEVNULL, stderr=DEVNULL)
    save()


def peer_leftover_cleanup(tmp: Path) -> None:
    """Delete any peer container a crashed worker left behind (inside a crun-friendly namespace)."""
    script = []
    if (tmp / "crun-root").is_dir():
        for cid in os.listdir(tmp / "crun-root"):
            script.append(f"crun --root {tmp / 'crun-root'} delete --force {cid}")
    if (tmp / "runsc-root").is_dir() and shutil.which("runsc"):
        script.append(
            f"for c in $(runsc --root {tmp / 'runsc-root'} list -quiet 2>/dev/null); do "
            f"runsc --root {tmp / 'runsc-root'} delete -force $c; done"
        )
    pod = tmp / "podman"
    if pod.is_dir() and shutil.which("podman"):
        script.append(
            f"podman --root {pod / 'root'} --runroot {pod / 'run'} --tmpdir {pod / 'tmp'} "
            "--cgroup-manager cgroupfs --events-backend file --storage-driver overlay rm -af -t 0"
        )
    if script:
        subprocess.run(
            in_cgroup_ns_wrapper(["sh", "-c", "; ".join(script)]), stdout=DEVNULL, stderr=DEVNULL, timeout=120
        )


# --------------------------------------------------------------------------- the daemon


class Daemon:
    def __init__(self, root: Path, cgroup_parent: str) -> None:
        self.root = root
        self.socket = root / "sandfleet.sock"
        self.config = root / "config.toml"
        self.cgroup_parent = cgroup_parent
        self.process = DaemonProcess(["--config", str(self.config)], workdir=root, log=root / "daemon.log")
        self.crashes: list[dict[str, Any]] = []
        root.mkdir(parents=True, exist_ok=True)
        self.config.write_text(
            f'socket = "{self.socket}"\nstate_dir = "{root / "state"}"\nrun_dir = "{root / "run"}"\n'
            f'image_dir = "{IMAGES}"\nstopped_retention = 0\n'
            # Density runs hundreds of default (1 GiB-limit) sandboxes: far more limit than RAM.
            "memory_overcommit = 64\n"
            # A warm pool of its own shape, so the cold-create figures never hit it.
            f'[[pools]]\nimage = "busybox"\nsize = {POOL_SIZE}\n[pools.resources]\nmemory = "{POOL_MEMORY}"\n'
            f'[container]\ncgroup_parent = "{cgroup_parent}"\n'
        )

    def start(self, timeout: float = 120.0) -> None:
        self.process.start(timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.alive()

    def log(self) -> str:
        return self.process.log()

    def stop(self) -> None:
        self.process.stop()


def daemon_metrics(sock: Path) -> dict[str, float]:
    import httpx

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://sandfleet") as c:
        text = c.get("/metrics").text
    out = {}
    for name in (
        "sandfleet_create_seconds_sum",
        "sandfleet_create_seconds_count",
        "sandfleet_exec_seconds_sum",
        "sandfleet_exec_seconds_count",
    ):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def metrics_delta(before: dict[str, float], after: dict[str, float], kind: str) -> float | None:
    n = after.get(f"sandfleet_{kind}_seconds_count", 0) - before.get(f"sandfleet_{kind}_seconds_count", 0)
    s = after.get(f"sandfleet_{kind}_seconds_sum", 0) - before.get(f"sandfleet_{kind}_seconds_sum", 0)
    return round(s / n * 1000, 3) if n else None


# --------------------------------------------------------------------------- sandfleet phases


def bench_create(
    fleet: Any, n: int, labels: dict[str, str], sock: Path, *, memory: str | None = None, pause: float = 0.0
) -> dict[str, Any]:
    """Create + first exec, N times. `memory` picks the shape (the warm pool's, for pooled runs);
    `pause` between cycles lets a pool refill (an arrival rate below its refill capacity)."""
    create, first, total, stop = [], [], [], []
    shape = {"resources": {"memory": memory}} if memory else {}
    for _ in range(3):  # warm-up: image resolved, layers mounted, connection open
        with fleet.create(image="busybox", labels=labels, **shape) as sb:
            sb.exec("true")
    m0 = daemon_metrics(sock)
    for _ in range(n):
        time.sleep(pause)
        t0 = time.perf_counter()
        sb = fleet.create(image="busybox", labels=labels, **shape)
        t1 = time.perf_counter()
        r = sb.exec("true")
        t2 = time.perf_counter()
        if r.exit_code != 0:
            raise RuntimeError(f"exec true failed: {r}")
        sb.stop()
        t3 = time.perf_counter()
        create.append(t1 - t0)
        first.append(t2 - t1)
        total.append(t2 - t0)
        stop.append(t3 - t2)
    m1 = daemon_metrics(sock)
    return {
        "create_plus_first_exec": stats(total),
        "create": stats(create),
        "first_exec": stats(first),
        "stop_not_in_cycle": stats(stop),
        "daemon_side_create_mean_ms": metrics_delta(m0, m1, "create"),
        "daemon_side_exec_mean_ms": metrics_delta(m0, m1, "exec"),
    }


def bench_pooled_groups(fleet: Any, groups: int, labels: dict[str, str]) -> dict[str, Any]:
    """A trainer starting a group of rollouts: POOL_SIZE creates back to back from a full warm pool,
    each followed by its first exec; the group is stopped and the pool refills before the next."""
    from sandfleet import Resources

    create, total = [], []
    for _ in range(groups):
        time.sleep(3)  # the pool refills
        sbs = []
        for _ in range(POOL_SIZE):
            t0 = time.perf_counter()
            sb = fleet.create(image="busybox", labels=labels, resources=Resources(memory=POOL_MEMORY))
            t1 = time.perf_counter()
            if sb.exec("true").exit_code != 0:
                raise RuntimeError("exec true failed")
            create.append(t1 - t0)
            total.append(time.perf_counter() - t0)
            sbs.append(sb)
        for sb in sbs:
            sb.stop()
    return {"group": POOL_SIZE, "groups": groups, "create_plus_first_exec": stats(total), "create": stats(create)}


def bench_exec(fleet: Any, n: int, labels: dict[str, str], sock: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with fleet.create(image="busybox", labels=labels) as sb:
        for name, cmd, want in (
            ('exec("true")', "true", ""),
            ('exec("echo hi")', "echo hi", "hi\n"),
            ('exec(["true"]) (argv, no shell)', ["true"], ""),
        ):
            for _ in range(20):
                sb.exec(cmd)
            m0 = daemon_metrics(sock)
            xs = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = sb.exec(cmd)
                xs.append(time.perf_counter() - t0)
                if r.exit_code != 0 or r.stdout != want:
                    raise RuntimeError(f"exec {cmd!r} gave {r}")
            m1 = daemon_metrics(sock)
            out[name] = {"stats": stats(xs), "daemon_side_mean_ms": metrics_delta(m0, m1, "exec")}
    return out


def settle(seconds: float) -> None:
    time.sleep(seconds)  # a measurement window, not synchronisation


def bench_density(fleet: Any, daemon: Daemon, n: int, n_exec: int, labels: dict[str, str]) -> dict[str, Any]:
    pid = daemon.pid
    before_pids = set(cgroup_tree_pids(daemon.cgroup_parent))
    settle(2)
    rss0 = rss_kib(pid)
    avail0 = mem_available_kib()
    fds0 = len(os.listdir(f"/proc/{pid}/fd"))
    threads0 = int(read_status(pid).get("Threads", "0"))
    from sandfleet import Resources, SandboxSpec

    spec = SandboxSpec(
        image="busybox", labels=labels, resources=Resources(memory=DENSITY_MEMORY, cpu_request=IDLE_CPU_REQUEST)
    )
    t0 = time.perf_counter()
    results = fleet.create_many([spec] * n, concurrency=32)
    create_all_s = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, SandboxError)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} density creates failed, e.g. {failed[0]!r}")
    sbs = [r for r in results if not isinstance(r, SandboxError)]
    settle(3)
    rss1 = rss_kib(pid)
    avail1 = mem_available_kib()
    fds1 = len(os.listdir(f"/proc/{pid}/fd"))
    threads1 = int(read_status(pid).get("Threads", "0"))
    # the sandboxes' processes: our daemon's cgroup tree only (other daemons may run on this host)
    pids = [p for p in cgroup_tree_pids(daemon.cgroup_parent) if p not in before_pids]
    pss = pss_kib(pids)
    cg_mem = None
    for d in cgroup_dirs(daemon.cgroup_parent):
        if d.parent.name == "memory" and (d / "memory.usage_in_bytes").exists():
            cg_mem = int((d / "memory.usage_in_bytes").read_text()) // 1024

    # daemon CPU while the sandboxes idle
    hz = os.sysconf("SC_CLK_TCK")
    c0 = cpu_ticks(pid)
    a0 = sum(cpu_ticks(p) for p in pids if os.path.exists(f"/proc/{p}"))
    w0 = time.monotonic()
    settle(10)
    c1 = cpu_ticks(pid)
    a1 = sum(cpu_ticks(p) for p in pids if os.path.exists(f"/proc/{p}"))
    wall = time.monotonic() - w0

    rng = random.Random(1234)
    xs = []
    for _ in range(n_exec):
        sb = rng.choice(sbs)
        t = time.perf_counter()
        r = sb.exec("true")
        xs.append(time.perf_counter() - t)
        if r.exit_code != 0:
            raise RuntimeError(f"exec into idle sandbox failed: {r}")
    running = len(fleet.list(labels=labels, state="running"))
    t = time.perf_counter()
    stop_error = None
    try:
        stopped = fleet.stop_many(labels)
    except SandboxError as exc:
        stopped, stop_error = [], f"{type(exc).__name__}: {exc}"
        restart_if_dead(daemon, fleet, labels, "density stop_many")
    stop_all_s = time.perf_counter() - t
    return {
        "sandboxes": n,
        "running_at_measurement": running,
        "create_all_s": round(create_all_s, 3),
        "daemon_rss_before_mib": round(rss0 / 1024, 1),
        "daemon_rss_after_mib": round(rss1 / 1024, 1),
        "daemon_rss_per_sandbox_kib": round((rss1 - rss0) / n, 1),
        "host_mem_used_per_sandbox_kib": round((avail0 - avail1) / n, 1),
        "host_mem_used_total_mib": round((avail0 - avail1) / 1024, 1),
        "sandbox_processes": len(pids),
        "sandbox_pss_total_mib": round(pss / 1024, 2),
        "sandbox_pss_per_sandbox_kib": round(pss / n, 1),
        "cgroup_memory_usage_total_mib": round(cg_mem / 1024, 1) if cg_mem is not None else None,
        "daemon_fds_before": fds0,
        "daemon_fds_after": fds1,
        "daemon_threads_before": threads0,
        "daemon_threads_after": threads1,
        "daemon_idle_cpu_percent_of_one_core": round((c1 - c0) / hz / wall * 100, 2),
        "sandboxes_idle_cpu_percent_of_one_core": round((a1 - a0) / hz / wall * 100, 2),
        "idle_window_s": round(wall, 2),
        "exec_into_random_idle": stats(xs),
        "stop_all_s": round(stop_all_s, 3),
        "stopped": len(stopped),
        "stop_error": stop_error,
    }


def _zram_used() -> int:
    """Bytes of memory all zram devices use (compressed data + metadata): what swapped pages cost."""
    total = 0
    for dev in Path("/sys/block").glob("zram*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int((dev / "mm_stat").read_text().split()[2])
    return total


def bench_fork(fleet: Any, n: int, children: int, labels: dict[str, str]) -> dict[str, Any]:
    """Fork `children` sandboxes from one live sandbox (a counter running, a few files written):
    seconds from the fork call until every child is exec-ready, and until each has run one exec
    that reads the counter it inherited."""
    from sandfleet import SandboxError

    counter = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.01; done"
    rows = []
    for _ in range(n):
        parent = fleet.create(image="busybox", labels=labels)
        kids: list[Any] = []
        try:
            parent.exec("mkdir -p /task && seq 1 1000 > /task/data && echo setup > /task/state")
            parent.start(counter)
            time.sleep(0.3)
            t = time.perf_counter()
            kids = parent.fork(children, labels=labels)
            fork_s = time.perf_counter() - t
            failed = [k for k in kids if isinstance(k, SandboxError)]
            if failed:
                raise RuntimeError(f"{len(failed)} of {children} forks failed: {failed[0]}")
            # Empty when the snapshot caught the shell between truncating and writing the file.
            counts = [int(k.exec("cat /tmp/count").stdout.strip() or 0) for k in kids]
            all_s = time.perf_counter() - t
            snaps = [e for e in parent.events() if e.kind == "snapshot"]
            rows.append((fork_s, all_s, snaps[-1].data["seconds"] if snaps else 0.0, min(counts)))
        finally:
            for k in kids:
                if not isinstance(k, SandboxError):
                    k.stop()
            parent.stop()

    def med(i: int) -> float:
        return sorted(r[i] for r in rows)[len(rows) // 2]

    return {
        "n": n,
        "children": children,
        "fork_s": round(med(0), 3),
        "fork_s_max": round(max(r[0] for r in rows), 3),
        "fork_and_one_exec_each_s": round(med(1), 3),
        "snapshot_s": round(med(2), 3),
        "min_inherited_count": min(r[3] for r in rows),
    }


KSM = Path("/sys/kernel/mm/ksm")


def _ksm(name: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int((KSM / name).read_text())
    return 0


def _ksm_settle(limit: float) -> float:
    """Seconds until ksmd has stopped finding new pages to share (or `limit`)."""
    t0 = time.monotonic()
    last, still = _ksm("pages_sharing"), 0.0
    while time.monotonic() - t0 < limit:
        time.sleep(1.0)
        now = _ksm("pages_sharing")
        still = still + 1.0 if now - last < 256 else 0.0  # < 1 MiB more in a second
        last = now
        if still >= 3 and _ksm("full_scans") > 0:
            break
    return round(time.monotonic() - t0, 1)


def bench_fork_memory(fleet: Any, children: int, mib: int, labels: dict[str, str]) -> dict[str, Any]:
    """A parent holding `mib` MiB of random bytes (identical in every child, unlike in other
    sandboxes), forked `children` times: host memory the children take, with the kernel's
    same-page merging (the daemon's default) and, side by side in the same run, without it
    (ksmd stopped, its merged pages split again)."""
    from sandfleet import SandboxError

    hold = f"import os, time; d = os.urandom({mib} << 20); time.sleep(10**6)"
    out: dict[str, Any] = {"children": children, "parent_mib": mib}
    saved_run = (KSM / "run").read_text().strip() if KSM.exists() else "0"
    try:
        for mode in ("ksm", "no_ksm"):
            if KSM.exists():
                (KSM / "run").write_text("1" if mode == "ksm" else "2")
            parent = fleet.create(image="python:3.11", resources={"memory": f"{mib * 2}MiB"}, labels=labels)
            kids: list[Any] = []
            try:
                parent.start(["python3", "-c", hold])
                wait = time.monotonic() + 60
                while parent.usage().memory_bytes < mib << 20 and time.monotonic() < wait:
                    time.sleep(0.2)
                parent_bytes = parent.usage().memory_bytes
                settle(2)
                before = mem_available_kib()
                t = time.perf_counter()
                kids = parent.fork(children, labels=labels)
                fork_s = time.perf_counter() - t
                failed = [k for k in kids if isinstance(k, SandboxError)]
                if failed:
                    raise RuntimeError(f"{len(failed)} of {children} forks failed: {failed[0]}")
                right_after = mem_available_kib()
                settle_s = _ksm_settle(120) if mode == "ksm" else 0.0
                after = mem_available_kib()
                out[mode] = {
                    "fork_s": round(fork_s, 3),
                    "parent_mib": round(parent_bytes / 2**20, 1),
                    "children_mib_right_after_fork": round((before - right_after) / 1024, 1),
                    "children_mib": round((before - after) / 1024, 1),
                    "per_child_mib": round((before - after) / 1024 / children, 1),
                    "ksm_settle_s": settle_s,
                    "ksm_pages_sharing": _ksm("pages_sharing"),
                }
            finally:
                for k in kids:
                    if not isinstance(k, SandboxError):
                        k.stop()
                parent.stop()
    finally:
        if KSM.exists():
            (KSM / "run").write_text(saved_run if saved_run != "2" else "1")
    if "ksm" in out and "no_ksm" in out and out["ksm"]["children_mib"] > 0:
        out["memory_ratio_no_ksm_over_ksm"] = round(out["no_ksm"]["children_mib"] / out["ksm"]["children_mib"], 2)
        out["children_over_parent_ksm"] = round(out["ksm"]["children_mib"] / max(1.0, out["ksm"]["parent_mib"]), 2)
    return out


def bench_pause(fleet: Any, daemon: Daemon, n: int, labels: dict[str, str]) -> dict[str, Any]:
    """A sandbox holding 200 MiB of anonymous memory: pause (freeze + push out), then resume by exec."""
    from sandfleet import Resources

    hold = 'awk \'BEGIN { s = sprintf("%209715200s", ""); system("sleep 1000") }\''
    rows = []
    for _ in range(n):
        sb = fleet.create(image="busybox", labels=labels, resources=Resources(memory="512MiB"))
        try:
            mem = next(d for d in cgroup_dirs(daemon.cgroup_parent) if d.parent.name == "memory") / sb.id
            sb.start(hold)
            deadline = time.time() + 30
            while int((mem / "memory.usage_in_bytes").read_text()) < 200 * 1024**2 and time.time() < deadline:
                time.sleep(0.05)
            before = int((mem / "memory.usage_in_bytes").read_text())
            zram0 = _zram_used()
            t = time.perf_counter()
            sb.pause()
            pause_s = time.perf_counter() - t
            after = int((mem / "memory.usage_in_bytes").read_text())
            zram1 = _zram_used()
            t = time.perf_counter()
            r = sb.exec("true")
            resume_ms = (time.perf_counter() - t) * 1000
            if r.exit_code != 0:
                raise RuntimeError(f"exec after pause failed: {r}")
            rows.append((before, after, pause_s, resume_ms, zram1 - zram0))
        finally:
            sb.stop()

    def med(i: int) -> float:
        return sorted(r[i] for r in rows)[len(rows) // 2]

    return {
        "n": n,
        "memory_before_mib": round(med(0) / 1024**2, 1),
        "memory_after_mib": round(med(1) / 1024**2, 2),
        "fraction_pushed_out": round(1 - med(1) / med(0), 4),
        "pause_s": round(med(2), 3),
        "pause_s_max": round(max(r[2] for r in rows), 3),
        "resume_to_first_exec_ms": round(med(3), 2),
        "resume_to_first_exec_ms_max": round(max(r[3] for r in rows), 2),
        "zram_growth_mib": round(med(4) / 1024**2, 2),
        "swap": Path("/proc/swaps").read_text().splitlines()[1:],
    }


def bench_qos(fleet: Any, n: int, labels: dict[str, str]) -> dict[str, Any]:
    """exec("true") into a latency-sensitive sandbox: unloaded, then with both cores saturated by
    CPU hogs in best-effort sandboxes, then by the same hogs without QoS (latency-sensitive too)."""
    from sandfleet import Resources

    ncpu = os.cpu_count() or 2
    hog = " & ".join(["while :; do :; done"] * 2) + " & wait"
    probe = fleet.create(image="busybox", labels=labels)

    def measure() -> dict[str, Any]:
        for _ in range(10):
            probe.exec("true")
        return stats([_timed(lambda: probe.exec("true")) for _ in range(n)])

    def loaded(qos: str) -> dict[str, Any]:
        hogs = [
            fleet.create(image="busybox", labels=labels, qos=qos, resources=Resources(cpu=2)) for _ in range(4 * ncpu)
        ]
        try:
            for h in hogs:
                h.start(hog)
            time.sleep(1)
            return measure()
        finally:
            for h in hogs:
                h.stop()

    try:
        unloaded = measure()
        with_qos = loaded("best_effort")
        without_qos = loaded("latency_sensitive")
    finally:
        probe.stop()
    return {
        "hogs": f"{4 * ncpu} sandboxes x 2 busy loops (cpu limit 2 each)",
        "unloaded": unloaded,
        "hogs_best_effort": with_qos,
        "hogs_latency_sensitive": without_qos,
        "ratio_p50_with_qos": round(with_qos["p50_ms"] / unloaded["p50_ms"], 2),
        "ratio_p50_without_qos": round(without_qos["p50_ms"] / unloaded["p50_ms"], 2),
    }


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def restart_if_dead(daemon: Daemon, fleet: Any, labels: dict[str, str], where: str) -> None:
    """After a failed call: if the daemon died, record it, start it again (it adopts the sandboxes), stop ours."""
    daemon.process.wait(5)
    if daemon.alive():
        return
    # rich draws tracebacks in boxes: keep the plain lines (the exception and uvicorn's traceback)
    plain = [ln for ln in daemon.log().splitlines() if ln.strip() and ln.lstrip()[:1] not in ("│", "╭", "╰")]
    errors = sorted({ln for ln in plain if re.match(r"^[\w.]+(Error|Exception)\b", ln)})
    daemon.crashes.append(
        {
            "where": where,
            "exit_code": daemon.process.returncode,
            "errors": errors,
            "log_tail": "\n".join(plain[-60:]),
        }
    )

    print(f"!! the daemon died during {where} (exit {daemon.process.returncode}); "
          "restarting it to adopt and stop its sandboxes", flush=True)  # fmt: skip
    (daemon.root / "daemon.log").rename(daemon.root / f"daemon.crash{len(daemon.crashes)}.log")
    daemon.start()
    fleet.stop_many(labels)


async def bench_burst(sock: Path, n: int, concurrency: int, labels: dict[str, str]) -> dict[str, Any]:
    """n creates through `create_many` (batched requests), then one exec into each: all exec-ready when?"""
    from sandfleet import AsyncClient, Resources, SandboxSpec

    async with AsyncClient(sock, timeout=600) as fleet:
        spec = SandboxSpec(
            image="busybox", labels=labels, resources=Resources(memory=DENSITY_MEMORY, cpu_request=IDLE_CPU_REQUEST)
        )
        t0 = time.perf_counter()
        results = await fleet.create_many([spec] * n, concurrency=concurrency)
        created_s = time.perf_counter() - t0
        sbs = [r for r in results if not isinstance(r, SandboxError)]
        failed = [r for r in results if isinstance(r, SandboxError)]
        sem = asyncio.Semaphore(32)

        async def first_exec(sb: Any) -> None:
            async with sem:
                r = await sb.exec("true")
                if r.exit_code != 0:
                    raise RuntimeError(f"exec after burst create failed: {r}")

        await asyncio.gather(*(first_exec(sb) for sb in sbs))
        elapsed = time.perf_counter() - t0
        t1 = time.perf_counter()
        stop_error = None
        try:
            stopped = await fleet.stop_many(labels)
        except SandboxError as exc:
            stopped, stop_error = [], f"{type(exc).__name__}: {exc}"
        stop_s = time.perf_counter() - t1
    return {
        "sandboxes": n,
        "in_flight": concurrency,
        "failed": len(failed),
        "created_s": round(created_s, 3),
        "creations_per_s": round(n / created_s, 1),
        "all_exec_ready_s": round(elapsed, 3),
        "stop_many_s": round(stop_s, 3),
        "stopped": len(stopped),
        "stop_error": stop_error,
    }


# --------------------------------------------------------------------------- report


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return round(a / b, 2)


def build_tables(res: dict[str, Any]) -> list[tuple[str, list[str], list[list[str]]]]:
    def f(x: Any, nd: int = 2) -> str:
        if x is None:
            return "-"
        if isinstance(x, float):
            return f"{x:.{nd}f}"
        return str(x)

    sf = res["sandfleet"]
    tables = []
    base = sf["create_to_first_exec"]["create_plus_first_exec"]

    def sandfleet_row(label: str, st: dict[str, Any], note: str) -> list[str]:
        """One sandfleet line of the cycle table, with its ratios to the cold create."""
        ratios = [f(st["p50_ms"] / base["p50_ms"], 2), f(st["mean_ms"] / base["mean_ms"], 2)]
        return [label, f(st["p50_ms"]), f(st["p99_ms"]), f(st["mean_ms"]), *ratios, note]

    cold = sf["create_to_first_exec"]
    rows = [
        sandfleet_row(
            'sandfleet SDK: create + exec("true")',
            base,
            f"create p50 {f(cold['create']['p50_ms'])} ms + first exec p50 {f(cold['first_exec']['p50_ms'])} ms",
        )
    ]
    if "pooled_create_to_first_exec" in sf:
        pooled = sf["pooled_create_to_first_exec"]
        rows.append(
            sandfleet_row(
                'sandfleet SDK, warm pool: create + exec("true")',
                pooled["create_plus_first_exec"],
                f"create p50 {f(pooled['create']['p50_ms'])} ms + first exec p50 "
                f"{f(pooled['first_exec']['p50_ms'])} ms; one create every 0.2 s (the CPUs idle in between)",
            )
        )
    if "pooled_groups" in sf:
        pg = sf["pooled_groups"]
        rows.append(
            sandfleet_row(
                f'sandfleet SDK, warm pool, groups of {pg["group"]} back to back: create + exec("true")',
                pg["create_plus_first_exec"],
                f"create p50 {f(pg['create']['p50_ms'])} ms; {pg['groups']} groups, the pool refilled between them",
            )
        )
    for name, pr in res["peers"]["cycle"].items():
        if pr["status"] == "ok":
            s = pr["stats"]
            r = res["ratios"]["create_cycle"][name]
            rows.append(
                [name, f(s["p50_ms"]), f(s["p99_ms"]), f(s["mean_ms"]), f(r["p50"]), f(r["mean"]), pr.get("note", "")]
            )
        else:
            rows.append([name, "-", "-", "-", "-", "-", f"{pr['status']}: {pr['reason']}"[:160]])
    n = base["n"]
    tables.append(
        (
            f"Fresh sandbox + run `true` (ms, N={n}; ratio = peer / sandfleet)",
            ["what", "p50", "p99", "mean", "ratio p50", "ratio mean", "notes"],
            rows,
        )
    )

    rows = []
    ex = sf["exec"]
    ref = ex['exec("true")']["stats"]
    for name, e in ex.items():
        s = e["stats"]
        rows.append(
            [
                f"sandfleet SDK {name}",
                f(s["p50_ms"]),
                f(s["p99_ms"]),
                f(s["mean_ms"]),
                f(ratio(s["p50_ms"], ref["p50_ms"])),
                f(ratio(s["mean_ms"], ref["mean_ms"])),
                f"daemon-side mean {f(e['daemon_side_mean_ms'])} ms",
            ]
        )
    for name, pr in res["peers"]["exec"].items():
        if pr["status"] == "ok":
            s = pr["stats"]
            r = res["ratios"]["exec"][name]
            rows.append([name, f(s["p50_ms"]), f(s["p99_ms"]), f(s["mean_ms"]), f(r["p50"]), f(r["mean"]), ""])
        else:
            rows.append([name, "-", "-", "-", "-", "-", f"{pr['status']}: {pr['reason']}"[:160]])
    tables.append(
        (
            f'Exec into a running sandbox (ms, N={ref["n"]}; ratio = x / sandfleet exec("true"))',
            ["what", "p50", "p99", "mean", "ratio p50", "ratio mean", "notes"],
            rows,
        )
    )

    rows = []
    for d in sf["density"]:
        e = d["exec_into_random_idle"]
        n = d["sandboxes"]
        rows += [
            [
                f"{n} idle: daemon RSS before -> after (MiB)",
                f"{f(d['daemon_rss_before_mib'], 1)} -> {f(d['daemon_rss_after_mib'], 1)}",
            ],
            [f"{n} idle: daemon RSS per sandbox (KiB)", f(d["daemon_rss_per_sandbox_kib"], 1)],
            [
                f"{n} idle: host memory per sandbox (MemAvailable delta / N, KiB)",
                f(d["host_mem_used_per_sandbox_kib"], 1),
            ],
            [
                f"{n} idle: PSS of all sandbox processes (MiB total / KiB each)",
                f"{f(d['sandbox_pss_total_mib'])} / {f(d['sandbox_pss_per_sandbox_kib'], 1)}",
            ],
            [f"{n} idle: sandbox cgroups' memory.usage_in_bytes total (MiB)", f(d["cgroup_memory_usage_total_mib"], 1)],
            [
                f"{n} idle: daemon fds / threads before -> after",
                f"{d['daemon_fds_before']} / {d['daemon_threads_before']} -> {d['daemon_fds_after']} / "
                f"{d['daemon_threads_after']}",
            ],
            [
                f"{n} idle: daemon CPU while idle ({f(d['idle_window_s'], 1)} s, % of one core)",
                f(d["daemon_idle_cpu_percent_of_one_core"]),
            ],
            [
                f'{n} idle: exec("true") into random idle sandboxes p50 / p99 / mean (ms)',
                f"{f(e['p50_ms'])} / {f(e['p99_ms'])} / {f(e['mean_ms'])} (N={e['n']})",
            ],
            [f"{n} idle: create_many of all (s)", f(d["create_all_s"])],
            [f"{n} idle: stop_many of all (s)", f(d["stop_all_s"])],
        ]
    for key in ("burst", "sustained"):
        b = sf[key]
        rows += [
            [
                f"{key}: {b['sandboxes']} creates (create_many, {b['in_flight']} in flight): seconds / creations/s",
                f"{f(b['created_s'])} / {f(b['creations_per_s'], 1)}",
            ],
            [f"{key}: all {b['sandboxes']} exec-ready (created + one exec each) (s)", f(b["all_exec_ready_s"])],
            [f"{key}: failed creates / stop_many of all (s)", f"{b['failed']} / {f(b['stop_many_s'])}"],
        ]
    pz = sf["pause"]
    rows += [
        [
            f"pause of a sandbox holding {f(pz['memory_before_mib'], 0)} MiB anon: seconds (median / max of {pz['n']})",
            f"{f(pz['pause_s'], 3)} / {f(pz['pause_s_max'], 3)}",
        ],
        [
            "pause: memory left in the sandbox's cgroup (MiB) / share pushed out / zram growth (MiB)",
            f"{f(pz['memory_after_mib'])} / {f(100 * pz['fraction_pushed_out'], 1)} % / {f(pz['zram_growth_mib'])}",
        ],
        [
            "resume (transparent, by exec) to first exec done, ms (median / max)",
            f"{f(pz['resume_to_first_exec_ms'])} / {f(pz['resume_to_first_exec_ms_max'])}",
        ],
    ]
    fk = sf["fork"]
    rows += [
        [
            f"fork of {fk['children']} from one live sandbox: seconds (median / max of {fk['n']}); snapshot part",
            f"{f(fk['fork_s'], 3)} / {f(fk['fork_s_max'], 3)}; {f(fk['snapshot_s'], 3)}",
        ],
        ["fork: until every child has run one exec (s)", f(fk["fork_and_one_exec_each_s"], 3)],
    ]
    fm = sf.get("fork_memory") or {}
    for mode, label in (("ksm", "with KSM (default)"), ("no_ksm", "without KSM")):
        if mode in fm:
            m = fm[mode]
            rows.append(
                [
                    f"fork of {fm['children']} from a parent holding {f(m['parent_mib'], 0)} MiB, {label}: host "
                    "memory of all children (MiB; per child); fork s; KSM settle s",
                    f"{f(m['children_mib'], 0)} ({f(m['per_child_mib'], 1)}); {f(m['fork_s'], 2)}; "
                    f"{f(m['ksm_settle_s'], 0)}",
                ]
            )
    qs = sf["qos"]
    rows += [
        [
            'QoS: latency-sensitive exec("true") p50 / p99, unloaded (ms)',
            f"{f(qs['unloaded']['p50_ms'])} / {f(qs['unloaded']['p99_ms'])}",
        ],
        [
            f"QoS: same, while {qs['hogs']} run as best_effort (ms; p50 ratio to unloaded)",
            f"{f(qs['hogs_best_effort']['p50_ms'])} / {f(qs['hogs_best_effort']['p99_ms'])} "
            f"({f(qs['ratio_p50_with_qos'])}x)",
        ],
        [
            "QoS: same, with the hogs latency_sensitive too (no QoS) (ms; p50 ratio)",
            f"{f(qs['hogs_latency_sensitive']['p50_ms'])} / {f(qs['hogs_latency_sensitive']['p99_ms'])} "
            f"({f(qs['ratio_p50_without_qos'])}x)",
        ],
    ]
    rows += [
        [
            "daemon crashes during the run",
            "; ".join(
                f"{c['where']} (exit {c['exit_code']}: {', '.join(c['errors'])[:120]})"
                for c in sf.get("daemon_crashes", [])
            )
            or "none",
        ],
    ]
    tables.append(("Density and burst", ["measure", "value"], rows))

    rows = [[t["target"], f(t["measured"]), "yes" if t["met"] else "NO"] for t in res["targets"]]
    tables.append(("Targets", ["target", "measured", "met"], rows))
    return tables


def write_markdown(res: dict[str, Any], tables: list[tuple[str, list[str], list[list[str]]]], path: Path) -> None:
    m = res["meta"]
    lines = [
        "# sandfleet benchmark: latest run",
        "",
        f"{m['date']} — {m['nproc']} CPUs ({m['cpu']}), {m['mem_total_gib']} GiB, kernel {m['kernel']}, "
        f"cgroup {m['cgroup']}, Python {m['python']}, sandfleet {m['sandfleet_commit']}"
        f"{' (--quick)' if res['config']['quick'] else ''}. Load average at start / end: {m['loadavg_start']} / "
        f"{m['loadavg_end']}. Runtimes: " + ", ".join(v for v in m["versions"].values() if v) + ".",
        "",
        "Produced by `python bench/run.py`; every figure is also in `latest.json`. Each peer cycle is one "
        "subprocess started and waited for from Python; sandfleet figures are wall time through the sync SDK "
        "over the daemon's unix socket.",
        "",
    ]
    for title, header, rows in tables:
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in rows:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def print_tables(
    tables: list[tuple[str, list[str], list[list[str]]]], text_columns: Sequence[str] = ("notes", "target")
) -> None:
    """Rich tables on the terminal: the first column and `text_columns` left-aligned, numbers right."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(160, shutil.get_terminal_size().columns))
    for title, header, rows in tables:
        t = Table(title=title, title_justify="left")
        for i, h in enumerate(header):
            t.add_column(h, justify="left" if i == 0 or h in text_columns else "right", overflow="fold")
        for row in rows:
            t.add_row(*row)
        console.print(t)


# --------------------------------------------------------------------------- main


def machine_info() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = "?"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    from sandfleet.runtime import cgroups

    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_total_gib": round(meminfo_kib("MemTotal") / 1024**2, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cgroup": cgroups.detect(),
        "sandfleet_commit": commit,
        "loadavg_start": Path("/proc/loadavg").read_text().split()[0],
        "versions": {
            "crun": version_of(["crun", "--version"]),
            "bwrap": version_of(["bwrap", "--version"]),
            "runsc": version_of(["runsc", "--version"]),
            "podman": version_of(["podman", "--version"]),
            "docker": version_of(["docker", "--version"]),
            "util-linux (nsenter)": version_of(["nsenter", "--version"]),
        },
    }


def docker_skip_reason() -> str:
    if shutil.which("docker") is None:
        return "no docker CLI and no docker engine"
    try:
        r = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True, timeout=15
        )
    except subprocess.TimeoutExpired:
        return "no docker engine (docker info timed out)"
    if r.returncode != 0:
        err = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"no docker engine (dockerd is not running on this kind of machine; docker info: {err})"
    return f"docker engine {r.stdout.strip()} is present but this benchmark does not drive it yet"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller N everywhere (a smoke run)")
    ap.add_argument("--profile", type=Path, help="py-spy record the daemon during the create loop into this file")
    ap.add_argument("--no-peers", action="store_true", help="skip the peer runtimes")
    ap.add_argument("--results", type=Path, default=RESULTS, help="where latest.json / latest.md go")
    ap.add_argument("--peer-worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_worker:
        peer_worker(args.peer_worker)
        return 0
    if os.geteuid() != 0:
        print("bench/run.py must run as root (the daemon and the peers create namespaces and cgroups)")
        return 2

    q = args.quick
    n_create, n_exec, n_idle_exec, n_peer = (30, 100, 100, 30) if q else (100, 500, 500, 100)
    n_idles = (50,) if q else (500, 5000)
    n_burst, n_sustained = (100, 200) if q else (1000, 3000)
    burst_in_flight = 32

    def on_term(signo: int, frame: object) -> None:
        raise SystemExit(f"interrupted by signal {signo}")

    signal.signal(signal.SIGTERM, on_term)

    tag = f"{os.getpid()}-{int(time.time())}"
    tmp = Path(tempfile.mkdtemp(prefix="sandfleet-bench-"))
    os.chmod(tmp, 0o755)
    daemon_cg = f"/sfbench-daemon-{tag}"
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
        cleanup(daemon, tmp, labels, cgroups_to_remove, profiler, worker)


def cleanup(
    daemon: Daemon | None,
    tmp: Path,
    labels: dict[str, str],
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
        from sandfleet import Client

        try:  # the daemon keeps sandboxes across its own restarts: stop them through the API first
            with Client(daemon.socket, timeout=300) as c:
                c.stop_many(labels)
                for s in c.list(state="running"):
                    c.get(s.id).stop()
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
