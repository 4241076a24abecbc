"""Tar archives of sandbox trees, streamed while walking them (`TarStream`), sparse files kept sparse."""

from __future__ import annotations

import errno
import io
import os
import posixpath
import stat as stat_mod
import tarfile
from array import array
from collections.abc import Generator, Iterator
from contextlib import closing
from types import TracebackType
from typing import IO, TYPE_CHECKING

from sandfleet.runtime.openat2 import openat2
from sandfleet.runtime.sandboxfs.fileops import _CHUNK, _SandboxFSCore
from sandfleet.runtime.sandboxfs.paths import _STRICT, MAX_MEMBER_NAME
from sandfleet.runtime.sandboxfs.results import FileOpError, FileTooLargeError, _close, _from_oserror, _translate
from sandfleet.runtime.sandboxfs.walk import _Walk

if TYPE_CHECKING:
    from sandfleet.runtime.sandboxfs.fileops import _IntList
    from sandfleet.runtime.sandboxfs.syscalls import _St


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


class _TarDownload(_SandboxFSCore):
    """Tar archives of sandbox trees, produced while walking them."""

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


__all__ = ["TarStream"]
