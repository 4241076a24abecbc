"""Process primitives for the daemon: spawning with exact fd placement, pidfd waits, reaping.

`spawn()` uses posix_spawn (vfork-fast even from a large Python process) because the OCI runtime must
find the agent channel at fd 3 exactly (`--preserve-fds`), which subprocess cannot arrange. Exit is
awaited through a pidfd on the event loop, so no thread is involved and asyncio's own child
watchers never race with us (we only ever wait for pids we spawned). The daemon's SIGCHLD handler
runs `reap_orphans()`, which only collects exited OCI runtime helpers nobody else waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PR_SET_CHILD_SUBREAPER = 36
_libc = ctypes.CDLL(None, use_errno=True)
# Pids that spawn() will wait for itself: the orphan reaper must never steal their exit status.
_spawned: set[int] = set()


@dataclass(frozen=True)
class Completed:
    argv: list[str]
    returncode: int
    stdout: bytes
    stderr: bytes


async def wait_pid(pid: int) -> int:
    """Wait for our child `pid` to exit without blocking the loop; return its exit code (-sig)."""
    loop = asyncio.get_running_loop()
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return _reap(pid)
    try:
        done = loop.create_future()

        def _ready() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(pidfd, _ready)
        try:
            await done
        finally:
            loop.remove_reader(pidfd)
    finally:
        os.close(pidfd)
    return _reap(pid)


def _reap(pid: int) -> int:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return -1
    return os.waitstatus_to_exitcode(status)


async def _read_all(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    chunks: list[bytes] = []
    eof = loop.create_future()

    def _ready() -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        if data:
            chunks.append(data)
        elif not eof.done():
            eof.set_result(None)

    loop.add_reader(fd, _ready)
    try:
        await eof
    finally:
        loop.remove_reader(fd)
    return b"".join(chunks)


def _posix_spawn(
    argv: Sequence[str],
    stdio: tuple[int, int, int],
    fd_map: Mapping[int, int],
    env: Mapping[str, str],
    *,
    setsid: bool = False,
) -> int:
    """posix_spawn with exactly `stdio` at 0-2 and `fd_map` (child fd -> our fd) in place; return the pid."""
    actions: list[tuple[int, int, int]] = [(os.POSIX_SPAWN_DUP2, fd, i) for i, fd in enumerate(stdio)]
    # dup2 onto the target clears FD_CLOEXEC there, so exactly these fds reach the child. A source
    # that is itself a target number (or below 3) would be overwritten by an earlier dup2: copy it
    # above every target first.
    floor = max([2, *fd_map]) + 1
    lifted: list[int] = []
    try:
        for child_fd, our_fd in fd_map.items():
            if our_fd < floor:
                our_fd = fcntl.fcntl(our_fd, fcntl.F_DUPFD_CLOEXEC, floor)
                lifted.append(our_fd)
            actions.append((os.POSIX_SPAWN_DUP2, our_fd, child_fd))
        # vfork+exec: returns as soon as the child has exec'd, never waits for it.
        pid = os.posix_spawnp(argv[0], list(argv), dict(env), file_actions=actions, setsid=setsid)
        _spawned.add(pid)
        return pid
    finally:
        for fd in lifted:
            os.close(fd)


def start_background(argv: Sequence[str], *, fd_map: Mapping[int, int]) -> int:
    """Start a long-lived helper in a session of its own (no controlling terminal) with /dev/null for
    stdio; the caller owns (and must `wait_pid`) it."""
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        return _posix_spawn(argv, (null, null, null), fd_map, os.environ, setsid=True)
    finally:
        os.close(null)


def exited(pid: int) -> bool:
    """Has our child `pid` exited? (Peeks: the exit status stays for `wait_pid`.)"""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def forget(pid: int) -> None:
    """After `wait_pid` of a `start_background` child."""
    _spawned.discard(pid)


async def spawn(
    argv: Sequence[str],
    *,
    fd_map: Mapping[int, int] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = 60.0,
    capture: bool = True,
) -> Completed:
    """Run `argv` to completion, capturing stdout/stderr; `fd_map` maps child fd -> our fd.

    `capture=False` gives the child /dev/null for all stdio: needed when it leaves long-lived
    descendants behind (a detached container), which would otherwise hold our pipes open.
    """
    out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        stdio = (null, out_w, err_w) if capture else (null, null, null)
        pid = _posix_spawn(argv, stdio, dict(fd_map or {}), env if env is not None else os.environ)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        os.close(out_w)
        os.close(err_w)
        os.close(null)
    try:
        async with asyncio.timeout(timeout):
            stdout, stderr, code = await asyncio.gather(_read_all(out_r), _read_all(err_r), wait_pid(pid))
    except BaseException:
        # Timed out or cancelled: never leave the child running (or unreaped) behind us.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        await asyncio.shield(wait_pid(pid))
        raise
    finally:
        _spawned.discard(pid)
        os.close(out_r)
        os.close(err_r)
    return Completed(list(argv), code, stdout, stderr)


def become_subreaper() -> None:
    """Orphans of our runtimes re-parent to us instead of this host's slow-reaping PID 1."""
    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


# OCI runtimes, the launcher (a launch that failed past its fork leaves one child behind), and
# sandbox agents (our children once the launcher's intermediate process exits) that died on their own
# or were killed with their half-created sandbox; and criu's tasks of a restore that failed part way
# (criu runs through its own dynamic loader, hence that name), left to us when criu exits.
ORPHAN_NAMES = frozenset(
    {"crun", "runc", "runsc", "sandfleet-run", "sandfleet-agent", "qemu-system-x86", "bwrap", "ld-linux-x86-64"}
)


def reap_orphans(names: frozenset[str] = ORPHAN_NAMES, limit: int = 1024) -> int:
    """Reap exited runtime processes re-parented to us (`crun run --detach` leaves one per create).

    Peeks with WNOWAIT and only reaps zombies whose command is an OCI runtime and which spawn() is
    not waiting for, so an exit some other waiter (a subprocess in a worker thread) is about to
    collect is never stolen. Costs one syscall when there is nothing to reap (no /proc scan).
    """
    reaped = 0
    for _ in range(limit):
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        if info is None or info.si_pid in _spawned:
            break
        try:
            with open(f"/proc/{info.si_pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            break
        if comm not in names:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, os.WNOHANG)
            reaped += 1
    return reaped


def process_start_time(pid: int) -> int | None:
    """Start time in clock ticks since boot: (pid, start time) identifies a process across pid reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[19])
