"""A SWE-ReX deployment and runtime whose commands, shells and files live in a sandfleet sandbox.

SWE-ReX's own remote deployments (docker, modal, fargate) start a `swerex-remote` server inside the
container and drive it over HTTP; a sandfleet sandbox already has an agent that runs commands, keeps
shells and moves files, so `SandfleetRuntime` speaks SWE-ReX's request/response models straight to
sandfleet's `AsyncClient` instead: nothing is installed in the image, and any image with a shell
works (bash for SWE-agent's tools).

How SWE-ReX's semantics map:

- a bash session (`create_session` / `run_in_session`) is a sandfleet terminal session (`pty=True`):
  one long-lived shell on a pseudo-terminal, as SWE-ReX's pexpect shell is, whose cwd, environment
  and variables carry over. A command is syntax-checked first (`bash -n`, as SWE-ReX does:
  `BashIncorrectSyntaxError` with the checker's stdout/stderr in `extra_info`); its output is the
  terminal's (stdout and stderr in one, CRLF as LF, escape sequences gone). A timeout raises
  `CommandTimeoutError` and, as in SWE-ReX, leaves the command running: `BashInterruptAction`
  types ^C into the terminal (`n_retry` times, each waiting `timeout` for it to end), then, as
  SWE-ReX, ^Z and `kill -9 %%` (the shell's notice of the killed job comes with the next
  command's output). What a command printed after the action that left it running returned comes
  with the next observation.
- interactive programs (`is_interactive_command`, `is_interactive_quit`) run in the session the
  same way, so REPLs print their prompts; each action types a line into the terminal and waits
  for one of its `expect` strings, or for the program to end (where SWE-ReX waits for its shell
  prompt).
- `execute` is one process (`/bin/sh -c` when `shell`), `read_file`/`write_file`/`upload` are
  sandfleet's file calls (relative paths are relative to the sandbox's workdir).

Errors of the sandbox (`sandfleet.errors.SandboxError`) come out as SWE-ReX's exception types.
SWE-agent picks deployments from a closed union of configs, so it cannot select this one by config
alone: build it with `SandfleetDeploymentConfig(...).get_deployment()` and hand it to SWE-agent's
`SWEEnv(deployment=...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict
from swerex.deployment.abstract import AbstractDeployment
from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
from swerex.exceptions import (
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    DeploymentStartupError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (
    AbstractRuntime,
    Action,
    BashAction,
    BashInterruptAction,
    BashObservation,
    CloseBashSessionResponse,
    CloseResponse,
    CloseSessionRequest,
    CloseSessionResponse,
    Command,
    CommandResponse,
    CreateBashSessionResponse,
    CreateSessionRequest,
    CreateSessionResponse,
    IsAliveResponse,
    Observation,
    ReadFileRequest,
    ReadFileResponse,
    UploadRequest,
    UploadResponse,
    WriteFileRequest,
    WriteFileResponse,
)
from swerex.utils.log import get_logger

from sandfleet import AsyncClient, AsyncSandbox, SandboxSpec
from sandfleet.client.aio import AsyncEventStream, AsyncSession
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxTimeoutError,
    WrongStateError,
)
from sandfleet.models import ExecEvent

__all__ = ["SandfleetDeployment", "SandfleetDeploymentConfig", "SandfleetRuntime"]

_MAX_OUTPUT = 64 * 1024**2  # the most output the daemon keeps of one command


class SandfleetDeploymentConfig(BaseModel):
    """A sandfleet sandbox as a SWE-ReX deployment (`type: sandfleet`, in the style of SWE-ReX's
    `DockerDeploymentConfig`)."""

    image: str = "python:3.11"
    """The sandbox's image."""
    socket: str | None = None
    """The daemon's unix socket (None and no `url`: the default socket)."""
    url: str | None = None
    """The daemon's TCP URL (then `token` authenticates)."""
    token: str | None = None
    labels: dict[str, str] = {}
    """Labels of the sandbox (`fleet.list(labels=...)`, `fleet.stop_many(...)` find it by them)."""
    sandbox: dict[str, Any] = {}
    """More `SandboxSpec` fields: resources, network, env, workdir, mounts, idle_ttl, layers, backend, ..."""
    startup_timeout: float = 180.0
    """Seconds to wait for the sandbox (a full node's refusals are retried until then)."""
    runtime_timeout: float = 60.0
    """The client's deadline for calls that have none of their own."""
    output_limit: int | None = None
    """Bytes of output kept per command (None: the daemon's default, 1 MiB)."""

    type: Literal["sandfleet"] = "sandfleet"
    """Discriminator for (de)serialization/CLI, as SWE-ReX's configs have. Do not change."""

    model_config = ConfigDict(extra="forbid")

    def get_deployment(self) -> SandfleetDeployment:
        return SandfleetDeployment.from_config(self)


