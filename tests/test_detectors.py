"""Misbehaviour detectors (daemon/security/detectors.py): thresholds on a fake clock, quiet times, bounded state,
and the scan of an overlay upper for replaced system binaries on real directories."""

from __future__ import annotations

import os
import random
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from sandfleet.daemon.security.detectors import (
    Detectors,
    DetectorsConfig,
    Finding,
    replaced_system_binaries,
)

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def _detectors(**config: object) -> tuple[Detectors, Clock]:
    clock = Clock()
    return Detectors(DetectorsConfig.model_validate(config), clock=clock), clock


def _names(findings: list[Finding]) -> list[str]:
    return [f.detector for f in findings]


# --- config ---------------------------------------------------------------------------------------------


def test_defaults_and_unknown_fields_are_refused() -> None:
    c = DetectorsConfig()
    assert (c.port_scan.threshold, c.port_scan.window) == (20, 10.0)
    assert (c.connection_flood.threshold, c.connection_flood.window) == (200, 10.0)
    assert (c.fork_flood.threshold, c.fork_flood.window) == (50, 10.0)
    assert (c.output_flood.threshold, c.output_flood.window) == (20, 60.0)
    assert (c.oom_repeat.threshold, c.oom_repeat.window) == (3, 60.0)
    assert (c.cpu_mining.ratio, c.cpu_mining.window) == (0.9, 120.0)
    assert c.agent_attack.threshold == 1
    assert all(
        getattr(c, name).enabled and getattr(c, name).action == "record" for name in DetectorsConfig.model_fields
    )
    with pytest.raises(ValidationError):
        DetectorsConfig.model_validate({"port_scn": {}})
    with pytest.raises(ValidationError):
        DetectorsConfig.model_validate({"port_scan": {"treshold": 5}})
    with pytest.raises(ValidationError):
        DetectorsConfig.model_validate({"port_scan": {"action": "explode"}})
    with pytest.raises(ValidationError):
        DetectorsConfig.model_validate({"fork_flood": {"threshold": 0}})


# --- port scan, connection flood --------------------------------------------------------------------------


def test_port_scan_fires_at_the_threshold_of_distinct_denied_destinations() -> None:
    d, clock = _detectors(port_scan={"action": "kill"})
    for port in range(1, 20):
        assert d.connection("sb", "10.0.0.1", port, allowed=False) == []
        clock.tick(0.4)
    (f,) = d.connection("sb", "10.0.0.1", 20, allowed=False)
    assert (f.detector, f.sandbox_id, f.action) == ("port_scan", "sb", "kill")
    assert f.evidence["count"] == 20 and f.evidence["threshold"] == 20 and f.evidence["window"] == 10.0
    assert len(f.evidence["sample"]) == 10 and f.evidence["sample"][-1] == "10.0.0.1:20"
    assert f.to_dict() == {"detector": "port_scan", "sandbox_id": "sb", "action": "kill", "evidence": f.evidence}


def test_port_scan_ignores_retries_allowed_traffic_and_slow_probing() -> None:
    d, clock = _detectors()
    for _ in range(100):  # a client retrying one closed port
        assert d.connection("sb", "10.0.0.1", 5432, allowed=False) == []
        clock.tick(0.05)
    for port in range(1000, 1050):  # allowed connections are not a scan (and 50 stay under the flood)
        assert d.connection("sb", "10.0.0.2", port, allowed=True) == []
    clock.tick(10)
    for port in range(60):  # one denied destination a second: at most 10 in any 10 s window
        assert d.connection("sb", "10.0.0.3", port, allowed=False) == []
        clock.tick(1)
    # IPv6 destinations are quoted unambiguously
    d2, _ = _detectors(port_scan={"threshold": 2})
    d2.connection("sb", "fd00::1", 1, allowed=False)
    (f,) = d2.connection("sb", "fd00::1", 2, allowed=False)
    assert f.evidence["sample"] == ["[fd00::1]:1", "[fd00::1]:2"]


