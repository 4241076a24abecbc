"""What the node sees sandboxes do, and what it does about it: the audit stream's sandbox records,
the misbehaviour detectors' inputs, and a finding's action (record, pause or kill).

Inputs: every journal event (`EventJournal.tap`: OOM kills, refused forks, truncated output,
attempts on the agent), every connection the egress proxy served or refused, and a sweep every
`interval` seconds over running sandboxes (cgroup counters, CPU time, the system directories of
their writable layer), read in one thread call for all of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from sandfleet.backends.base import LayerView, offers
from sandfleet.daemon.audit import AuditLog
from sandfleet.daemon.core import NodeCore
from sandfleet.daemon.detectors import Detectors, DetectorsConfig, Finding, replaced_system_binaries
from sandfleet.daemon.lifecycle import RUNNING, Sandbox
from sandfleet.daemon.pausing import Pauser
from sandfleet.images.recipe import BUILD_LABEL
from sandfleet.models import Usage

log = logging.getLogger(__name__)

# Journal events that belong in the audit stream (the rest are lifecycle bookkeeping).
AUDITED = frozenset(
    {"oom_kill", "pids_limit", "output_truncated", "agent_attack", "finding", "network_policy", "port_exposed"}
)
_RESERVED = frozenset({"kind", "sandbox_id", "labels", "actor"})


class Monitor:
    def __init__(
        self, core: NodeCore, pauser: Pauser, config: DetectorsConfig, audit: AuditLog | None, interval: float = 5.0
    ) -> None:
        self.core = core
        self.pauser = pauser
        self.audit = audit
        self.interval = interval
        self.detectors = Detectors(config)
        core.journal.tap = self._event
        core.table.on_stopped(lambda sb: self.detectors.forget(sb.id))

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

    def connection(self, sandbox_id: str, rec: dict[str, Any]) -> None:
        """One connection the egress proxy refused, or served and closed."""
        self.core.metrics.egress_connections.labels(allowed=str(bool(rec.get("allowed"))).lower()).inc()
        self.audit_record("connection", sandbox_id, rec)
        host, port = rec.get("host"), rec.get("port")
        if isinstance(host, str) and isinstance(port, int):
            self._act(self.detectors.connection(sandbox_id, host, port, bool(rec.get("allowed"))))

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
        running = [sb for sb in self.core.table if sb.state == RUNNING and sb.live is not None]
        if not running:
            return
        samples = await asyncio.to_thread(self._read_all, running)
        for sb, stats, cpu, paths in samples:
            if sb.state != RUNNING:
                continue
            if stats is not None:
                self.core.note_limits(sb, stats)
            if cpu is not None:
                self._act(self.detectors.cpu_sample(sb.id, cpu, sb.spec.resources.cpu))
            if paths:
                self._act(self.detectors.binaries(sb.id, paths))

    def _read_all(self, sandboxes: list[Sandbox]) -> list[tuple[Sandbox, Usage | None, float | None, list[str]]]:
        out = []
        for sb in sandboxes:
            live = sb.live
            if live is None:
                continue
            tier = self.core.tier(sb)
            stats: Usage | None = None
            cpu: float | None = None
            paths: list[str] = []
            try:
                stats = tier.usage(live)
                cpu = tier.cpu_seconds(live)
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
