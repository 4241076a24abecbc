"""The fncall tier's warm worker: runs inside a pooled sandbox under the image's own python3.

The daemon starts it through the agent (`python3 -I -c <this file's text> <preload...>`) as the
sandbox's root and keeps its stdin and stdout: per call it writes a request (HEADER, then that many
bytes of JSON) and reads a line `taken` (none: the call never began), then the result. Three kinds of
process, so that nothing of a call ever lies in the memory a later call is forked from:

- the supervisor (this process, long-lived): reads each request, writes the call's files, has the
  zygote fork the call, feeds the call's stdin and collects its output, kills what it left running,
  removes what it left, and answers. It holds every call's data, so no call is ever forked from it
  once it has read a request (nor can a call read it: it is root, calls are not);
- the zygote, forked from the supervisor before any request (warm: the preloads imported): it reads
  nothing but the supervisor's one-byte orders, each with the call's pipes attached (SCM_RIGHTS),
  forks the call with them, and reports its exit status and then that every process of the call is
  gone (it is their child subreaper: orphans come to it, and it reaps until no child is left). The
  next call starts only then;
- the call: a fresh fork of the zygote, which reads its order from a pipe of its own (the code as
  the supervisor compiled it, marshalled: a first compile in a fresh fork costs hundreds of
  copy-on-write faults), becomes the unprivileged CALL_UID in a scratch directory of its own, and
  runs the code (or execs bash).

What a call could leave, and where it goes:
- memory: the call was a fork of the zygote, which never held a call's data, and it exited;
- processes: everything running as CALL_UID is killed with one kill(-1) sent as CALL_UID (a process
  whose uids are not 0 holds no capability and signals only its own uid; kill(-1) spares the
  sender; a fork racing with it fails), so a background process, a double fork or a setsid escapes
  nothing; the zygote reaps them all before the next call. (The supervisor takes that uid for the
  moment of the kill, root staying its saved uid: a call's process signalling it then spoils only
  its own call.);
- files: CALL_UID can create entries only in directories it may write to. At start the supervisor
  walks the worker's own filesystems (the root, /dev, /dev/shm, /dev/mqueue; not volumes, /proc,
  /sys) and takes back what CALL_UID could change there: entries of its uid or group become
  root's, world-writable files lose that bit, world-writable directories get the sticky bit. What
  is left writable is the world-writable sticky directories found (/tmp, /run/lock (also reached as
  /var/lock), /dev/shm, /dev/mqueue (POSIX message queues), nested ones) and the scratch: after each
  call everything CALL_UID owns there is removed;
- System V IPC objects it created (by creator uid: an owner changed with IPC_SET is no escape) or
  owns are removed; keyrings are out of reach (the sandbox's seccomp filter denies keyctl).
Limits (memory, pids, no network) are the worker sandbox's, which serves one call at a time.

Kept free of anything newer than Python 3.9 (socket.send_fds) and of imports beyond the standard
library.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import fcntl
import json
import marshal
import os
import select
import signal
import socket
import stat
import struct
import sys
import time
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

CALL_UID = 61000  # also its gid; inside the sandbox's user namespace (root there is unprivileged outside)
SCRATCH = "/tmp/.fncall"
CHUNK = 65536
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HEADER = struct.Struct(">4sI")  # a request's MAGIC and length (the daemon's side: daemon/node/stateless_calls.py)
MAGIC = b"\xffSFZ"  # never in a request's JSON (ASCII): a stream out of step is seen at once
OWN_MOUNTS = ("/", "/dev", "/dev/shm", "/dev/mqueue")  # the sandbox's own filesystems (not volumes)
SKIPPED = ("/proc", "/sys", "/dev/.sandfleet", "/dev/pts")
LOCK = "/run/.sandfleet-zygote"  # root's: held by the live supervisor and zygote (see take_over)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LIBC = ctypes.CDLL(None, use_errno=True)
STATUS = struct.Struct("i")


class _ZygoteGone(Exception):
    """The zygote died (killed from inside the worker, say): the supervisor starts afresh."""


def claim() -> list[str]:
    """Walk the worker's own filesystems and take back what CALL_UID could change (see the module
    doc); return the world-writable (sticky) directories, where it can still create entries. What
    an earlier call left in those (a supervisor before this one died) goes."""
    remove_tree(SCRATCH)
    with open("/proc/self/mountinfo") as f:  # field 5: the mount point, octal-escaped
        mounts = {m.split()[4].encode().decode("unicode_escape") for m in f}
    skipped = set(SKIPPED) | (mounts - set(OWN_MOUNTS))  # volumes are shared storage by design
    found = []
    stack = [("/", False)]
    while stack:
        top, public = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for e in entries:
            if e.path in skipped:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == CALL_UID and public:
                remove_tree(e.path)  # what an earlier call made
                continue
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = st.st_mode
            if st.st_uid == CALL_UID or st.st_gid == CALL_UID:
                os.lchown(e.path, 0 if st.st_uid == CALL_UID else -1, 0 if st.st_gid == CALL_UID else -1)
                mode = os.lstat(e.path).st_mode  # chown drops setuid/setgid bits
            if stat.S_ISDIR(mode):
                if mode & 0o002:
                    if not mode & stat.S_ISVTX:
                        os.chmod(e.path, stat.S_IMODE(mode) | stat.S_ISVTX)
                    found.append(e.path)
                stack.append((e.path, bool(mode & 0o002)))
            elif stat.S_ISREG(mode) and mode & 0o002:
                os.chmod(e.path, stat.S_IMODE(mode) & ~0o002)
    return found


def sweep(wdirs: list[str]) -> None:
    """Remove what CALL_UID made: the scratch, and its entries in the world-writable directories
    (sticky: it could make nothing else there), once no process of that uid is left."""
    remove_tree(SCRATCH)
    for top in wdirs:
        try:
            fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            with os.scandir(fd) as it:
                mine = [e.name for e in it if e.stat(follow_symlinks=False).st_uid == CALL_UID]
            for name in mine:
                remove_tree(name, fd)  # in /dev/mqueue: mq_unlink
        except OSError:
            pass
        finally:
            os.close(fd)


def remove_tree(name: str, parent: int | None = None) -> None:
    """Remove `name` (relative to the directory open as `parent`, else a path) and everything below
    it, never following a symlink, however deep (one descriptor at a time and no paths: neither a
    descriptor nor a path length limit binds), directories made unreadable included (opened up
    first: the caller is their owner or root). Nothing else may be writing there."""
    if parent is None:
        try:
            top = os.open(os.path.dirname(name), os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            remove_tree(os.path.basename(name), top)
        finally:
            os.close(top)
        return
    top = parent
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=top, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=top)
            return
    except OSError:
        return
    fd = top
    levels: list[tuple[str, list[str]]] = []  # the directories entered, each with its subdirectories left
    sub: str | None = name
    while True:
        if sub is not None:
            try:
                with contextlib.suppress(OSError):
                    os.chmod(sub, 0o700, dir_fd=fd)
                inner = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError:
                inner = -1
            if inner >= 0:
                dirs = []
                with os.scandir(inner) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            dirs.append(e.name)
                        else:
                            with contextlib.suppress(OSError):
                                os.unlink(e.name, dir_fd=inner)
                if fd != top:
                    os.close(fd)
                fd = inner
                levels.append((sub, dirs))
            elif not levels:
                return
        here, dirs = levels[-1]
        if dirs:
            sub = dirs.pop()
            continue
        sub = None
        levels.pop()
        up = top if not levels else os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = up
        with contextlib.suppress(OSError):
            os.rmdir(here, dir_fd=fd)
        if not levels:
            return


def remove_ipc() -> None:
    """System V shared memory, semaphores and queues CALL_UID created or owns (rarely any: read 3
    small files). Only their creator or owner may remove them: root here lacks CAP_SYS_ADMIN."""
    # /proc/sysvipc columns: the owner's uid and the creator's (cuid) are 7 and 9 for shm and msg,
    # 4 and 6 for sem.
    for kind, ctl, uid_col in (("shm", LIBC.shmctl, 7), ("sem", LIBC.semctl, 4), ("msg", LIBC.msgctl, 7)):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > uid_col + 2 and CALL_UID in (int(cols[uid_col]), int(cols[uid_col + 2])):
                ctl(int(cols[1]), 0, None)  # IPC_RMID


def as_call_uid(fn: Callable[[], object]) -> None:
    """Run `fn` with the real and effective uid CALL_UID (the saved one stays 0, to come back): with
    the uids not 0 no capability is held, so kill(-1) signals exactly the processes of that uid, and
    System V objects are removed as their creator."""
    os.setresgid(CALL_UID, CALL_UID, 0)
    os.setresuid(CALL_UID, CALL_UID, 0)
    try:
        fn()
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)


def kill_calls() -> None:
    """SIGKILL every process of the caller's uid but itself (see as_call_uid)."""
    # Once is enough (a fork racing with it fails: its parent has a fatal signal pending); ESRCH:
    # nothing was left.
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def clear() -> None:
    """Every process and System V object of CALL_UID gone, as an earlier supervisor could have left them."""
    as_call_uid(kill_calls)
    as_call_uid(remove_ipc)


