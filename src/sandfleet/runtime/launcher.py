"""Client of the launcher server: `sandfleet-run --serve` (launcher.c), started once per daemon.

Each create is one SOCK_SEQPACKET message carrying the launch arguments and, by SCM_RIGHTS, a reply
pipe, the agent channel and the pinned bind-mount sources. The server forks a worker per message, so
launches overlap and the daemon never forks or execs on its hot path (posix_spawn of a static binary
still stalls the calling thread, and the GIL with it, until the exec completes).

The daemon watches the server through a pidfd on its event loop. If the server dies (killed, or a
bug), the daemon notices at once: it kills what the server had started and not yet finished (the
workers, their stage-1 processes and criu runs: all in the server's process group, which the server
leads), reaps them, fails every launch in flight with a retryable error (their sandboxes' cleanup
then kills whatever joined their cgroups, and nothing of theirs can still be running to come back
after it), and starts a new server, without waiting for the next create to find it gone.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from sandfleet.runtime import mounts, proc

log = logging.getLogger("sandfleet.launcher")

INVALID = "I"  # the request itself cannot be carried out (e.g. a bind target the image cannot take)
UNAVAILABLE = "U"  # the launcher died before answering; nothing of the launch is left running: retry

# How long the daemon waits for the processes of a dead server's group to go after SIGKILL.
_GROUP_GRACE = 2.0
_EXIT_GRACE = 1.0  # from a dead server's pipes closing to its exit being seen


class LaunchError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.invalid = kind == INVALID
        self.unavailable = kind == UNAVAILABLE
        self.message = message


@dataclass(eq=False)
class _Server:
    """One server process: its pid (also its process group), a pidfd to watch it and its socket."""

    pid: int
    pidfd: int
    sock: socket.socket
    exited: asyncio.Future[None]
    # Futures of launches in flight on this server (their replies, and sends waiting for room in its
    # queue): failed with UNAVAILABLE if it dies.
    waiters: set[asyncio.Future[None]] = field(default_factory=set)
    lost: bool = False  # died (or its socket broke): no new launch goes to it
    failed: bool = False  # its waiters were failed
    stopping: bool = False  # close(): its exit is expected


class LauncherServer:
    """One `sandfleet-run --serve` process; restarted as soon as it dies."""

    def __init__(self, binary: Path, *, agent_fd: int, seccomp_fd: int, shared_dir: Path) -> None:
        self.binary = binary
        # Where the server mounts what all sandboxes bind: a read-only sysfs and an empty tmpfs.
        self.shared_dir = shared_dir
        self.agent_fd = agent_fd
        self.seccomp_fd = seccomp_fd
        self._server: _Server | None = None
        self._send_lock = asyncio.Lock()
        self._recoveries: set[asyncio.Task[None]] = set()
        self._closing = False
        self.restarts = 0  # servers started after the first (for tests and metrics)

    @property
    def pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    async def start(self) -> None:
        self._closing = False
        await self._spawn()

    async def _spawn(self) -> None:
        for name in ("sysfs", "empty", "template"):  # template: only mounted in the server's template namespace
            (self.shared_dir / name).mkdir(mode=0o555, parents=True, exist_ok=True)
        # A previous server's shared mounts (it died): the new one mounts its own.
        await asyncio.to_thread(self._unmount_shared)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid = proc.start_background(
                [str(self.binary), "--serve", "--shared", str(self.shared_dir)],
                fd_map={3: theirs.fileno(), 4: self.agent_fd, 5: self.seccomp_fd},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        loop = asyncio.get_running_loop()
        try:
            pidfd = os.pidfd_open(pid)
        except BaseException:
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await proc.wait_pid(pid)
            proc.forget(pid)
            raise
        ours.setblocking(False)
        server = _Server(pid, pidfd, ours, loop.create_future())
        loop.add_reader(pidfd, self._on_exit, server)
        try:
            for _ in range(200):  # the server mounts the shared sysfs before it takes requests
                if await asyncio.to_thread(os.path.ismount, self.shared_dir / "empty"):
                    self._server = server
                    return
                if server.exited.done():
                    break
                await asyncio.sleep(0.01)
        except BaseException:
            await self._stop(server)
            raise
        await self._stop(server)
        raise LaunchError("E", f"the launcher could not mount sysfs and an empty tmpfs under {self.shared_dir}")

    def _unmount_shared(self) -> None:
        for name in ("sysfs", "empty"):
            while os.path.ismount(self.shared_dir / name):
                try:
                    mounts.umount(str(self.shared_dir / name), lazy=True)
                except OSError:
                    break

    def _on_exit(self, server: _Server) -> None:
        """The server's pidfd became readable: it exited."""
        asyncio.get_running_loop().remove_reader(server.pidfd)
        if not server.exited.done():
            server.exited.set_result(None)
        if not server.stopping:
            log.warning("the launcher (pid %d) died; restarting it", server.pid)
            self._lose(server)

    def _lose(self, server: _Server) -> None:
        """Take `server` out of service: kill its process group, then recover in the background."""
        if server.lost:
            return
        server.lost = True
        if self._server is server:
            self._server = None
        # Its pid is not reaped yet (we reap it only in _recover), so the number still names its
        # group: the workers and what they started (stage 1, criu, cp) all die here.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(server.pid, signal.SIGKILL)
        task = asyncio.ensure_future(self._recover(server))
        self._recoveries.add(task)
        task.add_done_callback(self._recoveries.discard)

    async def _recover(self, server: _Server) -> None:
        try:
            await self._reap(server)
            await self._drain_group(server.pid)
            self._fail(server, "the launcher died before it answered (it has been restarted): try again")
            proc.reap_orphans()
            async with self._send_lock:
                server.sock.close()
                if self._server is None and not self._closing:
                    self.restarts += 1
                    await self._spawn()
        except (OSError, LaunchError) as exc:
            log.error("the launcher could not be restarted (the next create tries again): %s", exc)

    async def _reap(self, server: _Server) -> None:
        """Wait for the server itself to exit (it was sent SIGKILL if it had not) and reap it."""
        try:
            async with asyncio.timeout(10):
                await asyncio.shield(server.exited)
        except TimeoutError:
            log.error("the launcher (pid %d) did not exit after SIGKILL", server.pid)
            return
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitid(os.P_PIDFD, server.pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 (it has exited)
        os.close(server.pidfd)
        proc.forget(server.pid)

    @staticmethod
    async def _drain_group(pgid: int) -> None:
        """Reap the dead server's group: its workers and their children became our children (we are
        a subreaper) and die of the SIGKILL. The group's number stays reserved while any member
        exists, so `kill(-pgid, 0)` names only them until it fails."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _GROUP_GRACE
        while True:
            with contextlib.suppress(ChildProcessError, OSError):
                while os.waitid(os.P_PGID, pgid, os.WEXITED | os.WNOHANG) is not None:  # noqa: ASYNC222 (never blocks)
                    pass
            try:
                os.kill(-pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            if loop.time() > deadline:
                log.warning("processes of the dead launcher's group %d outlived SIGKILL by %.0fs", pgid, _GROUP_GRACE)
                return
            # One SIGKILL reached every member (a fork racing with it is covered by the kernel).
            await asyncio.sleep(0.005)

    @staticmethod
    def _fail(server: _Server, message: str) -> None:
        server.failed = True
        for waiter in list(server.waiters):
            if not waiter.done():
                waiter.set_exception(LaunchError(UNAVAILABLE, message))
        server.waiters.clear()

    async def _stop(self, server: _Server) -> None:
        """Stop a server we no longer want: EOF on its socket, then SIGKILL after 5 s; reaped."""
        server.stopping = True
        server.lost = True
        if self._server is server:
            self._server = None
        server.sock.close()  # the server exits on EOF
        try:
            async with asyncio.timeout(5):
                await asyncio.shield(server.exited)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGKILL)
        await self._reap(server)
        self._fail(server, "the launcher was stopped")

    async def close(self) -> None:
        self._closing = True
        for task in list(self._recoveries):
            task.cancel()
        if self._recoveries:
            await asyncio.gather(*self._recoveries, return_exceptions=True)
        if self._server is not None:
            await self._stop(self._server)
        await asyncio.to_thread(self._unmount_shared)

    async def _current(self) -> _Server:
        if self._server is None:
            if self._closing:
                raise LaunchError(UNAVAILABLE, "the launcher is stopped")
            try:
                self.restarts += 1
                await self._spawn()
            except (OSError, LaunchError) as exc:
                raise LaunchError("E", f"the launcher cannot be restarted: {exc}") from exc
        assert self._server is not None
        return self._server

    async def _send(self, payload: bytes, fds: list[int]) -> _Server:
        # One sender at a time: sends are short, and a single waiter per fd is all the loop allows.
        async with self._send_lock:
            for attempt in range(2):
                server = await self._current()
                try:
                    await self._sendmsg(server, payload, fds)
                    return server
                except (BrokenPipeError, ConnectionResetError):
                    self._lose(server)  # it closed its end: dead or dying; restarted below
                    if attempt:
                        raise LaunchError(UNAVAILABLE, "the launcher died: try again") from None
                    log.warning("the launcher's socket broke; restarting it")
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(5):
                            await asyncio.shield(server.exited)
            raise AssertionError("unreachable")

    async def _sendmsg(self, server: _Server, payload: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        sock = server.sock
        while True:
            if server.failed:
                raise LaunchError(UNAVAILABLE, "the launcher died: try again")
            try:
                sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                return
            except BlockingIOError:
                # The server's queue is full (a burst): wait until it drains a message.
                ready: asyncio.Future[None] = loop.create_future()
                fileno = sock.fileno()
                server.waiters.add(ready)
                loop.add_writer(fileno, _resolve, ready)
                try:
                    await ready
                finally:
                    loop.remove_writer(fileno)
                    server.waiters.discard(ready)

    async def launch(self, args: list[str], *, channel_fd: int, bind_fds: list[int], timeout: float) -> int:
        """Start one sandbox; return its agent's pid. Raises LaunchError or TimeoutError."""
        reply_r, reply_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            async with asyncio.timeout(timeout):
                try:
                    server = await self._send(b"\0".join(a.encode() for a in args), [reply_w, channel_fd, *bind_fds])
                finally:
                    os.close(reply_w)
                reply = await _read_reply(server, reply_r)
        finally:
            os.close(reply_r)
        if reply[:1] == b"P":
            return int(reply[1:])
        if not reply:
            # The pipe closes with a dying server's files, a moment before it is seen to exit: wait
            # for that moment before blaming its worker.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_EXIT_GRACE):
                    await asyncio.shield(server.exited)
            if server.lost or server.exited.done() or proc.exited(server.pid):  # the dying server dropped it
                raise LaunchError(UNAVAILABLE, "the launcher died before it answered: try again")
            raise LaunchError("E", "the launcher's worker exited without an answer")
        return _raise(reply)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _raise(reply: bytes) -> int:
    raise LaunchError(reply[:1].decode(), reply[1:].decode(errors="replace"))


def _drain(fd: int, chunks: list[bytes]) -> bool:
    """Read what is there; True at EOF."""
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return False
        if not data:
            return True
        chunks.append(data)


async def _read_reply(server: _Server, fd: int) -> bytes:
    """Everything written to the reply pipe until its EOF; LaunchError(UNAVAILABLE) if the server
    died first (unless its worker had already answered in full)."""
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    while not _drain(fd, chunks):
        if server.failed:
            raise LaunchError(UNAVAILABLE, "the launcher died before it answered (it has been restarted): try again")
        ready: asyncio.Future[None] = loop.create_future()
        server.waiters.add(ready)
        loop.add_reader(fd, _resolve, ready)
        try:
            await ready
        except LaunchError:
            if _drain(fd, chunks):  # the worker answered just before the server died
                break
            raise
        finally:
            loop.remove_reader(fd)
            server.waiters.discard(ready)
    return b"".join(chunks)
