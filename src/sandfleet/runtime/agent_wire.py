"""The wire protocol of the in-sandbox agent (agent.c): message types, flags, records and their encoding.

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

import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Literal

from sandfleet.runtime.agent_errors import ProtocolError

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
EXEC_LAZY = 128  # STARTED may wait (5 ms at most) for the first output or the EXIT: one wake-up for a short command
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


def decode_alert(payload: bytes) -> dict[str, Any]:
    """An ALERT's JSON object; ProtocolError if it is not one."""
    try:
        alert = json.loads(payload.decode(errors="replace"))
    except ValueError as exc:
        raise ProtocolError(f"malformed alert: {exc}") from None
    if not isinstance(alert, dict):
        raise ProtocolError("malformed alert: not an object")
    return alert


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
