"""Content-addressed local store of EROFS layers plus ``name:tag`` manifests."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import re
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from pydantic import ValidationError

from . import fsutil
from .models import (
    DIGEST_RE,
    ImageManifest,
    ImageNotFoundError,
    LayerCorruptError,
    LayerKind,
    LayerRef,
    parse_ref,
)

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, float], None]


def _digest_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


class LayerStore:
    """Layers live in ``root/layers/sha256-<hex>.erofs``; manifests in ``root/images/<name>/<tag>.json``.

    ``uid_base`` is the host uid that maps to uid 0 inside sandboxes; layer files are
    stored with ids already shifted by it, so no idmapped mounts are needed at run time.
    """

    def __init__(self, root: Path, *, uid_base: int = 100000) -> None:
        self.root = Path(root)
        self.uid_base = uid_base
        self.layers_dir = self.root / "layers"
        self.images_dir = self.root / "images"
        self.tmp_dir = self.root / "tmp"
        # Per event loop: an asyncio.Lock binds to the loop it first waits on.
        self._locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, asyncio.Lock]] = (
            weakref.WeakKeyDictionary()
        )
        # digest -> size as recorded in manifests / at creation; avoids rescanning manifests.
        self._sizes: dict[str, int] = {}
        for d in (self.layers_dir, self.images_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ lookups

    def _manifest_path(self, name: str, tag: str) -> Path:
        return self.images_dir / name / f"{tag}.json"

    def resolve(self, ref: str) -> ImageManifest:
        """Return the manifest for ``name[:tag]`` (tag defaults to ``latest``)."""
        name, tag = parse_ref(ref)
        path = self._manifest_path(name, tag)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ImageNotFoundError(f"image {name}:{tag} not found") from None
        m = ImageManifest.model_validate_json(data)
        if (m.name, m.tag) != (name, tag):
            raise ImageNotFoundError(f"manifest at {path} names {m.ref}, not {name}:{tag}")
        self._remember(m.layers)
        return m

    def _remember(self, layers: list[LayerRef]) -> None:
        for layer in layers:
            self._sizes[layer.digest] = layer.size

    def has_image(self, ref: str) -> bool:
        try:
            self.resolve(ref)
        except ImageNotFoundError:
            return False
        return True

    def layer_path(self, digest: str) -> Path:
        """Path of a layer file; checks existence and (cheaply) size against the manifests' record."""
        if not DIGEST_RE.match(digest):
            raise LayerCorruptError(f"malformed layer digest {digest!r}")
        path = self.layers_dir / ("sha256-" + digest.removeprefix("sha256:") + ".erofs")
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise LayerCorruptError(f"layer {digest} missing ({path})") from None
        expected = self._recorded_size(digest)
        if expected is not None and size != expected:
            raise LayerCorruptError(f"layer {digest} has size {size}, expected {expected}")
        return path

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
        """All readable manifests, sorted by ref. Unparseable ones are logged and skipped."""
        out: list[ImageManifest] = []
        for path in sorted(self.images_dir.rglob("*.json")):
            if path.name.startswith("."):
                continue
            try:
                m = ImageManifest.model_validate_json(path.read_bytes())
            except (OSError, ValidationError) as exc:
                log.warning("skipping unreadable manifest %s: %s", path, exc)
                continue
            self._remember(m.layers)
            out.append(m)
        out.sort(key=lambda m: (m.name, m.tag))
        return out

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
        alone (a build or pack may be about to name them). Returns (digests removed, bytes freed).

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
            if digest in referenced or now - st.st_mtime < min_age:
                continue
            path.unlink(missing_ok=True)
            self._sizes.pop(digest, None)
            removed.append(digest)
            freed += st.st_size
        return removed, freed

    # ------------------------------------------------------------------ building

    @contextlib.asynccontextmanager
    async def _file_lock(self, name: str, tag: str) -> AsyncIterator[None]:
        # Per ref (not per name) so a recipe may depend on another tag of the same name
        # without deadlocking on its own flock. Polled so waiting stays cancellable.
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
        fd = os.open(self.root / f".lock-{safe}@{tag}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.2)
            yield
        finally:
            os.close(fd)  # releases the flock

    async def ensure(self, ref: str, progress: ProgressFn | None = None) -> ImageManifest:
        """Return the manifest for ``ref``, building it first if it is a built-in image."""
        from .builders import BUILTIN_IMAGES, BuildContext

        name, tag = parse_ref(ref)
        key = f"{name}:{tag}"
        with contextlib.suppress(ImageNotFoundError):
            return self.resolve(key)
        builder = BUILTIN_IMAGES.get(key)
        if builder is None:
            raise ImageNotFoundError(f"image {key} not found and no built-in recipe for it")
        loop_locks = self._locks.setdefault(asyncio.get_running_loop(), {})
        lock = loop_locks.setdefault(key, asyncio.Lock())
        async with lock:
            with contextlib.suppress(ImageNotFoundError):
                return self.resolve(key)  # built by a concurrent ensure() in this process
            async with self._file_lock(name, tag):
                with contextlib.suppress(ImageNotFoundError):
                    return self.resolve(key)  # built by another process
                workdir = self.tmp_dir / f"build-{re.sub(r'[^a-z0-9.-]', '_', key)}-{uuid.uuid4().hex[:8]}"
                await asyncio.to_thread(workdir.mkdir, parents=True)
                ctx = BuildContext(store=self, workdir=workdir, progress=progress)
                started = time.monotonic()
                try:
                    ctx.report(f"{key}: building", 0.0)
                    layers = await builder.build(ctx)
                    m = self.put_manifest(name, tag, layers, recipe=builder.recipe)
                finally:
                    await asyncio.shield(asyncio.to_thread(fsutil.rmtree, workdir))
                log.info("built %s in %.1fs", key, time.monotonic() - started)
                ctx.report(f"{key}: done", 1.0)
                return m


__all__ = ["LayerStore", "ProgressFn"]
