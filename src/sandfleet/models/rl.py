"""RL: trajectories (exactly-once steps) and verification apart from the agent."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from sandfleet.errors import Cause
from sandfleet.models.common import (
    MAX_REF,
    MAX_SECONDS,
    AbsPath,
    Encoding,
    EnvVars,
    ErrorBody,
    Labels,
    SandboxPath,
    _Model,
)
from sandfleet.models.execs import ExecRequest, ExecResult
from sandfleet.models.files import FileInfo
from sandfleet.models.sandboxes import Resources, SandboxSpec, check_layers

MAX_STEPS = 100_000


MAX_STEP_FILE = 16 * 1024**2


TRAJECTORY_ID = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,116}$"  # "trajectory:" + it is an idempotency key


TrajectoryId = Annotated[str, Field(pattern=TRAJECTORY_ID, description="the rollout's id, chosen by the caller")]


class TrajectoryOpen(_Model):
    """Open a rollout's trajectory, or open it again: the same id and arguments give back the same
    trajectory (and the same sandbox) however often a restarted trainer asks. Exactly one of `spec`
    (a new sandbox), `snapshot_id` (a new sandbox restored from a set-up state) or `sandbox_id`
    (one that exists) says where its steps run."""

    id: TrajectoryId
    spec: SandboxSpec | None = None
    snapshot_id: str | None = Field(None, max_length=64)
    sandbox_id: str | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, lt=2**63, description="given to the sandbox as SANDFLEET_SEED; recorded")
    labels: Labels = Field(default_factory=dict, description="the trajectory's labels (its sandbox gets them too)")
    metadata: Labels = Field(default_factory=dict, description="free-form: the task, the policy version, ...")

    @model_validator(mode="after")
    def _one_place(self) -> TrajectoryOpen:
        given = [n for n in ("spec", "snapshot_id", "sandbox_id") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of spec, snapshot_id or sandbox_id")
        if self.spec is not None and self.spec.backend == "fncall":
            raise ValueError("a trajectory needs a stateful sandbox: the fncall tier has none")
        return self


class ExecAction(_Model):
    kind: Literal["exec"] = "exec"
    exec: ExecRequest

    @model_validator(mode="after")
    def _foreground(self) -> ExecAction:
        if self.exec.background or self.exec.keep_stdin_open:
            raise ValueError("a step's command runs to its end: no background, no open stdin")
        return self


class WriteAction(_Model):
    kind: Literal["write"] = "write"
    path: SandboxPath
    content: str = Field(max_length=MAX_STEP_FILE * 4 // 3 + 4, description="text, or base64 with encoding=base64")
    encoding: Encoding = "utf-8"
    mode: int = Field(0o644, ge=0, le=0o7777)


class ReadAction(_Model):
    kind: Literal["read"] = "read"
    path: SandboxPath
    encoding: Encoding = "utf-8"
    limit: int = Field(MAX_STEP_FILE, ge=0, le=MAX_STEP_FILE, description="bytes read at most")


class SnapshotAction(_Model):
    kind: Literal["snapshot"] = "snapshot"
    ttl: float | None = Field(None, gt=0, le=MAX_SECONDS)
    labels: Labels = Field(default_factory=dict)


class CheckpointAction(_Model):
    """Record the sandbox's state, to roll back to by a later step (the result's `checkpoint_id`)."""

    kind: Literal["checkpoint"] = "checkpoint"
    labels: Labels = Field(default_factory=dict)


class RollbackAction(_Model):
    """Put the sandbox back to a checkpoint an earlier step took, in place."""

    kind: Literal["rollback"] = "rollback"
    checkpoint_id: str = Field(max_length=MAX_REF)


StepAction = Annotated[
    ExecAction | WriteAction | ReadAction | SnapshotAction | CheckpointAction | RollbackAction,
    Field(discriminator="kind"),
]


class StepRequest(_Model):
    """Step `step` (0, 1, 2, ...) of a trajectory. Taken once: asked again (a restarted trainer
    replaying its rollout) it answers the recorded result without running anything; while it runs,
    a second ask waits for the first's result. The action must be the one recorded for that step."""

    step: int = Field(ge=0, lt=MAX_STEPS)
    action: StepAction


class StepResult(_Model):
    trajectory_id: str
    step: int
    kind: Literal["exec", "write", "read", "snapshot", "checkpoint", "rollback"]
    replayed: bool = Field(description="the recorded result of an earlier ask: nothing ran now")
    exec: ExecResult | None = None
    content: str | None = Field(None, description="read: the file's bytes as text or base64 (per the action)")
    encoding: Encoding = "utf-8"
    file: FileInfo | None = None
    snapshot_id: str | None = None
    checkpoint_id: str | None = Field(None, description="checkpoint: the one taken; rollback: the one gone back to")
    error: ErrorBody | None = Field(None, description="the step's error (recorded like any result)")
    cause: Cause | None = Field(None, description="whose fault a failure was (the error's, or the command's)")
    started_at: float
    duration: float


class StepList(_Model):
    steps: list[StepResult]


