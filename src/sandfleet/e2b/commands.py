"""envd's process.Process over sandfleet: a command is a background process (its output followed as
it comes), a command on a PTY a sandfleet terminal held by this server while its Start stream lasts."""

from __future__ import annotations

import asyncio
import base64
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

from sandfleet.client.aio import AsyncEventStream, AsyncProcess, AsyncSandbox
from sandfleet.e2b._proto import process_pb2 as pp
from sandfleet.e2b._upstream import Upstream, envd_key, envd_user, owner, resolve
from sandfleet.e2b.ptys import Pty, Ptys
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    SandboxTimeoutError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.models import ExecEvent, ExecResult, ProcessInfo

CHUNK = 1 << 16  # output bytes per data event
SIGNALS = {pp.SIGNAL_SIGKILL: signal.SIGKILL, pp.SIGNAL_SIGTERM: signal.SIGTERM}


def pid_of(process_id: str) -> int:
    """A background process's number as envd's callers know it (sandfleet's ids are `p-` and 12 hex
    digits; a terminal's command has its own pid, small, where these are large)."""
    return (int(process_id[2:10], 16) & 0x7FFFFFFF) or 1


def _argv(command: str | list[str]) -> list[str]:
    return command if isinstance(command, list) else ["/bin/sh", "-c", command]


class Processes:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._ptys = Ptys()

    def close(self) -> None:
        self._ptys.close()

    def _sandbox(self, ctx: Any) -> tuple[AsyncSandbox, str]:
        headers = ctx.request_headers
        return self.upstream.envd_sandbox(headers), owner(envd_key(headers))

    def _pty(self, sb: AsyncSandbox, who: str, selector: pp.ProcessSelector) -> Pty | None:
        if selector.WhichOneof("selector") != "pid":
            return None
        return self._ptys.get((who, sb.id, selector.pid))

    async def _find(self, sb: AsyncSandbox, selector: pp.ProcessSelector) -> AsyncProcess:
        if selector.WhichOneof("selector") != "pid":
            raise NotFoundError("a process is found by its pid here (tags are not kept)")
        for info in await sb.processes():
            if pid_of(info.id) == selector.pid and info.running:
                return AsyncProcess(sb, info)
        raise NotFoundError(f"process with pid {selector.pid} not found")

    async def List(self, req: pp.ListRequest, ctx: Any) -> pp.ListResponse:
        sb, who = self._sandbox(ctx)
        found = [_info(p) for p in await sb.processes() if p.running]
        for pid, pty in self._ptys.of(who, sb.id):
            found.append(pp.ProcessInfo(config=pp.ProcessConfig(cmd=pty.argv[0], args=pty.argv[1:]), pid=pid))
        return pp.ListResponse(processes=found)

    async def Start(self, req: pp.StartRequest, ctx: Any) -> AsyncIterator[pp.StartResponse]:
        sb, who = self._sandbox(ctx)
        config = req.process
        argv = [config.cmd, *config.args]
        env = dict(config.envs) or None
        cwd = resolve(config.cwd) if config.HasField("cwd") else None
        user = envd_user(ctx.request_headers)
        if req.HasField("pty"):
            async for event in self._start_pty(sb, who, argv, env, cwd, user, req.pty.size):
                yield pp.StartResponse(event=event)
            return
        # One call: the process started and its output followed (a second call would add its trip).
        events = sb.start_stream(argv, env=env, cwd=cwd, user=user, keep_stdin_open=req.stdin, binary=True)
        async for event in _bounded(_events(events), ctx.timeout_ms):
            yield pp.StartResponse(event=event)

    async def _start_pty(
        self,
        sb: AsyncSandbox,
        who: str,
        argv: list[str],
        env: dict[str, str] | None,
        cwd: str | None,
        user: str | None,
        size: Any,
    ) -> AsyncIterator[pp.ProcessEvent]:
        """A terminal held here until its command exits: leaving this stream does not end it."""
        rows, cols = size.rows or 24, size.cols or 80
        pid, pty = await self._ptys.open(sb, who, argv, rows, cols, env=env, cwd=cwd, user=user)
        yield pp.ProcessEvent(start=pp.ProcessEvent.StartEvent(pid=pid))
        async for event in _pty_events(pty):
            yield event

    async def Connect(self, req: pp.ConnectRequest, ctx: Any) -> AsyncIterator[pp.ConnectResponse]:
        sb, who = self._sandbox(ctx)
        if (pty := self._pty(sb, who, req.process)) is not None:
            yield pp.ConnectResponse(event=pp.ProcessEvent(start=pp.ProcessEvent.StartEvent(pid=req.process.pid)))
            async for event in _pty_events(pty):
                yield pp.ConnectResponse(event=event)
            return
        proc = await self._find(sb, req.process)
        yield pp.ConnectResponse(event=pp.ProcessEvent(start=pp.ProcessEvent.StartEvent(pid=pid_of(proc.id))))
        async for event in _bounded(_follow(proc), ctx.timeout_ms):
            yield pp.ConnectResponse(event=event)

    async def Update(self, req: pp.UpdateRequest, ctx: Any) -> pp.UpdateResponse:
        sb, who = self._sandbox(ctx)
        pty = self._pty(sb, who, req.process)
        if pty is None:
            raise NotFoundError("no terminal with this pid")
        if req.HasField("pty"):
            await pty.terminal.resize(req.pty.size.rows, req.pty.size.cols)
        return pp.UpdateResponse()

    async def _send(self, sb: AsyncSandbox, who: str, selector: pp.ProcessSelector, data: pp.ProcessInput) -> None:
        raw = data.stdin if data.WhichOneof("input") == "stdin" else data.pty
        if (pty := self._pty(sb, who, selector)) is not None:
            await pty.terminal.send(raw)
        elif data.WhichOneof("input") == "stdin":
            await (await self._find(sb, selector)).write_stdin(raw)
        else:
            raise NotFoundError("no terminal with this pid")

    async def SendInput(self, req: pp.SendInputRequest, ctx: Any) -> pp.SendInputResponse:
        sb, who = self._sandbox(ctx)
        await self._send(sb, who, req.process, req.input)
        return pp.SendInputResponse()

    async def StreamInput(self, reqs: AsyncIterator[pp.StreamInputRequest], ctx: Any) -> pp.StreamInputResponse:
        sb, who = self._sandbox(ctx)
        selector: pp.ProcessSelector | None = None
        async for req in reqs:
            kind = req.WhichOneof("event")
            if kind == "start":
                selector = req.start.process
            elif kind == "data":
                if selector is None:
                    raise InvalidArgumentError("the stream's first message names the process (start)")
                await self._send(sb, who, selector, req.data.input)
        return pp.StreamInputResponse()

    async def SendSignal(self, req: pp.SendSignalRequest, ctx: Any) -> pp.SendSignalResponse:
        sb, who = self._sandbox(ctx)
        signo = SIGNALS.get(req.signal, signal.SIGKILL)
        if (pty := self._pty(sb, who, req.process)) is not None:
            # The terminal's command by its pid in the sandbox (its Start stream then reports the end);
            # the shell's `kill`, as images need not have the binary.
            r = await sb.exec(["/bin/sh", "-c", f"kill -{int(signo)} {int(pty.terminal.pid)}"], timeout=30)
            if r.exit_code != 0:
                raise NotFoundError(f"process with pid {pty.terminal.pid} not found: {r.stderr.strip()}"[:300])
        else:
            await (await self._find(sb, req.process)).kill(signo)
        return pp.SendSignalResponse()

    async def CloseStdin(self, req: pp.CloseStdinRequest, ctx: Any) -> pp.CloseStdinResponse:
        sb, _ = self._sandbox(ctx)
        await (await self._find(sb, req.process)).close_stdin()
        return pp.CloseStdinResponse()


