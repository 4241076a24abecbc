"""statx(2) and getdents64(2) for tree walks: what os.stat and os.scandir do not give (mount ids, dir offsets)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import NamedTuple

from sandfleet.runtime.openat2 import _libc

_AT_SYMLINK_NOFOLLOW = 0x100
_AT_NO_AUTOMOUNT = 0x800
_AT_EMPTY_PATH = 0x1000
_STATX_BASIC_STATS = 0x7FF
_STATX_MNT_ID = 0x1000
_STATX_ATTR_MOUNT_ROOT = 0x2000
# struct statx: mask, blksize, attributes, nlink, uid, gid, mode, (pad), ino, size, blocks, attributes_mask
_STATX_HEAD = struct.Struct("=IIQIIIH2xQQQQ")
_STATX_TIME = struct.Struct("=qI")  # stx_mtime at 112
_STATX_DEV = struct.Struct("=II")  # stx_dev_major, stx_dev_minor at 136
_STATX_MNT = struct.Struct("=Q")  # stx_mnt_id at 144
_statx_fn = getattr(_libc, "statx", None)


if _statx_fn is not None:
    _statx_fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    _statx_fn.restype = ctypes.c_int


class _St(NamedTuple):
    mode: int
    ino: int
    dev: int
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int
    mtime: float
    mnt_id: int  # 0: unknown
    mount_root: bool  # the root of a mount (in whichever mount namespace the lookup walked)


def _statx(dirfd: int, name: bytes, *, follow: bool = False) -> _St:
    """``statx(2)`` of ``name`` below ``dirfd`` (``b""``: ``dirfd`` itself); a final symlink is not
    followed unless ``follow``. Mounts on the final component are (the kernel always does), so a
    mount point reports the mounted root, with ``mount_root`` set."""
    if _statx_fn is None:  # no statx in this libc: no mount ids; walks still compare st_dev
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=follow) if name else os.fstat(dirfd)
        return _St(
            st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, st.st_size, st.st_blocks,
            st.st_mtime, 0, False,
        )  # fmt: skip
    flags = _AT_NO_AUTOMOUNT | (0 if follow else _AT_SYMLINK_NOFOLLOW) | (0 if name else _AT_EMPTY_PATH)
    buf = ctypes.create_string_buffer(256)
    while _statx_fn(dirfd, name, flags, _STATX_BASIC_STATS | _STATX_MNT_ID, buf) != 0:
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, os.strerror(err), os.fsdecode(name))
    mask, _blksize, attrs, nlink, uid, gid, mode, ino, size, blocks, amask = _STATX_HEAD.unpack_from(buf)
    sec, nsec = _STATX_TIME.unpack_from(buf, 112)
    major, minor = _STATX_DEV.unpack_from(buf, 136)
    (mnt_id,) = _STATX_MNT.unpack_from(buf, 144)
    return _St(
        mode, ino, os.makedev(major, minor), nlink, uid, gid, size, blocks, sec + nsec / 1e9,
        mnt_id if mask & _STATX_MNT_ID else 0, bool(amask & attrs & _STATX_ATTR_MOUNT_ROOT),
    )  # fmt: skip


# getdents64(2) gives each entry's directory offset (d_off), so a walk can come back to a
# directory and resume after the entry it left from, keeping 8 bytes per level instead of the
# directory's listing. Unknown architectures fall back to os.listdir (whole listing per level).
_GETDENTS64: int | None = {
    "x86_64": 217,
    "amd64": 217,
    "aarch64": 61,
    "arm64": 61,
    "riscv64": 61,
    "loongarch64": 61,
    "ppc64": 202,
    "ppc64le": 202,
    "s390x": 220,
    "i386": 220,
    "i686": 220,
    "armv7l": 217,
}.get(platform.machine())
_DIRENT = struct.Struct("=QqHB")  # d_ino, d_off, d_reclen, d_type; d_name (NUL-terminated) follows
