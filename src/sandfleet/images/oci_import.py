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
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

from sandfleet.models import check_abs_path, check_env, check_user

from . import fsutil
from .builtin_images import BuildContext
from .models import ImageError, ImageManifest, LayerRef, parse_ref
from .oci_archive import _open_source
from .oci_errors import (
    MAX_ENTRIES_PER_LAYER,
    MAX_IMPORT_BYTES,
    MAX_LAYER_BYTES,
    MAX_LAYERS,
    OciImportError,
    OciRefError,
)
from .oci_manifest import _candidates, _RunConfig, _select
from .oci_merge import _merge_into, _restore_dir_times, _strip_overlay_markers
from .oci_unpack import _Caps, _unpack_blob
from .store import LayerStore, ProgressFn

if TYPE_CHECKING:
    from .oci_archive import _Source
    from .oci_manifest import _Plan

log = logging.getLogger(__name__)

# While an import runs, its finished layers are named by no manifest yet: refreshing their
# mtime this often keeps LayerStore.gc's min_age (600 s by default) from deleting them.
_LAYER_REFRESH_SECONDS = 60.0
_T = TypeVar("_T")
_P = ParamSpec("_P")


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


# The errors import_image raises are named here too, for callers of the import alone.
__all__ = ["OciImportError", "OciRefError", "import_image"]
