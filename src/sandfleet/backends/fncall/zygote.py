"""The fncall tier's warm worker: runs inside a pooled sandbox under the image's own python3.

The daemon starts it through the agent (`python3 -I -c <this file's text, residue.py's and
forking.py's> <preload...>`) as the sandbox's root and keeps its stdin and stdout: per call it writes a request
(HEADER, then that many bytes of JSON) and reads a line `taken` (none: the call never began), then
the result, then `settled` (nothing of the call is left: the next request may come). Three kinds
of process, so that nothing of a call ever lies in the memory a later call is forked from:

- the supervisor (this process, long-lived): reads each request, writes the call's files, gives the
  call forked ahead its order, feeds its stdin and collects its output, kills what it left running
  (if anything: once the call's own process is reaped, or at the call's deadline), answers, then
  (before reading the next request) removes what it left. It holds every call's data, so no call
  is ever forked from it once it has read a request (nor can a call read it: it is root, calls
  are not);
- the zygote, forked from the supervisor before any request (warm: the preloads imported): it reads
  nothing at all. It forks the next call ahead with five pipes (order, stdin, stdout, stderr, exit
  status) and sends the supervisor their other ends (SCM_RIGHTS), then reports the call's exit
  status and then that every process of the call is gone (it is their child subreaper: orphans
  come to it, and it reaps until no child is left), in one message when the call left nothing
  running. Only then does it fork the next;
- the call: a fork of the zygote that waits, still root, for its order on its pipe (the code as the
  supervisor compiled it, marshalled: a first compile in a fresh fork costs hundreds of copy-on-
  write faults), then becomes the unprivileged CALL_UID in a scratch directory of its own and runs
  the code (or execs bash). Before it exits it writes its exit status and closes its output, so the
  answer need not wait for the kernel to take its memory down (unless something it left holds the
  output: then the answer waits for its reaping and that kill). Each page it writes is copied from
  the zygote's, so its path touches few objects (forking.py).

What a call could leave, and where it goes: residue.py.
Limits (memory, pids, no network) are the worker sandbox's, which serves one call at a time.

Kept free of anything newer than Python 3.9 and of imports beyond the standard library. The zygote's
loop and the call's process: forking.py.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import marshal
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

from sandfleet.backends.fncall.forking import CHUNK, STATUS, zygote  # in a worker, sent along too
from sandfleet.backends.fncall.residue import (  # in a worker, the module the daemon sends along
    CALL_UID,
    SCRATCH,
    as_call_uid,
    claim,
    clear,
    kill_calls,
    remove_ipc,
    remove_tree,
    sweep,
)

HEADER = struct.Struct(">4sI")  # a request's MAGIC and length (the daemon's side: daemon/node/stateless_calls.py)
MAGIC = b"\xffSFZ"  # never in a request's JSON (ASCII): a stream out of step is seen at once
KILL_AGAIN = 0.05  # seconds between kills of what is left of a call past its time
SETTLE_GRACE = 1.0  # seconds an answered call's processes have to end before they are killed
LOCK = "/run/.sandfleet-zygote"  # root's: held by the live supervisor and zygote (see take_over)


class _ZygoteGone(Exception):
    """The zygote died (killed from inside the worker, say): the supervisor starts afresh."""


class Zygote:
    """The supervisor's end of the zygote: its messages, and the pipes of the call it forked ahead."""

    def __init__(self, ctl: socket.socket) -> None:
        self.ctl = ctl
        self.spare: list[int] | None = None
        self.failed = False

    def fileno(self) -> int:
        return self.ctl.fileno()

    def recv(self, in_call: bool = False) -> list[bytes]:
        """The words of the zygote's next message (a spare's pipes kept); _ZygoteGone when it died.
        Outside a call, x and g are of the spare: it died before its order (killed by root or the
        OOM killer)."""
        # (socket.recv_fds would drop the flag: these must not outlive an exec of this process)
        msg, anc, _, _ = self.ctl.recvmsg(16, socket.CMSG_SPACE(5 * 4), socket.MSG_CMSG_CLOEXEC)
        fds: list[int] = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += struct.unpack(f"{len(data) // 4}i", data[: len(data) - len(data) % 4])
        words = []
        while msg:
            n = 1 + STATUS.size if msg[:1] == b"x" else 1
            words.append(msg[:n])
            msg = msg[n:]
        for word in words:
            if word == b"s" and len(fds) == 5 or not in_call and word[:1] in (b"x", b"g"):
                self.drop()
                if word == b"s":
                    self.spare, fds = fds, []
            self.failed = self.failed or word == b"F"
        for fd in fds:
            os.close(fd)
        if not words:
            raise _ZygoteGone
        return words

    def drop(self) -> None:
        for fd in self.spare or ():
            os.close(fd)
        self.spare = None

    def take(self) -> list[int] | None:
        """The pipes of the call forked ahead (its order, stdin, stdout, stderr, exit status), once
        it is there and alive; None: it could not be forked."""
        if self.spare is None and self.failed:
            self.failed = False
            try:
                self.ctl.send(b"r")  # fork again
            except OSError as exc:
                raise _ZygoteGone from exc
        while True:
            spare = self.spare
            watch = [self.fileno()] if spare is None else [self.fileno(), spare[4]]
            r, _, _ = select.select(watch, [], [], None if spare is None else 0)
            if self.fileno() in r:
                self.recv()
                if self.spare is None and self.failed:
                    return None
            elif spare is not None and spare[4] in r:  # its status pipe ended unwritten: it died
                self.drop()
            elif spare is not None:
                self.spare = None
                return spare


