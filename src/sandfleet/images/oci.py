"""Import container images: ``docker save`` tarballs, OCI image layouts and ``oci-archive`` tars.

Every OCI layer tar is unpacked into a staging tree in overlayfs form (whiteouts become 0/0
character devices, opaque directories get ``trusted.overlay.opaque``) and packed into an EROFS
layer of the store. An imported image then runs exactly like a built-in one: an overlay of
read-only layers, with no tar handling at sandbox start.

Runs of small layers are merged into one EROFS layer (fewer overlay lower dirs, fewer mounts and
lookups per path); the merge keeps whiteouts and opaque markers, since they may hide content of
the layers below the merged run. An image of more layers than the daemon can stack (32) also has
its topmost layers merged into one.

Layer tars are untrusted: entry paths must be relative without ``..``, the staging tree is only
ever touched through directory fds opened with ``O_NOFOLLOW``, and an entry that would be written
through a symlink is rejected, so nothing outside the staging dir can be reached. Entry count,
uncompressed bytes (per layer and per import), tar header sizes and trailing data are capped, so
a hostile layer can't exhaust the daemon's memory or disk.

The archive itself is read through one fd opened without following a symlink and checked to be a
regular file or directory (a FIFO would block the daemon's threads); inside a directory, every
member is opened beneath that fd, component by component, never through a symlink, so an archive
can't make the daemon read host files.

Errors: OciImportError for what is wrong with the archive (format, digests, paths, caps); an
OSError of the host (ENOSPC, EIO, EMFILE...) propagates as it is, since it is not the caller's fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import hashlib
import importlib
import io
import json
import logging
import os
import platform
import shutil
import stat
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, ParamSpec, Protocol, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from sandfleet.models import check_abs_path, check_env, check_user

from . import fsutil
from .models import DIGEST_RE, ImageError, ImageManifest, InvalidRefError, LayerRef, parse_ref
from .store import BuildContext, LayerStore, ProgressFn

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

log = logging.getLogger(__name__)

OPAQUE_XATTR = "trusted.overlay.opaque"
_WHITEOUT_PREFIX = ".wh."
_OPAQUE_MARKER = ".wh..wh..opq"
_AUFS_META_PREFIX = ".wh..wh."  # aufs bookkeeping (.wh..wh.plnk etc.); never image content
_OVERLAY_XATTR_PREFIX = "trusted.overlay."
_PAX_XATTR_PREFIX = "SCHILY.xattr."
_REF_NAME = "org.opencontainers.image.ref.name"
_CONTAINERD_NAME = "io.containerd.image.name"
_CHUNK = 1 << 20
_MAX_JSON = 16 << 20  # manifests and configs are small; don't read a huge "manifest" into memory
_MAX_INDEX_DEPTH = 4
_DIR_FD_CACHE = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# Caps on what one import may unpack; import_image takes overrides. Entries: each costs inodes and
# bookkeeping (dir mtimes, whiteouts) while its layer unpacks. Bytes: of uncompressed tar, which
# is what lands in the staging dir (a small gzip can expand a thousandfold).
MAX_PATH_DEPTH = 256
MAX_ENTRIES_PER_LAYER = 2_000_000
MAX_LAYER_BYTES = 64 << 30
MAX_IMPORT_BYTES = 256 << 30
# The daemon runs environments of at most 32 layers (service.MAX_LAYERS: one overlay's mount
# options must fit a page), so an import merges layers down to this many.
MAX_LAYERS = 32
# After a layer tar's end-of-archive marker only padding follows (tools pad to a 10 KiB record);
# more than this is junk, and draining it unbounded would let a blob stream on forever.
_MAX_TRAILING = 1 << 20
# A pax or GNU long-name header is read into memory whole: real ones hold a path or some xattrs.
_MAX_TAR_HEADER = 8 << 20
# Extension headers preceding one entry (pax, GNU long name and link): tarfile recurses per
# header, holding each in memory; real tars use at most three.
_MAX_TAR_HEADER_CHAIN = 8
# Global pax headers accumulate for the rest of the archive and are copied into every entry.
_MAX_GLOBAL_PAX = 1 << 20
# Members of the archive (docker save / oci-archive) itself: a few per layer in real ones.
_MAX_ARCHIVE_MEMBERS = 100_000
# While an import runs, its finished layers are named by no manifest yet: refreshing their
# mtime this often keeps LayerStore.gc's min_age (600 s by default) from deleting them.
_LAYER_REFRESH_SECONDS = 60.0

_INDEX_TYPES = frozenset(
    {"application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json"}
)
_MANIFEST_TYPES = frozenset(
    {"application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"}
)
_CONFIG_TYPES = frozenset(
    {"application/vnd.oci.image.config.v1+json", "application/vnd.docker.container.image.v1+json"}
)
# The compression is sniffed from the blob itself; the media type only has to name a tar layer.
_LAYER_TYPES = frozenset(
    {
        "application/vnd.oci.image.layer.v1.tar",
        "application/vnd.oci.image.layer.v1.tar+gzip",
        "application/vnd.oci.image.layer.v1.tar+zstd",
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
        "application/vnd.docker.image.rootfs.diff.tar",
        "application/vnd.docker.image.rootfs.diff.tar.gzip",
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)
# platform.machine() -> GOARCH, the spelling of OCI platform objects.
_GOARCH = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}

_T = TypeVar("_T")
_P = ParamSpec("_P")
_M = TypeVar("_M", bound=BaseModel)


class OciImportError(ImageError):
    """The archive can't be imported: unreadable, inconsistent, unsupported or unsafe."""


