"""Files of a sandbox, from the host side: user lookup, read/write/list/stat/mkdir/remove, tar
downloads and uploads, and watches (the agent's inotify).

The container tier opens the sandbox's root as an O_PATH fd and works under it with openat2
(runtime/sandboxfs/); errors come back typed by kind (`errormap.to_wire_error`).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import os
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, BinaryIO

from sandfleet.backends.base import HostFiles, LiveSandbox, unsupported
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.node.agentfiles import AgentFS
from sandfleet.daemon.node.core import AGENT_START_TIMEOUT, EventStream, NodeCore, T, resolve_cwd
from sandfleet.daemon.node.image_service import Images
from sandfleet.daemon.node.lifecycle import Sandbox, User, stopped_meanwhile
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    UnavailableError,
    UnsupportedError,
)
from sandfleet.images import LayerCorruptError
from sandfleet.models import FileEvent, FileInfo, check_user, shown
from sandfleet.runtime.agent_errors import AgentError, ChannelClosedError
from sandfleet.runtime.agent_wire import WatchEvent
from sandfleet.runtime.sandboxfs.fs import SandboxFS
from sandfleet.runtime.sandboxfs.results import FileOpError, FileStat

IN_ISDIR = 0x40000000

PASSWD_MAX_BYTES = 4 * 1024**2  # of /etc/passwd read to resolve a user name


_WATCH_KINDS = (  # inotify mask bit -> FileEvent type, first match wins
    (0x4000, "overflow"),  # IN_Q_OVERFLOW
    (0x100, "create"),  # IN_CREATE
    (0x200 | 0x400, "delete"),  # IN_DELETE, IN_DELETE_SELF
    (0x40, "rename_from"),  # IN_MOVED_FROM
    (0x80, "rename_to"),  # IN_MOVED_TO
    (0x2 | 0x8, "modify"),  # IN_MODIFY, IN_CLOSE_WRITE
    (0x4, "chmod"),  # IN_ATTRIB
)


def _watch_kind(mask: int) -> str | None:
    return next((kind for bits, kind in _WATCH_KINDS if mask & bits), None)


async def _thread_chunks(produce: Callable[[], Iterator[bytes]], depth: int = 4) -> AsyncGenerator[bytes, None]:
    """Chunks a worker thread produces, at most `depth` of them buffered."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(depth)
    stop = threading.Event()

    def put(item: bytes | BaseException | None) -> None:
        asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

    def run() -> None:
        try:
            for chunk in produce():
                if stop.is_set():
                    return
                put(chunk)
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
            if not stop.is_set():
                put(exc)
            return
        if not stop.is_set():
            put(None)

    worker = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while not worker.done():  # unblock a pending put so the thread sees `stop` and ends
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
            await asyncio.sleep(0.005)


def file_info(st: FileStat) -> FileInfo:
    return FileInfo(
        path=st.path,
        name=st.name,
        type=st.type,
        size=st.size,
        mode=st.mode,
        uid=st.uid,
        gid=st.gid,
        mtime=st.mtime,
        link_target=st.link_target,
        xattrs=st.xattrs,
    )


