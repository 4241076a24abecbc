"""E2B's in-sandbox daemon (envd) as its SDK calls it, over sandfleet's API: the Connect services
process.Process and filesystem.Filesystem, and the /files and /health routes. Every call names its
sandbox (E2b-Sandbox-Id) and carries the access token the create answered (X-Access-Token: the
caller's API key, so it acts as the caller's project)."""

from __future__ import annotations

import base64
import gzip
import posixpath
import signal
import stat
from collections.abc import AsyncIterator
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from sandfleet.client.aio import AsyncProcess, AsyncSandbox
from sandfleet.e2b._connect import ConnectService
from sandfleet.e2b._proto import filesystem_pb2 as fs
from sandfleet.e2b._proto import process_pb2 as pp
from sandfleet.e2b._upstream import Upstream
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    SandboxNotFoundError,
    UnsupportedError,
)
from sandfleet.models import ExecResult, FileInfo, ProcessInfo

HOME = "/root"  # where relative paths lead (envd: the user's home; sandfleet's default user is root)
CHUNK = 1 << 16  # output bytes per data event
SIGNALS = {pp.SIGNAL_SIGKILL: signal.SIGKILL, pp.SIGNAL_SIGTERM: signal.SIGTERM}


def _sandbox(upstream: Upstream, headers: Any) -> AsyncSandbox:
    sandbox_id = headers.get("e2b-sandbox-id")
    if not sandbox_id:
        raise InvalidArgumentError("the E2b-Sandbox-Id header is required")
    return upstream.sandbox(headers.get("x-access-token"), sandbox_id)


def _path(path: str) -> str:
    if not path:
        raise InvalidArgumentError("a path is required")
    return posixpath.normpath(posixpath.join(HOME, path))


# -- processes --------------------------------------------------------------------------------


def pid_of(process_id: str) -> int:
    """A process's number as envd's callers know it (sandfleet's ids are `p-` and 12 hex digits)."""
    return (int(process_id[2:10], 16) & 0x7FFFFFFF) or 1


def _argv(command: str | list[str]) -> list[str]:
    return command if isinstance(command, list) else ["/bin/sh", "-c", command]


class Processes:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def _find(self, sb: AsyncSandbox, selector: pp.ProcessSelector) -> AsyncProcess:
        if selector.WhichOneof("selector") != "pid":
            raise NotFoundError("a process is found by its pid here (tags are not kept)")
        for info in await sb.processes():
            if pid_of(info.id) == selector.pid and info.running:
                return AsyncProcess(sb, info)
        raise NotFoundError(f"process with pid {selector.pid} not found")

    async def List(self, req: pp.ListRequest, ctx: Any) -> pp.ListResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        found = [_info(p) for p in await sb.processes() if p.running]
        return pp.ListResponse(processes=found)

    async def Start(self, req: pp.StartRequest, ctx: Any) -> AsyncIterator[pp.StartResponse]:
        sb = _sandbox(self.upstream, ctx.request_headers)
        if req.HasField("pty"):
            raise UnsupportedError("a process on a pseudo-terminal is not served by sandfleet's E2B layer yet")
        config = req.process
        proc = await sb.start(
            [config.cmd, *config.args],
            env=dict(config.envs) or None,
            cwd=_path(config.cwd) if config.HasField("cwd") else None,
            keep_stdin_open=req.stdin,
            binary=True,
        )
        yield pp.StartResponse(event=pp.ProcessEvent(start=pp.ProcessEvent.StartEvent(pid=pid_of(proc.id))))
        async for event in _follow(proc):
            yield pp.StartResponse(event=event)

    async def Connect(self, req: pp.ConnectRequest, ctx: Any) -> AsyncIterator[pp.ConnectResponse]:
        sb = _sandbox(self.upstream, ctx.request_headers)
        proc = await self._find(sb, req.process)
        yield pp.ConnectResponse(event=pp.ProcessEvent(start=pp.ProcessEvent.StartEvent(pid=pid_of(proc.id))))
        async for event in _follow(proc):
            yield pp.ConnectResponse(event=event)

    async def Update(self, req: pp.UpdateRequest, ctx: Any) -> pp.UpdateResponse:
        raise UnsupportedError("a process on a pseudo-terminal is not served by sandfleet's E2B layer yet")

    async def SendInput(self, req: pp.SendInputRequest, ctx: Any) -> pp.SendInputResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        await _input(await self._find(sb, req.process), req.input)
        return pp.SendInputResponse()

    async def StreamInput(self, reqs: AsyncIterator[pp.StreamInputRequest], ctx: Any) -> pp.StreamInputResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        proc: AsyncProcess | None = None
        async for req in reqs:
            kind = req.WhichOneof("event")
            if kind == "start":
                proc = await self._find(sb, req.start.process)
            elif kind == "data":
                if proc is None:
                    raise InvalidArgumentError("the stream's first message names the process (start)")
                await _input(proc, req.data.input)
        return pp.StreamInputResponse()

    async def SendSignal(self, req: pp.SendSignalRequest, ctx: Any) -> pp.SendSignalResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        proc = await self._find(sb, req.process)
        await proc.kill(SIGNALS.get(req.signal, signal.SIGKILL))
        return pp.SendSignalResponse()

    async def CloseStdin(self, req: pp.CloseStdinRequest, ctx: Any) -> pp.CloseStdinResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        await (await self._find(sb, req.process)).close_stdin()
        return pp.CloseStdinResponse()


