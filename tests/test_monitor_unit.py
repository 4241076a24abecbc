"""The monitor's sweep reads an idle sandbox with one file read: its counters and files in full only
after it used CPU or had a request, and at least every FULL_AFTER seconds (10,000 idle sandboxes
cost the daemon a quarter of a core when each was read in full every 5 s)."""

from __future__ import annotations

import zlib
from types import SimpleNamespace
from typing import Any

import pytest

from sandfleet.daemon.node.monitor import FULL_AFTER, Monitor
from sandfleet.daemon.security.detectors import DetectorsConfig

pytestmark = pytest.mark.unit


class Tier:
    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.full: list[str] = []

    def cpu_seconds(self, live: Any) -> float:
        return self.cpu[live.id]

    def usage(self, live: Any) -> None:
        self.full.append(live.id)


def _monitor(tier: Tier, now: list[float]) -> Monitor:
    core = SimpleNamespace(journal=SimpleNamespace(taps=[]), table=SimpleNamespace(on_stopped=lambda fn: None))
    core.tier = lambda sb: tier
    m = Monitor(core, pauser=None, config=DetectorsConfig(), audit=None)  # type: ignore[arg-type]
    m.clock = lambda: now[0]
    return m


def _sandbox(sid: str) -> Any:
    return SimpleNamespace(id=sid, live=SimpleNamespace(id=sid), last_active_at=1.0, spec=SimpleNamespace(labels={}))


def test_an_idle_sandbox_is_read_in_full_only_after_cpu_a_request_or_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zlib, "crc32", lambda data: 0)  # a new sandbox's clock starts at its first read
    tier, now = Tier(), [1000.0]
    m = _monitor(tier, now)
    a, b, c = _sandbox("a"), _sandbox("b"), _sandbox("c")
    tier.cpu = {"a": 1.0, "b": 2.0, "c": 0.0}
    for _ in range(3):
        rows = m._read_all([a, b, c])
        now[0] += 5
    # a and b after the first sweep only; c's counter reads 0 (unreadable: it tells nothing)
    assert tier.full == ["a", "b", "c", "c", "c"]
    assert [(sb.id, cpu) for sb, _, cpu, _ in rows] == [("a", 1.0), ("b", 2.0), ("c", 0.0)]  # CPU every sweep
    tier.full.clear()
    tier.cpu["a"] = 1.5  # it ran something
    b.last_active_at = 2.0  # a request (a file written through the API, say)
    m._read_all([a, b])
    assert tier.full == ["a", "b"]
    tier.full.clear()
    now[0] += FULL_AFTER - 1
    m._read_all([a, b])
    assert tier.full == []
    now[0] += 1
    m._read_all([a, b])
    assert tier.full == ["a", "b"]  # their time came
    m._read_all([b])  # a stopped: forgotten, read in full if it ever came back
    tier.full.clear()
    m._read_all([a, b])
    assert tier.full == ["a"]
