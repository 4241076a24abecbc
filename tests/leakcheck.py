"""What a sandbox can leave behind on the host, counted; used by the leak and restart tests."""

from __future__ import annotations

import os
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from conftest import Daemon

SANDBOX_UID_BASE = 100000


def net_namespaces() -> set[int]:
    out = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
            except OSError:
                continue
    return out


def sandbox_processes(cgroup_parent: str) -> list[int]:
    """Processes running as a sandbox uid (root inside = 100000 outside) in one daemon's cgroups."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cgroups = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        m = re.search(r"^Uid:\s+(\d+)", status, re.M)
        if m and SANDBOX_UID_BASE <= int(m.group(1)) < SANDBOX_UID_BASE + 65536 and f"/{cgroup_parent}/" in cgroups:
            pids.append(int(pid))
    return pids


def children(pid: int) -> list[tuple[int, str, str]]:
    """`pid`'s child processes: (pid, state letter, command name)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if int(fields[1]) == pid:
            out.append((int(entry), fields[0], stat[stat.find("(") + 1 : stat.rfind(")")]))
    return out


def zombie_children(pid: int) -> list[str]:
    """The command names of `pid`'s unreaped children."""
    return [comm for _, state, comm in children(pid) if state == "Z"]


def loop_devices() -> int:
    return sum(1 for dev in Path("/sys/block").glob("loop*") if (dev / "loop" / "backing_file").exists())


@dataclass(frozen=True)
class Residue:
    mounts: tuple[str, ...]
    cgroups: tuple[str, ...]
    sandbox_dirs: tuple[str, ...]  # restores and OCI runtimes have one; launcher creates none
    sandbox_ids: tuple[str, ...]  # sandboxes with a cgroup left, in any hierarchy
    runtime_state: tuple[str, ...]
    state_rows: int
    processes: int
    netns: int
    loops: int
    zombies: tuple[str, ...]
    vm_dirs: tuple[str, ...] = ()  # run_dir/<microvm|vm>/<id>
    vm_cgroups: tuple[str, ...] = ()  # <ctrl>/<id> under the VM tiers' parents
    qemu: tuple[int, ...] = ()  # QEMU processes of this daemon's VMs


def qemu_processes(d: Daemon) -> tuple[int, ...]:
    """QEMU processes whose command line names this daemon's run directory."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"qemu-system" in cmd and str(d.run_dir).encode() in cmd:
                out.append(int(p.name))
    return tuple(sorted(out))


def residue(d: Daemon, *, daemon_alive: bool = True) -> Residue:
    sandboxes_dir = d.run_dir / "sandboxes"
    mounts: tuple[str, ...] = ()
    if daemon_alive:
        mounts = tuple(
            line.split()[4] for line in d.mountinfo().splitlines() if line.split()[4].startswith(str(sandboxes_dir))
        )
    parent = d.cgroup_parent
    cgroups = tuple(
        sorted(
            f"{ctrl.name}/{child.name}"
            for ctrl in Path("/sys/fs/cgroup").iterdir()
            if (ctrl / parent).is_dir()
            for child in (ctrl / parent).iterdir()
            if child.is_dir()
        )
    )
    rows = 0
    db = d.state_dir / "state.db"
    if db.exists():
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0]
        finally:
            con.close()
    crun_root = d.run_dir / "crun"
    return Residue(
        mounts=mounts,
        cgroups=cgroups,
        sandbox_dirs=tuple(sorted(os.listdir(sandboxes_dir))) if sandboxes_dir.exists() else (),
        sandbox_ids=tuple(sorted({c.split("/", 1)[1] for c in cgroups})),
        runtime_state=tuple(sorted(os.listdir(crun_root))) if crun_root.exists() else (),
        state_rows=rows,
        processes=len(sandbox_processes(parent)),
        netns=len(net_namespaces()),
        loops=loop_devices(),
        zombies=tuple(zombie_children(d.pid)) if daemon_alive else (),
        vm_dirs=tuple(
            sorted(x.name for t in ("microvm", "vm") if (d.run_dir / t).is_dir() for x in (d.run_dir / t).iterdir())
        ),  # fmt: skip
        vm_cgroups=tuple(sorted(f"{c.parent.parent.name}/{c.name}" for c in d.vm_cgroup_dirs())),
        qemu=qemu_processes(d),
    )
