"""I/O-free core shared by `Client` and `AsyncClient`: request building and response decoding.

Each API call is described as a `Call` (method, path, params, body, expected model); the sync and
async clients only differ in how they send it. Transport errors and wire errors are mapped to the
`SandboxError` tree here, so both clients raise the same exceptions.

Deadlines. Every request waits at most the client's `timeout` for an answer unless its call takes a
`timeout=` of its own (image builds, imports, pushes and `pack` default to `BUILD_TIMEOUT`). A
command whose own timeout fits in the client's is run by the one-response exec endpoint, which gets
that timeout plus `EXEC_MARGIN` (so the daemon's `timed_out=true` answer wins); a command with no
timeout, or a longer one, is streamed, and there the client's timeout bounds *silence* (the daemon
sends a heartbeat every `HEARTBEAT_INTERVAL` seconds while nothing else happens), never less than
`MIN_SILENCE`. Calls that retry (create, create_many, fork, restore) keep to one deadline for all
their attempts.

Several gateways (`Client(["http://gw1:8600", "http://gw2:8600"])`, `sandfleet.ray.connect()`): calls
go to one; a transport failure there moves every later call to the next (`fail_over`), and the
call itself is sent there at once when that is safe (it never reached the first, or it is a read).
A create whose answer was lost is retried with its idempotency key, marked `RETRIED`, so whichever
gateway gets it asks the nodes which one holds the key (a first attempt is not marked: it costs
nothing extra, unless the caller says its key may have been used by another process, `key_reused`).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import random
import re
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Final, Literal, TypeVar
from urllib.parse import quote, urlsplit

import httpx
from pydantic import BaseModel, ValidationError

from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxError,
    SandboxTimeoutError,
    UnavailableError,
    WrongStateError,
    error_from_wire,
)
from sandfleet.models import (
    PROJECT_LABEL,
    TRAJECTORY_ID,
    AuditQuery,
    AuditRecord,
    BuildEvent,
    CreateBatchItem,
    CreateBatchRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ExposedPort,
    ExposeRequest,
    FileEvent,
    ForkRequest,
    ImageInfo,
    LifetimeManyRequest,
    LifetimeUpdate,
    NetworkPolicy,
    ProcessInfo,
    Resources,
    RunCodeBatchItem,
    RunCodeRequest,
    SandboxSpec,
    SessionCreateRequest,
    SessionRunRequest,
    SnapshotRequest,
    StepResult,
    TerminalRequest,
    TerminalResize,
    TerminalSize,
    VerifyRequest,
    check_idempotency_key,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DEFAULT_SOCKET = "/run/sandfleet/sandfleet.sock"
DEFAULT_TIMEOUT = 60.0
# Extra HTTP time on top of a command's own timeout, so the daemon's answer wins: its timed_out=true,
# or its typed error once its own deadline (the command's timeout + 15 s) passes.
EXEC_MARGIN = 20.0
# Image builds, imports, pushes and pack: their own, longer default (seconds).
BUILD_TIMEOUT = 1800.0
# The daemon sends a heartbeat line this often while a stream has nothing else to say...
HEARTBEAT_INTERVAL = 5.0
# ...so a stream silent for the client's timeout, but never less than this, is a daemon gone quiet.
MIN_SILENCE = 2 * HEARTBEAT_INTERVAL + 2.0
# Retried calls: backoff from BACKOFF_FIRST doubling to BACKOFF_MAX (with jitter); another attempt is
# only made when at least MIN_ATTEMPT seconds of the call's deadline are left for it.
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 1.0
MIN_ATTEMPT = 0.5
# With several gateways: a connection not made within this many seconds moves on to the next one.
FAILOVER_CONNECT = 5.0
# On a create retried after an attempt whose answer was lost (or whose key the caller says another
# process may have used): the gateway that gets it asks the nodes which holds the key first (another
# gateway may have placed it).
RETRIED = "x-sandfleet-retry"


class Unset(Enum):
    """The type of `UNSET`: "argument not given", where None already means something (no limit)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    params: Mapping[str, Any] | list[tuple[str, Any]] | None = None
    json: Any = None
    content: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # A one-response call: seconds to wait for the answer ("default": the client's timeout).
    # A streamed call: seconds the whole stream may last (None or "default": as long as the daemon
    # keeps talking; silence is bounded by `silence_limit` of the client's timeout).
    timeout: float | None | Literal["default"] = "default"


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is: a unix socket (default), or HTTP URLs (a node's, or one or several
    cluster gateways': `urls`, the first used first) with a bearer token."""

    socket: str | None
    url: str
    token: str | None
    urls: tuple[str, ...] = ()

    @classmethod
    def resolve(
        cls, socket: str | os.PathLike[str] | Sequence[str] | None, url: str | Sequence[str] | None, token: str | None
    ) -> Endpoint:
        if url is None and isinstance(socket, str) and socket.startswith(("http://", "https://")):
            url, socket = socket, None  # Client("http://gateway:8600", token=...)
        elif url is None and isinstance(socket, list | tuple):
            url, socket = socket, None  # Client(["http://gw1:8600", "http://gw2:8600"], token=...)
        url = url or os.environ.get("SANDFLEET_URL")
        token = token or os.environ.get("SANDFLEET_TOKEN")
        if url:
            urls = tuple(u.strip().rstrip("/") for u in (url.split(",") if isinstance(url, str) else url) if u.strip())
            if not urls:
                raise InvalidArgumentError("no URL given")
            return cls(None, urls[0], token, urls)
        sock = str(socket or os.environ.get("SANDFLEET_SOCKET") or DEFAULT_SOCKET)
        return cls(sock, "http://sandfleet", token, ("http://sandfleet",))

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self) -> str:
        if self.socket:
            return f"unix socket {self.socket}"
        return self.url if len(self.urls) < 2 else "any of " + ", ".join(self.urls)

    def timeout(self, timeout: float | httpx.Timeout) -> float | httpx.Timeout:
        """A call's timeouts, the connect phase cut to FAILOVER_CONNECT when other gateways wait."""
        if len(self.urls) < 2:
            return timeout
        t = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        connect = min(t.connect or FAILOVER_CONNECT, FAILOVER_CONNECT)
        return httpx.Timeout(connect=connect, read=t.read, write=t.write, pool=t.pool)


