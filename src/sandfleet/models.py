"""Value objects shared by the SDK, the HTTP API and the daemon (pydantic, I/O free)."""

from __future__ import annotations

import base64
import bisect
import ipaddress
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar, Union

import pydantic
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from sandfleet.errors import Cause

_BYTES = TypeAdapter(pydantic.ByteSize)  # "512MiB", "1 GB", "4k", 4096: decimal and binary units


def parse_size(value: object) -> int:
    """Bytes from `"1GiB"`, `"512M"` or `4096` (pydantic's ByteSize parses the strings); a bool
    or a negative number is refused rather than read as 1, 0 or a huge size."""
    if isinstance(value, bool):
        raise ValueError("size must be a number of bytes or a string like '1GiB'")
    if isinstance(value, int | float) and value < 0:
        raise ValueError("size must not be negative")
    try:
        return int(_BYTES.validate_python(value))
    except ValidationError:
        raise ValueError(f"cannot parse size {str(value)[:40]!r} (use e.g. '512MiB', '1GiB', 1048576)") from None


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
LABEL_KEY = _LABEL_KEY_RE  # what a label key may be
_HOSTNAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9-]{0,61}[a-zA-Z0-9])?$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER_RE = re.compile(r"^[a-z_][a-z0-9_-]*\$?$|^[0-9]+$")

