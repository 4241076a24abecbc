"""Publishing a local image to the shared store, each layer as an on-demand layer (metadata image + blob)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from typing import TYPE_CHECKING

from pydantic import ValidationError

from . import fsutil
from .models import (
    ImageError,
    ImageManifest,
    LayerRef,
)
from .store_io import BLOB_CHUNK, _atomic_write, _blob_name, _digest_file, _layer_name, _publish_once

if TYPE_CHECKING:
    from .store import LayerStore, ProgressFn


async def push(store: LayerStore, ref: str, progress: ProgressFn | None = None) -> ImageManifest:
    """Publish a local image to the shared store, each layer as an on-demand layer: a small
    metadata image plus a blob of its file data (uncompressed, so pages can be read in place).

    Layers already in the shared store are not converted again; the shared manifest is
    written last, so readers never see an image with missing layers.
    """
    if store.shared is None:
        raise ImageError("no shared store is configured")
    m = await asyncio.to_thread(store.resolve, ref)
    for d in ("layers", "blobs", "images", "tmp", "converted"):
        await asyncio.to_thread((store.shared / d).mkdir, parents=True, exist_ok=True)
    out: list[LayerRef] = []
    for i, layer in enumerate(m.layers):
        if progress is not None:
            progress(f"{m.ref}: layer {i + 1}/{len(m.layers)}", i / len(m.layers))
        out.append(await _push_layer(store, layer))
    shared_manifest = ImageManifest(**{**m.model_dump(), "layers": out})
    path = store.shared / "images" / m.name / f"{m.tag}.json"
    data = shared_manifest.model_dump_json(indent=2).encode() + b"\n"
    await asyncio.to_thread(_atomic_write, path, data)
    store._remember(out)
    if progress is not None:
        progress(f"{m.ref}: published", 1.0)
    return shared_manifest


async def _push_layer(store: LayerStore, layer: LayerRef) -> LayerRef:
    assert store.shared is not None
    if layer.blob is not None:
        return layer  # already an on-demand layer of the shared store
    # mkfs stamps its build time into the metadata image, so converting the same layer twice
    # gives two digests: remember each conversion, and images sharing a base share it here too.
    record = store.shared / "converted" / (layer.digest.removeprefix("sha256:") + ".json")
    with contextlib.suppress(OSError, ValidationError):
        done = LayerRef.model_validate_json(await asyncio.to_thread(record.read_bytes))
        if await asyncio.to_thread(_shared_has, store, done):
            return done
    pushed = await _convert_layer(store, layer)
    data = pushed.model_dump_json().encode()
    await asyncio.to_thread(_atomic_write, record, data)
    return pushed


def _shared_has(store: LayerStore, layer: LayerRef) -> bool:
    assert store.shared is not None and layer.blob is not None
    return (store.shared / "layers" / _layer_name(layer.digest)).exists() and (
        store.shared / "blobs" / _blob_name(layer.blob)
    ).exists()


async def _convert_layer(store: LayerStore, layer: LayerRef) -> LayerRef:
    assert store.shared is not None
    work = store.shared / "tmp" / uuid.uuid4().hex
    await asyncio.to_thread(work.mkdir)
    try:
        meta, blob = work / "meta.erofs", work / "data.blob"
        # The layer file is mounted and re-packed as it is: ids (already shifted), xattrs,
        # whiteouts and opaque markers carry over.
        source = await asyncio.to_thread(store.layer_path, layer.digest)
        async with fsutil.mounted_erofs(source, work / "mnt") as mnt:
            await fsutil.mkfs_erofs(mnt, meta, blobdev=blob, chunk_size=BLOB_CHUNK)
        meta_digest, meta_size = await asyncio.to_thread(_digest_file, meta)
        blob_digest, blob_size = await asyncio.to_thread(_digest_file, blob)
        for src, dest in (
            (meta, store.shared / "layers" / _layer_name(meta_digest)),
            (blob, store.shared / "blobs" / _blob_name(blob_digest)),
        ):
            await asyncio.to_thread(_publish_once, src, dest)
    finally:
        await asyncio.shield(asyncio.to_thread(fsutil.rmtree, work))
    return LayerRef(
        digest=meta_digest,
        size=meta_size,
        kind=layer.kind,
        description=f"{layer.description} (on demand; was {layer.digest})",
        blob=blob_digest,
        blob_size=blob_size,
    )