class OciRefError(OciImportError, InvalidRefError):
    """No usable ``name:tag`` for the imported image: the caller has to pass one."""


class _Reader(Protocol):
    def read(self, size: int, /) -> bytes: ...


# --------------------------------------------------------------------------- tar headers

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


# --------------------------------------------------------------------------- archive metadata


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class _Platform(_Model):
    os: str = ""
    architecture: str = ""


class _Descriptor(_Model):
    media_type: str = Field("", alias="mediaType")
    digest: str
    size: int = Field(ge=0)
    annotations: dict[str, str] = Field(default_factory=dict)
    platform: _Platform | None = None


class _Index(_Model):
    manifests: list[_Descriptor]


class _Manifest(_Model):
    config: _Descriptor
    layers: list[_Descriptor]


class _DockerEntry(_Model):
    config: str = Field(alias="Config")
    repo_tags: list[str] | None = Field(None, alias="RepoTags")
    layers: list[str] = Field(alias="Layers")


class _DockerManifest(RootModel[list[_DockerEntry]]):
    pass


class _Layout(_Model):
    image_layout_version: str = Field(alias="imageLayoutVersion")


class _RootFS(_Model):
    diff_ids: list[str] = Field(default_factory=list)


class _RunConfig(_Model):
    env: list[str] | None = Field(None, alias="Env")
    working_dir: str | None = Field(None, alias="WorkingDir")
    user: str | None = Field(None, alias="User")


class _ImageConfig(_Model):
    config: _RunConfig | None = None
    rootfs: _RootFS | None = None


def _parse(model: type[_M], data: bytes, what: str) -> _M:
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top level)'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise OciImportError(f"{what} is malformed: {problems}") from None


@dataclass(frozen=True)
class _LayerBlob:
    """One layer as the archive states it; digests are None where the archive gives none."""

    path: str
    digest: str | None  # sha256 of the blob as stored (maybe compressed)
    size: int | None
    diff_id: str | None  # sha256 of the uncompressed tar (the config's rootfs.diff_ids)


@dataclass(frozen=True)
class _Plan:
    config: _ImageConfig
    config_digest: str
    layers: list[_LayerBlob]


@dataclass(frozen=True)
class _Candidate:
    """An image of the archive; loading its manifest and config is deferred to the chosen one."""

    labels: tuple[str, ...]  # names as the archive spells them, for messages
    refs: tuple[str, ...]  # the same, normalised to name:tag (unusable ones dropped)
    bare_tags: tuple[str, ...]  # OCI ref.name annotations that are only a tag, no repository
    load: Callable[[], _Plan]


# --------------------------------------------------------------------------- refs


def normalise_ref(ref: str) -> str:
    """An archive's image name in our grammar: ``docker.io/library/python:3.11`` -> ``library/python:3.11``.

    The registry host (a first component with a dot or port, or ``localhost``) and any
    ``@digest`` are dropped and the name is lowercased. Raises InvalidRefError if the rest is
    still not a valid ``name[:tag]``.
    """
    name = ref.strip().split("@", 1)[0]
    host, sep, rest = name.partition("/")
    if sep and ("." in host or ":" in host or host == "localhost"):
        name = rest
    repo, colon, tag = name.rpartition(":")
    if not colon or "/" in tag:
        repo, tag = name, ""
    name, tag = parse_ref(f"{repo.lower()}:{tag}" if tag else repo.lower())
    return f"{name}:{tag}"


