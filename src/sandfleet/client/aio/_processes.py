"""Handles on what runs in a sandbox: `AsyncProcess` (a background process) and `AsyncSession` (a
persistent shell)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sandfleet.client import _base as b
from sandfleet.models import ExecEvent, ExecResult, Ok, ProcessInfo, SessionInfo

if TYPE_CHECKING:
    from sandfleet.client.aio._http import AsyncEventStream
    from sandfleet.client.aio._sandbox import AsyncSandbox


class AsyncProcess:
    def __init__(self, sandbox: AsyncSandbox, info: ProcessInfo) -> None:
        self._sb = sandbox
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"<AsyncProcess {self.id} in {self._sb.id}>"

    async def wait(self, timeout: float = 60.0) -> ProcessInfo:
        """Wait up to `timeout` seconds for the process to exit: its info, with `result` once it has
        (`running` stays True if it is still running then). Raises `WrongStateError` if its sandbox
        stopped before it finished."""
        self.info = b.finished(await self._sb._c._model(ProcessInfo, b.call_wait(self._sb.id, self.id, timeout)))
        return self.info

    def output(self) -> AsyncEventStream[ExecEvent]:
        """The process's output as it comes: what it printed so far, each stdout/stderr chunk after,
        then one `exit` event with its result (heartbeats swallowed). Several may follow one process."""
        return self._sb._c._events(b.call_output(self._sb.id, self.id), b.exec_event)

    async def kill(self, signal: int = 9) -> ProcessInfo:
        """Send `signal` to the process's tree; its state once the signal took effect."""
        self.info = await self._sb._c._model(ProcessInfo, b.call_kill(self._sb.id, self.id, signal))
        return self.info

    async def write_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        """Write to the process's standard input (started with `keep_stdin_open=True`); `close`
        then closes it."""
        await self._sb._c._model(Ok, b.call_stdin(b.process_path(self._sb.id, self.id), b.as_bytes(data), close))

    async def close_stdin(self) -> None:
        """Close the process's standard input (it reads end-of-file)."""
        await self.write_stdin(b"", close=True)


class AsyncSession:
    def __init__(self, sandbox: AsyncSandbox, info: SessionInfo) -> None:
        self._sb = sandbox
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"<AsyncSession {self.id} in {self._sb.id}>"

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def refresh(self) -> SessionInfo:
        """The session's current info (`busy` while a command runs in it)."""
        self.info = await self._sb._c._model(SessionInfo, b.Call("GET", b.session_path(self._sb.id, self.id)))
        return self.info

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        merge_stderr: bool = False,
        binary: bool = False,
    ) -> ExecResult:
        """Run a command in the session's shell (its cwd, environment and variables carry over).

        `stdin` (text or bytes) is fed to the command; with `keep_stdin_open` its standard input stays
        open for `session.write_stdin(...)` until `session.close_stdin()`. `merge_stderr` and `binary`
        as `exec`. A timed-out command is killed, the shell lives on. A command whose timeout is None
        or longer than the client's is streamed (heartbeats prove the daemon alive), so a daemon that
        stops answering raises `SandboxTimeoutError` after the client's timeout of silence.
        """
        body = b.session_run_body(
            command,
            b.CommandOptions(
                timeout=timeout,
                output_limit=output_limit,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                merge_stderr=merge_stderr,
                binary=binary,
            ),
        )
        c = self._sb._c
        if b.one_response(timeout, c.timeout):
            return await c._model(ExecResult, b.call_session_run(self._sb.id, self.id, body, c.timeout))
        return await c._streamed_result(b.call_session_run(self._sb.id, self.id, body, c.timeout, stream=True))

    def run_stream(
        self,
        command: str,
        *,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        merge_stderr: bool = False,
        binary: bool = False,
    ) -> AsyncEventStream[ExecEvent]:
        """`run`, streaming stdout/stderr chunks as they arrive, then one `exit` event with the result
        (heartbeats swallowed; see `exec_stream`)."""
        body = b.session_run_body(
            command,
            b.CommandOptions(
                timeout=timeout,
                output_limit=output_limit,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                merge_stderr=merge_stderr,
                binary=binary,
            ),
        )
        c = self._sb._c
        return c._events(b.call_session_run(self._sb.id, self.id, body, c.timeout, stream=True), b.exec_event)

    async def write_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        """Write to the standard input of the command running in the session (started with `stdin`
        or `keep_stdin_open`); `close` then closes it."""
        call = b.call_stdin(b.session_path(self._sb.id, self.id), b.as_bytes(data), close)
        await self._sb._c._model(Ok, call)

    async def close_stdin(self) -> None:
        """Close the running command's standard input (it reads end-of-file)."""
        await self.write_stdin(b"", close=True)

    async def close(self) -> None:
        await self._sb._c._send(b.Call("DELETE", b.session_path(self._sb.id, self.id)))