Backend = Literal["fncall", "container", "microvm", "vm"]
QoS = Literal["latency_sensitive", "best_effort"]
SandboxState = Literal["creating", "running", "paused", "stopping", "stopped", "failed"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Bounds on what one request may carry: an error message never echoes more than SHOWN characters of
# an input, and every string a sandbox keeps (env, labels, paths) has a size the node can afford.
SHOWN = 80
MAX_PATH = 4096
MAX_ENV_VALUE = 16 * 1024
MAX_ENV_TOTAL = 32 * 1024
MAX_ENV_VARS = 256
MAX_LABELS = 64
MAX_LABEL_VALUE = 256
MAX_COMMAND = 32 * 1024  # an exec's command; argv, env and cwd travel in one 64 KiB agent message
MAX_SESSION_COMMAND = 1024**2  # a session command travels as a script, in chunks
MAX_STDIN = 32 * 1024**2
MAX_REF = 255


def shown(value: object) -> str:
    """`value` for an error message: repr'd, and cut to SHOWN characters."""
    text = repr(value)
    return text if len(text) <= SHOWN else text[: SHOWN - 3] + "..."


def check_env(env: dict[str, str]) -> dict[str, str]:
    if len(env) > MAX_ENV_VARS:
        raise ValueError(f"at most {MAX_ENV_VARS} environment variables")
    total = 0
    for key, value in env.items():
        if len(key) > 256 or not _ENV_KEY_RE.match(key):
            raise ValueError(f"invalid environment variable name {shown(key)}")
        if "\0" in value:
            raise ValueError(f"environment variable {key} contains a NUL byte")
        if len(value) > MAX_ENV_VALUE:
            raise ValueError(f"environment variable {key} is longer than {MAX_ENV_VALUE} characters")
        total += len(key) + len(value) + 2
    if total > MAX_ENV_TOTAL:
        raise ValueError(f"the environment is larger than {MAX_ENV_TOTAL} characters in all")
    return env


def check_user(user: str) -> str:
    """A user name (as in /etc/passwd) or a numeric uid."""
    if len(user) > 64 or not _USER_RE.match(user):
        raise ValueError(f"invalid user {shown(user)}")
    return user


def check_abs_path(path: str) -> str:
    if not path.startswith("/") or "\0" in path or len(path) > MAX_PATH:
        raise ValueError(f"path must be absolute, at most {MAX_PATH} characters, with no NUL byte: {shown(path)}")
    return path


def check_path(path: str) -> str:
    """A path inside the sandbox: absolute, or relative to the sandbox's working directory."""
    if not path or "\0" in path or len(path) > MAX_PATH:
        raise ValueError(f"path must be non-empty, at most {MAX_PATH} characters, with no NUL byte: {shown(path)}")
    return path


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ValueError(f"at most {MAX_LABELS} labels")
    for key, value in labels.items():
        if not _LABEL_KEY_RE.match(key) or len(value) > MAX_LABEL_VALUE:
            raise ValueError(
                f"invalid label {shown(key)}: keys are 1-63 characters of [A-Za-z0-9._/-] starting with a letter "
                f"or digit, values at most {MAX_LABEL_VALUE} characters"
            )
    return labels


def check_idempotency_key(key: str) -> str:
    if not _IDEMPOTENCY_RE.match(key):
        raise ValueError("an idempotency key is 1-128 characters of [A-Za-z0-9._:-]")
    return key


_IDEMPOTENCY_RE = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# In a label selector (list, stop, pause, resume ... by labels), this key selects by project: a
# sandbox of that project or of one under it matches. Sandboxes do not carry it as a label.
PROJECT_LABEL = "sandfleet.project"
_PROJECT_PART = r"[a-z0-9][a-z0-9_.-]{0,62}"
_PROJECT_RE = re.compile(rf"^{_PROJECT_PART}(/{_PROJECT_PART}){{0,7}}$")


def validation_message(errors: Sequence[Mapping[str, Any]]) -> str:
    """What a refused request is told of its validation errors: where and what, for the first five;
    never the (unbounded) input itself. "body", FastAPI's first place of a JSON body, is left out."""
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")[:100]
        parts.append(f"{loc}: {str(err.get('msg'))[:300]}")
    return "; ".join(parts) or "invalid request"


def check_project(project: str) -> str:
    """A project path: org/team/job, up to 8 levels of 1-63 characters of [a-z0-9_.-]."""
    if not _PROJECT_RE.match(project):
        raise ValueError(
            f"invalid project {shown(project)}: a path like 'org/team/job' of at most 8 parts, each 1-63 "
            "characters of [a-z0-9_.-] starting with a letter or digit"
        )
    return project


# Field types that carry these checks, for every model (here, recipes, imports) that takes such values.
EnvVars = Annotated[dict[str, str], AfterValidator(check_env)]
AbsPath = Annotated[str, AfterValidator(check_abs_path)]
SandboxPath = Annotated[str, AfterValidator(check_path)]
UserName = Annotated[str, AfterValidator(check_user)]
Labels = Annotated[dict[str, str], AfterValidator(check_labels)]
ProjectPath = Annotated[str, AfterValidator(check_project)]
IdempotencyKey = Annotated[str, AfterValidator(check_idempotency_key)]
Encoding = Literal["utf-8", "base64"]


DEFAULT_CPU_REQUEST = 0.1
MAX_SECONDS = 10 * 365 * 86400.0  # ten years: any lifetime longer is "none"


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


_SERVICE_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_DNS_LABEL = r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?"
_DNS_PATTERN_RE = re.compile(rf"^(\*\.)?({_DNS_LABEL}\.)*{_DNS_LABEL}$")
MAX_ALLOW = 64


def split_host_port(entry: str) -> tuple[str, int | None]:
    """`host`, `host:port`, `[v6]` or `[v6]:port` -> (host, port or None)."""
    if entry.startswith("["):
        host, sep, rest = entry[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad address {shown(entry)}: expected [IPv6]:port")
        port = rest[1:] if rest else None
    else:
        host, sep, port_s = entry.rpartition(":")
        host, port = (host, port_s) if sep else (entry, None)
    if port is None:
        return host, None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"bad port in {shown(entry)}: expected 1-65535")
    return host, int(port)


def check_allow_entry(entry: str) -> str:
    """A service name (`pypi`), or a host pattern with an optional port: `example.com`,
    `*.example.com:8443`, `203.0.113.7:80`, `[2001:db8::1]:443`."""
    entry = entry.strip().lower()
    if _SERVICE_RE.match(entry):
        return entry
    host, _ = split_host_port(entry)
    try:
        ipaddress.ip_address(host)
        return entry
    except ValueError:
        pass
    if len(host) > 253 or "." not in host or not _DNS_PATTERN_RE.match(host):
        raise ValueError(
            f"invalid network allow entry {shown(entry)}: expected a service name (e.g. 'pypi') or "
            "host[:port] (e.g. 'example.com', '*.example.com:8443', '203.0.113.7:80')"
        )
    return entry


AllowEntry = Annotated[str, AfterValidator(check_allow_entry)]


class NetworkPolicy(_Model):
    """Where a sandbox may connect to. Nothing is reachable by default (`allow=[]`, written
    "none"): the sandbox has a loopback device and nothing else. Each entry of `allow` is a service
    the node defines (`pypi`, `npm`, `debian`, or one of its config's `[network.services]`) or a
    host pattern with an optional port (no port: 80 and 443). Connections go through the node's
    egress proxy (HTTP_PROXY and HTTPS_PROXY are set for every command); it checks each one, and
    the address a name resolves to, against the policy. Whatever the policy, the host, the node's
    other sandboxes, link-local and metadata addresses are never reachable, nor private ranges
    unless a service of the node names them.

    Also accepted: `"none"`, a list of entries, or `{"pypi": True, "npm": False}`."""

    allow: list[AllowEntry] = Field(default_factory=list, max_length=MAX_ALLOW)

    @model_validator(mode="before")
    @classmethod
    def _short_forms(cls, data: Any) -> Any:
        if data is None or data == "none":
            return {"allow": []}
        if isinstance(data, str):
            return {"allow": [data]}
        if isinstance(data, list | tuple):
            return {"allow": list(data)}
        if isinstance(data, dict) and "allow" not in data:
            if not all(isinstance(v, bool) for v in data.values()):
                raise ValueError("a network rule map takes booleans: {'pypi': True, 'npm': False}")
            return {"allow": [k for k, v in data.items() if v]}
        return data

    @field_validator("allow")
    @classmethod
    def _unique(cls, v: list[str]) -> list[str]:
        return list(dict.fromkeys(v))

    @property
    def none(self) -> bool:
        return not self.allow

    def __str__(self) -> str:
        return ",".join(self.allow) or "none"


class NetworkUpdate(_Model):
    network: NetworkPolicy


class NetworkManyRequest(_Model):
    labels: Labels = Field(description="every running or paused sandbox carrying all these labels")
    network: NetworkPolicy


class ExposedPort(_Model):
    """A server listening inside a sandbox, reachable from the node: over HTTP at `path` of the
    daemon's API (its authentication applies; the SDK gives the full `url`), or as a byte stream at
    `socket`, a unix socket on the node only root can open. Gone with the sandbox."""

    port: int = Field(ge=1, le=65535)
    path: str
    socket: str | None = None
    url: str | None = None


class ExposeRequest(_Model):
    port: int = Field(ge=1, le=65535, description="a TCP port a server in the sandbox listens on (127.0.0.1)")


class ExposedPortList(_Model):
    ports: list[ExposedPort]


class AuditRecord(_Model):
    """One entry of the node's audit stream: an API call (`api`), a connection a sandbox made or was
    refused (`connection`), a limit it hit (`oom_kill`, `pids_limit`, `output_truncated`), a change
    of its policy (`network_policy`), an attempt on its agent (`agent_attack`), a detector's
    `finding`."""

    seq: int
    ts: float
    kind: str
    sandbox_id: str | None = None
    labels: dict[str, str] | None = None
    actor: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class AuditQuery(_Model):
    """Which audit records to read: after `since` (a seq), from `since_time` (epoch seconds)."""

    since: int = Field(0, ge=0, description="records with a greater seq (0: from the oldest kept)")
    since_time: float | None = Field(None, ge=0, description="records at or after this time (epoch seconds)")
    limit: int = Field(1000, ge=1, le=10000)
    kinds: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=32)
    sandbox_id: str | None = Field(None, max_length=64)
    newest: bool = Field(False, description="the last `limit` matching records (still oldest first), not the first")