class SandfleetDeployment(AbstractDeployment):
    """Creates the sandbox on `start()`, stops it on `stop()`; `runtime` is its `SandfleetRuntime`."""

    def __init__(self, *, logger: logging.Logger | None = None, client: AsyncClient | None = None, **kwargs: Any):
        """See `SandfleetDeploymentConfig` for the keyword arguments. `client` reuses a connection to
        the daemon (left open by `stop()`); otherwise one is made on `start()`."""
        self.logger = logger or get_logger("rex-deploy")
        self._config = SandfleetDeploymentConfig(**kwargs)
        self._client = client
        self._owns_client = client is None
        self._sandbox: AsyncSandbox | None = None
        self._runtime: SandfleetRuntime | None = None
        self._hooks = CombinedDeploymentHook()

    @classmethod
    def from_config(cls, config: SandfleetDeploymentConfig) -> Self:
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> AsyncSandbox:
        """The sandbox, once started (raises `DeploymentNotStartedError` before)."""
        if self._sandbox is None:
            raise _not_started()
        return self._sandbox

    @property
    def runtime(self) -> SandfleetRuntime:
        if self._runtime is None:
            raise _not_started()
        return self._runtime

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        """Whether the sandbox is up (raises `DeploymentNotStartedError` before `start()`)."""
        return await self.runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        """Create the sandbox (a second call while it runs does nothing)."""
        if self._runtime is not None:
            return
        cfg = self._config
        if self._client is None:
            self._client = AsyncClient(cfg.socket, url=cfg.url, token=cfg.token, timeout=cfg.runtime_timeout)
        self._hooks.on_custom_step("Starting sandbox")
        spec = {"labels": cfg.labels, **cfg.sandbox}
        try:
            self._sandbox = await self._client.create(SandboxSpec(image=cfg.image, **spec), timeout=cfg.startup_timeout)
        except SandboxError as exc:
            await self._close_client()
            raise DeploymentStartupError(f"cannot start a sandbox from {cfg.image}: {exc}") from exc
        self.logger.info(f"Started sandbox {self._sandbox.id} from {cfg.image}")
        self._runtime = SandfleetRuntime(self._sandbox, logger=self.logger, output_limit=cfg.output_limit)

    async def stop(self) -> None:
        """Close the runtime's sessions and stop the sandbox; idempotent."""
        runtime, self._runtime = self._runtime, None
        sandbox, self._sandbox = self._sandbox, None
        try:
            if runtime is not None:
                await runtime.close()
            if sandbox is not None:
                try:
                    await sandbox.stop()
                except SandboxError as exc:
                    self.logger.warning(f"Failed to stop sandbox {sandbox.id}: {exc}")
        finally:
            await self._close_client()

    async def _close_client(self) -> None:
        if self._owns_client and self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def _file_not_found(path: str) -> FileNotFoundError:
    return FileNotFoundError(2, "No such file or directory", path)


def _not_started(msg: str = "Deployment not started") -> DeploymentNotStartedError:
    return DeploymentNotStartedError(msg)  # type: ignore[no-untyped-call]  # swerex's own signature is untyped


