"""Cgroup facility: one interface over cgroup v1 (incl. hybrid hosts like this one) and v2.

With the launcher (`sandfleet-run`) this module creates each sandbox's cgroup and writes its limits
before the sandbox's first process joins it; with an OCI runtime (crun, runc) the runtime does that
from config.json. Either way this module reads usage and limit hits (OOM kills, pids-limit refusals)
and removes leftovers after a crash. Paths are relative to the hierarchy root, e.g. "/sandfleet/<id>".
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandfleet.runtime import mounts

CGROUP_ROOT = Path("/sys/fs/cgroup")
# "unified": on a hybrid host, runtimes that see the cgroup2 mount (runc) also make a directory there.
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids", "freezer", "devices", "cpuset", "blkio", "systemd", "unified")

# The v1 hierarchies a launcher-made sandbox joins ("cpu" is co-mounted with cpuacct here).
V1_JOINED = ("memory", "cpu", "cpuacct", "pids", "freezer", "devices")
# Device nodes a sandbox may open (the launcher binds exactly these from the host), as v1 rules.
ALLOWED_DEVICES: tuple[str, ...] = ("c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm", "c 1:9 rwm")
ALLOWED_DEVICES += ("c 5:0 rwm", "c 5:2 rwm", "c 136:* rwm")  # tty, ptmx, devpts

Mode = Literal["v1", "v2", "hybrid"]
DEFAULT_CFS_PERIOD_US = 100_000  # what a new v1 cpu cgroup starts with


@dataclass(frozen=True)
class CgroupPlan:
    # Paths as strings: made per create and only handed to the launcher's command line.
    dirs: list[str]  # made in this order; the sandbox's first process joins each
    writes: list[tuple[str, str]]  # (file, value): limits, written in this order once the dirs exist


def detect(root: Path = CGROUP_ROOT) -> Mode:
    if (root / "cgroup.controllers").exists():
        return "v2"
    if (root / "unified" / "cgroup.controllers").exists():
        return "hybrid"
    return "v1"


# The cgroup2 root's option that makes moving a process into a cgroup cheap (kernel >= 6.0).
FAVOR_MOVES = "favordynmods"


def root_options(mountinfo: str = "/proc/self/mountinfo") -> list[str] | None:
    """The cgroup2 root's options as a mount of it shows them (nsdelegate, memory_recursiveprot...),
    or None when no cgroup2 is mounted in view."""
    try:
        with open(mountinfo) as f:
            for line in f:
                _, _, after = line.partition(" - ")  # (mount points and sources are escaped: no " - ")
                fields = after.split()
                if len(fields) >= 3 and fields[0] == "cgroup2":
                    return [o for o in fields[2].split(",") if o not in ("rw", "ro")]
    except OSError:
        pass
    return None


def favor_moves(options: list[str] | None) -> bool:
    """Give the cgroup2 root `favordynmods`, so that moving a process into a cgroup (a create's
    first write to cgroup.procs, in every v1 hierarchy too) waits for no RCU grace period.

    Such a write takes the kernel's one cgroup_threadgroup_rwsem for writing. Without the option the
    first writer after an idle spell waits for a grace period: 15 ms here, so a create 100 ms after
    the last one took 11 ms, against 3 ms back to back. The price is a memory barrier more in every
    fork and exit. The option belongs to the host's single cgroup2 root; a mount that names it sets
    it, and every mount from the host's cgroup namespace sets all the root's options at once, so
    `options` (`root_options()` as the host has them) are kept. With no cgroup2 in view (None) the
    root's options are unknown and nothing is mounted: a mount would clear them (and on a host that
    never mounted cgroup2, make it show in every process's /proc/<pid>/cgroup). The mount is made
    in the daemon's own mount namespace and taken down at once. Returns whether the root has the
    option now; never raises.
    """
    if options is None:
        return False
    if FAVOR_MOVES in options:
        return True
    try:
        with tempfile.TemporaryDirectory(prefix="sandfleet-cgroup2-") as point:
            try:
                mounts.mount("cgroup2", point, "cgroup2", mounts.MS_NOSUID | mounts.MS_NODEV | mounts.MS_NOEXEC,
                             ",".join([*options, FAVOR_MOVES]))  # fmt: skip
            except OSError:
                return False  # a kernel before 6.0
            try:
                return FAVOR_MOVES in (root_options() or [])
            finally:
                mounts.umount(point, lazy=True)
    except OSError:
        return False


@dataclass(frozen=True)
class CgroupStats:
    memory_bytes: int
    memory_peak_bytes: int
    oom_kills: int
    pids: int
    pids_limit_hits: int
    cpu_seconds: float


def _read_small(path: Path) -> str:
    """A counter or state file of a few lines (< 4 KiB), os-level: a stop and the monitor's sweep
    (one per running sandbox, 10,000 on a full node) read several, and a text-mode open costs more
    than the kernel's part."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode()
    finally:
        os.close(fd)