class AuditList(_Model):
    records: list[AuditRecord]
    last_seq: int = Field(description="pass as `since` to read on from here")


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


def _check_b64(value: str | None) -> str | None:
    if value is not None:
        try:
            base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ValueError("not valid base64") from exc
    return value


Base64 = Annotated[str, AfterValidator(_check_b64)]


class _Stdin(_Model):
    """Standard input fed to a command, then closed: text, or bytes as base64."""

    stdin: str | None = Field(None, max_length=MAX_STDIN, description="text fed to the command's standard input")
    stdin_b64: Base64 | None = Field(
        None, max_length=MAX_STDIN * 4 // 3 + 4, description="bytes (base64) fed to its standard input"
    )
    keep_stdin_open: bool = Field(
        False,
        description="keep the command's standard input open after `stdin` for writes through the stdin "
        "endpoint (background processes and session commands); closed when the caller closes it",
    )

    def stdin_bytes(self) -> bytes | None:
        if self.stdin_b64 is not None:
            return base64.b64decode(self.stdin_b64)
        return None if self.stdin is None else self.stdin.encode()

    @model_validator(mode="after")
    def _one_stdin(self) -> _Stdin:
        if self.stdin is not None and self.stdin_b64 is not None:
            raise ValueError("give stdin or stdin_b64, not both")
        return self