def fail_over(
    http: httpx.Client | httpx.AsyncClient, endpoint: Endpoint, base: httpx.URL, exc: BaseException, call: Call
) -> bool:
    """After a transport failure of `call` at `base`: with several gateways, every later call goes
    to the next one. True when `call` itself may be sent there at once: it surely never reached
    `base` (no connection was made), or it is a read that did not time out. Anything else is for
    the caller's own retries (creates have them, with their idempotency key)."""
    if len(endpoint.urls) < 2:
        return False
    if http.base_url == base:
        here = str(base).rstrip("/")
        i = endpoint.urls.index(here) if here in endpoint.urls else -1
        http.base_url = endpoint.urls[(i + 1) % len(endpoint.urls)]
    if not request_sent(exc):
        return True
    return call.method in ("GET", "HEAD") and not isinstance(exc, httpx.TimeoutException)


class Route:
    """One call's way through the gateways: where it was last sent, and whether a transport failure
    there sends it to the next one (`fail_over`, at most once per gateway)."""

    def __init__(self, http: httpx.Client | httpx.AsyncClient, endpoint: Endpoint, call: Call) -> None:
        self.http, self.endpoint, self.call = http, endpoint, call
        self.left = len(endpoint.urls)
        self.base = http.base_url

    def sending(self) -> None:
        self.base = self.http.base_url

    def failed(self, exc: Exception, again: bool = True) -> SandboxError | None:
        """After a transport failure: None if the call is to be sent again (to the next gateway),
        else the error to raise. `again` False: it is not (a stream whose items were given)."""
        self.left -= 1
        if again and fail_over(self.http, self.endpoint, self.base, exc, self.call) and self.left > 0:
            return None
        return map_transport_error(exc, self.endpoint)


# -- deadlines ----------------------------------------------------------------------------------------


def check_timeout(timeout: float | None, default: float) -> float:
    """A call's own `timeout=` (None: the client's), refused unless positive."""
    seconds = default if timeout is None else timeout
    if not seconds > 0:
        raise InvalidArgumentError(f"timeout must be a positive number of seconds, not {seconds!r}")
    return float(seconds)


def exec_timeout(timeout: float | None, default: float) -> float | None:
    if timeout is None:
        return None
    return max(default, timeout + EXEC_MARGIN)


def one_response(command_timeout: float | None, client_timeout: float) -> bool:
    """Whether a command runs through the one-response endpoint (its timeout fits in the client's)
    rather than a stream whose heartbeats prove the daemon alive however long the command runs."""
    return command_timeout is not None and command_timeout <= client_timeout


def request_timeout(call: Call, client_timeout: float) -> float:
    """Seconds a one-response call waits for its answer."""
    return client_timeout if call.timeout is None or call.timeout == "default" else call.timeout


def silence_limit(client_timeout: float) -> float:
    """How long a stream may go without a line before the daemon counts as gone."""
    return max(client_timeout, MIN_SILENCE)


def stream_timeouts(client_timeout: float) -> httpx.Timeout:
    """httpx timeouts of a streamed call: each read may wait for the silence limit (heartbeats
    arrive well within it), the rest the client's timeout."""
    return httpx.Timeout(client_timeout, read=silence_limit(client_timeout))


def stream_deadline(call: Call, start: float) -> float | None:
    """The monotonic time a streamed call must be over by (None: no limit but the silence one)."""
    return None if call.timeout is None or call.timeout == "default" else start + call.timeout


def _silence_error(waited: float, deadline_passed: bool) -> SandboxTimeoutError:
    if deadline_passed:
        return SandboxTimeoutError("the daemon's stream outlasted the call's deadline")
    return SandboxTimeoutError(
        f"the daemon sent nothing for {waited:.1f} s (not even a heartbeat): it stopped answering"
    )


async def next_line(lines: AsyncIterator[str], silence: float, deadline: float | None) -> str | None:
    """The next line of a stream (None at its end), or SandboxTimeoutError once it has been silent
    for `silence` seconds or runs past `deadline` (the caller then closes the connection)."""
    wait = silence if deadline is None else min(silence, deadline - time.monotonic())
    if wait <= 0:
        raise _silence_error(0.0, True)
    try:
        async with asyncio.timeout(wait):
            return await anext(lines, None)
    except TimeoutError as exc:
        raise _silence_error(wait, wait < silence) from exc


def next_line_sync(lines: Iterator[str], silence: float, deadline: float | None) -> str | None:
    """The blocking counterpart of `next_line`: httpx's read timeout (the silence limit, see
    `stream_timeouts`) bounds each read on the socket; a line that comes too late still counts as
    silence, and the deadline is checked between lines."""
    start = time.monotonic()
    if deadline is not None and start >= deadline:
        raise _silence_error(0.0, True)
    line = next(lines, None)
    now = time.monotonic()
    if now - start > silence:
        raise _silence_error(now - start, False)
    if deadline is not None and now > deadline:
        raise _silence_error(now - start, True)
    return line