async def _pty_events(pty: Pty) -> AsyncIterator[pp.ProcessEvent]:
    async for data in pty.follow():
        yield pp.ProcessEvent(data=pp.ProcessEvent.DataEvent(pty=data))
    if pty.result is not None:
        yield pp.ProcessEvent(end=_end(pty.result))
    else:
        yield pp.ProcessEvent(end=pp.ProcessEvent.EndEvent(exit_code=-1, status="terminal closed"))


def _info(p: ProcessInfo) -> pp.ProcessInfo:
    argv = _argv(p.command)
    return pp.ProcessInfo(config=pp.ProcessConfig(cmd=argv[0], args=argv[1:]), pid=pid_of(p.id))


async def _bounded(events: AsyncIterator[pp.ProcessEvent], timeout_ms: float | None) -> AsyncIterator[pp.ProcessEvent]:
    """The events until the call's deadline (Connect-Timeout-Ms: the SDK's `timeout`, the time it
    follows the command; the command runs on, as under envd)."""
    deadline = None if not timeout_ms else time.monotonic() + timeout_ms / 1000
    it = aiter(events)
    while True:
        try:
            if deadline is None:
                event = await anext(it)
            else:
                event = await asyncio.wait_for(anext(it), max(0.0, deadline - time.monotonic()))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise SandboxTimeoutError(f"the call's {(timeout_ms or 0) / 1000:g} s ran out") from None
        yield event


def _follow(proc: AsyncProcess) -> AsyncIterator[pp.ProcessEvent]:
    return _events(proc.output())


async def _events(stream: AsyncEventStream[ExecEvent]) -> AsyncIterator[pp.ProcessEvent]:
    """A process's output as it comes (started with binary output: base64 chunks), then its end;
    `started` (a process started by this stream) as envd's start event."""
    try:
        async for event in _translated(stream):
            yield event
    except WrongStateError as exc:  # its sandbox stopped under it: what E2B's SDK then asks /health about
        raise UnavailableError(f"the command's sandbox stopped: {exc}") from exc


async def _translated(stream: AsyncEventStream[ExecEvent]) -> AsyncIterator[pp.ProcessEvent]:
    async with stream as events:
        async for ev in events:
            if ev.type == "started" and ev.process is not None:
                yield pp.ProcessEvent(start=pp.ProcessEvent.StartEvent(pid=pid_of(ev.process.id)))
            elif ev.type in ("stdout", "stderr"):
                data = base64.b64decode(ev.data)
                for i in range(0, len(data), CHUNK):
                    yield pp.ProcessEvent(data=pp.ProcessEvent.DataEvent(**{ev.type: data[i : i + CHUNK]}))
            elif ev.type == "exit" and ev.result is not None:
                yield pp.ProcessEvent(end=_end(ev.result))
                return
    end = pp.ProcessEvent.EndEvent(exit_code=-1, exited=False, status="lost", error="its output ended without an exit")
    yield pp.ProcessEvent(end=end)


def _end(r: ExecResult) -> pp.ProcessEvent.EndEvent:
    if r.signal:
        name = signal.Signals(r.signal).name.lower().removeprefix("sig")
        end = pp.ProcessEvent.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}")
    else:
        end = pp.ProcessEvent.EndEvent(exit_code=r.exit_code, exited=True, status=f"exit status {r.exit_code}")
    if r.timed_out:
        end.error = "the command's time ran out"
    return end
