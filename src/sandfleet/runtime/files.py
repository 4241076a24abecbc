"""File operations inside a sandbox's root filesystem, performed by the (real root) daemon.

Paths given to :class:`SandboxFS` are paths *as seen from inside the sandbox*: absolute, or
relative to the ``cwd`` the instance was made with (default ``/``). The daemon runs as real root
on the host, so a symlink planted by sandboxed code must never make it touch a host file. All
resolution therefore goes through ``openat2(2)`` relative to an ``O_PATH`` fd of the sandbox root
with::

    RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

* ``RESOLVE_IN_ROOT``: absolute symlinks and ``..`` are clamped to the sandbox root, exactly
  as the sandbox itself would resolve them (the kernel does this atomically, no TOCTOU).
* ``RESOLVE_NO_MAGICLINKS``: ``/proc/<pid>/root``-style magic links are refused.
* ``RESOLVE_NO_XDEV``: resolution never crosses into another mount (the sandbox's
  ``/proc``, ``/dev``, ``/sys`` and any bind mount); such paths fail with ``crosses_mount``.

An operation resolves the *parent* directory this way and then acts on the final component
with ``*at`` syscalls relative to the parent fd (never following a final symlink), or opens
the full path with ``openat2`` when following a final symlink inside the root is wanted
(read, write of an existing file, listing a directory). Regular files are always opened
``O_PATH`` first, checked with ``fstat`` and only then re-opened for I/O through
``/proc/self/fd/N``, so the daemon never ``open()``s a FIFO or device node planted in the
sandbox.

Mount points. The daemon reaches the sandbox through ``/proc/<agent>/root`` from another mount
namespace, where the kernel's "is this a mount point?" checks of ``rmdir``/``unlink``/``rename``
do not see the sandbox's mounts: removing ``/proc`` would succeed and detach the sandbox's
mounts. Every remove or replace therefore checks its target first with ``statx``
(``STATX_ATTR_MOUNT_ROOT``, and a mount id different from the root's) and against the
``mount_points`` the caller passed (from the sandbox's mountinfo, see :func:`mount_points`), and
refuses with ``permission_denied``.

Tree walks (recursive remove, tar download) are iterative and go down one component at a time
with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``; they keep at most
``_FD_WINDOW`` directory fds open below their top whatever the depth, and per level only the
name, the inode number and a directory offset (about 20 bytes). Climbing back to a directory
whose fd was closed reopens it as ``..`` of the child (``RESOLVE_NO_XDEV``) and checks its
(``st_dev``, ``st_ino``) against the one recorded on the way down; every climb also checks that
the child still sits in the directory it was entered from. A directory renamed or replaced by
the sandbox during a walk stops it with ``changed``: a walk never goes above its top, never
leaves its mount, and never continues somewhere it did not come from.

All functions are synchronous (the daemon calls them from a worker thread) and close every
fd they open, including on errors; a :class:`TarStream` holds its own fds (never the root fd)
until it is exhausted or closed.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import platform
import posixpath
import re
import stat as stat_mod
import struct
import tarfile
from array import array
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import IO, BinaryIO, Literal, NamedTuple, TypeVar, cast

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "MAX_MEMBER_NAME",
    "FileKind",
    "FileOpError",
    "FileOpKind",
    "FileStat",
    "FileTooLargeError",
    "SandboxFS",
    "TarStream",
    "check_upload",
    "mount_points",
    "openat2",
    "RESOLVE_BENEATH",
    "RESOLVE_IN_ROOT",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_NO_XDEV",
]

T = TypeVar("T")

# --------------------------------------------------------------------------- openat2

SYS_openat2 = 437  # same number on x86_64 and on every asm-generic arch (aarch64, ...)

RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_IN_ROOT = 0x10

# Resolution of sandbox paths from the sandbox root.
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
# One component below a directory fd we already trust: no symlinks, no mounts, no escape.
_STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
# ".." of a directory a walk is in (checked against the recorded parent afterwards).
_UP = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV

_MAX_SYMLINK_HOPS = 40
_CHUNK = 1 << 20

#: Bytes of a tar member name at most (PATH_MAX without its NUL); deeper trees are refused.
MAX_MEMBER_NAME = 4095
#: Entries one tree walk may visit (a sandbox that keeps creating files cannot keep a walk going).
DEFAULT_MAX_ENTRIES = 1 << 24
# Directory fds a walk keeps open below its top (then the top, plus one or two transient fds).
_FD_WINDOW = 8
_DENTS_BUF = 32 << 10
# Lines of /etc/passwd and /etc/group longer than this are skipped.
_MAX_DB_LINE = 64 << 10


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


# --------------------------------------------------------------------------- statx, getdents64

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


# --------------------------------------------------------------------------- errors

FileOpKind = Literal[
    "not_found",
    "exists",
    "not_a_directory",
    "is_a_directory",
    "permission_denied",
    "crosses_mount",
    "invalid_path",
    "too_large",
    "no_space",
    "changed",
    "io_error",
]

_ERRNO_KIND: dict[int, tuple[FileOpKind, str]] = {
    errno.ENOENT: ("not_found", "no such file or directory"),
    errno.EEXIST: ("exists", "already exists"),
    errno.ENOTEMPTY: ("exists", "directory not empty"),
    errno.ENOTDIR: ("not_a_directory", "a path component is not a directory"),
    errno.EISDIR: ("is_a_directory", "is a directory"),
    errno.EACCES: ("permission_denied", "permission denied"),
    errno.EPERM: ("permission_denied", "operation not permitted"),
    errno.EROFS: ("permission_denied", "read-only file system"),
    errno.EXDEV: ("crosses_mount", "path crosses a mount point (e.g. /proc, /dev, /sys or a bind mount)"),
    errno.EBUSY: ("crosses_mount", "path is a mount point or busy"),
    errno.ELOOP: ("invalid_path", "too many levels of symlinks, or a refused (magic) symlink"),
    errno.ENOSPC: ("no_space", "no space left on device"),
    errno.EDQUOT: ("no_space", "disk quota exceeded"),
    errno.ENAMETOOLONG: ("invalid_path", "file name too long"),
    errno.EINVAL: ("invalid_path", "invalid argument"),
}


class FileOpError(Exception):
    """A file operation inside a sandbox failed.

    ``kind`` is one of :data:`FileOpKind` ("io_error" is the catch-all for errnos that have
    no better mapping; "changed": a directory was renamed or replaced by the sandbox while a
    walk was in it, and the walk stopped); ``path`` is the sandbox path; ``errno`` the
    underlying errno if any.
    """

    def __init__(self, kind: FileOpKind, path: str, message: str, *, err: int | None = None) -> None:
        super().__init__(f"{path}: {message}")
        self.kind: FileOpKind = kind
        self.path = path
        self.errno = err


class FileTooLargeError(FileOpError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__("too_large", path, message)


def _from_oserror(exc: OSError, path: str) -> FileOpError:
    err = exc.errno if exc.errno is not None else 0
    kind, msg = _ERRNO_KIND.get(err, ("io_error", exc.strerror or str(exc)))
    return FileOpError(kind, path, msg, err=err)


@contextmanager
def _translate(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _from_oserror(exc, path) from exc


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _mount_refused(path: str, inside: str | None = None) -> FileOpError:
    if inside is None:
        return FileOpError(
            "permission_denied", path, "is a mount point of the sandbox; it cannot be removed or replaced"
        )
    return FileOpError(
        "permission_denied", path, f"contains a mount point of the sandbox ({inside}); it cannot be removed"
    )


# --------------------------------------------------------------------------- paths


def _norm(path: str, cwd: str | None = None) -> str:
    """Validate and normalise a user-supplied sandbox path ("/a//b/./c/" -> "/a/b/c").

    Absolute paths may not contain ``..``. A relative path is resolved against ``cwd`` (an
    absolute, normalised path; None: relative paths are refused), its ``..`` taken lexically
    and clamped at ``/``; symlinks are still resolved by the kernel, inside the root.
    """
    if not isinstance(path, str) or not path:
        raise FileOpError("invalid_path", repr(path), "path must be a non-empty string")
    if "\0" in path:
        raise FileOpError("invalid_path", repr(path), "path contains a NUL byte")
    if not path.startswith("/"):
        if cwd is None:
            raise FileOpError("invalid_path", path, "path must be absolute")
        stack = [p for p in cwd.split("/") if p]
        for comp in path.split("/"):
            if comp in ("", "."):
                continue
            if comp == "..":
                if stack:
                    stack.pop()
                continue
            stack.append(comp)
        return "/" + "/".join(stack)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileOpError("invalid_path", path, "'..' components are not allowed")
    return "/" + "/".join(parts)


def _rel(path: str) -> str:
    """Normalised absolute sandbox path -> path for openat2 relative to the root fd."""
    return path.lstrip("/") or "."


def _split(path: str) -> tuple[str, str]:
    parent, name = posixpath.split(path)
    return parent, name


def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name


def _show(path: str) -> str:
    """A path for an error message: very deep ones are shortened in the middle."""
    return path if len(path) <= 600 else f"{path[:280]}/.../{path[-280:]}"


def _member_parts(name: str) -> list[str]:
    """Validate a tar member / link name: relative, no '..', no NUL."""
    if "\0" in name:
        raise FileOpError("invalid_path", name, "tar member name contains a NUL byte")
    if name.startswith("/"):
        raise FileOpError("invalid_path", name, "absolute tar member names are not allowed")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileOpError("invalid_path", name, "'..' in tar member names is not allowed")
    return parts


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_points(mountinfo: str | bytes) -> frozenset[str]:
    """The mount points listed in a ``/proc/<pid>/mountinfo`` text (field 5), as absolute paths.

    Read from ``/proc/<agent>/mountinfo`` they are paths inside the sandbox (the kernel shows
    them relative to that process's root). The kernel's octal escapes (``\\040`` space,
    ``\\011`` tab, ``\\012`` newline, ``\\134`` backslash) are decoded; undecodable bytes are kept
    as surrogate escapes, as ``os.fsdecode`` does.
    """
    text = os.fsdecode(mountinfo) if isinstance(mountinfo, bytes) else mountinfo
    out: set[str] = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        raw = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        if not raw.startswith("/"):
            continue
        out.add(_canon(raw))
    return frozenset(out)


def _canon(path: str) -> str:
    """``/a//b/`` -> ``/a/b`` (no other normalisation: mount points are the kernel's paths)."""
    return "/" + "/".join(p for p in path.split("/") if p not in ("", "."))


# --------------------------------------------------------------------------- stat

FileKind = Literal["file", "dir", "symlink", "other"]
_StrList = list[str]  # SandboxFS.list shadows the builtin inside the class body
_IntList = list[int]
_Extents = list[tuple[int, int]]


@dataclass(frozen=True)
class FileStat:
    path: str
    name: str
    type: FileKind
    size: int
    mode: int  # permission bits only (S_IMODE)
    uid: int  # as seen inside the sandbox
    gid: int
    mtime: float
    link_target: str | None = None


def _kind(st_mode: int) -> FileKind:
    if stat_mod.S_ISREG(st_mode):
        return "file"
    if stat_mod.S_ISDIR(st_mode):
        return "dir"
    if stat_mod.S_ISLNK(st_mode):
        return "symlink"
    return "other"


# --------------------------------------------------------------------------- tree walks


class _Frame:
    """An open directory of a walk and what is left of its last getdents64 buffer."""

    __slots__ = ("fd", "level", "buf", "pos", "skip", "done")

    def __init__(self, fd: int, level: int) -> None:
        self.fd = fd
        self.level = level
        self.buf = b""
        self.pos = 0
        self.skip = 0  # os.listdir fallback: entries already consumed
        self.done = False  # os.listdir fallback: listing handed out


class _Walk:
    """Depth-first walk below a directory fd (``top_fd``, borrowed) with bounded fds and memory.

    ``next_name()`` gives the entries of the current directory one by one (``None`` at its end),
    ``descend(name)`` enters a subdirectory, ``ascend()`` goes back to the parent. The top's fd
    and those of the ``_FD_WINDOW`` deepest levels are kept open; per level the walk keeps only
    the name (in ``rel``), the inode number and the directory offset where its listing resumes.
    A directory whose fd was closed is reopened as ``..`` of its child and identified by
    (st_dev, st_ino); any mismatch stops the walk with ``changed``. Subdirectories are opened
    with ``_STRICT`` (no symlink, no other mount) and checked to be on the top's mount.
    """

    def __init__(self, top_fd: int, top_path: str, *, max_entries: int) -> None:
        st = _statx(top_fd, b"")
        self.top_path = top_path
        self.dev = st.dev
        self.mnt_id = st.mnt_id
        self.max_entries = max_entries
        self.entries = 0
        self.frames = [_Frame(top_fd, 0)]  # the top, then the deepest levels (contiguous)
        self.rel = bytearray()  # the current directory below the top: b"a/b/c"
        self.lens = array("B")  # name length of each level below the top
        self.inos = array("Q", [st.ino])  # inode number of each level, the top first
        self.cookies = array("q", [0])  # d_off of the last entry taken at each level
        self._dbuf = ctypes.create_string_buffer(_DENTS_BUF) if _GETDENTS64 is not None else None
        self._seek(self.frames[0], 0)

    @property
    def depth(self) -> int:
        return len(self.inos) - 1

    @property
    def fd(self) -> int:
        """An fd of the current directory (valid until the next descend/ascend)."""
        return self.frames[-1].fd

    def arc(self, name: bytes) -> bytes:
        """``name`` in the current directory, relative to the top (b"a/b/name")."""
        return bytes(self.rel) + b"/" + name if self.rel else name

    def spath(self, name: bytes | None = None) -> str:
        """Sandbox path of the current directory or of ``name`` in it (shortened if very long)."""
        rel = bytes(self.rel) if name is None else self.arc(name)
        return _show(_join(self.top_path, os.fsdecode(rel)) if rel else self.top_path)

    def stat(self, name: bytes) -> _St | None:
        """statx of ``name`` in the current directory (not followed); None if it is gone meanwhile."""
        try:
            return _statx(self.fd, name)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _from_oserror(exc, self.spath(name)) from exc

    def is_mount(self, st: _St) -> bool:
        """Whether an entry of a directory of this walk is a mount point (in the sandbox's namespace)."""
        if st.mount_root or (self.mnt_id and st.mnt_id and st.mnt_id != self.mnt_id):
            return True
        return stat_mod.S_ISDIR(st.mode) and st.dev != self.dev

    def next_name(self) -> bytes | None:
        fr = self.frames[-1]
        while True:
            if fr.pos >= len(fr.buf):
                fr.buf, fr.pos = self._read(fr), 0
                if not fr.buf:
                    return None
            _ino, off, reclen, _type = _DIRENT.unpack_from(fr.buf, fr.pos)
            start = fr.pos + _DIRENT.size
            name = fr.buf[start : fr.buf.index(b"\0", start, fr.pos + reclen)]
            fr.pos += reclen
            self.cookies[-1] = off
            if name == b"." or name == b"..":
                continue
            self.entries += 1
            if self.entries > self.max_entries:
                raise FileTooLargeError(
                    _show(self.top_path), f"more than {self.max_entries} entries walked (a huge or changing tree)"
                )
            return name

    def descend(self, name: bytes) -> None:
        """Enter directory ``name`` of the current directory; OSError (EXDEV, ELOOP, ENOTDIR, ENOENT...)
        if it is not a plain directory on this walk's mount."""
        fd = openat2(self.fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
        try:
            st = _statx(fd, b"")
            if self.is_mount(st):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(name))
        except BaseException:
            _close(fd)
            raise
        if self.rel:
            self.rel += b"/"
        self.rel += name
        self.lens.append(len(name))
        self.inos.append(st.ino)
        self.cookies.append(0)
        self.frames.append(_Frame(fd, self.depth))
        if len(self.frames) > _FD_WINDOW + 1:
            _close(self.frames.pop(1).fd)  # its listing resumes from its cookie when we come back

    def ascend(self) -> tuple[bytes, int]:
        """Go back to the parent of the current directory; returns (its name, its inode number)."""
        level = self.depth - 1
        pino = self.inos[level]
        child = self.frames.pop()
        try:
            if self.frames[-1].level == level:  # parent still open: the child must still sit in it
                st = _statx(child.fd, b"..")
                if st.ino != pino or st.dev != self.dev:
                    raise self._changed()
            else:  # reopen the parent as the child's "..", and check it is the one we came from
                pfd = openat2(child.fd, "..", os.O_RDONLY | os.O_DIRECTORY, 0, _UP)
                try:
                    st = _statx(pfd, b"")
                    if st.ino != pino or st.dev != self.dev or self.is_mount(st):
                        raise self._changed()
                    fr = _Frame(pfd, level)
                    self._seek(fr, self.cookies[level])
                except BaseException:
                    _close(pfd)
                    raise
                self.frames.append(fr)
        except OSError as exc:
            raise self._changed() from exc
        finally:
            _close(child.fd)
        n = self.lens.pop()
        name = bytes(self.rel[len(self.rel) - n :])
        del self.rel[max(0, len(self.rel) - n - 1) :]
        ino = self.inos.pop()
        self.cookies.pop()
        return name, ino

    def close(self) -> None:
        for fr in self.frames[1:]:
            _close(fr.fd)
        del self.frames[1:]

    def _changed(self) -> FileOpError:
        return FileOpError(
            "changed", self.spath(), "was moved or replaced by the sandbox during the operation; stopped there"
        )

    def _seek(self, fr: _Frame, cookie: int) -> None:
        fr.buf, fr.pos = b"", 0
        if self._dbuf is None:
            fr.skip, fr.done = cookie, False
        else:
            os.lseek(fr.fd, cookie, os.SEEK_SET)

    def _read(self, fr: _Frame) -> bytes:
        buf, nr = self._dbuf, _GETDENTS64
        if buf is None or nr is None:  # no getdents64 here: hand out the whole listing once, in the same format
            if fr.done:
                return b""
            fr.done = True
            out = bytearray()
            names = os.listdir(fr.fd)
            for i in range(fr.skip, len(names)):
                raw = os.fsencode(names[i])
                out += _DIRENT.pack(0, i + 1, _DIRENT.size + len(raw) + 1, 0) + raw + b"\0"
            return bytes(out)
        while True:
            n = _syscall(ctypes.c_long(nr), ctypes.c_int(fr.fd), buf, ctypes.c_size_t(_DENTS_BUF))
            if n >= 0:
                return ctypes.string_at(buf, n)
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise _from_oserror(OSError(err, os.strerror(err)), self.spath())


def _rmtree_fd(top_fd: int, top_path: str, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
    """Empty the directory ``top_fd`` (borrowed; its file offset is used) without following
    symlinks and without removing or entering any mount point (``permission_denied`` /
    ``crosses_mount``; what was removed before stays removed).

    Iterative with a bounded number of fds (see :class:`_Walk`). Entries that appear while a
    directory is being emptied are picked up by going through it again; a sandbox that keeps
    creating them meets ``max_entries``.
    """
    w = _Walk(top_fd, top_path, max_entries=max_entries)
    redo = -1  # w.entries when a directory was last gone through again
    try:
        while True:
            name = w.next_name()
            if name is None:
                if w.depth == 0:
                    return
                cname, ino = w.ascend()
                try:
                    st: _St | None = _statx(w.fd, cname)
                except FileNotFoundError:
                    st = None
                if st is None or st.ino != ino or not stat_mod.S_ISDIR(st.mode):
                    raise FileOpError(
                        "changed", w.spath(cname), "was moved or replaced by the sandbox while being removed"
                    )
                try:
                    os.rmdir(cname, dir_fd=w.fd)
                except OSError as exc:
                    if exc.errno != errno.ENOTEMPTY or redo == w.entries:
                        raise _from_oserror(exc, w.spath(cname)) from exc
                    redo = w.entries  # entries appeared meanwhile: go through it again
                    try:
                        w.descend(cname)
                    except OSError as exc2:
                        raise _from_oserror(exc2, w.spath(cname)) from exc2
                continue
            if (st := w.stat(name)) is None:
                continue
            if w.is_mount(st):
                raise _mount_refused(w.spath(name))
            if stat_mod.S_ISDIR(st.mode):
                try:
                    w.descend(name)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # gone or swapped for a file/symlink: the parent's rmdir sends us back
                    raise _from_oserror(exc, w.spath(name)) from exc
            else:
                try:
                    os.unlink(name, dir_fd=w.fd)
                except (FileNotFoundError, IsADirectoryError):
                    pass  # gone, or swapped for a directory: the parent's rmdir sends us through again
                except OSError as exc:
                    raise _from_oserror(exc, w.spath(name)) from exc
    finally:
        w.close()


def _extents(fd: int, size: int, limit: int) -> tuple[array[int] | None, int]:
    """Data extents of a file with holes (SEEK_DATA/SEEK_HOLE) as ``[offset, length, ...]`` and
    their total, or ``(None, size)`` when it is all data or the filesystem cannot tell. Stops
    early once the total passes ``limit`` (the caller refuses the file then)."""
    ext: array[int] = array("q")
    pos = total = 0
    while pos < size and total <= limit:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                break
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                return None, size
            raise
        if start >= size:
            break
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        if end <= start:
            break
        ext.append(start)
        ext.append(end - start)
        total += end - start
        pos = end
    if len(ext) == 2 and ext[0] == 0 and ext[1] == size:
        return None, size
    return ext, total


def _pread_range(fd: int, offset: int, length: int, chunk: int) -> Iterator[bytes]:
    """``length`` bytes from ``offset``; a file that shrank meanwhile is padded with zeros."""
    end = offset + length
    while offset < end:
        n = min(chunk, end - offset)
        data = os.pread(fd, n, offset)
        if not data:
            data = bytes(n)
        offset += len(data)
        yield data


class TarStream(Iterator[bytes]):
    """The chunks of a tar archive, produced while walking (see :meth:`SandboxFS.iter_tar`).

    It owns the fds it reads through (never the sandbox root fd, which may be closed once
    ``iter_tar`` returned) and closes them when exhausted, on error, or on :meth:`close`.
    ``next()`` may be called from any thread, one call at a time. ``content_bytes`` is what the
    sizing pass charged (file content, sparse files by their data extents).
    """

    def __init__(self, gen: Generator[bytes, None, None], fds: list[int], content_bytes: int) -> None:
        self._gen: Generator[bytes, None, None] | None = gen
        self._fds = fds
        self.content_bytes = content_bytes

    def __iter__(self) -> TarStream:
        return self

    def __next__(self) -> bytes:
        if self._gen is None:
            raise StopIteration
        try:
            return next(self._gen)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.close()
        fds, self._fds = self._fds, []
        for fd in fds:
            _close(fd)

    def __enter__(self) -> TarStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class _ParentCache:
    """The last directory upload_tar extracted into (an O_PATH fd), reused by the next member."""

    __slots__ = ("path", "fd")

    def __init__(self) -> None:
        self.path: str | None = None
        self.fd = -1

    def get(self, path: str) -> int | None:
        return self.fd if path == self.path else None

    def put(self, path: str, fd: int) -> None:
        self.clear()
        self.path, self.fd = path, fd

    def clear(self) -> None:
        if self.fd >= 0:
            _close(self.fd)
        self.path, self.fd = None, -1


# --------------------------------------------------------------------------- SandboxFS


class SandboxFS:
    """File operations confined to one sandbox root.

    ``root_fd`` is an ``O_PATH | O_DIRECTORY`` fd of the sandbox root (e.g. from
    ``open("/proc/<pid>/root")``); it is borrowed, not closed. Files and directories created
    here are owned by ``uid_base + uid`` / ``uid_base + gid`` on the host; reported ids are
    translated back (host ids outside ``[uid_base, uid_base + id_count)`` show as 65534).

    ``cwd``: relative paths resolve against it (absolute, inside the sandbox; ``..`` of a
    relative path is applied lexically and clamped at ``/``). ``mount_points``: the sandbox's
    mount points (absolute paths inside it, e.g. :func:`mount_points` of
    ``/proc/<agent>/mountinfo``); removing or replacing one of them, or recursively removing a
    directory holding one, is refused before anything is touched (``permission_denied``); mount
    points are also detected with ``statx`` whether or not they were passed. ``max_entries``
    bounds the entries one tree walk (recursive remove, tar download) visits. ``max_archive``
    is the default ``max_bytes`` of tar downloads.
    """

    OVERFLOW_ID = 65534

    def __init__(
        self,
        root_fd: int,
        *,
        uid_base: int,
        max_read: int = 64 << 20,
        id_count: int = 65536,
        max_archive: int = 1 << 30,
        cwd: str = "/",
        mount_points: Iterable[str] = (),
        max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self.root_fd = root_fd
        self.uid_base = uid_base
        self.max_read = max_read
        self.id_count = id_count
        # Default cap of what a tar download may contain (file content; sparse files count what
        # they store, see iter_tar).
        self.max_archive = max_archive
        if not isinstance(cwd, str) or not cwd.startswith("/"):
            raise FileOpError("invalid_path", repr(cwd), "cwd must be an absolute path")
        self.cwd = _norm(cwd)
        self.mount_points = frozenset(_canon(m) for m in mount_points)
        self.max_entries = max_entries
        self._root_mnt: int | None = None

    # ---------------------------------------------------------------- id helpers

    def _host_id(self, inner: int) -> int:
        if not 0 <= inner < self.id_count:
            raise FileOpError("invalid_path", "-", f"uid/gid {inner} outside the sandbox id range")
        return self.uid_base + inner

    def _inner_id(self, host: int) -> int:
        inner = host - self.uid_base
        return inner if 0 <= inner < self.id_count else self.OVERFLOW_ID

    def _filestat(self, path: str, st: os.stat_result, link_target: str | None = None) -> FileStat:
        return FileStat(
            path=path,
            name=posixpath.basename(path) or "/",
            type=_kind(st.st_mode),
            size=st.st_size,
            mode=stat_mod.S_IMODE(st.st_mode),
            uid=self._inner_id(st.st_uid),
            gid=self._inner_id(st.st_gid),
            mtime=st.st_mtime,
            link_target=link_target,
        )

    # ---------------------------------------------------------------- fd helpers

    def _norm(self, path: str) -> str:
        return _norm(path, self.cwd)

    def _open(self, path: str, flags: int, mode: int = 0) -> int:
        """openat2 a normalised sandbox path from the root (follows symlinks inside root)."""
        return openat2(self.root_fd, _rel(path), flags, mode, _IN_ROOT)

    def _open_parent(self, path: str) -> tuple[int, str]:
        """Resolve the parent directory of ``path``; returns (O_PATH dir fd, final name)."""
        parent, name = _split(path)
        fd = self._open(parent, os.O_PATH | os.O_DIRECTORY)
        return fd, name

    @staticmethod
    def _reopen(fd: int, flags: int) -> int:
        """Re-open an O_PATH fd for I/O via its /proc/self/fd magic link (same inode, no race)."""
        return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC | os.O_NOCTTY)

    def _open_regular(self, path: str, flags: int) -> int:
        """Open an existing regular file (following symlinks inside root) for I/O."""
        pfd = self._open(path, os.O_PATH)
        try:
            st = os.fstat(pfd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise FileOpError("is_a_directory", path, "is a directory")
            if not stat_mod.S_ISREG(st.st_mode):
                raise FileOpError("invalid_path", path, "not a regular file")
            return self._reopen(pfd, flags)
        finally:
            _close(pfd)

    # ---------------------------------------------------------------- mount points

    def _is_mount(self, st: _St) -> bool:
        """Whether ``st`` (statx of an entry of a directory resolved from the root) is a mount point."""
        if st.mount_root:
            return True
        if self._root_mnt is None:
            self._root_mnt = _statx(self.root_fd, b"").mnt_id
        return bool(st.mnt_id and self._root_mnt and st.mnt_id != self._root_mnt)

    def _refuse_mount_path(self, path: str, *, recursive: bool = False) -> None:
        """Refuse ``path`` if it is one of the given mount points or (``recursive``) holds one."""
        if path == "/" or path in self.mount_points:
            raise _mount_refused(path)
        if recursive:
            prefix = path + "/"
            inside = sorted(m for m in self.mount_points if m.startswith(prefix))
            if inside:
                raise _mount_refused(path, inside[0])

    def _unlink_nondir(self, dirfd: int, name: str, spath: str) -> bool:
        """Remove an existing non-directory ``name`` (file or symlink) so it is replaced, not
        followed; never a mount point. Returns whether something was removed."""
        try:
            st = _statx(dirfd, os.fsencode(name))
        except FileNotFoundError:
            return False
        if spath in self.mount_points or self._is_mount(st):
            raise _mount_refused(spath)
        if stat_mod.S_ISDIR(st.mode):
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), name)
        os.unlink(name, dir_fd=dirfd)
        return True

    # ---------------------------------------------------------------- read / write

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        p = self._norm(path)
        if offset < 0 or (length is not None and length < 0):
            raise FileOpError("invalid_path", p, "offset and length must be non-negative")
        if length is not None and length > self.max_read:
            raise FileTooLargeError(p, f"requested length {length} exceeds the limit of {self.max_read}")
        with _translate(p):
            fd = self._open_regular(p, os.O_RDONLY)
            try:
                if length is None:
                    size = os.fstat(fd).st_size
                    if size > self.max_read:
                        raise FileTooLargeError(
                            p, f"file is {size} bytes, larger than the limit of {self.max_read}; pass length"
                        )
                    want = self.max_read + 1  # detect growth past the limit while reading
                else:
                    want = length
                chunks: list[bytes] = []
                got = 0
                pos = offset
                while got < want:
                    data = os.pread(fd, min(_CHUNK, want - got), pos)
                    if not data:
                        break
                    chunks.append(data)
                    got += len(data)
                    pos += len(data)
                if length is None and got > self.max_read:
                    raise FileTooLargeError(p, f"file grew beyond the limit of {self.max_read} bytes")
                return b"".join(chunks)
            finally:
                _close(fd)

    def write(
        self,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        uid: int = 0,
        gid: int = 0,
        append: bool = False,
        make_parents: bool = True,
    ) -> None:
        """Write ``data`` to ``path``, creating it (owned by uid/gid, with ``mode``) if needed.

        An existing file is truncated (or appended to) in place, keeping its inode, owner and
        mode. A final symlink is followed inside the root; a dangling one creates its target
        (inside the root). Writing to anything but a regular file is refused, and so is a mount
        point (a file bind-mounted into the sandbox).
        """
        p = self._norm(path)
        if p == "/":
            raise FileOpError("is_a_directory", p, "is a directory")
        self._refuse_mount_path(p)
        huid, hgid = self._host_id(uid), self._host_id(gid)
        if make_parents:
            self.mkdir(_split(p)[0], parents=True, uid=uid, gid=gid, exist_ok=True)
        cur = p
        with _translate(p):
            for _ in range(_MAX_SYMLINK_HOPS):
                try:
                    fd = self._open(cur, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOCTTY, 0o600)
                except FileExistsError:
                    pass
                else:
                    try:
                        os.fchown(fd, huid, hgid)
                        os.fchmod(fd, mode & 0o7777)
                        if append:
                            os.lseek(fd, 0, os.SEEK_END)
                        _write_all(fd, data)
                    finally:
                        _close(fd)
                    return
                # Exists: a file, a directory, or a symlink (possibly dangling).
                try:
                    fd = self._open_regular(cur, os.O_WRONLY | (os.O_APPEND if append else os.O_TRUNC))
                except FileNotFoundError:
                    cur = self._follow_dangling(cur)
                    continue
                try:
                    _write_all(fd, data)
                finally:
                    _close(fd)
                return
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), p)

    def _follow_dangling(self, path: str) -> str:
        """``path`` exists as a symlink whose target is missing: return the target sandbox path."""
        pfd, name = self._open_parent(path)
        try:
            target = os.readlink(name, dir_fd=pfd)
        finally:
            _close(pfd)
        if "\0" in target:
            raise OSError(errno.EINVAL, "bad symlink", path)
        if not target.startswith("/"):
            target = _join(_split(path)[0], target)
        # Lexical clamp at "/"; actual resolution is again done by openat2(RESOLVE_IN_ROOT).
        return posixpath.normpath("/" + target.lstrip("/"))

    # ---------------------------------------------------------------- users

    def lookup_user(self, name: str, *, max_bytes: int = 4 * 1024**2) -> tuple[int, int, str] | None:
        """(uid, gid, home) of user ``name`` from the sandbox's ``/etc/passwd``, or None if it has
        no such entry (or no /etc/passwd). The first well-formed line wins.

        The file is streamed through the same safe open as :meth:`read` (a regular file, never a
        FIFO or device), 64 KiB at a time, with O(1) memory: lines longer than 64 KiB are
        skipped, and if ``name`` is not found in the first ``max_bytes`` bytes of a longer file
        the lookup fails with ``too_large``. An empty home is reported as ``/``.
        """

        def accept(fields: list[bytes]) -> tuple[int, int, str] | None:
            if len(fields) < 6:
                return None
            uid, gid = _db_id(fields[2]), _db_id(fields[3])
            if uid is None or gid is None:
                return None
            return uid, gid, fields[5].decode("utf-8", "replace") or "/"

        return self._scan_db("/etc/passwd", name, max_bytes, accept)

    def lookup_group(self, name: str, *, max_bytes: int = 4 * 1024**2) -> int | None:
        """The gid of group ``name`` from the sandbox's ``/etc/group`` (as :meth:`lookup_user`)."""

        def accept(fields: list[bytes]) -> int | None:
            return _db_id(fields[2]) if len(fields) >= 3 else None

        return self._scan_db("/etc/group", name, max_bytes, accept)

    def _scan_db(self, path: str, name: str, max_bytes: int, accept: Callable[[list[bytes]], T | None]) -> T | None:
        key = name.encode("utf-8", "surrogateescape") if isinstance(name, str) else b""
        if not key or b":" in key or b"\n" in key or b"\0" in key:
            return None
        prefix = key + b":"
        with _translate(path):
            try:
                fd = self._open_regular(path, os.O_RDONLY)
            except FileNotFoundError:
                return None
            try:
                pending = b""  # the start of a line that continues in the next chunk
                skipping = False  # inside a line longer than _MAX_DB_LINE
                total = 0
                while True:
                    if total >= max_bytes:
                        if os.read(fd, 1):
                            raise FileTooLargeError(
                                path,
                                f"{name!r} not found in the first {max_bytes} bytes; the file is larger than "
                                "the lookup reads",
                            )
                        chunk = b""
                    else:
                        chunk = os.read(fd, min(_MAX_DB_LINE, max_bytes - total))
                    if not chunk:  # end of file: a last line without a newline
                        if not skipping and pending.startswith(prefix) and len(pending) <= _MAX_DB_LINE:
                            return accept(pending.split(b":"))
                        return None
                    total += len(chunk)
                    if skipping:
                        nl = chunk.find(b"\n")
                        if nl < 0:
                            continue
                        chunk, skipping = chunk[nl + 1 :], False
                    buf = pending + chunk if pending else chunk
                    last = buf.rfind(b"\n")
                    if last >= 0:
                        found = _db_match(buf, last + 1, prefix, accept)
                        if found is not None:
                            return found
                        buf = buf[last + 1 :]
                    pending = buf
                    if len(pending) > _MAX_DB_LINE:
                        pending, skipping = b"", True
            finally:
                _close(fd)

    # ---------------------------------------------------------------- metadata

    def stat(self, path: str, *, follow_symlinks: bool = False) -> FileStat:
        p = self._norm(path)
        with _translate(p):
            if p == "/" or follow_symlinks:
                fd = self._open(p, os.O_PATH)
                try:
                    return self._filestat(p, os.fstat(fd))
                finally:
                    _close(fd)
            pfd, name = self._open_parent(p)
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=pfd) if stat_mod.S_ISLNK(st.st_mode) else None
                return self._filestat(p, st, target)
            finally:
                _close(pfd)

    def list(self, path: str) -> list[FileStat]:
        """Entries of a directory (a final symlink is followed inside the root), sorted by name."""
        p = self._norm(path)
        with _translate(p):
            fd = self._open(p, os.O_RDONLY | os.O_DIRECTORY)
            try:
                out: list[FileStat] = []
                for name in sorted(os.listdir(fd)):
                    child = _join(p, name)
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        target = os.readlink(name, dir_fd=fd) if stat_mod.S_ISLNK(st.st_mode) else None
                    except FileNotFoundError:
                        continue  # removed concurrently
                    out.append(self._filestat(child, st, target))
                return out
            finally:
                _close(fd)

    # ---------------------------------------------------------------- mkdir / remove

    def mkdir(
        self,
        path: str,
        *,
        parents: bool = True,
        mode: int = 0o755,
        uid: int = 0,
        gid: int = 0,
        exist_ok: bool = True,
    ) -> None:
        p = self._norm(path)
        huid, hgid = self._host_id(uid), self._host_id(gid)
        if p == "/":
            if exist_ok:
                return
            raise FileOpError("exists", p, "already exists")
        self._refuse_mount_path(p)
        _close(self._makedirs(p, parents=parents, mode=mode, huid=huid, hgid=hgid, exist_ok=exist_ok))

    def _makedirs(self, p: str, *, parents: bool, mode: int, huid: int, hgid: int, exist_ok: bool) -> int:
        """mkdir (-p) of normalised ``p``; returns an O_PATH fd of the directory.

        The deepest existing prefix is found by bisection (existence is monotone in the prefix
        length), the missing components are created each in the directory fd of the previous one:
        O(depth log depth) lookups and two fds whatever the depth. Every directory created gets
        ``mode`` and the owner; like ``mkdir -p``, the target of a dangling symlink is not created.
        """
        parts = [c for c in p.split("/") if c]
        with _translate(p):

            def probe(k: int) -> int:
                """An O_PATH fd of the first k components as a directory, or -1 if missing."""
                try:
                    return self._open("/" + "/".join(parts[:k]), os.O_PATH | os.O_DIRECTORY)
                except FileNotFoundError:
                    return -1

            fd = probe(len(parts))
            if fd >= 0:
                if not exist_ok:
                    _close(fd)
                    raise FileOpError("exists", p, "already exists")
                return fd
            # bisect for the number of leading components that exist: probe(lo) ok, probe(hi) missing
            lo, hi = 0, len(parts)
            if len(parts) > 1:
                fd = probe(len(parts) - 1)  # the common case: only the last one is missing
                if fd >= 0:
                    lo = len(parts) - 1
                else:
                    hi = len(parts) - 1
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        mfd = probe(mid)
                        if mfd >= 0:
                            _close(mfd)
                            lo = mid
                        else:
                            hi = mid
            if fd < 0:
                fd = probe(lo) if lo else self._open("/", os.O_PATH | os.O_DIRECTORY)
                if fd < 0:
                    raise FileOpError("changed", p, "a parent directory vanished while being created")
            try:
                if lo < len(parts) - 1 and not parents:
                    prefix = "/" + "/".join(parts[: lo + 1])
                    raise FileOpError("not_found", p, f"parent directory {prefix} does not exist")
                for i in range(lo, len(parts)):
                    comp = parts[i]
                    try:
                        os.mkdir(comp, 0o700, dir_fd=fd)
                    except FileExistsError:
                        # Made meanwhile, or a dangling symlink / non-directory: resolve it in root.
                        prefix = "/" + "/".join(parts[: i + 1])
                        try:
                            nfd = self._open(prefix, os.O_PATH | os.O_DIRECTORY)
                        except FileNotFoundError:
                            raise FileOpError(
                                "exists", p, f"{prefix} exists and is not a directory (dangling symlink?)"
                            ) from None
                        if i == len(parts) - 1 and not exist_ok:
                            _close(nfd)
                            raise FileOpError("exists", p, "already exists") from None
                    else:
                        nfd = openat2(fd, comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                        try:
                            os.fchown(nfd, huid, hgid)
                            os.fchmod(nfd, mode & 0o7777)
                        except BaseException:
                            _close(nfd)
                            raise
                    _close(fd)
                    fd = nfd
                return fd
            except BaseException:
                _close(fd)
                raise

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink (never its target) or directory (``recursive`` for non-empty).

        The root, a mount point, or (``recursive``) a directory holding one of the given
        ``mount_points`` is refused before anything is removed (``permission_denied``).
        Recursive removal walks with a bounded number of fds whatever the depth, never follows
        symlinks, and stops at a mount point it finds below (``permission_denied``) or a
        directory the sandbox moves meanwhile (``changed``); whatever was already removed stays
        removed.
        """
        p = self._norm(path)
        if p == "/":
            raise FileOpError("invalid_path", p, "refusing to remove the sandbox root")
        self._refuse_mount_path(p, recursive=recursive)
        with _translate(p):
            pfd, name = self._open_parent(p)
            try:
                st = _statx(pfd, os.fsencode(name))
                if self._is_mount(st):
                    raise _mount_refused(p)
                if not stat_mod.S_ISDIR(st.mode):
                    os.unlink(name, dir_fd=pfd)
                    return
                if not recursive:
                    os.rmdir(name, dir_fd=pfd)
                    return
                dfd = openat2(pfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                try:
                    ino = os.fstat(dfd).st_ino
                    for attempt in range(4):
                        _rmtree_fd(dfd, p, max_entries=self.max_entries)
                        try:
                            cur: _St | None = _statx(pfd, os.fsencode(name))
                        except FileNotFoundError:
                            cur = None
                        if cur is None or cur.ino != ino:
                            raise FileOpError("changed", p, "was moved or replaced by the sandbox while being removed")
                        try:
                            os.rmdir(name, dir_fd=pfd)
                            return
                        except OSError as exc:
                            if exc.errno != errno.ENOTEMPTY or attempt == 3:
                                raise
                finally:
                    _close(dfd)
            finally:
                _close(pfd)

    # ---------------------------------------------------------------- tar download

    def download_tar(self, path: str, *, max_bytes: int | None = None) -> bytes:
        """A tar archive of ``path`` (see :meth:`iter_tar`) as bytes."""
        buf = io.BytesIO()
        self.write_tar(path, buf, max_bytes=max_bytes)
        return buf.getvalue()

    def write_tar(self, path: str, fileobj: IO[bytes], *, max_bytes: int | None = None) -> None:
        """Write a tar archive of ``path`` (see :meth:`iter_tar`) into ``fileobj``."""
        with self.iter_tar(path, max_bytes=max_bytes) as stream:
            for chunk in stream:
                fileobj.write(chunk)

    def iter_tar(self, path: str, chunk_size: int = _CHUNK, *, max_bytes: int | None = None) -> TarStream:
        """A tar (pax) archive of ``path``, produced while walking, in chunks of ``chunk_size``.

        For a directory, member names are relative to it ("a.py", "sub/b.py"); for a file the
        single member is its basename. The top-level path follows symlinks inside the root;
        nothing below it is followed (symlinks are archived as symlinks). Other mounts below
        the directory appear as empty directories, files bind-mounted there are left out.
        FIFOs, sockets and devices are skipped. uid/gid are inside-sandbox ids.

        Accounting: ``max_bytes`` (default ``max_archive``) caps the file content the archive
        carries. A regular file is charged by its data: its size, or, when it has fewer
        allocated blocks than its size suggests (``st_blocks * 512 < st_size``), the total of
        its data extents (``SEEK_DATA``/``SEEK_HOLE``), and such a file is archived in the GNU
        sparse format (pax 1.0: GNU tar, bsdtar and Python's tarfile restore the holes), so
        holes cost neither the charge nor the stream. A file's hard links are charged (and
        archived) once per name. Headers are not charged; the number of entries is capped by
        ``max_entries``. A member name longer than :data:`MAX_MEMBER_NAME` bytes (a tree too
        deep to archive) is refused with ``too_large``.

        This call resolves ``path`` and walks the tree once to size it (statx per entry, extents
        only for sparse-looking files), so a refusal (``too_large``, ``not_found``, ...) is
        raised here, before any chunk. The returned :class:`TarStream` no longer needs the root
        fd. If the tree grows past a cap while streaming (the sandbox changed it between the
        two walks), the stream raises ``too_large`` mid-way: the consumer must then abort the
        transfer rather than end it cleanly.
        """
        p = self._norm(path)
        cap = self.max_archive if max_bytes is None else max_bytes
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        fds: list[int] = []
        try:
            with _translate(p):
                fd = self._open(p, os.O_PATH)
                fds.append(fd)
                st = os.fstat(fd)
                if stat_mod.S_ISDIR(st.st_mode):
                    dfd = self._reopen(fd, os.O_RDONLY | os.O_DIRECTORY)
                    _close(fds.pop())
                    fds.append(dfd)
                    size = self._tar_size_dir(dfd, p, cap)
                    gen = self._tar_chunks(self._tar_dir_pieces(dfd, p, cap, chunk_size), chunk_size)
                elif stat_mod.S_ISREG(st.st_mode):
                    rfd = self._reopen(fd, os.O_RDONLY)
                    _close(fds.pop())
                    fds.append(rfd)
                    size = self._charge(rfd, os.fstat(rfd), p, cap, cap)
                    name = posixpath.basename(p)
                    gen = self._tar_chunks(self._file_member(rfd, name, p, [cap], cap, chunk_size), chunk_size)
                else:
                    raise FileOpError("invalid_path", p, "not a regular file or directory")
        except BaseException:
            for fd in fds:
                _close(fd)
            raise
        return TarStream(gen, fds, size)

    def _too_large(self, path: str, cap: int) -> FileTooLargeError:
        return FileTooLargeError(
            path,
            f"the archive would exceed {cap} bytes of file content (sparse files count the data they "
            "store); download smaller parts",
        )

    def _charge(self, rfd: int, st: os.stat_result, spath: str, left: int, cap: int) -> int:
        """What a regular file (open for reading) costs an archive; too_large past ``left``."""
        if st.st_blocks * 512 >= st.st_size:
            data = st.st_size
        else:
            _ext, data = _extents(rfd, st.st_size, left)
        if data > left:
            raise self._too_large(spath, cap)
        return data

    def _tar_walk(self, dfd: int, top: str) -> Generator[tuple[_Walk, bytes, bytes, _St], None, None]:
        """(walk, name, member name, statx) for each entry below ``dfd`` worth archiving,
        parents before children; other mounts are yielded (if directories) but not entered."""
        w = _Walk(dfd, top, max_entries=self.max_entries)
        try:
            while True:
                name = w.next_name()
                if name is None:
                    if w.depth == 0:
                        return
                    w.ascend()
                    continue
                if (st := w.stat(name)) is None:
                    continue
                isdir = stat_mod.S_ISDIR(st.mode)
                arc = w.arc(name)
                if len(arc) + isdir > MAX_MEMBER_NAME:
                    raise FileTooLargeError(
                        w.spath(name),
                        f"its member name would be {len(arc) + isdir} bytes, more than {MAX_MEMBER_NAME}: the "
                        "tree is too deep to archive; download a subdirectory",
                    )
                mount = w.is_mount(st)
                if mount and not isdir:
                    continue  # a file bind-mounted into the sandbox: not archived
                if not (isdir or stat_mod.S_ISREG(st.mode) or stat_mod.S_ISLNK(st.mode)):
                    continue  # fifos, sockets, device nodes
                yield w, name, arc, st
                if isdir and not mount:
                    try:
                        w.descend(name)
                    except OSError as exc:
                        if exc.errno in (errno.EXDEV, errno.ELOOP, errno.ENOENT, errno.ENOTDIR):
                            continue  # another mount (contents not archived), or swapped meanwhile
                        raise _from_oserror(exc, w.spath(name)) from exc
        finally:
            w.close()

    def _open_member(self, w: _Walk, name: bytes) -> int:
        """A regular file of a walk opened for reading (-1 if it vanished or is no longer one)."""
        try:
            ofd = openat2(w.fd, name, os.O_PATH | os.O_NOFOLLOW, 0, _STRICT)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EXDEV):
                return -1  # vanished or swapped for a symlink/mount meanwhile
            raise _from_oserror(exc, w.spath(name)) from exc
        try:
            if not stat_mod.S_ISREG(os.fstat(ofd).st_mode):
                return -1
            return self._reopen(ofd, os.O_RDONLY)
        except OSError as exc:
            raise _from_oserror(exc, w.spath(name)) from exc
        finally:
            _close(ofd)

    def _tar_size_dir(self, dfd: int, top: str, cap: int) -> int:
        """The sizing pass: total charge of a directory's archive; too_large past ``cap``."""
        total = 0
        with closing(self._tar_walk(dfd, top)) as entries:
            for w, name, _arc, st in entries:
                if not stat_mod.S_ISREG(st.mode):
                    continue
                if st.blocks * 512 >= st.size:
                    total += st.size
                else:  # may be sparse: its extents tell
                    rfd = self._open_member(w, name)
                    if rfd < 0:
                        continue
                    try:
                        total += self._charge(rfd, os.fstat(rfd), w.spath(name), cap - total, cap)
                    finally:
                        _close(rfd)
                if total > cap:
                    raise self._too_large(w.spath(name), cap)
        return total

    @staticmethod
    def _tar_chunks(pieces: Generator[bytes, None, None], chunk_size: int) -> Generator[bytes, None, None]:
        """Archive pieces -> chunks of ``chunk_size`` (the last shorter), end-of-archive included."""
        out = bytearray()
        total = 0
        with closing(pieces):
            for piece in pieces:
                out += piece
                total += len(piece)
                while len(out) >= chunk_size:
                    yield bytes(out[:chunk_size])
                    del out[:chunk_size]
        end = tarfile.BLOCKSIZE * 2
        end += -(total + end) % tarfile.RECORDSIZE  # as tarfile pads the last record
        out += bytes(end)
        while out:
            yield bytes(out[:chunk_size])
            del out[:chunk_size]

    def _tarinfo(self, name: str, mode: int, uid: int, gid: int, mtime: float) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.mode = stat_mod.S_IMODE(mode)
        ti.uid = self._inner_id(uid)
        ti.gid = self._inner_id(gid)
        ti.uname = ti.gname = ""
        ti.mtime = int(mtime)
        return ti

    @staticmethod
    def _header(ti: tarfile.TarInfo) -> bytes:
        return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")

    def _tar_dir_pieces(self, dfd: int, top: str, cap: int, chunk: int) -> Generator[bytes, None, None]:
        left = [cap]
        with closing(self._tar_walk(dfd, top)) as entries:
            for w, name, arc_b, st in entries:
                arc = os.fsdecode(arc_b)
                if stat_mod.S_ISDIR(st.mode):
                    ti = self._tarinfo(arc, st.mode, st.uid, st.gid, st.mtime)
                    ti.type = tarfile.DIRTYPE
                    yield self._header(ti)
                elif stat_mod.S_ISLNK(st.mode):
                    try:
                        target = os.readlink(name, dir_fd=w.fd)
                    except FileNotFoundError:
                        continue
                    except OSError as exc:
                        if exc.errno == errno.EINVAL:
                            continue  # no longer a symlink
                        raise _from_oserror(exc, w.spath(name)) from exc
                    ti = self._tarinfo(arc, st.mode, st.uid, st.gid, st.mtime)
                    ti.type = tarfile.SYMTYPE
                    ti.linkname = os.fsdecode(target)
                    yield self._header(ti)
                else:
                    rfd = self._open_member(w, name)
                    if rfd < 0:
                        continue
                    try:
                        yield from self._file_member(rfd, arc, w.spath(name), left, cap, chunk)
                    finally:
                        _close(rfd)

    def _file_member(
        self, rfd: int, arc: str, spath: str, left: _IntList, cap: int, chunk: int
    ) -> Generator[bytes, None, None]:
        """One regular file (``rfd`` open for reading) as a tar member: plain, or GNU sparse 1.0
        when it has holes. ``left[0]`` is the content budget, decreased here."""
        with _translate(spath):
            st = os.fstat(rfd)
            size = st.st_size
            ext: array[int] | None = None
            data = size
            if st.st_blocks * 512 < size:
                ext, data = _extents(rfd, size, left[0])
            if data > left[0]:
                raise self._too_large(spath, cap)
            left[0] -= data
            ti = self._tarinfo(arc, st.st_mode, st.st_uid, st.st_gid, st.st_mtime)
            ti.type = tarfile.REGTYPE
            if ext is None:
                ti.size = size
                yield self._header(ti)
                yield from _pread_range(rfd, 0, size, chunk)
                yield bytes(-size % tarfile.BLOCKSIZE)
                return
            # GNU sparse 1.0: a map ("count\n" then "offset\nlength\n" per extent, NUL-padded to a
            # block) followed by the data of the extents; the pax header carries the real name
            # and size, the ustar name is GNU tar's "GNUSparseFile" one for extractors without
            # sparse support.
            count = len(ext) // 2
            map_len = len(f"{count}\n")
            for v in ext:
                map_len += len(str(v)) + 1
            map_pad = -map_len % tarfile.BLOCKSIZE
            head, tail = posixpath.split(arc)
            sparse_name = posixpath.join(head, "GNUSparseFile.0", tail)
            ti.name = sparse_name
            ti.size = map_len + map_pad + data
            ti.pax_headers = {
                "path": sparse_name,
                "GNU.sparse.major": "1",
                "GNU.sparse.minor": "0",
                "GNU.sparse.name": arc,
                "GNU.sparse.realsize": str(size),
            }
            yield self._header(ti)
            text = bytearray(f"{count}\n".encode())
            for v in ext:
                text += b"%d\n" % v
                if len(text) >= chunk:
                    yield bytes(text)
                    text.clear()
            text += bytes(map_pad)
            yield bytes(text)
            for i in range(0, len(ext), 2):
                yield from _pread_range(rfd, ext[i], ext[i + 1], chunk)
            yield bytes(-data % tarfile.BLOCKSIZE)

    # ---------------------------------------------------------------- tar upload

    def upload_tar(
        self, path: str, data: bytes | BinaryIO, *, uid: int = 0, gid: int = 0, max_bytes: int | None = None
    ) -> None:
        """Extract a tar archive into directory ``path`` (created if missing).

        Members are owned by uid/gid (archive ownership is ignored); permission bits are kept
        minus setuid/setgid. Absolute names, ``..`` components, names longer than
        :data:`MAX_MEMBER_NAME` bytes, device nodes and FIFOs are rejected (``invalid_path``);
        symlinks are created verbatim; hard links may only point at regular files extracted
        earlier from the same archive; GNU sparse members are written with their holes. Every
        member is created with ``*at`` calls relative to a parent fd resolved with
        ``RESOLVE_IN_ROOT``, so symlinks (from the archive or already in the sandbox) resolve
        inside the root, never outside. An existing non-directory at a member's path is
        replaced (never written through), unless it is a mount point (``permission_denied``).

        Seekable input is validated completely before anything is extracted (:func:`check_upload`,
        with ``max_bytes``); a non-seekable stream is validated member by member.
        """
        dest = self._norm(path)
        huid, hgid = self._host_id(uid), self._host_id(gid)
        fobj: BinaryIO = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
        seekable = fobj.seekable()
        self.mkdir(dest, parents=True, uid=uid, gid=gid, exist_ok=True)
        try:
            tar = tarfile.open(fileobj=fobj, mode="r:*" if seekable else "r|*")  # noqa: SIM115
        except tarfile.TarError as exc:
            raise FileOpError("invalid_path", dest, f"not a valid tar archive: {exc}") from exc
        parents = _ParentCache()
        with tar:
            try:
                if seekable:
                    it: Iterator[tuple[tarfile.TarInfo, _StrList]] = iter(check_upload(tar, dest, max_bytes=max_bytes))
                else:
                    it = ((m, self._check_member(m, dest)) for m in tar)
                created: dict[str, tuple[int, int]] = {}  # member path -> (st_dev, st_ino)
                for m, parts in it:
                    if not parts:
                        continue  # "." entry
                    self._extract_member(tar, m, dest, parts, huid, hgid, created, parents)
            except tarfile.TarError as exc:
                raise FileOpError("invalid_path", dest, f"corrupt tar archive: {exc}") from exc
            finally:
                parents.clear()

    @staticmethod
    def _check_member(m: tarfile.TarInfo, dest: str) -> _StrList:
        where = f"{dest} (member {m.name[:200]!r})"
        if m.name.startswith("/"):
            raise FileOpError("invalid_path", where, "absolute member names are not allowed")
        if len(m.name.encode("utf-8", "surrogateescape")) > MAX_MEMBER_NAME:
            raise FileOpError("invalid_path", where, f"member name longer than {MAX_MEMBER_NAME} bytes")
        try:
            parts = _member_parts(m.name)
        except FileOpError as exc:
            raise FileOpError("invalid_path", where, str(exc)) from None
        if m.ischr() or m.isblk() or m.isfifo():
            raise FileOpError("invalid_path", where, "device nodes and FIFOs are not allowed")
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk()):
            raise FileOpError("invalid_path", where, f"unsupported member type {m.type!r}")
        if m.issym() and "\0" in m.linkname:
            raise FileOpError("invalid_path", where, "symlink target contains a NUL byte")
        if m.islnk():
            if m.linkname.startswith("/"):
                raise FileOpError("invalid_path", where, "hard link to an absolute path is not allowed")
            try:
                _member_parts(m.linkname)
            except FileOpError:
                raise FileOpError("invalid_path", where, "hard link target outside the archive") from None
        sparse = _sparse_map(m)
        if sparse is not None:
            pos = 0
            for off, length in sparse:
                if off < pos or length < 0 or off + length > m.size:
                    raise FileOpError("invalid_path", where, "corrupt sparse map")
                pos = off + length
        return parts

    def _extract_member(
        self,
        tar: tarfile.TarFile,
        m: tarfile.TarInfo,
        dest: str,
        parts: _StrList,
        huid: int,
        hgid: int,
        created: dict[str, tuple[int, int]],
        parents: _ParentCache,
    ) -> None:
        rel = "/".join(parts)
        spath = _join(dest, rel)
        mode = m.mode & 0o1777
        parent = posixpath.dirname(spath)
        name = parts[-1]
        with _translate(spath):
            # The member's directory: that of the previous member, or resolved in root (archives
            # often omit directory entries: missing parents are created). A member only ever
            # replaces entries *in* this directory, so the cached fd never goes stale by the archive.
            pfd = parents.get(parent)
            if pfd is None:
                pfd = self._makedirs(parent, parents=True, mode=0o755, huid=huid, hgid=hgid, exist_ok=True)
                parents.put(parent, pfd)
            if m.isdir():
                try:
                    os.mkdir(name, 0o700, dir_fd=pfd)
                except FileExistsError:
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                    if not stat_mod.S_ISDIR(st.st_mode):
                        self._unlink_nondir(pfd, name, spath)
                        os.mkdir(name, 0o700, dir_fd=pfd)
                dfd = openat2(pfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                try:
                    os.fchown(dfd, huid, hgid)
                    os.fchmod(dfd, mode or 0o755)
                finally:
                    _close(dfd)
                return
            self._unlink_nondir(pfd, name, spath)
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=pfd)
                os.chown(name, huid, hgid, dir_fd=pfd, follow_symlinks=False)
                return
            if m.islnk():
                target = "/".join(_member_parts(m.linkname))
                ident = created.get(target)
                if ident is None:
                    raise FileOpError(
                        "invalid_path",
                        spath,
                        f"hard link target {m.linkname!r} is not a file extracted earlier",
                    )
                tpath = _join(dest, target)
                sfd, sname = self._open_parent(tpath)
                try:
                    st = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
                    if (st.st_dev, st.st_ino) != ident or not stat_mod.S_ISREG(st.st_mode):
                        msg = f"hard link target {m.linkname!r} changed"
                        raise FileOpError("invalid_path", spath, msg)
                    os.link(sname, name, src_dir_fd=sfd, dst_dir_fd=pfd, follow_symlinks=False)
                finally:
                    _close(sfd)
                created[rel] = ident
                return
            # regular file
            fd = openat2(pfd, name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, _STRICT)
            try:
                os.fchown(fd, huid, hgid)
                os.fchmod(fd, mode)
                sparse = _sparse_map(m)
                if sparse is not None:
                    self._write_sparse(tar, m, sparse, fd)
                else:
                    src = tar.extractfile(m)
                    if src is not None:
                        while chunk := src.read(_CHUNK):
                            _write_all(fd, chunk)
                os.utime(fd, (m.mtime, m.mtime))
                st = os.fstat(fd)
                created[rel] = (st.st_dev, st.st_ino)
            finally:
                _close(fd)

    @staticmethod
    def _write_sparse(tar: tarfile.TarFile, m: tarfile.TarInfo, sparse: _Extents, fd: int) -> None:
        """A GNU sparse member: the data of each extent at its offset, holes left as holes."""
        src = cast(BinaryIO, tar.fileobj)
        src.seek(m.offset_data)
        for off, length in sparse:
            at, left = off, length
            while left:
                chunk = src.read(min(_CHUNK, left))
                if not chunk:
                    raise tarfile.ReadError("unexpected end of data")
                view = memoryview(chunk)
                while view:
                    n = os.pwrite(fd, view, at)
                    view = view[n:]
                    at += n
                left -= len(chunk)
        os.ftruncate(fd, m.size)


