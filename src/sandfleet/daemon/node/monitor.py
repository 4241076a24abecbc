"""What the node sees sandboxes do, and what it does about it: the audit stream's sandbox records,
the misbehaviour detectors' inputs, and a finding's action (record, pause or kill).

Inputs: every journal event (a tap of `EventJournal`: OOM kills, refused forks, truncated output,
attempts on the agent), every connection the egress proxy accepted, and what became of it (served,
refused, or silent until closed), and a sweep every `interval` seconds over running sandboxes (cgroup
counters, CPU time, the system directories of their writable layer), read in one thread call for all
of them. A sandbox's connection records reach the audit stream at a bounded rate (a flood of
connections must not become a flood of records): the ones over it are counted, and the count written.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

from sandfleet.backends.base import LayerView, offers
from sandfleet.daemon.node.core import NodeCore
from sandfleet.daemon.node.lifecycle import LIVE_STATES, RUNNING, Sandbox
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.security.audit import AuditLog
from sandfleet.daemon.security.detectors import Detectors, DetectorsConfig, Finding, replaced_system_binaries
from sandfleet.images.recipe_sandbox import BUILD_LABEL
from sandfleet.models import Usage

log = logging.getLogger(__name__)

FULL_AFTER = 300.0  # seconds an idle sandbox goes without a full read of its counters and files

# Journal events that belong in the audit stream (the rest are lifecycle bookkeeping).
AUDITED = frozenset(
    {"oom_kill", "pids_limit", "output_truncated", "agent_attack", "finding", "network_policy", "port_exposed"}
)
_RESERVED = frozenset({"kind", "sandbox_id", "labels", "actor"})
# Connection records go to the audit stream at most this fast (token buckets), per sandbox and for
# the node (many sandboxes flooding at once).
AUDIT_RATE, AUDIT_BURST = 20.0, 200  # records a second, and at once, per sandbox
NODE_AUDIT_RATE, NODE_AUDIT_BURST = 200.0, 1000


@dataclass
class _Bucket:
    rate: float
    burst: float
    tokens: float
    at: float
    suppressed: int = 0  # records over the rate since the last one written

    def refill(self, now: float) -> None:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now


class Monitor:
    def __init__(
        self, core: NodeCore, pauser: Pauser, config: DetectorsConfig, audit: AuditLog | None, interval: float = 5.0
    ) -> None:
        self.core = core
        self.pauser = pauser
        self.audit = audit
        self.interval = interval
        self.detectors = Detectors(config)
        # Per running sandbox at its last full read: (CPU seconds, last request, when: monotonic).
        self._last: dict[str, tuple[float, float, float]] = {}
        self.clock = time.monotonic
        self._cpu_marks: dict[str, tuple[float, float]] = {}  # per running sandbox: (CPU seconds, when)
        self._buckets: dict[str, _Bucket] = {}
        self._node_bucket = _Bucket(NODE_AUDIT_RATE, NODE_AUDIT_BURST, NODE_AUDIT_BURST, time.monotonic())
        core.journal.taps.append(self._event)
        core.table.on_stopped(self._stopped)

    def _stopped(self, sb: Sandbox) -> None:
        self.detectors.forget(sb.id)
        self._flush_suppressed(sb.id)
        self._buckets.pop(sb.id, None)

    # ---- inputs ----------------------------------------------------------------------------

    def _labels(self, sandbox_id: str) -> dict[str, str] | None:
        sb = self.core.table.find(sandbox_id)
        return dict(sb.spec.labels) if sb is not None else None

    def audit_record(self, kind: str, sandbox_id: str | None, data: dict[str, Any], actor: str | None = None) -> None:
        if self.audit is None:
            return
        fields = {k: v for k, v in data.items() if k not in _RESERVED}
        labels = self._labels(sandbox_id) if sandbox_id else None
        try:
            self.audit.record(kind, sandbox_id=sandbox_id, labels=labels, actor=actor, **fields)
        except RuntimeError:
            pass  # before the stream started (the daemon's first moments) or after it closed

    def _event(self, sandbox_id: str, kind: str, data: dict[str, Any]) -> None:
        if kind in AUDITED:
            self.audit_record(kind, sandbox_id, data)
        if kind != "finding":
            self._act(self.detectors.event(sandbox_id, kind, data))

    def _live(self, sandbox_id: str) -> bool:
        sb = self.core.table.find(sandbox_id)
        return sb is not None and sb.state in LIVE_STATES

    def accepted(self, sandbox_id: str, refused: bool) -> None:
        """A connection the egress proxy accepted (`refused` at once: over a limit)."""
        if self._live(sandbox_id):
            self._act(self.detectors.accepted(sandbox_id, refused))

    def connection(self, sandbox_id: str, rec: dict[str, Any]) -> None:
        """One connection the egress proxy refused, or served and closed."""
        self.core.metrics.egress_connections.labels(allowed=str(bool(rec.get("allowed"))).lower()).inc()
        if not self._live(sandbox_id):
            # Cut as its sandbox stopped (at most its `max_connections`): recorded, and no state
            # is kept for a sandbox whose state was dropped.
            self.audit_record("connection", sandbox_id, rec)
            return
        if self._within_rate(sandbox_id):
            bucket = self._buckets[sandbox_id]
            if bucket.suppressed:
                rec = {**rec, "suppressed": bucket.suppressed}
                bucket.suppressed = 0
            self.audit_record("connection", sandbox_id, rec)
        host, port = rec.get("host"), rec.get("port")
        if isinstance(host, str) and isinstance(port, int):
            self._act(self.detectors.connection(sandbox_id, host, port, bool(rec.get("allowed"))))

    def _within_rate(self, sandbox_id: str) -> bool:
        now = time.monotonic()
        b = self._buckets.get(sandbox_id)
        if b is None:
            b = self._buckets[sandbox_id] = _Bucket(AUDIT_RATE, AUDIT_BURST, AUDIT_BURST, now)
        node = self._node_bucket
        b.refill(now)
        node.refill(now)
        if b.tokens >= 1 and node.tokens >= 1:
            b.tokens -= 1
            node.tokens -= 1
            return True
        b.suppressed += 1
        return False

    def _flush_suppressed(self, sandbox_id: str) -> None:
        """One record saying how many connection records of the sandbox were over the rate."""
        b = self._buckets.get(sandbox_id)
        if b is not None and b.suppressed:
            why = (
                f"connection records over the audit's rate ({AUDIT_RATE:g}/s a sandbox, {NODE_AUDIT_RATE:g}/s "
                "the node): counted, not written"
            )
            self.audit_record("connection", sandbox_id, {"suppressed": b.suppressed, "reason": why})
            b.suppressed = 0

    # ---- the sweep -------------------------------------------------------------------------

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sweep()
            except Exception:
                log.exception("the monitor's sweep failed")

    async def sweep(self) -> None:
        """Read every running sandbox's counters, CPU and system dirs (one thread call), then feed them in."""
        for sandbox_id in list(self._buckets):
            self._flush_suppressed(sandbox_id)
        running = [sb for sb in self.core.table if sb.state == RUNNING and sb.live is not None]
        if not running:
            return
        samples = await asyncio.to_thread(self._read_all, running)
        now = self.clock()
        marks: dict[str, tuple[float, float]] = {}
        for sb, stats, cpu, paths in samples:
            if sb.state != RUNNING:
                continue
            if stats is not None:
                self.core.note_limits(sb, stats)
                sb.memory_seen, sb.tasks_seen = stats.memory_bytes, stats.pids
            if cpu is not None:
                last = self._cpu_marks.get(sb.id)
                if last is not None and now > last[1]:
                    sb.cpu_rate = round(max(0.0, cpu - last[0]) / (now - last[1]), 4)
                marks[sb.id] = (cpu, now)
                self._act(self.detectors.cpu_sample(sb.id, cpu, sb.spec.resources.cpu))
            if paths:
                self._act(self.detectors.binaries(sb.id, paths))
        self._cpu_marks = marks

    def _read_all(self, sandboxes: list[Sandbox]) -> list[tuple[Sandbox, Usage | None, float | None, list[str]]]:
        out: list[tuple[Sandbox, Usage | None, float | None, list[str]]] = []
        seen: dict[str, tuple[float, float, float]] = {}
        now = self.clock()
        for sb in sandboxes:
            live = sb.live
            if live is None:
                continue
            tier = self.core.tier(sb)
            stats: Usage | None = None
            cpu: float | None = None
            paths: list[str] = []
            active = sb.last_active_at  # once: a request may move it meanwhile (seen at the next sweep)
            try:
                cpu = tier.cpu_seconds(live)
            except OSError:
                pass
            # A sandbox that used no CPU and had no request since its last full read changed none of
            # it (its counters, its files): one file read, and the full one every FULL_AFTER seconds.
            # A counter that reads 0 (unreadable, or a tier without one) tells nothing.
            last = self._last.get(sb.id)
            if cpu and last is not None and last[:2] == (cpu, active) and now - last[2] < FULL_AFTER:
                seen[sb.id] = last
                out.append((sb, None, cpu, paths))
                continue
            # (a new one's clock starts anywhere: a burst of creates is not read in full all at once again)
            stagger = 0.0 if last is not None else zlib.crc32(sb.id.encode()) % 1000 / 1000 * FULL_AFTER
            seen[sb.id] = (cpu or 0.0, active, now - stagger)
            try:
                stats = tier.usage(live)
            except OSError:
                pass
            # A recipe's build step changes system files by design (apt, pip): its sandboxes are not scanned.
            if isinstance(tier, LayerView) and offers(tier, "layer_view") and BUILD_LABEL not in sb.spec.labels:
                try:
                    upper, lowers = tier.layer_paths(live)
                    paths = replaced_system_binaries(upper, lowers)
                except OSError:
                    pass
            out.append((sb, stats, cpu, paths))
        self._last = seen  # the sandboxes gone or not running are forgotten
        return out

    # ---- what a finding does -----------------------------------------------------------------

    def _act(self, findings: list[Finding]) -> None:
        for f in findings:
            sb = self.core.table.find(f.sandbox_id)
            if sb is None:
                continue
            self.core.metrics.findings.labels(detector=f.detector).inc()
            log.warning("sandbox %s: detector %s fired (%s): %s", f.sandbox_id, f.detector, f.action, f.evidence)
            self.core.journal.record(f.sandbox_id, "finding", {**f.to_dict(), "at": time.time()})
            if f.action == "pause" and sb.state == RUNNING:
                self.core.spawn(self._pause(f), name=f"finding-pause-{f.sandbox_id}")
            elif f.action == "kill":
                self.core.spawn(self._kill(f), name=f"finding-kill-{f.sandbox_id}")

    async def _pause(self, f: Finding) -> None:
        try:
            await self.pauser.pause(f.sandbox_id, force=True)
        except Exception as exc:
            log.warning("sandbox %s: pausing it after %s failed: %s", f.sandbox_id, f.detector, exc)

    async def _kill(self, f: Finding) -> None:
        try:
            await self.core.stop(f.sandbox_id, reason=f"detector {f.detector}")
        except Exception as exc:
            log.warning("sandbox %s: stopping it after %s failed: %s", f.sandbox_id, f.detector, exc)
