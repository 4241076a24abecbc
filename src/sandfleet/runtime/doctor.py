"""Host checks for `sandfleet doctor`: what the tiers need, whether the host has it, and how to get it
(which tiers that allows: backends/tiers.py, which also asks the VM tiers' guest)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandfleet.runtime import cgroups, criu, seccomp

APT = "apt-get install -y"


@dataclass(frozen=True)
class Check:
    name: str
    status: Literal["ok", "warn", "fail"]
    detail: str


def _filesystems() -> set[str]:
    try:
        return {line.split()[-1] for line in Path("/proc/filesystems").read_text().splitlines() if line.strip()}
    except OSError:
        return set()


def _version(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else ""


def run_checks(*, state_dir: Path) -> Iterator[Check]:
    """The host's checks (the daemon's own is the CLI's: the runtime layer does not speak the API)."""
    yield Check(
        "root",
        "ok" if os.geteuid() == 0 else "fail",
        "running as root" if os.geteuid() == 0 else "the daemon must run as root (sudo sandfleet serve)",
    )
    release = platform.release()
    major, minor = (int(x) for x in release.split(".")[:2])
    yield Check(
        "kernel",
        "ok" if (major, minor) >= (6, 12) else "warn",
        f"{release}"
        + (
            ""
            if (major, minor) >= (6, 12)
            else ": EROFS mounts straight from files need >= 6.12; older kernels need loop devices"
        ),
    )
    try:
        userns = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        userns = 0
    yield Check(
        "user namespaces",
        "ok" if userns > 0 else "fail",
        f"max_user_namespaces={userns}" + ("" if userns else ": sysctl -w user.max_user_namespaces=65536"),
    )
    fs = _filesystems()
    for name, module in (("overlay", "overlay"), ("erofs", "erofs")):
        yield Check(
            f"filesystem {name}",
            "ok" if name in fs else "fail",
            "available" if name in fs else f"modprobe {module} (kernel config CONFIG_{name.upper()}_FS)",
        )
    mode = cgroups.detect()
    root = cgroups.CGROUP_ROOT
    if mode == "v2":
        ctrls = set((root / "cgroup.controllers").read_text().split())
    else:
        ctrls = {c for c in ("memory", "cpu", "pids", "freezer") if (root / c).is_dir()}
    missing = {"memory", "cpu", "pids"} - ctrls
    yield Check(
        "cgroups",
        "fail" if missing else "ok",
        f"{mode} ({', '.join(sorted(ctrls))})"
        + (f"; missing {sorted(missing)}" if missing else "")
        + ("; hybrid host: with crun the daemon hides cgroup2 in its own mount namespace" if mode == "hybrid" else ""),
    )
    options = cgroups.root_options()
    favored = options is not None and cgroups.FAVOR_MOVES in options
    yield Check(
        "cgroup moves",
        "ok" if favored else "warn",
        "cgroup2 has favordynmods: a process joins a cgroup without waiting for an RCU grace period"
        if favored
        else "cgroup2 lacks favordynmods (Linux >= 6.0): a create after an idle spell may wait ~10 ms; "
        "`sandfleet serve` sets it (config cgroup_favordynmods)",
    )
    for binary, pkg, need in (
        ("crun", "crun", "warn"),
        ("runc", "runc", "warn"),
        ("mkfs.erofs", "erofs-utils", "fail"),
        ("busybox", "busybox-static", "fail"),
        ("mmdebstrap", "mmdebstrap", "warn"),
        ("gcc", "gcc libc6-dev", "fail"),
        ("musl-gcc", "musl-tools", "warn"),  # the agent against musl: faster exec per sandbox
    ):
        path = shutil.which(binary)
        if path:
            ver = _version([binary, "--version"]) if binary not in ("busybox", "mkfs.erofs", "musl-gcc") else ""
            yield Check(binary, "ok", f"{path} {ver}".strip())
        else:
            yield Check(binary, need, f"not found: {APT} {pkg}")  # type: ignore[arg-type]
    try:
        seccomp.compile_bpf(seccomp.default_profile())
        yield Check("libseccomp", "ok", "compiles the sandbox seccomp filter")
    except seccomp.SeccompUnavailableError as exc:
        yield Check("libseccomp", "fail", f"{exc}: {APT} libseccomp2")
    try:
        tool = criu.Criu()
        ver = _version([*tool.command(), "--version"])
        yield Check("criu", "ok", f"{tool.binary} {ver} (snapshot, restore, fork)".strip())
    except criu.CriuUnavailableError as exc:
        yield Check("criu", "warn", f"{exc}; snapshots and forks are unavailable until it is")
    libc_a = any(Path(p).exists() for p in ("/usr/lib/x86_64-linux-gnu/libc.a", "/usr/lib/aarch64-linux-gnu/libc.a"))
    yield Check(
        "static libc",
        "ok" if libc_a else "fail",
        "libc.a present (launcher and agent are linked statically)" if libc_a else f"{APT} libc6-dev",
    )
    try:
        pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    except (OSError, ValueError):
        pid_max = 0
    yield Check(
        "pid_max",
        "ok" if pid_max >= 4 * 1024 * 1024 else "warn",
        f"{pid_max}"
        + (
            ""
            if pid_max >= 4 * 1024 * 1024
            else ": binds before memory at thousands of sandboxes; sysctl -w kernel.pid_max=4194304"
        ),
    )
    target = state_dir if state_dir.exists() else state_dir.parent
    try:
        st = os.statvfs(target)
        free = st.f_bavail * st.f_frsize
        yield Check(
            "disk",
            "ok" if free > 5 * 1024**3 else "warn",
            f"{free / 1024**3:.1f} GiB free under {target}" + ("" if free > 5 * 1024**3 else ": images need a few GiB"),
        )
    except OSError as exc:
        yield Check("disk", "warn", f"cannot stat {target}: {exc}")