def _info(p: ProcessInfo) -> pp.ProcessInfo:
    argv = _argv(p.command)
    return pp.ProcessInfo(config=pp.ProcessConfig(cmd=argv[0], args=argv[1:]), pid=pid_of(p.id))


async def _input(proc: AsyncProcess, data: pp.ProcessInput) -> None:
    if data.WhichOneof("input") != "stdin":
        raise UnsupportedError("a process on a pseudo-terminal is not served by sandfleet's E2B layer yet")
    await proc.write_stdin(data.stdin)


async def _follow(proc: AsyncProcess) -> AsyncIterator[pp.ProcessEvent]:
    """The process's output as it comes (started with binary output: base64 chunks), then its end."""
    async with proc.output() as events:
        async for ev in events:
            if ev.type in ("stdout", "stderr"):
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


# -- files ------------------------------------------------------------------------------------

TYPES = {"file": fs.FILE_TYPE_FILE, "dir": fs.FILE_TYPE_DIRECTORY, "symlink": fs.FILE_TYPE_SYMLINK}


def entry(f: FileInfo) -> fs.EntryInfo:
    e = fs.EntryInfo(
        name=f.name,
        type=TYPES.get(f.type, fs.FILE_TYPE_UNSPECIFIED),
        path=f.path,
        size=f.size,
        mode=stat.S_IMODE(f.mode),
        permissions=stat.filemode(f.mode),
        owner="root" if f.uid == 0 else str(f.uid),
        group="root" if f.gid == 0 else str(f.gid),
        is_symlink=f.type == "symlink",
    )
    e.modified_time.FromNanoseconds(int(f.mtime * 1e9))
    if f.link_target is not None:
        e.symlink_target = f.link_target
    return e


