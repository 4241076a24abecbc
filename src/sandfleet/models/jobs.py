"""What an operator of a run watches: a job's figures over time, and the alerts.

A job is the sandboxes that carry one value of the node's job label (`job_label`, "job" by default);
its figures are counted by the node as things happen (no per-sandbox series), over the last hour in
buckets, and added up over nodes by a gateway."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sandfleet.errors import Cause
from sandfleet.models.common import _Model

# Fixed reward bins, so that nodes' histograms add up: below 0, ten of [0, 1), exactly 1, above 1.
REWARD_EDGES: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
EXAMPLES = 5  # recent failures a job keeps per cause
BRIEF = 20  # stuck and slowest sandboxes a job lists at most

# Why a create was refused before a sandbox existed: a project's quota, its creates per second, the
# node full, the node draining.
Refusal = Literal["quota", "rate", "capacity", "draining"]


class FailureExample(_Model):
    """One recent failure of a job, to look into."""

    at: float
    cause: Cause
    kind: Literal["exec", "step", "create", "agent", "verify"] = Field(description="what failed")
    sandbox_id: str | None = None
    trajectory_id: str | None = None
    step: int | None = None
    message: str


class RewardBin(_Model):
    lo: float | None = Field(description="None: from minus infinity")
    hi: float | None = Field(description="None: to infinity; a bin holds lo <= r < hi, and the bin [1, 1] only 1")
    count: int


class Rewards(_Model):
    count: int
    mean: float | None
    min: float | None
    max: float | None
    bins: list[RewardBin]


class JobPoint(_Model):
    """One bucket of a job's series: what happened in it, and its sandboxes by state at its end."""

    t: float = Field(description="the bucket's start (seconds since the epoch)")
    created: int = 0
    refused: int = Field(0, description="creates refused before a sandbox existed")
    stopped: int = 0
    failures: dict[str, int] = Field(default_factory=dict, description="by cause")
    oom_kills: int = 0
    verified: int = 0
    passed: int = 0
    steps: int = 0
    replays: int = 0
    execs: int = 0
    states: dict[str, int] = Field(default_factory=dict, description="sandboxes in each state, as last counted")


class SandboxBrief(_Model):
    """A sandbox of a job worth a look: why it is listed, and what it does."""

    id: str
    state: str
    created_at: float
    last_active_at: float
    why: list[str] = Field(default_factory=list, description="what makes it stuck (empty in `slowest`)")
    cpu: float | None = Field(None, description="cores it used over the monitor's last interval")
    memory: int | None = Field(None, description="bytes it held at the monitor's last full read")
    node: str | None = Field(None, description="through a gateway: the node holding it")


class QuotaUse(_Model):
    """A project's live sandboxes, their CPU and memory limits, against its quota (None: no cap)."""

    project: str
    sandboxes: int
    cpu: float
    memory: int
    quota_sandboxes: int | None = None
    quota_cpu: float | None = None
    quota_memory: int | None = None


class JobStats(_Model):
    key: str = Field(description="the job label")
    value: str
    since: float = Field(description="counted since (the node's start, or the job's first event after it)")
    bucket: float = Field(description="seconds each point of `series` covers")
    states: dict[str, int] = Field(description="its sandboxes by state now")
    created: int
    stopped: int
    execs: int = Field(description="commands and steps run")
    steps: int
    replays: int = Field(description="steps asked again and answered from the log (a restarted trainer)")
    oom_kills: int
    failures: dict[str, int] = Field(description="by cause: infra, agent, timeout, verifier, caller")
    examples: list[FailureExample] = Field(description="the latest failures, newest first (a few per cause)")
    refused: dict[Refusal, int] = Field(
        default_factory=dict,
        description="create attempts refused before a sandbox existed, by why: quota (a project's cap), rate (its "
        "creates per second), capacity (no room on the node), draining; each attempt (an SDK or a gateway that tries "
        "again counts each). Not failures: the caller is told and may retry",
    )
    refusals: list[FailureExample] = Field(default_factory=list, description="the latest refusals, newest first")
    verifications: dict[str, int] = Field(description="by outcome: passed, or the cause of the failure")
    pass_rate: float | None
    rewards: Rewards
    findings: dict[str, int] = Field(description="misbehaviour detector findings, by detector")
    cpu: float = Field(description="CPU limits of its live sandboxes (cores)")
    memory: int = Field(description="memory limits of its live sandboxes (bytes)")
    cpu_used: float = Field(description="cores its running sandboxes used over the monitor's last interval")
    memory_used: int = Field(description="bytes its running sandboxes held at the monitor's last reads")
    quotas: list[QuotaUse] = Field(description="the projects its sandboxes are in, against their quotas")
    series: list[JobPoint]
    stuck: list[SandboxBrief] = Field(
        description="no request for `stuck_after` seconds while running, an agent not answering, or detector findings"
    )
    slowest: list[SandboxBrief] = Field(description="the live ones running longest")


Severity = Literal["warning", "critical"]


class Alert(_Model):
    name: Literal[
        "failure_rate",
        "verifier_timeouts",
        "quota_exhausted",
        "pool_empty",
        "detector_findings",
        "stuck_sandboxes",
        "node_lost",
    ]
    severity: Severity
    summary: str
    labels: dict[str, str] = Field(default_factory=dict, description="job, project, cause, pool, detector, node")
    value: float
    threshold: float
    since: float = Field(description="firing since (seconds since the epoch)")


class AlertList(_Model):
    alerts: list[Alert]
    at: float = Field(description="when they were evaluated")