class ChangedFile(_Model):
    path: str
    change: Literal["added", "modified", "deleted"]
    type: Literal["file", "dir", "symlink", "other"]


class VerifyRequest(_Model):
    """Run a task's checks in a fresh sandbox: the agent sandbox's pre-agent state (its image and
    layers), plus only the agent's changes (its writable layer, as one layer), plus `layers` that
    only verifiers ever see (hidden tests), on top; the agent's sandbox is untouched."""

    command: str | list[str] = Field(description="the checks; exit 0 passes")
    layers: Annotated[list[str], AfterValidator(check_layers)] = Field(
        default_factory=list,
        max_length=16,
        description="verifier-only layers on top (image refs or 'sha256:' digests): never in the agent's sandbox",
    )
    protect: list[AbsPath] = Field(
        default_factory=list,
        max_length=64,
        description="paths whose changes by the agent are dropped (visible tests, the grader): the checks see "
        "them as before the agent ran",
    )
    allow: list[AbsPath] | None = Field(
        None,
        min_length=1,
        max_length=64,
        description="keep only the agent's changes under these paths (the code it was asked to change); "
        "everything else it changed (a conftest.py, a .pth file, a binary on PATH) is dropped and listed in "
        "`dropped`. `protect` still applies below them",
    )
    cwd: SandboxPath | None = None
    env: EnvVars = Field(default_factory=dict)
    timeout: float = Field(600.0, gt=0, le=86400, description="seconds the checks may run (wall clock)")
    cpu_time: float | None = Field(
        None, gt=0, le=86400, description="CPU seconds the checks may use (see ExecRequest.cpu_time)"
    )
    queue_timeout: float = Field(
        3600.0,
        ge=0,
        le=86400,
        description="seconds the verification may wait for room on the node (the verification queue, then "
        "admission of its sandbox) before its checks start; not part of `timeout`",
    )
    resources: Resources | None = Field(None, description="default: the agent sandbox's")
    reward_file: SandboxPath | None = Field(
        None, description="a file the checks write a number into: the reward (default: 1.0 if they pass, else 0.0)"
    )
    agent_exit_codes: list[Annotated[int, Field(ge=0, le=255)]] = Field(
        default_factory=lambda: [1, 2],
        max_length=32,
        description="exit codes meaning the agent's work failed the checks (cause agent); any other failure is "
        "the verifier's unless the agent's code crashed or ran out of memory (pytest: 1 = tests failed, "
        "2 = a collection error, e.g. the agent's code does not import; 3-5 = the checker itself broke)",
    )
    output_limit: int = Field(256 * 1024, ge=0, le=64 * 1024**2)
    keep: bool = Field(False, description="keep the verifier's sandbox (to look into a failure)")

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        return ExecRequest(command=v).command


class VerifyResult(_Model):
    passed: bool
    reward: float
    cause: Cause | None = Field(description="None when the checks passed; agent, timeout, verifier or infra")
    result: ExecResult | None = Field(None, description="the checks' command (None when it could not run)")
    error: ErrorBody | None = None
    changed: list[ChangedFile] = Field(description="what the agent changed (protected paths included)")
    dropped: list[str] = Field(default_factory=list, description="changed paths dropped: protected, or outside `allow`")
    queued: float = Field(0.0, description="seconds spent waiting for room on the node (not part of `timeout`)")
    changes_layer: str | None = Field(None, description="digest of the layer holding the agent's changes")
    verifier_sandbox_id: str | None = None
    replayed: bool = False
    duration: float


class TrajectoryInfo(_Model):
    id: str
    sandbox_id: str | None
    state: Literal["open", "closed"]
    steps: int = Field(description="steps recorded")
    seed: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, str] = Field(default_factory=dict)
    source_snapshot: str | None = None
    created_at: float
    closed_at: float | None = None
    reward: float | None = None
    verification: VerifyResult | None = None
    failures: dict[str, int] = Field(default_factory=dict, description="failed steps by cause")
    lost_from: int | None = Field(
        None,
        description="its log is damaged from this step on: that step and every later one answer data_loss and "
        "never run (the steps before it replay as logged)",
    )


class TrajectoryList(_Model):
    trajectories: list[TrajectoryInfo]
    total: int | None = Field(None, description="with `limit`: how many match in all (the newest `limit` given)")


class TrajectoryClose(_Model):
    reward: float | None = Field(None, description="recorded with the trajectory (default: its verification's)")
    stop_sandbox: bool = True


class NodeVersions(_Model):
    sandfleet: str
    agent: str
    kernel: str
    backend: str


class ReproRecord(_Model):
    """Enough to run a trajectory again: what its sandbox was made of and from, what was done in it,
    with which seed, on which software."""

    trajectory: TrajectoryInfo
    spec: SandboxSpec | None = Field(description="the sandbox's spec as created (its seed in env)")
    image: str | None
    layers: list[str] = Field(description="layer digests, bottom -> top")
    source_snapshot: str | None
    snapshots: list[str] = Field(description="snapshots its steps took")
    actions: list[dict[str, Any]] = Field(description="each step's action, in order, as asked")
    node: NodeVersions
