"""The file operations of a sandbox root on single files and directories (read, write, stat, mkdir, remove, users)."""

from __future__ import annotations

import errno
import os
import posixpath
import stat as stat_mod
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from sandfleet.runtime.openat2 import openat2
from sandfleet.runtime.sandboxfs import xattrs as _xattrs
from sandfleet.runtime.sandboxfs.paths import (
    _IN_ROOT,
    _MAX_SYMLINK_HOPS,
    _STRICT,
    _canon,
    _join,
    _norm,
    _rel,
    _split,
)
from sandfleet.runtime.sandboxfs.results import (
    FileOpError,
    FileStat,
    FileTooLargeError,
    _close,
    _kind,
    _mount_refused,
    _translate,
)
from sandfleet.runtime.sandboxfs.syscalls import _statx
from sandfleet.runtime.sandboxfs.walk import DEFAULT_MAX_ENTRIES, _rmtree_fd

if TYPE_CHECKING:
    from sandfleet.runtime.sandboxfs.syscalls import _St

T = TypeVar("T")
_CHUNK = 1 << 20
# Lines of /etc/passwd and /etc/group longer than this are skipped.
_MAX_DB_LINE = 64 << 10
_StrList = list[str]  # SandboxFS.list shadows the builtin inside the class body
_IntList = list[int]


class _SandboxFSCore:
    """Operations on single files and directories, their ids and the mount checks: `SandboxFS` adds tar."""

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

    def _filestat(
        self, path: str, st: os.stat_result, link_target: str | None = None, attrs: dict[str, str] | None = None
    ) -> FileStat:
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
            xattrs=attrs,
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
        attrs: dict[str, str] | None = None,
        attrs_scope: str = "",
    ) -> None:
        """Write ``data`` to ``path``, creating it (owned by uid/gid, with ``mode``) if needed.

        An existing file is truncated (or appended to) in place, keeping its inode, owner and
        mode. A final symlink is followed inside the root; a dangling one creates its target
        (inside the root). Writing to anything but a regular file is refused, and so is a mount
        point (a file bind-mounted into the sandbox). ``attrs`` given: they become the file's
        ``user.<attrs_scope>`` extended attributes (sandboxfs/xattrs.py), the others there go.
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
                        if attrs is not None:
                            _xattrs.replace(fd, attrs, attrs_scope)
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
                    if attrs is not None:
                        _xattrs.replace(fd, attrs, attrs_scope)
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
                    st = os.fstat(fd)
                    regular = stat_mod.S_ISREG(st.st_mode) or stat_mod.S_ISDIR(st.st_mode)
                    return self._filestat(p, st, attrs=_xattrs.read(fd) if regular else None)
                finally:
                    _close(fd)
            pfd, name = self._open_parent(p)
            try:
                st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                target = os.readlink(name, dir_fd=pfd) if stat_mod.S_ISLNK(st.st_mode) else None
                return self._filestat(p, st, target, _xattrs.read_at(pfd, name, st.st_mode))
            finally:
                _close(pfd)

    def list(self, path: str, *, xattrs: bool = False) -> list[FileStat]:
        """Entries of a directory (a final symlink is followed inside the root), sorted by name;
        `xattrs`: with their `user.` attributes (a syscall more per entry)."""
        p = self._norm(path)
        with _translate(p):
            fd = self._open(p, os.O_RDONLY | os.O_DIRECTORY)
            budget = _xattrs.Budget() if xattrs else None
            try:
                out: list[FileStat] = []
                for name in sorted(os.listdir(fd)):
                    child = _join(p, name)
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                        target = os.readlink(name, dir_fd=fd) if stat_mod.S_ISLNK(st.st_mode) else None
                    except FileNotFoundError:
                        continue  # removed concurrently
                    attrs = _xattrs.read_at(fd, name, st.st_mode, budget) if budget is not None else None
                    out.append(self._filestat(child, st, target, attrs))
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


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


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
