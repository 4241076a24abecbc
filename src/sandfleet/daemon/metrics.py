"""Prometheus metrics of one daemon (own registry, so several daemons can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.oom_kills = Counter("sandfleet_oom_kills", "Processes killed by a sandbox memory limit", registry=r)
        self.http_errors = Counter("sandfleet_api_errors", "API errors by wire code", ["code"], registry=r)
        self.daemon_rss = Gauge("sandfleet_daemon_rss_bytes", "Resident memory of the daemon", registry=r)