def test_pip_and_a_test_suite_do_not_trip_anything() -> None:
    d, clock = _detectors()
    for i in range(30):  # pip: 30 connections to the index and the file host
        assert d.connection("sb", ("pypi.org", "files.pythonhosted.org")[i % 2], 443, allowed=True) == []
        clock.tick(0.1)
    for i in range(150):  # a test suite's local servers: many connections, a few refused
        assert d.connection("sb", "127.0.0.1", 8000 + i % 5, allowed=i % 10 != 0) == []
        clock.tick(0.05)
    assert d.event("sb", "oom_kill", {"count": 1}) == []  # one OOM is a mistake, not an attack
    assert d.event("sb", "pids_limit", {"refused_forks": 10}) == []
    assert d.event("sb", "output_truncated", {}) == []
    for t in range(0, 31, 5):  # a 30 s compile at the limit, then idle
        clock.tick(5)
        assert d.cpu_sample("sb", cpu_seconds=2.0 * min(t, 30), cpu_limit=2.0) == []
    for _ in range(30):
        clock.tick(5)
        assert d.cpu_sample("sb", cpu_seconds=60.0, cpu_limit=2.0) == []


def test_connection_flood_fires_once_per_window() -> None:
    d, clock = _detectors(connection_flood={"action": "pause"})
    d.connection("sb", "example.com", 443, allowed=True)  # the latest destinations asked are its sample
    d.connection("sb", "example.com", 80, allowed=False)
    for i in range(199):
        assert d.accepted("sb", refused=i % 2 == 0) == []
    (f,) = d.accepted("sb")
    assert (f.detector, f.action) == ("connection_flood", "pause")
    assert f.evidence["count"] == 200 and f.evidence["refused"] == 100
    assert f.evidence["sample"] == ["example.com:80", "example.com:443"]
    # the flood goes on: quiet for the window, then one more finding
    findings: list[Finding] = []
    for _ in range(100):
        for _ in range(1000):
            findings += d.accepted("sb")
        clock.tick(0.1)  # 100k attempts over 10 s
    assert findings == []
    clock.tick(0.1)
    for _ in range(200):
        findings += d.accepted("sb")
    assert _names(findings) == ["connection_flood"]


def test_connection_flood_under_threshold_or_spread_out_is_silent() -> None:
    d, clock = _detectors()
    for _ in range(199):
        assert d.accepted("sb") == []
    clock.tick(10)  # they have left the window
    for _ in range(199):
        assert d.accepted("sb") == []
    for i in range(1000):  # requests are not the flood's count (their connections were, when accepted)
        assert d.connection("sb", "h", i % 3, allowed=True) == []
    assert d.state_size("sb") <= 199 + 10


def test_connections_that_never_send_a_request_are_a_flood() -> None:
    d, _ = _detectors(port_scan={"threshold": 3}, connection_flood={"threshold": 3})
    assert d.accepted("sb") == [] and d.accepted("sb") == []
    (f,) = d.accepted("sb")
    assert f.detector == "connection_flood" and f.evidence["sample"] == []


# --- events -----------------------------------------------------------------------------------------------


def test_fork_flood_sums_refused_forks() -> None:
    d, clock = _detectors(fork_flood={"action": "kill"})
    for _ in range(7):
        assert d.event("sb", "pids_limit", {"refused_forks": 7}) == []
        clock.tick(1)
    assert d.event("sb", "pids_limit", {"refused_forks": True}) == []  # malformed counts count nothing
    assert d.event("sb", "pids_limit", {"refused_forks": "999"}) == []
    assert d.event("sb", "pids_limit", {"refused_forks": -5}) == []
    assert d.event("sb", "pids_limit", {"refused_forks": float("nan")}) == []
    (f,) = d.event("sb", "pids_limit", {"refused_forks": 1})
    assert (f.detector, f.action, f.evidence["count"]) == ("fork_flood", "kill", 50)
    # one burst over the threshold fires at once (after the quiet time)
    clock.tick(10)
    (f,) = d.event("sb", "pids_limit", {"refused_forks": 10_000})
    assert f.evidence["count"] == 10_000


