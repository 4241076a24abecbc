"""openat2(2) through ctypes: opening a path with the kernel confining its resolution (RESOLVE_* flags)."""

from __future__ import annotations

import ctypes
import errno
import os

SYS_openat2 = 437  # same number on x86_64 and on every asm-generic arch (aarch64, ...)

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str | bytes, flags: int, mode: int = 0, resolve: int = 0) -> int:
    """Thin wrapper around ``openat2(2)``; raises :class:`OSError` on failure.

    ``O_CLOEXEC`` is always added. ``EAGAIN`` (a concurrent rename/mount raced with a
    ``RESOLVE_IN_ROOT``/``RESOLVE_BENEATH`` lookup) is retried a few times.
    """
    how = _OpenHow(flags | os.O_CLOEXEC, mode if flags & (os.O_CREAT | os.O_TMPFILE) else 0, resolve)
    raw = os.fsencode(path)
    for _ in range(16):
        fd = int(
            _syscall(
                ctypes.c_long(SYS_openat2),
                ctypes.c_int(dirfd),
                ctypes.c_char_p(raw),
                ctypes.byref(how),
                ctypes.c_size_t(ctypes.sizeof(how)),
            )
        )
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            raise OSError(err, os.strerror(err), os.fsdecode(path))
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), os.fsdecode(path))


__all__ = [
    "openat2",
    "RESOLVE_BENEATH",
    "RESOLVE_IN_ROOT",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_NO_XDEV",
]