class Files:
    def __init__(self, core: NodeCore, pauser: Pauser, images: Images) -> None:
        self.core = core
        self.pauser = pauser
        self.images = images

    async def user(self, sb: Sandbox, live: LiveSandbox, name: str) -> User:
        user = sb.users.get(name)
        if user is not None:
            return user
        try:  # every route's `user` is checked here too: "¹" is a digit to str.isdigit, not to int()
            check_user(name)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        if name.isdigit():
            user = User(int(name), int(name), "/")
        else:
            # Streamed through a capped parser in a worker thread: a 62 MB /etc/passwd costs the
            # sandbox's own disk, never the daemon's memory or its event loop.
            try:
                agent = self.agent_fs(sb, live)
                if agent is not None:
                    found = await agent.lookup_user(name)
                else:
                    found = await self.fs(sb, live, lambda fs: fs.lookup_user(name, max_bytes=PASSWD_MAX_BYTES))
            except NotFoundError:
                found = None
            except FileOpError as exc:  # through the agent: /etc/passwd no regular file, or too large
                raise to_wire_error(exc, limit=1000) from exc
            except AgentError as exc:
                raise UnavailableError(f"sandbox {sb.id}: {exc}") from exc
            if found is None:
                raise InvalidArgumentError(f"user {shown(name)} does not exist in the sandbox")
            user = User(*found)
        if not 0 <= user.uid < 65536 or not 0 <= user.gid < 65536:
            raise InvalidArgumentError(f"user {shown(name)} is outside the sandbox's id range")
        if len(sb.users) < 64:
            sb.users[name] = user
        return user

    async def watch(self, sandbox_id: str, path: str, recursive: bool) -> EventStream[FileEvent]:
        """File changes under a directory, from inotify run by the sandbox's agent (so the watches
        count against the sandbox's own inotify share, not the daemon's)."""
        sb, live = await self.pauser.ready(sandbox_id)
        target = resolve_cwd(sb, path)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                w = await live.channel.watch(target, recursive=recursive)
        except TimeoutError:
            raise self.core.unresponsive(sb, "it did not take a watch") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc
        except ValueError as exc:  # a NUL in the path, or longer than one message
            raise InvalidArgumentError(f"cannot watch {shown(target)}: {exc}") from exc
        # the agent answers a watch it cannot set up with its end at once: surface that as an error
        first: WatchEvent | None = None
        try:
            first = await w.next(timeout=0.2)
            if first is None:
                raise InvalidArgumentError(f"cannot watch {shown(target)}: not a directory in the sandbox")
        except TimeoutError:
            pass
        except AgentError as exc:
            raise InvalidArgumentError(f"cannot watch {shown(target)}: {exc}") from exc

        async def events() -> AsyncGenerator[FileEvent, None]:
            last: tuple[str, str] | None = None
            pending = first
            try:
                while True:
                    ev = pending if pending is not None else await w.next()
                    pending = None
                    if ev is None:
                        return
                    kind = _watch_kind(ev.mask)
                    if kind is None or (kind, ev.path) == last:
                        continue  # a write shows as several IN_MODIFY: one event
                    last = (kind, ev.path)
                    yield FileEvent(type=kind, path=ev.path, is_dir=bool(ev.mask & IN_ISDIR))
            except AgentError as exc:
                raise UnavailableError(f"the watch of {shown(target)} ended: {exc}") from exc
            finally:
                await w.close()

        return EventStream(events(), w.close)

    async def stat(self, sb: Sandbox, live: LiveSandbox, path: str, *, follow_symlinks: bool = False) -> FileStat:
        """A path's metadata, reached as this sandbox's tier reaches its files (host side, or through
        its agent): for the daemon's own look inside a sandbox (a session's shell)."""
        agent = self.agent_fs(sb, live)
        if agent is None:
            return await self.fs(sb, live, lambda fs: fs.stat(path, follow_symlinks=follow_symlinks))
        try:
            return await agent.stat(path, follow_symlinks=follow_symlinks)
        except FileOpError as exc:
            raise to_wire_error(exc, limit=1000) from exc
        except AgentError as exc:
            raise UnavailableError(f"sandbox {sb.id}: {exc}") from exc

    def agent_fs(self, sb: Sandbox, live: LiveSandbox) -> AgentFS | None:
        """Files through the agent, for a tier whose sandbox root the host cannot reach (a VM's);
        None where the host-side path applies."""
        if isinstance(self.core.tier(sb), HostFiles):
            return None
        return AgentFS(live.channel, cwd=sb.spec.workdir)

    async def _agent_op(
        self,
        sandbox_id: str,
        op: Callable[[AgentFS], Awaitable[T]],
        event: tuple[str, dict[str, Any]] | None = None,
    ) -> T | None:
        """Run `op` through the agent if the sandbox's tier needs that (else None: the caller goes
        the host-side way)."""
        sb, live = await self.pauser.ready(sandbox_id)
        agent = self.agent_fs(sb, live)
        if agent is None:
            return None
        self.core.touch(sb)
        try:
            result = await op(agent)
        except FileOpError as exc:
            raise to_wire_error(exc, limit=1000) from exc
        except AgentError as exc:
            raise UnavailableError(f"sandbox {sandbox_id}: {exc}") from exc
        finally:
            self.core.touch(sb)  # once more when done: the monitor rereads a sandbox touched since it last looked
        if event is not None:
            self.core.journal.record(sb.id, event[0], event[1])
        return result

    async def fs(
        self, sb: Sandbox, live: LiveSandbox, op: Callable[[SandboxFS], T], *, cwd: str = "/", mutating: bool = False
    ) -> T:
        host = self.core.tier(sb)
        if not isinstance(host, HostFiles):
            raise unsupported(host, "reach its files from the host")

        def run() -> T:
            fd = host.open_root(live)
            try:
                # A write that replaced or removed a directory the sandbox has a mount on would detach
                # that mount in the sandbox (the daemon sees its tree from another mount namespace).
                points = host.mount_points(live) if mutating else frozenset()
                return op(SandboxFS(fd, uid_base=live.uid_base, cwd=cwd, mount_points=points))
            finally:
                os.close(fd)

        try:
            return await asyncio.to_thread(run)
        except FileOpError as exc:
            raise to_wire_error(exc, limit=1000) from exc
        except FileNotFoundError as exc:
            raise UnavailableError(f"sandbox {live.sandbox_id} is no longer running") from exc

    async def read_file(self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None) -> bytes:
        via = await self._agent_op(sandbox_id, lambda a: a.read(path, offset=offset, length=length))
        if via is not None:
            return via
        return await self._file_op(sandbox_id, lambda fs: fs.read(path, offset=offset, length=length))

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        *,
        mode: int,
        user: str | None,
        append: bool,
        xattrs: dict[str, str] | None = None,
        xattrs_scope: str = "",
    ) -> FileInfo:
        """`xattrs` given: they become the file's `user.<xattrs_scope>` extended attributes, the
        others there go (those outside the scope stay)."""
        owner = await self._file_owner(sandbox_id, user)

        async def via_agent(a: AgentFS) -> FileInfo:
            if xattrs:  # the agent's tools (busybox's or coreutils) have no xattr command
                raise UnsupportedError("files reached through a VM's agent keep no extended attributes yet")
            await a.write(path, data, mode=mode, uid=owner.uid, gid=owner.gid, append=append)
            return file_info(await a.stat(path))

        info = await self._agent_op(sandbox_id, via_agent, ("file_write", {"path": path, "bytes": len(data)}))
        if info is not None:
            return info

        def op(fs: SandboxFS) -> FileInfo:
            fs.write(
                path,
                data,
                mode=mode,
                uid=owner.uid,
                gid=owner.gid,
                append=append,
                attrs=xattrs,
                attrs_scope=xattrs_scope,
            )
            return file_info(fs.stat(path, follow_symlinks=True))

        return await self._file_op(sandbox_id, op, ("file_write", {"path": path, "bytes": len(data)}), mutating=True)

    async def list_files(self, sandbox_id: str, path: str, xattrs: bool = False) -> builtins.list[FileInfo]:
        via = await self._agent_op(sandbox_id, lambda a: a.list(path))
        if via is not None:
            return [file_info(x) for x in via]
        return [file_info(st) for st in await self._file_op(sandbox_id, lambda fs: fs.list(path, xattrs=xattrs))]

    async def stat_file(self, sandbox_id: str, path: str, follow_symlinks: bool) -> FileInfo:
        via = await self._agent_op(sandbox_id, lambda a: a.stat(path, follow_symlinks=follow_symlinks))
        if via is not None:
            return file_info(via)
        return file_info(await self._file_op(sandbox_id, lambda fs: fs.stat(path, follow_symlinks=follow_symlinks)))

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool, mode: int, user: str | None) -> FileInfo:
        owner = await self._file_owner(sandbox_id, user)

        async def via_agent(a: AgentFS) -> FileInfo:
            await a.mkdir(path, parents=parents, mode=mode, uid=owner.uid, gid=owner.gid)
            return file_info(await a.stat(path))

        info = await self._agent_op(sandbox_id, via_agent, ("mkdir", {"path": path}))
        if info is not None:
            return info

        def op(fs: SandboxFS) -> FileInfo:
            fs.mkdir(path, parents=parents, mode=mode, uid=owner.uid, gid=owner.gid)
            return file_info(fs.stat(path))

        return await self._file_op(sandbox_id, op, ("mkdir", {"path": path}), mutating=True)

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None:
        async def via_agent(a: AgentFS) -> bool:
            await a.remove(path, recursive=recursive)
            return True

        if await self._agent_op(sandbox_id, via_agent, ("file_remove", {"path": path, "recursive": recursive})):
            return
        await self._file_op(
            sandbox_id,
            lambda fs: fs.remove(path, recursive=recursive),
            ("file_remove", {"path": path, "recursive": recursive}),
            mutating=True,
        )

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        limit = self._download_limit(sandbox_id)
        via = await self._agent_op(sandbox_id, lambda a: a.tar_out(path, max_bytes=limit))
        if via is not None:
            return via
        return await self._file_stream(sandbox_id, lambda fs: fs.iter_tar(path, max_bytes=limit))

    async def upload_limit(self, sandbox_id: str) -> int:
        """The largest tar an upload may send: the sandbox's writable layer, plus the tar's headers."""
        disk = self.core.sandbox(sandbox_id).spec.resources.disk
        return disk + disk // 8 + 1024**2

    async def upload_tar(self, sandbox_id: str, path: str, tar: BinaryIO, size: int, user: str | None) -> None:
        """Unpack an uploaded tar (seekable): checked whole before anything is written, by the same
        rules on every tier (`files.check_upload`), its files at most the sandbox's disk."""
        owner = await self._file_owner(sandbox_id, user)
        disk = self.core.sandbox(sandbox_id).spec.resources.disk

        async def via_agent(a: AgentFS) -> bool:
            await a.tar_in(path, tar, uid=owner.uid, gid=owner.gid, max_bytes=disk)
            return True

        if await self._agent_op(sandbox_id, via_agent, ("upload", {"path": path, "bytes": size})):
            return

        def op(fs: SandboxFS) -> None:
            fs.upload_tar(path, tar, uid=owner.uid, gid=owner.gid, max_bytes=disk)

        await self._file_op(sandbox_id, op, ("upload", {"path": path, "bytes": size}), mutating=True)

    async def _file_op(
        self,
        sandbox_id: str,
        op: Callable[[SandboxFS], T],
        event: tuple[str, dict[str, Any]] | None = None,
        *,
        mutating: bool = False,
    ) -> T:
        sb, live = await self.pauser.ready(sandbox_id)
        self.core.touch(sb)
        try:
            result = await self.fs(sb, live, op, cwd=sb.spec.workdir, mutating=mutating)
        finally:
            self.core.touch(sb)  # as in _agent_op
        if event is not None:
            self.core.journal.record(sb.id, event[0], event[1])
        return result

    async def _file_owner(self, sandbox_id: str, user: str | None) -> User:
        sb, live = await self.pauser.ready(sandbox_id)
        return await self.user(sb, live, user or sb.spec.user)

    def _download_limit(self, sandbox_id: str) -> int:
        """The most a download of the sandbox's tree can carry: what its writable layer holds at
        most plus what its read-only layers hold (by their files' sizes)."""
        sb = self.core.sandbox(sandbox_id)
        layers = sb.live.runtime.get("layers", []) if sb.live is not None else []
        total = sb.spec.resources.disk
        for digest in layers:
            with contextlib.suppress(SandboxError, OSError, LayerCorruptError):
                ref = self.images.layer_by_digest(str(digest))
                total += 4 * (ref.size + (ref.blob_size or 0))  # EROFS compresses (lz4hc: ~2x, be generous)
        return total

    async def _file_stream(
        self, sandbox_id: str, produce: Callable[[SandboxFS], Iterator[bytes]]
    ) -> AsyncGenerator[bytes, None]:
        """Chunks `produce` makes from the sandbox's tree in a worker thread, a few at a time (the
        daemon's memory stays bounded whatever the size); an error before the first chunk is the
        request's (a typed 4xx), a later one ends the stream short."""
        sb, live = await self.pauser.ready(sandbox_id)
        self.core.touch(sb)
        cwd = sb.spec.workdir

        host = self.core.tier(sb)
        if not isinstance(host, HostFiles):
            raise unsupported(host, "reach its files from the host")

        def chunks() -> Iterator[bytes]:
            fd = host.open_root(live)
            try:
                yield from produce(SandboxFS(fd, uid_base=live.uid_base, cwd=cwd))
            finally:
                os.close(fd)

        gen = _thread_chunks(chunks)
        try:
            with stopped_meanwhile(sb, "its files were read"):
                first = await anext(gen, b"")
        except FileOpError as exc:
            await gen.aclose()
            raise to_wire_error(exc, limit=1000) from exc
        except BaseException:
            await gen.aclose()
            raise

        async def rest() -> AsyncGenerator[bytes, None]:
            try:
                if first:
                    yield first
                async for chunk in gen:
                    yield chunk
            finally:
                await gen.aclose()

        return rest()
