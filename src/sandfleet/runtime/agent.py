"""Daemon side of the in-sandbox agent (agent.c): build, wire protocol and asyncio channel.

Every message is one SOCK_SEQPACKET datagram: ``u32 type, u32 id`` (little-endian) + payload.

Unsolicited from the agent: ALERT (id 0), a JSON object about an attempt on the agent that its
seccomp listener caught and refused (see agent.c and seccomp.py `attempt_rules`):

    {"kind": "attempt", "syscall": "kill", "nr": 62, "arch": "x86_64", "pid": 42, "uid": 0,
     "euid": 0, "comm": "sh", "signal": 15}

with "signal" (kill, tkill, tgkill, rt_sigqueueinfo, rt_tgsigqueueinfo), "request" (ptrace) or
"flags" (pidfd_open), and "gone": true when the caller died before the agent answered (its pid, uid
and comm may then be another process's). "pid" is as the agent (PID 1 of the sandbox) sees it; uids
are the sandbox's. At most 20 a second per sandbox; past that they are counted and reported once the
second is over as ``{"kind": "suppressed", "count": N}``. `AgentChannel.on_alert` receives each.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import signal as _signal
import socket
import stat
import struct
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sandfleet.runtime.prebuilt import install_prebuilt, prebuilt_dir

AGENT_SOURCE = Path(__file__).with_name("agent.c")
LAUNCHER_SOURCE = Path(__file__).with_name("launcher.c")
LAUNCHER_NAME = "sandfleet-run"  # <= 15 bytes: it is also the command name the orphan reaper matches
# 2: REOPEN, FORGET; 3: sessions framed by the agent, MERGE, WATCH; 4: ALERT; 5: terminals (PTY, RESIZE);
# 6: LOWFD, terminal sessions (SESSION | PTY)
AGENT_VERSION = "sandfleet-agent/6"

# daemon -> agent
MSG_EXEC = 1
MSG_STDIN = 2
MSG_SIGNAL = 3
MSG_PING = 4
MSG_REOPEN = 5  # move to a fresh socketpair offered on fd 4 (before a snapshot); same execs go on
REOPEN_CHECKPOINT = 1  # REOPEN's u32 flags: criu dumps next, so the agent closes its seccomp listener
MSG_FORGET = 6  # orphan every running exec but those listed: the rest belong to a daemon that is gone
MSG_SRUN = 7  # a session command begins (timeout, flags, cap, nonce); its script follows as STDIN
MSG_CMDIN = 8  # bytes for the running session command's stdin; empty = EOF
MSG_WATCH = 9  # watch a directory (u32 flags: 1 recursive; the path)
MSG_UNWATCH = 20
MSG_RESIZE = 22  # a terminal exec's window size: u16 rows, u16 cols
MSG_HOLD = 23  # u32 1: stop reading a terminal exec's output (its writers block), 0: read on
# agent -> daemon
MSG_STARTED = 10
MSG_STDOUT = 11
MSG_STDERR = 12
MSG_EXIT = 13
MSG_ERROR = 14
MSG_PONG = 15
MSG_HELLO = 16
MSG_SEXIT = 17  # a session command ended: status, flags, counts, duration, bytes dropped before it
MSG_WEVENT = 18  # u32 inotify mask, the path
MSG_WEND = 19  # the watch ended: i32 errno (0: asked to), reason
MSG_ALERT = 21  # an attempt on the agent (JSON object, id 0), unsolicited; see the module docstring

# EXEC flags
EXEC_STDIN_PIPE = 1
EXEC_SETSID = 2
EXEC_MERGE = 4  # stderr goes to the stdout pipe
EXEC_SESSION = 8  # a session shell: sockets for stdio, a status socket and a per-command stdin
EXEC_NONDUMP = 16  # start it with its effective gid differing (bash, dash): non-dumpable from its exec on
EXEC_PTY = 32  # a new pseudo-terminal as stdio and controlling tty; u16 rows, u16 cols follow the header
EXEC_LOWFD = 64  # a session shell's status socket and command stdin at fds 9 and 8 (dash cannot name 100, 101)
SESSION_FDS = (100, 101)  # (status, command stdin) of a session shell
SESSION_LOW_FDS = (9, 8)  # the same with EXEC_LOWFD
# EXIT flags
EXIT_TIMED_OUT = 1
EXIT_STDOUT_TRUNCATED = 2
EXIT_STDERR_TRUNCATED = 4
EXIT_LOST = 8  # a session command whose shell exited or never reported
# SRUN flags
SRUN_STDIN = 1
NONCE_LEN = 32
# SIGNAL scopes
SCOPE_GROUP = 0
SCOPE_TREE = 1
SCOPE_DESCENDANTS = 2

MAX_PAYLOAD = 64 * 1024
MAX_DATAGRAM = MAX_PAYLOAD + 8
HANDOFF_FD = 4
UNLIMITED = 2**64 - 1  # out_cap meaning "forward everything"
_NR_PIDFD_GETFD = 438  # same number on every architecture using the generic syscall table

_HDR = struct.Struct("<II")
_EXEC = struct.Struct("<IIIIQII")
_EXIT = struct.Struct("<iIQQQ")
_EXIT_CPU = struct.Struct("<Q")  # after _EXIT, from agents that send it (older ones do not)
_SIGNAL = struct.Struct("<iI")
_SRUN = struct.Struct("<IIQ")
_SEXIT = struct.Struct("<iIQQQQI")
_I32 = struct.Struct("<i")
_WINSZ = struct.Struct("<HH")


log = logging.getLogger("sandfleet.agent")


def decode_alert(payload: bytes) -> dict[str, Any]:
    """An ALERT's JSON object; ProtocolError if it is not one."""
    try:
        alert = json.loads(payload.decode(errors="replace"))
    except ValueError as exc:
        raise ProtocolError(f"malformed alert: {exc}") from None
    if not isinstance(alert, dict):
        raise ProtocolError("malformed alert: not an object")
    return alert


