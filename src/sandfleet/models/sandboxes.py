"""A sandbox: its spec (resources, mounts, tier options, image and layers), what it is, lifetimes,
batches and job-level calls."""

from __future__ import annotations

import bisect
import posixpath
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import AfterValidator, Field, field_validator, model_validator

from sandfleet.models.common import (
    _HOSTNAME_RE,
    DEFAULT_CPU_REQUEST,
    MAX_BYTES,
    MAX_REF,
    MAX_SECONDS,
    AbsPath,
    Backend,
    ByteSize,
    EnvVars,
    ErrorBody,
    IdempotencyKey,
    Labels,
    ProjectPath,
    QoS,
    SandboxState,
    UserName,
    _Model,
    shown,
)
from sandfleet.models.network import NetworkPolicy


class Resources(_Model):
    """What a sandbox may use. `Resources(cpu=2, memory="4GiB")`."""

    cpu: float = Field(1.0, gt=0, le=256, description="CPU cores (CFS quota); fractions allowed")
    cpu_request: float | None = Field(
        None,
        ge=0,
        le=256,
        description="CPU cores the node counts for admission (requests are overcommitted by the daemon's "
        "cpu_overcommit); default min(cpu, 0.1): agent sandboxes mostly wait",
    )
    memory: ByteSize = Field(1024**3, le=MAX_BYTES, description="memory limit in bytes or '4GiB' (no swap beyond it)")
    pids: int = Field(512, ge=8, le=32768, description="maximum number of tasks (fork-bomb cap)")
    disk: ByteSize = Field(1024**3, le=MAX_BYTES, description="size limit of the writable layer in bytes or '10GiB'")

    @field_validator("memory")
    @classmethod
    def _min_memory(cls, v: int) -> int:
        if v < 16 * 1024**2:
            raise ValueError("memory must be at least 16MiB")
        return v

    @field_validator("disk")
    @classmethod
    def _min_disk(cls, v: int) -> int:
        if v < 1024**2:
            raise ValueError("disk must be at least 1MiB")
        return v

    @model_validator(mode="after")
    def _request_within_limit(self) -> Resources:
        if self.cpu_request is not None and self.cpu_request > self.cpu:
            raise ValueError("cpu_request cannot exceed cpu (the limit)")
        return self

    @property
    def requested_cpu(self) -> float:
        return self.cpu_request if self.cpu_request is not None else min(self.cpu, DEFAULT_CPU_REQUEST)


RESERVED_TARGETS = ("/proc", "/sys", "/dev")  # the sandbox's own, set up after the binds


class Mount(_Model):
    """A host path bind-mounted into the sandbox; the daemon only allows paths under its allowlist."""

    source: AbsPath = Field(description="absolute host path, under the daemon's `mount_allowlist`")
    target: AbsPath = Field(description="absolute path inside the sandbox")
    read_only: bool = True

    @field_validator("target")
    @classmethod
    def _target(cls, v: str) -> str:
        norm = posixpath.normpath(v)
        if norm == "/" or any(norm == d or norm.startswith(d + "/") for d in RESERVED_TARGETS):
            raise ValueError(f"mount target {v!r} may not be /, or at or under {', '.join(RESERVED_TARGETS)}")
        return v


_IMAGE_REF_RE = re.compile(r"^[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9._-]+)?$")


def check_image_ref(v: str) -> str:
    if len(v) > MAX_REF or not _IMAGE_REF_RE.match(v):
        raise ValueError(f"invalid image reference {shown(v)}")
    return v


ImageRef = Annotated[str, AfterValidator(check_image_ref)]


_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class ContainerOptions(_Model):
    """Options only the container tier has (`SandboxSpec.options`, with `type` = "container")."""

    type: Literal["container"] = "container"
    nofile: int | None = Field(
        None,
        ge=64,
        le=1 << 20,
        description="hard limit on the files each process may hold open (RLIMIT_NOFILE); never above what "
        "the node allows a sandbox of its pids limit (at most 4096)",
    )

    def model_post_init(self, context: Any, /) -> None:
        # The tag always goes on the wire, even where unset fields are left out (the SDK's specs).
        self.__pydantic_fields_set__.add("type")


class VMOptions(_Model):
    """Options only the vm tier has (`SandboxSpec.options`, with `type` = "vm")."""

    type: Literal["vm"] = "vm"
    init: bool = Field(
        False,
        description="boot the image's own init (/sbin/init, e.g. systemd) as the guest's PID 1; otherwise sandfleet's "
        "init stays PID 1 and only the agent runs",
    )

    def model_post_init(self, context: Any, /) -> None:
        self.__pydantic_fields_set__.add("type")