def run_child(fds: list[int]) -> NoReturn:
    """In a fresh fork of the zygote: read the order from its pipe, become the call and run it;
    never returns."""
    req_r, in_r, out_w, err_w = fds
    try:
        parts = []
        while True:
            data = os.read(req_r, CHUNK)
            if not data:
                break
            parts.append(data)
        language, code, env, cwd = marshal.loads(b"".join(parts))
        if isinstance(code, tuple):  # the compiler's error
            code = SyntaxError(*code[1]) if code[0] == "SyntaxError" else ValueError(code[1])
        os.setsid()
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(cwd)
        os.setgroups([])
        os.setresgid(CALL_UID, CALL_UID, CALL_UID)
        os.setresuid(CALL_UID, CALL_UID, CALL_UID)
        env = {"PATH": PATH, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", **env}
        if language == "bash":
            shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            os.execve(shell, [shell, "-c", code], env)
        os.environ.clear()
        os.environ.update(env)
        # The interpreter's own stream objects, never used by the supervisor nor the zygote (they
        # read and write their fds directly), so they hold no buffered bytes, and reusing them
        # costs nothing; fds 0-2 are the call's pipes now.
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
        sys.argv = ["-c"]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        status = 0
        try:
            if isinstance(code, BaseException):  # as python3 -c reports it: no traceback
                traceback.print_exception(type(code), code, None)
                status = 1
            else:
                exec(code, main.__dict__)
        except SystemExit as exc:
            if exc.code is None:
                status = 0
            elif isinstance(exc.code, int):
                status = exc.code & 0xFF
            else:
                print(exc.code, file=sys.stderr)  # noqa: T201 (what python3 -c does)
                status = 1
        except BaseException:
            traceback.print_exc()
            status = 1
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:
                pass
        os._exit(status)
    except BaseException:
        try:
            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(126)


def zygote(ctl: socket.socket) -> NoReturn:
    """The zygote's loop: per order, fork the call with the pipes that came with it, report its exit
    status (x), then that nothing of it is left (g); F: the fork failed."""
    try:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # the daemon's pipes are the supervisor's alone
        os.dup2(null, 1)
        os.close(null)
        while True:
            msg, fds, _, _ = socket.recv_fds(ctl, 1, 4)
            if not msg:
                os._exit(0)  # the supervisor is gone
            try:
                pid = os.fork()
            except OSError:
                pid = -1
            if pid == 0:
                ctl.close()
                run_child(fds)
            for fd in fds:
                os.close(fd)
            if pid < 0:
                ctl.send(b"F")
            while True:
                try:
                    done, status = os.waitpid(-1, 0)
                except ChildProcessError:
                    break
                except InterruptedError:
                    continue
                if done == pid:
                    ctl.send(b"x" + STATUS.pack(status))
            ctl.send(b"g")
    except BaseException:
        os._exit(1)


def prepare_scratch(req: dict[str, Any]) -> None:
    os.mkdir(SCRATCH, 0o700)
    for name, data in (req.get("files") or {}).items():
        path = os.path.join(SCRATCH, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
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
    remove_tree(SCRATCH)
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


def call(req: dict[str, Any], order: bytes, ctl: socket.socket, wdirs: list[str]) -> dict[str, Any]:
    """Run one call through the zygote; returns once nothing of it is left."""
    cap = int(req["cap"])
    req_r, req_w = os.pipe()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.monotonic()
    socket.send_fds(ctl, [b"f"], [req_r, in_r, out_w, err_w])
    for fd in (req_r, in_r, out_w, err_w):
        os.close(fd)
    deadline = t0 + float(req["timeout"])
    kept: dict[int, list[bytes]] = {out_r: [], err_r: []}
    counts = {out_r: 0, err_r: 0}
    pending = {req_w: order, in_w: base64.b64decode(req.get("stdin") or "")}
    for fd in pending:
        os.set_blocking(fd, False)
    status = None
    ended = 0.0
    forked = True
    gone = timed_out = False
    readers = [out_r, err_r, ctl.fileno()]
    while not gone:
        for fd in [fd for fd, data in pending.items() if not data]:
            os.close(fd)
            del pending[fd]
        wait = None
        if status is None and not timed_out:
            wait = deadline - time.monotonic()
            if wait <= 0:
                timed_out = True
                as_call_uid(kill_calls)
                readers, wait = [ctl.fileno()], None  # its output is not waited for any more
        r, w, _ = select.select(readers, list(pending), [], wait)
        for fd in w:
            try:
                pending[fd] = pending[fd][os.write(fd, pending[fd][:CHUNK]) :]
            except BrokenPipeError:
                pending[fd] = b""
        for fd in r:
            if fd != ctl.fileno():
                if not keep(fd, kept, counts, cap):
                    readers.remove(fd)
                continue
            msg = ctl.recv(16)
            if not msg:
                raise _ZygoteGone
            if msg[:1] == b"x":
                status, ended = STATUS.unpack(msg[1:])[0], time.monotonic()
                # The call is over: whatever it left running goes now (and its pipes close with it).
                as_call_uid(kill_calls)
            elif msg == b"F":
                forked = False
            elif msg == b"g":
                gone = True
    if not timed_out:  # every writer is gone: the rest of the output is in the pipes
        for fd in (out_r, err_r):
            while fd in readers and keep(fd, kept, counts, cap):
                pass
    duration = (ended or time.monotonic()) - t0
    for fd in [out_r, err_r, *pending]:
        os.close(fd)
    as_call_uid(remove_ipc)
    sweep(wdirs)
    if not forked:
        return {"id": req["id"], "error": "the zygote could not fork the call (the pids limit?)"}
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
    }


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
        serve(ctl, wdirs)
    except _ZygoteGone:
        # Killed from inside the worker (say): no zygote may be forked from this process, which
        # has read requests, so it starts afresh as a new program (the daemon's pipes stay).
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")[:-1]
        os.execv("/proc/self/exe", argv)


def serve(ctl: socket.socket, wdirs: list[str]) -> None:
    """Requests until the daemon closes fd 0; _ZygoteGone when the zygote dies."""
    while True:
        r, _, _ = select.select([0, ctl.fileno()], [], [])
        if ctl.fileno() in r and not ctl.recv(16):
            raise _ZygoteGone
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
            write_all(json.dumps({"taken": req.get("id")}).encode() + b"\n")  # see the top: `taken`
            order = prepare(req)
        except Exception as exc:
            call_id = req.get("id") if isinstance(req, dict) else None
            write_all(json.dumps({"id": call_id, "error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            continue
        try:
            res = call(req, order, ctl, wdirs)
        except _ZygoteGone:
            write_all(json.dumps({"error": "the worker's zygote died"}).encode() + b"\n")
            raise
        except Exception as exc:
            # Where the call stands is unknown: this process ends (the zygote with it), and the
            # daemon starts another on the next call.
            write_all(json.dumps({"id": req["id"], "error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            return
        write_all(json.dumps(res).encode() + b"\n")


def write_all(data: bytes, fd: int = 1) -> None:
    while data:
        data = data[os.write(fd, data) :]


if __name__ == "__main__":
    main()