class TerminalSize(_Model):
    """A pseudo-terminal's window, in character cells."""

    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)


class ExecRequest(_Stdin):
    command: str | list[str] = Field(description="a shell string (run by /bin/sh -c) or an argv list")
    env: EnvVars = Field(default_factory=dict)
    cwd: SandboxPath | None = Field(None, description="absolute, or relative to the sandbox's working directory")
    user: UserName | None = None
    timeout: float | None = Field(60.0, gt=0, le=86400, description="seconds; kills the process tree")
    cpu_time: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="CPU seconds the command may use (its own processes': the command and its descendants, not "
        "the rest of its sandbox); past them its process tree is killed as by a timeout (`cpu_time_exceeded`). "
        "Unlike `timeout`, time spent waiting for a CPU on a busy node does not count. Tiers whose commands the "
        "node cannot see (microvm, vm) refuse it (unsupported)",
    )
    output_limit: int = Field(1024**2, ge=0, le=64 * 1024**2, description="bytes kept per stream")
    merge_stderr: bool = Field(False, description="standard error goes to standard output (one stream, in order)")
    encoding: Encoding = Field("utf-8", description="how output comes back: utf-8 text, or base64 of the raw bytes")
    background: bool = False
    pty: TerminalSize | None = Field(
        None,
        description="run it on a new pseudo-terminal of this size: the terminal is its stdin, stdout, stderr and "
        "controlling terminal (output is one stream, `stdout`; `stdin` is typed into it); TERM defaults to "
        "xterm-256color",
    )

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str]) -> str | list[str]:
        return cls.check_command(v)

    @staticmethod
    def check_command(v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("command must not be empty")
        if not v:
            raise ValueError("command must not be empty")
        items = [v] if isinstance(v, str) else v
        if any("\0" in item for item in items):
            raise ValueError("command contains a NUL byte")
        if sum(len(item) + 1 for item in items) > MAX_COMMAND:
            raise ValueError(f"command is longer than {MAX_COMMAND} characters: write a script file and run it")
        return v


class TerminalRequest(_Model):
    """The first message of a terminal WebSocket (`GET /v1/sandboxes/{id}/terminal`): what to run on it."""

    type: Literal["start"] = "start"
    command: str | list[str] | None = Field(
        None, description="a shell string or an argv list; default: the user's login shell (bash, else sh)"
    )
    env: EnvVars = Field(default_factory=dict)
    cwd: SandboxPath | None = None
    user: UserName | None = None
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)
    timeout: float | None = Field(
        None, gt=0, le=86400, description="seconds; kills it (default: none, it lives while connected)"
    )
    output_limit: int | None = Field(
        None,
        ge=0,
        le=64 * 1024**2,
        description="bytes forwarded in all (default: no limit; a client that reads slowly holds the command "
        "back, as a terminal does)",
    )

    @field_validator("command")
    @classmethod
    def _command(cls, v: str | list[str] | None) -> str | list[str] | None:
        return None if v is None else ExecRequest.check_command(v)

    def exec_request(self) -> ExecRequest:
        login = _LOGIN_SHELL + ('exec "$sh" -l' if self.cwd else 'cd "${HOME:-/}" 2>/dev/null; exec "$sh" -l')
        return ExecRequest(
            command=self.command or ["/bin/sh", "-c", login],
            env=self.env,
            cwd=self.cwd,
            user=self.user,
            timeout=self.timeout,
            output_limit=64 * 1024**2 if self.output_limit is None else self.output_limit,
            pty=TerminalSize(rows=self.rows, cols=self.cols),
        )


# The default terminal command: the user's shell from /etc/passwd when it is one that runs (not
# nologin or false), else bash, else sh; started in the user's home unless a cwd was asked for.
_LOGIN_SHELL = (
    "sh=$(awk -F: -v u=\"$(id -un 2>/dev/null)\" '$1 == u {print $7}' /etc/passwd 2>/dev/null); "
    'case "$sh" in *nologin | *false) sh= ;; esac; [ -x "$sh" ] || sh=$(command -v bash || echo /bin/sh); '
)