# One model per tier, told apart by `type`.
TierOptions = Annotated[Union[ContainerOptions, VMOptions], Field(discriminator="type")]  # noqa: UP007


def check_layers(v: list[str]) -> list[str]:
    """Layer entries: image refs or `sha256:` digests."""
    for ref in v:
        is_digest = ref.startswith("sha256:")
        if len(ref) > MAX_REF or not (_DIGEST_RE.match(ref) if is_digest else _IMAGE_REF_RE.match(ref)):
            raise ValueError(f"invalid layer {shown(ref)}: expected name[:tag] or sha256:<64 hex>")
    return v


class SandboxSpec(_Model):
    """Everything needed to create a sandbox."""

    backend: Backend = "container"
    image: ImageRef | None = Field(
        None,
        description="image reference, e.g. 'busybox', 'debian:bookworm'; the bottom of the layer stack. "
        "Default 'busybox' unless `layers` is given",
    )
    layers: list[str] = Field(
        default_factory=list,
        max_length=32,
        description="layers stacked on top of `image` at create time, bottom -> top: image refs "
        "('toolkit/harness:3.1', each contributes its whole stack) or layer digests ('sha256:...'); "
        "an upper layer's files (and whiteouts) win over a lower one's",
    )
    resources: Resources = Field(default_factory=Resources)
    env: EnvVars = Field(default_factory=dict)
    workdir: AbsPath = "/"
    user: UserName = Field("root", description="default user for commands: a name or a numeric uid")
    hostname: str | None = None
    labels: Labels = Field(default_factory=dict)
    project: ProjectPath | None = Field(
        None,
        description="the project ('org/team/job') the sandbox belongs to and is counted against: its quotas, "
        "and which tokens see it. Default: the calling token's project (none on a node without projects)",
    )
    node_selector: Labels = Field(
        default_factory=dict,
        description="labels the node must carry (its `node_labels`): a cluster places the sandbox only on such "
        "a node, and a node without them refuses it",
    )
    idle_ttl: float | None = Field(600.0, gt=0, le=MAX_SECONDS, description="stop after this many idle seconds")
    max_lifetime: float | None = Field(None, gt=0, le=MAX_SECONDS, description="stop this many seconds after creation")
    qos: QoS = Field(
        "latency_sensitive",
        description="latency_sensitive: normal scheduling (and its own core-scheduling cookie on SMT hosts); "
        "best_effort: SCHED_IDLE and the lowest CPU weight, so it only gets CPU nobody else wants",
    )
    pause_after: float | None = Field(
        None,
        gt=0,
        le=MAX_SECONDS,
        description="pause (freeze, push memory out) after this many idle seconds; any request resumes",
    )
    network: NetworkPolicy = Field(
        default_factory=lambda: NetworkPolicy(),
        description="egress policy: 'none' (the default: loopback only), or the services and host[:port] "
        "patterns the sandbox may reach through the node's egress proxy",
    )
    mounts: list[Mount] = Field(default_factory=list, max_length=16)
    options: TierOptions | None = Field(
        None, description="options of the sandbox's own tier; their `type` must be its `backend`"
    )

    @model_validator(mode="after")
    def _options_of_its_tier(self) -> SandboxSpec:
        if self.options is not None and self.options.type != self.backend:
            raise ValueError(f"options are for the {self.options.type} tier, the sandbox's is {self.backend}")
        return self

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[str]) -> list[str]:
        return check_layers(v)

    @model_validator(mode="before")
    @classmethod
    def _default_image(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("image") is None and not data.get("layers"):
            return {**data, "image": "busybox"}
        return data

    def environment(self) -> str:
        """The layer stack this spec asks for, as one string (pools and metrics key on it)."""
        return "+".join([self.image or "", *self.layers]) if self.layers else self.image or ""

    @field_validator("hostname")
    @classmethod
    def _hostname(cls, v: str | None) -> str | None:
        if v is not None and not _HOSTNAME_RE.match(v):
            raise ValueError(f"invalid hostname {shown(v)}")
        return v


class SandboxInfo(_Model):
    id: str
    state: SandboxState
    spec: SandboxSpec
    created_at: float
    last_active_at: float
    stopped_at: float | None = None
    stop_reason: str | None = None


class Usage(_Model):
    """What a sandbox uses now, from its cgroup."""

    memory_bytes: int
    memory_peak_bytes: int
    cpu_seconds: float = Field(description="CPU time used since creation (all its processes)")
    pids: int
    oom_kills: int
    pids_limit_hits: int


class WhoAmI(_Model):
    """The caller as the node (or gateway) sees its credentials."""

    name: str
    can_write: bool = Field(description="false for a read-only token: only GET calls are allowed")
    project: str | None = None


class LifetimeUpdate(_Model):
    """New lifetimes of live sandboxes; a field left out is kept, `null` removes that limit."""

    idle_ttl: float | None = Field(None, gt=0, le=MAX_SECONDS)
    max_lifetime: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds after creation (not after this call)"
    )
    pause_after: float | None = Field(None, gt=0, le=MAX_SECONDS, description="idle seconds before a pause")

    def changes(self) -> dict[str, float | None]:
        """The limits this update sets (None: removed)."""
        return {k: getattr(self, k) for k in ("idle_ttl", "max_lifetime", "pause_after") if k in self.model_fields_set}