class Deadline:
    """The time a retried call may take in all, and the backoff between its attempts."""

    def __init__(self, seconds: float, *, retry_refusals_for: float | None = None) -> None:
        now = time.monotonic()
        self.end = now + seconds
        self.refusals_end = self.end if retry_refusals_for is None else min(self.end, now + retry_refusals_for)
        self._backoff = BACKOFF_FIRST
        self.delay = self._jittered()

    def _jittered(self) -> float:
        return self._backoff * random.uniform(0.5, 1.0)

    def remaining(self) -> float:
        return self.end - time.monotonic()

    def attempt_timeout(self, per_request: float) -> float:
        """An attempt waits the client's timeout, or what is left of the deadline if less."""
        return max(0.001, min(per_request, self.remaining()))

    def _room(self, refused: bool) -> float:
        """Seconds left to wait before the last attempt that still gets MIN_ATTEMPT seconds."""
        return (self.refusals_end if refused else self.end) - time.monotonic() - MIN_ATTEMPT

    def allows(self, refused: bool) -> bool:
        """Whether another attempt fits (a refusal's retries may stop sooner: `retry_refusals_for`)."""
        return self._room(refused) > 0

    def backoff(self, refused: bool = False) -> float:
        """The delay to sleep before the next attempt (cut so that attempt still fits); the next one
        is longer."""
        delay = min(self.delay, max(0.0, self._room(refused)))
        self._backoff = min(self._backoff * 2, BACKOFF_MAX)
        self.delay = self._jittered()
        return delay


def new_idempotency_key() -> str:
    return uuid.uuid4().hex


def idempotency_key(key: str | None) -> str:
    """The caller's key (checked), or a fresh one."""
    if key is None:
        return new_idempotency_key()
    try:
        return check_idempotency_key(key)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(str(exc)) from exc


def transport_cause(exc: SandboxError) -> BaseException | None:
    """The transport exception a SandboxError was raised from (`map_transport_error`), if any."""
    cause = exc.__cause__
    return cause if isinstance(cause, httpx.HTTPError | OSError) else None


def request_sent(cause: BaseException) -> bool:
    """False when the request surely never reached the daemon: no connection was made."""
    return not isinstance(
        cause,
        httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | FileNotFoundError | ConnectionRefusedError,
    )


@dataclass
class CreateAttempts:
    """The retry state of one create (or one spec of a batch, a fork, a restore): its idempotency
    key, and whether an earlier attempt may have made the sandbox (the request reached the daemon
    and its answer was lost), in which case only an answer for the same key settles it."""

    key: str
    in_doubt: bool = False
    reused: bool = False  # the caller says another process (a trainer before its restart) may have used the key

    @property
    def retried(self) -> bool:
        """Whether a gateway should look for what the key made before placing this attempt (a node
        answers a key it holds anyway: this is for a cluster, where another node may hold it)."""
        return self.in_doubt or self.reused

    def retry_reason(self, exc: SandboxError) -> Literal["refused", "lost"] | None:
        """Why `exc` calls for another attempt with the same key, or None if it does not."""
        cause = transport_cause(exc)
        if cause is None:  # the daemon answered: whatever an earlier attempt did is settled
            self.in_doubt = False
            return "refused" if isinstance(exc, ResourceExhaustedError) else None
        if request_sent(cause):
            self.in_doubt = True
        # A refused connection before anything was sent is a missing daemon: fail fast, unless an
        # earlier attempt's outcome is still unknown (a restarting daemon answers again shortly).
        return "lost" if self.in_doubt else None

    def final(self, exc: SandboxError) -> SandboxError:
        """The error to give up with: `exc`, or (outcome unknown) one saying which key settles it."""
        if not self.in_doubt:
            return exc
        err = type(exc)(
            f"{exc.message} (the daemon may have acted on it: repeat the call with "
            f"idempotency_key={self.key!r} to get what it made, if anything)"
        )
        err.__cause__ = exc
        return err


# -- request bodies -----------------------------------------------------------------------------------


def validated(model: type[M], what: str, fields: dict[str, Any]) -> M:
    """`model(**fields)`, or an InvalidArgumentError saying what was wrong (never a pydantic error)."""
    return _validated(model, what, fields)


def verify_request(command: str | list[str] | VerifyRequest, options: dict[str, Any]) -> VerifyRequest:
    if isinstance(command, VerifyRequest):
        return command
    return _validated(VerifyRequest, "verify request", {"command": command, **options})


def _validated(model: type[M], what: str, data: Mapping[str, Any]) -> M:
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid {what}: {exc}") from exc


def selector(labels: Mapping[str, str] | None, project: str | None) -> dict[str, str]:
    """A label selector, with `project` as the label the daemon matches against each sandbox's
    project and everything under it (`PROJECT_LABEL`)."""
    out = dict(labels or {})
    if project is not None:
        out[PROJECT_LABEL] = project
    return out


# httpx writes a request's headers and body separately; without TCP_NODELAY the body waits for the
# ACK of the headers, which the server delays (40 ms on Linux): every small call over TCP paid it.
TCP_OPTIONS: Final = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def in_project(specs: Iterable[SandboxSpec], project: str | None) -> list[SandboxSpec]:
    """The specs, those naming no project put in `project`."""
    if project is None:
        return list(specs)
    return [s if s.project is not None else spec_from(s, {"project": project}) for s in specs]


