"""File operations inside a sandbox's root filesystem, performed by the (real root) daemon.

Every path given to :class:`SandboxFS` is an absolute path *as seen from inside the
sandbox*. The daemon runs as real root on the host, so a symlink planted by sandboxed
code must never make it touch a host file. All resolution therefore goes through
``openat2(2)`` relative to an ``O_PATH`` fd of the sandbox root with::

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
sandbox. Tree walks (recursive remove, tar download, tar upload) descend one component at a
time with ``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV``.

All functions are synchronous (the daemon calls them from a worker thread) and close every
fd they open, including on errors.
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import posixpath
import stat as stat_mod
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, BinaryIO, Literal

__all__ = [
    "FileKind",
    "FileOpError",
    "FileOpKind",
    "FileStat",
    "FileTooLargeError",
    "SandboxFS",
    "openat2",
    "RESOLVE_BENEATH",
    "RESOLVE_IN_ROOT",
    "RESOLVE_NO_MAGICLINKS",
    "RESOLVE_NO_SYMLINKS",
    "RESOLVE_NO_XDEV",
]

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

_MAX_SYMLINK_HOPS = 40
_CHUNK = 1 << 20


class _OpenHow(ctypes.Structure):
    _fields_ = [
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = 0) -> int:
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
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), path)


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
    no better mapping); ``path`` is the sandbox path; ``errno`` the underlying errno if any.
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


# --------------------------------------------------------------------------- paths


def _norm(path: str) -> str:
    """Validate and normalise a user-supplied sandbox path ("/a//b/./c/" -> "/a/b/c")."""
    if not isinstance(path, str) or not path:
        raise FileOpError("invalid_path", repr(path), "path must be a non-empty string")
    if "\0" in path:
        raise FileOpError("invalid_path", repr(path), "path contains a NUL byte")
    if not path.startswith("/"):
        raise FileOpError("invalid_path", path, "path must be absolute")
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


# --------------------------------------------------------------------------- stat

FileKind = Literal["file", "dir", "symlink", "other"]
_StrList = list[str]  # SandboxFS.list shadows the builtin inside the class body


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


class _PaddedReader(io.RawIOBase):
    """Reads exactly ``size`` bytes from ``fd``: truncated files are zero padded, growth ignored."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__()
        self._fd = fd
        self._left = size

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        n = self._left if size is None or size < 0 else min(size, self._left)
        if n <= 0:
            return b""
        data = os.read(self._fd, n)
        if not data:
            data = b"\0" * n
        self._left -= len(data)
        return data


# --------------------------------------------------------------------------- SandboxFS