def prepare_scratch(req: dict[str, Any]) -> None:
    try:
        os.mkdir(SCRATCH, 0o700)
    except FileExistsError:  # left by a request that failed before its call (its files go with the next)
        remove_tree(SCRATCH)
        os.mkdir(SCRATCH, 0o700)
    files = req.get("files") or {}
    for name, data in files.items():
        path = os.path.join(SCRATCH, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
    if not files:
        os.lchown(SCRATCH, CALL_UID, CALL_UID)
        return
    for dirpath, dirnames, filenames in os.walk(SCRATCH):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.lchown(name, CALL_UID, CALL_UID)


def keep(fd: int, kept: dict[int, list[bytes]], counts: dict[int, int], cap: int) -> bool:
    """Read a chunk of a call's output, kept up to `cap` bytes (the rest counted); False at its end."""
    data = os.read(fd, CHUNK)
    room = cap - counts[fd]
    if room > 0:
        kept[fd].append(data[:room])
    counts[fd] += len(data)
    return bool(data)


def prepare(req: dict[str, Any]) -> bytes:
    """The call's scratch directory and files, and its order (what the call reads from its pipe)."""
    prepare_scratch(req)
    code: Any = req["code"]
    if req["language"] == "python":
        # Compiled here, where the compiler is warm (in a fresh fork its first run costs hundreds
        # of copy-on-write faults); the call gets the code object, marshalled.
        try:
            code = compile(code, "<code>", "exec")
        except SyntaxError as exc:
            code = ("SyntaxError", exc.args)
        except ValueError as exc:  # a NUL in the source
            code = ("ValueError", str(exc))
    return marshal.dumps((req["language"], code, req.get("env") or {}, SCRATCH))


def call(req: dict[str, Any], order: bytes, zyg: Zygote, deadline: float) -> tuple[dict[str, Any], bool]:
    """Run one call through the zygote; returns its result once its status and all its output are
    in, and whether the zygote said that nothing of it is left (else `settle` waits for that)."""
    cap = int(req["cap"])
    t0 = time.monotonic()
    fds = zyg.take()
    if fds is None:
        return {"id": req["id"], "error": "the zygote could not fork the call (the pids limit?)"}, True
    req_w, in_w, out_r, err_r, status_r = fds
    kept: dict[int, list[bytes]] = {out_r: [], err_r: []}
    counts = {out_r: 0, err_r: 0}
    pending = {req_w: order, in_w: base64.b64decode(req.get("stdin") or "")}
    for fd in pending:
        os.set_blocking(fd, False)
    status = None
    ended = 0.0
    gone = timed_out = reaped = False
    readers = [out_r, err_r, status_r, zyg.fileno()]
    while not gone and not (status is not None and out_r not in readers and err_r not in readers):
        for fd in [fd for fd, data in pending.items() if not data]:
            os.close(fd)
            del pending[fd]
        wait = None
        if not reaped:  # (its own status byte is a word of its code, not its end)
            if not timed_out and deadline <= time.monotonic():
                timed_out = True
                for fd in pending:  # an order cut short: a call that has not begun never does
                    os.close(fd)
                pending.clear()
                readers = [zyg.fileno()]  # its output is not waited for any more
            if timed_out:  # killed until reaped: a kill misses a call not yet of CALL_UID
                as_call_uid(kill_calls)
                wait = KILL_AGAIN
            else:
                wait = deadline - time.monotonic()
        r, w, _ = select.select(readers, list(pending), [], wait)
        for fd in w:
            try:
                pending[fd] = pending[fd][os.write(fd, pending[fd][:CHUNK]) :]
            except BrokenPipeError:
                pending[fd] = b""
        for fd in r:
            if fd in (out_r, err_r):
                if not keep(fd, kept, counts, cap):
                    readers.remove(fd)
                continue
            if fd == status_r:
                readers.remove(fd)
                msg = os.read(fd, 1)
                if msg and status is None and not timed_out:  # the call's own word, before its exit
                    status, ended = msg[0] << 8, time.monotonic()
                continue
            words = zyg.recv(in_call=True)
            for msg in words:
                if msg[:1] == b"x":
                    reaped = True
                    if status is None:
                        status, ended = STATUS.unpack(msg[1:])[0], time.monotonic()
                elif msg == b"g":
                    gone = True
            kill_leftovers(words)
    if not timed_out:  # every writer is gone: the rest of the output is in the pipes
        for fd in (out_r, err_r):
            while fd in readers and keep(fd, kept, counts, cap):
                pass
    duration = (ended or time.monotonic()) - t0
    for fd in [out_r, err_r, status_r, *pending]:
        os.close(fd)
    out = b"".join(kept[out_r])
    err = b"".join(kept[err_r])
    return {
        "id": req["id"],
        "status": status,
        "timed_out": timed_out,
        "out": base64.b64encode(out).decode(),
        "err": base64.b64encode(err).decode(),
        "out_n": counts[out_r],
        "err_n": counts[err_r],
        "duration": duration,
    }, gone


def kill_leftovers(words: list[bytes]) -> None:
    """The call is reaped (x) but not all of it is gone (no g with it): whatever it left running
    goes now, its hold on the call's output pipes with it. (A call that leaves nothing, the usual
    one, costs no kill: x and g come together.)"""
    if b"g" not in words and any(word[:1] == b"x" for word in words):
        as_call_uid(kill_calls)


def settle(zyg: Zygote, gone: bool, wdirs: list[str], until: float) -> None:
    """After the answer, before the next request: wait until the zygote has reaped every process of
    the call (what it left running is killed once the call is reaped, or at `until`), then remove
    what they left."""
    while not gone:
        if not select.select([zyg.fileno()], [], [], max(0.0, until - time.monotonic()))[0]:
            # Still running: it wrote its status byte itself and went on. Killed until gone.
            as_call_uid(kill_calls)
            until = time.monotonic() + KILL_AGAIN
            continue
        words = zyg.recv(in_call=True)
        kill_leftovers(words)
        gone = b"g" in words
    remove_ipc()
    sweep(wdirs)


def read_exactly(n: int) -> bytes | None:
    """n bytes from fd 0 (the daemon's pipe); None at its end."""
    parts = []
    while n:
        data = os.read(0, min(n, 1 << 20))
        if not data:
            return None
        parts.append(data)
        n -= len(data)
    return b"".join(parts)


def take_over() -> int:
    """Hold the worker's lock (its descriptor), ending first the supervisor a restarted daemon left
    running here (the agent keeps an orphaned exec running): that supervisor and its zygote are one
    process group, whose id the lock file holds, and they hold the lock while either lives."""
    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileNotFoundError:
        return -1  # an image without /run
    if os.fstat(fd).st_uid != 0:  # not root's: not a supervisor's
        os.close(fd)
        os.unlink(LOCK)
        return take_over()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with contextlib.suppress(ValueError, OSError):
            os.killpg(int(os.pread(fd, 32, 0)), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpgid(0)).encode(), 0)
    return fd


