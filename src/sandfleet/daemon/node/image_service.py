"""Images for the node's sandboxes: resolve-or-build a reference, stack an environment's layers,
apply an image's defaults to a spec, and list, push, import, delete and garbage-collect images
(keeping every layer a live sandbox, a warm pool or a registered `layer_users` hook still needs).
"""

from __future__ import annotations

import asyncio
import builtins
import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandfleet.backends.base import LayerCache, offers
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.lifecycle import LIVE_STATES
from sandfleet.errors import DataLossError, ImageNotFoundError, InternalError, InvalidArgumentError
from sandfleet.images import (
    ImageBuildError,
    ImageError,
    ImageManifest,
    InvalidRefError,
    LayerCorruptError,
    LayerRef,
    oci_import,
)
from sandfleet.images import ImageNotFoundError as StoreImageNotFound
from sandfleet.images.recipe_build import prune_build_cache
from sandfleet.models import ImageInfo, SandboxSpec

# Lower layers of one overlay: the mount options (one ~100-byte path per layer) must fit a page.
MAX_LAYERS = 32


def _first_of_each(layers: list[LayerRef]) -> list[LayerRef]:
    """A stack without repeats. A layer named twice (two images on one base) keeps its first,
    lowest position: the shared base stays at the bottom, under what each image changed."""
    return list({x.digest: x for x in layers}.values())  # a dict keeps each key's first slot


def image_info(m: ImageManifest) -> ImageInfo:
    return ImageInfo(
        name=m.name,
        tag=m.tag,
        layers=[x.digest for x in m.layers],
        size=sum(x.size + (x.blob_size or 0) for x in m.layers),
        created=m.created,
        on_demand=any(x.blob is not None for x in m.layers),
    )


