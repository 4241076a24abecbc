"""Misbehaviour detectors: port scans, floods, crypto-mining, attacks on the agent, replaced system binaries.

Agents in RL sandboxes have been seen scanning ports, flooding connections and forks, overwriting /bin/bash
and poking the in-sandbox agent. The daemon feeds its observations (connection attempts from the network
policy, cgroup events, CPU samples, scans of a sandbox's writable layer) into `Detectors`, which returns
typed `Finding`s; the node's policy (`DetectorConfig.action`) says what to do with each: record, pause or kill.

Pure logic with an injectable clock, so the thresholds are tested with a fake one; the one I/O is
`replaced_system_binaries`, the scan of an overlay upper whose result goes to `Detectors.binaries`.
Two properties hold whatever a sandbox does: a detector fires once and is then quiet for that sandbox
for its `window` (a flood gives one finding, not thousands), and the state kept per sandbox is bounded
(windows hold at most `threshold` entries, since reaching it fires and clears them; strings are capped).
"""

from __future__ import annotations

import errno
import math
import os
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Action = Literal["record", "pause", "kill"]

# Upper bounds of what the config accepts: the state a window keeps is proportional to its threshold.
_MAX_THRESHOLD = 100_000
_MAX_WINDOW = 3600.0
_MAX_SAMPLE = 10  # destinations quoted in a finding's evidence
_MAX_HOST = 255  # a host name is at most 253 characters; anything longer is cut, not stored whole
_MAX_WEIGHT = 1_000_000_000  # one event's count, so a bogus value cannot make evidence absurd
_MAX_REPORTED_PATHS = 1024  # replaced binaries remembered per sandbox (to report each once)
_MAX_PATH = 512
_MAX_EVIDENCE_ITEMS = 10  # keys of an event's data copied into evidence
_MAX_EVIDENCE_STR = 256


