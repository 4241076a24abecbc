"""The fncall tier's warm worker: runs inside a pooled sandbox under the image's own python3.

The daemon starts it through the agent (`python3 -I -S -c <this file's text> <uid> <preload...>`)
as the sandbox's root, keeps its stdin and stdout, and sends one JSON line per call; it answers
one JSON line per call. Each call is a fresh process forked from this warm interpreter, as the
unprivileged CALL_UID, in a scratch directory of its own. After the call nothing of it is left:

- memory: the call was a forked child; this process never runs call code itself;
- processes: everything running as CALL_UID is killed with one kill(-1) sent from CALL_UID (a
  process can signal only its own uid once it holds no capability, and kill(-1) spares the sender),
  so a background process, a double fork or a setsid escapes nothing;
- files: CALL_UID can write only in the scratch directory and the world-writable directories found
  at start (/tmp, /var/tmp, /dev/shm, /dev/mqueue, ...): what it made there is removed;
- System V IPC objects it created are removed.
Limits (memory, pids, no network) are the worker sandbox's, which serves one call at a time.

Kept free of anything newer than Python 3.9 (pidfd_open) and of imports beyond the standard library.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import stat
import sys
import time
import traceback
import types
from collections.abc import Iterator
from typing import Any, NoReturn

CALL_UID = 61000  # also its gid; inside the sandbox's user namespace (root there is unprivileged outside)
SCRATCH = "/tmp/.fncall"
CHUNK = 65536
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def writable_dirs() -> list[str]:
    """Directories CALL_UID could write in: world-writable ones (not under /proc, /sys)."""
    found = []
    for top in ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue", "/run", "/var/lock", "/var/run"):
        try:
            st = os.lstat(top)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002:
            found.append(top)
    return found


def remove_owned(top: str) -> None:
    """Remove what CALL_UID created directly under `top` (a sticky world-writable directory)."""
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        path = os.path.join(top, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != CALL_UID or path == SCRATCH:
            continue
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def remove_ipc() -> None:
    """System V shared memory, semaphores and queues CALL_UID made (rarely any: read 3 small files)."""
    libc: Any = None
    for kind, ctl in (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl")):
        try:
            with open("/proc/sysvipc/" + kind) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            # columns: key id perms ... uid gid cuid cgid ...: uid is 7th for shm, 5th for sem/msg
            uid_col = 7 if kind == "shm" else (4 if kind == "sem" else 7)
            if len(cols) <= uid_col or int(cols[uid_col]) != CALL_UID:
                continue
            if libc is None:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
            getattr(libc, ctl)(int(cols[1]), 0, None)  # IPC_RMID


def kill_calls(ipc: bool = False) -> None:
    """SIGKILL every process of CALL_UID: sent from CALL_UID itself (no capability left while the
    uids are not 0, so only processes of that uid qualify; kill(-1) spares the sender). With `ipc`,
    also remove its System V IPC objects (only their owner may: root here lacks CAP_SYS_ADMIN)."""
    os.setresgid(CALL_UID, CALL_UID, 0)
    os.setresuid(CALL_UID, CALL_UID, 0)
    try:
        # Once is enough (a fork racing with it fails: its parent has a fatal signal pending);
        # ESRCH: nothing was left.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if ipc:
            remove_ipc()
    finally:
        os.setresuid(0, 0, 0)
        os.setresgid(0, 0, 0)


def run_child(req: dict[str, Any], code: Any, fds: tuple[int, int, int]) -> NoReturn:
    """In the forked child: become the call and run it; never returns."""
    in_r, out_w, err_w = fds
    try:
        os.setsid()
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 1 << 16)
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(req["cwd"])
        os.setgroups([])
        os.setresgid(CALL_UID, CALL_UID, CALL_UID)
        os.setresuid(CALL_UID, CALL_UID, CALL_UID)
        env = {"PATH": PATH, "HOME": req["cwd"], "TMPDIR": req["cwd"], "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
        env.update(req.get("env") or {})
        if req["language"] == "bash":
            shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            os.execve(shell, [shell, "-c", req["code"]], env)
        os.environ.clear()
        os.environ.update(env)
        # The interpreter's own stream objects, never used by the zygote (it reads and writes its
        # fds 0 and 1 directly), so they hold no buffered bytes of its, and reusing them costs
        # nothing; fds 0-2 are the call's pipes now.
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
        sys.argv = ["-c"]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        status = 0
        try:
            if isinstance(code, BaseException):
                raise code
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


def prepare_scratch(req: dict[str, Any]) -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)
    os.mkdir(SCRATCH, 0o700)
    for name, data in (req.get("files") or {}).items():
        path = os.path.join(SCRATCH, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
    for dirpath, dirnames, filenames in os.walk(SCRATCH):
        for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
            os.lchown(name, CALL_UID, CALL_UID)
    req["cwd"] = SCRATCH


def call(req: dict[str, Any], wdirs: list[str]) -> dict[str, Any]:
    prepare_scratch(req)
    stdin = base64.b64decode(req.get("stdin") or "")
    cap = int(req["cap"])
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    code: Any = None
    if req["language"] == "python":
        # Compiled here, not in the child: the first compile() in a fresh fork costs ~6 ms of
        # copy-on-write faults (the parser's arenas), one in the warm parent ~0.1 ms.
        try:
            code = compile(req["code"], "<code>", "exec")
        except (SyntaxError, ValueError) as exc:
            code = exc  # raised in the child, so it is reported like any error of the code
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        for fd in (in_w, out_r, err_r):
            os.close(fd)
        run_child(req, code, (in_r, out_w, err_w))
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    pidfd = os.pidfd_open(pid)
    deadline = t0 + float(req["timeout"])
    kept: dict[int, list[bytes]] = {out_r: [], err_r: []}
    counts = {out_r: 0, err_r: 0}
    os.set_blocking(in_w, False)
    pending = stdin
    if not pending:
        os.close(in_w)
        in_w = -1
    status = None
    timed_out = False
    readers = [out_r, err_r, pidfd]
    while readers:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        writers = [in_w] if in_w >= 0 else []
        r, w, _ = select.select(readers, writers, [], left)
        if w:
            try:
                n = os.write(in_w, pending[:CHUNK])
                pending = pending[n:]
            except BrokenPipeError:
                pending = b""
            if not pending:
                os.close(in_w)
                in_w = -1
        for fd in r:
            if fd == pidfd:
                readers.remove(pidfd)
                status = os.waitpid(pid, 0)[1]
                # The call is over: whatever it left running goes now (and its pipes close with it).
                kill_calls()
                continue
            data = os.read(fd, CHUNK)
            if not data:
                readers.remove(fd)
                continue
            room = cap - counts[fd]
            if room > 0:
                kept[fd].append(data[:room])
            counts[fd] += len(data)
    kill_calls(ipc=True)
    if status is None:
        status = os.waitpid(pid, 0)[1]
    duration = time.monotonic() - t0
    for fd in (out_r, err_r, pidfd) + ((in_w,) if in_w >= 0 else ()):
        os.close(fd)
    shutil.rmtree(SCRATCH, ignore_errors=True)
    for top in wdirs:
        remove_owned(top)
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


def main() -> None:
    for name in sys.argv[1:]:
        try:
            __import__(name)
        except ImportError as exc:
            os.write(2, f"sandfleet-zygote: preload {name}: {exc}\n".encode())
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    wdirs = writable_dirs()
    write_all(b'{"ready": true}\n')
    for line in requests():
        req = None
        try:
            req = json.loads(line)
            res = call(req, wdirs)
        except Exception as exc:
            call_id = req.get("id") if isinstance(req, dict) else None
            res = {"id": call_id, "error": f"{type(exc).__name__}: {exc}"}
        write_all(json.dumps(res).encode() + b"\n")


def requests() -> Iterator[bytes]:
    """Lines from fd 0, read directly (sys.stdin stays unused: see run_child)."""
    buf = b""
    while True:
        data = os.read(0, CHUNK)
        if not data:
            return
        buf += data
        *lines, buf = buf.split(b"\n")
        yield from lines


def write_all(data: bytes) -> None:
    while data:
        data = data[os.write(1, data) :]


if __name__ == "__main__":
    main()