class TerminalResize(_Model):
    type: Literal["resize"]
    rows: int = Field(ge=1, le=1000)
    cols: int = Field(ge=1, le=1000)


class WhoAmI(_Model):
    """The caller as the node (or gateway) sees its credentials."""

    name: str
    can_write: bool = Field(description="false for a read-only token: only GET calls are allowed")
    project: str | None = None


MAX_CALL_FILES = 64
MAX_CALL_FILES_BYTES = 8 * 1024**2


def _check_call_path(v: str) -> str:
    norm = posixpath.normpath(v) if v else ""
    if not v or v.startswith("/") or norm.startswith("..") or "\0" in v or len(v) > MAX_PATH:
        raise ValueError(f"call file {shown(v)}: a relative path inside the call's scratch directory")
    return v


CallPath = Annotated[str, AfterValidator(_check_call_path)]


class RunCodeRequest(_Stdin):
    """One stateless call (`fleet.run_code`): the code runs in a fresh process forked from a warm
    interpreter of a pooled worker, in a scratch directory of its own, as an unprivileged user;
    nothing it writes, leaves running or changes in memory is seen by the next call."""

    code: str = Field(max_length=MAX_SESSION_COMMAND, description="the program text")
    language: Literal["python", "bash"] = "python"
    files: dict[CallPath, str] = Field(
        default_factory=dict,
        max_length=MAX_CALL_FILES,
        description="files written into the call's scratch directory (its working directory) first, by relative path",
    )
    files_b64: dict[CallPath, Base64] = Field(
        default_factory=dict, max_length=MAX_CALL_FILES, description="the same, bytes as base64"
    )
    env: EnvVars = Field(default_factory=dict)
    timeout: float = Field(30.0, gt=0, le=3600, description="seconds; the call and everything it started are killed")
    output_limit: int = Field(1024**2, ge=0, le=64 * 1024**2, description="bytes kept per stream")
    encoding: Encoding = Field("utf-8", description="how output comes back: utf-8 text, or base64 of the raw bytes")
    image: ImageRef | None = Field(
        None, description="pooled calls only: the workers' image (default: the node's python image)"
    )
    resources: Resources | None = Field(
        None, description="pooled calls only: each worker's limits (a worker runs one call at a time)"
    )
    project: ProjectPath | None = Field(
        None,
        description="pooled calls only: the project whose workers run the call (workers are never shared between "
        "projects). Default: the calling token's project",
    )

    @model_validator(mode="after")
    def _files_fit(self) -> RunCodeRequest:
        names = set(self.files) & set(self.files_b64)
        if names:
            raise ValueError(f"file {shown(sorted(names)[0])} given twice (files and files_b64)")
        total = sum(len(v) for v in self.files.values()) + sum(len(v) * 3 // 4 for v in self.files_b64.values())
        if total > MAX_CALL_FILES_BYTES:
            raise ValueError(
                f"call files hold more than {MAX_CALL_FILES_BYTES} bytes: use a worker sandbox's files API"
            )
        return self


class ExecResult(_Model):
    """How a command ended. `cause` says whose fault a failure was: `timeout` when it ran out of time
    (`infra` instead when its timeout fired while the node starved it of CPU: `starved`), `agent` for
    anything else that did not exit 0 (its exit status, a signal, the OOM killer), None on success.
    Errors raised instead of a result carry their own cause (SandboxError.cause)."""

    exit_code: int
    stdout: str = Field(description="text, or base64 when `encoding` is base64")
    stderr: str = Field(description="text, or base64 when `encoding` is base64")
    duration: float = Field(description="seconds from start to exit")
    timed_out: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    signal: int | None = None
    oom_killed: bool = Field(False, description="the kernel's OOM killer ended it (the memory limit was hit)")
    cpu_time_exceeded: bool = Field(False, description="killed for using its `cpu_time` (then `timed_out` too)")
    starved: bool = Field(
        False,
        description="its timeout fired while the node starved it: its processes wanted a CPU and got less than "
        "half of what they could have used (cause infra, not timeout)",
    )
    cpu_seconds: float | None = Field(
        None, description="CPU time the command's own processes used (measured when it had a `cpu_time`)"
    )
    encoding: Encoding = "utf-8"
    cause: Cause | None = Field(
        None, description="whose fault a failure was: timeout, agent or infra (starved); None when it exited 0"
    )

    @model_validator(mode="before")
    @classmethod
    def _attribute(cls, data: Any) -> Any:
        if isinstance(data, dict) and "cause" not in data:
            if data.get("timed_out"):
                data = {**data, "cause": "infra" if data.get("starved") else "timeout"}
            elif data.get("exit_code", 0) != 0 or data.get("oom_killed") or data.get("signal"):
                data = {**data, "cause": "agent"}
        return data

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def stdout_bytes(self) -> bytes:
        """stdout as bytes (exact when the exec asked for `encoding="base64"`)."""
        return base64.b64decode(self.stdout) if self.encoding == "base64" else self.stdout.encode()

    @property
    def stderr_bytes(self) -> bytes:
        return base64.b64decode(self.stderr) if self.encoding == "base64" else self.stderr.encode()


class ExecEvent(_Model):
    """One line of a streamed exec: output chunks, then exactly one `exit` carrying the result.
    `heartbeat` lines come while nothing else does, so a client can tell a quiet command from a
    daemon that stopped answering."""

    type: Literal["stdout", "stderr", "exit", "heartbeat"]
    data: str = Field("", description="text, or base64 when the exec's `encoding` is base64")
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
    busy: bool = Field(False, description="a command is running in it")
    pty: bool = Field(False, description="its shell runs on a pseudo-terminal")


class SessionRunRequest(_Stdin):
    command: str = Field(min_length=1, max_length=MAX_SESSION_COMMAND)
    timeout: float | None = Field(60.0, gt=0, le=86400)
    output_limit: int = Field(1024**2, ge=0, le=64 * 1024**2)
    merge_stderr: bool = False
    encoding: Encoding = "utf-8"

    @field_validator("command")
    @classmethod
    def _command(cls, v: str) -> str:
        if "\0" in v:
            raise ValueError("command contains a NUL byte")
        if not v.strip():
            raise ValueError("command must not be empty")
        return v


class SessionCreateRequest(_Model):
    env: EnvVars = Field(default_factory=dict)
    cwd: SandboxPath | None = None
    user: UserName | None = None
    pty: TerminalSize | None = Field(
        None,
        description="run the shell on a new pseudo-terminal of this size: it is the shell's stdout and stderr "
        "and each command's stdin (output is one stream, `stdout`, with the terminal's CRLF line ends; stdin is "
        "typed into it, ^C interrupts the command); TERM defaults to xterm-256color",
    )


class LifetimeUpdate(_Model):
    """New lifetimes of live sandboxes; a field left out is kept, `null` removes that limit."""

    idle_ttl: float | None = Field(None, gt=0, le=MAX_SECONDS)
    max_lifetime: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds after creation (not after this call)"
    )


