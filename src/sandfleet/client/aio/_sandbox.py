"""`AsyncSandbox`: one sandbox, its lifecycle, network, ports, snapshots and forks, and the commands
run in it (exec, streams, terminals, background processes, sessions)."""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

from sandfleet.client import _base as b
from sandfleet.client._base import UNSET, Unset
from sandfleet.client.aio._files import AsyncFiles
from sandfleet.client.aio._processes import AsyncProcess, AsyncSession
from sandfleet.client.aio._terminal import AsyncTerminal
from sandfleet.errors import SandboxError, SandboxNotFoundError
from sandfleet.models import (
    CheckpointInfo,
    CheckpointList,
    CheckpointRequest,
    CreateBatchResult,
    EventList,
    ExecEvent,
    ExecResult,
    ExposedPort,
    ExposedPortList,
    ImageInfo,
    NetworkPolicy,
    ProcessInfo,
    ProcessList,
    RollbackRequest,
    RollbackResult,
    SandboxEvent,
    SandboxInfo,
    SessionInfo,
    SessionList,
    SetLabelsRequest,
    SnapshotInfo,
    TerminalSize,
    Usage,
    VerifyRequest,
    VerifyResult,
)

if TYPE_CHECKING:
    from sandfleet.client.aio._client import AsyncClient
    from sandfleet.client.aio._http import AsyncEventStream


