"""A command's options, one group (`CommandOptions`) for every call that runs a command, and the
calls that run them: exec (one answer or streamed), background processes, sessions, stateless calls."""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sandfleet.client._base.deadlines import EXEC_MARGIN, exec_timeout
from sandfleet.client._base.wire import (
    _OCTET_STREAM,
    UNSET,
    Call,
    Unset,
    _sb,
    _stream_item,
    _validated,
    process_path,
    session_path,
)
from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    SandboxError,
    UnavailableError,
    WrongStateError,
    error_from_wire,
)
from sandfleet.models import (
    ExecEvent,
    ExecRequest,
    ExecResult,
    ProcessInfo,
    Resources,
    RunCodeBatchItem,
    RunCodeRequest,
    SessionCreateRequest,
    SessionRunRequest,
    TerminalSize,
)


@dataclass(frozen=True)
class CommandOptions:
    """A command's options, as every SDK call that runs a command takes them (`exec`, `exec_stream`,
    `start`, `terminal`, a session's `run` and `run_stream`, a trajectory's `exec`, `run_code`): each
    call keeps its own keyword arguments (its signature says which apply and their defaults) and
    gathers them here, and the request bodies are built from this one group.

    Where it runs: `env`, `cwd`, `user` (the daemon's defaults else). Its standard input: `stdin`
    (text as is, bytes as base64), `keep_stdin_open`. Its output: `output_limit`, `merge_stderr`,
    `binary` (output as base64 of the raw bytes, `ExecResult.stdout_bytes`), `pty` (True: 24x80)
    runs it on a pseudo-terminal. Its limits: `timeout` (seconds; None: none; UNSET: the request's
    default), `cpu_time` (CPU seconds). Options left at their defaults are not sent."""

    timeout: float | None | Unset = UNSET
    env: Mapping[str, str] | None = None
    cwd: str | None = None
    user: str | None = None
    stdin: str | bytes | None = None
    keep_stdin_open: bool = False
    output_limit: int | None = None
    merge_stderr: bool = False
    binary: bool = False
    pty: bool | TerminalSize = False
    cpu_time: float | None = None

    def where(self) -> dict[str, Any]:
        """Its environment, working directory and user, as far as given."""
        fields: dict[str, Any] = {"env": dict(self.env)} if self.env else {}
        if self.cwd is not None:
            fields["cwd"] = self.cwd
        if self.user is not None:
            fields["user"] = self.user
        return fields

    def fields(self) -> dict[str, Any]:
        """The request fields of the options given (a request refuses those it has no field for)."""
        fields: dict[str, Any] = {} if isinstance(self.timeout, Unset) else {"timeout": self.timeout}
        if self.cpu_time is not None:
            fields["cpu_time"] = self.cpu_time
        if self.pty:
            fields["pty"] = TerminalSize() if self.pty is True else self.pty
        fields |= self.where()
        if isinstance(self.stdin, bytes | bytearray | memoryview):
            fields["stdin_b64"] = base64.b64encode(bytes(self.stdin)).decode()
        elif self.stdin is not None:
            fields["stdin"] = self.stdin
        if self.keep_stdin_open:
            fields["keep_stdin_open"] = True
        if self.output_limit is not None:
            fields["output_limit"] = self.output_limit
        if self.merge_stderr:
            fields["merge_stderr"] = True
        if self.binary:
            fields["encoding"] = "base64"
        return fields


def exec_body(command: str | list[str], options: CommandOptions) -> dict[str, Any]:
    """The exec request body (also a background process's, and a trajectory step's)."""
    fields = {"command": command, **options.fields()}
    return _validated(ExecRequest, "exec request", fields).model_dump(mode="json", exclude_unset=True)


def session_run_body(command: str, options: CommandOptions) -> dict[str, Any]:
    """A session command's request body (the session's shell has its own env, cwd and user)."""
    fields = {"command": command, **options.fields()}
    return _validated(SessionRunRequest, "session command", fields).model_dump(mode="json", exclude_unset=True)


def run_code_body(
    code: str,
    options: CommandOptions,
    *,
    language: str = "python",
    files: Mapping[str, str | bytes] | None = None,
    image: str | None = None,
    resources: Resources | None = None,
) -> dict[str, Any]:
    """A stateless call's body: `files` by relative path, text as is and bytes as base64."""
    fields: dict[str, Any] = {"code": code, "language": language, **options.fields()}
    for name, data in (files or {}).items():
        if isinstance(data, bytes | bytearray | memoryview):
            fields.setdefault("files_b64", {})[name] = base64.b64encode(bytes(data)).decode()
        else:
            fields.setdefault("files", {})[name] = data
    if image is not None:
        fields["image"] = image
    if resources is not None:
        fields["resources"] = resources
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


def decode_event(line: bytes) -> ExecEvent:
    return _stream_item(ExecEvent, line)


def exec_event(line: bytes) -> ExecEvent | None:
    """A command stream's event; None for a heartbeat (it only proves the daemon alive)."""
    event = _stream_item(ExecEvent, line)
    return None if event.type == "heartbeat" else event


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


def call_start_stream(sandbox_id: str, body: dict[str, Any]) -> Call:
    """Start a background process and follow its output: a stream without an end in time."""
    return Call("POST", _sb(sandbox_id, "/processes/stream"), json=body, timeout=None)


def call_output(sandbox_id: str, process_id: str) -> Call:
    """A process's output as it comes, until its exit: a stream without an end in time (silence is
    bounded by the client, see `silence_limit`)."""
    return Call("GET", process_path(sandbox_id, process_id) + "/output", timeout=None)


def call_kill(sandbox_id: str, process_id: str, signal: int) -> Call:
    return Call("DELETE", process_path(sandbox_id, process_id), params={"signal": signal})


def call_stdin(base_path: str, data: bytes, close: bool) -> Call:
    """Write bytes to a command's standard input (`close`: then close it)."""
    return Call("POST", base_path + "/stdin", params={"close": str(close).lower()}, content=data, headers=_OCTET_STREAM)


def call_session_create(sandbox_id: str, options: CommandOptions) -> Call:
    """A session's shell: where it runs (`env`, `cwd`, `user`) and `pty`, from its options."""
    body = _validated(SessionCreateRequest, "session request", {"env": {}, **options.fields()})
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
