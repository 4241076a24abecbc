"""Prometheus metrics of one daemon (own registry, so several daemons can live in one test process).

Sandbox usage is exported added up by state and QoS class (`sandfleet_sandboxes*`): a series per
sandbox is 10,000 series a node (380,000 a cluster), each new sandbox a new one. `metrics_per_sandbox`
adds the per-sandbox families (`sandfleet_sandbox_*`) for a node being debugged.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandfleet.daemon.node.lifecycle import HOLDING_STATES
from sandfleet.errors import CAUSES
from sandfleet.models import QoS, Usage

QOS_CLASSES: tuple[str, ...] = get_args(QoS)


@dataclass(frozen=True)
class SandboxSample:
    """A sandbox holding node resources, as a scrape sees it."""

    id: str
    state: str
    qos: str
    memory: int | None  # bytes at the monitor's last read of it (None: not read yet)
    tasks: int | None  # tasks, likewise
    read: Callable[[], Usage]  # its cgroup now (the per-sandbox series only)


@dataclass(frozen=True)
class NodeUsage:
    sandboxes: list[SandboxSample]
    cpu_seconds: Mapping[str, float]  # by QoS class: CPU time all sandboxes used, stopped ones included


UsageSource = Callable[[], NodeUsage]

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.alive = Gauge("sandfleet_sandboxes_running", "Sandboxes currently running", registry=r)
        self.created = Counter("sandfleet_sandboxes_created", "Sandboxes created", registry=r)
        self.create_failures = Counter("sandfleet_sandbox_create_failures", "Failed creates", registry=r)
        self.rejected = Counter("sandfleet_admission_rejections", "Creates rejected: node full", registry=r)
        self.quota_refusals = Counter(
            "sandfleet_quota_refusals", "Creates refused by a project's quota, by project", ["project"], registry=r
        )
        self.stopped = Counter("sandfleet_sandboxes_stopped", "Sandboxes stopped", ["reason"], registry=r)
        self.create_seconds = Histogram(
            "sandfleet_create_seconds", "Create latency (request to exec-ready)", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.snapshot_seconds = Histogram(
            "sandfleet_snapshot_seconds",
            "Time to checkpoint a sandbox (frozen meanwhile)",
            buckets=(0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
            registry=r,
        )
        self.paused = Counter("sandfleet_pauses", "Sandboxes paused (frozen, memory pushed out)", registry=r)
        self.resumed = Counter("sandfleet_resumes", "Sandboxes resumed", ["transparent"], registry=r)
        self.pool_hits = Counter("sandfleet_pool_hits", "Creates served from a warm pool", registry=r)
        self.pool_ready = Gauge(
            "sandfleet_pool_ready", "Members ready in each configured warm pool", ["pool"], registry=r
        )
        self.execs = Counter("sandfleet_execs", "Commands executed", registry=r)
        self.exec_seconds = Histogram(
            "sandfleet_exec_seconds", "Exec latency in the daemon", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.agent_unresponsive = Counter(
            "sandfleet_agent_unresponsive", "Sandboxes whose agent stopped answering (reported once each)", registry=r
        )
        self.oom_kills = Counter("sandfleet_oom_kills", "Processes killed by a sandbox memory limit", registry=r)
        self.http_errors = Counter("sandfleet_api_errors", "API errors by wire code", ["code"], registry=r)
        # Whose fault each failure was (infra, agent, timeout, verifier, caller): API errors, commands that
        # failed, verifications. A trainer masks infra failures instead of scoring them against the policy.
        self.failures = Counter("sandfleet_failures", "Failures by whose fault they were", ["cause"], registry=r)
        self.verifications = Counter(
            "sandfleet_verifications", "Verifications by outcome: passed, or whose fault", ["outcome"], registry=r
        )
        # Every cause and outcome exported from the start (at 0): rate() and the alert rules see the
        # first failure, which a series born at 1 would hide.
        for cause in CAUSES:
            self.failures.labels(cause=cause)
        for outcome in ("passed", *CAUSES):
            self.verifications.labels(outcome=outcome)
        self.egress_connections = Counter(
            "sandfleet_egress_connections",
            "Connections sandboxes made through the egress proxy",
            ["allowed"],
            registry=r,
        )
        self.findings = Counter("sandfleet_findings", "Misbehaviour detector findings", ["detector"], registry=r)
        self.daemon_rss = Gauge("sandfleet_daemon_rss_bytes", "Resident memory of the daemon", registry=r)
        self.alerts_firing = Gauge(
            "sandfleet_alerts_firing", "The node's alerts firing (GET /v1/alerts)", ["name", "severity"], registry=r
        )

        self.admission_cpu_committed = Gauge(
            "sandfleet_admission_cpu_requests", "CPU requests of the sandboxes admitted", registry=r
        )
        self.admission_cpu_load = Gauge(
            "sandfleet_admission_cpu_load", "CPUs latency-sensitive sandboxes used (last sample)", registry=r
        )
        self.admission_memory_committed = Gauge(
            "sandfleet_admission_memory_limits_bytes", "Memory limits of the sandboxes admitted", registry=r
        )

    def track_sandboxes(self, source: UsageSource, *, per_sandbox: bool = False) -> None:
        """Sandbox usage by state and QoS class; `per_sandbox`: also a series per sandbox, read from its
        cgroup at scrape time."""
        self.registry.register(_UsageCollector(source, per_sandbox))

    def pools_ready(self, ready: Mapping[str, int]) -> None:
        """Members ready in each configured warm pool, by pool. Only configured ones: the configuration
        fixes them (no series goes stale), where adaptive pools come with every shape callers ask for."""
        for pool, n in ready.items():
            self.pool_ready.labels(pool=pool).set(n)


def _usage_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily]:
    by = ["state", "qos"]
    return (
        GaugeMetricFamily("sandfleet_sandboxes", "Sandboxes holding resources (running, paused)", labels=by),
        GaugeMetricFamily("sandfleet_sandboxes_memory_bytes", "Memory they use (the monitor's last read)", labels=by),
        GaugeMetricFamily("sandfleet_sandboxes_tasks", "Tasks in them (the monitor's last read)", labels=by),
        CounterMetricFamily(
            "sandfleet_sandboxes_cpu_seconds", "CPU time sandboxes used, stopped ones included", labels=["qos"]
        ),
    )


def _sandbox_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, CounterMetricFamily, GaugeMetricFamily]:
    labels = ["sandbox", "state", "qos"]
    return (
        GaugeMetricFamily("sandfleet_sandbox_memory_bytes", "Memory a sandbox uses now", labels=labels),
        GaugeMetricFamily("sandfleet_sandbox_memory_peak_bytes", "Most memory a sandbox used", labels=labels),
        CounterMetricFamily("sandfleet_sandbox_cpu_seconds", "CPU time a sandbox used", labels=labels),
        GaugeMetricFamily("sandfleet_sandbox_tasks", "Tasks in a sandbox", labels=labels),
    )


class _UsageCollector(Collector):
    def __init__(self, source: UsageSource, per_sandbox: bool) -> None:
        self.source = source
        self.per_sandbox = per_sandbox
        self._lock = threading.Lock()  # two scrapes at once (two Prometheus servers)
        self._cpu_start: dict[str, float] | None = None
        self._cpu_high = dict.fromkeys(QOS_CLASSES, 0.0)

    def describe(self) -> Iterator[Metric]:
        # The names only: registering refuses one that clashes with another metric.
        yield from _usage_families()
        if self.per_sandbox:
            yield from _sandbox_families()

    def collect(self) -> Iterator[Metric]:
        usage = self.source()
        # Added up from what the monitor last read of each sandbox (each sweep for one that used CPU,
        # so a few seconds old): reading 10,000 cgroups again here would be 20,000 file reads a
        # scrape, per Prometheus server; a tier's parent cgroup gives one total, not one by state and
        # QoS. A paused sandbox counts what it held once paused.
        count, memory, tasks, cpu = _usage_families()
        n: Tally[tuple[str, str]] = Tally(dict.fromkeys(itertools.product(sorted(HOLDING_STATES), QOS_CLASSES), 0))
        mem: Tally[tuple[str, str]] = Tally()
        pids: Tally[tuple[str, str]] = Tally()
        for s in usage.sandboxes:
            key = (s.state, s.qos)
            n[key] += 1
            mem[key] += s.memory or 0
            pids[key] += s.tasks or 0
        for key in sorted(n):
            count.add_metric(key, n[key])
            memory.add_metric(key, mem[key])
            tasks.add_metric(key, pids[key])
        for qos, seconds in self._cpu(usage.cpu_seconds).items():
            cpu.add_metric([qos], seconds)
        yield from (count, memory, tasks, cpu)
        if self.per_sandbox:
            yield from _per_sandbox(usage.sandboxes)

    def _cpu(self, seconds: Mapping[str, float]) -> dict[str, float]:
        """A counter per QoS class, that never goes down: counted from the first scrape (the node's
        count of what best-effort sandboxes used starts over with the daemon), and never below what
        was exported (a best-effort sandbox's use counts as latency-sensitive until the reaper's next
        look moves it over)."""
        with self._lock:
            if not seconds:  # not split yet (the reaper's first look): nothing to start from
                return dict(self._cpu_high)
            if self._cpu_start is None:
                self._cpu_start = {q: seconds.get(q, 0.0) for q in QOS_CLASSES}
            for q in QOS_CLASSES:
                self._cpu_high[q] = max(self._cpu_high[q], seconds.get(q, 0.0) - self._cpu_start[q])
            return dict(self._cpu_high)


def _per_sandbox(sandboxes: list[SandboxSample]) -> Iterator[Metric]:
    mem, peak, cpu, tasks = _sandbox_families()
    for s in sandboxes:
        try:
            st = s.read()
        except OSError:  # stopped meanwhile
            continue
        values = [s.id, s.state, s.qos]
        mem.add_metric(values, st.memory_bytes)
        peak.add_metric(values, st.memory_peak_bytes)
        cpu.add_metric(values, st.cpu_seconds)
        tasks.add_metric(values, st.pids)
    yield from (mem, peak, cpu, tasks)
