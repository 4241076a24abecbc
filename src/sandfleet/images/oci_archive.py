"""Reading an image archive (a directory, or a tar of one) safely: members beneath one fd, tar headers bounded."""

from __future__ import annotations

import errno
import gzip
import os
import stat
import tarfile
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol, cast

from .oci_errors import OciImportError

_DIR_FD_CACHE = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A pax or GNU long-name header is read into memory whole: real ones hold a path or some xattrs.
_MAX_TAR_HEADER = 8 << 20
# Extension headers preceding one entry (pax, GNU long name and link): tarfile recurses per
# header, holding each in memory; real tars use at most three.
_MAX_TAR_HEADER_CHAIN = 8
# Global pax headers accumulate for the rest of the archive and are copied into every entry.
_MAX_GLOBAL_PAX = 1 << 20
# Members of the archive (docker save / oci-archive) itself: a few per layer in real ones.
_MAX_ARCHIVE_MEMBERS = 100_000
_EXTENSION_TYPES = frozenset(
    {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE}
)
_header_chain = threading.local()  # extension headers being processed by this thread's tarfile


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's TarInfo, minus the ways a hostile tar makes tarfile itself use unbounded memory.

    tarfile reads a pax or GNU long-name header into memory whole and recurses once per such
    header; it keeps global pax headers for the rest of the archive; and it builds a sparse
    file's map from as many extension blocks or map lines as the tar holds. So: headers are
    capped in size, in number per entry and (global ones) in total; sparse entries are refused
    (no image tool writes them). The hooks are tarfile's private methods, stable since 3.x.
    """

    def _proc_member(self, tar: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type == tarfile.GNUTYPE_SPARSE:
            _sparse_unsupported(self)
        if self.type not in _EXTENSION_TYPES:
            return cast(tarfile.TarInfo, super()._proc_member(tar))  # type: ignore[misc]  # private, untyped
        if self.size > _MAX_TAR_HEADER:
            raise OciImportError(f"a tar extension header of {self.size} bytes (at most {_MAX_TAR_HEADER})")
        if self.type == tarfile.XGLTYPE:
            held = sum(len(k) + len(v) for k, v in tar.pax_headers.items())
            if held + self.size > _MAX_GLOBAL_PAX:
                raise OciImportError(f"global pax headers of more than {_MAX_GLOBAL_PAX} bytes")
        depth: int = getattr(_header_chain, "depth", 0)
        if depth >= _MAX_TAR_HEADER_CHAIN:
            raise OciImportError(f"more than {_MAX_TAR_HEADER_CHAIN} tar extension headers in a row")
        _header_chain.depth = depth + 1
        try:
            return cast(tarfile.TarInfo, super()._proc_member(tar))  # type: ignore[misc]  # private, untyped
        finally:
            _header_chain.depth = depth

    # pax sparse formats 0.0, 0.1 and 1.0 (1.0 reads its map from the entry's data, unbounded)
    def _proc_gnusparse_00(self, entry: tarfile.TarInfo, *_: object) -> None:
        _sparse_unsupported(entry)

    def _proc_gnusparse_01(self, entry: tarfile.TarInfo, *_: object) -> None:
        _sparse_unsupported(entry)

    def _proc_gnusparse_10(self, entry: tarfile.TarInfo, *_: object) -> None:
        _sparse_unsupported(entry)


def _sparse_unsupported(entry: tarfile.TarInfo) -> None:
    raise OciImportError(f"{entry.name!r} is a sparse file entry, which is not supported")


def _archive_path(path: str) -> str:
    """A path inside the archive as named by its metadata, which must not leave the archive."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if path.startswith("/") or ".." in parts or not parts:
        raise OciImportError(f"archive path {path!r} is absolute or leaves the archive")
    return "/".join(parts)


class _Source(Protocol):
    def has(self, path: str) -> bool: ...

    def open(self, path: str) -> IO[bytes]: ...

    def close(self) -> None: ...


def _reopen(pfd: int) -> int:
    """A readable fd of the file behind the ``O_PATH`` fd ``pfd``. Through its /proc magic link,
    which names the inode itself: nothing swapped in at the path meanwhile can be opened instead.
    Only now is the file opened for real, after fstat said it is a regular file, so a FIFO can't
    block and a device node (say /dev/watchdog, whose open arms it) is never opened at all."""
    fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    os.set_blocking(fd, True)  # O_NONBLOCK only so a leased file fails instead of hanging the open
    return fd


def _kind(st: os.stat_result) -> str:
    mode = st.st_mode
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