# --------------------------------------------------------------------------- upload rules


def check_upload(
    tar: tarfile.TarFile, dest: str, *, max_bytes: int | None = None
) -> list[tuple[tarfile.TarInfo, list[str]]]:
    """Every member of an archive to be unpacked into ``dest``, with its name's parts, checked
    before anything is written: the rules of :meth:`SandboxFS.upload_tar` (names, types), hard
    links only to regular files of the archive named before them (and not replaced since), and
    the data all members hold (a sparse member by its extents) at most ``max_bytes``, counted
    header by header: an archive that would expand past what the sandbox can hold (a gzip bomb)
    is refused at its first oversized header, never unpacked (and one cut short, by tarfile's own
    check at its end, as ``tarfile.ReadError``). Raises FileOpError (``invalid_path``,
    ``too_large``). One set of rules for every tier (the VM tiers check uploads with it on the
    host before their guest's tar sees a byte)."""
    out: list[tuple[tarfile.TarInfo, list[str]]] = []
    files: set[str] = set()  # regular files (and their hard links) named so far
    total = 0
    while (m := tar.next()) is not None:
        parts = SandboxFS._check_member(m, dest)
        rel = "/".join(parts)
        if m.islnk() and "/".join(_member_parts(m.linkname)) not in files:
            where = f"{dest} (member {m.name[:200]!r})"
            raise FileOpError("invalid_path", where, f"hard link target {m.linkname!r} is not a file extracted earlier")
        if m.isreg() or m.islnk():
            files.add(rel)
        else:
            files.discard(rel)
        sparse = _sparse_map(m)
        total += m.size if sparse is None else sum(length for _off, length in sparse)
        if max_bytes is not None and total > max_bytes:
            raise FileTooLargeError(dest, f"the archive's files hold more than {max_bytes} bytes, more than fits")
        out.append((m, parts))
    return out