def main() -> None:
    for name in sys.argv[1:]:
        try:
            __import__(name)
        except ImportError as exc:
            os.write(2, f"sandfleet-zygote: preload {name}: {exc}\n".encode())
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    with contextlib.suppress(ChildProcessError):  # the zygote of this process before it started afresh
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # a group with its zygote: a successor ends them together
    take_over()  # its descriptor stays open: the lock lives as long as this process
    ctl, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.fork() == 0:  # before any request: the zygote holds nothing of a call
        ctl.close()
        zygote(theirs)
    theirs.close()
    clear()
    wdirs = claim()
    write_all(b'{"ready": true}\n')
    try:
        serve(Zygote(ctl), wdirs)
    except _ZygoteGone:
        # Killed from inside the worker (say): no zygote may be forked from this process, which
        # has read requests, so it starts afresh as a new program (the daemon's pipes stay).
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:-1]
        os.execv("/proc/self/exe", argv)


def serve(zyg: Zygote, wdirs: list[str]) -> None:
    """Requests until the daemon closes fd 0; _ZygoteGone when the zygote dies."""
    while True:
        r, _, _ = select.select([0, zyg.fileno()], [], [])
        if zyg.fileno() in r:
            zyg.recv()  # the next spare; _ZygoteGone if it died
        if 0 not in r:
            continue
        head = read_exactly(HEADER.size)
        if head is None:
            return
        magic, size = HEADER.unpack(head)
        if magic != MAGIC:
            write_all(json.dumps({"error": "the request stream is out of step"}).encode() + b"\n")
            return  # the daemon starts another interpreter
        body = read_exactly(size)
        if body is None:
            return
        req = None
        try:
            req = json.loads(body)
            write_all(said("taken", req.get("id")))  # see the top: `taken`
            order = prepare(req)
        except Exception as exc:  # nothing of the call ran: settled at once (its files go with the next)
            call_id = req.get("id") if isinstance(req, dict) else None
            error = json.dumps({"id": call_id, "error": f"{type(exc).__name__}: {exc}"})
            write_all(f"{error}\n".encode() + said("settled", call_id))
            continue
        try:
            deadline = time.monotonic() + float(req["timeout"])
            res, gone = call(req, order, zyg, deadline)
        except _ZygoteGone:
            write_all(json.dumps({"error": "the worker's zygote died"}).encode() + b"\n")
            raise
        except Exception as exc:
            # Where the call stands is unknown: this process ends (the zygote with it), and the
            # daemon starts another on the next call.
            write_all(json.dumps({"id": req["id"], "error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            return
        write_all(json.dumps(res).encode() + b"\n")
        try:
            # Answered: what is left of it should be exiting (it said its status and closed its
            # output), so it has SETTLE_GRACE to go, never past its deadline.
            settle(zyg, gone, wdirs, min(deadline, time.monotonic() + SETTLE_GRACE))
        except _ZygoteGone:
            raise
        except Exception as exc:  # answered already: this process ends, the next call starts another
            os.write(2, f"sandfleet-zygote: after call {req['id']}: {type(exc).__name__}: {exc}\n".encode())
            return
        write_all(said("settled", req["id"]))


def said(word: str, call_id: Any) -> bytes:
    """The line `{"taken": id}` or `{"settled": id}` (the daemon's ids are ints: no encoder needed)."""
    if type(call_id) is int:
        return f'{{"{word}": {call_id}}}\n'.encode()
    return json.dumps({word: call_id}).encode() + b"\n"


def write_all(data: bytes, fd: int = 1) -> None:
    while data:
        data = data[os.write(fd, data) :]


if __name__ == "__main__":
    main()