class DetectorConfig(BaseModel):
    """What every detector has: whether it runs and what the node does when it fires."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="run this detector (a disabled one keeps no state)")
    action: Action = Field(
        "record", description="on a finding: record it (event + metric), pause the sandbox, or kill it"
    )


class PortScanConfig(DetectorConfig):
    threshold: int = Field(
        20, ge=1, le=_MAX_THRESHOLD, description="distinct (host, port) destinations denied within `window`"
    )
    window: float = Field(10.0, gt=0, le=_MAX_WINDOW, description="seconds; also the quiet time after a finding")


class ConnectionFloodConfig(DetectorConfig):
    threshold: int = Field(
        200,
        ge=1,
        le=_MAX_THRESHOLD,
        description="connections accepted by the egress proxy within `window` (whatever became of them: "
        "relayed, refused, or silent)",
    )
    window: float = Field(10.0, gt=0, le=_MAX_WINDOW, description="seconds; also the quiet time after a finding")


class ForkFloodConfig(DetectorConfig):
    threshold: int = Field(
        50, ge=1, le=_MAX_THRESHOLD, description="forks refused by the pids limit, summed within `window`"
    )
    window: float = Field(10.0, gt=0, le=_MAX_WINDOW, description="seconds; also the quiet time after a finding")


class OutputFloodConfig(DetectorConfig):
    # 20 a minute: a test of output caps (or an agent cat-ing a big file now and then) stays under it.
    threshold: int = Field(20, ge=1, le=_MAX_THRESHOLD, description="output truncations within `window`")
    window: float = Field(60.0, gt=0, le=_MAX_WINDOW, description="seconds; also the quiet time after a finding")


class OomRepeatConfig(DetectorConfig):
    threshold: int = Field(
        3, ge=1, le=_MAX_THRESHOLD, description="OOM kills within `window` (one is an honest mistake)"
    )
    window: float = Field(60.0, gt=0, le=_MAX_WINDOW, description="seconds; also the quiet time after a finding")


class CpuMiningConfig(DetectorConfig):
    ratio: float = Field(
        0.9, gt=0, le=1.0, description="CPU use, as a fraction of the sandbox's CPU limit, that counts as busy"
    )
    window: float = Field(
        120.0,
        gt=0,
        le=_MAX_WINDOW,
        description="seconds of uninterrupted busy samples before a finding (a build's burst is shorter); "
        "also the quiet time after one",
    )


class AgentAttackConfig(DetectorConfig):
    threshold: int = Field(
        1, ge=1, le=_MAX_THRESHOLD, description="attempts on the agent (signal, ptrace, its fds) within `window`"
    )
    window: float = Field(60.0, gt=0, le=_MAX_WINDOW, description="seconds; also the quiet time after a finding")


class SystemBinariesConfig(DetectorConfig):
    """Fires at once on a replaced system binary; each path is reported once per sandbox (scans repeat)."""


class DetectorsConfig(BaseModel):
    """Per-detector settings. The defaults never fire on normal work (tests creating sandboxes, pip, builds)."""

    model_config = ConfigDict(extra="forbid")

    port_scan: PortScanConfig = Field(default_factory=PortScanConfig, description="denied connections, many targets")
    connection_flood: ConnectionFloodConfig = Field(
        default_factory=ConnectionFloodConfig, description="connection attempts, allowed or not"
    )
    fork_flood: ForkFloodConfig = Field(default_factory=ForkFloodConfig, description="forks refused by the pids limit")
    output_flood: OutputFloodConfig = Field(default_factory=OutputFloodConfig, description="exec output truncations")
    oom_repeat: OomRepeatConfig = Field(default_factory=OomRepeatConfig, description="repeated OOM kills")
    cpu_mining: CpuMiningConfig = Field(default_factory=CpuMiningConfig, description="CPU pinned at its limit")
    agent_attack: AgentAttackConfig = Field(
        default_factory=AgentAttackConfig, description="processes signalling/tracing the sandbox's agent"
    )
    system_binaries: SystemBinariesConfig = Field(
        default_factory=SystemBinariesConfig, description="system binaries replaced or deleted in the writable layer"
    )


@dataclass(frozen=True)
class Finding:
    """One detector fired for one sandbox; `evidence` is JSON-ready (counts, window, samples, paths)."""

    detector: str
    sandbox_id: str
    action: Action
    evidence: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector,
            "sandbox_id": self.sandbox_id,
            "action": self.action,
            "evidence": dict(self.evidence),
        }


class _Window:
    """Weighted observations within the last `window` seconds, oldest first, with their running sum."""

    __slots__ = ("entries", "total")

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int, Any]] = deque()
        self.total = 0

    def add(self, now: float, weight: int, window: float, cap: int, payload: Any = None) -> None:
        horizon = now - window
        while self.entries and self.entries[0][0] <= horizon:
            self.total -= self.entries.popleft()[1]
        # Never reached while the caller fires at `total >= threshold` (every weight is >= 1): a backstop.
        while len(self.entries) >= cap:
            self.total -= self.entries.popleft()[1]
        self.entries.append((now, weight, payload))
        self.total += weight

    def clear(self) -> None:
        self.entries.clear()
        self.total = 0


@dataclass
class _Cpu:
    last_time: float
    last_cpu: float
    busy_since: float | None = None  # time of the sample that started the current busy run
    busy_cpu: float = 0.0  # cumulative CPU seconds at `busy_since`


@dataclass
class _SandboxState:
    windows: dict[str, _Window] = field(default_factory=dict)
    denied: OrderedDict[tuple[str, int], float] = field(default_factory=OrderedDict)  # destination -> last denial
    recent: deque[tuple[str, int]] = field(default_factory=lambda: deque(maxlen=_MAX_SAMPLE))  # destinations asked
    cpu: _Cpu | None = None
    quiet_until: dict[str, float] = field(default_factory=dict)
    reported_paths: set[str] = field(default_factory=set)

    def size(self) -> int:
        return (
            sum(len(w.entries) for w in self.windows.values())
            + len(self.denied)
            + len(self.recent)
            + (self.cpu is not None)
            + len(self.quiet_until)
            + len(self.reported_paths)
        )


# event kind -> (detector, the data key holding its count; None: each event counts 1)
_EVENTS: dict[str, tuple[str, str | None]] = {
    "oom_kill": ("oom_repeat", "count"),
    "pids_limit": ("fork_flood", "refused_forks"),
    "output_truncated": ("output_flood", None),
    "agent_attack": ("agent_attack", None),
}


class Detectors:
    """The node's detectors over all its sandboxes; not thread-safe (the daemon's event loop calls it)."""

    def __init__(self, config: DetectorsConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._sandboxes: dict[str, _SandboxState] = {}

    def accepted(self, sandbox_id: str, refused: bool = False) -> list[Finding]:
        """A connection the egress proxy accepted, before anything is read from it (`refused`: at once,
        over a connection limit): a flood of connections that never send a request counts too."""
        flood = self._config.connection_flood
        if not flood.enabled:
            return []
        now = self._clock()
        st = self._state(sandbox_id)
        if self._quiet(st, "connection_flood", now):
            return []
        w = st.windows.setdefault("connection_flood", _Window())
        w.add(now, 1, flood.window, flood.threshold, refused)
        if w.total < flood.threshold:
            return []
        evidence = {
            "count": w.total,
            "refused": sum(1 for _, _, was_refused in w.entries if was_refused),
            "threshold": flood.threshold,
            "window": flood.window,
            "sample": [_dest(*d) for d in reversed(st.recent)],  # the latest destinations asked for
        }
        w.clear()
        return [self._fire(st, sandbox_id, "connection_flood", flood.action, flood.window, now, evidence)]

    def connection(self, sandbox_id: str, host: str, port: int, allowed: bool) -> list[Finding]:
        """A request the network policy saw: `allowed` or denied (the flood is counted at `accepted`)."""
        now = self._clock()
        dest = (host[:_MAX_HOST], port)
        findings: list[Finding] = []
        if self._config.connection_flood.enabled:
            recent = self._state(sandbox_id).recent
            if dest in recent:
                recent.remove(dest)
            recent.append(dest)
        scan = self._config.port_scan
        if not allowed and scan.enabled:
            st = self._state(sandbox_id)
            if not self._quiet(st, "port_scan", now):
                # Distinct destinations, each at its latest denial: retrying one closed port is not a scan.
                st.denied.pop(dest, None)
                st.denied[dest] = now
                horizon = now - scan.window
                while st.denied and next(iter(st.denied.values())) <= horizon:
                    st.denied.popitem(last=False)
                if len(st.denied) >= scan.threshold:
                    evidence = {
                        "count": len(st.denied),
                        "threshold": scan.threshold,
                        "window": scan.window,
                        "sample": [_dest(h, p) for h, p in list(st.denied)[-_MAX_SAMPLE:]],
                    }
                    st.denied.clear()
                    findings.append(self._fire(st, sandbox_id, "port_scan", scan.action, scan.window, now, evidence))
        return findings

    def event(self, sandbox_id: str, kind: str, data: Mapping[str, Any]) -> list[Finding]:
        """A sandbox event: oom_kill {"count"}, pids_limit {"refused_forks"}, output_truncated, agent_attack."""
        if kind not in _EVENTS:
            return []
        name, key = _EVENTS[kind]
        cfg = getattr(self._config, name)
        assert isinstance(cfg, ForkFloodConfig | OutputFloodConfig | OomRepeatConfig | AgentAttackConfig)
        if not cfg.enabled:
            return []
        weight = 1 if key is None else _weight(data.get(key, 1))
        if weight <= 0:
            return []
        now = self._clock()
        st = self._state(sandbox_id)
        if self._quiet(st, name, now):
            return []
        w = st.windows.setdefault(name, _Window())
        w.add(now, weight, cfg.window, cfg.threshold)
        if w.total < cfg.threshold:
            return []
        evidence: dict[str, Any] = {"count": w.total, "threshold": cfg.threshold, "window": cfg.window}
        if kind == "agent_attack":
            evidence["event"] = _sanitize(data)  # who tried what: the daemon's report of the attempt
        w.clear()
        return [self._fire(st, sandbox_id, name, cfg.action, cfg.window, now, evidence)]

    def cpu_sample(self, sandbox_id: str, cpu_seconds: float, cpu_limit: float) -> list[Finding]:
        """The sandbox's cumulative CPU seconds now, and its limit in CPUs."""
        cfg = self._config.cpu_mining
        if not cfg.enabled:
            return []
        now = self._clock()
        st = self._state(sandbox_id)
        prev = st.cpu
        if prev is None or not math.isfinite(cpu_seconds) or cpu_seconds < prev.last_cpu:
            # First sample, or the counter restarted (a restore gets a new cgroup): a new baseline.
            st.cpu = _Cpu(now, cpu_seconds) if math.isfinite(cpu_seconds) else None
            return []
        elapsed = now - prev.last_time
        if elapsed <= 0:
            return []
        if not (math.isfinite(cpu_limit) and cpu_limit > 0):
            # Without a limit "at its limit" means nothing: no run can build up.
            prev.busy_since = None
        elif (cpu_seconds - prev.last_cpu) / elapsed >= cfg.ratio * cpu_limit:
            if prev.busy_since is None:
                prev.busy_since, prev.busy_cpu = prev.last_time, prev.last_cpu
        else:
            prev.busy_since = None  # one idle interval ends the run: builds and test suites breathe
        prev.last_time, prev.last_cpu = now, cpu_seconds
        if prev.busy_since is None or now - prev.busy_since < cfg.window or self._quiet(st, "cpu_mining", now):
            return []
        busy = now - prev.busy_since
        evidence = {
            "busy_seconds": round(busy, 3),
            "usage_cpus": round((cpu_seconds - prev.busy_cpu) / busy, 3),
            "cpu_limit": cpu_limit,
            "ratio": cfg.ratio,
            "window": cfg.window,
        }
        prev.busy_since, prev.busy_cpu = now, cpu_seconds  # the next finding needs another whole window
        return [self._fire(st, sandbox_id, "cpu_mining", cfg.action, cfg.window, now, evidence)]

    def binaries(self, sandbox_id: str, paths: list[str]) -> list[Finding]:
        """The result of `replaced_system_binaries` for the sandbox: fires for paths not reported before."""
        cfg = self._config.system_binaries
        if not cfg.enabled or not paths:
            return []
        st = self._state(sandbox_id)
        new: list[str] = []
        for p in paths:
            p = p[:_MAX_PATH]
            # Full memory means this sandbox was reported a thousand times over: quiet is right.
            if p not in st.reported_paths and len(st.reported_paths) < _MAX_REPORTED_PATHS:
                st.reported_paths.add(p)
                new.append(p)
        if not new:
            return []
        return [Finding("system_binaries", sandbox_id, cfg.action, {"count": len(new), "paths": new})]

    def forget(self, sandbox_id: str) -> None:
        """The sandbox stopped: drop its state."""
        self._sandboxes.pop(sandbox_id, None)

    def state_size(self, sandbox_id: str | None = None) -> int:
        """Entries held for one sandbox (or all): for metrics and the tests of the memory bound."""
        if sandbox_id is not None:
            st = self._sandboxes.get(sandbox_id)
            return 0 if st is None else st.size()
        return sum(st.size() for st in self._sandboxes.values())

    def _state(self, sandbox_id: str) -> _SandboxState:
        st = self._sandboxes.get(sandbox_id)
        if st is None:
            st = self._sandboxes[sandbox_id] = _SandboxState()
        return st

    @staticmethod
    def _quiet(st: _SandboxState, name: str, now: float) -> bool:
        """Whether `name` is in its quiet time after a finding (observations then are dropped, not kept)."""
        until = st.quiet_until.get(name)
        if until is None:
            return False
        if now >= until:
            del st.quiet_until[name]
            return False
        return True

    @staticmethod
    def _fire(
        st: _SandboxState,
        sandbox_id: str,
        name: str,
        action: Action,
        window: float,
        now: float,
        evidence: dict[str, Any],
    ) -> Finding:
        st.quiet_until[name] = now + window
        return Finding(name, sandbox_id, action, evidence)


