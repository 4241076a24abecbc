"""Unpacking one untrusted layer tar into a staging tree in overlayfs form, through directory fds only."""

from __future__ import annotations

import errno
import gzip
import io
import logging
import os
import shutil
import stat
import tarfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import fsutil
from .oci_archive import _DIR_FD_CACHE, _DIR_FLAGS, _FORMAT_ERRORS, _BoundedTarInfo
from .oci_decompress import _decompressed, _Digesting, _drain
from .oci_errors import _CHUNK, MAX_PATH_DEPTH, OciImportError

if TYPE_CHECKING:
    from .oci_archive import _Source
    from .oci_manifest import _LayerBlob

log = logging.getLogger(__name__)

OPAQUE_XATTR = "trusted.overlay.opaque"
_WHITEOUT_PREFIX = ".wh."
_OPAQUE_MARKER = ".wh..wh..opq"
_AUFS_META_PREFIX = ".wh..wh."  # aufs bookkeeping (.wh..wh.plnk etc.); never image content
_OVERLAY_XATTR_PREFIX = "trusted.overlay."
_PAX_XATTR_PREFIX = "SCHILY.xattr."


@dataclass
class _Unpacked:
    digest: str  # sha256 of the blob as stored
    size: int  # bytes of uncompressed tar
    dir_times: dict[str, int]


@dataclass(frozen=True)
class _Caps:
    entries: int  # per layer
    layer_bytes: int  # uncompressed, per layer
    import_bytes: int  # uncompressed, all layers of the import


def _unpack_blob(
    src: _Source, blob: _LayerBlob, dest: Path, stop: threading.Event, caps: _Caps, imported: int
) -> _Unpacked:
    """Unpack one layer blob into the fresh staging dir ``dest``, verifying what the archive states.
    ``imported``: uncompressed bytes of the import's layers so far."""
    what = f"layer {blob.digest or blob.path}"
    if caps.import_bytes - imported < caps.layer_bytes:
        limit = max(caps.import_bytes - imported, 0)
        too_big = f"{what}: the image unpacks to more than {caps.import_bytes} bytes (max_import_bytes)"
    else:
        limit = caps.layer_bytes
        too_big = f"{what} unpacks to more than {caps.layer_bytes} bytes (max_layer_bytes)"
    with src.open(blob.path) as raw:
        stored = _Digesting(raw)
        buffered = io.BufferedReader(stored, _CHUNK)
        try:
            with _decompressed(buffered, what) as tar_stream:
                plain = _Digesting(tar_stream, limit, too_big)
                times = _LayerWriter(dest, what, stop, caps.entries).unpack(plain)
                _drain(plain, what)  # the tar's trailing padding counts towards its digest
            _drain(buffered, what)  # after the compressed stream's end
        except _FORMAT_ERRORS as exc:
            raise OciImportError(f"{what}: {exc}") from exc
    if blob.size is not None and stored.size != blob.size:
        raise OciImportError(f"{what} is {stored.size} bytes, expected {blob.size}: the archive is corrupt")
    if blob.digest is not None and stored.digest != blob.digest:
        raise OciImportError(f"{what} has digest {stored.digest}: the archive is corrupt")
    if blob.diff_id is not None and plain.digest != blob.diff_id:
        raise OciImportError(f"{what} unpacks to {plain.digest}, config says {blob.diff_id}: the archive is corrupt")
    return _Unpacked(stored.digest, plain.size, times)


def _lstat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return None


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _remove_at(dir_fd: int, name: str, st: os.stat_result) -> None:
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _set_opaque(fd: int) -> None:
    os.setxattr(fd, OPAQUE_XATTR, b"y")


def _is_opaque(fd: int) -> bool:
    try:
        return os.getxattr(fd, OPAQUE_XATTR) == b"y"
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP):
            return False
        raise


def _mtime_ns(member: tarfile.TarInfo) -> int:
    return int(member.mtime * 1_000_000_000)


def _entry_parts(name: str, what: str) -> tuple[str, ...]:
    if name.startswith("/"):
        raise OciImportError(f"{what}: absolute path {name!r}")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise OciImportError(f"{what}: path {name!r} leaves the layer ('..')")
    if len(parts) > MAX_PATH_DEPTH:  # deeper trees only serve to exhaust recursion and fds
        raise OciImportError(f"{what}: path {name[:200]!r}... is deeper than {MAX_PATH_DEPTH} directories")
    return parts