class Images:
    def __init__(self, core: NodeCore, *, build_missing_images: bool, import_dirs: builtins.list[Path] | None) -> None:
        self.core = core
        self.build_missing_images = build_missing_images
        self.import_dirs = import_dirs
        # Layers something above uses besides live sandboxes and pools (snapshots): gc keeps them.
        self.layer_users: builtins.list[Callable[[], set[str]]] = []

    async def resolve_image(self, ref: str) -> ImageManifest:
        try:
            if self.build_missing_images:
                return await self.core.store.ensure(ref)
            return self.core.store.resolve(ref)
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found (see `sandfleet images`)") from exc
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except ImageBuildError as exc:
            raise InternalError(f"building image {ref} failed: {exc}") from exc

    async def resolve_environment(self, spec: SandboxSpec) -> ImageManifest:
        """The layer stack a spec asks for: `image`'s layers, then each of `layers` (an image ref
        adds its whole stack, a digest one layer), bottom -> top. A layer named twice keeps its
        first, lowest position. Environment defaults (env, workdir, user) of later entries win."""
        if not spec.layers:
            assert spec.image is not None
            m = await self.resolve_image(spec.image)
            if len({x.digest for x in m.layers}) < len(m.layers):  # the overlay refuses a repeated lower
                m = m.model_copy(update={"layers": _first_of_each(m.layers)})
            self._check_layer_count(m)
            return m
        stack: builtins.list[LayerRef] = []
        env: dict[str, str] = {}
        workdir = user = None
        for ref in ([spec.image] if spec.image else []) + spec.layers:
            if ref.startswith("sha256:"):
                layer = await asyncio.to_thread(self.layer_by_digest, ref)
                stack.append(layer)
                continue
            m = await self.resolve_image(ref)
            stack.extend(m.layers)
            env.update(m.env)
            workdir, user = m.workdir or workdir, m.user or user
        m = ImageManifest(
            name="environment",
            tag="stack",
            layers=_first_of_each(stack),
            created=time.time(),
            env=env,
            workdir=workdir,
            user=user,
        )
        self._check_layer_count(m)
        return m

    @staticmethod
    def _check_layer_count(image: ImageManifest) -> None:
        if len(image.layers) > MAX_LAYERS:
            raise InvalidArgumentError(f"the environment has {len(image.layers)} layers; at most {MAX_LAYERS}")

    def layer_by_digest(self, digest: str) -> LayerRef:
        try:
            return self.core.store.layer_ref_or_file(digest)
        except LayerCorruptError as exc:
            if self.core.store.has_layer(digest):
                raise DataLossError(str(exc)) from exc
            raise ImageNotFoundError(f"image layer {digest} not found in the layer store") from exc

    @staticmethod
    def with_image_defaults(spec: SandboxSpec, image: ImageManifest) -> SandboxSpec:
        """The spec with the image's environment defaults filled in where the caller set none,
        validated like the caller's own fields (an imported image may carry anything)."""
        update: dict[str, Any] = {}
        if image.env:
            update["env"] = {**image.env, **spec.env}
        if image.workdir and "workdir" not in spec.model_fields_set:
            update["workdir"] = image.workdir
        if image.user and "user" not in spec.model_fields_set:
            update["user"] = image.user.split(":", 1)[0]
        if not update:
            return spec
        try:
            merged = SandboxSpec.model_validate({**spec.model_dump(exclude_unset=True), **update})
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidArgumentError(f"the image's defaults are not valid ({errors}); set them in the spec") from exc
        return merged

    async def list_images(self) -> builtins.list[ImageInfo]:
        return [image_info(m) for m in await asyncio.to_thread(self.core.store.list_images)]

    async def build_image(self, ref: str) -> ImageInfo:
        """The image `ref`, built from its built-in recipe if the node does not have it yet."""
        return image_info(await self.resolve_image(ref))

    async def push_image(self, ref: str) -> ImageInfo:
        """Publish a local image to the shared store as on-demand layers."""
        if self.core.store.shared is None:
            raise InvalidArgumentError("no shared store is configured (shared_image_dir)")
        try:
            return image_info(await self.core.store.push(ref))
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found") from exc
        except LayerCorruptError as exc:
            raise DataLossError(str(exc)) from exc
        except ImageError as exc:
            raise InternalError(f"pushing {ref} failed: {exc}") from exc

    async def import_image(self, path: str, ref: str | None) -> ImageInfo:
        """An OCI image (docker save tarball, OCI layout or its tar) on this host, as an image."""
        source = Path(path)
        if not source.is_absolute() or not await asyncio.to_thread(source.exists):
            raise InvalidArgumentError(f"import source {path!r} must be an absolute path that exists on the node")
        try:
            # `within` is checked on the opened file, so a path swapped after any check cannot escape.
            return image_info(await oci_import.import_image(self.core.store, source, ref, within=self.import_dirs))
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference: {exc}") from exc
        except oci_import.OciImportError as exc:
            raise InvalidArgumentError(f"cannot import {path}: {exc}") from exc
        except ImageError as exc:  # building the EROFS layers failed
            raise InternalError(f"importing {path} failed: {exc}") from exc

    async def delete_image(self, ref: str) -> None:
        try:
            await asyncio.to_thread(self.core.store.remove_image, ref)
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found") from exc

    async def gc_images(self, min_age: float = 600.0) -> tuple[builtins.list[str], int]:
        """Delete layers nothing refers to: no image, no sandbox of this daemon, no snapshot."""
        keep: set[str] = set()
        for sb in self.core.table:
            if sb.live is not None and sb.state in LIVE_STATES:
                keep.update(str(d) for d in sb.live.runtime.get("layers", []))
        for users in self.layer_users:
            keep |= users()
        if self.core.pools is not None:
            keep.update(self.core.pools.layer_digests())
        # A mounted layer's file cannot really go (the mount holds it): unmount the unused ones first.
        for cache in self._caches():
            await cache.unmount_unused_layers()
            keep |= cache.busy_layers()  # and never one a create is mounting right now
        removed, freed = await asyncio.to_thread(self.core.store.gc, keep, min_age=min_age)
        trimmed, trimmed_bytes = await self.trim_cache(keep)
        removed, freed = removed + trimmed, freed + trimmed_bytes
        if removed:
            await asyncio.to_thread(prune_build_cache, self.core.store)  # recipe steps whose layer went
            log.info("image gc removed %d layers (%d bytes)", len(removed), freed)
        return removed, freed

    async def trim_cache(self, keep: set[str]) -> tuple[builtins.list[str], int]:
        """Hold the local copies of shared-store layers to `image_cache_max`: over it, unused
        layers are unmounted (a mounted file frees nothing), then the least recently used go."""
        limit = self.core.store.cache_max
        if limit is None or await asyncio.to_thread(self.core.store.local_bytes) <= limit:
            return [], 0
        caches = self._caches()
        for cache in caches:
            await cache.unmount_unused_layers()
        return await asyncio.to_thread(self.core.store.trim, limit, keep, functools.partial(_remove_if_idle, caches))

    def _caches(self) -> builtins.list[LayerCache]:
        # offers(): a tier sharing another's backend (fncall) does not hold a cache of its own
        return [b for b in self.core.backends.values() if isinstance(b, LayerCache) and offers(b, "layer_cache")]

    def layer_refs(self, digests: builtins.list[str]) -> builtins.list[LayerRef]:
        return [self.layer_by_digest(digest) for digest in digests]


def _remove_if_idle(caches: list[LayerCache], digest: str, remove: Callable[[], None]) -> bool:
    """Run `remove` unless a tier has the layer mounted (or is mounting it), each tier's check held
    around the next: atomic with respect to every tier's mounts."""
    if not caches:
        remove()
        return True
    first, rest = caches[0], caches[1:]
    done = False

    def inner() -> None:
        nonlocal done
        done = _remove_if_idle(rest, digest, remove)

    return first.remove_layer_if_idle(digest, inner) and done