def _dest(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _weight(value: Any) -> int:
    """An event's count: a non-negative integer, anything else counts nothing."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    if isinstance(value, float) and not math.isfinite(value):
        return 0
    return max(0, min(int(value), _MAX_WEIGHT))


def _sanitize(data: Mapping[str, Any]) -> dict[str, Any]:
    """A bounded, JSON-ready copy of an event's data (it may quote what the sandbox chose, e.g. a comm)."""
    out: dict[str, Any] = {}
    for key, value in list(data.items())[:_MAX_EVIDENCE_ITEMS]:
        if value is None or isinstance(value, bool | int | float):
            out[str(key)[:64]] = value
        else:
            out[str(key)[:64]] = (value if isinstance(value, str) else repr(value))[:_MAX_EVIDENCE_STR]
    return out


# --- the scan of a sandbox's writable layer -----------------------------------------------------------

SYSTEM_DIRS = ("bin", "sbin", "usr/bin", "usr/sbin", "lib", "lib64", "usr/lib64", "usr/lib/x86_64-linux-gnu")
_OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")  # the second on `userxattr` mounts


def replaced_system_binaries(upper: Path, lowers: Sequence[Path], *, limit: int = 20) -> list[str]:
    """Paths ("/usr/bin/bash") in the upper's system dirs that replace or delete something of the lowers.

    Reported: an entry directly in a system dir (not recursive) that also exists in the lowers (top first;
    a whiteout in a higher lower hides the file below), an overlay whiteout (a deleted file), an opaque
    directory; and a system dir (or its parent, e.g. "/bin" or "/usr") that the upper replaced with a
    non-directory or that replaces a lower's symlink (Debian's /bin -> usr/bin). New files are fine.

    The upper belongs to the sandbox, so nothing in it is followed: the walk goes by directory fds opened
    with O_NOFOLLOW (a symlink swapped in mid-scan fails the open instead of leading elsewhere) and entries
    are lstat'ed. The lowers are the image's read-only layers: their symlinks are resolved, inside the layer.
    """
    found: list[str] = []
    seen: set[str] = set()

    def report(path: str) -> bool:
        if path not in seen:
            seen.add(path)
            found.append(path)
        return len(found) >= limit

    if limit <= 0:
        return found
    try:
        root_fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return found
    try:
        for rel in SYSTEM_DIRS:
            if _scan_dir(root_fd, rel, lowers, report):
                break
    finally:
        os.close(root_fd)
    return found


def _scan_dir(root_fd: int, rel: str, lowers: Sequence[Path], report: Callable[[str], bool]) -> bool:
    """Scan one system dir of the upper; True once `report` says the limit is reached."""
    fds: list[int] = []
    try:
        fd = root_fd
        parts = rel.split("/")
        for i, name in enumerate(parts):
            sub = "/".join(parts[: i + 1])
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return False  # the sandbox never wrote there
            lower = _lower_entry(lowers, sub)
            if not stat.S_ISDIR(st.st_mode):
                # A symlink, file or whiteout where the lowers have something: the dir itself was replaced.
                return report("/" + sub) if (lower is not None or _is_whiteout(st)) else False
            # A directory over what the lowers have as a symlink (/bin -> usr/bin) replaces it too.
            if lower is not None and not stat.S_ISDIR(lower.st_mode) and report("/" + sub):
                return True
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return False  # swapped under us; the next scan looks again
                raise
            fds.append(fd)
        lower_dirs = [_resolve_in_layer(lower, rel) for lower in lowers]
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                path = f"/{rel}/{entry.name}"
                if _is_whiteout(st):
                    replaced = True
                elif stat.S_ISDIR(st.st_mode):
                    # A directory is copied up whenever something is created inside it (apt adding a
                    # library's subdir): only an opaque one (rm -rf + mkdir) hides what the lowers had.
                    lower = _lookup(lower_dirs, entry.name)
                    replaced = lower is not None and (not stat.S_ISDIR(lower.st_mode) or _is_opaque(fd, entry.name))
                else:
                    replaced = _lookup(lower_dirs, entry.name) is not None
                if replaced and report(path):
                    return True
        return False
    except OSError:
        return False  # an upper being torn down (the sandbox stopping) is not worth a failed scan
    finally:
        for fd in fds:
            os.close(fd)


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(dir_fd: int, name: str) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        for attr in _OPAQUE_XATTRS:
            try:
                if os.getxattr(fd, attr) == b"y":
                    return True
            except OSError:
                pass
        return False
    finally:
        os.close(fd)


def _lower_entry(lowers: Sequence[Path], rel: str) -> os.stat_result | None:
    """The lstat of `rel` in the lowers' merged view (top first), None if absent there."""
    parent, _, name = rel.rpartition("/")
    return _lookup([_resolve_in_layer(lower, parent) for lower in lowers], name)


def _lookup(dirs: Sequence[Path | None], name: str) -> os.stat_result | None:
    """The first of `dirs` (top layer first) holding `name` decides; a whiteout there means absent."""
    for d in dirs:
        if d is None:
            continue
        try:
            st = os.lstat(d / name)
        except OSError:
            continue
        return None if _is_whiteout(st) else st
    return None


def _resolve_in_layer(layer: Path, rel: str) -> Path | None:
    """The real directory `rel` names inside a (trusted, read-only) layer, its symlinks followed within the
    layer (an absolute target is the layer's, not the host's); None when it is not a directory there."""
    pending = [p for p in rel.split("/") if p]
    current: list[str] = []
    hops = 40  # the kernel's own limit on symlinks in one lookup
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            if current:
                current.pop()
            continue
        path = layer.joinpath(*current, name)
        try:
            st = os.lstat(path)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(path)
            if target.startswith("/"):
                current = []
            pending[:0] = [p for p in target.split("/") if p]
            continue
        if not stat.S_ISDIR(st.st_mode):
            return None
        current.append(name)
    return layer.joinpath(*current)