class LifetimeManyRequest(LifetimeUpdate):
    labels: Labels = Field(description="sandboxes carrying all of these labels")

    @field_validator("labels")
    @classmethod
    def _some(cls, v: dict[str, str]) -> dict[str, str]:
        if not v:
            raise ValueError("give at least one label")
        return v


class FileEvent(_Model):
    """One change under a watched directory (`GET .../files/watch`, a line each)."""

    type: Literal["create", "modify", "delete", "rename_from", "rename_to", "chmod", "overflow", "heartbeat"]
    path: str = ""
    is_dir: bool = False


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


MAX_RECIPE = 1024**2


class RecipeBuildRequest(_Model):
    """A recipe (TOML text) for the daemon to build into its store; its `copy` and `git` sources are
    read from `base_dir` on the daemon's host (as `images import` reads archives)."""

    recipe: str = Field(max_length=MAX_RECIPE, description="the recipe's TOML text")
    base_dir: AbsPath = Field(description="the directory relative sources are read from (daemon's host)")


class BuildEvent(_Model):
    """One line of a recipe build's stream: progress, each step as it finishes (with the output of
    its commands before it), then one `done` carrying the image; `heartbeat` while nothing else."""

    type: Literal["progress", "output", "step", "done", "heartbeat"]
    stage: str | None = Field(None, description="progress: what the build is doing")
    fraction: float | None = Field(None, description="progress: how much of the build is done, 0..1")
    index: int | None = Field(None, description="output, step: the step's index (0: the base)")
    kind: str | None = Field(None, description="step: base, apt, pip, copy, git or run")
    cache_hit: bool | None = None
    layer: str | None = Field(None, description="step: the digest of the step's layer")
    seconds: float | None = None
    name: str | None = Field(None, description="step: the image the step's layer was published as, if any")
    stream: Literal["stdout", "stderr"] | None = None
    line: str | None = Field(None, description="output: one line a run or pip step printed")
    image: ImageInfo | None = Field(None, description="done: the image built")
    steps: int | None = Field(None, description="done: how many steps (the base included)")
    cache_hits: int | None = Field(None, description="done: how many came from the build cache")