def _usable_ref(name: str) -> str | None:
    try:
        return normalise_ref(name)
    except InvalidRefError:
        return None


def _select(candidates: list[_Candidate], ref: str | None, source: Path) -> tuple[_Candidate, str]:
    """Pick the image to import and the ``name:tag`` to store it under."""
    if not candidates:
        raise OciImportError(f"{source} holds no image (for linux/{_host_arch()})")

    def listing() -> str:
        return ", ".join(" / ".join(c.labels) or "(unnamed)" for c in candidates)

    if ref is not None:
        want = normalise_ref(ref)
        if len(candidates) == 1:
            return candidates[0], want
        hits = [c for c in candidates if want in c.refs]
        if not hits:
            tag = want.rpartition(":")[2]
            hits = [c for c in candidates if tag in c.bare_tags]
        if len(hits) == 1:
            return hits[0], want
        how = "no image" if not hits else f"{len(hits)} images"
        raise OciRefError(f"{how} in {source} match {want!r}; it holds: {listing()}")
    if len(candidates) > 1:
        raise OciRefError(f"{source} holds {len(candidates)} images ({listing()}); pass a ref to choose one")
    (only,) = candidates
    if not only.refs:
        raise OciRefError(f"the image in {source} has no usable name ({listing()}); pass a ref such as 'myimage:1.0'")
    return only, only.refs[0]


# --------------------------------------------------------------------------- sources


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


# --------------------------------------------------------------------------- manifests


def _read_json(src: _Source, path: str, digest: str | None, size: int | None, what: str) -> tuple[bytes, str]:
    """Read a small JSON file, verifying its digest and size where the archive states them."""
    with src.open(path) as f:
        data = f.read(_MAX_JSON + 1)
    if len(data) > _MAX_JSON:
        raise OciImportError(f"{what} ({path}) is larger than {_MAX_JSON} bytes")
    actual = "sha256:" + hashlib.sha256(data).hexdigest()
    if digest is not None and actual != digest:
        raise OciImportError(f"{what} ({path}) has digest {actual}, expected {digest}: the archive is corrupt")
    if size is not None and len(data) != size:
        raise OciImportError(f"{what} ({path}) is {len(data)} bytes, expected {size}: the archive is corrupt")
    return data, actual


def _blob_path(digest: str) -> str:
    if DIGEST_RE.match(digest):
        return "blobs/sha256/" + digest.removeprefix("sha256:")
    algorithm, sep, _ = digest.partition(":")
    if sep and algorithm != "sha256":
        raise OciImportError(f"unsupported digest algorithm {algorithm!r} in {digest!r} (only sha256)")
    raise OciImportError(f"malformed digest {digest!r}")


def _read_blob(src: _Source, desc: _Descriptor, what: str) -> bytes:
    return _read_json(src, _blob_path(desc.digest), desc.digest, desc.size, f"{what} {desc.digest}")[0]


def _name_digest(path: str) -> str | None:
    """The digest a docker-save member name states: Docker >= 25 stores ``blobs/sha256/<hex>``,
    older Docker and podman name the config ``<hex>.json`` (the image id is its digest)."""
    if path.startswith("blobs/sha256/"):
        digest = "sha256:" + path.removeprefix("blobs/sha256/")
    elif "/" not in path and path.endswith(".json"):
        digest = "sha256:" + path.removesuffix(".json")
    else:
        return None
    return digest if DIGEST_RE.match(digest) else None


def _diff_ids(config: _ImageConfig, n_layers: int, what: str) -> list[str | None]:
    ids = config.rootfs.diff_ids if config.rootfs is not None else []
    if not ids:
        return [None] * n_layers
    if len(ids) != n_layers:
        raise OciImportError(f"{what} lists {len(ids)} diff_ids for {n_layers} layers")
    return list(ids)


def _docker_plan(src: _Source, entry: _DockerEntry) -> _Plan:
    cfg_path = _archive_path(entry.config)
    raw, cfg_digest = _read_json(src, cfg_path, _name_digest(cfg_path), None, "image config")
    config = _parse(_ImageConfig, raw, f"image config {cfg_path}")
    diff_ids = _diff_ids(config, len(entry.layers), f"image config {cfg_path}")
    layers = []
    for path, diff_id in zip(entry.layers, diff_ids, strict=True):
        path = _archive_path(path)
        layers.append(_LayerBlob(path, _name_digest(path), None, diff_id))
    return _Plan(config, cfg_digest, layers)