@contextlib.contextmanager
def _as_swerex(what: str) -> Iterator[None]:
    """Re-raise sandfleet's errors as SWE-ReX's (callers catch those)."""
    try:
        yield
    except SandboxTimeoutError as exc:
        raise CommandTimeoutError(f"{what}: {exc}") from exc
    except (SandboxNotFoundError, WrongStateError) as exc:
        raise _not_started(f"{what}: the sandbox is not running: {exc}") from exc
    except SandboxError as exc:
        raise SwerexException(f"{what}: {exc}") from exc


_ANSI = re.compile(r"\x1b(\[[0-?]*[ -/]*[@-~]|[@-Z\\-_])")


def _terminal_text(s: str) -> str:
    """A terminal's output as plain text (escape sequences gone, CRLF as LF)."""
    return _ANSI.sub("", s).replace("\r\n", "\n")


class _Foreground:
    """A command running in a session (a program left running by a timeout, an interactive one):
    its streamed output collected in the background, so each action can wait for what it expects
    without ending the stream."""

    def __init__(self, stream: AsyncEventStream[ExecEvent]) -> None:
        self.buffer = ""
        self.seen = 0  # what earlier actions consumed of `buffer`
        self.exit_code: int | None = None
        self.done = False
        self.error: SandboxError | None = None
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._pump(stream))

    async def _pump(self, stream: AsyncEventStream[ExecEvent]) -> None:
        try:
            async with stream:
                async for ev in stream:
                    if ev.type == "exit" and ev.result is not None:
                        self.exit_code = ev.result.exit_code
                    elif ev.type in ("stdout", "stderr"):
                        self.buffer += ev.data
                    self._changed.set()
        except SandboxError as exc:
            self.error = exc
        finally:
            self.done = True
            self._changed.set()

    def rest(self) -> str:
        """What no action consumed yet."""
        before, self.seen = self.buffer[self.seen :], len(self.buffer)
        return before

    async def expect(self, patterns: list[str], timeout: float | None, what: str) -> tuple[str, str]:
        """Wait for the first of `patterns` after what was consumed, or for the program to end:
        (the output before it, the pattern; "" for the end). Raises CommandTimeoutError."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            hits = [(i, p) for p in patterns if p and (i := self.buffer.find(p, self.seen)) >= 0]
            if hits:
                at, pattern = min(hits)
                before, self.seen = self.buffer[self.seen : at], at + len(pattern)
                return before, pattern
            if self.done:
                if self.error is not None:
                    with _as_swerex(what):
                        raise self.error
                return self.rest(), ""
            self._changed.clear()
            left = None if deadline is None else deadline - loop.time()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError as exc:
                raise CommandTimeoutError(f"timeout after {timeout} seconds while running command {what!r}") from exc

    async def cancel(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, SandboxError):
            await self._task


class _BashSession:
    """One SWE-ReX bash session: a sandfleet session, and the interactive program in it, if any."""

    def __init__(self, runtime: SandfleetRuntime, session: AsyncSession) -> None:
        self.rt = runtime
        self.session = session
        self.last_exit = 0
        self.foreground: _Foreground | None = None
        self.pending = ""  # what an ended command printed after the last observation

    def _start(self, command: str) -> _Foreground:
        stream = self.session.run_stream(command, merge_stderr=True, timeout=None, output_limit=self.rt.output_limit)
        self.foreground = _Foreground(stream)
        return self.foreground

    def _ended(self, fg: _Foreground) -> None:
        """The foreground command is over: its exit code is the session's, its unread output the next one's."""
        self.foreground = None
        self.pending += _terminal_text(fg.rest())
        self.last_exit = fg.exit_code if fg.exit_code is not None else self.last_exit

    def _take_pending(self) -> str:
        out, self.pending = self.pending, ""
        return out

    async def run(self, action: BashAction | BashInterruptAction) -> BashObservation:
        if isinstance(action, BashInterruptAction):
            return await self._interrupt(action)
        if action.is_interactive_command or action.is_interactive_quit:
            return await self._interactive(action)
        if self.foreground is not None and not self.foreground.done:
            raise SwerexException(
                f"session {action.session!r} runs an interactive program: send it interactive actions, or interrupt it"
            )
        obs = await self._normal(action)
        if action.check == "raise" and obs.exit_code != 0:
            msg = (
                f"Command {action.command!r} failed with exit code {obs.exit_code}. Here is the output:\n{obs.output!r}"
            )
            raise NonZeroExitCodeError(f"{action.error_msg}: {msg}" if action.error_msg else msg)
        return obs

    async def _normal(self, action: BashAction) -> BashObservation:
        if self.foreground is not None and self.foreground.done:
            self._ended(self.foreground)
        if not action.command.strip():  # an empty line: nothing runs, $? stays
            return BashObservation(exit_code=None if action.check == "ignore" else self.last_exit)
        await self._check_syntax(action.command)
        with _as_swerex(f"running {action.command!r}"):
            fg = self._start(action.command)
        before, _ = await fg.expect([], action.timeout, action.command)  # CommandTimeoutError: it runs on
        self._ended(fg)
        output = self._take_pending() + _terminal_text(before)
        return BashObservation(output=output, exit_code=None if action.check == "ignore" else self.last_exit)

    async def _check_syntax(self, command: str) -> None:
        """SWE-ReX refuses a command its shell cannot parse before running any of it."""
        with _as_swerex("checking the command's syntax"):
            r = await self.rt.sandbox.exec([self.session.info.shell, "-n"], stdin=command + "\n", timeout=30)
        if r.exit_code != 0:
            msg = (
                f"Error (exit code {r.exit_code}) while checking bash command \n{command!r}\n"
                f"---- Stderr ----\n{r.stderr}\n---- Stdout ----\n{r.stdout}"
            )
            raise BashIncorrectSyntaxError(msg, extra_info={"bash_stdout": r.stdout, "bash_stderr": r.stderr})

    async def _interactive(self, action: BashAction) -> BashObservation:
        fg = self.foreground
        with _as_swerex(f"running {action.command!r}"):
            if fg is None or fg.done:
                if fg is not None:
                    self._ended(fg)
                fg = self._start(action.command)
            else:
                await self.session.write_stdin(action.command + "\n")
        before, matched = await fg.expect(action.expect, action.timeout, action.command)
        if fg.done and not matched:
            self._ended(fg)
        # A terminal echoes what was typed: the output is what follows it.
        before = self._take_pending() + _terminal_text(before)
        output = before.lstrip().removeprefix(action.command.strip()).strip()
        return BashObservation(output=output, exit_code=0, expect_string=matched)

    async def _interrupt(self, action: BashInterruptAction) -> BashObservation:
        fg = self.foreground
        if fg is None or fg.done:
            if fg is not None:
                self._ended(fg)
            return BashObservation(output=self._take_pending().strip(), exit_code=0)
        for _ in range(action.n_retry):
            with _as_swerex("interrupting the session"):
                await self.session.write_stdin("\x03")  # ^C: the terminal's SIGINT to the command
            try:
                before, matched = await fg.expect(action.expect, action.timeout, "interrupt")
            except CommandTimeoutError:
                continue
            if fg.done:
                self._ended(fg)
            output = self._take_pending() + _terminal_text(before)
            return BashObservation(output=output.strip(), exit_code=0, expect_string=matched)
        # As SWE-ReX: suspend it (^Z: job control gives the shell the terminal back) and kill the job.
        with _as_swerex("interrupting the session"):
            await self.session.write_stdin("\x1a")
        try:
            before, _ = await fg.expect([], max(action.timeout, 5.0), "interrupt")
        except CommandTimeoutError:  # it would not stop either: the daemon kills what the shell runs
            await fg.cancel()
            before = fg.rest()
        self._ended(fg)
        output = self._take_pending() + _terminal_text(before)
        with _as_swerex("interrupting the session"):
            r = await self.session.run("kill -9 %%", timeout=30, merge_stderr=True)
        self.pending += _terminal_text(r.stdout)  # the shell's notice of the killed job: for the next one, as there
        return BashObservation(output=output.strip(), exit_code=0, expect_string="")

    async def close(self) -> None:
        if self.foreground is not None:
            await self.foreground.cancel()
        with contextlib.suppress(NotFoundError):  # its sandbox is gone: so is the shell
            await self.session.close()


class SandfleetRuntime(AbstractRuntime):
    """SWE-ReX's runtime interface over one sandfleet sandbox. `close()` closes its sessions; the
    sandbox is the deployment's to stop."""

    def __init__(
        self, sandbox: AsyncSandbox, *, logger: logging.Logger | None = None, output_limit: int | None = None
    ) -> None:
        self.sandbox = sandbox
        self.output_limit = output_limit
        self.logger = logger or get_logger("rex-runtime")
        self._sessions: dict[str, _BashSession] = {}

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        try:
            info = await asyncio.wait_for(self.sandbox.refresh(), timeout)
        except (SandboxError, TimeoutError) as exc:
            return IsAliveResponse(is_alive=False, message=f"{type(exc).__name__}: {exc}")
        if info.state in ("running", "paused"):  # a paused sandbox resumes on the next request
            return IsAliveResponse(is_alive=True)
        return IsAliveResponse(is_alive=False, message=f"sandbox {info.id} is {info.state}")

    async def create_session(self, request: CreateSessionRequest) -> CreateSessionResponse:
        if request.session in self._sessions:
            raise SessionExistsError(f"session {request.session} already exists")
        with _as_swerex(f"creating session {request.session!r}"):
            session = _BashSession(self, await self.sandbox.session(pty=True))
        self._sessions[request.session] = session
        output = ""
        if request.startup_source:
            sources = " ; ".join(f"source {shlex.quote(p)}" for p in request.startup_source)
            with _as_swerex(f"starting session {request.session!r}"):
                r = await session.session.run(sources, timeout=max(request.startup_timeout, 1.0), merge_stderr=True)
            output = _terminal_text(r.stdout)
        return CreateBashSessionResponse(output=output)

    def _session(self, name: str) -> _BashSession:
        if name not in self._sessions:
            raise SessionDoesNotExistError(f"session {name!r} does not exist")
        return self._sessions[name]

    async def run_in_session(self, action: Action) -> Observation:
        return await self._session(action.session).run(action)

    async def close_session(self, request: CloseSessionRequest) -> CloseSessionResponse:
        session = self._session(request.session)
        del self._sessions[request.session]
        with _as_swerex(f"closing session {request.session!r}"):
            await session.close()
        return CloseBashSessionResponse()

    async def execute(self, command: Command) -> CommandResponse:
        """One process, as `subprocess.run(command.command, shell=command.shell, ...)` would run it;
        `env` adds to the sandbox's environment (it does not replace it)."""
        cmd = command.command
        if command.shell:
            argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else ["/bin/sh", "-c", *cmd]
        else:
            argv = [cmd] if isinstance(cmd, str) else list(cmd)
        with _as_swerex(f"running {cmd!r}"):
            try:
                r = await self.sandbox.exec(
                    argv,
                    env=command.env,
                    cwd=command.cwd,
                    timeout=command.timeout,
                    merge_stderr=command.merge_output_streams,
                    output_limit=self.output_limit,
                )
            except InvalidArgumentError as exc:  # what subprocess.run raises for a command it cannot start
                raise ValueError(str(exc)) from exc
        if r.timed_out:
            raise CommandTimeoutError(f"Timeout ({command.timeout}s) exceeded while running command")
        response = CommandResponse(stdout=r.stdout, stderr=r.stderr, exit_code=r.exit_code)
        if command.check and r.exit_code != 0:
            msg = f"Command {cmd!r} failed with exit code {r.exit_code}. Stdout:\n{r.stdout!r}\nStderr:\n{r.stderr!r}"
            raise NonZeroExitCodeError(f"{command.error_msg}: {msg}" if command.error_msg else msg)
        return response

    async def read_file(self, request: ReadFileRequest) -> ReadFileResponse:
        """The file as text (`Path.read_text` semantics: UTF-8 unless `encoding`; a missing file
        raises FileNotFoundError, as SWE-ReX's runtimes do)."""
        with _as_swerex(f"reading {request.path}"):
            try:
                data = await self.sandbox.files.read(request.path)
            except PermissionDeniedError:  # e.g. under a bind mount: the sandbox's own `cat` can
                data = await self._read_by_command(request.path)
            except SandboxNotFoundError:
                raise
            except NotFoundError as exc:
                raise _file_not_found(request.path) from exc
        return ReadFileResponse(content=data.decode(request.encoding or "utf-8", request.errors or "strict"))

    async def write_file(self, request: WriteFileRequest) -> WriteFileResponse:
        """Write the text, making missing parent directories."""
        with _as_swerex(f"writing {request.path}"):
            await self._write(request.path, request.content.encode())
        return WriteFileResponse()

    async def upload(self, request: UploadRequest) -> UploadResponse:
        """A local file or directory into the sandbox, as `shutil.copy` / `shutil.copytree` would:
        a directory becomes `target_path`; a file becomes `target_path`, or goes into it if that is
        a directory."""
        source = Path(request.source_path)
        with _as_swerex(f"uploading {source} to {request.target_path}"):
            if await asyncio.to_thread(source.is_dir):
                try:
                    await self.sandbox.files.upload(source, request.target_path)
                except PermissionDeniedError:
                    for local in await asyncio.to_thread(lambda: sorted(p for p in source.rglob("*") if p.is_file())):
                        dest = posixpath.join(request.target_path, *local.relative_to(source).parts)
                        await self._write(dest, await asyncio.to_thread(local.read_bytes), local.stat().st_mode)
                return UploadResponse()
            target = request.target_path
            with contextlib.suppress(NotFoundError, PermissionDeniedError):
                if (await self.sandbox.files.stat(target, follow_symlinks=True)).type == "dir":
                    target = posixpath.join(target, source.name)
            data, st = await asyncio.to_thread(lambda: (source.read_bytes(), source.stat()))
            await self._write(target, data, st.st_mode)
        return UploadResponse()

    async def _write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        try:
            await self.sandbox.files.write(path, data, mode=mode & 0o7777)
        except PermissionDeniedError:  # e.g. under a bind mount: the sandbox's own shell can
            await self._write_by_command(path, data, mode & 0o7777)

    # sandfleet's file calls refuse paths that cross a mount point (a bind mount of the host's, say);
    # commands run inside the sandbox see its mounts as its programs do.

    async def _read_by_command(self, path: str) -> bytes:
        r = await self.sandbox.exec(["cat", "--", path], binary=True, timeout=120, output_limit=_MAX_OUTPUT)
        if r.exit_code != 0:
            if "No such file" in r.stderr_bytes.decode(errors="replace"):
                raise _file_not_found(path)
            raise SwerexException(f"cannot read {path}: {r.stderr_bytes.decode(errors='replace').strip()}")
        if r.stdout_truncated:
            raise SwerexException(f"cannot read {path}: larger than {_MAX_OUTPUT} bytes")
        return r.stdout_bytes

    async def _write_by_command(self, path: str, data: bytes, mode: int) -> None:
        script = 'mkdir -p -- "$(dirname -- "$1")" && cat > "$1" && chmod "$2" "$1"'
        r = await self.sandbox.exec(["sh", "-c", script, "sh", path, f"{mode:o}"], stdin=data, timeout=120)
        if r.exit_code != 0:
            raise SwerexException(f"cannot write {path}: {r.stderr.strip()}")

    async def close(self) -> CloseResponse:
        """Close every session (their shells and programs end); the sandbox keeps running."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            with contextlib.suppress(SandboxError):
                await session.close()
        return CloseResponse()
