"""Unpacking a tar archive into a sandbox: members checked first (`check_upload`), then written beneath the root."""

from __future__ import annotations

import io
import os
import posixpath
import stat as stat_mod
import tarfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, BinaryIO, cast

from sandfleet.runtime.openat2 import openat2
from sandfleet.runtime.sandboxfs.fileops import _CHUNK, _SandboxFSCore, _write_all
from sandfleet.runtime.sandboxfs.paths import _STRICT, MAX_MEMBER_NAME, _join, _member_parts
from sandfleet.runtime.sandboxfs.results import FileOpError, FileTooLargeError, _close, _translate

if TYPE_CHECKING:
    from sandfleet.runtime.sandboxfs.fileops import _StrList

_Extents = list[tuple[int, int]]


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


class _TarUpload(_SandboxFSCore):
    """Unpacking tar archives into the sandbox."""

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
        parts = _TarUpload._check_member(m, dest)
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


def _sparse_map(m: tarfile.TarInfo) -> list[tuple[int, int]] | None:
    """The (offset, length) data extents of a GNU sparse member (tarfile keeps them in ``sparse``)."""
    sparse = cast("list[tuple[int, int]] | None", getattr(m, "sparse", None))
    return None if sparse is None else [(int(off), int(length)) for off, length in sparse]


__all__ = ["check_upload"]
