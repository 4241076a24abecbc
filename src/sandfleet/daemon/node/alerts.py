"""The node's alerts: conditions an operator of a run must hear of, evaluated every few seconds from
the jobs' figures (`JobBook`), the warm pools and the projects' quotas; shown by GET /v1/alerts (and
the console) and exported as `sandfleet_alerts_firing` for Prometheus (docs/grafana/alerts.yml
forwards it, next to rules over the raw counters).

Each alert is named (a closed set: `Alert.name`), has labels saying what it is about (job, project,
cause, pool, detector), the value that made it fire and the threshold, and the time it began firing,
kept while it keeps firing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field

from sandfleet.daemon.node.jobstats import BUCKET, Counts, JobBook, JobKey
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.daemon.node.pool import WarmPools
from sandfleet.daemon.security.iam import exhausted, quota_alert
from sandfleet.errors import Cause
from sandfleet.models import Alert, QuotaUse

log = logging.getLogger(__name__)

NAMES: tuple[str, ...] = get_args(Alert.model_fields["name"].annotation)  # the closed set of alerts


FAILURE_RATIO: dict[Cause, float] = {"infra": 0.05, "timeout": 0.25, "verifier": 0.05, "caller": 0.5}


class AlertsConfig(BaseModel):
    """When the node's alerts fire (`[jobs.alerts]`)."""

    model_config = ConfigDict(extra="forbid")

    window: float = Field(300.0, ge=BUCKET, le=3600, description="seconds of a job's figures an alert looks at")
    failure_ratio: dict[Cause, float] = Field(
        default_factory=lambda: dict(FAILURE_RATIO),
        description="a job's failures of a cause over its commands, creates (failed ones too), steps without a "
        "command and verifications in the window, above which `failure_rate` fires (a cause not named never "
        "fires: agent failures are the policy's)",
    )
    min_runs: int = Field(20, ge=1, description="fewer of those in the window: no rate")
    verifier_timeouts: int = Field(3, ge=1, description="a job's verifications timing out in the window")
    findings: int = Field(1, ge=1, description="a job's detector findings in the window")
    stuck_after: float = Field(900.0, gt=0, description="seconds a running sandbox goes without a request: stuck")
    stuck_sandboxes: int = Field(1, ge=1, description="a job's stuck sandboxes (and agents not answering)")
    pool_empty_after: float = Field(
        30.0, ge=0, description="seconds a configured warm pool stays empty before it fires"
    )


class Alerts:
    def __init__(
        self,
        jobs: JobBook,
        metrics: Metrics,
        config: AlertsConfig,
        pools: Callable[[], WarmPools | None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.jobs = jobs
        self.metrics = metrics
        self.config = config
        self.pools = pools
        self.clock = clock
        # The projects' usage against their quotas (set by the API, which knows the projects).
        self.quotas: Callable[[], list[QuotaUse]] = list
        self.firing: list[Alert] = []
        self.evaluated_at = 0.0
        self._since: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(BUCKET)
            try:
                self.evaluate()
            except Exception:
                log.exception("evaluating the alerts failed")

    def evaluate(self) -> list[Alert]:
        now = self.clock()
        found: list[tuple[str, str, str, dict[str, str], float, float]] = []
        c = self.config
        for key, counts in self.jobs.recent(c.window).items():
            labels = _job_labels(self.jobs.label, key)
            runs = counts["runs"]  # commands, creates (failed ones too), steps without a command, verifications
            for cause, ratio in c.failure_ratio.items():
                failed = counts[f"failure:{cause}"]
                if runs >= c.min_runs and failed / runs > ratio:
                    what = f"{failed} of {runs} commands, creates, steps and verifications failed by {cause}"
                    found.append(("failure_rate", "critical", what, {**labels, "cause": cause}, failed / runs, ratio))
            if (n := counts["verify:timeout"]) >= c.verifier_timeouts:
                what = f"{n} verifications timed out in the last {c.window:g} s"
                found.append(("verifier_timeouts", "warning", what, labels, n, c.verifier_timeouts))
            for detector, n in _by(counts, "finding:").items():
                if n >= c.findings:
                    what = f"detector {detector} fired {n} times in the last {c.window:g} s"
                    on = {**labels, "detector": detector}
                    found.append(("detector_findings", "warning", what, on, n, c.findings))
        for key, n in self.jobs.stuck_by_job(c.stuck_after).items():
            if n >= c.stuck_sandboxes:
                what = f"{n} sandboxes stuck (no request for {c.stuck_after:g} s, an agent not answering, findings)"
                on = _job_labels(self.jobs.label, key)
                found.append(("stuck_sandboxes", "warning", what, on, n, c.stuck_sandboxes))
        for q in self.quotas():  # (through a gateway, the cluster's: see cluster/fan_out.py)
            for dim, used, cap in exhausted(q):
                a = quota_alert(q, dim, used, cap, now)
                found.append((a.name, a.severity, a.summary, a.labels, used, cap))
        pools = self.pools()
        for pool in pools.empty() if pools is not None else []:
            found.append(("pool_empty", "warning", f"warm pool {pool} has no sandbox ready", {"pool": pool}, 0, 1))

        since: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        alerts = []
        for name, severity, summary, labels, value, threshold in found:
            ident = (name, tuple(sorted(labels.items())))
            began = since[ident] = self._since.get(ident, now)
            if name == "pool_empty" and now - began < c.pool_empty_after:
                continue  # a burst empties a pool for a moment; one that stays empty is the alert
            alerts.append(
                Alert(
                    name=name,
                    severity=severity,
                    summary=summary,
                    labels=labels,
                    value=value,
                    threshold=threshold,
                    since=began,
                )
            )
        self._since = since
        self.firing, self.evaluated_at = alerts, now
        firing: dict[tuple[str, str], int] = {(n, s): 0 for n in NAMES for s in ("warning", "critical")}
        for a in alerts:
            firing[(a.name, a.severity)] += 1
        for (name, severity), n in firing.items():
            self.metrics.alerts_firing.labels(name=name, severity=severity).set(n)
        return alerts

    def visible(self, sees: Callable[[str | None], bool], root: bool) -> list[Alert]:
        """The alerts the caller may see: those of its projects; the node's own (pools) the root only.
        Evaluated again first when the last evaluation is older than a bucket (the loop's first)."""
        if self.clock() - self.evaluated_at > BUCKET:
            self.evaluate()
        out = []
        for a in self.firing:
            project = a.labels.get("project")
            if root or (project is not None and sees(project or None)):
                out.append(a)
        return out


def _job_labels(label: str, key: JobKey) -> dict[str, str]:
    project, value = key
    out = {"job": value if value is not None else "", "label": label}
    if project:
        out["project"] = project
    return out


def _by(counts: Counts, prefix: str) -> dict[str, Any]:
    return {k[len(prefix) :]: n for k, n in counts.items() if k.startswith(prefix) and n}