def _docker_candidates(src: _Source) -> list[_Candidate]:
    raw, _ = _read_json(src, "manifest.json", None, None, "manifest.json")
    out = []
    for entry in _parse(_DockerManifest, raw, "manifest.json").root:
        labels = tuple(entry.repo_tags or ())
        refs = tuple(r for r in map(_usable_ref, labels) if r is not None)
        out.append(_Candidate(labels, refs, (), partial(_docker_plan, src, entry)))
    return out


def _host_arch() -> str:
    machine = platform.machine()
    return _GOARCH.get(machine, machine)


def _runs_here(desc: _Descriptor) -> bool:
    p = desc.platform
    return p is None or (p.os == "linux" and p.architecture == _host_arch())


def _oci_plan(src: _Source, desc: _Descriptor) -> _Plan:
    for _ in range(_MAX_INDEX_DEPTH):
        if desc.media_type in _MANIFEST_TYPES:
            break
        if desc.media_type not in _INDEX_TYPES:
            raise OciImportError(f"unsupported media type {desc.media_type!r} for image {desc.digest}")
        index = _parse(_Index, _read_blob(src, desc, "image index"), f"image index {desc.digest}")
        fits = [m for m in index.manifests if _runs_here(m)]
        if not fits:
            have = sorted({f"{m.platform.os}/{m.platform.architecture}" for m in index.manifests if m.platform})
            raise OciImportError(f"image index {desc.digest} has no linux/{_host_arch()} image (has: {have})")
        desc = fits[0]
    else:
        raise OciImportError(f"image indexes nested deeper than {_MAX_INDEX_DEPTH} levels")
    manifest = _parse(_Manifest, _read_blob(src, desc, "image manifest"), f"image manifest {desc.digest}")
    if manifest.config.media_type not in _CONFIG_TYPES:
        raise OciImportError(f"unsupported config media type {manifest.config.media_type!r} (not a container image)")
    raw = _read_blob(src, manifest.config, "image config")
    config = _parse(_ImageConfig, raw, f"image config {manifest.config.digest}")
    for layer in manifest.layers:
        if layer.media_type not in _LAYER_TYPES:
            raise OciImportError(f"unsupported layer media type {layer.media_type!r} for layer {layer.digest}")
    diff_ids = _diff_ids(config, len(manifest.layers), f"image config {manifest.config.digest}")
    layers = [
        _LayerBlob(_blob_path(d.digest), d.digest, d.size, diff_id)
        for d, diff_id in zip(manifest.layers, diff_ids, strict=True)
    ]
    return _Plan(config, manifest.config.digest, layers)


def _oci_candidates(src: _Source) -> list[_Candidate]:
    raw, _ = _read_json(src, "oci-layout", None, None, "oci-layout")
    version = _parse(_Layout, raw, "oci-layout").image_layout_version
    if not version.startswith("1."):
        raise OciImportError(f"unsupported OCI layout version {version!r}")
    raw, _ = _read_json(src, "index.json", None, None, "index.json")
    out = []
    for desc in _parse(_Index, raw, "index.json").manifests:
        if not _runs_here(desc):
            continue
        labels: list[str] = []
        bare: list[str] = []
        for key in (_CONTAINERD_NAME, _REF_NAME):
            name = desc.annotations.get(key)
            if name is None or name in labels:
                continue
            # The OCI spec suggests a bare tag for ref.name; podman and others store a full name.
            (labels if ":" in name or "/" in name else bare).append(name)
        refs = tuple(r for r in map(_usable_ref, labels) if r is not None)
        out.append(_Candidate(tuple(labels + bare), refs, tuple(bare), partial(_oci_plan, src, desc)))
    return out


def _candidates(src: _Source, source: Path) -> list[_Candidate]:
    # `docker save` of Docker >= 25 writes both formats; manifest.json has the full RepoTags.
    if src.has("manifest.json"):
        return _docker_candidates(src)
    if src.has("oci-layout"):
        return _oci_candidates(src)
    raise OciImportError(f"{source} is neither a docker save archive (manifest.json) nor an OCI layout (oci-layout)")


# --------------------------------------------------------------------------- layer blobs


class _Digesting(io.RawIOBase):
    """Passes a stream through, hashing (sha256) and counting what is read; with a ``limit``,
    raises OciImportError(``too_big``) as soon as more than that many bytes come through."""

    def __init__(self, src: _Reader, limit: int | None = None, too_big: str = "") -> None:
        super().__init__()
        self._src = src
        self._sha = hashlib.sha256()
        self.size = 0
        self._limit = limit
        self._too_big = too_big

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        want = len(view)
        if self._limit is not None:
            want = min(want, self._limit - self.size + 1)  # one byte past the limit tells it is exceeded
        data = self._src.read(want)
        if self._limit is not None and self.size + len(data) > self._limit:
            raise OciImportError(self._too_big)
        view[: len(data)] = data
        self._sha.update(data)
        self.size += len(data)
        return len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self._sha.hexdigest()


