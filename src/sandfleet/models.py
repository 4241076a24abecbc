"""Value objects shared by the SDK, the HTTP API and the daemon (pydantic, I/O free)."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Parse `"1GiB"`, `"512M"`, `4096` into bytes."""
    if isinstance(value, bool):
        raise ValueError("size must be a number of bytes or a string like '1GiB'")
    if isinstance(value, int):
        size = value
    elif isinstance(value, float):
        size = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot parse size {value!r} (use e.g. '512MiB', '1GiB', 1048576)")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"cannot parse size {value!r}")
    if size < 0:
        raise ValueError("size must not be negative")
    return size


MAX_BYTES = 2**40  # 1 TiB: far above any node, far below what overflows a kernel interface
# One schema for requests and responses: bytes, or a size string such as "4GiB" on input.
ByteSize = Annotated[
    int,
    BeforeValidator(parse_size),
    WithJsonSchema(
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_BYTES}, {"type": "string", "examples": ["4GiB"]}]}
    ),
]

_LABEL_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_HOSTNAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]*\$?$|^[0-9]+$")

Backend = Literal["fncall", "container", "microvm", "vm"]
QoS = Literal["latency_sensitive", "best_effort"]
SandboxState = Literal["creating", "running", "paused", "stopping", "stopped", "failed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def check_env(env: dict[str, str]) -> dict[str, str]:
    for key, value in env.items():
        if not _ENV_KEY_RE.match(key):
            raise ValueError(f"invalid environment variable name {key!r}")
        if "\0" in value:
            raise ValueError(f"environment variable {key} contains a NUL byte")
    return env


def check_user(user: str) -> str:
    """A user name (as in /etc/passwd) or a numeric uid."""
    if not _USER_RE.match(user):
        raise ValueError(f"invalid user {user!r}")
    return user


def check_abs_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path:
        raise ValueError(f"path must be absolute and contain no NUL byte: {path!r}")
    return path


# Field types that carry these checks, for every model (here, recipes, imports) that takes such values.
EnvVars = Annotated[dict[str, str], AfterValidator(check_env)]
AbsPath = Annotated[str, AfterValidator(check_abs_path)]
UserName = Annotated[str, AfterValidator(check_user)]


DEFAULT_CPU_REQUEST = 0.1


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
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


class SandboxSpec(_Model):
    """Everything needed to create a sandbox."""

    backend: Backend = "container"
    image: str | None = Field(
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
    labels: dict[str, str] = Field(default_factory=dict)
    idle_ttl: float | None = Field(600.0, gt=0, description="stop after this many idle seconds")
    max_lifetime: float | None = Field(None, gt=0, description="stop this many seconds after creation")
    qos: QoS = Field(
        "latency_sensitive",
        description="latency_sensitive: normal scheduling (and its own core-scheduling cookie on SMT hosts); "
        "best_effort: SCHED_IDLE and the lowest CPU weight, so it only gets CPU nobody else wants",
    )
    pause_after: float | None = Field(
        None, gt=0, description="pause (freeze, push memory out) after this many idle seconds; any request resumes"
    )
    network: Literal["none"] = Field("none", description="network policy; 'none' = loopback only")
    mounts: list[Mount] = Field(default_factory=list, max_length=16)

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not _IMAGE_REF_RE.match(v):
            raise ValueError(f"invalid image reference {v!r}")
        return v

    @field_validator("layers")
    @classmethod
    def _layers(cls, v: list[str]) -> list[str]:
        for ref in v:
            is_digest = ref.startswith("sha256:")
            if not (_DIGEST_RE.match(ref) if is_digest else _IMAGE_REF_RE.match(ref)):
                raise ValueError(f"invalid layer {ref!r}: expected name[:tag] or sha256:<64 hex>")
        return v

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
            raise ValueError(f"invalid hostname {v!r}")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        for key, value in v.items():
            if not _LABEL_KEY_RE.match(key) or len(value) > 256:
                raise ValueError(f"invalid label {key!r}={value!r}")
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


class ExecRequest(_Model):
    command: str | list[str] = Field(description="a shell string (run by /bin/sh -c) or an argv list")
    env: EnvVars = Field(default_factory=dict)
    cwd: AbsPath | None = None
    user: str | None = None
    stdin: str | None = Field(None, description="text fed to the command's standard input")
    timeout: float | None = Field(60.0, gt=0, le=86400, description="seconds; kills the process tree")
    output_limit: int = Field(1024**2, ge=0, le=64 * 1024**2, description="bytes kept per stream")
    background: bool = False

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("command must not be empty")
        if not v:
            raise ValueError("command must not be empty")
        items = [v] if isinstance(v, str) else v
        if any("\0" in item for item in items):
            raise ValueError("command contains a NUL byte")
        return v


class ExecResult(_Model):
    exit_code: int
    stdout: str
    stderr: str
    duration: float = Field(description="seconds from start to exit")
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: int | None = None

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class ExecEvent(_Model):
    """One line of a streamed exec: output chunks, then exactly one `exit` carrying the result."""

    type: Literal["stdout", "stderr", "exit"]
    data: str = ""
    result: ExecResult | None = None


class ProcessInfo(_Model):
    """A background process started with `background=True`."""

    id: str
    command: str | list[str]
    running: bool
    started_at: float
    result: ExecResult | None = None


class SessionInfo(_Model):
    id: str
    shell: str
    created_at: float


class SessionRunRequest(_Model):
    command: str
    timeout: float | None = Field(60.0, gt=0, le=86400)
    output_limit: int = Field(1024**2, ge=0, le=64 * 1024**2)


class SessionCreateRequest(_Model):
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None
    user: str | None = None


class FileInfo(_Model):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    link_target: str | None = None


class SandboxEvent(_Model):
    seq: int
    sandbox_id: str
    time: float
    kind: str
    data: dict[str, Any] = Field(default_factory=dict)


class ImageInfo(_Model):
    name: str
    tag: str
    layers: list[str]
    size: int = Field(description="bytes of the layer files (for on-demand layers: metadata plus data blobs)")
    created: float
    on_demand: bool = Field(False, description="its file data is read on demand from the shared store")


class ImportRequest(_Model):
    path: str = Field(description="a `docker save` tarball, an OCI image layout directory or its tar (daemon's host)")
    ref: str | None = Field(None, description="name:tag for the image; default: the archive's own tag")


class StopRequest(_Model):
    reason: str = "user"


class ErrorBody(_Model):
    code: Literal[
        "invalid_argument",
        "not_found",
        "wrong_state",
        "resource_exhausted",
        "timeout",
        "unauthenticated",
        "permission_denied",
        "unavailable",
        "data_loss",
        "internal",
    ]
    message: str
    retryable: bool


class ErrorResponse(_Model):
    error: ErrorBody


class SandboxList(_Model):
    sandboxes: list[SandboxInfo]


MAX_BATCH = 256


class CreateBatchRequest(_Model):
    """Create many sandboxes in one request: one HTTP round trip instead of one per sandbox."""

    specs: list[SandboxSpec] = Field(min_length=1, max_length=MAX_BATCH)
    concurrency: int = Field(16, ge=1, le=64, description="creates the daemon runs at once for this batch")


class CreateBatchItem(_Model):
    """Exactly one of `sandbox` (created) or `error` (why not), for the spec at the same index."""

    sandbox: SandboxInfo | None = None
    error: ErrorBody | None = None


class CreateBatchResult(_Model):
    results: list[CreateBatchItem]


class StopManyRequest(_Model):
    labels: dict[str, str]
    reason: str = "user"


class StopManyResult(_Model):
    stopped: list[str]


class LabelsRequest(_Model):
    labels: dict[str, str] = Field(min_length=1, description="sandboxes carrying all of these labels")


class IdList(_Model):
    sandboxes: list[str]


class FileList(_Model):
    files: list[FileInfo]


class EventList(_Model):
    events: list[SandboxEvent]


class ProcessList(_Model):
    processes: list[ProcessInfo]


class SessionList(_Model):
    sessions: list[SessionInfo]


class ImageList(_Model):
    images: list[ImageInfo]


class Health(_Model):
    status: str
    version: str
    sandboxes_running: int
    backends: list[str]
    pools: dict[str, int] = Field(default_factory=dict, description="ready sandboxes per warm pool")


class Ok(_Model):
    ok: bool = True


MAX_FORK = 64


class SnapshotInfo(_Model):
    """A checkpoint of a running sandbox: its processes with their memory, and its writable layer."""

    id: str
    sandbox_id: str = Field(description="the sandbox it was taken from; the snapshot is deleted with it")
    created_at: float
    size_bytes: int = Field(description="bytes on the node's disk (memory images + writable layer)")
    seconds: float = Field(description="how long taking it took (the sandbox is frozen meanwhile)")


class SnapshotList(_Model):
    snapshots: list[SnapshotInfo]


class ForkRequest(_Model):
    """New sandboxes from one snapshot (restore) or one live sandbox (fork), each on its own."""

    count: int = Field(1, ge=1, le=MAX_FORK, description="how many sandboxes to start")
    labels: dict[str, str] = Field(
        default_factory=dict, description="labels of the new sandboxes (added to the source's labels)"
    )


class PackRequest(_Model):
    """Turn a live sandbox's changes into a new image: its layers plus one layer of what it changed."""

    image: str = Field(description="name:tag of the new image (replaced if it exists)")
    exclude: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="absolute paths whose changes are left out (caches, shell history, answer files)",
    )


class GcResult(_Model):
    removed: list[str] = Field(description="digests of the layer files deleted")
    bytes: int = Field(description="disk freed")
