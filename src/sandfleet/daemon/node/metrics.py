"""Prometheus metrics of one daemon (own registry, so several daemons can live in one test process)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sandfleet.models import Usage

# (sandbox id, state, qos, a reader of its cgroup's current usage)
SandboxSource = Callable[[], Iterable[tuple[str, str, str, Callable[[], Usage]]]]

_LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.alive = Gauge("sandfleet_sandboxes_running", "Sandboxes currently running", registry=r)
        self.created = Counter("sandfleet_sandboxes_created", "Sandboxes created", registry=r)
        self.create_failures = Counter("sandfleet_sandbox_create_failures", "Failed creates", registry=r)
        self.rejected = Counter("sandfleet_admission_rejections", "Creates rejected: node full", registry=r)
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
        self.egress_connections = Counter(
            "sandfleet_egress_connections",
            "Connections sandboxes made through the egress proxy",
            ["allowed"],
            registry=r,
        )
        self.findings = Counter("sandfleet_findings", "Misbehaviour detector findings", ["detector"], registry=r)
        self.daemon_rss = Gauge("sandfleet_daemon_rss_bytes", "Resident memory of the daemon", registry=r)

        self.admission_cpu_committed = Gauge(
            "sandfleet_admission_cpu_requests", "CPU requests of the sandboxes admitted", registry=r
        )
        self.admission_cpu_load = Gauge(
            "sandfleet_admission_cpu_load", "CPUs latency-sensitive sandboxes used (last sample)", registry=r
        )
        self.admission_memory_committed = Gauge(
            "sandfleet_admission_memory_limits_bytes", "Memory limits of the sandboxes admitted", registry=r
        )

    def track_sandboxes(self, source: SandboxSource) -> None:
        """Per-sandbox usage series, read from the cgroups at scrape time (one series per sandbox)."""
        self.registry.register(_SandboxCollector(source))


class _SandboxCollector(Collector):
    def __init__(self, source: SandboxSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        labels = ["sandbox", "state", "qos"]
        mem = GaugeMetricFamily("sandfleet_sandbox_memory_bytes", "Memory a sandbox uses now", labels=labels)
        peak = GaugeMetricFamily("sandfleet_sandbox_memory_peak_bytes", "Most memory a sandbox used", labels=labels)
        cpu = CounterMetricFamily("sandfleet_sandbox_cpu_seconds", "CPU time a sandbox used", labels=labels)
        tasks = GaugeMetricFamily("sandfleet_sandbox_tasks", "Tasks in a sandbox", labels=labels)
        for sandbox_id, state, qos, read in self.source():
            try:
                st = read()
            except OSError:  # stopped meanwhile
                continue
            values = [sandbox_id, state, qos]
            mem.add_metric(values, st.memory_bytes)
            peak.add_metric(values, st.memory_peak_bytes)
            cpu.add_metric(values, st.cpu_seconds)
            tasks.add_metric(values, st.pids)
        yield from (mem, peak, cpu, tasks)