# errnos that writing an entry into the staging dir fails with because of the entry itself (a
# name too long for the filesystem, too many hard links to one file, an xattr too large, a path
# clash our checks did not foresee); any other (ENOSPC, EIO, EMFILE, EPERM...) is the host's.
_ENTRY_ERRNOS = frozenset(
    {
        errno.ENAMETOOLONG,
        errno.EMLINK,
        errno.E2BIG,
        errno.ERANGE,
        errno.EFBIG,
        errno.EINVAL,
        errno.EEXIST,
        errno.ENOTEMPTY,
        errno.ENOTDIR,
        errno.EISDIR,
        errno.ELOOP,
    }
)


def _entry_fault(exc: OSError) -> bool:
    """Whether an OSError while unpacking an entry is the layer's fault (else the host's)."""
    return isinstance(exc, gzip.BadGzipFile) or exc.errno in _ENTRY_ERRNOS


class _LayerWriter:
    """Unpacks one layer tar into an empty staging dir, in overlayfs form.

    Whiteouts only hide lower layers, never entries of their own layer (OCI image spec): a
    ``.wh.NAME`` next to a NAME of the same tar makes NAME, if it is a directory, opaque.
    """

    def __init__(self, root: Path, what: str, stop: threading.Event, max_entries: int) -> None:
        self.root = root
        self.what = what
        self.stop = stop
        self.max_entries = max_entries
        self.whited: set[tuple[str, ...]] = set()
        self.times: dict[str, int] = {}  # dir mtimes, applied once all children exist
        self.skipped: list[str] = []  # the first few, for the log
        self.n_skipped = 0
        # Open fds of recently used dirs: resolving each entry's parent component by component
        # (O_NOFOLLOW needs that) would otherwise cost most of the unpack time.
        self.fds: OrderedDict[tuple[str, ...], int] = OrderedDict()

    def unpack(self, stream: _Digesting) -> dict[str, int]:
        os.mkdir(self.root, 0o700)
        os.chmod(self.root, 0o755)  # not the daemon's umask: this becomes the image's / unless the tar says
        self.times[""] = time.time_ns()
        self.fds[()] = os.open(self.root, _DIR_FLAGS)
        try:
            with tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo) as tar:
                count = 0
                while (member := tar.next()) is not None:
                    # tarfile keeps every TarInfo it read (~0.5 KB each) in tar.members, which
                    # stream mode never needs back: without this a layer of 10M entries takes GBs.
                    tar.members.clear()  # type: ignore[attr-defined]  # (not in typeshed)
                    count += 1
                    if count > self.max_entries:
                        raise OciImportError(
                            f"{self.what} has more than {self.max_entries} entries (max_layer_entries)"
                        )
                    if self.stop.is_set():
                        raise OciImportError(f"{self.what}: import cancelled")
                    while len(self.fds) > _DIR_FD_CACHE:  # not inside _dir: its callers hold fds
                        self._evict_oldest()
                    try:
                        self._entry(tar, member)
                    except (ValueError, OverflowError) as exc:  # e.g. a NUL in a name, a huge mtime
                        raise OciImportError(f"{self.what}: cannot unpack {member.name!r}: {exc}") from exc
                    except OSError as exc:
                        if not _entry_fault(exc):
                            exc.add_note(f"while unpacking {member.name!r} of {self.what}")
                            raise
                        raise OciImportError(f"{self.what}: cannot unpack {member.name!r}: {exc}") from exc
        finally:
            self._forget_dirs(keep_root=False)
        if self.n_skipped:
            log.warning(
                "%s: skipped %d device node(s) or unknown entries: %s",
                self.what,
                self.n_skipped,
                ", ".join(self.skipped) + (" ..." if self.n_skipped > len(self.skipped) else ""),
            )
        return self.times

    def _entry(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = _entry_parts(m.name, self.what)
        if not 0 <= m.uid < fsutil.ID_RANGE or not 0 <= m.gid < fsutil.ID_RANGE:
            raise OciImportError(
                f"{self.what}: {m.name!r} is owned by {m.uid}:{m.gid}; sandboxes map only ids 0..{fsutil.ID_RANGE - 1}"
            )
        if not parts:
            if not m.isdir():
                raise OciImportError(f"{self.what}: the layer root {m.name!r} is not a directory")
            self._meta(self._dir((), create=True), m, replace_xattrs=True)
            self.times[""] = _mtime_ns(m)
            return
        base = parts[-1]
        if base == _OPAQUE_MARKER:
            _set_opaque(self._dir(parts[:-1], create=True))
        elif any(p.startswith(_AUFS_META_PREFIX) for p in parts):
            log.debug("%s: ignoring aufs metadata %s", self.what, m.name)
        elif base.startswith(_WHITEOUT_PREFIX):
            self._whiteout(parts[:-1], base.removeprefix(_WHITEOUT_PREFIX))
        elif m.ischr() or m.isblk() or not (m.isreg() or m.isdir() or m.issym() or m.islnk() or m.isfifo()):
            self.n_skipped += 1  # the sandbox's /dev is provided at run time
            if len(self.skipped) < 5:
                self.skipped.append(m.name)
        else:
            self._create(tar, m, self._dir(parts[:-1], create=True), parts)

    def _dir(self, parts: tuple[str, ...], *, create: bool) -> int:
        """An fd (cached: don't close it) of the staging dir at ``parts``, made as an implied dir if
        missing and ``create``. Never follows a symlink: one on the way means the entry would be
        written outside the layer, which is refused."""
        fd = self.fds.get(parts)
        if fd is not None:
            self.fds.move_to_end(parts)
            return fd
        # Tars list a dir's entries together, so the parent is usually cached; else walk from the root.
        start = len(parts) - 1 if parts[:-1] in self.fds else 0
        fd = self.fds[parts[:start]]
        owned = False
        try:
            for i in range(start, len(parts)):
                child = self._open_dir(fd, parts, i, create)
                if owned:
                    os.close(fd)
                fd, owned = child, True
        except BaseException:
            if owned:
                os.close(fd)
            raise
        self.fds[parts] = fd
        return fd

    def _open_dir(self, parent: int, parts: tuple[str, ...], i: int, create: bool) -> int:
        name = parts[i]
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise OciImportError(f"{self.what}: {'/'.join(parts[: i + 1])} does not exist") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            st = os.lstat(name, dir_fd=parent)
            if not (create and _is_whiteout(st)):
                kind = "symlink" if stat.S_ISLNK(st.st_mode) else "non-directory"
                raise OciImportError(
                    f"{self.what}: {'/'.join(parts[: i + 1])} is a {kind}; refusing to unpack through it"
                ) from None
            os.unlink(name, dir_fd=parent)  # this layer's own whiteout, now replaced by a dir
        return self._implied_dir(parent, name, parts[: i + 1])

    def _evict_oldest(self) -> None:
        parts = next(p for p in self.fds if p)  # the oldest but the root
        os.close(self.fds.pop(parts))

    def _forget_dirs(self, *, keep_root: bool = True) -> None:
        """Close the cached dir fds; needed whenever a dir is removed, as its fd would still work."""
        root = self.fds.pop((), None)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        if root is not None:
            if keep_root:  # the root is never removed
                self.fds[()] = root
            else:
                os.close(root)

    def _implied_dir(self, parent: int, name: str, parts: tuple[str, ...]) -> int:
        """A parent dir the tar has no entry for (or not yet): 0755 root, as docker makes them."""
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        try:
            os.fchmod(fd, 0o755)
            if parts in self.whited:
                _set_opaque(fd)
        except BaseException:
            os.close(fd)
            raise
        self.times["/".join(parts)] = time.time_ns()
        return fd

    def _whiteout(self, parent: tuple[str, ...], name: str) -> None:
        if name in ("", ".", ".."):
            raise OciImportError(f"{self.what}: bad whiteout name {_WHITEOUT_PREFIX + name!r}")
        fd = self._dir(parent, create=True)
        st = _lstat_at(fd, name)
        if st is None:
            os.mknod(name, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=fd)
        elif stat.S_ISDIR(st.st_mode):
            _set_opaque(self._dir((*parent, name), create=False))
        # else: an entry of this layer, which hides the lower one by itself
        self.whited.add((*parent, name))

    def _create(self, tar: tarfile.TarFile, m: tarfile.TarInfo, fd: int, parts: tuple[str, ...]) -> None:
        name = parts[-1]
        existing = _lstat_at(fd, name)
        if m.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                os.unlink(name, dir_fd=fd)
                existing = None
            if existing is None:
                os.mkdir(name, 0o700, dir_fd=fd)
            child = self._dir(parts, create=False)
            self._meta(child, m, replace_xattrs=existing is not None)
            if parts in self.whited:
                _set_opaque(child)
            self.times["/".join(parts)] = _mtime_ns(m)
            return
        if existing is not None:
            if stat.S_ISDIR(existing.st_mode):
                self._forget_dirs()
                fd = self._dir(parts[:-1], create=False)
            _remove_at(fd, name, existing)
        if m.isreg():
            data = tar.extractfile(m)
            out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
            with open(out, "wb") as f:
                if data is not None:
                    shutil.copyfileobj(data, f, _CHUNK)
                f.flush()
                self._meta(out, m)
                os.utime(out, ns=(_mtime_ns(m), _mtime_ns(m)))
        elif m.islnk():
            target = _entry_parts(m.linkname, self.what)
            if not target:
                raise OciImportError(f"{self.what}: hard link {m.name!r} to the layer root")
            tfd = self._dir(target[:-1], create=False)
            st = _lstat_at(tfd, target[-1])
            if st is None or stat.S_ISDIR(st.st_mode) or _is_whiteout(st):
                raise OciImportError(
                    f"{self.what}: hard link {m.name!r} -> {m.linkname!r}: the target is not a file of this layer"
                )
            os.link(target[-1], name, src_dir_fd=tfd, dst_dir_fd=fd, follow_symlinks=False)
        else:  # symlink or fifo: no fd to set metadata through, so by name (never following it)
            if m.issym():
                os.symlink(m.linkname, name, dir_fd=fd)
            else:
                os.mkfifo(name, 0o600, dir_fd=fd)
            os.chown(name, m.uid, m.gid, dir_fd=fd, follow_symlinks=False)
            if not m.issym():
                os.chmod(name, m.mode & 0o7777, dir_fd=fd)
            for key, value in _tar_xattrs(m).items():
                _try_setxattr(f"/proc/self/fd/{fd}/{name}", key, value, m.name)
            os.utime(name, ns=(_mtime_ns(m), _mtime_ns(m)), dir_fd=fd, follow_symlinks=False)

    def _meta(self, fd: int, m: tarfile.TarInfo, *, replace_xattrs: bool = False) -> None:
        os.fchown(fd, m.uid, m.gid)  # before chmod: chown clears setuid/setgid (and file caps)
        os.fchmod(fd, m.mode & 0o7777)
        xattrs = _tar_xattrs(m)
        if replace_xattrs:  # a later entry for the same dir: its xattrs win, the opaque marker stays
            for key in os.listxattr(fd):
                if key not in xattrs and key != OPAQUE_XATTR:
                    os.removexattr(fd, key)
        for key, value in xattrs.items():
            _try_setxattr(fd, key, value, m.name)


def _tar_xattrs(m: tarfile.TarInfo) -> dict[str, bytes]:
    """An entry's xattrs (pax ``SCHILY.xattr.*``), minus overlayfs' own: a layer must not smuggle in
    opaque, redirect or metacopy markers; those come only from whiteout entries."""
    return {
        key.removeprefix(_PAX_XATTR_PREFIX): value.encode("utf-8", "surrogateescape")
        for key, value in m.pax_headers.items()
        if key.startswith(_PAX_XATTR_PREFIX)
        and not key.removeprefix(_PAX_XATTR_PREFIX).startswith(_OVERLAY_XATTR_PREFIX)
    }


def _try_setxattr(target: int | str, key: str, value: bytes, entry: str) -> None:
    try:
        if isinstance(target, int):
            os.setxattr(target, key, value)
        else:
            os.setxattr(target, key, value, follow_symlinks=False)
    except OSError as exc:
        # e.g. user.* on a symlink, or a capability the kernel rejects: the file is still usable
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EINVAL):
            raise
        log.warning("%s: xattr %s not kept: %s", entry, key, exc)


__all__ = ["OPAQUE_XATTR"]
