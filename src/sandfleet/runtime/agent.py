"""The asyncio channel to a sandbox's agent (`AgentChannel`) over its SOCK_SEQPACKET socket; taking one over."""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import signal as _signal
import socket
import stat
import struct
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sandfleet.runtime.agent_errors import AgentError, ChannelClosedError, ExecStartError, ProtocolError
from sandfleet.runtime.agent_exec import AgentWatch, ExecProcess
from sandfleet.runtime.agent_wire import (
    _NR_PIDFD_GETFD,
    EXEC_LAZY,
    EXEC_LOWFD,
    EXEC_MERGE,
    EXEC_NONDUMP,
    EXEC_PTY,
    EXEC_SESSION,
    EXEC_SETSID,
    EXEC_STDIN_PIPE,
    HANDOFF_FD,
    MAX_DATAGRAM,
    MSG_ALERT,
    MSG_ERROR,
    MSG_EXIT,
    MSG_FORGET,
    MSG_HELLO,
    MSG_PONG,
    MSG_REOPEN,
    MSG_SEXIT,
    MSG_STARTED,
    MSG_STDERR,
    MSG_STDOUT,
    MSG_WATCH,
    MSG_WEND,
    MSG_WEVENT,
    REOPEN_CHECKPOINT,
    SCOPE_TREE,
    UNLIMITED,
    CommandExit,
    ExecRequest,
    OutputChunk,
    WatchEvent,
    _cstr,
    decode_alert,
    decode_error,
    decode_exit,
    decode_hello,
    decode_message,
    decode_started,
    encode_exec,
    encode_message,
    encode_ping,
    encode_signal,
)

log = logging.getLogger("sandfleet.agent")


