"""What every benchmark module shares: paths and sizes, statistics, /proc and cgroup readers, and the
benchmark's own daemon (`Daemon`, started from a given source tree for side-by-side runs).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sandfleet.daemon.node.process import DaemonProcess
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


class Daemon:
    def __init__(self, root: Path, cgroup_parent: str, *, src: Path | None = None) -> None:
        """`src`: the source tree (its `src/` directory) the daemon runs from; default: this one."""
        self.root = root
        self.socket = root / "sandfleet.sock"
        self.config = root / "config.toml"
        self.cgroup_parent = cgroup_parent
        env = {**os.environ, "PYTHONPATH": str(src)} if src is not None else None
        self.process = DaemonProcess(["--config", str(self.config)], workdir=root, log=root / "daemon.log", env=env)
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

    def stop_sandboxes(self) -> None:
        """Stop every live sandbox through the API (a daemon keeps them across its own restarts)."""
        from sandfleet import Client

        with Client(self.socket, timeout=300) as c:
            for s in c.list():
                c.get(s.id).stop()


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


def settle(seconds: float) -> None:
    time.sleep(seconds)  # a measurement window, not synchronisation


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def stop_labelled(
    daemon: Daemon, fleet: Any, labels: dict[str, str], where: str
) -> tuple[list[str], str | None, float]:
    """`fleet.stop_many(labels)`: (the ids stopped, the error if it failed, seconds taken, a restart
    included). A daemon that died doing it is started again to stop them (`restart_if_dead`)."""
    t = time.perf_counter()
    try:
        return fleet.stop_many(labels), None, time.perf_counter() - t
    except SandboxError as exc:
        restart_if_dead(daemon, fleet, labels, where)
        return [], f"{type(exc).__name__}: {exc}", time.perf_counter() - t


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
