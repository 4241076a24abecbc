"""Content-addressed local store of EROFS layers plus ``name:tag`` manifests; `LayerStore.ensure`
builds missing built-in images (`builtin_images`)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from . import fsutil, store_shared
from .builtin_images import BUILTIN_IMAGES, BuildContext, Builder
from .models import (
    DIGEST_RE,
    ImageManifest,
    ImageNotFoundError,
    LayerCorruptError,
    LayerKind,
    LayerRef,
    parse_ref,
)
from .store_io import _atomic_write, _blob_name, _digest_file, _file_version, _hash_unchanging, _layer_name, file_lock

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, float], None]

# After a failed rebuild of an outdated built-in image, the stored one is used this long before
# the rebuild is tried again.
REBUILD_RETRY_SECONDS = 600.0


class LayerStore:
    """Layers live in ``root/layers/sha256-<hex>.erofs``; manifests in ``root/images/<name>/<tag>.json``.

    ``uid_base`` is the host uid that maps to uid 0 inside sandboxes; layer files are
    stored with ids already shifted by it, so no idmapped mounts are needed at run time.

    ``shared`` is an optional second store of the same layout on a shared filesystem (NFS, CephFS,
    3FS in production), plus ``blobs/``. Images found only there are used in place: their
    metadata images are copied into this (local) store when first needed, and their file data
    stays in the shared blob, which the kernel reads page by page as sandboxes touch files
    (EROFS's extra-device mode, with direct I/O), so a 5 GB image never moves 5 GB. EROFS's cache
    of the layers' files is the node's data cache; ``cache_max`` caps the local copies of shared
    layers (least recently used go).
    """

    def __init__(
        self, root: Path, *, uid_base: int = 100000, shared: Path | None = None, cache_max: int | None = None
    ) -> None:
        self.root = Path(root)
        self.uid_base = uid_base
        self.shared = Path(shared) if shared is not None else None
        self.cache_max = cache_max
        self.layers_dir = self.root / "layers"
        self.images_dir = self.root / "images"
        self.tmp_dir = self.root / "tmp"
        self.verified_dir = self.root / "verified"
        self.used_dir = self.root / "used"  # per layer: a file whose mtime is when it was last used
        # Per event loop: an asyncio.Lock binds to the loop it first waits on.
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
            weakref.WeakKeyDictionary()
        )
        # digest -> the layer's record in a manifest (size, blob); avoids rescanning manifests.
        self._refs: dict[str, LayerRef] = {}
        self._unnamed: dict[str, LayerRef] = {}  # layers no manifest names, as `layer_ref_or_file` saw them
        self._sizes: dict[str, int] = {}
        # Parsed manifests by path, valid while the file's (device, inode, size, mtime, ctime) stay
        # the same: every create resolves its image, and a stat costs a fraction of a read and a
        # validation. Manifests are replaced, never edited in place, and nobody mutates a returned one.
        self._manifests: dict[Path, tuple[tuple[int, ...], ImageManifest]] = {}
        self._fetch_lock = threading.Lock()
        self._rebuild_failed: dict[str, float] = {}  # built-in ref -> when rebuilding it last failed
        for d in (self.layers_dir, self.images_dir, self.tmp_dir, self.verified_dir, self.used_dir):
            d.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ lookups

    def _manifest_roots(self) -> list[Path]:
        """Where manifests are looked up: here first, then the shared store."""
        return [self.images_dir] + ([self.shared / "images"] if self.shared is not None else [])

    def _manifest_path(self, name: str, tag: str) -> Path:
        return self.images_dir / name / f"{tag}.json"

    def resolve(self, ref: str) -> ImageManifest:
        """Return the manifest for ``name[:tag]`` (tag defaults to ``latest``): local, else shared."""
        name, tag = parse_ref(ref)
        for images_dir in self._manifest_roots():
            path = images_dir / name / f"{tag}.json"
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            version = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            cached = self._manifests.get(path)
            if cached is not None and cached[0] == version:
                return cached[1]
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                continue
            m = ImageManifest.model_validate_json(data)
            if (m.name, m.tag) != (name, tag):
                raise ImageNotFoundError(f"manifest at {path} names {m.ref}, not {name}:{tag}")
            self._remember(m.layers)
            if len(self._manifests) >= 4096:
                self._manifests.clear()
            self._manifests[path] = (version, m)
            return m
        raise ImageNotFoundError(f"image {name}:{tag} not found")

    def _remember(self, layers: list[LayerRef]) -> None:
        for layer in layers:
            self._refs[layer.digest] = layer
            self._sizes[layer.digest] = layer.size

    def layer_ref(self, digest: str) -> LayerRef | None:
        """The record of a layer some manifest (local or shared) names, or None."""
        if digest not in self._refs:
            self.list_images()
        return self._refs.get(digest)

    def layer_ref_or_file(self, digest: str) -> LayerRef:
        """`layer_ref`, else a record made from the layer's file (a layer no image names: a recipe
        step's, a digest a caller stacks by hand), remembered so that the next lookup scans no
        manifests. Raises LayerCorruptError if there is no such file."""
        if not self.has_layer(digest):
            # Gone (maybe deleted under the store since it was looked up): answer from the manifests
            # as they are now, as a restarted daemon would. An image naming it makes that a loss.
            self._unnamed.pop(digest, None)
            named = (x for m in self.list_images() for x in m.layers if x.digest == digest)
            ref = next(named, None)
            if ref is None:
                raise LayerCorruptError(f"layer {digest} missing ({self.layers_dir / _layer_name(digest)})")
            return ref
        ref = self._unnamed.get(digest) or self.layer_ref(digest)
        if ref is None:
            ref = LayerRef(digest=digest, size=self.layer_path(digest).stat().st_size, kind="layer")
            self._unnamed[digest] = ref
            self._sizes[digest] = ref.size
        return ref

    def has_image(self, ref: str) -> bool:
        try:
            self.resolve(ref)
        except ImageNotFoundError:
            return False
        return True

    def layer_path(self, digest: str) -> Path:
        """Path of a layer file; checks existence and (cheaply) size against the manifests' record.

        A layer only the shared store has is copied here first (for an on-demand layer that is
        its small metadata image; the data stays in the shared blob, see `blob_path`).
        """
        if not DIGEST_RE.match(digest):
            raise LayerCorruptError(f"malformed layer digest {digest!r}")
        path = self.layers_dir / _layer_name(digest)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            if not self._fetch(digest, path):
                raise LayerCorruptError(f"layer {digest} missing ({path})") from None
            size = path.stat().st_size
        expected = self._recorded_size(digest)
        if expected is not None and size != expected:
            raise LayerCorruptError(f"layer {digest} has size {size}, expected {expected}")
        return path

    def has_layer(self, digest: str) -> bool:
        """Whether a layer file for `digest` exists here or in the shared store (intact or not)."""
        name = _layer_name(digest)
        return (self.layers_dir / name).exists() or (
            self.shared is not None and (self.shared / "layers" / name).exists()
        )

    def blob_path(self, digest: str) -> Path | None:
        """The shared-store blob holding an on-demand layer's file data; None for a self-contained layer."""
        ref = self.layer_ref(digest)
        if ref is None or ref.blob is None:
            return None
        if self.shared is None:
            raise LayerCorruptError(f"layer {digest} reads its data from a shared store, and none is configured")
        path = self.shared / "blobs" / _blob_name(ref.blob)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise LayerCorruptError(f"data blob {ref.blob} of layer {digest} missing ({path})") from None
        if size != ref.blob_size:
            raise LayerCorruptError(f"data blob {ref.blob} of layer {digest} has size {size}, expected {ref.blob_size}")
        return path

    def verified_layer_path(self, digest: str) -> Path:
        """`layer_path`, with the file's sha256 checked once per file version (blocking).

        A flipped bit in an uncompressed layer would otherwise show up as silently wrong file
        content (or SIGBUS) in every sandbox. The check is remembered in ``verified/`` by the
        file's (device, inode, size, mtime, ctime), so it costs one read of the layer per node, not
        one per create. The ctime is what a writer cannot put back: any change to the file's content
        or metadata sets it to now, and only the clock can set it back (an mtime restored with
        utime still changes it). So the store never changes a layer file once it is verified: its
        use stamps live in ``used/``. An on-demand layer's blob is checked by size only: hashing
        it would read what the mode exists to leave unread.
        """
        path = self.layer_path(digest)
        stamp = self.verified_dir / digest.removeprefix("sha256:")
        with contextlib.suppress(OSError):
            if stamp.read_text() == _file_version(path.stat()):
                return path
        version = _hash_unchanging(path, digest)
        _atomic_write(stamp, version.encode(), sync=False)
        return path

    def is_verified(self, digest: str) -> bool:
        """Whether `verified_layer_path` would take the layer file as already hashed."""
        path = self.layers_dir / _layer_name(digest)
        try:
            return (self.verified_dir / digest.removeprefix("sha256:")).read_text() == _file_version(path.stat())
        except OSError:
            return False

    def _stamp_verified(self, path: Path, digest: str) -> None:
        _atomic_write(
            self.verified_dir / digest.removeprefix("sha256:"), _file_version(path.stat()).encode(), sync=False
        )

    def _fetch(self, digest: str, dest: Path) -> bool:
        """Copy a layer file from the shared store, checking its digest; False if it has none."""
        if self.shared is None:
            return False
        src = self.shared / "layers" / _layer_name(digest)
        with self._fetch_lock:
            if dest.exists():
                return True
            tmp = self.tmp_dir / f"fetch-{uuid.uuid4().hex}"
            try:
                h = hashlib.sha256()
                with open(src, "rb") as fin, open(tmp, "wb") as fout:
                    while chunk := fin.read(1 << 20):
                        h.update(chunk)
                        fout.write(chunk)
                if "sha256:" + h.hexdigest() != digest:
                    raise LayerCorruptError(f"layer {digest} in the shared store is corrupt ({src})")
                os.chmod(tmp, 0o444)
                os.rename(tmp, dest)
            except FileNotFoundError:
                return False
            finally:
                tmp.unlink(missing_ok=True)
            self._stamp_verified(dest, digest)  # just hashed while copying
        return True

    def layer_paths(self, manifest: ImageManifest) -> list[Path]:
        """Layer files bottom -> top, each size-checked against the manifest."""
        out = []
        for layer in manifest.layers:
            path = self.layer_path(layer.digest)
            if path.stat().st_size != layer.size:
                raise LayerCorruptError(f"layer {layer.digest} size mismatch")
            out.append(path)
        return out

    def _recorded_size(self, digest: str) -> int | None:
        # The size lives in manifests; the erofs file name carries only the digest.
        if digest not in self._sizes:
            self.list_images()
        return self._sizes.get(digest)

    async def verify_layer(self, digest: str) -> None:
        """Full re-hash of a layer file (slow; for fsck-style checks)."""
        path = self.layer_path(digest)
        actual, _ = await asyncio.to_thread(_digest_file, path)
        if actual != digest:
            raise LayerCorruptError(f"layer {digest} hashes to {actual}")

    def list_images(self) -> list[ImageManifest]:
        """All readable manifests (local, then the shared store's unless shadowed), sorted by ref.

        Unparseable ones are logged and skipped.
        """
        found: dict[tuple[str, str], ImageManifest] = {}
        for images_dir in self._manifest_roots():
            for path in sorted(images_dir.rglob("*.json")):
                if path.name.startswith("."):
                    continue
                try:
                    m = ImageManifest.model_validate_json(path.read_bytes())
                except (OSError, ValidationError) as exc:
                    log.warning("skipping unreadable manifest %s: %s", path, exc)
                    continue
                self._remember(m.layers)
                found.setdefault((m.name, m.tag), m)
        return [found[k] for k in sorted(found)]

    # ------------------------------------------------------------------ writes

    async def add_layer_from_dir(
        self,
        src: Path,
        description: str,
        *,
        kind: LayerKind = "layer",
        shift_ids: bool = True,
    ) -> LayerRef:
        """Pack a staging tree into a content-addressed EROFS layer.

        With ``shift_ids`` (default) ``src`` is modified in place: every entry is lchown'ed
        from id to id+uid_base. Pass False if the tree is already shifted.
        """
        if shift_ids:
            await asyncio.to_thread(fsutil.shift_ownership, src, self.uid_base)
        tmp = self.tmp_dir / f"layer-{uuid.uuid4().hex}.erofs"
        try:
            await fsutil.mkfs_erofs(src, tmp)
            digest, size = await asyncio.to_thread(_digest_file, tmp)
            final = self.layers_dir / ("sha256-" + digest.removeprefix("sha256:") + ".erofs")
            if final.exists() and final.stat().st_size == size:
                tmp.unlink()  # identical layer already stored
            else:
                os.chmod(tmp, 0o444)
                os.rename(tmp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._sizes[digest] = size
        return LayerRef(digest=digest, size=size, kind=kind, description=description)

    def put_manifest(
        self,
        name: str,
        tag: str,
        layers: list[LayerRef],
        *,
        recipe: str = "",
        created: float | None = None,
        env: dict[str, str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
    ) -> ImageManifest:
        """Atomically write (or replace) the manifest for ``name:tag``; layers must be stored."""
        parse_ref(f"{name}:{tag}")
        for layer in layers:
            path = self.layer_path(layer.digest)
            if path.stat().st_size != layer.size:
                raise LayerCorruptError(f"layer {layer.digest} size mismatch")
        m = ImageManifest(
            name=name,
            tag=tag,
            layers=list(layers),
            created=time.time() if created is None else created,
            recipe=recipe,
            env=env or {},
            workdir=workdir,
            user=user,
        )
        _atomic_write(self._manifest_path(name, tag), m.model_dump_json(indent=2).encode() + b"\n")
        return m

    def remove_image(self, ref: str) -> None:
        """Delete the manifest. Layers are shared between images and are left in place."""
        name, tag = parse_ref(ref)
        path = self._manifest_path(name, tag)
        try:
            path.unlink()
        except FileNotFoundError:
            raise ImageNotFoundError(f"image {name}:{tag} not found") from None
        # Prune now-empty name directories (e.g. images/base/debian/).
        parent = path.parent
        while parent != self.images_dir:
            try:
                parent.rmdir()
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    break
                raise
            parent = parent.parent

    def gc(self, keep: set[str], *, min_age: float = 600.0) -> tuple[list[str], int]:
        """Delete layer files no manifest names and `keep` (layers in use: mounted, of live
        sandboxes, of snapshots) does not hold; layers younger than `min_age` seconds are left
        alone, as are layers used (`touch`) within `min_age` (a build or pack may be about to name
        them). Returns (digests removed, bytes freed).

        A sandbox still running on a removed layer is unaffected: its mount holds the file.
        """
        referenced = {layer.digest for m in self.list_images() for layer in m.layers} | keep
        removed, freed, now = [], 0, time.time()
        for path in sorted(self.layers_dir.glob("sha256-*.erofs")):
            digest = "sha256:" + path.name.removeprefix("sha256-").removesuffix(".erofs")
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if digest in referenced or now - max(st.st_mtime, self._last_used(digest) or 0.0) < min_age:
                continue
            self._forget(path, digest)
            removed.append(digest)
            freed += st.st_size
        return removed, freed

    def _forget(self, path: Path, digest: str) -> None:
        path.unlink(missing_ok=True)
        (self.verified_dir / digest.removeprefix("sha256:")).unlink(missing_ok=True)
        (self.used_dir / digest.removeprefix("sha256:")).unlink(missing_ok=True)
        self._sizes.pop(digest, None)
        self._refs.pop(digest, None)
        self._unnamed.pop(digest, None)

    def local_bytes(self) -> int:
        """Bytes of the layer files in this (local) store."""
        total = 0
        for path in self.layers_dir.glob("sha256-*.erofs"):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def trim(
        self, max_bytes: int, keep: set[str], guard: Callable[[str, Callable[[], None]], bool] | None = None
    ) -> tuple[list[str], int]:
        """Drop local copies of shared-store layers, least recently mounted first, until the local
        layer files take at most `max_bytes`; never one in `keep` (in use) and never a layer the
        shared store does not hold (it could not be fetched again). `guard(digest, remove)` runs the
        removal only if nothing started mounting the layer meanwhile. Returns (digests, bytes freed).
        """
        if self.shared is None:
            return [], 0
        files = []
        total = 0
        for path in self.layers_dir.glob("sha256-*.erofs"):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            total += st.st_size
            digest = "sha256:" + path.name.removeprefix("sha256-").removesuffix(".erofs")
            used = self._last_used(digest)
            # Stores written before use stamps existed kept the time of use in the file's atime.
            files.append((st.st_atime if used is None else used, st.st_size, path))
        removed, freed = [], 0
        for _used, size, path in sorted(files):
            if total <= max_bytes:
                break
            digest = "sha256:" + path.name.removeprefix("sha256-").removesuffix(".erofs")
            if digest in keep or not (self.shared / "layers" / path.name).exists():
                continue
            remove = functools.partial(self._forget, path, digest)
            if guard is not None and not guard(digest, remove):
                continue
            if guard is None:
                remove()
            total -= size
            freed += size
            removed.append(digest)
        return removed, freed

    def touch(self, path: Path) -> None:
        """Mark a layer file (``layers/sha256-<hex>.erofs``) as used now: its stamp in ``used/``
        orders `trim` (least recently used first) and counts as activity for `gc`'s `min_age`.
        The layer file itself is left alone: changing even its times would change its ctime and
        void its verification."""
        stamp = self.used_dir / path.name.removeprefix("sha256-").removesuffix(".erofs")
        try:
            os.utime(stamp)
        except FileNotFoundError:
            with contextlib.suppress(OSError):
                os.close(os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
        except OSError:
            pass

    def _last_used(self, digest: str) -> float | None:
        try:
            return (self.used_dir / digest.removeprefix("sha256:")).stat().st_mtime
        except OSError:
            return None

    # ------------------------------------------------------------------ shared store

    async def push(self, ref: str, progress: ProgressFn | None = None) -> ImageManifest:
        """Publish a local image to the shared store (`store_shared.push`)."""
        return await store_shared.push(self, ref, progress)

    # ------------------------------------------------------------------ building

    def _current(self, key: str, builder: Builder | None) -> ImageManifest | None:
        """The stored manifest of ``key`` (ImageNotFoundError if none), or None if it is a built-in
        image made by an older version of its builder (blocking if the shared store is involved)."""
        m = self.resolve(key)
        if builder is not None and builder.outdated(self, m):
            return None
        return m

    async def ensure(self, ref: str, progress: ProgressFn | None = None) -> ImageManifest:
        """Return the manifest for ``ref``, building it first if it is a built-in image that is
        missing or was made by an older version of its builder (`Builder.outdated`).

        If rebuilding an outdated image fails, the stored one is returned (and the rebuild is not
        tried again for `REBUILD_RETRY_SECONDS`): a node that cannot reach its mirror keeps working.
        """
        name, tag = parse_ref(ref)
        key = f"{name}:{tag}"
        builder = BUILTIN_IMAGES.get(key)
        with contextlib.suppress(ImageNotFoundError):
            # A local file read: cheaper inline than a thread hop; the shared filesystem may block.
            if self.shared is None:
                current = self._current(key, builder)
            else:
                current = await asyncio.to_thread(self._current, key, builder)
            if current is not None:
                return current
        if builder is None:
            raise ImageNotFoundError(f"image {key} not found and no built-in recipe for it")
        loop_locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        lock = loop_locks.setdefault(key, asyncio.Lock())
        async with lock:
            with contextlib.suppress(ImageNotFoundError):
                if (current := self._current(key, builder)) is not None:
                    return current  # built by a concurrent ensure() in this process
            async with file_lock(self.root, name, tag):
                outdated: ImageManifest | None = None
                with contextlib.suppress(ImageNotFoundError):
                    if (current := self._current(key, builder)) is not None:
                        return current  # built by another process
                    outdated = self.resolve(key)
                failed_at = self._rebuild_failed.get(key)
                if (
                    outdated is not None
                    and failed_at is not None
                    and time.monotonic() - failed_at < REBUILD_RETRY_SECONDS
                ):
                    return outdated
                try:
                    return await self._build_builtin(key, builder, progress, upgrade=outdated is not None)
                except Exception as exc:  # an ImageError, OSError, or a TaskGroup's ExceptionGroup of them
                    if outdated is None:
                        raise
                    self._rebuild_failed[key] = time.monotonic()
                    log.warning("rebuilding outdated %s failed, keeping the stored image: %s", key, exc)
                    if progress is not None:
                        with contextlib.suppress(Exception):
                            progress(f"{key}: rebuild failed ({exc}); using the stored image", 1.0)
                    return outdated

    async def _build_builtin(
        self, key: str, builder: Builder, progress: ProgressFn | None, *, upgrade: bool
    ) -> ImageManifest:
        name, tag = parse_ref(key)
        workdir = self.tmp_dir / f"build-{re.sub(r'[^a-z0-9.-]', '_', key)}-{uuid.uuid4().hex[:8]}"
        await asyncio.to_thread(workdir.mkdir, parents=True)
        ctx = BuildContext(store=self, workdir=workdir, progress=progress)
        started = time.monotonic()
        try:
            ctx.report(f"{key}: {'rebuilding (its builder changed)' if upgrade else 'building'}", 0.0)
            layers = await builder.build(ctx)
            m = self.put_manifest(name, tag, layers, recipe=builder.manifest_recipe)
        finally:
            await asyncio.shield(asyncio.to_thread(fsutil.rmtree, workdir))
        self._rebuild_failed.pop(key, None)
        log.info("%s %s in %.1fs", "rebuilt" if upgrade else "built", key, time.monotonic() - started)
        ctx.report(f"{key}: done", 1.0)
        return m


# --------------------------------------------------------------------------- built-in images
# What a built-in recipe is and where they are registered. The recipes themselves (`builders`)

__all__ = ["LayerStore", "ProgressFn"]