def spec_from(spec: SandboxSpec | None, kwargs: dict[str, Any]) -> SandboxSpec:
    if spec is not None and not kwargs:
        return spec
    merged = {**spec.model_dump(exclude_unset=True), **kwargs} if spec is not None else kwargs
    return _validated(SandboxSpec, "sandbox spec", merged)


def _where(env: Mapping[str, str] | None, cwd: str | None, user: str | None) -> dict[str, Any]:
    """A command's environment, working directory and user, as far as given (the daemon's defaults else)."""
    fields: dict[str, Any] = {"env": dict(env)} if env else {}
    if cwd is not None:
        fields["cwd"] = cwd
    if user is not None:
        fields["user"] = user
    return fields


def _stdin_fields(stdin: str | bytes | None, keep_stdin_open: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if isinstance(stdin, bytes | bytearray | memoryview):
        fields["stdin_b64"] = base64.b64encode(bytes(stdin)).decode()
    elif stdin is not None:
        fields["stdin"] = stdin
    if keep_stdin_open:
        fields["keep_stdin_open"] = True
    return fields


def _output_fields(output_limit: int | None, merge_stderr: bool, binary: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if output_limit is not None:
        fields["output_limit"] = output_limit
    if merge_stderr:
        fields["merge_stderr"] = True
    if binary:
        fields["encoding"] = "base64"
    return fields


def exec_body(
    command: str | list[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    user: str | None = None,
    stdin: str | bytes | None = None,
    keep_stdin_open: bool = False,
    output_limit: int | None = None,
    merge_stderr: bool = False,
    binary: bool = False,
    pty: bool | TerminalSize = False,
    cpu_time: float | None = None,
) -> dict[str, Any]:
    """The exec request body: options left at their defaults are not sent (the daemon's defaults
    apply); `timeout=None` means none. `stdin` text travels as is, bytes as base64; `binary` asks for
    output as base64 of the raw bytes (`ExecResult.stdout_bytes`); `pty` (True: 24x80) runs it on a
    pseudo-terminal; `cpu_time`: CPU seconds it may use."""
    fields: dict[str, Any] = {"command": command, "timeout": timeout}
    if cpu_time is not None:
        fields["cpu_time"] = cpu_time
    if pty:
        fields["pty"] = TerminalSize() if pty is True else pty
    fields |= _where(env, cwd, user)
    fields |= _stdin_fields(stdin, keep_stdin_open) | _output_fields(output_limit, merge_stderr, binary)
    return _validated(ExecRequest, "exec request", fields).model_dump(mode="json", exclude_unset=True)


def run_code_body(
    code: str,
    *,
    language: str = "python",
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    output_limit: int | None = None,
    binary: bool = False,
    image: str | None = None,
    resources: Resources | None = None,
) -> dict[str, Any]:
    """A stateless call's body: `files` by relative path, text as is and bytes as base64."""
    fields: dict[str, Any] = {"code": code, "language": language, "timeout": timeout}
    for name, data in (files or {}).items():
        if isinstance(data, bytes | bytearray | memoryview):
            fields.setdefault("files_b64", {})[name] = base64.b64encode(bytes(data)).decode()
        else:
            fields.setdefault("files", {})[name] = data
    if env:
        fields["env"] = dict(env)
    if image is not None:
        fields["image"] = image
    if resources is not None:
        fields["resources"] = resources
    fields |= _stdin_fields(stdin, False) | _output_fields(output_limit, False, binary)
    return _validated(RunCodeRequest, "run_code request", fields).model_dump(mode="json", exclude_unset=True)


def call_run_code(sandbox_id: str | None, body: dict[str, Any], default_timeout: float) -> Call:
    """On a worker sandbox, or (None) on one of the node's pools; waits the call's timeout plus
    EXEC_MARGIN (a pool may first start a worker)."""
    path = "/v1/run" if sandbox_id is None else _sb(sandbox_id, "/run")
    return Call("POST", path, json=body, timeout=exec_timeout(body.get("timeout"), default_timeout))


def call_run_batch(bodies: list[dict[str, Any]], default_timeout: float) -> Call:
    """Stateless calls together: a stream of outcomes, bounded by the longest call's timeout."""
    longest = max(float(body.get("timeout", 30.0)) for body in bodies)
    return Call("POST", "/v1/run/batch", json={"calls": bodies}, timeout=exec_timeout(longest, default_timeout))


def run_batch_item(line: bytes) -> tuple[int, ExecResult | SandboxError] | None:
    """One call's outcome from a batch stream; None for a heartbeat."""
    item = _stream_item(RunCodeBatchItem, line)
    if item.type == "heartbeat" or item.index is None:
        return None
    if item.result is not None:
        return item.index, item.result
    return item.index, error_from_wire({"error": item.error.model_dump() if item.error else {}})


def session_run_body(
    command: str,
    *,
    timeout: float | None,
    output_limit: int | None = None,
    stdin: str | bytes | None = None,
    keep_stdin_open: bool = False,
    merge_stderr: bool = False,
    binary: bool = False,
) -> dict[str, Any]:
    """A session command's request body (as `exec_body`)."""
    fields: dict[str, Any] = {"command": command, "timeout": timeout}
    fields |= _stdin_fields(stdin, keep_stdin_open) | _output_fields(output_limit, merge_stderr, binary)
    return _validated(SessionRunRequest, "session command", fields).model_dump(mode="json", exclude_unset=True)


def as_bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


# -- responses ----------------------------------------------------------------------------------------


def raise_for(response_status: int, body: bytes, endpoint: Endpoint) -> None:
    if response_status < 400:
        return
    try:
        decoded: object = json.loads(body)
    except ValueError:
        decoded = body[:200].decode(errors="replace")
    raise error_from_wire(decoded, status=response_status)


def decode(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValueError as exc:
        raise InternalError(f"malformed response from the daemon: {exc}") from exc


def _stream_item(model: type[M], line: bytes) -> M:
    """One line of an ndjson stream; an `error` line is the error the daemon hit mid-stream."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise InternalError(f"malformed stream line from the daemon: {line[:200]!r}") from exc
    if isinstance(data, dict) and data.get("type") == "error":
        raise error_from_wire(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InternalError(f"malformed stream line from the daemon: {exc}") from exc


def decode_event(line: bytes) -> ExecEvent:
    return _stream_item(ExecEvent, line)


def exec_event(line: bytes) -> ExecEvent | None:
    """A command stream's event; None for a heartbeat (it only proves the daemon alive)."""
    event = _stream_item(ExecEvent, line)
    return None if event.type == "heartbeat" else event


def file_event(line: bytes) -> FileEvent | None:
    """A watch stream's event; None for a heartbeat."""
    event = _stream_item(FileEvent, line)
    return None if event.type == "heartbeat" else event


def build_event(line: bytes) -> BuildEvent | None:
    """A recipe build's event; None for a heartbeat."""
    event = _stream_item(BuildEvent, line)
    return None if event.type == "heartbeat" else event


def built(image: ImageInfo | None) -> ImageInfo:
    if image is None:
        raise UnavailableError("the daemon's stream ended before the build did (the daemon went away)")
    return image


def recipe_source(recipe: str | os.PathLike[str], base_dir: str | os.PathLike[str] | None) -> tuple[str, str]:
    """A recipe's TOML text and the absolute directory its sources are read from."""
    if base_dir is None:
        if isinstance(recipe, str) and "\n" in recipe:
            raise InvalidArgumentError("a recipe given as text needs base_dir")
        path = Path(recipe).absolute()
        try:
            return path.read_text(), str(path.parent)
        except (OSError, UnicodeError) as exc:
            raise InvalidArgumentError(f"cannot read the recipe {str(path)!r}: {exc}") from exc
    if not isinstance(recipe, str):
        raise InvalidArgumentError("with base_dir, give the recipe's text")
    return recipe, str(Path(base_dir).absolute())


def exit_result(event: ExecEvent) -> ExecResult:
    if event.result is None:
        raise InternalError("the daemon sent an exit event without a result")
    return event.result


def no_exit() -> UnavailableError:
    return UnavailableError("the daemon's stream ended before the command's exit (the daemon or sandbox went away)")


def finished(info: ProcessInfo) -> ProcessInfo:
    """A waited-on process's info; one that ended without a result is an error, not a silent None."""
    if not info.running and info.result is None:
        raise WrongStateError(f"process {info.id} ended without a result (its sandbox stopped)")
    return info


TERMINAL_PROTOCOL = "sandfleet.terminal"
TERMINAL_FRAME = 1 << 20  # the largest WebSocket message a terminal accepts (output comes in <= 64 KiB)
TERMINAL_OPEN_TIMEOUT = 30.0  # from the upgrade to the daemon's `started`
EXPECT_KEEP = 2 * 1024**2  # `expect`: output kept while looking for a match (halved when past it)
EXPECT_OVERLAP = 4096  # ... and how far back into what was searched a match may begin


TERMINAL_BEARER = "sandfleet.bearer."  # + base64url(token), no padding: a browser's credentials


def terminal_credentials(subprotocols: Sequence[str], authorization: str) -> str:
    """The Authorization header a terminal WebSocket stands for: a browser, which cannot set headers
    on one, sends its token as the subprotocol `sandfleet.bearer.<base64url>` ('' when none)."""
    for proto in subprotocols:
        proto = proto.strip()
        if proto.startswith(TERMINAL_BEARER):
            raw = proto[len(TERMINAL_BEARER) :]
            try:
                token = base64.b64decode(raw + "=" * (-len(raw) % 4), altchars=b"-_", validate=True).decode()
                return "Bearer " + (token or "\0")
            except (ValueError, UnicodeDecodeError):
                return "Bearer \0"  # a token no one has: refused like any wrong one
    return authorization


def terminal_origin_ok(origin: str | None, host: str) -> bool:
    """A terminal WebSocket a browser opened from a page of this host (or a client that is not a
    browser: no Origin): never one from another site's page, credentials or not."""
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == host.lower()


def terminal_path(sandbox_id: str) -> str:
    return _sb(sandbox_id, "/terminal")


def terminal_start(
    command: str | list[str] | None,
    *,
    rows: int,
    cols: int,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    timeout: float | None,
    output_limit: int | None,
) -> str:
    """The terminal's first message: a TerminalRequest, checked here (bad input fails before connecting)."""
    fields: dict[str, Any] = {"type": "start", "command": command, "rows": rows, "cols": cols, "timeout": timeout}
    fields |= _where(env, cwd, user)
    if output_limit is not None:
        fields["output_limit"] = output_limit
    return _validated(TerminalRequest, "terminal request", fields).model_dump_json(exclude_unset=True)


def terminal_resize(rows: int, cols: int) -> str:
    return _validated(TerminalResize, "terminal size", {"type": "resize", "rows": rows, "cols": cols}).model_dump_json()


def terminal_message(text: str) -> dict[str, Any]:
    """A text frame of the daemon: `started`, `exit` (returned), or `error` (raised)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InternalError(f"malformed terminal message from the daemon: {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise InternalError(f"malformed terminal message from the daemon: {text[:200]!r}")
    if data.get("type") == "error":
        raise error_from_wire(data)
    return data


def terminal_result(data: dict[str, Any]) -> ExecResult:
    try:
        return ExecResult.model_validate(data.get("result"))
    except ValueError as exc:
        raise InternalError(f"malformed terminal exit from the daemon: {exc}") from exc


def terminal_closed(code: int | None, reason: str | None) -> SandboxError:
    """The daemon closed the terminal without saying why in a message first."""
    return UnavailableError(f"the terminal's connection closed (code {code}{': ' + reason if reason else ''})")


def map_transport_error(exc: Exception, endpoint: Endpoint) -> SandboxError:
    if isinstance(exc, httpx.TimeoutException):
        return SandboxTimeoutError(f"request to sandfleet at {endpoint.describe()} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError | FileNotFoundError | ConnectionRefusedError):
        if endpoint.socket:
            return UnavailableError(
                f"cannot reach the sandfleet daemon at {endpoint.describe()} (is `sandfleet serve` running?)"
            )
        return UnavailableError(f"cannot reach sandfleet at {endpoint.describe()} ({type(exc).__name__})")
    return UnavailableError(f"transport error talking to sandfleet at {endpoint.describe()}: {exc}")


async def gather_bounded(limit: int, factories: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the coroutine factories with at most `limit` in flight; results in order."""
    sem = asyncio.Semaphore(max(1, limit))

    async def run(factory: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await factory()

    return list(await asyncio.gather(*(run(f) for f in factories)))


def gather_bounded_sync(limit: int, factories: Sequence[Callable[[], T]]) -> list[T]:
    """The blocking client's counterpart: a thread pool of `limit` workers."""
    with ThreadPoolExecutor(max(1, limit)) as pool:
        return list(pool.map(lambda f: f(), factories))


def local_tar(src: Path) -> bytes:
    """Pack a local file or directory for upload (paths relative to it)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if src.is_dir():
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
        else:
            tar.add(src, arcname=src.name)
    return buf.getvalue()


def extract_tar(data: bytes, dest: Path) -> None:
    import io
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(dest, filter="data")


# -- the calls, one builder per API operation (no I/O) ----------------------------------------------


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OCTET_STREAM = {"content-type": "application/octet-stream"}


def _id(kind: str, value: str) -> str:
    """An id as one path segment, refusing ids that could not name anything (or would change the route)."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidArgumentError(f"invalid {kind} id {value!r}")
    return quote(value, safe="")


def sandbox_path(sandbox_id: str) -> str:
    """`/v1/sandboxes/<id>`, refusing ids that could not name a sandbox (or would change the route)."""
    return "/v1/sandboxes/" + _id("sandbox", sandbox_id)


def _sb(sandbox_id: str, suffix: str = "") -> str:
    return sandbox_path(sandbox_id) + suffix


_TRAJECTORY_RE = re.compile(TRAJECTORY_ID)


def trajectory_path(trajectory_id: str, suffix: str = "") -> str:
    if not isinstance(trajectory_id, str) or not _TRAJECTORY_RE.match(trajectory_id):
        raise InvalidArgumentError(f"invalid trajectory id {trajectory_id!r}: 1-117 characters of [A-Za-z0-9._:-]")
    return "/v1/trajectories/" + trajectory_id + suffix


STEP_RETRY = 300.0  # seconds a trajectory call is retried through lost answers and a daemon restart
STEP_GRACE = 30.0  # a step's call waits this much longer than its command may run


def verify_timeout(req: VerifyRequest) -> float:
    """A verification's call waits for its turn on the node (`queue_timeout`), then for its checks."""
    return req.queue_timeout + req.timeout + STEP_GRACE + 60


def step_timeout(command_timeout: float | None, client_timeout: float) -> float:
    """A step's call waits for its command (a step is one answer, never a stream: it may be a replay)."""
    return max(client_timeout, (command_timeout or 86400.0) + STEP_GRACE)


def step_error(result: StepResult) -> SandboxError | None:
    """The error a step recorded, as the exception the SDK raises for it (cause included)."""
    return None if result.error is None else error_from_wire({"error": result.error.model_dump()})


def snapshot_path(snapshot_id: str) -> str:
    return "/v1/snapshots/" + _id("snapshot", snapshot_id)


def process_path(sandbox_id: str, process_id: str) -> str:
    return _sb(sandbox_id, "/processes/" + _id("process", process_id))


def session_path(sandbox_id: str, session_id: str) -> str:
    return _sb(sandbox_id, "/sessions/" + _id("session", session_id))


def retried(call: Call, retried: bool) -> Call:
    """`call`, marked RETRIED if `retried` (see `CreateAttempts.retried`)."""
    return dataclasses.replace(call, headers={**call.headers, RETRIED: "1"}) if retried else call


# Fields the caller left unset are not sent: the daemon fills them from the image's defaults
# (an OCI image's WorkingDir and User) before its own.
def call_create(spec: SandboxSpec, key: str, timeout: float) -> Call:
    return Call(
        "POST",
        "/v1/sandboxes",
        json=spec.model_dump(mode="json", exclude_unset=True),
        headers={"idempotency-key": key},
        timeout=timeout,
    )


def call_create_batch(specs: Sequence[SandboxSpec], keys: Sequence[str], concurrency: int, timeout: float) -> Call:
    body = CreateBatchRequest(specs=list(specs), concurrency=concurrency, idempotency_keys=list(keys))
    return Call("POST", "/v1/sandboxes/batch", json=body.model_dump(mode="json", exclude_unset=True), timeout=timeout)


def _fork_body(count: int, labels: Mapping[str, str] | None, key: str) -> dict[str, Any]:
    body = _validated(
        ForkRequest, "fork request", {"count": count, "labels": dict(labels or {}), "idempotency_key": key}
    )
    return body.model_dump(mode="json")


def call_fork(sandbox_id: str, count: int, labels: Mapping[str, str] | None, key: str, timeout: float) -> Call:
    return Call("POST", _sb(sandbox_id, "/fork"), json=_fork_body(count, labels, key), timeout=timeout)


def call_restore(snapshot_id: str, count: int, labels: Mapping[str, str] | None, key: str, timeout: float) -> Call:
    return Call("POST", snapshot_path(snapshot_id) + "/restore", json=_fork_body(count, labels, key), timeout=timeout)


def call_snapshot(sandbox_id: str, ttl: float | None, labels: Mapping[str, str] | None, timeout: float) -> Call:
    """No body unless a ttl or labels are given (the node's retention applies)."""
    fields: dict[str, Any] = {}
    if ttl is not None:
        fields["ttl"] = ttl
    if labels:
        fields["labels"] = dict(labels)
    body = _validated(SnapshotRequest, "snapshot request", fields).model_dump(mode="json") if fields else None
    return Call("POST", _sb(sandbox_id, "/snapshots"), json=body, timeout=timeout)


def call_snapshots(sandbox_id: str | None) -> Call:
    return Call("GET", "/v1/snapshots", params={"sandbox_id": sandbox_id} if sandbox_id else None)


def item_error(item: CreateBatchItem) -> SandboxError:
    """The error of one failed item of a batch create, as the exception the daemon meant."""
    assert item.error is not None
    return error_from_wire({"error": item.error.model_dump()}, status=200)


def call_list(labels: Mapping[str, str] | None, state: str | None) -> Call:
    """`state` None: the daemon's default, live sandboxes (creating, running, paused, stopping)."""
    params: list[tuple[str, Any]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if state is not None:
        params.append(("state", state))
    return Call("GET", "/v1/sandboxes", params=params)


def call_jobs(key: str, labels: Mapping[str, str] | None, state: str | None) -> Call:
    call = call_list(labels, state)
    return Call("GET", "/v1/jobs", params=[("key", key), *(call.params or [])])


def _lifetimes(idle_ttl: float | None | Unset, max_lifetime: float | None | Unset) -> dict[str, Any]:
    fields = {
        name: value
        for name, value in (("idle_ttl", idle_ttl), ("max_lifetime", max_lifetime))
        if not isinstance(value, Unset)
    }
    if not fields:
        raise InvalidArgumentError("give idle_ttl or max_lifetime (None removes that limit)")
    return fields


def call_set_lifetime(sandbox_id: str, idle_ttl: float | None | Unset, max_lifetime: float | None | Unset) -> Call:
    """Only the limits given are sent (an explicit None as null: remove that limit)."""
    body = _validated(LifetimeUpdate, "lifetime update", _lifetimes(idle_ttl, max_lifetime))
    return Call("PATCH", sandbox_path(sandbox_id), json=body.model_dump(mode="json", exclude_unset=True))


def call_set_lifetimes(
    labels: Mapping[str, str], idle_ttl: float | None | Unset, max_lifetime: float | None | Unset
) -> Call:
    fields = {"labels": dict(labels), **_lifetimes(idle_ttl, max_lifetime)}
    body = _validated(LifetimeManyRequest, "lifetime update", fields)
    return Call("POST", "/v1/sandboxes/lifetimes", json=body.model_dump(mode="json", exclude_unset=True))


def call_labels(action: Literal["pause", "resume"], labels: Mapping[str, str], timeout: float) -> Call:
    return Call("POST", f"/v1/sandboxes/{action}", json={"labels": dict(labels)}, timeout=timeout)


def network_policy(network: NetworkPolicy | str | Sequence[str] | Mapping[str, bool]) -> NetworkPolicy:
    """A policy from any of its forms: "none", ["pypi", "example.com:443"], {"pypi": True}."""
    if isinstance(network, NetworkPolicy):
        return network
    try:
        return NetworkPolicy.model_validate(network)
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid network policy: {exc}") from exc


def call_set_network(sandbox_id: str, network: NetworkPolicy) -> Call:
    return Call("PUT", _sb(sandbox_id, "/network"), json={"network": network.model_dump(mode="json")})


def call_set_network_many(labels: Mapping[str, str], network: NetworkPolicy, timeout: float) -> Call:
    body = {"labels": dict(labels), "network": network.model_dump(mode="json")}
    return Call("POST", "/v1/sandboxes/network", json=body, timeout=timeout)


def call_expose(sandbox_id: str, port: int) -> Call:
    return Call(
        "POST", _sb(sandbox_id, "/ports"), json={"port": _validated(ExposeRequest, "port", {"port": port}).port}
    )


def audit_query(
    since: int,
    since_time: float | None,
    kinds: Sequence[str] | None,
    sandbox_id: str | None,
    limit: int,
    newest: bool = False,
) -> AuditQuery:
    fields = {"since": since, "since_time": since_time, "kinds": kinds, "sandbox_id": sandbox_id, "limit": limit}
    return _validated(AuditQuery, "audit query", fields | {"newest": newest})


def call_audit(query: AuditQuery, *, follow: bool) -> Call:
    params: list[tuple[str, Any]] = [("since", query.since)]
    if not follow:
        params.append(("limit", query.limit))
    if query.since_time is not None:
        params.append(("since_time", query.since_time))
    if query.sandbox_id is not None:
        params.append(("sandbox_id", query.sandbox_id))
    params += [("kind", k) for k in query.kinds or []]
    if query.newest and not follow:
        params.append(("newest", "true"))
    if follow:
        return Call("GET", "/v1/audit/follow", params=params, timeout=None)
    return Call("GET", "/v1/audit", params=params)


def audit_record(line: bytes) -> AuditRecord | None:
    """A line of the followed audit stream; None for a heartbeat."""
    if line.startswith(b'{"type":"heartbeat"'):
        return None
    return _stream_item(AuditRecord, line)


def exposed(base: httpx.URL, port: ExposedPort) -> ExposedPort:
    """The daemon's answer with the full URL this client reaches the port at (through the gateway
    it uses now, when there are several)."""
    return port.model_copy(update={"url": str(base).rstrip("/") + port.path})


def call_pack(sandbox_id: str, image: str, exclude: Sequence[str], timeout: float) -> Call:
    return Call("POST", _sb(sandbox_id, "/pack"), json={"image": image, "exclude": list(exclude)}, timeout=timeout)


def call_exec(sandbox_id: str, body: dict[str, Any], default_timeout: float, *, stream: bool = False) -> Call:
    """One response: wait the command's timeout plus EXEC_MARGIN. Streamed: the same bounds the whole
    stream (none without a command timeout); silence is bounded by the client (see `silence_limit`)."""
    return Call(
        "POST",
        _sb(sandbox_id, "/exec/stream" if stream else "/exec"),
        json=body,
        timeout=exec_timeout(body.get("timeout"), default_timeout),
    )


def call_start(sandbox_id: str, body: dict[str, Any]) -> Call:
    return Call("POST", _sb(sandbox_id, "/processes"), json=body)


def call_wait(sandbox_id: str, process_id: str, timeout: float) -> Call:
    if not timeout >= 0:
        raise InvalidArgumentError(f"wait timeout must be >= 0 seconds, not {timeout!r}")
    return Call("GET", process_path(sandbox_id, process_id), params={"wait": timeout}, timeout=timeout + EXEC_MARGIN)


def call_kill(sandbox_id: str, process_id: str, signal: int) -> Call:
    return Call("DELETE", process_path(sandbox_id, process_id), params={"signal": signal})


def call_stdin(base_path: str, data: bytes, close: bool) -> Call:
    """Write bytes to a command's standard input (`close`: then close it)."""
    return Call("POST", base_path + "/stdin", params={"close": str(close).lower()}, content=data, headers=_OCTET_STREAM)


def call_session_create(
    sandbox_id: str,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    pty: bool | TerminalSize = False,
) -> Call:
    fields: dict[str, Any] = {"env": dict(env or {})}
    if cwd is not None:
        fields["cwd"] = cwd
    if user is not None:
        fields["user"] = user
    if pty:
        fields["pty"] = TerminalSize() if pty is True else pty
    body = _validated(SessionCreateRequest, "session request", fields)
    return Call("POST", _sb(sandbox_id, "/sessions"), json=body.model_dump(mode="json", exclude_unset=True))


def call_session_run(
    sandbox_id: str, session_id: str, body: dict[str, Any], default_timeout: float, *, stream: bool = False
) -> Call:
    return Call(
        "POST",
        session_path(sandbox_id, session_id) + ("/run/stream" if stream else "/run"),
        json=body,
        timeout=exec_timeout(body.get("timeout"), default_timeout),
    )


def call_write(sandbox_id: str, path: str, data: bytes, mode: int, user: str | None, append: bool) -> Call:
    params: dict[str, Any] = {"path": path, "mode": mode, "append": str(append).lower()}
    if user:
        params["user"] = user
    return Call("PUT", _sb(sandbox_id, "/files/content"), params=params, content=data, headers=_OCTET_STREAM)


def call_read(sandbox_id: str, path: str, offset: int, length: int | None) -> Call:
    params: dict[str, Any] = {"path": path, "offset": offset}
    if length is not None:
        params["length"] = length
    return Call("GET", _sb(sandbox_id, "/files/content"), params=params)


def call_list_files(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/files/list"), params={"path": path})


def call_stat(sandbox_id: str, path: str, follow_symlinks: bool) -> Call:
    params = {"path": path, "follow_symlinks": str(follow_symlinks).lower()}
    return Call("GET", _sb(sandbox_id, "/files/stat"), params=params)


def call_mkdir(sandbox_id: str, path: str, parents: bool, mode: int, user: str | None) -> Call:
    params: dict[str, Any] = {"path": path, "parents": str(parents).lower(), "mode": mode}
    if user:
        params["user"] = user
    return Call("POST", _sb(sandbox_id, "/files/mkdir"), params=params)


def call_remove(sandbox_id: str, path: str, recursive: bool) -> Call:
    return Call("DELETE", _sb(sandbox_id, "/files"), params={"path": path, "recursive": str(recursive).lower()})


def call_upload(sandbox_id: str, path: str, data: bytes, user: str | None) -> Call:
    params: dict[str, Any] = {"path": path}
    if user:
        params["user"] = user
    return Call(
        "PUT", _sb(sandbox_id, "/files/tar"), params=params, content=data, headers={"content-type": "application/x-tar"}
    )


def call_download(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/files/tar"), params={"path": path})


def call_watch(sandbox_id: str, path: str, recursive: bool) -> Call:
    """A stream with no end of its own (None): it lasts until the caller stops reading."""
    params = {"path": path, "recursive": str(recursive).lower()}
    return Call("GET", _sb(sandbox_id, "/files/watch"), params=params, timeout=None)