# --------------------------------------------------------------------------- helpers


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _sparse_map(m: tarfile.TarInfo) -> list[tuple[int, int]] | None:
    """The (offset, length) data extents of a GNU sparse member (tarfile keeps them in ``sparse``)."""
    sparse = cast("list[tuple[int, int]] | None", getattr(m, "sparse", None))
    return None if sparse is None else [(int(off), int(length)) for off, length in sparse]


def _db_match(buf: bytes, end: int, prefix: bytes, accept: Callable[[list[bytes]], T | None]) -> T | None:
    """The first line of ``buf[:end]`` (whole lines) starting with ``prefix`` that ``accept`` takes.
    Candidates are found with bytes.find, so lines of other users cost no Python work."""
    pos = 0
    if not buf.startswith(prefix):
        pos = buf.find(b"\n" + prefix, 0, end) + 1
        if pos == 0:
            return None
    while True:
        eol = buf.find(b"\n", pos, end)
        if eol - pos <= _MAX_DB_LINE:
            found = accept(buf[pos:eol].split(b":"))
            if found is not None:
                return found
        pos = buf.find(b"\n" + prefix, eol, end) + 1
        if pos == 0:
            return None


def _db_id(field: bytes) -> int | None:
    """A uid/gid field of /etc/passwd or /etc/group (ASCII digits only, at most 10 of them)."""
    if not field or len(field) > 10 or not field.isdigit():
        return None
    return int(field)