class ImportRequest(_Model):
    path: str = Field(
        max_length=MAX_PATH,
        description="a `docker save` tarball, an OCI image layout directory or its tar (daemon's host)",
    )
    ref: str | None = Field(
        None, max_length=MAX_REF, description="name:tag for the image; default: the archive's own tag"
    )


class StopRequest(_Model):
    reason: str = Field("user", max_length=256)


class ErrorBody(_Model):
    code: Literal[
        "invalid_argument",
        "not_found",
        "wrong_state",
        "resource_exhausted",
        "timeout",
        "unauthenticated",
        "permission_denied",
        "unsupported",
        "unavailable",
        "sandbox_lost",
        "data_loss",
        "internal",
    ]
    message: str
    retryable: bool
    cause: Cause = Field(
        description="whose fault: infra (node, daemon, lost sandbox, refused create), agent (what ran in the "
        "sandbox), timeout, verifier (a verification's own checks broke), caller (a bad request)"
    )


class ErrorResponse(_Model):
    error: ErrorBody


class SandboxList(_Model):
    sandboxes: list[SandboxInfo]
    next: str | None = Field(None, description="with `limit`: the cursor of the next page (`after`), null on the last")
    total: int | None = Field(None, description="with `limit`: how many sandboxes match in all")


T = TypeVar("T")


class JobGroup(_Model):
    value: str | None = Field(description="the label's value; null: sandboxes without that label")
    count: int
    states: dict[str, int] = Field(description="how many in each state")


class JobList(_Model):
    """Sandboxes grouped by one label's value (a job, a team, ...): counts, never the sandboxes."""

    key: str
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


class RunCodeBatchRequest(_Model):
    """Many stateless calls in one request (the async SDK sends calls made at the same time this way)."""

    calls: list[RunCodeRequest] = Field(min_length=1, max_length=MAX_BATCH)


class RunCodeBatchItem(_Model):
    """One call of a batch, as it completes: `result` or `error` for the call at `index`; or a
    heartbeat while none completed for a while."""

    type: Literal["result", "heartbeat"] = "result"
    index: int | None = None
    result: ExecResult | None = None
    error: ErrorBody | None = None


class StopManyRequest(_Model):
    labels: Labels
    reason: str = Field("user", max_length=256)


class StopManyResult(_Model):
    stopped: list[str]


class LabelsRequest(_Model):
    labels: Labels = Field(min_length=1, description="sandboxes carrying all of these labels")


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
    tiers: dict[str, list[str]] = Field(
        default_factory=dict,
        description="the capabilities of each isolation tier the node runs (pause, snapshot, pack, host_files, ...); "
        "a call a tier cannot serve answers `unsupported`",
    )


class ProjectUsage(_Model):
    """What one project's live sandboxes on a node hold (their limits, as quotas count them)."""

    sandboxes: int
    cpu: float = Field(description="sum of their CPU limits (cores)")
    memory: int = Field(description="sum of their memory limits (bytes)")


class NodeLoad(_Model):
    """What cluster placement and quotas read of a node, about once a second."""

    key: str = Field(description="the node's key: the 6 hex digits after sb- and snap- in the ids it makes")
    group: str = Field(description="its node group (placement spills over from one group to the next)")
    labels: dict[str, str] = Field(default_factory=dict, description="node labels a create may require")
    draining: bool = Field(description="taking no new creates (forks and restores of its snapshots still run)")
    sandboxes: int = Field(description="live sandboxes (creating, running, paused, stopping)")
    capacity: int = Field(description="its admission limit (max_sandboxes)")
    tiers: list[str]
    images: list[str] = Field(default_factory=list, description="image references in its layer store")
    projects: dict[str, ProjectUsage] = Field(
        default_factory=dict, description="per project (not rolled up; '' for none): what its sandboxes hold"
    )
    at: float = Field(description="when this was read (the node's clock, seconds since the epoch)")
    generation: int = Field(
        0, description="cluster mode: the generation the node serves under (raised when it is fenced)"
    )