def test_output_flood_and_its_window() -> None:
    d, clock = _detectors()
    for _ in range(5):  # one truncation a minute: a chatty build, not a flood
        assert d.event("sb", "output_truncated", {}) == []
        clock.tick(60)
    for _ in range(19):
        assert d.event("sb", "output_truncated", {}) == []
        clock.tick(2)
    (f,) = d.event("sb", "output_truncated", {})
    assert f.detector == "output_flood" and f.evidence == {"count": 20, "threshold": 20, "window": 60.0}


def test_oom_repeat() -> None:
    d, clock = _detectors()
    assert d.event("sb", "oom_kill", {"count": 1}) == []
    clock.tick(61)
    assert d.event("sb", "oom_kill", {}) == []  # no count: one
    clock.tick(30)
    assert d.event("sb", "oom_kill", {"count": 1}) == []
    (f,) = d.event("sb", "oom_kill", {"count": 1})
    assert f.detector == "oom_repeat" and f.evidence["count"] == 3


def test_agent_attack_fires_at_once_with_bounded_evidence() -> None:
    d, clock = _detectors(agent_attack={"action": "kill"})
    data = {"pid": 42, "comm": "x" * 10_000, "op": "ptrace", "blob": b"\x00" * 5, **{f"k{i}": i for i in range(50)}}
    (f,) = d.event("sb", "agent_attack", data)
    assert (f.detector, f.action, f.evidence["count"]) == ("agent_attack", "kill", 1)
    ev = f.evidence["event"]
    assert ev["pid"] == 42 and ev["op"] == "ptrace" and len(ev["comm"]) == 256 and isinstance(ev["blob"], str)
    assert len(ev) == 10
    assert d.event("sb", "agent_attack", {"pid": 43}) == []  # quiet for the window
    clock.tick(60)
    assert _names(d.event("sb", "agent_attack", {"pid": 44})) == ["agent_attack"]
    # the default policy only records
    d2, _ = _detectors()
    assert d2.event("sb", "agent_attack", {})[0].action == "record"


def test_unknown_events_are_ignored() -> None:
    d, _ = _detectors(output_flood={"threshold": 1})
    assert d.event("sb", "exec_started", {"count": 100}) == []
    assert d.state_size() == 0


def test_sandboxes_are_independent() -> None:
    d, _ = _detectors(oom_repeat={"threshold": 2})
    assert d.event("a", "oom_kill", {}) == []
    assert d.event("b", "oom_kill", {}) == []
    assert [f.sandbox_id for f in d.event("b", "oom_kill", {})] == ["b"]


# --- CPU mining -------------------------------------------------------------------------------------------