class AgentError(RuntimeError):
    """Base class for agent failures."""


class AgentBuildError(AgentError):
    """gcc failed; the message carries its stderr."""


class ProtocolError(AgentError):
    """Malformed message."""


class ChannelClosedError(AgentError):
    """The channel to the agent is gone."""


class ExecStartError(AgentError):
    """The agent could not start the command (chdir/setuid/exec failed)."""

    def __init__(self, errno_: int, message: str) -> None:
        super().__init__(errno_, message)
        self.errno = errno_
        self.message = message

    def __str__(self) -> str:
        return f"[Errno {self.errno}] {self.message}"


# ---- build -------------------------------------------------------------------------------


def build_static(source_path: Path, cache_dir: Path, name: str, *, prefer_musl: bool = False) -> Path:
    """Compile a C source statically to ``cache_dir/<hash>/<name>`` (content-addressed, reused if present).

    The file name is kept as given because it is the process's command name (`comm`), which the
    orphan reaper matches on. With `prefer_musl`, musl-gcc (Debian's musl-tools) is used when installed:
    a static glibc binary runs dozens of CPUID instructions at start (cache and feature probing), and
    each one traps to the hypervisor on a VM, so exec of the glibc-built agent costs ~0.5 ms against
    ~0.24 ms for the musl build, once per sandbox.
    """
    source = source_path.read_bytes()
    # A gcc build keeps the key it always had (a snapshot names the agent build it can be restored
    # with); a musl build is another build of the same source. A build already here or prebuilt at
    # setup is used before any compiler runs; musl's first.
    keys = {"gcc": hashlib.sha256(source).hexdigest()[:16]}
    if prefer_musl:
        keys["musl-gcc"] = hashlib.sha256(b"musl-gcc\0" + source).hexdigest()[:16]
        if found := _ready(cache_dir, keys["musl-gcc"], name):
            return found
    compiler = "musl-gcc" if prefer_musl and shutil.which("musl-gcc") else "gcc"
    key = keys[compiler]
    target = cache_dir / key / name
    if found := _ready(cache_dir, key, name):
        return found
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=target.parent)
    os.close(fd)
    try:
        res = subprocess.run(
            [compiler, "-O2", "-static", "-Wall", "-Wextra", "-o", tmp, str(source_path)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            raise AgentBuildError(f"{compiler} failed on {source_path.name} ({res.returncode}):\n{res.stderr}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: concurrent builders just overwrite with identical bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _ready(cache_dir: Path, key: str, name: str) -> Path | None:
    """`cache_dir/key/name` if it is there or could be copied from the prebuilt set."""
    target = cache_dir / key / name
    if target.exists():
        return target
    if (prebuilt_dir() / key / name).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        if install_prebuilt(key, name, target):
            return target
    return None


def build_agent(cache_dir: Path) -> Path:
    """The in-sandbox agent (agent.c), built once per source version."""
    return build_static(AGENT_SOURCE, cache_dir, "agent", prefer_musl=True)


def build_launcher(cache_dir: Path) -> Path:
    """The launcher (launcher.c) that starts a sandbox's agent in fresh namespaces."""
    return build_static(LAUNCHER_SOURCE, cache_dir, LAUNCHER_NAME)


# ---- wire format (pure) --------------------------------------------------------------------


@dataclass(frozen=True)
class OutputChunk:
    stream: Literal["stdout", "stderr"]
    data: bytes


@dataclass(frozen=True)
class ExitInfo:
    exit_code: int  # killed by signal n -> 128 + n
    signal: int | None
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    duration: float  # seconds
    # CPU seconds of the process and of the descendants it waited for (its rusage); None: not sent
    cpu: float | None = None

    @classmethod
    def from_raw(
        cls, status: int, flags: int, out: int, err: int, duration_us: int, cpu_us: int | None = None
    ) -> ExitInfo:
        sig: int | None = None
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            code = 128 + sig
        else:
            code = os.WEXITSTATUS(status)
        return cls(
            exit_code=code,
            signal=sig,
            timed_out=bool(flags & EXIT_TIMED_OUT),
            stdout_truncated=bool(flags & EXIT_STDOUT_TRUNCATED),
            stderr_truncated=bool(flags & EXIT_STDERR_TRUNCATED),
            stdout_bytes=out,
            stderr_bytes=err,
            duration=duration_us / 1e6,
            cpu=None if cpu_us is None else cpu_us / 1e6,
        )


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    uid: int
    gid: int
    timeout_ms: int
    out_cap: int
    flags: int
    winsize: tuple[int, int] | None = None  # EXEC_PTY: rows, cols


@dataclass(frozen=True)
class CommandExit:
    """The end of one session command (SEXIT)."""

    status: int  # as the shell reports $? (-1: the shell never reported)
    timed_out: bool
    lost: bool  # the shell exited or did not come back: the session is over
    stdout_truncated: bool
    stderr_truncated: bool
    stdout_bytes: int
    stderr_bytes: int
    duration: float
    dropped_before: int  # bytes background jobs printed between the previous command and this one
    seq: int  # the SRUN it answers

    @classmethod
    def decode(cls, payload: bytes) -> CommandExit:
        if len(payload) < _SEXIT.size:
            raise ProtocolError("short SEXIT")
        status, flags, out, err, dur, dropped, seq = _SEXIT.unpack_from(payload)
        return cls(
            status=status,
            timed_out=bool(flags & EXIT_TIMED_OUT),
            lost=bool(flags & EXIT_LOST),
            stdout_truncated=bool(flags & EXIT_STDOUT_TRUNCATED),
            stderr_truncated=bool(flags & EXIT_STDERR_TRUNCATED),
            stdout_bytes=out,
            stderr_bytes=err,
            duration=dur / 1e6,
            dropped_before=dropped,
            seq=seq,
        )


def encode_sexit(
    exec_id: int, status: int, flags: int, out: int, err: int, duration_us: int, dropped: int = 0, seq: int = 0
) -> bytes:
    return encode_message(MSG_SEXIT, exec_id, _SEXIT.pack(status, flags, out, err, duration_us, dropped, seq))


SRUN_HEAD = _SRUN.size + NONCE_LEN + 4


def encode_srun(
    exec_id: int, nonce: bytes, timeout_ms: int, cap: int, flags: int, seq: int, script: bytes = b""
) -> bytes:
    """SRUN with the script inline (or its first part: the rest goes as STDIN)."""
    if len(nonce) != NONCE_LEN:
        raise ValueError(f"nonce must be {NONCE_LEN} bytes")
    return encode_message(
        MSG_SRUN, exec_id, _SRUN.pack(timeout_ms, flags, cap) + nonce + struct.pack("<I", seq) + script
    )


@dataclass(frozen=True)
class WatchEvent:
    mask: int  # inotify mask (IN_CREATE, IN_MODIFY, ...)
    path: str  # absolute, inside the sandbox


Event = OutputChunk | ExitInfo | CommandExit


def encode_message(mtype: int, msg_id: int, payload: bytes = b"") -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return _HDR.pack(mtype, msg_id) + payload


def decode_message(data: bytes) -> tuple[int, int, bytes]:
    """Split a datagram into (type, id, payload)."""
    if len(data) < _HDR.size:
        raise ProtocolError(f"short datagram ({len(data)} bytes)")
    mtype, msg_id = _HDR.unpack_from(data)
    return mtype, msg_id, data[_HDR.size :]


def _cstr(s: str) -> bytes:
    b = s.encode()
    if b"\0" in b:
        raise ValueError(f"NUL byte in {s!r}")
    return b + b"\0"


def encode_exec(exec_id: int, req: ExecRequest) -> bytes:
    if not req.argv:
        raise ValueError("argv must not be empty")
    env = [f"{k}={v}" for k, v in req.env.items()]
    strings = b"".join(_cstr(s) for s in [req.cwd, *req.argv, *env])
    head = _EXEC.pack(req.flags, req.uid, req.gid, req.timeout_ms, req.out_cap, len(req.argv), len(env))
    if req.flags & EXEC_PTY:
        head += _WINSZ.pack(*(req.winsize or (24, 80)))
    return encode_message(MSG_EXEC, exec_id, head + strings)


def decode_exec(payload: bytes) -> ExecRequest:
    if len(payload) < _EXEC.size:
        raise ProtocolError("short EXEC")
    flags, uid, gid, tmo, cap, argc, envc = _EXEC.unpack_from(payload)
    winsize = None
    off = _EXEC.size
    if flags & EXEC_PTY:
        if len(payload) < off + _WINSZ.size:
            raise ProtocolError("short EXEC")
        winsize = _WINSZ.unpack_from(payload, off)
        off += _WINSZ.size
    parts = payload[off:].split(b"\0")
    if len(parts) < 2 + argc + envc:
        raise ProtocolError("EXEC strings truncated")
    strs = [p.decode() for p in parts[: 1 + argc + envc]]
    env = {k: v for k, _, v in (s.partition("=") for s in strs[1 + argc :])}
    return ExecRequest(strs[1 : 1 + argc], env, strs[0], uid, gid, tmo, cap, flags, winsize)


def encode_stdin(exec_id: int, data: bytes) -> bytes:
    """Empty data means: close the child's stdin."""
    return encode_message(MSG_STDIN, exec_id, data)


def encode_resize(exec_id: int, rows: int, cols: int) -> bytes:
    return encode_message(MSG_RESIZE, exec_id, _WINSZ.pack(rows, cols))


def decode_resize(payload: bytes) -> tuple[int, int]:
    if len(payload) < _WINSZ.size:
        raise ProtocolError("short RESIZE")
    rows, cols = _WINSZ.unpack_from(payload)
    return rows, cols


def encode_signal(exec_id: int, signo: int, scope: int = SCOPE_GROUP) -> bytes:
    return encode_message(MSG_SIGNAL, exec_id, _SIGNAL.pack(signo, scope))


def decode_signal(payload: bytes) -> tuple[int, int]:
    signo, scope = _SIGNAL.unpack_from(payload)
    return int(signo), int(scope)


def encode_ping(msg_id: int) -> bytes:
    return encode_message(MSG_PING, msg_id)


def encode_pong(msg_id: int) -> bytes:
    return encode_message(MSG_PONG, msg_id)


def encode_started(exec_id: int, pid: int) -> bytes:
    return encode_message(MSG_STARTED, exec_id, _I32.pack(pid))


def decode_started(payload: bytes) -> int:
    if len(payload) < 4:
        raise ProtocolError("short STARTED")
    return int(_I32.unpack_from(payload)[0])


def encode_output(exec_id: int, stream: Literal["stdout", "stderr"], data: bytes) -> bytes:
    return encode_message(MSG_STDOUT if stream == "stdout" else MSG_STDERR, exec_id, data)


def encode_exit(
    exec_id: int, status: int, flags: int, out: int, err: int, duration_us: int, cpu_us: int | None = None
) -> bytes:
    cpu = b"" if cpu_us is None else _EXIT_CPU.pack(cpu_us)
    return encode_message(MSG_EXIT, exec_id, _EXIT.pack(status, flags, out, err, duration_us) + cpu)


def decode_exit(payload: bytes) -> ExitInfo:
    if len(payload) < _EXIT.size:
        raise ProtocolError("short EXIT")
    status, flags, out, err, duration_us = _EXIT.unpack_from(payload)
    cpu = _EXIT_CPU.unpack_from(payload, _EXIT.size)[0] if len(payload) >= _EXIT.size + _EXIT_CPU.size else None
    return ExitInfo.from_raw(status, flags, out, err, duration_us, cpu)


def encode_error(exec_id: int, errno_: int, message: str) -> bytes:
    return encode_message(MSG_ERROR, exec_id, _I32.pack(errno_) + message.encode())


def decode_error(payload: bytes) -> tuple[int, str]:
    if len(payload) < 4:
        raise ProtocolError("short ERROR")
    return int(_I32.unpack_from(payload)[0]), payload[4:].decode(errors="replace")


def encode_hello(version: str = AGENT_VERSION) -> bytes:
    return encode_message(MSG_HELLO, 0, version.encode())


def decode_hello(payload: bytes) -> str:
    return payload.decode(errors="replace")


# ---- asyncio channel -----------------------------------------------------------------------


class ExecProcess:
    """One command running under the agent. Events are consumed by a single reader."""

    def __init__(self, channel: AgentChannel, exec_id: int) -> None:
        self.id = exec_id
        self.pid = -1
        self._channel = channel
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._exit: ExitInfo | None = None
        self._error: BaseException | None = None
        self._abandoned = False  # start() was cancelled: discard output, kill on STARTED

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._exit

    def _push(self, item: Event) -> None:
        if isinstance(item, ExitInfo):
            self._exit = item
        if not self._abandoned:
            self._queue.put_nowait(item)

    def _fail(self, exc: BaseException) -> None:
        if self._exit is None and self._error is None:
            self._error = exc
            self._queue.put_nowait(exc)

    async def write_stdin(self, data: bytes) -> None:
        for off in range(0, len(data), MAX_PAYLOAD):  # empty data would mean EOF: send nothing
            await self._channel._send(encode_stdin(self.id, data[off : off + MAX_PAYLOAD]))

    async def close_stdin(self) -> None:
        await self._channel._send(encode_stdin(self.id, b""))

    async def signal(self, signo: int, scope: int = SCOPE_GROUP) -> None:
        await self._channel._send(encode_signal(self.id, signo, scope))

    async def resize(self, rows: int, cols: int) -> None:
        """A terminal exec's new window size (its foreground job gets SIGWINCH)."""
        await self._channel._send(encode_resize(self.id, rows, cols))

    async def hold(self, stop: bool) -> None:
        """A terminal exec: stop reading its output (what it writes then blocks), or read on."""
        await self._channel._send(encode_message(MSG_HOLD, self.id, struct.pack("<I", 1 if stop else 0)))

    async def run_command(
        self, script: bytes, nonce: bytes, *, timeout: float | None, out_cap: int, stdin: bool = False, seq: int = 0
    ) -> None:
        """Begin one command of a session shell: the agent forwards its output (within `out_cap`
        per stream) until the shell reports, with `nonce`, through its status socket; the events
        then carry a CommandExit with this `seq`. `script` must end by reporting (see the daemon's
        session code); it travels inside the SRUN datagram when it fits."""
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000 + 0.999))
        flags = SRUN_STDIN if stdin else 0
        first = script[: MAX_PAYLOAD - SRUN_HEAD]
        await self._channel._send(encode_srun(self.id, nonce, timeout_ms, out_cap, flags, seq, first))
        await self.write_stdin(script[len(first) :])

    async def write_command_stdin(self, data: bytes) -> None:
        """Bytes for the stdin of the session command now running (started with stdin=True)."""
        for off in range(0, len(data), MAX_PAYLOAD):
            await self._channel._send(encode_message(MSG_CMDIN, self.id, data[off : off + MAX_PAYLOAD]))

    async def close_command_stdin(self) -> None:
        await self._channel._send(encode_message(MSG_CMDIN, self.id, b""))

    async def events(self) -> AsyncIterator[Event]:
        """Yield OutputChunks (and, for a session, a CommandExit per command), then the final
        ExitInfo. Raises ChannelClosedError if the channel dies."""
        while True:
            if self._queue.empty():
                if self._error is not None:
                    raise self._error
                if self._exit is not None:  # already fully consumed
                    yield self._exit
                    return
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, ExitInfo):
                return

    async def wait(self) -> tuple[bytes, bytes, ExitInfo]:
        """Collect all output until exit."""
        out: list[bytes] = []
        err: list[bytes] = []
        async for ev in self.events():
            if isinstance(ev, ExitInfo):
                return b"".join(out), b"".join(err), ev
            if isinstance(ev, OutputChunk):
                (out if ev.stream == "stdout" else err).append(ev.data)
        raise AssertionError("unreachable: events() ends with ExitInfo")