class AsyncSandbox:
    def __init__(self, client: AsyncClient, info: SandboxInfo) -> None:
        self._c = client
        self.info = info
        self.id = info.id
        self.files = AsyncFiles(self)

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.state}>"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            await self.stop()
        except SandboxError:
            if et is None:
                raise

    async def refresh(self) -> SandboxInfo:
        self.info = await self._c._model(SandboxInfo, b.Call("GET", b.sandbox_path(self.id)))
        return self.info

    async def usage(self) -> Usage:
        """Current and peak memory, CPU seconds, tasks and limit hits (does not resume a paused sandbox)."""
        return await self._c._model(Usage, b.Call("GET", b.sandbox_path(self.id) + "/usage"))

    async def pause(self) -> SandboxInfo:
        """Freeze the sandbox and push its memory out; any later request resumes it transparently."""
        self.info = await self._c._model(SandboxInfo, b.Call("POST", b.sandbox_path(self.id) + "/pause"))
        return self.info

    async def resume(self) -> SandboxInfo:
        self.info = await self._c._model(SandboxInfo, b.Call("POST", b.sandbox_path(self.id) + "/resume"))
        return self.info

    async def set_network(self, network: NetworkPolicy | str | Sequence[str] | Mapping[str, bool]) -> SandboxInfo:
        """Make `network` the sandbox's egress policy, at once: "none", or the services and
        host[:port] patterns it may reach (`["pypi"]`, `{"pypi": True}`); connections the new policy
        does not allow are closed."""
        self.info = await self._c._model(SandboxInfo, b.call_set_network(self.id, b.network_policy(network)))
        return self.info

    async def set_labels(self, labels: Mapping[str, str]) -> SandboxInfo:
        """Make `labels` the sandbox's labels (all of them: one left out is removed); lists and
        label-wide calls (stop, pause, lifetimes, network) select by them at once. Labels under
        `sandfleet.` are the node's own: kept, and not settable."""
        req = b.validated(SetLabelsRequest, "labels", {"labels": dict(labels)})
        self.info = await self._c._model(SandboxInfo, b.operation_call("set_labels", req, sandbox_id=self.id))
        return self.info

    async def expose(self, port: int) -> ExposedPort:
        """Reach a server listening on 127.0.0.1:`port` inside the sandbox: over HTTP at `url` (the
        daemon's API, its token required), or as a byte stream at `socket` (a unix socket on the
        node, root's). Closed with the sandbox, or by `unexpose`."""
        return b.exposed(self._c._http.base_url, await self._c._model(ExposedPort, b.call_expose(self.id, port)))

    async def unexpose(self, port: int) -> None:
        await self._c._send(b.Call("DELETE", b.sandbox_path(self.id) + f"/ports/{int(port)}"))

    async def ports(self) -> builtins.list[ExposedPort]:
        """The ports this sandbox exposes."""
        found = await self._c._model(ExposedPortList, b.Call("GET", b.sandbox_path(self.id) + "/ports"))
        return [b.exposed(self._c._http.base_url, p) for p in found.ports]

    async def set_lifetime(
        self,
        *,
        idle_ttl: float | None | Unset = UNSET,
        max_lifetime: float | None | Unset = UNSET,
        pause_after: float | None | Unset = UNSET,
    ) -> SandboxInfo:
        """Change this sandbox's idle TTL, max lifetime (seconds after creation, not after this call)
        and/or idle seconds before a pause. Only the limits given change; None removes that limit."""
        call = b.call_set_lifetime(self.id, idle_ttl, max_lifetime, pause_after)
        self.info = await self._c._model(SandboxInfo, call)
        return self.info

    async def snapshot(
        self, *, ttl: float | None = None, labels: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> SnapshotInfo:
        """Checkpoint processes, memory and files; the sandbox keeps running (a paused one stays paused).
        The snapshot outlives the sandbox: kept `ttl` seconds (default: the node's retention) or until
        deleted; `labels` are its own. Waits up to `timeout` seconds (default: the client's)."""
        call = b.call_snapshot(self.id, ttl, labels, b.check_timeout(timeout, self._c.timeout))
        return await self._c._model(SnapshotInfo, call)

    async def checkpoint(
        self, *, labels: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> CheckpointInfo:
        """Record this sandbox's state (processes and their memory, files, sessions and background
        processes) to come back to with `rollback`; it keeps running. Checkpoints belong to the
        sandbox: the oldest go past 32 or past its disk, and all go when it stops."""
        req = b.validated(CheckpointRequest, "checkpoint request", {"labels": dict(labels or {})})
        call = b.operation_call(
            "checkpoint", req, timeout=b.check_timeout(timeout, self._c.timeout), sandbox_id=self.id
        )
        return await self._c._model(CheckpointInfo, call)

    async def checkpoints(self) -> builtins.list[CheckpointInfo]:
        """This sandbox's checkpoints, oldest first."""
        call = b.operation_call("list_checkpoints", sandbox_id=self.id)
        return (await self._c._model(CheckpointList, call)).checkpoints

    async def rollback(self, checkpoint: str | CheckpointInfo, *, timeout: float | None = None) -> RollbackResult:
        """Put this sandbox back to `checkpoint`, in place: the same id, and the sessions and
        background processes it had then (their handles go on working); files, memory, cwd and env
        as they were. What was opened after it is gone (the result lists it)."""
        cid = checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint
        req = b.validated(RollbackRequest, "rollback request", {"checkpoint_id": cid})
        call = b.operation_call("rollback", req, timeout=b.check_timeout(timeout, self._c.timeout), sandbox_id=self.id)
        return await self._c._model(RollbackResult, call)

    async def delete_checkpoint(self, checkpoint: str | CheckpointInfo) -> None:
        cid = checkpoint.id if isinstance(checkpoint, CheckpointInfo) else checkpoint
        await self._c._send(b.operation_call("delete_checkpoint", sandbox_id=self.id, checkpoint_id=cid))

    async def pack(self, image: str, *, exclude: Sequence[str] = (), timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Save this sandbox's changes as image `name:tag` (its layers + one new layer); `exclude`d paths
        keep their base content. Create sandboxes from it with `fleet.create(image=...)`. A build:
        waits up to `timeout` seconds (default 30 minutes, whatever the client's timeout)."""
        return await self._c._model(ImageInfo, b.call_pack(self.id, image, exclude, b.check_timeout(timeout, 0)))

    async def fork(
        self,
        count: int = 1,
        labels: Mapping[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> builtins.list[AsyncSandbox | SandboxError]:
        """`count` copies of this sandbox as it is now, each isolated from it and from each other (with
        its sessions and background processes, under the same ids). A lost answer is retried with
        the same idempotency key (given, or a fresh one) within `timeout` (default: the client's)."""
        attempts = b.CreateAttempts(b.idempotency_key(idempotency_key))
        deadline = b.Deadline(b.check_timeout(timeout, self._c.timeout))
        reply = await self._c._retrying(
            lambda key, t: b.call_fork(self.id, count, labels, key, t),
            CreateBatchResult,
            attempts,
            deadline,
            refusals=False,
        )
        return self._c._batch(reply)

    async def verify(self, command: str | builtins.list[str] | VerifyRequest, **options: Any) -> VerifyResult:
        """Run a task's checks in a fresh sandbox: this one's pre-agent state (its image and layers),
        plus what was changed in it, plus verifier-only `layers` (hidden tests) that this sandbox
        never sees; changes under `protect` paths are dropped first. Options: VerifyRequest's fields.
        The result says whether they passed, the reward, whose fault a failure was, what changed."""
        req = b.verify_request(command, options)
        call = b.Call(
            "POST",
            b.sandbox_path(self.id) + "/verify",
            json=req.model_dump(mode="json", exclude_defaults=True),
            timeout=b.verify_timeout(req),
        )
        return await self._c._model(VerifyResult, call)

    async def stop(self, reason: str = "user") -> SandboxInfo:
        """Stop the sandbox; stopping one that is already gone (TTL, stop_many) is not an error."""
        try:
            self.info = await self._c._model(
                SandboxInfo, b.Call("DELETE", b.sandbox_path(self.id), json={"reason": reason})
            )
        except SandboxNotFoundError:
            self.info = self.info.model_copy(update={"state": "stopped"})
        return self.info

    async def exec(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        pty: bool | TerminalSize = False,
        cpu_time: float | None = None,
    ) -> ExecResult:
        """Run a command to completion. A string runs under /bin/sh -c; a list is an argv.

        `cwd` may be relative (to the sandbox's working directory). `stdin` is text, or bytes.
        `merge_stderr` sends standard error into stdout (one stream, in order). `binary` returns
        output as base64 of the raw bytes: read `result.stdout_bytes` / `stderr_bytes`. `pty` (True,
        or a `TerminalSize`; default 24x80) runs it on a new pseudo-terminal: one output stream
        (`stdout`, with the terminal's CR LF line ends), `stdin` typed into it, TERM=xterm-256color.
        `timeout` (seconds, None: none) kills the command's process tree. A command whose timeout is
        None or longer than the client's is streamed, so a daemon that stops answering raises
        `SandboxTimeoutError` after the client's timeout of silence rather than hanging. `cpu_time`
        (CPU seconds) kills it once it has used that much CPU, however long a busy node made it wait.
        """
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                pty=pty,
                cpu_time=cpu_time,
            ),
        )
        if b.one_response(timeout, self._c.timeout):
            return await self._c._model(ExecResult, b.call_exec(self.id, body, self._c.timeout))
        return await self._c._streamed_result(b.call_exec(self.id, body, self._c.timeout, stream=True))

    async def run_code(
        self,
        code: str,
        *,
        language: Literal["python", "bash"] = "python",
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        output_limit: int | None = None,
        binary: bool = False,
    ) -> ExecResult:
        """A stateless call on this worker (a sandbox of the fncall tier): like `AsyncClient.run_code`,
        against the state this worker was set up with (its files and installed packages, read-only
        to the call)."""
        body = b.run_code_body(
            code,
            b.CommandOptions(stdin=stdin, env=env, timeout=timeout, output_limit=output_limit, binary=binary),
            language=language,
            files=files,
        )
        return await self._c._model(ExecResult, b.call_run_code(self.id, body, self._c.timeout))

    def exec_stream(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        pty: bool | TerminalSize = False,
    ) -> AsyncEventStream[ExecEvent]:
        """Stream the command's stdout/stderr chunks as they arrive, then one `exit` event with the
        result (options as `exec`; with `binary`, each chunk's `data` is base64): `async for ev in
        sb.exec_stream(cmd)`. The command starts at the first iteration (or `async with`); heartbeats
        are swallowed; a daemon silent for the client's timeout raises `SandboxTimeoutError`. Leaving
        early (`async with`, `aclose()`) closes the stream and the daemon kills the command."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                pty=pty,
            ),
        )
        return self._c._events(b.call_exec(self.id, body, self._c.timeout, stream=True), b.exec_event)

    async def terminal(
        self,
        command: str | builtins.list[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
    ) -> AsyncTerminal:
        """An interactive terminal: `command` (default: the user's login shell) on a new
        pseudo-terminal of `rows` x `cols`, over a WebSocket. `async with await sb.terminal() as t:
        await t.send("ls\\r"); print(await t.expect(b"$ "))`. Keystrokes are bytes as a keyboard sends
        them ("\\x03" is Ctrl-C: the foreground job gets SIGINT); `resize()` changes the window
        (SIGWINCH). `timeout` (seconds; None: while connected) kills it as in `exec`; `output_limit`
        (bytes forwarded in all) is none by default: output not read holds the command back, as a
        terminal does. Closing the terminal kills what still runs on it."""
        options = b.CommandOptions(env=env, cwd=cwd, user=user, timeout=timeout, output_limit=output_limit)
        start = b.terminal_start(command, options, rows=rows, cols=cols)
        term = AsyncTerminal(self)
        await term._open(start)
        return term

    async def start(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        timeout: float | None = None,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        cpu_time: float | None = None,
    ) -> AsyncProcess:
        """Start a background process (its own session); returns a handle to wait on, kill or feed.
        `stdin` is written first; with `keep_stdin_open` its standard input then stays open for
        `process.write_stdin(...)` until `process.close_stdin()`. `timeout` and `cpu_time` as in exec."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                cpu_time=cpu_time,
            ),
        )
        return AsyncProcess(self, await self._c._model(ProcessInfo, b.call_start(self.id, body)))

    def start_stream(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        timeout: float | None = None,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        cpu_time: float | None = None,
    ) -> AsyncEventStream[ExecEvent]:
        """`start` and the process's `output()` in one call: a `started` event carrying the process
        (its `process`: kill it, feed it, wait on it through `AsyncProcess(sb, event.process)`), then its
        output as it comes and one `exit`. Leaving the stream early does not stop the process."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                cpu_time=cpu_time,
            ),
        )
        return self._c._events(b.call_start_stream(self.id, body), b.exec_event)

    async def processes(self) -> builtins.list[ProcessInfo]:
        """The sandbox's background processes (running and finished)."""
        return (await self._c._model(ProcessList, b.Call("GET", b.sandbox_path(self.id) + "/processes"))).processes

    async def session(
        self,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: bool | TerminalSize = False,
    ) -> AsyncSession:
        """Open a persistent shell: commands share cwd, environment and shell variables. With `pty`
        (True, or a `TerminalSize`) the shell runs on a pseudo-terminal: each command's output is one
        stream (`stdout`, CRLF line ends), its stdin is the terminal (`write_stdin` types into it:
        "\\x03" is ^C) and programs see a terminal (pagers, REPLs); `run` still returns each command's
        own output and exit code."""
        info = await self._c._model(
            SessionInfo, b.call_session_create(self.id, b.CommandOptions(env=env, cwd=cwd, user=user, pty=pty))
        )
        return AsyncSession(self, info)

    async def sessions(self) -> builtins.list[SessionInfo]:
        """The sandbox's open sessions (a fork or restore child has its parent's, under the same ids)."""
        return (await self._c._model(SessionList, b.Call("GET", b.sandbox_path(self.id) + "/sessions"))).sessions

    async def attach_session(self, session_id: str) -> AsyncSession:
        """A handle on an existing session (opened by another process, or inherited by a fork child)."""
        info = await self._c._model(SessionInfo, b.Call("GET", b.session_path(self.id, session_id)))
        return AsyncSession(self, info)

    async def events(self, after: int = 0) -> builtins.list[SandboxEvent]:
        """The sandbox's event log after sequence number `after`."""
        call = b.Call("GET", b.sandbox_path(self.id) + "/events", params={"after": after})
        return (await self._c._model(EventList, call)).events
