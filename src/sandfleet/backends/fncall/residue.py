"""What a call of the fncall tier could leave in its worker, and how it goes (zygote.py runs it).

What a call could leave, and where it goes:
- memory: the call was a fork of the zygote, which never held a call's data, and it exited;
- processes: when the zygote finds the call's own process reaped and others of it still running,
  or at the call's deadline, everything running as CALL_UID is killed with one kill(-1) sent as
  CALL_UID (a process whose uids are not 0 holds no capability and signals only its own uid;
  kill(-1) spares the sender; a fork racing with it fails), so a background process, a double fork
  or a setsid escapes nothing; the zygote reaps them all before the next call. (The supervisor
  takes that uid for the moment of the kill, root staying its saved uid: a call's process
  signalling it then spoils only its own call.);
- files: CALL_UID can create entries only in directories it may write to. At start the supervisor
  walks the worker's own filesystems (the root, /dev, /dev/shm, /dev/mqueue; not volumes, /proc,
  /sys) and takes back what CALL_UID could change there: entries of its uid or group become
  root's, world-writable files lose that bit, world-writable directories get the sticky bit. What
  is left writable is the world-writable sticky directories found (/tmp, /run/lock (also reached as
  /var/lock), /dev/shm, /dev/mqueue (POSIX message queues), nested ones) and the scratch: after each
  call everything CALL_UID owns there is removed;
- System V IPC objects it created (by creator uid: an owner changed with IPC_SET is no escape) or
  owns are removed; keyrings are out of reach (the sandbox's seccomp filter denies keyctl).

Kept free of anything newer than Python 3.9 and of imports beyond the standard library: the daemon
sends this text with zygote.py's (stateless_calls.ZYGOTE_SOURCE).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
from collections.abc import Callable

CALL_UID = 61000  # also its gid; inside the sandbox's user namespace (root there is unprivileged outside)
SCRATCH = "/tmp/.fncall"
OWN_MOUNTS = ("/", "/dev", "/dev/shm", "/dev/mqueue")  # the sandbox's own filesystems (not volumes)
SKIPPED = ("/proc", "/sys", "/dev/.sandfleet", "/dev/pts")
LIBC = ctypes.CDLL(None, use_errno=True)


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
        with contextlib.suppress(OSError):  # the usual case: an empty directory (a symlink is not)
            os.rmdir(name)
            return
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
    small files). Only their creator or owner may remove them (root here lacks CAP_SYS_ADMIN): the
    removal is done as CALL_UID (see as_call_uid)."""
    # /proc/sysvipc columns: the owner's uid and the creator's (cuid) are 7 and 9 for shm and msg,
    # 4 and 6 for sem.
    found = []
    for kind, ctl, uid_col in (("shm", LIBC.shmctl, 7), ("sem", LIBC.semctl, 4), ("msg", LIBC.msgctl, 7)):
        try:  # (os-level reads: a text-mode open costs more than the rest of a call's cleanup)
            fd = os.open("/proc/sysvipc/" + kind, os.O_RDONLY)
        except OSError:
            continue
        try:
            parts = []
            while data := os.read(fd, 1 << 16):
                parts.append(data)
        finally:
            os.close(fd)
        for row in b"".join(parts).splitlines()[1:]:
            cols = row.split()
            if len(cols) > uid_col + 2 and CALL_UID in (int(cols[uid_col]), int(cols[uid_col + 2])):
                found.append((ctl, int(cols[1])))
    if found:
        as_call_uid(lambda: [ctl(ipc_id, 0, None) for ctl, ipc_id in found])  # IPC_RMID


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
    remove_ipc()