def _feed_cpu(d: Detectors, clock: Clock, cpu: float, usage: float, seconds: int, step: int = 10) -> list[Finding]:
    findings: list[Finding] = []
    for _ in range(seconds // step):
        clock.tick(step)
        cpu += usage * step
        findings += d.cpu_sample("sb", cpu, cpu_limit=2.0)
    return findings


def test_cpu_mining_fires_after_a_whole_window_at_the_limit() -> None:
    d, clock = _detectors(cpu_mining={"action": "pause"})
    assert d.cpu_sample("sb", 0.0, cpu_limit=2.0) == []  # a baseline only
    assert _feed_cpu(d, clock, 0.0, usage=1.9, seconds=110) == []
    (f,) = _feed_cpu(d, clock, 1.9 * 110, usage=1.9, seconds=10)
    assert (f.detector, f.action) == ("cpu_mining", "pause")
    assert f.evidence["busy_seconds"] == 120 and f.evidence["usage_cpus"] == pytest.approx(1.9)
    assert f.evidence["cpu_limit"] == 2.0
    # still mining: the next finding needs another whole window
    assert _feed_cpu(d, clock, 1.9 * 120, usage=2.0, seconds=110) == []
    assert _names(_feed_cpu(d, clock, 1.9 * 120 + 220, usage=2.0, seconds=10)) == ["cpu_mining"]


def test_cpu_mining_one_idle_gap_resets_and_under_the_ratio_is_fine() -> None:
    d, clock = _detectors()
    d.cpu_sample("sb", 0.0, cpu_limit=2.0)
    cpu = 0.0
    for _ in range(5):  # 100 s busy, 10 s idle, over and over: never a whole window
        assert _feed_cpu(d, clock, cpu, usage=2.0, seconds=100) == []
        cpu += 200
        clock.tick(10)
        assert d.cpu_sample("sb", cpu, cpu_limit=2.0) == []
    assert _feed_cpu(d, clock, cpu, usage=1.7, seconds=600) == []  # 85 % of the limit


def test_cpu_mining_odd_samples() -> None:
    d, clock = _detectors(cpu_mining={"window": 20})
    assert d.cpu_sample("sb", 100.0, cpu_limit=1.0) == []
    assert d.cpu_sample("sb", 100.0, cpu_limit=1.0) == []  # no time passed: ignored
    clock.tick(10)
    assert d.cpu_sample("sb", 5.0, cpu_limit=1.0) == []  # counter went back (a restore): new baseline
    clock.tick(10)
    assert d.cpu_sample("sb", 15.0, cpu_limit=0.0) == []  # no limit: nothing to be at
    clock.tick(10)
    assert d.cpu_sample("sb", 25.0, cpu_limit=1.0) == []
    clock.tick(10)
    assert d.cpu_sample("sb", float("nan"), cpu_limit=1.0) == []
    clock.tick(10)
    assert d.cpu_sample("sb", 45.0, cpu_limit=1.0) == []  # the nan dropped the baseline
    clock.tick(10)
    assert d.cpu_sample("sb", 55.0, cpu_limit=1.0) == []
    clock.tick(10)
    assert _names(d.cpu_sample("sb", 65.0, cpu_limit=1.0)) == ["cpu_mining"]


# --- system binaries --------------------------------------------------------------------------------------


def test_binaries_fire_once_per_path() -> None:
    d, _ = _detectors(system_binaries={"action": "kill"})
    assert d.binaries("sb", []) == []
    (f,) = d.binaries("sb", ["/usr/bin/bash", "/usr/bin/ls", "/usr/bin/bash"])
    assert (f.detector, f.action, f.evidence) == (
        "system_binaries",
        "kill",
        {"count": 2, "paths": ["/usr/bin/bash", "/usr/bin/ls"]},
    )
    assert d.binaries("sb", ["/usr/bin/bash", "/usr/bin/ls"]) == []  # the next scan finds the same
    (f,) = d.binaries("sb", ["/usr/bin/bash", "/usr/sbin/sshd"])
    assert f.evidence["paths"] == ["/usr/sbin/sshd"]


# --- switches, forget, memory -----------------------------------------------------------------------------


def test_disabled_detectors_keep_nothing() -> None:
    off = {"enabled": False}
    names = DetectorsConfig.model_fields
    d, clock = _detectors(**dict.fromkeys(names, off))
    for i in range(1000):
        assert d.connection("sb", "h", i, allowed=False) == []
        assert d.event("sb", "agent_attack", {}) == []
        assert d.event("sb", "pids_limit", {"refused_forks": 100}) == []
        assert d.cpu_sample("sb", float(i * 10), cpu_limit=1.0) == []
        assert d.binaries("sb", ["/usr/bin/bash"]) == []
        clock.tick(1)
    assert d.state_size() == 0


def test_forget_drops_the_state() -> None:
    d, _ = _detectors(oom_repeat={"threshold": 2})
    d.event("sb", "oom_kill", {})
    d.connection("sb", "h", 1, allowed=False)
    d.cpu_sample("sb", 1.0, 1.0)
    d.binaries("sb", ["/bin/sh"])
    assert d.state_size("sb") > 0
    d.forget("sb")
    d.forget("never-seen")
    assert d.state_size("sb") == 0 and d.state_size() == 0
    assert d.event("sb", "oom_kill", {}) == []  # the earlier OOM is gone with the state
    assert _names(d.binaries("sb", ["/bin/sh"])) == ["system_binaries"]


def test_memory_stays_bounded_under_100k_observations() -> None:
    d, clock = _detectors()
    rng = random.Random(7)
    findings: list[Finding] = []
    peak = 0
    for i in range(100_000):
        host = "h" * rng.randrange(1, 5000)  # hosts of any length
        findings += d.accepted("sb", refused=rng.random() < 0.1)
        findings += d.connection("sb", host + str(rng.randrange(10**6)), rng.randrange(65536), rng.random() < 0.5)
        kind = ("oom_kill", "pids_limit", "output_truncated", "agent_attack", "other")[i % 5]
        findings += d.event("sb", kind, {"count": 1, "refused_forks": 1})
        findings += d.cpu_sample("sb", i * 0.001, 1.0)
        if i % 10 == 0:
            findings += d.binaries("sb", [f"/usr/bin/tool{i}"])
        clock.tick(0.001)
        if i % 1000 == 0:
            peak = max(peak, d.state_size())
    peak = max(peak, d.state_size())
    # windows hold at most `threshold` entries; reported paths are capped at 1024
    assert peak <= 20 + 200 + 10 + 50 + 5 + 3 + 1 + 1 + 8 + 1024  # (10: the flood's sample of destinations)
    counts = {name: _names(findings).count(name) for name in set(_names(findings))}
    # 100 s of abuse: one finding per window and detector at most (binaries: once per path, capped)
    assert counts["port_scan"] <= 11 and counts["connection_flood"] <= 11 and counts["fork_flood"] <= 11
    assert counts["agent_attack"] <= 2 and counts["oom_repeat"] <= 2 and counts["output_flood"] <= 2
    assert counts["system_binaries"] == 1024
    assert all(len(s) <= 300 for f in findings for s in f.evidence.get("sample", []))


# --- replaced_system_binaries -------------------------------------------------------------------------------


def _tree(root: Path, files: list[str], links: dict[str, str] | None = None) -> Path:
    for f in files:
        p = root / f
        if f.endswith("/"):
            p.mkdir(parents=True, exist_ok=True)
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("x")
    for name, target in (links or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(target)
    return root


def _debian_lower(root: Path) -> Path:
    """A merged-/usr image: /bin, /sbin, /lib, /lib64 are symlinks into /usr."""
    return _tree(
        root,
        [
            "usr/bin/bash",
            "usr/bin/ls",
            "usr/bin/python3",
            "usr/sbin/sshd",
            "usr/lib/x86_64-linux-gnu/libc.so.6",
            "usr/lib/x86_64-linux-gnu/perl5/",
            "usr/lib64/ld-linux-x86-64.so.2",
            "etc/passwd",
        ],
        {"bin": "usr/bin", "sbin": "usr/sbin", "lib": "usr/lib", "lib64": "/usr/lib64"},
    )


def test_scan_reports_replaced_files_not_new_ones(tmp_path: Path) -> None:
    lower = _debian_lower(tmp_path / "lower")
    upper = _tree(
        tmp_path / "upper",
        [
            "usr/bin/bash",
            "usr/bin/newtool",
            "usr/lib/x86_64-linux-gnu/libnew.so",
            "usr/lib/x86_64-linux-gnu/perl5/",
            "usr/lib/x86_64-linux-gnu/newdir/",
            "etc/passwd",
            "usr/local/bin/ls",
            "usr/bin/sub/ls",
        ],
        {"usr/bin/python3": "/tmp/evil", "usr/sbin/sshd": "sshd-dangling"},
    )
    found = replaced_system_binaries(upper, [lower])
    assert sorted(found) == ["/usr/bin/bash", "/usr/bin/python3", "/usr/sbin/sshd"]
    assert replaced_system_binaries(tmp_path / "upper-missing", [lower]) == []
    assert replaced_system_binaries(_tree(tmp_path / "empty", ["usr/"]), [lower]) == []


def test_scan_checks_every_lower_and_stops_at_the_limit(tmp_path: Path) -> None:
    top = _tree(tmp_path / "top", ["usr/bin/pip"])
    bottom = _tree(tmp_path / "bottom", [f"usr/bin/t{i}" for i in range(50)] + ["sbin/init"])
    upper = _tree(tmp_path / "upper", [f"usr/bin/t{i}" for i in range(50)] + ["usr/bin/pip", "sbin/init"])
    assert len(replaced_system_binaries(upper, [top, bottom])) == 20
    assert len(replaced_system_binaries(upper, [top, bottom], limit=100)) == 52
    assert replaced_system_binaries(upper, [top, bottom], limit=0) == []
    assert "/sbin/init" in replaced_system_binaries(upper, [top, bottom], limit=100)


def test_scan_never_follows_the_uppers_symlinks(tmp_path: Path) -> None:
    lower = _debian_lower(tmp_path / "lower")
    decoy = _tree(tmp_path / "decoy", ["bash", "ls"])
    # the sandbox points /usr/bin (and /lib64) somewhere else: the scan must not list the decoy
    upper = _tree(tmp_path / "upper", ["usr/"], {"usr/bin": str(decoy), "lib64": str(decoy)})
    assert sorted(replaced_system_binaries(upper, [lower])) == ["/lib64", "/usr/bin"]
    # the upper root itself a symlink: nothing is read
    (tmp_path / "upper-link").symlink_to(decoy)
    assert replaced_system_binaries(tmp_path / "upper-link", [lower]) == []
    # a symlinked /usr in the upper: /usr reported once, not entered
    upper2 = _tree(tmp_path / "upper2", [], {"usr": str(tmp_path / "lower" / "usr")})
    assert replaced_system_binaries(upper2, [lower]) == ["/usr"]


def test_scan_handles_lower_symlinked_system_dirs(tmp_path: Path) -> None:
    lower = _debian_lower(tmp_path / "lower")
    # /bin -> usr/bin in the lower: a write to /bin/bash lands in the upper's usr/bin
    upper = _tree(tmp_path / "upper", ["usr/bin/bash"])
    assert replaced_system_binaries(upper, [lower]) == ["/usr/bin/bash"]
    # the symlink /bin replaced by a real directory (and the absolute /lib64 -> /usr/lib64 resolved in
    # the layer, not on the host): the dir itself and what it shadows are reported
    upper2 = _tree(tmp_path / "upper2", ["bin/bash", "bin/brand-new", "lib64/ld-linux-x86-64.so.2"])
    assert replaced_system_binaries(upper2, [lower]) == ["/bin", "/bin/bash", "/lib64", "/lib64/ld-linux-x86-64.so.2"]
    # a lower symlink loop is not followed forever
    loop = _tree(tmp_path / "loop", [], {"bin": "sbin", "sbin": "bin"})
    assert replaced_system_binaries(_tree(tmp_path / "upper3", ["usr/bin/x"]), [loop]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts are made with mknod (root)")
def test_scan_reports_whiteouts_and_honours_lower_whiteouts(tmp_path: Path) -> None:
    bottom = _tree(tmp_path / "bottom", ["usr/bin/bash", "usr/bin/old"])
    top = _tree(tmp_path / "top", ["usr/bin/"])
    os.mknod(top / "usr/bin/old", stat.S_IFCHR, 0)  # the image deleted `old` in a later layer
    upper = _tree(tmp_path / "upper", ["usr/bin/old"])  # so a new `old` replaces nothing
    os.mknod(upper / "usr/bin/bash", stat.S_IFCHR, 0)  # the sandbox deleted bash
    os.mknod(upper / "usr/bin/tty0", stat.S_IFCHR, os.makedev(4, 0))  # a device, not a whiteout
    assert replaced_system_binaries(upper, [top, bottom]) == ["/usr/bin/bash"]
    # an opaque directory (rm -rf + mkdir) hides what the lowers had in it
    lower = _tree(tmp_path / "lower", ["usr/lib/x86_64-linux-gnu/gconv/x", "usr/lib/x86_64-linux-gnu/perl/"])
    upper2 = _tree(tmp_path / "upper2", ["usr/lib/x86_64-linux-gnu/gconv/", "usr/lib/x86_64-linux-gnu/perl/"])
    os.setxattr(upper2 / "usr/lib/x86_64-linux-gnu/gconv", "trusted.overlay.opaque", b"y")
    assert replaced_system_binaries(upper2, [lower]) == ["/usr/lib/x86_64-linux-gnu/gconv"]