class _DirSource:
    """An OCI image layout (or an unpacked ``docker save``) directory.

    Its metadata (docker save ``Layers``, whose paths carry no digest) names members by path, so
    every member is opened beneath the directory's fd one component at a time, never through a
    symlink, and must be a regular file: a symlink could otherwise make the root daemon read any
    host file, and a FIFO would block its thread forever.
    """

    def __init__(self, fd: int, root: Path) -> None:
        self.fd = fd  # O_PATH, owned
        self.root = root  # for messages only

    def _lookup(self, path: str) -> int | None:
        """An ``O_PATH`` fd of the member at ``path`` (not followed if a symlink), None if missing."""
        parts = _archive_path(path).split("/")
        fd = self.fd
        try:
            for i, name in enumerate(parts[:-1]):
                try:
                    child = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except FileNotFoundError:
                    return None
                except OSError as exc:
                    if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                        raise
                    st = os.lstat(name, dir_fd=fd)
                    raise OciImportError(
                        f"{'/'.join(parts[: i + 1])} in {self.root} is {_kind(st)}, not a directory; "
                        f"refusing to read {path} through it"
                    ) from None
                if fd != self.fd:
                    os.close(fd)
                fd = child
            try:
                return os.open(parts[-1], os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                return None
        finally:
            if fd != self.fd:
                os.close(fd)

    def has(self, path: str) -> bool:
        pfd = self._lookup(path)
        if pfd is None:
            return False
        os.close(pfd)
        return True

    def open(self, path: str) -> IO[bytes]:
        pfd = self._lookup(path)
        if pfd is None:
            raise OciImportError(f"{path} is missing from {self.root}")
        try:
            st = os.fstat(pfd)
            if not stat.S_ISREG(st.st_mode):
                raise OciImportError(
                    f"{path} in {self.root} is {_kind(st)}; the members of an image directory must be regular files"
                )
            return os.fdopen(_reopen(pfd), "rb")
        finally:
            os.close(pfd)

    def close(self) -> None:
        os.close(self.fd)


# What a malformed tar archive or layer blob raises while it is decompressed and parsed. OSError in general is
# not among them: reading the archive or writing the staging dir fails that way for reasons of the
# host (EIO, ENOSPC), and gzip's BadGzipFile, which is one, is the archive's.
_FORMAT_ERRORS = (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile)


class _TarSource:
    """A tar of either format; members are read in place (tarfile seeks), not unpacked first."""

    def __init__(self, file: IO[bytes], path: Path) -> None:
        self.path = path
        self._file = file  # owned: tarfile does not close a file it was given
        try:
            self._tar = tarfile.open(fileobj=file, mode="r:*", tarinfo=_BoundedTarInfo)  # noqa: SIM115 (for the source's lifetime)
        except _FORMAT_ERRORS as exc:
            file.close()
            raise OciImportError(f"{path} is neither a tar archive nor an OCI layout directory: {exc}") from None
        except BaseException:
            file.close()
            raise
        try:
            self._members: dict[str, tarfile.TarInfo] = {}
            count = 0
            while (m := self._tar.next()) is not None:
                count += 1
                if count > _MAX_ARCHIVE_MEMBERS:
                    raise OciImportError(f"{path} has more than {_MAX_ARCHIVE_MEMBERS} members; not an image archive")
                parts = [p for p in m.name.split("/") if p not in ("", ".")]
                if parts and ".." not in parts:
                    self._members["/".join(parts)] = m
        except _FORMAT_ERRORS as exc:
            self.close()
            raise OciImportError(f"{path}: unreadable tar archive: {exc}") from None
        except BaseException:
            self.close()
            raise

    def has(self, path: str) -> bool:
        m = self._members.get(_archive_path(path))
        return m is not None and (m.isreg() or m.issym() or m.islnk())

    def open(self, path: str) -> IO[bytes]:
        member = self._members.get(_archive_path(path))
        f = None
        if member is not None:
            # A link member resolves by name within this tar (tarfile never looks at the host).
            try:
                f = self._tar.extractfile(member)
            except KeyError:  # a symlink or hard link member whose target is missing
                pass
            except RecursionError:  # link members that point at each other
                raise OciImportError(f"{path} in {self.path} is a loop of links") from None
        if f is None:
            raise OciImportError(f"{path} is missing from {self.path}")
        return f

    def close(self) -> None:
        try:
            self._tar.close()
        finally:
            self._file.close()


def _open_source(path: Path, within: Sequence[Path] | None) -> _Source:
    """Open the archive once; everything after reads through that fd, not the path.

    The last component must not be a symlink, and with ``within`` the file opened must lie in
    one of those directories: checked on the open fd, so a path swapped after the caller's own
    check of it can't redirect the import.
    """
    try:
        pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        raise OciImportError(f"{path}: no such file or directory") from None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENAMETOOLONG):
            raise
        raise OciImportError(f"{path}: {exc.strerror}") from None
    try:
        # Where first, then what: a caller must not learn the type of a file outside `within`.
        if within is not None:
            real = os.readlink(f"/proc/self/fd/{pfd}")
            roots = [os.path.realpath(r) for r in within]
            if not any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots):
                raise OciImportError(f"{path} (opened as {real}) is not under any of {', '.join(roots)}")
        st = os.fstat(pfd)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise OciImportError(
                f"{path} is {_kind(st)}; an image is a tar archive (a regular file) or an OCI layout directory"
            )
        if stat.S_ISDIR(st.st_mode):
            src: _Source = _DirSource(pfd, path)
            pfd = -1  # the source owns it now
            return src
        return _TarSource(os.fdopen(_reopen(pfd), "rb"), path)
    finally:
        if pfd >= 0:
            os.close(pfd)