IN_Q_OVERFLOW = 0x4000


class AgentWatch:
    """File-change events under a directory of the sandbox, from the agent's inotify."""

    MAX_QUEUED = 10000  # beyond this, events are dropped and counted (a slow reader costs no memory)

    def __init__(self, channel: AgentChannel, watch_id: int) -> None:
        self.id = watch_id
        self._channel = channel
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._error: BaseException | None = None
        self._ended = False
        self.dropped = 0

    def _push(self, ev: WatchEvent) -> None:
        if self._queue.qsize() >= self.MAX_QUEUED:
            if not self.dropped:  # the reader learns that events were lost, once per gap
                self._queue.put_nowait(WatchEvent(IN_Q_OVERFLOW, ""))
            self.dropped += 1
            return
        self.dropped = 0
        self._queue.put_nowait(ev)

    def _end(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
            self._queue.put_nowait(None)

    async def next(self, timeout: float | None = None) -> WatchEvent | None:  # noqa: ASYNC109
        """The next event; None once the watch has ended (raises if it ended on an error);
        TimeoutError if nothing came within `timeout`."""
        async with asyncio.timeout(timeout):
            item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # stay ended for later callers
            if self._error is not None:
                raise self._error
        return item

    async def close(self) -> None:
        if not self._ended:
            self._channel._watches.pop(self.id, None)
            self._end(None)
            with contextlib.suppress(ChannelClosedError):
                await self._channel._send(encode_message(MSG_UNWATCH, self.id))


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
    ) -> ExecProcess:
        """Start a command; returns once it has exec'd. Raises ExecStartError on failure.

        `out_cap`: bytes forwarded per stream (the rest is drained and counted); None = no cap.
        `session`: a shell whose commands are framed by the agent (`ExecProcess.run_command`).
        `pty`: (rows, cols) of a new pseudo-terminal that is its stdin, stdout and stderr (output
        comes as stdout; stdin is always open; it leads a session of its own); with `session`, the
        terminal is the shell's stdout and stderr and each command's stdin (its script still comes
        on a socket). `low_fds`: a session shell's descriptors at SESSION_LOW_FDS.
        """
        self._check_open()
        out_cap = UNLIMITED if out_cap is None else out_cap
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000 + 0.999))
        flags = (EXEC_STDIN_PIPE if stdin else 0) | (EXEC_SETSID if setsid else 0)
        flags |= (EXEC_MERGE if merge_stderr else 0) | (EXEC_SESSION if session else 0)
        flags |= (EXEC_NONDUMP if nondump else 0) | (EXEC_LOWFD if low_fds else 0)
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


# ---- handoff -------------------------------------------------------------------------------

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
