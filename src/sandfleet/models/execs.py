"""Commands: exec, background processes, sessions, terminals, and stateless calls (run_code)."""

from __future__ import annotations

import base64
import posixpath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from sandfleet.errors import Cause
from sandfleet.models.common import (
    MAX_COMMAND,
    MAX_PATH,
    MAX_SESSION_COMMAND,
    MAX_STDIN,
    Encoding,
    EnvVars,
    ErrorBody,
    ProjectPath,
    SandboxPath,
    UserName,
    _Model,
    shown,
)
from sandfleet.models.sandboxes import MAX_BATCH, ImageRef, Resources


def _check_b64(value: str | None) -> str | None:
    if value is not None:
        try:
            base64.b64decode(value, validate=True)
        except ValueError as exc:
            raise ValueError("not valid base64") from exc
    return value


Base64 = Annotated[str, AfterValidator(_check_b64)]

# The bounds of a command's options, one definition each, for every request that runs a command
# (ExecRequest, TerminalRequest, SessionRunRequest, RunCodeRequest); where it runs is
# EnvVars, SandboxPath and UserName, and its standard input `_Stdin`. Field types, not a base class:
# a request's field order is part of a logged step's identity (daemon/rl/steplog.py).
MAX_OUTPUT = 64 * 1024**2
OutputLimit = Annotated[int, Field(ge=0, le=MAX_OUTPUT)]
OutputEncoding = Annotated[Encoding, Field(description="how output comes back: utf-8 text, or base64 of the raw bytes")]
CommandTimeout = Annotated[float, Field(gt=0, le=86400)]  # seconds (a stateless call has its own: at most 3600)


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
    timeout: CommandTimeout | None = Field(60.0, description="seconds; kills the process tree")
    cpu_time: float | None = Field(
        None,
        gt=0,
        le=86400,
        description="CPU seconds the command may use (its own processes': the command and its descendants, not "
        "the rest of its sandbox); past them its process tree is killed as by a timeout (`cpu_time_exceeded`). "
        "Unlike `timeout`, time spent waiting for a CPU on a busy node does not count. Tiers whose commands the "
        "node cannot see (microvm, vm) refuse it (unsupported)",
    )
    output_limit: OutputLimit = Field(1024**2, description="bytes kept per stream")
    merge_stderr: bool = Field(False, description="standard error goes to standard output (one stream, in order)")
    encoding: OutputEncoding = "utf-8"
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
    timeout: CommandTimeout | None = Field(
        None, description="seconds; kills it (default: none, it lives while connected)"
    )
    output_limit: OutputLimit | None = Field(
        None,
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
            output_limit=MAX_OUTPUT if self.output_limit is None else self.output_limit,
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


MAX_CALL_FILES = 64


MAX_CALL_FILES_BYTES = 8 * 1024**2


def _check_call_path(v: str) -> str:
    norm = posixpath.normpath(v) if v else ""
    if not v or v.startswith("/") or norm.startswith("..") or "\0" in v or len(v) > MAX_PATH or norm == ".":
        raise ValueError(f"call file {shown(v)}: a relative path inside the call's scratch directory")
    if any(len(part.encode()) > 255 for part in norm.split("/")):
        raise ValueError(f"call file {shown(v)}: a name longer than 255 bytes")
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
    output_limit: OutputLimit = Field(1024**2, description="bytes kept per stream")
    encoding: OutputEncoding = "utf-8"
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
        paths = [posixpath.normpath(p) for p in [*self.files, *self.files_b64]]
        if len(set(paths)) < len(paths):
            raise ValueError("a call file given twice (by two spellings of one path)")
        known = set(paths)
        for path in paths:  # a file cannot also be the directory of another
            parent = posixpath.dirname(path)
            while parent:
                if parent in known:
                    raise ValueError(f"call file {shown(parent)} is also the directory of {shown(path)}")
                parent = posixpath.dirname(parent)
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


class ProcessInfo(_Model):
    """A background process started with `background=True`."""

    id: str
    command: str | list[str]
    running: bool
    started_at: float
    result: ExecResult | None = None


class ExecEvent(_Model):
    """One line of a streamed exec: output chunks, then exactly one `exit` carrying the result.
    `heartbeat` lines come while nothing else does, so a client can tell a quiet command from a
    daemon that stopped answering. A background process started and followed at once
    (`start_process_stream`) begins with one `started` carrying the process."""

    type: Literal["started", "stdout", "stderr", "exit", "heartbeat"]
    data: str = Field("", description="text, or base64 when the exec's `encoding` is base64")
    result: ExecResult | None = None
    process: ProcessInfo | None = Field(None, description="started: the background process")


class SessionInfo(_Model):
    id: str
    shell: str
    created_at: float
    busy: bool = Field(False, description="a command is running in it")
    pty: bool = Field(False, description="its shell runs on a pseudo-terminal")


class SessionRunRequest(_Stdin):
    command: str = Field(min_length=1, max_length=MAX_SESSION_COMMAND)
    timeout: CommandTimeout | None = 60.0
    output_limit: OutputLimit = 1024**2
    merge_stderr: bool = False
    encoding: OutputEncoding = "utf-8"

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


class ProcessList(_Model):
    processes: list[ProcessInfo]


class SessionList(_Model):
    sessions: list[SessionInfo]
