"""The fncall tier's zygote and the process of each call (zygote.py's docstring has the whole
picture: the supervisor, the zygote, the call).

After a fork every page the zygote or the call writes is a page copied (copy-on-write), and that is
most of what a call costs: so the zygote's loop and the call's path touch few objects (no
comprehensions, no contextlib, the environment made once, signals reset through _signal).

Kept free of anything newer than Python 3.9 and of imports beyond the standard library: the daemon
sends this text with zygote.py's (stateless_calls.ZYGOTE_SOURCE).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal.signal without the enum conversions (see run_child)
import marshal
import os
import signal
import socket
import struct
import sys
import traceback
import types
from typing import NoReturn

from sandfleet.backends.fncall.residue import CALL_UID, LIBC, SCRATCH  # in a worker, sent along

CHUNK = 65536
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
STATUS = struct.Struct("i")
FIVE_FDS = struct.Struct("5i")
RESET_SIGNALS = tuple(int(s) for s in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGCHLD))
ENV_CWD = [""]  # the directory the environment of this process was made for (zygote_env)
STATUS_FD = 1023  # the call's own exit status, told just before it exits (out of the way of its fds)
STATUS_LINK = f"/proc/self/fd/{STATUS_FD}"


def run_child(fds: list[int], link: str | None) -> NoReturn:
    """In a fresh fork of the zygote: read the order from its pipe, become the call and run it;
    never returns."""
    req_r, in_r, out_w, err_w, status_w = fds
    try:
        parts = []
        while True:
            data = os.read(req_r, CHUNK)
            if not data:
                break
            parts.append(data)
        if not parts:
            os._exit(0)  # a spare whose supervisor went away (its zygote died)
        language, code, env, cwd = marshal.loads(b"".join(parts))
        if isinstance(code, tuple):  # the compiler's error
            code = SyntaxError(*code[1]) if code[0] == "SyntaxError" else ValueError(code[1])
        os.setsid()
        try:
            os.dup2(status_w, STATUS_FD, inheritable=False)  # what it runs does not inherit it
        except OSError:  # a lower RLIMIT_NOFILE: the zygote's report will do
            link = None
        os.dup2(in_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, STATUS_FD)
        os.closerange(STATUS_FD + 1, 1 << 16)
        for sig in RESET_SIGNALS:
            _signal.signal(sig, _signal.SIG_DFL)
        os.chdir(cwd)
        os.setgroups([])
        os.setresgid(CALL_UID, CALL_UID, CALL_UID)
        os.setresuid(CALL_UID, CALL_UID, CALL_UID)
        if language == "bash":
            shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
            os.execve(shell, [shell, "-c", code], {**base_env(cwd), **env})
        if cwd != ENV_CWD[0]:  # else the zygote's own environment is the call's base (zygote_env)
            os.environ.clear()
            os.environ.update(base_env(cwd))
        if env:
            os.environ.update(env)
        # The interpreter's own stream objects, never used by the supervisor nor the zygote (they
        # read and write their fds directly), so they hold no buffered bytes, and reusing them
        # costs nothing; fds 0-2 are the call's pipes now.
        sys.stdin, sys.stdout, sys.stderr = sys.__stdin__, sys.__stdout__, sys.__stderr__
        sys.argv = ["-c"]
        me = os.getpid()
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
        # Its exit status and the end of its output before the kernel takes its memory down
        # (most of an exit's time): the supervisor answers meanwhile. Not from a process the call
        # forked (it holds the descriptor too), whose end is not the call's. (Plain try blocks
        # here and above: every object a call touches is a page copied, contextlib's many.)
        try:
            if link and os.getpid() == me and os.readlink(STATUS_LINK) == link:
                os.write(STATUS_FD, bytes((status,)))
                os.closerange(0, 3)
        except OSError:
            pass
        os._exit(status)
    except BaseException:
        try:
            os.write(2, traceback.format_exc().encode())
        finally:
            os._exit(126)


def base_env(cwd: str) -> dict[str, str]:
    """A call's environment before its own variables."""
    return {"PATH": PATH, "HOME": cwd, "TMPDIR": cwd, "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}


def zygote_env() -> None:
    """The zygote's environment made a call's base, once: a call then sets only its own variables."""
    os.environ.clear()
    os.environ.update(base_env(SCRATCH))
    ENV_CWD[0] = SCRATCH


def fork_spare(ctl: socket.socket) -> int:
    """Fork the next call ahead, with its pipes, and give the supervisor their other ends (s). The
    call waits for its order on its pipe, still root and holding nothing of a call: the fork is paid
    for while the worker idles. -1 (F said): the fork failed."""
    # Its order, stdin, stdout, stderr, own exit status. (No comprehension: after the fork every
    # object this process touches is a page copied, and a comprehension is a new function object.)
    order, stdin, stdout, stderr, status = os.pipe(), os.pipe(), os.pipe(), os.pipe(), os.pipe()
    theirs = [order[0], stdin[0], stdout[1], stderr[1], status[1]]
    mine = [order[1], stdin[1], stdout[0], stderr[0], status[0]]
    try:  # the status pipe as /proc names it: the call's own, not a file later on its number
        link: str | None = os.readlink(f"/proc/self/fd/{status[1]}")
    except OSError:
        link = None
    fds = FIVE_FDS.pack(*mine)
    try:
        pid = os.fork()
    except OSError:
        pid = -1
    if pid == 0:
        low = 3  # all but its pipes go (the lock: see take_over)
        for fd in sorted(theirs):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 16)
        run_child(theirs, link)
    for fd in theirs:
        os.close(fd)
    if pid > 0:
        ctl.sendmsg([b"s"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    else:
        ctl.send(b"F")
    for fd in mine:
        os.close(fd)
    return pid


def zygote(ctl: socket.socket) -> NoReturn:
    """The zygote's loop: fork the next call (see fork_spare), report its exit status (x), then that
    nothing of it is left (g), and again; after a failed fork, fork again on the supervisor's word.
    When the call left nothing running, x and g go in one message (one wake-up of the supervisor)."""
    try:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)  # the daemon's pipes are the supervisor's alone
        os.dup2(null, 1)
        os.close(null)
        zygote_env()
        while True:
            pid = fork_spare(ctl)
            report = b""
            if pid < 0:
                if not ctl.recv(1):
                    os._exit(0)  # the supervisor is gone
                continue
            while True:
                try:  # once the call is reaped, only a look at what else is left
                    done, status = os.waitpid(-1, os.WNOHANG if report else 0)
                except ChildProcessError:
                    break
                except InterruptedError:
                    continue
                if done == pid:
                    report = b"x" + STATUS.pack(status)
                elif done == 0:  # it left processes running: x now, and the supervisor kills them
                    ctl.send(report)
                    report = b""
            ctl.send(report + b"g")
    except BaseException:
        os._exit(1)