class SandboxFS:
    """File operations confined to one sandbox root.

    ``root_fd`` is an ``O_PATH | O_DIRECTORY`` fd of the sandbox root (e.g. from
    ``open("/proc/<pid>/root")``); it is borrowed, not closed. Files and directories created
    here are owned by ``uid_base + uid`` / ``uid_base + gid`` on the host; reported ids are
    translated back (host ids outside ``[uid_base, uid_base + id_count)`` show as 65534).
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
    ) -> None:
        self.root_fd = root_fd
        self.uid_base = uid_base
        self.max_read = max_read
        self.id_count = id_count
        # Bounds what a tar download may contain: a sparse `truncate -s 1T` file costs the
        # sandbox no disk but would cost the daemon its apparent size.
        self.max_archive = max_archive
        self._archive_budget = max_archive

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

    # ---------------------------------------------------------------- read / write

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        p = _norm(path)
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
        (inside the root). Writing to anything but a regular file is refused.
        """
        p = _norm(path)
        if p == "/":
            raise FileOpError("is_a_directory", p, "is a directory")
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

    # ---------------------------------------------------------------- metadata

    def stat(self, path: str, *, follow_symlinks: bool = False) -> FileStat:
        p = _norm(path)
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
        p = _norm(path)
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
        p = _norm(path)
        huid, hgid = self._host_id(uid), self._host_id(gid)
        parts = [c for c in p.split("/") if c]
        if not parts:
            if exist_ok:
                return
            raise FileOpError("exists", p, "already exists")
        with _translate(p):
            for i, comp in enumerate(parts):
                prefix = "/" + "/".join(parts[: i + 1])
                last = i == len(parts) - 1
                try:
                    fd = self._open(prefix, os.O_PATH | os.O_DIRECTORY)
                except FileNotFoundError:
                    pass
                else:
                    _close(fd)
                    if last and not exist_ok:
                        raise FileOpError("exists", p, "already exists")
                    continue
                if not last and not parents:
                    raise FileOpError("not_found", p, f"parent directory {prefix} does not exist")
                pfd, _ = self._open_parent(prefix)
                try:
                    try:
                        os.mkdir(comp, 0o700, dir_fd=pfd)
                    except FileExistsError:
                        # Something appeared between the lookup and mkdir, or a dangling symlink.
                        try:
                            fd = self._open(prefix, os.O_PATH | os.O_DIRECTORY)
                        except FileNotFoundError:
                            raise FileOpError(
                                "exists", p, f"{prefix} exists and is not a directory (dangling symlink?)"
                            ) from None
                        _close(fd)
                        if last and not exist_ok:
                            raise FileOpError("exists", p, "already exists") from None
                        continue
                    dfd = openat2(pfd, comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                    try:
                        os.fchown(dfd, huid, hgid)
                        os.fchmod(dfd, mode & 0o7777)
                    finally:
                        _close(dfd)
                finally:
                    _close(pfd)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove a file, symlink (never its target) or directory (``recursive`` for non-empty).

        Recursive removal walks with fds, never follows symlinks and refuses to descend into
        another mount (``crosses_mount``; whatever was already removed stays removed).
        """
        p = _norm(path)
        if p == "/":
            raise FileOpError("invalid_path", p, "refusing to remove the sandbox root")
        with _translate(p):
            pfd, name = self._open_parent(p)
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                if not stat_mod.S_ISDIR(st.st_mode):
                    os.unlink(name, dir_fd=pfd)
                    return
                if recursive:
                    dfd = openat2(pfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                    try:
                        _rmtree_fd(dfd, p)
                    finally:
                        _close(dfd)
                os.rmdir(name, dir_fd=pfd)
            finally:
                _close(pfd)

    # ---------------------------------------------------------------- tar download

    def download_tar(self, path: str) -> bytes:
        """A tar archive of ``path`` (see :meth:`write_tar`) as bytes."""
        buf = io.BytesIO()
        self.write_tar(path, buf)
        return buf.getvalue()

    def iter_tar(self, path: str, chunk_size: int = _CHUNK) -> Iterator[bytes]:
        """Like :meth:`download_tar` but yields chunks.

        The archive is first built into a spooled temp file (in memory up to 16 MiB, then on
        disk), so no sandbox fd is held open across yields.
        """
        import tempfile

        with tempfile.SpooledTemporaryFile(max_size=16 << 20) as tmp:
            self.write_tar(path, tmp)
            tmp.seek(0)
            while chunk := tmp.read(chunk_size):
                yield chunk

    def write_tar(self, path: str, fileobj: IO[bytes]) -> None:
        """Stream a tar (pax) of ``path`` into ``fileobj``.

        For a directory, member names are relative to it ("a.py", "sub/b.py"); for a file the
        single member is its basename. The top-level path follows symlinks inside the root;
        nothing below it is followed (symlinks are archived as symlinks). Other mounts below
        the directory appear as empty directories. FIFOs, sockets and devices are skipped.
        uid/gid are inside-sandbox ids.
        """
        p = _norm(path)
        self._archive_budget = self.max_archive
        with _translate(p):
            fd = self._open(p, os.O_PATH)
            try:
                st = os.fstat(fd)
                with tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                    if stat_mod.S_ISDIR(st.st_mode):
                        dfd = self._reopen(fd, os.O_RDONLY | os.O_DIRECTORY)
                        try:
                            self._tar_dir(tar, dfd, "", p)
                        finally:
                            _close(dfd)
                    elif stat_mod.S_ISREG(st.st_mode):
                        name = posixpath.basename(p)
                        self._tar_file(tar, fd, name, p)
                    else:
                        raise FileOpError("invalid_path", p, "not a regular file or directory")
            finally:
                _close(fd)

    def _tarinfo(self, name: str, st: os.stat_result) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.mode = stat_mod.S_IMODE(st.st_mode)
        ti.uid = self._inner_id(st.st_uid)
        ti.gid = self._inner_id(st.st_gid)
        ti.uname = ti.gname = ""
        ti.mtime = int(st.st_mtime)
        return ti

    def _tar_file(self, tar: tarfile.TarFile, opath_fd: int, name: str, spath: str) -> None:
        st = os.fstat(opath_fd)
        if not stat_mod.S_ISREG(st.st_mode):
            return
        rfd = self._reopen(opath_fd, os.O_RDONLY)
        try:
            st = os.fstat(rfd)
            if st.st_size > self._archive_budget:
                raise FileTooLargeError(
                    spath, f"the archive would exceed {self.max_archive} bytes; download smaller parts"
                )
            self._archive_budget -= st.st_size
            ti = self._tarinfo(name, st)
            ti.type = tarfile.REGTYPE
            ti.size = st.st_size
            tar.addfile(ti, _PaddedReader(rfd, st.st_size))
        finally:
            _close(rfd)

    def _tar_dir(self, tar: tarfile.TarFile, dfd: int, prefix: str, spath: str) -> None:
        for name in sorted(os.listdir(dfd)):
            arc = f"{prefix}{name}"
            child = _join(spath, name)
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat_mod.S_ISLNK(st.st_mode):
                ti = self._tarinfo(arc, st)
                ti.type = tarfile.SYMTYPE
                ti.linkname = os.readlink(name, dir_fd=dfd)
                tar.addfile(ti)
            elif stat_mod.S_ISREG(st.st_mode):
                try:
                    ofd = openat2(dfd, name, os.O_PATH | os.O_NOFOLLOW, 0, _STRICT)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EXDEV):
                        continue  # vanished or swapped for a symlink/mount meanwhile
                    raise
                try:
                    self._tar_file(tar, ofd, arc, child)
                finally:
                    _close(ofd)
            elif stat_mod.S_ISDIR(st.st_mode):
                ti = self._tarinfo(arc, st)
                ti.type = tarfile.DIRTYPE
                tar.addfile(ti)
                try:
                    cfd = openat2(dfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                except OSError as exc:
                    if exc.errno in (errno.EXDEV, errno.ELOOP, errno.ENOENT, errno.ENOTDIR):
                        continue  # another mount (contents not archived), or swapped meanwhile
                    raise
                try:
                    self._tar_dir(tar, cfd, arc + "/", child)
                finally:
                    _close(cfd)
            # fifos, sockets, device nodes: skipped

    # ---------------------------------------------------------------- tar upload

    def upload_tar(self, path: str, data: bytes | BinaryIO, *, uid: int = 0, gid: int = 0) -> None:
        """Extract a tar archive into directory ``path`` (created if missing).

        Members are owned by uid/gid (archive ownership is ignored); permission bits are kept
        minus setuid/setgid. Absolute names, ``..`` components, device nodes and FIFOs are
        rejected (``invalid_path``); symlinks are created verbatim; hard links may only point
        at regular files extracted earlier from the same archive. Every member is created with
        ``*at`` calls relative to a parent fd resolved with ``RESOLVE_IN_ROOT``, so symlinks
        (from the archive or already in the sandbox) resolve inside the root, never outside.
        An existing non-directory at a member's path is replaced (never written through).

        Seekable input is validated completely before anything is extracted; a non-seekable
        stream is validated member by member.
        """
        dest = _norm(path)
        huid, hgid = self._host_id(uid), self._host_id(gid)
        fobj: BinaryIO = io.BytesIO(data) if isinstance(data, bytes | bytearray | memoryview) else data
        seekable = fobj.seekable()
        self.mkdir(dest, parents=True, uid=uid, gid=gid, exist_ok=True)
        try:
            tar = tarfile.open(fileobj=fobj, mode="r:*" if seekable else "r|*")  # noqa: SIM115
        except tarfile.TarError as exc:
            raise FileOpError("invalid_path", dest, f"not a valid tar archive: {exc}") from exc
        with tar:
            try:
                if seekable:
                    members = tar.getmembers()
                    for m in members:
                        self._check_member(m, dest)
                    it: Iterator[tarfile.TarInfo] = iter(members)
                else:
                    it = iter(tar)
                created: dict[str, tuple[int, int]] = {}  # member path -> (st_dev, st_ino)
                for m in it:
                    parts = self._check_member(m, dest)
                    if not parts:
                        continue  # "." entry
                    self._extract_member(tar, m, dest, parts, huid, hgid, created)
            except tarfile.TarError as exc:
                raise FileOpError("invalid_path", dest, f"corrupt tar archive: {exc}") from exc

    @staticmethod
    def _check_member(m: tarfile.TarInfo, dest: str) -> _StrList:
        where = f"{dest} (member {m.name!r})"
        if m.name.startswith("/"):
            raise FileOpError("invalid_path", where, "absolute member names are not allowed")
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
    ) -> None:
        rel = "/".join(parts)
        spath = _join(dest, rel)
        mode = m.mode & 0o1777
        parent = posixpath.dirname(spath)
        inner_uid, inner_gid = huid - self.uid_base, hgid - self.uid_base
        # Archives often omit directory entries: create missing parents (resolved in root).
        self.mkdir(parent, parents=True, uid=inner_uid, gid=inner_gid, exist_ok=True)
        name = parts[-1]
        with _translate(spath):
            pfd = self._open(parent, os.O_PATH | os.O_DIRECTORY)
            try:
                if m.isdir():
                    try:
                        os.mkdir(name, 0o700, dir_fd=pfd)
                    except FileExistsError:
                        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                        if not stat_mod.S_ISDIR(st.st_mode):
                            _unlink_nondir(pfd, name)
                            os.mkdir(name, 0o700, dir_fd=pfd)
                    dfd = openat2(pfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
                    try:
                        os.fchown(dfd, huid, hgid)
                        os.fchmod(dfd, mode or 0o755)
                    finally:
                        _close(dfd)
                    return
                _unlink_nondir(pfd, name)
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
                    src = tar.extractfile(m)
                    if src is not None:
                        while chunk := src.read(_CHUNK):
                            _write_all(fd, chunk)
                    os.utime(fd, (m.mtime, m.mtime))
                    st = os.fstat(fd)
                    created[rel] = (st.st_dev, st.st_ino)
                finally:
                    _close(fd)
            finally:
                _close(pfd)


# --------------------------------------------------------------------------- helpers


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _unlink_nondir(dirfd: int, name: str) -> None:
    """Remove an existing non-directory ``name`` (file or symlink) so it is replaced, not followed."""
    try:
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat_mod.S_ISDIR(st.st_mode):
        raise OSError(errno.EISDIR, os.strerror(errno.EISDIR), name)
    os.unlink(name, dir_fd=dirfd)


def _rmtree_fd(top_fd: int, top_path: str) -> None:
    """Empty the directory ``top_fd`` (not closed here) without following symlinks or mounts.

    Iterative, so depth is bounded by the fd limit rather than the Python stack.
    """
    # stack of (dir fd, sandbox path, remaining names); fds other than top_fd are owned.
    stack: list[tuple[int, str, list[str]]] = [(top_fd, top_path, sorted(os.listdir(top_fd)))]
    try:
        while stack:
            dfd, dpath, names = stack[-1]
            if not names:
                stack.pop()
                if dfd != top_fd:
                    _close(dfd)
                if stack:
                    pfd, _, _ = stack[-1]
                    try:
                        os.rmdir(posixpath.basename(dpath), dir_fd=pfd)
                    except FileNotFoundError:
                        pass
                continue
            name = names.pop()
            child = _join(dpath, name)
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat_mod.S_ISDIR(st.st_mode):
                try:
                    os.unlink(name, dir_fd=dfd)
                except FileNotFoundError:
                    pass
                continue
            try:
                cfd = openat2(dfd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
            except OSError as exc:
                raise _from_oserror(exc, child) from exc
            try:
                names_c = sorted(os.listdir(cfd))
            except BaseException:
                _close(cfd)
                raise
            stack.append((cfd, child, names_c))
    finally:
        for dfd, _, _ in stack:
            if dfd != top_fd:
                _close(dfd)
