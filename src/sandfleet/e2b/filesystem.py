"""envd's filesystem.Filesystem over sandfleet's file calls; a watch is sandfleet's (inotify in the
sandbox), streamed (WatchDir) or kept by this server for polling (CreateWatcher and its events)."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from connectrpc.code import Code
from connectrpc.errors import ConnectError

from sandfleet.client.aio import AsyncSandbox
from sandfleet.e2b._names import names
from sandfleet.e2b._proto import filesystem_pb2 as fs
from sandfleet.e2b._upstream import Upstream, envd_key, envd_user, owner, resolve
from sandfleet.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, SandboxError
from sandfleet.models import FileEvent, FileInfo

TYPES = {"file": fs.FILE_TYPE_FILE, "dir": fs.FILE_TYPE_DIRECTORY, "symlink": fs.FILE_TYPE_SYMLINK}
EVENTS = {
    "create": fs.EVENT_TYPE_CREATE,
    "modify": fs.EVENT_TYPE_WRITE,
    "delete": fs.EVENT_TYPE_REMOVE,
    "rename_from": fs.EVENT_TYPE_RENAME,
    "rename_to": fs.EVENT_TYPE_CREATE,  # as envd (fsnotify) reports a rename's new name
    "chmod": fs.EVENT_TYPE_CHMOD,
}
MAX_WATCHERS = 64  # polled watchers a key keeps at once
MAX_EVENTS = 10_000  # events a polled watcher holds until they are asked for (the oldest dropped)
WATCHER_IDLE = 600.0  # seconds a polled watcher lives without being polled
POLL_WAIT = 0.2  # seconds an empty poll waits for a change on its way


# A file's E2B metadata is its `user.e2b.*` extended attributes (as envd keeps it).
METADATA_XATTR = "e2b."


def metadata(f: FileInfo) -> dict[str, str]:
    n = len(METADATA_XATTR)
    return {k[n:]: v for k, v in (f.xattrs or {}).items() if k.startswith(METADATA_XATTR) and len(k) > n}


KINDS = {"file": stat.S_IFREG, "dir": stat.S_IFDIR, "symlink": stat.S_IFLNK}  # for `ls -l`'s first letter


def entry(f: FileInfo) -> fs.EntryInfo:
    e = fs.EntryInfo(
        name=f.name,
        type=TYPES.get(f.type, fs.FILE_TYPE_UNSPECIFIED),
        path=f.path,
        size=f.size,
        mode=stat.S_IMODE(f.mode),
        permissions=stat.filemode(stat.S_IMODE(f.mode) | KINDS.get(f.type, 0)),
        owner="root" if f.uid == 0 else str(f.uid),
        group="root" if f.gid == 0 else str(f.gid),
        is_symlink=f.type == "symlink",
    )
    e.modified_time.FromNanoseconds(int(f.mtime * 1e9))
    e.metadata.update(metadata(f))
    if f.link_target is not None:
        e.symlink_target = f.link_target
    return e


async def _entry(sb: AsyncSandbox, f: FileInfo) -> fs.EntryInfo:
    """envd's entry: a symlink has its target's type and mode, and its target as an absolute path
    (is_symlink tells it is one; a dangling one stays a symlink)."""
    e = entry(f)
    users, groups = await names(sb)
    e.owner, e.group = users.get(f.uid, e.owner), groups.get(f.gid, e.group)
    if f.type == "symlink":
        with contextlib.suppress(NotFoundError):
            target = await sb.files.stat(f.path, follow_symlinks=True)
            e.type = TYPES.get(target.type, fs.FILE_TYPE_UNSPECIFIED)
            e.permissions = stat.filemode(stat.S_IMODE(target.mode) | KINDS.get(target.type, 0))
        if f.link_target is not None:
            e.symlink_target = posixpath.normpath(posixpath.join(posixpath.dirname(f.path), f.link_target))
    return e


async def _event(sb: AsyncSandbox, root: str, change: FileEvent, with_entry: bool) -> fs.FilesystemEvent | None:
    kind = EVENTS.get(change.type)
    if kind is None:  # overflow, heartbeat
        return None
    full = posixpath.join(root, change.path)
    event = fs.FilesystemEvent(name=posixpath.relpath(full, root), type=kind)
    if with_entry and change.type not in ("delete", "rename_from"):
        with contextlib.suppress(NotFoundError):  # gone again already
            event.entry.CopyFrom(await _entry(sb, await sb.files.stat(full)))
    return event


@dataclass
class _Watcher:
    owner: str
    sandbox_id: str
    task: asyncio.Task[None] | None = None
    events: list[fs.FilesystemEvent] = field(default_factory=list)
    failed: SandboxError | None = None
    polled: float = field(default_factory=time.monotonic)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class Filesystem:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._watchers: dict[str, _Watcher] = {}

    def _sandbox(self, ctx: Any) -> AsyncSandbox:
        return self.upstream.envd_sandbox(ctx.request_headers)

    async def Stat(self, req: fs.StatRequest, ctx: Any) -> fs.StatResponse:
        sb = self._sandbox(ctx)
        return fs.StatResponse(entry=await _entry(sb, await sb.files.stat(resolve(req.path))))

    async def MakeDir(self, req: fs.MakeDirRequest, ctx: Any) -> fs.MakeDirResponse:
        sb = self._sandbox(ctx)
        path = resolve(req.path)
        if await sb.files.exists(path):
            raise ConnectError(Code.ALREADY_EXISTS, f"path {path} already exists")
        made = await sb.files.mkdir(path, parents=True, user=envd_user(ctx.request_headers))
        return fs.MakeDirResponse(entry=await _entry(sb, made))

    async def Move(self, req: fs.MoveRequest, ctx: Any) -> fs.MoveResponse:
        sb = self._sandbox(ctx)
        source, destination = resolve(req.source), resolve(req.destination)
        await sb.files.stat(source)  # not_found when it is not there
        r = await sb.exec(["mv", "-f", "-T", "--", source, destination], timeout=60)
        if r.exit_code != 0:
            raise InvalidArgumentError(f"moving {source} to {destination} failed: {r.stderr.strip()}"[:500])
        return fs.MoveResponse(entry=await _entry(sb, await sb.files.stat(destination)))

    async def ListDir(self, req: fs.ListDirRequest, ctx: Any) -> fs.ListDirResponse:
        sb = self._sandbox(ctx)
        found: list[fs.EntryInfo] = []
        level = [resolve(req.path)]
        for _ in range(req.depth or 1):
            below = []
            for directory in level:
                for f in await sb.files.list(directory, xattrs=True):
                    found.append(await _entry(sb, f))
                    if f.type == "dir":
                        below.append(f.path)
            level = below
        found.sort(key=lambda e: e.path)  # depth first, as envd walks: a directory, then what is in it
        return fs.ListDirResponse(entries=found)

    async def Remove(self, req: fs.RemoveRequest, ctx: Any) -> fs.RemoveResponse:
        sb = self._sandbox(ctx)
        with contextlib.suppress(NotFoundError):  # envd's remove of what is not there does nothing
            await sb.files.remove(resolve(req.path), recursive=True)
        return fs.RemoveResponse()

    async def WatchDir(self, req: fs.WatchDirRequest, ctx: Any) -> AsyncIterator[fs.WatchDirResponse]:
        """`start` once the watch is in place, then each change (a name relative to the directory)."""
        sb = self._sandbox(ctx)
        root = resolve(req.path)
        await _directory(sb, root)
        async with sb.files.watch(root, recursive=req.recursive) as changes:
            yield fs.WatchDirResponse(start=fs.WatchDirResponse.StartEvent())
            async for change in changes:
                if (event := await _event(sb, root, change, req.include_entry)) is not None:
                    yield fs.WatchDirResponse(filesystem=event)

    async def CreateWatcher(self, req: fs.CreateWatcherRequest, ctx: Any) -> fs.CreateWatcherResponse:
        """A watch kept here; its events are polled (GetWatcherEvents) until it is removed or idle."""
        sb = self._sandbox(ctx)
        who = owner(envd_key(ctx.request_headers))
        self._expire()
        if sum(w.owner == who for w in self._watchers.values()) >= MAX_WATCHERS:
            raise ResourceExhaustedError(f"at most {MAX_WATCHERS} watchers at once: remove one first")
        root = resolve(req.path)
        await _directory(sb, root)
        watcher = _Watcher(who, sb.id)
        placed = asyncio.Event()
        watcher.task = asyncio.create_task(self._collect(sb, root, req, watcher, placed))
        waiting = asyncio.ensure_future(placed.wait())
        await asyncio.wait([waiting, watcher.task], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if watcher.failed is not None:
            raise watcher.failed
        if not placed.is_set():
            watcher.task.cancel()
            raise InvalidArgumentError(f"the watch of {root} could not be placed")
        watcher_id = secrets.token_hex(12)
        self._watchers[watcher_id] = watcher
        return fs.CreateWatcherResponse(watcher_id=watcher_id)

    @staticmethod
    async def _collect(sb: AsyncSandbox, root: str, req: Any, watcher: _Watcher, placed: asyncio.Event) -> None:
        try:
            async with sb.files.watch(root, recursive=req.recursive) as changes:
                placed.set()
                async for change in changes:
                    if (event := await _event(sb, root, change, req.include_entry)) is not None:
                        watcher.events.append(event)
                        del watcher.events[:-MAX_EVENTS]
                        watcher.arrived.set()
        except SandboxError as exc:
            watcher.failed = exc

    def _watcher(self, ctx: Any, watcher_id: str) -> _Watcher:
        who = owner(envd_key(ctx.request_headers))
        w = self._watchers.get(watcher_id)
        if w is None or w.owner != who or w.sandbox_id != ctx.request_headers.get("e2b-sandbox-id"):
            raise NotFoundError(f"watcher {watcher_id} not found")
        return w

    async def GetWatcherEvents(self, req: fs.GetWatcherEventsRequest, ctx: Any) -> fs.GetWatcherEventsResponse:
        w = self._watcher(ctx, req.watcher_id)
        w.polled = time.monotonic()
        if not w.events and w.failed is None:
            # A change made just before the poll may still be on its way from the sandbox (envd
            # queues it before the write answers): wait a moment for the first.
            w.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(w.arrived.wait(), POLL_WAIT)
        events, w.events = w.events, []
        if not events and w.failed is not None:
            raise w.failed
        return fs.GetWatcherEventsResponse(events=events)

    async def RemoveWatcher(self, req: fs.RemoveWatcherRequest, ctx: Any) -> fs.RemoveWatcherResponse:
        w = self._watcher(ctx, req.watcher_id)
        self._watchers.pop(req.watcher_id, None)
        if w.task is not None:
            w.task.cancel()
        return fs.RemoveWatcherResponse()

    def _expire(self) -> None:
        now = time.monotonic()
        for watcher_id, w in list(self._watchers.items()):
            if now - w.polled > WATCHER_IDLE:
                del self._watchers[watcher_id]
                if w.task is not None:
                    w.task.cancel()

    def close(self) -> None:
        for w in self._watchers.values():
            if w.task is not None:
                w.task.cancel()
        self._watchers.clear()


async def _directory(sb: AsyncSandbox, path: str) -> None:
    """envd watches directories only: not_found, or invalid_argument for a file."""
    if (await sb.files.stat(path, follow_symlinks=True)).type != "dir":
        raise InvalidArgumentError(f"path {path} is not a directory")