def _drain(stream: _Reader, what: str) -> None:
    """Read what follows the tar's end: it counts towards the digests, but only padding belongs there."""
    left = _MAX_TRAILING
    while data := stream.read(min(_CHUNK, left + 1)):
        left -= len(data)
        if left < 0:
            raise OciImportError(f"{what}: more than {_MAX_TRAILING} bytes of data after the end of the tar archive")


@contextlib.contextmanager
def _zstd_tool(exe: str, stream: _Reader) -> Iterator[_Reader]:
    """Decompress through the zstd tool; a thread feeds it, since the blob may be a tar member, not a file."""
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([exe, "-d", "-c", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
        stdin, stdout = cast(IO[bytes], proc.stdin), cast(IO[bytes], proc.stdout)
        failed: list[BaseException] = []

        def feed() -> None:
            try:
                while chunk := stream.read(_CHUNK):
                    stdin.write(chunk)
            except BrokenPipeError:
                pass  # zstd exited (bad input, or killed below); its exit status tells
            except BaseException as exc:
                failed.append(exc)
            finally:
                with contextlib.suppress(BrokenPipeError):
                    stdin.close()

        feeder = threading.Thread(target=feed, name="zstd-feed", daemon=True)
        feeder.start()
        done = False
        try:
            yield stdout
            done = True
        finally:
            if not done:
                proc.kill()
            stdout.close()
            feeder.join()
            status = proc.wait()
        if failed:
            raise failed[0]
        if status != 0:
            errors.seek(0)
            detail = errors.read().decode(errors="replace").strip()
            raise OciImportError(f"zstd failed (exit {status}): {detail}")


@contextlib.contextmanager
def _zstd(stream: _Reader, what: str) -> Iterator[_Reader]:
    try:
        zstandard = importlib.import_module("zstandard")
    except ImportError:
        exe = shutil.which("zstd")
        if exe is None:
            raise OciImportError(
                f"{what} is zstd-compressed: install the zstandard Python module or the zstd tool"
            ) from None
        with _zstd_tool(exe, stream) as out:
            yield out
        return
    with zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True, closefd=False) as reader:
        try:
            yield cast(_Reader, reader)
        except zstandard.ZstdError as exc:  # a corrupt blob: the archive's fault, like a gzip error
            raise OciImportError(f"{what}: {exc}") from exc


@contextlib.contextmanager
def _decompressed(stream: io.BufferedReader[_Digesting], what: str) -> Iterator[_Reader]:
    """The uncompressed tar stream of a layer blob, by its magic bytes (docker save names no media type)."""
    magic = stream.peek(6)[:6]
    if magic.startswith(b"\x1f\x8b"):
        with gzip.GzipFile(fileobj=stream, mode="rb") as gz:
            yield gz
    elif magic.startswith(_ZSTD_MAGIC):
        with _zstd(stream, what) as out:
            yield out
    elif magic.startswith((b"BZh", b"\xfd7zXZ\x00")):
        raise OciImportError(f"{what} is bzip2- or xz-compressed, which is not supported (gzip, zstd or plain tar)")
    else:
        yield stream


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


# --------------------------------------------------------------------------- staging trees


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


def _sandbox_defaults(run: _RunConfig) -> tuple[dict[str, str], str | None, str | None]:
    """The config's Env, WorkingDir and User as sandbox defaults: only values a SandboxSpec would
    accept (the daemon validates them again at create); others are dropped with a warning, since
    a caller cannot unset an image's env key from the spec."""
    env: dict[str, str] = {}
    for item in run.env or []:
        key, _, value = item.partition("=")
        try:
            env.update(check_env({key: value}))
        except ValueError as exc:
            log.warning("image config: dropping Env entry: %s", exc)
    workdir = run.working_dir or None
    if workdir is not None:
        try:
            check_abs_path(workdir)
        except ValueError as exc:
            log.warning("image config: dropping WorkingDir: %s", exc)
            workdir = None
    user = run.user or None
    if user is not None:
        try:
            check_user(user.split(":", 1)[0])
        except ValueError:
            log.warning("image config: dropping User %r: not a user name or uid a sandbox accepts", user)
            user = None
    return env, workdir, user


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


def _merge_into(upper: Path, lower: Path) -> None:
    """Stack the staged layer ``upper`` onto the staged layer ``lower``, in place in ``lower``.

    The result is one layer equivalent to the two: upper's entries replace lower's (moved by
    rename, so hard links survive); a whiteout replaces the lower entry and stays, as it may hide
    something beneath both; an opaque upper dir empties the lower one and stays opaque; an upper
    dir replacing a lower non-dir or whiteout becomes opaque, since what it replaced hid whatever
    lies below at that path. Dirs present in both merge; upper's metadata wins.
    """
    ufd = os.open(upper, _DIR_FLAGS)
    try:
        lfd = os.open(lower, _DIR_FLAGS)
        try:
            _merge_dir(ufd, lfd)
        finally:
            os.close(lfd)
    finally:
        os.close(ufd)
    fsutil.rmtree(upper)  # only the shells of merged dirs are left


def _merge_dir(ufd: int, lfd: int) -> None:
    if _is_opaque(ufd):
        for name in os.listdir(lfd):
            _remove_at(lfd, name, os.lstat(name, dir_fd=lfd))
    st = os.fstat(ufd)
    os.fchown(lfd, st.st_uid, st.st_gid)
    os.fchmod(lfd, stat.S_IMODE(st.st_mode))
    keys = os.listxattr(ufd)
    for key in os.listxattr(lfd):
        if key not in keys and key != OPAQUE_XATTR:  # lower's opaque marker still hides what is below
            os.removexattr(lfd, key)
    for key in keys:
        os.setxattr(lfd, key, os.getxattr(ufd, key))
    for name in os.listdir(ufd):
        ust = os.lstat(name, dir_fd=ufd)
        lst = _lstat_at(lfd, name)
        if stat.S_ISDIR(ust.st_mode) and lst is not None and stat.S_ISDIR(lst.st_mode):
            usub = os.open(name, _DIR_FLAGS, dir_fd=ufd)
            try:
                lsub = os.open(name, _DIR_FLAGS, dir_fd=lfd)
                try:
                    _merge_dir(usub, lsub)
                finally:
                    os.close(lsub)
            finally:
                os.close(usub)
            continue
        if lst is not None:
            _remove_at(lfd, name, lst)
        os.rename(name, name, src_dir_fd=ufd, dst_dir_fd=lfd)
        if stat.S_ISDIR(ust.st_mode) and lst is not None:
            moved = os.open(name, _DIR_FLAGS, dir_fd=lfd)
            try:
                _set_opaque(moved)
            finally:
                os.close(moved)


def _walk_dirs(root: Path) -> Iterator[tuple[str, int]]:
    """Yield (relative path, fd) of ``root`` and every dir below it, parents first. Unlike os.fwalk,
    never stats or opens a symlink's target (staged symlinks may point anywhere on the host)."""
    fds, rels = [os.open(root, _DIR_FLAGS)], [""]
    try:
        yield "", fds[0]
        pending = [_subdirs(fds[0])]
        while pending:
            if not pending[-1]:
                pending.pop()
                rels.pop()
                os.close(fds.pop())
                continue
            name = pending[-1].pop()
            fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
            rels.append(f"{rels[-1]}/{name}" if rels[-1] else name)
            yield rels[-1], fds[-1]
            pending.append(_subdirs(fds[-1]))
    finally:
        for fd in fds:
            os.close(fd)


def _subdirs(fd: int) -> list[str]:
    with os.scandir(fd) as entries:
        return [e.name for e in entries if e.is_dir(follow_symlinks=False)]


def _strip_overlay_markers(root: Path) -> None:
    """Drop whiteouts and opaque markers from the bottom layer: there is nothing below it to hide,
    and mounted on its own (``builders.mounted_layers`` of a one-layer image) its whiteouts
    would show up as character devices."""
    for _rel, fd in _walk_dirs(root):
        if _is_opaque(fd):
            os.removexattr(fd, OPAQUE_XATTR)
        with os.scandir(fd) as entries:
            whiteouts = [e.name for e in entries if _is_whiteout(e.stat(follow_symlinks=False))]
        for name in whiteouts:
            os.unlink(name, dir_fd=fd)


def _restore_dir_times(root: Path, times: dict[str, int]) -> None:
    """Set dir mtimes (from the topmost layer that has each dir) now that nothing is added below them."""
    for rel, fd in _walk_dirs(root):
        t = times.get(rel)
        if t is not None:
            os.utime(fd, ns=(t, t))


# --------------------------------------------------------------------------- import


@dataclass
class _Group:
    """Consecutive layers staged into one tree, to become one EROFS layer."""

    path: Path
    dir_times: dict[str, int]
    digests: list[str] = field(default_factory=list)


async def _blocking(stop: threading.Event, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """Run ``fn`` in a thread. If cancelled, tell it to stop and wait for it: threads can't be
    interrupted, and the staging dir must not be removed under a running unpack."""
    task = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        stop.set()
        await asyncio.gather(task, return_exceptions=True)
        raise


async def _open_cancellable(source: Path, within: Sequence[Path] | None) -> _Source:
    """`_open_source` in a thread; cancelled meanwhile, the source it opened anyway is closed."""
    task = asyncio.ensure_future(asyncio.to_thread(_open_source, source, within))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            (await task).close()
        raise


def _touch_layer(store: LayerStore, digest: str) -> None:
    # A use stamp (never the layer file itself, whose ctime its verification keys on): gc's
    # min_age leaves the layer alone for that long.
    store.touch(store.layer_path(digest))


async def _pack(store: LayerStore, group: _Group, index: int) -> LayerRef:
    if index == 0:
        await asyncio.to_thread(_strip_overlay_markers, group.path)
    await asyncio.to_thread(_restore_dir_times, group.path, group.dir_times)
    what = "OCI layer" if len(group.digests) == 1 else f"{len(group.digests)} merged OCI layers"
    ref = await store.add_layer_from_dir(
        group.path, f"{what} {', '.join(group.digests)}", kind="base" if index == 0 else "layer"
    )
    # No manifest names the layer until the import ends, and if an identical layer was stored
    # already, add_layer_from_dir kept that file with its old mtime: without this a concurrent
    # gc could delete it at once.
    await asyncio.to_thread(_touch_layer, store, ref.digest)
    await asyncio.to_thread(fsutil.rmtree, group.path)
    return ref


async def _keep_fresh(store: LayerStore, refs: list[LayerRef]) -> None:
    """Refresh the mtimes of the import's finished layers until cancelled (once the manifest
    names them): a long import (one big layer can take many minutes) would otherwise outlast
    gc's min_age for its first layers."""

    def touch_all(digests: list[str]) -> None:
        for digest in digests:
            try:
                _touch_layer(store, digest)
            except (OSError, ImageError) as exc:  # put_manifest checks the layers exist
                log.warning("cannot refresh layer %s: %s", digest, exc)

    while True:
        await asyncio.sleep(_LAYER_REFRESH_SECONDS)
        await asyncio.to_thread(touch_all, [r.digest for r in refs])


async def _import_layers(
    store: LayerStore,
    src: _Source,
    plan: _Plan,
    work: Path,
    *,
    merge_below: int,
    max_layers: int,
    caps: _Caps,
    ctx: BuildContext,
    stop: threading.Event,
    refs: list[LayerRef],
) -> list[str]:
    """Unpack the layers bottom -> top into ``refs``, merging runs of small ones; the mkfs of one
    group overlaps the unpacking of the next (mkfs.erofs is another process, so it gets the other
    core). Returns the digests of the OCI layers.

    At most ``max_layers`` groups: once the last one is open, every remaining layer goes into it.
    That merges the top layers, which are typically the small, image-specific ones, and needs no
    look-ahead, so a layer's mkfs still starts as soon as its group is complete.
    """
    digests: list[str] = []
    group: _Group | None = None
    packing: asyncio.Task[LayerRef] | None = None
    flushed = 0  # groups handed to packing
    imported = 0  # uncompressed bytes so far

    async def flush(g: _Group) -> None:
        nonlocal packing, flushed
        if packing is not None:
            refs.append(await asyncio.shield(packing))  # if cancelled: the finally below lets it finish
        packing = asyncio.create_task(_pack(store, g, len(refs)))
        flushed += 1

    n = len(plan.layers)
    try:
        for i, blob in enumerate(plan.layers):
            ctx.report(f"layer {i + 1}/{n}: unpacking {blob.digest or blob.path}", 0.05 + 0.9 * i / n)
            dest = work / f"layer-{i}"
            unpacked = await _blocking(stop, _unpack_blob, src, blob, dest, stop, caps, imported)
            imported += unpacked.size
            digests.append(unpacked.digest)
            small = unpacked.size < merge_below
            no_room = flushed + (group is not None) >= max_layers  # no new group may start
            if group is not None and (small or no_room):
                await _blocking(stop, _merge_into, dest, group.path)
                group.dir_times.update(unpacked.dir_times)
                group.digests.append(unpacked.digest)
                continue
            if group is not None:
                await flush(group)
            group = _Group(dest, unpacked.dir_times, [unpacked.digest])
            if not small and flushed + 1 < max_layers:  # else it stays open: the rest go into it
                await flush(group)
                group = None
        if group is not None:
            await flush(group)
        if packing is not None:
            refs.append(await asyncio.shield(packing))
            packing = None
    finally:
        if packing is not None:  # failed or cancelled while a group was packing: let it finish first
            await asyncio.gather(packing, return_exceptions=True)
    return digests


async def import_image(
    store: LayerStore,
    source: Path,
    ref: str | None = None,
    *,
    merge_below: int = 16 * 2**20,
    max_layers: int = MAX_LAYERS,
    max_layer_entries: int = MAX_ENTRIES_PER_LAYER,
    max_layer_bytes: int = MAX_LAYER_BYTES,
    max_import_bytes: int = MAX_IMPORT_BYTES,
    within: Sequence[Path] | None = None,
    progress: ProgressFn | None = None,
) -> ImageManifest:
    """Import an image from a ``docker save`` tar, an OCI layout dir or an ``oci-archive`` tar.

    ``ref`` names the stored image and, if the archive holds several, selects one of them (by
    RepoTags or ref-name annotation); without it the archive's own name is used, normalised
    (see ``normalise_ref``). An existing image of that name is replaced. Consecutive layers of
    less than ``merge_below`` uncompressed bytes become one EROFS layer (0: never merge), and
    the topmost layers are merged further if needed to make at most ``max_layers``.

    A layer may have at most ``max_layer_entries`` tar entries and ``max_layer_bytes`` of
    uncompressed tar, all layers together ``max_import_bytes``. ``source`` must not be a
    symlink; with ``within``, the file or directory opened must lie under one of those dirs.

    Raises OciImportError (OciRefError if a ref is needed or matches nothing), InvalidRefError
    for a malformed ``ref``, ValueError for a ``max_layers`` below 1; OSError for trouble of the
    host (a full disk, an I/O error), ImageError if packing a layer fails.
    """
    if max_layers < 1:
        raise ValueError(f"max_layers must be at least 1, not {max_layers}")
    source = Path(source)
    caps = _Caps(max_layer_entries, max_layer_bytes, max_import_bytes)
    ctx = BuildContext(store=store, workdir=store.tmp_dir / f"import-{uuid.uuid4().hex[:12]}", progress=progress)
    stop = threading.Event()
    started = time.monotonic()
    ctx.report(f"reading {source}", 0.0)
    await asyncio.to_thread(ctx.workdir.mkdir)
    layers: list[LayerRef] = []
    refresher = asyncio.create_task(_keep_fresh(store, layers))
    try:
        src = await _open_cancellable(source, within)
        try:
            candidates = await _blocking(stop, _candidates, src, source)
            chosen, target = _select(candidates, ref, source)
            plan = await _blocking(stop, chosen.load)
            if not plan.layers:
                raise OciImportError(f"the image {target} in {source} has no layers")
            digests = await _import_layers(
                store,
                src,
                plan,
                ctx.workdir,
                merge_below=merge_below,
                max_layers=max_layers,
                caps=caps,
                ctx=ctx,
                stop=stop,
                refs=layers,
            )
        finally:
            src.close()
        env, workdir, user = _sandbox_defaults(plan.config.config or _RunConfig())
        recipe = {"imported_from": str(source.absolute()), "oci_layers": digests, "config_digest": plan.config_digest}
        name, tag = parse_ref(target)
        manifest = await asyncio.to_thread(
            partial(
                store.put_manifest, name, tag, layers, recipe=json.dumps(recipe), env=env, workdir=workdir, user=user
            )
        )
    finally:
        refresher.cancel()
        await asyncio.gather(refresher, return_exceptions=True)
        await asyncio.shield(asyncio.to_thread(fsutil.rmtree, ctx.workdir))
    log.info(
        "imported %s from %s: %d OCI layers as %d EROFS layers in %.1fs",
        manifest.ref,
        source,
        len(digests),
        len(layers),
        time.monotonic() - started,
    )
    ctx.report(f"{manifest.ref}: imported", 1.0)
    return manifest


__all__ = [
    "MAX_ENTRIES_PER_LAYER",
    "MAX_PATH_DEPTH",
    "MAX_IMPORT_BYTES",
    "MAX_LAYERS",
    "MAX_LAYER_BYTES",
    "OPAQUE_XATTR",
    "OciImportError",
    "OciRefError",
    "import_image",
    "normalise_ref",
]