class SetLabelsRequest(_Model):
    """A sandbox's labels from now on: all of them (a label left out is removed)."""

    labels: Labels


class LifetimeManyRequest(LifetimeUpdate):
    labels: Labels = Field(description="sandboxes carrying all of these labels")

    @field_validator("labels")
    @classmethod
    def _some(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("give at least one label")
        return v


class SandboxEvent(_Model):
    seq: int
    sandbox_id: str
    time: float
    kind: str
    data: dict[str, Any] = Field(default_factory=dict)


class StopRequest(_Model):
    reason: str = Field("user", max_length=256)


class SandboxList(_Model):
    sandboxes: list[SandboxInfo]
    next: str | None = Field(None, description="with `limit`: the cursor of the next page (`after`), null on the last")
    total: int | None = Field(None, description="with `limit`: how many sandboxes match in all")


T = TypeVar("T")


class JobGroup(_Model):
    value: str | None = Field(description="the label's value; null: sandboxes without that label")
    count: int
    states: dict[str, int] = Field(description="how many in each state")
    # Counted by the node as things happen, for the values of its job label only (`counted`).
    failures: int | None = Field(None, description="failures of every cause (since the node began counting the job)")
    verified: int | None = Field(None, description="verifications counted")
    passed: int | None = Field(None, description="of which passed")
    steps: int | None = Field(None, description="trajectory steps counted")


class JobList(_Model):
    """Sandboxes grouped by one label's value (a job, a team, ...): counts, never the sandboxes."""

    key: str
    counted: bool = Field(False, description="`key` is the node's job label: the groups carry its figures")
    jobs: list[JobGroup]
    total: int


def list_page(
    items: Sequence[T], limit: int, after: str | None, stamp: Callable[[T], tuple[float, str]]
) -> tuple[list[T], str | None, int]:
    """One page of a sandbox list, newest first (`stamp`: an item's created_at and id); the cursor of
    the next is `<created_at>:<id>` of the last one given (still good when that one is gone); also how
    many there are in all. ValueError for a cursor no list gave."""

    def key(item: T) -> tuple[float, str]:
        created, ident = stamp(item)
        return (-created, ident)

    order = sorted(items, key=key)
    start = 0
    if after:
        created, _, last = after.partition(":")
        try:
            start = bisect.bisect_right(order, (-float(created), last), key=key)
        except ValueError:
            raise ValueError(f"after: {shown(after)} is not a cursor a list gave") from None
    page = order[start : start + limit]
    more = start + limit < len(order) and bool(page)
    return page, f"{stamp(page[-1])[0]!r}:{stamp(page[-1])[1]}" if more else None, len(order)


MAX_BATCH = 256


class CreateBatchRequest(_Model):
    """Create many sandboxes in one request: one HTTP round trip instead of one per sandbox."""

    specs: list[SandboxSpec] = Field(min_length=1, max_length=MAX_BATCH)
    concurrency: int = Field(16, ge=1, le=64, description="creates the daemon runs at once for this batch")
    idempotency_keys: list[IdempotencyKey | None] | None = Field(
        None,
        max_length=MAX_BATCH,
        description="one per spec (or null): a retried batch returns the sandbox each key already made",
    )

    @model_validator(mode="after")
    def _keys_match(self) -> CreateBatchRequest:
        if self.idempotency_keys is not None and len(self.idempotency_keys) != len(self.specs):
            raise ValueError("idempotency_keys must have one entry per spec")
        return self


class CreateBatchItem(_Model):
    """Exactly one of `sandbox` (created) or `error` (why not), for the spec at the same index."""

    sandbox: SandboxInfo | None = None
    error: ErrorBody | None = None


class CreateBatchResult(_Model):
    results: list[CreateBatchItem]


class StopManyRequest(_Model):
    labels: Labels
    reason: str = Field("user", max_length=256)


class StopManyResult(_Model):
    stopped: list[str]


class LabelsRequest(_Model):
    labels: Labels = Field(min_length=1, description="sandboxes carrying all of these labels")


class IdList(_Model):
    sandboxes: list[str]


class EventList(_Model):
    events: list[SandboxEvent]