def _read_int(path: Path, default: int = 0) -> int:
    try:
        return int(_read_small(path).split()[0])
    except (OSError, ValueError, IndexError):
        return default


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read_keyed(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        text = _read_small(path)
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _remove_tree(top: str) -> None:
    """rmdir a cgroup with child cgroups in it, deepest first (EBUSY if a task is left)."""
    for sub, _dirs, files in sorted(os.walk(top, topdown=False), key=lambda t: -len(t[0])):
        try:
            os.rmdir(sub)
        except FileNotFoundError:
            pass
        except OSError as exc:
            # A cgroup directory is never "not empty" (a busy one is EBUSY): this is a plain
            # directory with files, which an OCI runtime writes into the tmpfs beneath a hybrid
            # host's cgroup2 mount point where the daemon's namespace hides that mount.
            if exc.errno != errno.ENOTEMPTY:
                raise
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(sub, name))
            os.rmdir(sub)


class Cgroups:
    """Locate, read and clean sandbox cgroups under one parent (e.g. "/sandfleet")."""

    def __init__(self, parent: str = "/sandfleet", root: Path = CGROUP_ROOT) -> None:
        self.root = root
        self.mode: Mode = detect(root)
        self.parent = "/" + parent.strip("/")
        self._hierarchies: list[Path] | None = None
        self._roots_found: list[str] | None = None
        self._features: dict[str, bool] = {}
        self._v2_parent_ready = False

    def path_for(self, sandbox_id: str) -> str:
        return f"{self.parent}/{sandbox_id}"

    def _dirs(self, rel: str) -> list[Path]:
        rel = rel.lstrip("/")
        return [Path(r, rel) for r in self._roots()]

    def _roots(self) -> list[str]:
        """The hierarchies' roots (v2: one), as strings."""
        if self._roots_found is None:  # (mounted at boot: looked up once, not per call)
            found = [self.root] if self.mode == "v2" else [self.root / c for c in V1_CONTROLLERS]
            self._roots_found = [str(r) for r in found if r.is_dir()]
        return self._roots_found

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

    def procs(self, rel: str) -> list[int]:
        """The processes in the cgroup (its own, not its descendants')."""
        rel = rel.lstrip("/")
        d = self.root / rel if self.mode == "v2" else self.root / "pids" / rel
        try:
            return [int(x) for x in (d / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def limits(self, rel: str) -> tuple[int | None, float | None, int | None]:
        """The cgroup's (memory bytes, CPU cores, tasks) limits; None where unlimited or unreadable."""
        rel = rel.lstrip("/")

        def number(path: Path) -> int | None:
            try:
                text = path.read_text().split()
            except OSError:
                return None
            return int(text[0]) if text and text[0].isdigit() else None

        if self.mode == "v2":
            d = self.root / rel
            memory, pids = number(d / "memory.max"), number(d / "pids.max")
            try:
                quota, period = (d / "cpu.max").read_text().split()[:2]
                cpu = int(quota) / int(period) if quota.isdigit() else None
            except (OSError, ValueError):
                cpu = None
            return memory, cpu, pids
        v1_quota = number(self.root / "cpu" / rel / "cpu.cfs_quota_us")
        v1_period = number(self.root / "cpu" / rel / "cpu.cfs_period_us")
        v1_cpu = v1_quota / v1_period if v1_quota and v1_period else None
        v1_memory = number(self.root / "memory" / rel / "memory.limit_in_bytes")
        return v1_memory, v1_cpu, number(self.root / "pids" / rel / "pids.max")

    def cpu_seconds(self, rel: str) -> float:
        """CPU time used by the cgroup and its descendants, dead ones included (one file read)."""
        rel = rel.lstrip("/")
        if self.mode == "v2":
            return _read_keyed(self.root / rel / "cpu.stat").get("usage_usec", 0) / 1e6
        return _read_int(self.root / "cpuacct" / rel / "cpuacct.usage") / 1e9

    def plan(
        self, rel: str, *, memory: int, cpu_quota_us: int, cpu_period_us: int, pids: int, best_effort: bool = False
    ) -> CgroupPlan:
        """What making the sandbox cgroup with its limits takes: directories, then (file, value) writes.

        Memory and memory+swap get the same limit (no swap beyond the limit, as crun does with
        `swap == limit`). The launcher carries the plan out (in C, as part of the launch); the caller
        removes a half-made cgroup with `remove()`.
        """
        rel = rel.lstrip("/")
        root = str(self.root)
        if self.mode == "v2":
            if not self._v2_parent_ready:
                self._enable_v2_controllers((self.root / rel).parent)
                self._v2_parent_ready = True
            d = f"{root}/{rel}"
            writes = [(f"{d}/memory.max", str(memory))]
            if self._has("memory.swap.max"):
                writes.append((f"{d}/memory.swap.max", "0"))
            writes.append((f"{d}/cpu.max", f"{cpu_quota_us} {cpu_period_us}"))
            if best_effort:
                writes.append((f"{d}/cpu.weight", "1"))
            writes.append((f"{d}/pids.max", str(pids)))
            return CgroupPlan([d], writes)
        dirs = [f"{hierarchy}/{rel}" for hierarchy in self._joined_hierarchies()]  # the launcher makes missing parents
        mem, cpu, pid_dir, dev = (f"{root}/{c}/{rel}" for c in ("memory", "cpu", "pids", "devices"))
        writes = []
        if self._has("memory/memory.swappiness"):
            writes.append((f"{mem}/memory.swappiness", "100"))  # a paused sandbox's pages go to swap first
        writes.append((f"{mem}/memory.limit_in_bytes", str(memory)))
        if self._has("memory/memory.memsw.limit_in_bytes"):
            writes.append((f"{mem}/memory.memsw.limit_in_bytes", str(memory)))
        if cpu_period_us != DEFAULT_CFS_PERIOD_US:
            # Each write re-checks the bandwidth of every task group on the node: skip the no-op one.
            writes.append((f"{cpu}/cpu.cfs_period_us", str(cpu_period_us)))
        writes.append((f"{cpu}/cpu.cfs_quota_us", str(cpu_quota_us)))
        if best_effort:
            writes.append((f"{cpu}/cpu.shares", "2"))  # the lowest weight: CPU left over by everyone else
        writes.append((f"{pid_dir}/pids.max", str(pids)))
        if self._has("devices"):
            writes.append((f"{dev}/devices.deny", "a"))
            writes += [(f"{dev}/devices.allow", rule) for rule in ALLOWED_DEVICES]
        return CgroupPlan(dirs, writes)

    def _has(self, rel: str) -> bool:
        """Whether the kernel offers this controller file (the parent's copy; asked once)."""
        if rel not in self._features:
            if self.mode == "v2":
                self._features[rel] = (self.root / self.parent.lstrip("/") / rel).exists() or (self.root / rel).exists()
            else:
                self._features[rel] = (self.root / rel).exists()
        return self._features[rel]

    def _joined_hierarchies(self) -> list[Path]:
        """The distinct v1 hierarchies a sandbox joins (cpu and cpuacct are usually one), found once."""
        if self._hierarchies is None:
            seen: dict[Path, Path] = {}
            for ctrl in V1_JOINED:
                hierarchy = self.root / ctrl
                if hierarchy.is_dir():
                    seen.setdefault(hierarchy.resolve(), hierarchy)
            self._hierarchies = list(seen.values())
        return self._hierarchies

    def _enable_v2_controllers(self, parent: Path) -> None:
        """Create `parent` with memory, cpu and pids delegated from the root down to its children."""
        parent.mkdir(parents=True, exist_ok=True)
        parts = parent.relative_to(self.root).parts
        for level in [self.root.joinpath(*parts[:i]) for i in range(len(parts) + 1)]:
            enabled = (level / "cgroup.subtree_control").read_text().split()
            missing = [c for c in ("memory", "cpu", "pids") if c not in enabled]
            if missing:
                _write(level / "cgroup.subtree_control", " ".join(f"+{c}" for c in missing))

    # -- freezer and reclaim (pause) ------------------------------------------------------------

    def freeze(self, rel: str, timeout: float = 5.0) -> None:
        """Stop every task of the cgroup and wait until the kernel reports it frozen. A freeze that
        does not complete in time (tasks that get no CPU on a saturated node to stop at) is undone
        before the TimeoutError: a cgroup left freezing stops its tasks one by one, and the frozen
        ones ignore SIGKILL until thawed."""
        try:
            self._set_frozen(rel, True, timeout)
        except TimeoutError:
            with contextlib.suppress(OSError, TimeoutError):
                self._set_frozen(rel, False, timeout)
            raise

    def thaw(self, rel: str, timeout: float = 5.0) -> None:
        self._set_frozen(rel, False, timeout)

    def freeze_soon(self, rel: str) -> None:
        """Ask the kernel to stop every task of the cgroup, without waiting for it (a part about to
        be destroyed takes no CPU meanwhile; its destroy thaws it first)."""
        rel = rel.lstrip("/")
        if self.mode == "v2":
            _write(self.root / rel / "cgroup.freeze", "1")
        else:
            _write(self.root / "freezer" / rel / "freezer.state", "FROZEN")

    def frozen(self, rel: str) -> bool:
        rel = rel.lstrip("/")
        try:
            if self.mode == "v2":
                return _read_keyed(self.root / rel / "cgroup.events").get("frozen") == 1
            return _read_small(self.root / "freezer" / rel / "freezer.state").strip() == "FROZEN"
        except OSError:
            return False

    def thawed(self, rel: str) -> bool:
        """Neither frozen nor freezing (asked to freeze, some tasks maybe stopped already)."""
        rel = rel.lstrip("/")
        try:
            if self.mode == "v2":
                return _read_small(self.root / rel / "cgroup.freeze").strip() == "0" and not self.frozen(rel)
            return _read_small(self.root / "freezer" / rel / "freezer.state").strip() == "THAWED"
        except OSError:
            return True

    def freezer_dir(self, rel: str) -> Path:
        """The directory whose freezer state criu's --freeze-cgroup drives (v1 freezer or v2 cgroup)."""
        rel = rel.lstrip("/")
        return self.root / rel if self.mode == "v2" else self.root / "freezer" / rel

    def _set_frozen(self, rel: str, frozen: bool, timeout: float) -> None:
        rel = rel.lstrip("/")
        if self.mode == "v2":
            _write(self.root / rel / "cgroup.freeze", "1" if frozen else "0")
        else:
            _write(self.root / "freezer" / rel / "freezer.state", "FROZEN" if frozen else "THAWED")
        deadline = time.monotonic() + timeout
        while not self.frozen(rel) if frozen else not self.thawed(rel):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {rel} did not {'freeze' if frozen else 'thaw'} within {timeout}s")
            time.sleep(0.001)

    def reclaim(self, rel: str) -> None:
        """Push the cgroup's memory out: anonymous pages to swap, file pages dropped.

        v1: `memory.force_empty` (works with tasks inside, frozen or not); v2: `memory.reclaim` of
        everything it uses, which stops early (EAGAIN) when nothing more can go.
        """
        rel = rel.lstrip("/")
        try:
            if self.mode == "v2":
                d = self.root / rel
                _write(d / "memory.reclaim", str(_read_int(d / "memory.current")))
            else:
                _write(self.root / "memory" / rel / "memory.force_empty", "0")
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EBUSY):
                raise

    def memory_bytes(self, rel: str) -> int:
        rel = rel.lstrip("/")
        if self.mode == "v2":
            return _read_int(self.root / rel / "memory.current")
        return _read_int(self.root / "memory" / rel / "memory.usage_in_bytes")

    def kill_all(self, rel: str) -> int:
        """SIGKILL every process in the cgroup (a half-started sandbox whose init we never learned)."""
        killed = 0
        for d in self._dirs(rel):
            try:
                pids = (d / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, ValueError):
                    continue
            if pids:
                break
        return killed

    def exists(self, rel: str) -> bool:
        return any(d.is_dir() for d in self._dirs(rel))

    def remove(self, rel: str) -> None:
        """rmdir the cgroup (and any children) in every hierarchy; it must have no tasks left."""
        rel = rel.lstrip("/")
        for root in self._roots():
            # One rmdir is the whole job for a sandbox's cgroup (no children, no files of its own):
            # a stop pays it in every hierarchy, and walking each cgroup's ~30 files first cost more.
            d = f"{root}/{rel}"
            try:
                os.rmdir(d)
            except FileNotFoundError:
                continue  # a hierarchy the sandbox never joined
            except OSError:
                _remove_tree(d)

    def set_idle(self, rel: str, idle: bool) -> None:
        """The lowest CPU weight (as a best-effort sandbox has), or the default one."""
        rel = rel.lstrip("/")
        if self.mode == "v2":
            _write(self.root / rel / "cpu.weight", "1" if idle else "100")
        else:
            _write(self.root / "cpu" / rel / "cpu.shares", "2" if idle else "1024")

    def holds(self, pid: int, rel: str) -> bool:
        """Whether process `pid` is in cgroup `rel`, and in no other of ours under another name (v1:
        a rename half done leaves a sandbox's tasks under two names, and neither is the sandbox)."""
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        rel, ours = "/" + rel.strip("/"), False
        for line in lines:
            path = line.split(":", 2)[-1]
            if path == rel:
                ours = True
            elif path.startswith(self.parent + "/"):
                return False
        return ours

    @property
    def renamable(self) -> bool:
        """v1 renames a cgroup with its tasks in it (within its parent); v2 cannot rename at all."""
        return self.mode != "v2"

    def rename(self, rel: str, new: str) -> None:
        """Rename a cgroup within its parent in every hierarchy it has a directory in, its tasks
        staying in it (v1 only). A failure part way puts back what was renamed."""
        if not self.renamable:
            raise OSError(errno.EPERM, "cgroup v2 cannot rename a cgroup")  # (kernfs: no rename op)
        done: list[tuple[Path, Path]] = []
        # The freezer first: a daemon killed part way leaves the tasks' freezer under the name whose
        # cleanup thaws it (frozen tasks ignore the SIGKILL that empties the cgroup).
        dirs = sorted(self._dirs(rel), key=lambda d: d.relative_to(self.root).parts[0] != "freezer")
        try:
            for d in dirs:
                if not d.is_dir():
                    continue  # not joined there, or the other name of a co-mounted hierarchy
                target = d.with_name(new.rsplit("/", 1)[-1])
                os.rename(d, target)
                done.append((d, target))
        except OSError:
            for d, target in reversed(done):
                with contextlib.suppress(OSError):
                    os.rename(target, d)
            raise

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
