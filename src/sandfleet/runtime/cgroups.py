"""Cgroup facility: one interface over cgroup v1 (incl. hybrid hosts like this one) and v2.

The OCI runtime creates each sandbox's cgroup and writes its limits from config.json; this module
finds it again to read usage and limit hits (OOM kills, pids-limit refusals) and to remove leftovers
after a crash. Paths are relative to the hierarchy root, e.g. "/sandfleet/<id>".
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

CGROUP_ROOT = Path("/sys/fs/cgroup")
# "unified": on a hybrid host, runtimes that see the cgroup2 mount (runc) also make a directory there.
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer", "devices", "cpuset", "blkio", "systemd", "unified")

Mode = Literal["v1", "v2", "hybrid"]


def detect(root: Path = CGROUP_ROOT) -> Mode:
    if (root / "cgroup.controllers").exists():
        return "v2"
    if (root / "unified" / "cgroup.controllers").exists():
        return "hybrid"
    return "v1"


@dataclass(frozen=True)
class CgroupStats:
    memory_bytes: int
    memory_peak_bytes: int
    oom_kills: int
    pids: int
    pids_limit_hits: int
    cpu_seconds: float


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _read_keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


class Cgroups:
    """Locate, read and clean sandbox cgroups under one parent (e.g. "/sandfleet")."""

    def __init__(self, parent: str = "/sandfleet", root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self.mode: Mode = detect(root)
        self.parent = "/" + parent.strip("/")

    def path_for(self, sandbox_id: str) -> str:
        return f"{self.parent}/{sandbox_id}"

    def _dirs(self, rel: str) -> list[Path]:
        rel = rel.lstrip("/")
        if self.mode == "v2":
            return [self.root / rel]
        return [self.root / c / rel for c in V1_CONTROLLERS if (self.root / c).is_dir()]

    def stats(self, rel: str) -> CgroupStats:
        rel = rel.lstrip("/")
        if self.mode == "v2":
            d = self.root / rel
            events = _read_keyed(d / "memory.events")
            cpu = _read_keyed(d / "cpu.stat")
            return CgroupStats(
                memory_bytes=_read_int(d / "memory.current"),
                memory_peak_bytes=_read_int(d / "memory.peak"),
                oom_kills=events.get("oom_kill", 0),
                pids=_read_int(d / "pids.current"),
                pids_limit_hits=_read_keyed(d / "pids.events").get("max", 0),
                cpu_seconds=cpu.get("usage_usec", 0) / 1e6,
            )
        mem = self.root / "memory" / rel
        pids = self.root / "pids" / rel
        return CgroupStats(
            memory_bytes=_read_int(mem / "memory.usage_in_bytes"),
            memory_peak_bytes=_read_int(mem / "memory.max_usage_in_bytes"),
            oom_kills=_read_keyed(mem / "memory.oom_control").get("oom_kill", 0),
            pids=_read_int(pids / "pids.current"),
            pids_limit_hits=_read_keyed(pids / "pids.events").get("max", 0),
            cpu_seconds=_read_int(self.root / "cpuacct" / rel / "cpuacct.usage") / 1e9,
        )

    def exists(self, rel: str) -> bool:
        return any(d.is_dir() for d in self._dirs(rel))

    def remove(self, rel: str) -> None:
        """rmdir the cgroup (and any children) in every hierarchy; it must have no tasks left."""
        for d in self._dirs(rel):
            if not d.is_dir():
                continue
            for sub, _dirs, _files in sorted(os.walk(d, topdown=False), key=lambda t: -len(t[0])):
                try:
                    os.rmdir(sub)
                except FileNotFoundError:
                    pass

    def remove_parent_if_empty(self) -> None:
        """rmdir our parent cgroup where no sandbox cgroup is left under it (daemon shutdown)."""
        for d in self._dirs(self.parent):
            try:
                os.rmdir(d)
            except OSError:
                pass  # still has sandboxes (they outlive the daemon), or already gone

    def children(self) -> set[str]:
        """Names of sandbox cgroups present under the parent, in any hierarchy."""
        names: set[str] = set()
        for d in self._dirs(self.parent):
            try:
                names.update(e.name for e in os.scandir(d) if e.is_dir())
            except FileNotFoundError:
                continue
        return names