class AgentChannel:
    """A connected SOCK_SEQPACKET channel to one agent.

    Reading happens in a loop reader callback rather than a task, so thousands of idle
    channels cost only a selector registration each.
    """

    def __init__(
        self,
        sock: socket.socket,
        *,
        on_close: Callable[[AgentChannel], None] | None = None,
        first_id: int = 1,
    ) -> None:
        """`first_id`: where message ids start (a restored agent still knows its snapshot's exec ids)."""
        self._loop = asyncio.get_running_loop()
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self._execs: dict[int, ExecProcess] = {}
        self._starts: dict[int, asyncio.Future[int]] = {}
        self._pings: dict[int, asyncio.Future[None]] = {}
        self._watches: dict[int, AgentWatch] = {}
        self._hello: asyncio.Future[str] | None = None
        self._next_id = first_id
        self._reopening = False  # between reopen() and adopt_socket()
        self._reopened: asyncio.Future[None] | None = None  # EOF of the old socket after reopen()
        self._sends_held = False  # reopen() holds _send_lock until adopt_socket()
        self._held_kills: list[bytes] = []  # cleanup kills made meanwhile, for the new channel
        self._send_lock = asyncio.Lock()
        self._send_waiter: asyncio.Future[None] | None = None
        self._closed = False
        self.close_reason: BaseException | None = None
        self.agent_version: str | None = None
        self.on_close = on_close  # called once on EOF/error (not on an explicit close())
        # called with each ALERT's object (an attempt on the agent); its exceptions are logged
        self.on_alert: Callable[[dict[str, Any]], None] | None = None
        self._loop.add_reader(self._fd, self._on_readable)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def active_execs(self) -> int:
        return len(self._execs)

    # -- public API

    async def wait_hello(self, timeout: float | None = None) -> str:  # noqa: ASYNC109
        """Wait for the agent's HELLO (already buffered after a handoff); returns its version."""
        if self.agent_version is not None:
            return self.agent_version
        self._check_open()
        if self._hello is None or self._hello.done():
            self._hello = self._loop.create_future()
        async with asyncio.timeout(timeout):
            return await asyncio.shield(self._hello)

    async def ping(self, timeout: float | None = None) -> float:  # noqa: ASYNC109
        """Round trip to the agent; returns the latency in seconds."""
        self._check_open()
        msg_id = self._alloc_id()
        fut: asyncio.Future[None] = self._loop.create_future()
        self._pings[msg_id] = fut
        t0 = self._loop.time()
        try:
            async with asyncio.timeout(timeout):
                await self._send(encode_ping(msg_id))
                await fut
        finally:
            self._pings.pop(msg_id, None)
        return self._loop.time() - t0

    async def start(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str = "/",
        uid: int = 0,
        gid: int = 0,
        timeout: float | None = None,  # noqa: ASYNC109 (agent-side timeout, not ours)
        out_cap: int | None = None,
        stdin: bool = False,
        setsid: bool = False,
        merge_stderr: bool = False,
        session: bool = False,
        nondump: bool = False,
        pty: tuple[int, int] | None = None,
        low_fds: bool = False,
        lazy: bool = False,
    ) -> ExecProcess:
        """Start a command; returns once it has exec'd. Raises ExecStartError on failure.

        `out_cap`: bytes forwarded per stream (the rest is drained and counted); None = no cap.
        `session`: a shell whose commands are framed by the agent (`ExecProcess.run_command`).
        `pty`: (rows, cols) of a new pseudo-terminal that is its stdin, stdout and stderr (output
        comes as stdout; stdin is always open; it leads a session of its own); with `session`, the
        terminal is the shell's stdout and stderr and each command's stdin (its script still comes
        on a socket). `low_fds`: a session shell's descriptors at SESSION_LOW_FDS. `lazy`: the caller
        waits for the whole result anyway, so STARTED may come with the command's first output or
        its EXIT (within 5 ms): a short command then answers in one datagram burst.
        """
        self._check_open()
        out_cap = UNLIMITED if out_cap is None else out_cap
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000 + 0.999))
        flags = (EXEC_STDIN_PIPE if stdin else 0) | (EXEC_SETSID if setsid else 0)
        flags |= (EXEC_MERGE if merge_stderr else 0) | (EXEC_SESSION if session else 0)
        flags |= (EXEC_NONDUMP if nondump else 0) | (EXEC_LOWFD if low_fds else 0) | (EXEC_LAZY if lazy else 0)
        if pty is not None:
            flags |= EXEC_PTY | EXEC_STDIN_PIPE | EXEC_SETSID | EXEC_MERGE
        exec_id = self._alloc_id()
        req = ExecRequest(list(argv), dict(env or {}), cwd, uid, gid, timeout_ms, out_cap, flags, pty)
        data = encode_exec(exec_id, req)
        proc = ExecProcess(self, exec_id)
        fut: asyncio.Future[int] = self._loop.create_future()
        self._execs[exec_id] = proc
        self._starts[exec_id] = fut
        try:
            await self._send(data)
            proc.pid = await fut
        except BaseException:
            self._starts.pop(exec_id, None)
            if fut.cancelled() or not fut.done():
                # STARTED may still come: the dispatcher kills the process then
                proc._abandoned = True
            elif fut.exception() is None:  # started, but our caller is going away
                self._execs.pop(exec_id, None)
                self._send_nowait(encode_signal(exec_id, _signal.SIGKILL, SCOPE_TREE))
            raise
        return proc

    @property
    def next_id(self) -> int:
        return self._next_id

    async def reopen(self, timeout: float) -> None:  # noqa: ASYNC109
        """Ask the agent to move to a socketpair of its own (offered on its fd 4) and close this one.

        Before a checkpoint: the agent's end of a channel the daemon made is a socket of the host's
        network namespace that criu cannot dump, a pair the agent made is. The agent also closes its
        seccomp listener (criu cannot dump that either): attempts on it are then refused unreported.
        Sends wait from here until `adopt_socket()` (or `fail()`); output of running execs queues in
        the new pair. From here on, the old socket's EOF means the agent moved, never that it died,
        even after a timeout.
        """
        self._check_open()
        self._reopening = True
        self._reopened = self._loop.create_future()
        async with asyncio.timeout(timeout):
            await self._send_lock.acquire()  # first: no queued sender may write after REOPEN
            self._sends_held = True
            await self._send_unlocked(encode_message(MSG_REOPEN, 0, struct.pack("<I", REOPEN_CHECKPOINT)))
            await asyncio.shield(self._reopened)

    async def forget(self, keep: Sequence[int] = ()) -> None:
        """Tell the agent that execs it still runs belong to nobody we know (after adopt or restore),
        except those in `keep` (a fork's copies of its parent's sessions and background processes)."""
        await self._send(encode_message(MSG_FORGET, 0, b"".join(struct.pack("<I", i) for i in keep)))

    def attach(self, exec_id: int, pid: int) -> ExecProcess:
        """A handle on an exec the agent already runs (kept by `forget(keep=...)`)."""
        self._check_open()
        proc = ExecProcess(self, exec_id)
        proc.pid = pid
        self._execs[exec_id] = proc
        return proc

    async def watch(self, path: str, *, recursive: bool = True) -> AgentWatch:
        """inotify on a directory of the sandbox, run by the agent (charged to the sandbox)."""
        self._check_open()
        watch_id = self._alloc_id()
        w = AgentWatch(self, watch_id)
        self._watches[watch_id] = w
        try:
            payload = struct.pack("<I", 1 if recursive else 0) + _cstr(path)
            await self._send(encode_message(MSG_WATCH, watch_id, payload))
        except BaseException:
            self._watches.pop(watch_id, None)
            raise
        return w

    def fail(self, reason: str) -> None:
        """Give up on the channel as if the agent had gone (on_close runs: the sandbox is lost)."""
        self._shutdown(ChannelClosedError(reason))

    def _release_sends(self) -> None:
        self._held_kills.clear()
        if self._sends_held:
            self._sends_held = False
            self._send_lock.release()

    def adopt_socket(self, sock: socket.socket) -> None:
        """Carry on over the agent's new channel (after `reopen()`), with every exec still attached."""
        self._check_open()
        self._reopening = False
        self._loop.remove_reader(self._fd)
        self._sock.close()
        sock.setblocking(False)
        self._sock = sock
        self._fd = sock.fileno()
        self._loop.add_reader(self._fd, self._on_readable)
        kills = self._held_kills[:]
        self._release_sends()
        for data in kills:
            self._send_nowait(data)

    def kill_nowait(self, exec_id: int, scope: int = SCOPE_TREE) -> None:
        """SIGKILL an exec's processes without waiting (cleanup of an abandoned request: never
        blocks, even on an agent that stopped reading)."""
        self._send_nowait(encode_signal(exec_id, _signal.SIGKILL, scope))

    def close(self) -> None:
        """Close the channel; pending execs see ChannelClosedError. on_close is not called."""
        self._shutdown(None, notify=False)

    # -- internals

    def _check_open(self) -> None:
        if self._closed:
            raise ChannelClosedError("agent channel is closed") from self.close_reason

    def _alloc_id(self) -> int:
        while True:
            msg_id = self._next_id
            self._next_id = msg_id % 0xFFFFFFFF + 1
            if msg_id not in self._execs and msg_id not in self._pings and msg_id not in self._watches:
                return msg_id

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:  # datagrams must not interleave their add_writer waits
            await self._send_unlocked(data)

    async def _send_unlocked(self, data: bytes) -> None:
        """Send one datagram; the caller holds _send_lock."""
        self._check_open()
        try:
            self._sock.send(data)  # fast path; SEQPACKET sends are all-or-nothing
            return
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self._shutdown(exc)
            raise ChannelClosedError(str(exc)) from exc
        waiter = asyncio.ensure_future(self._loop.sock_sendall(self._sock, data))
        self._send_waiter = waiter
        try:
            await waiter
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self._closed and (task is None or task.cancelling() == 0):
                raise ChannelClosedError("agent channel closed during send") from None
            raise
        except OSError as exc:
            self._shutdown(exc)
            raise ChannelClosedError(str(exc)) from exc
        finally:
            self._send_waiter = None

    def _send_nowait(self, data: bytes) -> None:
        """Best-effort send from a callback (used only for cleanup kills)."""
        if self._closed:
            return
        if self._sends_held:
            # Past REOPEN the agent reads the old socket no more, and closing it with this still
            # unread would reset it (ECONNRESET, not EOF): sent on the new channel instead.
            self._held_kills.append(data)
            return
        try:
            self._sock.send(data)
        except OSError:
            pass

    def _on_readable(self) -> None:
        for _ in range(256):  # bounded, so one chatty channel can't starve the loop
            if self._closed:
                return
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # A socket closed with datagrams still unread reports ECONNRESET to its peer; while
                # reopening, that is the agent moving as asked as much as an EOF is.
                if not (self._reopening and exc.errno == errno.ECONNRESET):
                    self._shutdown(exc)
                    return
                data = b""
            if not data:
                if self._reopening:  # the agent moved to its new pair as asked
                    self._loop.remove_reader(self._fd)
                    if self._reopened is not None and not self._reopened.done():
                        self._reopened.set_result(None)
                    return
                self._shutdown(ChannelClosedError("agent closed the channel"))
                return
            try:
                self._dispatch(data)
            except (ProtocolError, struct.error, UnicodeDecodeError):
                continue  # a bad message must not kill the channel for everyone else

    def _dispatch(self, data: bytes) -> None:
        mtype, msg_id, payload = decode_message(data)
        if mtype in (MSG_STDOUT, MSG_STDERR):
            proc = self._execs.get(msg_id)
            if proc is not None:
                proc._push(OutputChunk("stdout" if mtype == MSG_STDOUT else "stderr", payload))
        elif mtype == MSG_EXIT:
            proc = self._execs.pop(msg_id, None)
            if proc is not None:
                proc._push(decode_exit(payload))
        elif mtype == MSG_SEXIT:
            proc = self._execs.get(msg_id)
            if proc is not None:
                proc._push(CommandExit.decode(payload))
        elif mtype == MSG_WEVENT:
            watch = self._watches.get(msg_id)
            if watch is not None and len(payload) >= 4:
                (mask,) = struct.unpack_from("<I", payload)
                watch._push(WatchEvent(mask, payload[4:].split(b"\0", 1)[0].decode(errors="replace")))
        elif mtype == MSG_WEND:
            watch = self._watches.pop(msg_id, None)
            if watch is not None:
                err, why = decode_error(payload)
                watch._end(None if err == 0 else AgentError(f"watch ended: {why} ({os.strerror(err)})"))
        elif mtype == MSG_STARTED:
            pid = decode_started(payload)
            start = self._starts.pop(msg_id, None)
            if start is not None and not start.done():
                start.set_result(pid)
            else:
                proc = self._execs.get(msg_id)
                if proc is not None and proc._abandoned:
                    proc.pid = pid
                    self._send_nowait(encode_signal(msg_id, _signal.SIGKILL, SCOPE_TREE))
        elif mtype == MSG_ERROR:
            err, message = decode_error(payload)
            start = self._starts.pop(msg_id, None)
            proc = self._execs.pop(msg_id, None)
            if start is not None and not start.done():
                start.set_exception(ExecStartError(err, message))
            elif proc is not None:
                proc._fail(AgentError(f"agent error {err}: {message}"))
        elif mtype == MSG_PONG:
            ping = self._pings.pop(msg_id, None)
            if ping is not None and not ping.done():
                ping.set_result(None)
        elif mtype == MSG_ALERT:
            alert = decode_alert(payload)
            if self.on_alert is not None:
                try:
                    self.on_alert(alert)
                except Exception:
                    log.exception("agent alert handler failed")
        elif mtype == MSG_HELLO:
            self.agent_version = decode_hello(payload)
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(self.agent_version)

    def _shutdown(self, exc: BaseException | None, *, notify: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self.close_reason = exc
        self._loop.remove_reader(self._fd)
        self._release_sends()
        waiter = self._send_waiter
        if waiter is not None and not waiter.done():
            # sock_sendall unregisters its writer while unwinding; close the socket only
            # afterwards so a recycled fd number can't be unregistered by mistake
            waiter.cancel()
            waiter.add_done_callback(lambda _f: self._sock.close())
        else:
            self._sock.close()
        closed = ChannelClosedError("agent channel closed")
        if exc is not None:
            closed.__cause__ = exc
        futs: list[asyncio.Future[int] | asyncio.Future[None]] = [*self._starts.values()]
        futs.extend(self._pings.values())
        for fut in futs:
            if not fut.done():
                fut.set_exception(closed)
        if self._hello is not None and not self._hello.done():
            self._hello.set_exception(closed)
        for proc in self._execs.values():
            proc._fail(closed)
        for watch in self._watches.values():
            watch._end(closed)
        self._watches.clear()
        self._starts.clear()
        self._pings.clear()
        self._execs.clear()
        if notify and self.on_close is not None:
            self.on_close(self)


_libc: ctypes.CDLL | None = None


def grab_handoff_channel(agent_pid: int) -> socket.socket:
    """Take the agent's fresh channel (its fd 4) after the previous daemon died.

    Raises OSError if the agent has no handoff channel pending (yet).
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.syscall.restype = ctypes.c_long
    pidfd = os.pidfd_open(agent_pid)
    try:
        fd = int(
            _libc.syscall(
                ctypes.c_long(_NR_PIDFD_GETFD),
                ctypes.c_int(pidfd),
                ctypes.c_int(HANDOFF_FD),
                ctypes.c_uint(0),
            )
        )
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"pidfd_getfd({agent_pid}, {HANDOFF_FD}): {os.strerror(e)}")
    finally:
        os.close(pidfd)
    try:
        # between handoffs the agent parks /dev/null on fd 4
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise OSError(errno.EAGAIN, f"agent {agent_pid} has no pending handoff channel")
        sock = socket.socket(fileno=fd)
    except BaseException:
        os.close(fd)
        raise
    if sock.type != socket.SOCK_SEQPACKET:
        sock.close()
        raise OSError(errno.EPROTOTYPE, "handoff fd is not a SOCK_SEQPACKET socket")
    return sock