class Filesystem:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    async def Stat(self, req: fs.StatRequest, ctx: Any) -> fs.StatResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        return fs.StatResponse(entry=entry(await sb.files.stat(_path(req.path))))

    async def MakeDir(self, req: fs.MakeDirRequest, ctx: Any) -> fs.MakeDirResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        path = _path(req.path)
        if await sb.files.exists(path):
            raise ConnectError(Code.ALREADY_EXISTS, f"path {path} already exists")
        return fs.MakeDirResponse(entry=entry(await sb.files.mkdir(path, parents=True)))

    async def Move(self, req: fs.MoveRequest, ctx: Any) -> fs.MoveResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        source, destination = _path(req.source), _path(req.destination)
        await sb.files.stat(source)  # not_found when it is not there
        r = await sb.exec(["mv", "-f", "-T", "--", source, destination], timeout=60)
        if r.exit_code != 0:
            raise InvalidArgumentError(f"moving {source} to {destination} failed: {r.stderr.strip()}"[:500])
        return fs.MoveResponse(entry=entry(await sb.files.stat(destination)))

    async def ListDir(self, req: fs.ListDirRequest, ctx: Any) -> fs.ListDirResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        depth = req.depth or 1
        found: list[fs.EntryInfo] = []
        level = [_path(req.path)]
        for _ in range(depth):
            below = []
            for directory in level:
                for f in await sb.files.list(directory):
                    found.append(entry(f))
                    if f.type == "dir":
                        below.append(f.path)
            level = below
        return fs.ListDirResponse(entries=found)

    async def Remove(self, req: fs.RemoveRequest, ctx: Any) -> fs.RemoveResponse:
        sb = _sandbox(self.upstream, ctx.request_headers)
        await sb.files.remove(_path(req.path), recursive=True)
        return fs.RemoveResponse()

    async def WatchDir(self, req: fs.WatchDirRequest, ctx: Any) -> AsyncIterator[fs.WatchDirResponse]:
        raise UnsupportedError("watching a directory is not served by sandfleet's E2B layer yet")
        yield  # an async generator: a server stream

    async def CreateWatcher(self, req: fs.CreateWatcherRequest, ctx: Any) -> fs.CreateWatcherResponse:
        raise UnsupportedError("watching a directory is not served by sandfleet's E2B layer yet")

    async def GetWatcherEvents(self, req: fs.GetWatcherEventsRequest, ctx: Any) -> fs.GetWatcherEventsResponse:
        raise UnsupportedError("watching a directory is not served by sandfleet's E2B layer yet")

    async def RemoveWatcher(self, req: fs.RemoveWatcherRequest, ctx: Any) -> fs.RemoveWatcherResponse:
        raise UnsupportedError("watching a directory is not served by sandfleet's E2B layer yet")


# -- envd's HTTP routes -----------------------------------------------------------------------


def _http_error(exc: SandboxError) -> JSONResponse:
    """envd's error body ({code, message}); a sandbox that is not there is the edge's 502."""
    status = 502 if isinstance(exc, SandboxNotFoundError) else exc.http_status
    return JSONResponse({"code": status, "message": str(exc)}, status_code=status)


class Files:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def routes(self) -> list[Route]:
        return [
            Route("/files", self.download, methods=["GET"]),
            Route("/files", self.upload, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]

    async def download(self, request: Request) -> Response:
        try:
            sb = _sandbox(self.upstream, request.headers)
            data = await sb.files.read(_path(request.query_params.get("path", "")))
        except SandboxError as exc:
            return _http_error(exc)
        return Response(data, media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        try:
            sb = _sandbox(self.upstream, request.headers)
            given = request.query_params.get("path")
            written = []
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                async with request.form() as form:
                    parts = [p for p in form.getlist("file") if isinstance(p, UploadFile)]
                    if not parts:
                        raise InvalidArgumentError("the form has no file part")
                    for part in parts:
                        target = given if given and len(parts) == 1 else part.filename
                        written.append(await _write(sb, target or "", await part.read()))
            else:
                data = await request.body()
                if request.headers.get("content-encoding", "").lower() == "gzip":
                    data = gzip.decompress(data)
                written.append(await _write(sb, given or "", data))
        except SandboxError as exc:
            return _http_error(exc)
        except (OSError, EOFError) as exc:  # a gzip body that is not gzip
            return _http_error(InvalidArgumentError(f"the body cannot be read: {exc}"))
        return JSONResponse(written)

    async def health(self, request: Request) -> Response:
        try:
            sb = _sandbox(self.upstream, request.headers)
            info = await sb.refresh()
        except SandboxError as exc:
            return _http_error(exc)
        if info.state not in ("running", "paused"):
            return _http_error(SandboxNotFoundError(f"sandbox {info.id} is {info.state}"))
        return Response(status_code=204)


async def _write(sb: AsyncSandbox, path: str, data: bytes) -> dict[str, str]:
    """envd's write: the parents made as needed, the file replaced."""
    target = _path(path)
    try:
        made = await sb.files.write(target, data)
    except NotFoundError:
        await sb.files.mkdir(posixpath.dirname(target), parents=True)
        made = await sb.files.write(target, data)
    return {"path": made.path, "name": made.name, "type": "file"}


def routes(upstream: Upstream) -> list[Route | Mount]:
    process = ConnectService(pp.DESCRIPTOR.services_by_name["Process"], Processes(upstream))
    filesystem = ConnectService(fs.DESCRIPTOR.services_by_name["Filesystem"], Filesystem(upstream))
    return [Mount(process.path, app=process), Mount(filesystem.path, app=filesystem), *Files(upstream).routes()]
