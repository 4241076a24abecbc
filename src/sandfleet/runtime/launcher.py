"""Client of the launcher server: `sandfleet-run --serve` (launcher.c), started once per daemon.

Each create is one SOCK_SEQPACKET message carrying the launch arguments and, by SCM_RIGHTS, a reply
pipe, the agent channel and the pinned bind-mount sources. The server forks a worker per message, so
launches overlap and the daemon never forks or execs on its hot path (posix_spawn of a static binary
still stalls the calling thread, and the GIL with it, until the exec completes).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import signal
import socket
from pathlib import Path

from sandfleet.runtime import mounts, proc

log = logging.getLogger("sandfleet.launcher")

INVALID = "I"  # the request itself cannot be carried out (e.g. a bind target the image cannot take)


class LaunchError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.invalid = kind == INVALID
        self.message = message


class LauncherServer:
    """One `sandfleet-run --serve` process; restarted transparently if it dies."""

    def __init__(self, binary: Path, *, agent_fd: int, seccomp_fd: int, shared_dir: Path) -> None:
        self.binary = binary
        # Where the server mounts what all sandboxes bind: a read-only sysfs and an empty tmpfs.
        self.shared_dir = shared_dir
        self.agent_fd = agent_fd
        self.seccomp_fd = seccomp_fd
        self._sock: socket.socket | None = None
        self._pid: int | None = None
        self._send_lock = asyncio.Lock()

    async def start(self) -> None:
        for name in ("sysfs", "empty", "template"):  # template: only mounted in the server's template namespace
            (self.shared_dir / name).mkdir(mode=0o555, parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._pid = proc.start_background(
                [str(self.binary), "--serve", "--shared", str(self.shared_dir)],
                fd_map={3: theirs.fileno(), 4: self.agent_fd, 5: self.seccomp_fd},
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        for _ in range(200):  # the server mounts the shared sysfs before it takes requests
            if await asyncio.to_thread(os.path.ismount, self.shared_dir / "empty"):
                return
            if proc.exited(self._pid):
                break
            await asyncio.sleep(0.01)
        await self.close()
        raise LaunchError("E", f"the launcher could not mount sysfs and an empty tmpfs under {self.shared_dir}")

    async def close(self) -> None:
        if self._sock is not None:
            self._sock.close()  # the server exits on EOF
            self._sock = None
        for name in ("sysfs", "empty"):
            with contextlib.suppress(OSError):
                mounts.umount(str(self.shared_dir / name), lazy=True)
        if self._pid is not None:
            pid, self._pid = self._pid, None
            try:
                async with asyncio.timeout(5):
                    await proc.wait_pid(pid)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                await proc.wait_pid(pid)
            finally:
                proc.forget(pid)

    async def _send(self, payload: bytes, fds: list[int]) -> None:
        # One sender at a time: sends are short, and a single waiter per fd is all the loop allows.
        async with self._send_lock:
            for attempt in range(2):
                if self._sock is None:
                    await self._restart()
                sock = self._sock
                assert sock is not None
                try:
                    await self._sendmsg(sock, payload, fds)
                    return
                except (BrokenPipeError, ConnectionResetError):
                    if attempt:
                        raise LaunchError("E", "the launcher died") from None
                    log.warning("the launcher died; restarting it")
                    await self._restart()

    async def _restart(self) -> None:
        await self.close()
        try:
            await self.start()
        except (OSError, LaunchError) as exc:
            raise LaunchError("E", f"the launcher cannot be restarted: {exc}") from exc

    async def _sendmsg(self, sock: socket.socket, payload: bytes, fds: list[int]) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock.sendmsg([payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
                return
            except BlockingIOError:
                # The server's queue is full (a burst): wait until it drains a message.
                ready: asyncio.Future[None] = loop.create_future()
                fileno = sock.fileno()
                loop.add_writer(fileno, _resolve, ready)
                try:
                    await ready
                finally:
                    loop.remove_writer(fileno)

    async def launch(self, args: list[str], *, channel_fd: int, bind_fds: list[int], timeout: float) -> int:
        """Start one sandbox; return its agent's pid. Raises LaunchError or TimeoutError."""
        reply_r, reply_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            async with asyncio.timeout(timeout):
                try:
                    await self._send(b"\0".join(a.encode() for a in args), [reply_w, channel_fd, *bind_fds])
                finally:
                    os.close(reply_w)
                reply = await _read_to_eof(reply_r)
        finally:
            os.close(reply_r)
        if reply[:1] == b"P":
            return int(reply[1:])
        if not reply:
            raise LaunchError("E", "the launcher's worker exited without an answer")
        return _raise(reply)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _raise(reply: bytes) -> int:
    raise LaunchError(reply[:1].decode(), reply[1:].decode(errors="replace"))


async def _read_to_eof(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    while True:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            ready: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _resolve, ready)
            try:
                await ready
            finally:
                loop.remove_reader(fd)
            continue
        if not data:
            return b"".join(chunks)
        chunks.append(data)