class DrainRequest(_Model):
    draining: bool = Field(True, description="true: take no new creates; false: take them again")


class FenceRequest(_Model):
    """Cluster mode: the node comes back after the cluster declared it lost."""

    generation: int = Field(
        ge=1, le=2**62, description="the generation to serve under; above the node's own, everything it holds stops"
    )


class AckRequest(_Model):
    """Sandboxes whose create answer a gateway handed to its caller."""

    sandboxes: list[Annotated[str, Field(max_length=64)]] = Field(max_length=4 * MAX_BATCH)


class HeldKey(_Model):
    key: IdempotencyKey
    project: ProjectPath | None = None


class KeysRequest(_Model):
    """Idempotency keys of creates retried through a gateway: which of them this node holds."""

    keys: list[HeldKey] = Field(min_length=1, max_length=MAX_BATCH)


class KeysHeld(_Model):
    held: list[bool] = Field(description="per key, in order: a create with it made (or is making) a sandbox here")


class Ok(_Model):
    ok: bool = True


MAX_FORK = 64


class SnapshotInfo(_Model):
    """A checkpoint of a running sandbox: its processes with their memory, and its writable layer.
    It outlives the sandbox: kept until deleted or until `expires_at`."""

    id: str
    sandbox_id: str = Field(description="the sandbox it was taken from (which may have stopped since)")
    created_at: float
    size_bytes: int = Field(description="bytes on the node's disk (memory images + writable layer)")
    seconds: float = Field(description="how long taking it took (the sandbox is frozen meanwhile)")
    labels: dict[str, str] = Field(default_factory=dict, description="the snapshot's own labels")
    expires_at: float | None = Field(None, description="when the node deletes it (None: kept until deleted)")
    project: str | None = Field(None, description="its sandbox's project: restored sandboxes belong to it too")


class SnapshotRequest(_Model):
    ttl: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds to keep it (default: the node's snapshot_retention)"
    )
    labels: Labels = Field(default_factory=dict)


class SnapshotList(_Model):
    snapshots: list[SnapshotInfo]


class ForkRequest(_Model):
    """New sandboxes from one snapshot (restore) or one live sandbox (fork), each on its own."""

    count: int = Field(1, ge=1, le=MAX_FORK, description="how many sandboxes to start")
    labels: Labels = Field(
        default_factory=dict, description="labels of the new sandboxes (added to the source's labels)"
    )
    idempotency_key: IdempotencyKey | None = Field(
        None, description="a retried fork or restore with the same key returns the sandboxes it already made"
    )


class PackRequest(_Model):
    """Turn a live sandbox's changes into a new image: its layers plus one layer of what it changed."""

    image: str = Field(max_length=MAX_REF, description="name:tag of the new image (replaced if it exists)")
    exclude: list[AbsPath] = Field(
        default_factory=list,
        max_length=256,
        description="absolute paths whose changes are left out (caches, shell history, answer files)",
    )


class GcResult(_Model):
    removed: list[str] = Field(description="digests of the layer files deleted")
    bytes: int = Field(description="disk freed")


# -- RL: trajectories (exactly-once steps), verification apart from the agent ---------------------

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


StepAction = Annotated[ExecAction | WriteAction | ReadAction | SnapshotAction, Field(discriminator="kind")]


class StepRequest(_Model):
    """Step `step` (0, 1, 2, ...) of a trajectory. Taken once: asked again (a restarted trainer
    replaying its rollout) it answers the recorded result without running anything; while it runs,
    a second ask waits for the first's result. The action must be the one recorded for that step."""

    step: int = Field(ge=0, lt=MAX_STEPS)
    action: StepAction


class StepResult(_Model):
    trajectory_id: str
    step: int
    kind: Literal["exec", "write", "read", "snapshot"]
    replayed: bool = Field(description="the recorded result of an earlier ask: nothing ran now")
    exec: ExecResult | None = None
    content: str | None = Field(None, description="read: the file's bytes as text or base64 (per the action)")
    encoding: Encoding = "utf-8"
    file: FileInfo | None = None
    snapshot_id: str | None = None
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
