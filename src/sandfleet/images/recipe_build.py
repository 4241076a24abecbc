"""Building a recipe: its base, then each step as a cached layer, then the image's manifest."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandfleet.errors import SandboxError

from . import fsutil
from .builders import trim_debian_rootfs
from .models import (
    DIGEST_RE,
    ImageError,
    LayerRef,
    parse_ref,
)
from .recipe import MmdebstrapBase, RecipeError, step_kind
from .recipe_context import BuildResult, StepResult, _cache_key, _Ctx, _publish_step
from .recipe_steps import _STEP_BUILDERS, _mmdebstrap
from .store import LayerStore, ProgressFn

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient

    from .recipe import MmdebstrapSpec, Recipe

log = logging.getLogger(__name__)


async def build_recipe(
    recipe: Recipe,
    store: LayerStore,
    *,
    client_factory: Callable[[], AsyncClient] | None = None,
    progress: ProgressFn | None = None,
    on_step: Callable[[StepResult], None] | None = None,
    on_output: Callable[[int, str, str], None] | None = None,
) -> BuildResult:
    """Build ``recipe`` into ``store``: one layer per step, reusing cached layers; write the manifest.

    ``client_factory`` makes an ``AsyncClient`` to the daemon that uses ``store``; it is called at
    most once, on the first pip/run step that misses the cache, and the client is closed at the
    end. Without it such steps raise RecipeError. Raises RecipeError naming the failing step.

    ``on_step(result)`` is called as each step (the base first, index 0) is done; with
    ``on_output(index, stream, line)`` a run step's output is streamed to it line by line
    (``stream`` is "stdout" or "stderr", ``line`` without its newline) as the command runs.
    """
    ctx = _Ctx(recipe, store, client_factory, progress, on_step=on_step, on_output=on_output)
    ctx.workdir = store.tmp_dir / f"recipe-{ctx.build_id}"
    await asyncio.to_thread(ctx.workdir.mkdir, parents=True)
    results: list[StepResult] = []
    try:
        results.append(await _build_base(ctx))
        ctx.step_done(results[-1])
        ctx.env.update(recipe.env)
        ctx.image_workdir = recipe.workdir or ctx.image_workdir
        ctx.image_user = recipe.user or ctx.image_user
        for i, step in enumerate(recipe.steps, 1):
            kind = step_kind(step)
            started = time.monotonic()
            ctx.report(i, kind, "checking cache", 0.0)
            await asyncio.to_thread(ctx._touch, ctx.stack)
            try:
                key, layer, hit = await _STEP_BUILDERS[kind](ctx, i, step)
                published = None
                if step.name is not None:
                    published = await _publish_step(ctx, i, kind, key, step.name, layer)
            except (ImageError, SandboxError, OSError) as exc:
                raise RecipeError(f"step {i} ({kind}): {exc}") from exc
            if not ctx.push(layer):
                log.info("step %d (%s): layer %s is in the stack below already; it stays there", i, kind, layer.digest)
            results.append(
                StepResult(
                    index=i,
                    kind=kind,
                    key=key,
                    layer=layer.digest,
                    cache_hit=hit,
                    seconds=time.monotonic() - started,
                    name=published,
                    description=layer.description,
                )
            )
            ctx.report(i, kind, "cached" if hit else "built", 1.0)
            ctx.step_done(results[-1])
        name, tag = parse_ref(recipe.ref)
        record = {
            "recipe": recipe.ref,
            "source": recipe.source,
            "build_id": ctx.build_id,
            "steps": [
                {"index": r.index, "kind": r.kind, "key": r.key, "layer": r.layer, "cache_hit": r.cache_hit}
                | ({"name": r.name} if r.name else {})
                for r in results
            ],
        }
        try:
            manifest = await asyncio.to_thread(
                store.put_manifest,
                name,
                tag,
                list(ctx.stack),
                recipe=json.dumps(record),
                env=ctx.env,
                workdir=ctx.image_workdir,
                user=ctx.image_user,
            )
        except ImageError as exc:
            raise RecipeError(f"writing the manifest of {recipe.ref}: {exc}") from exc
        return BuildResult(manifest=manifest, steps=results)
    finally:
        # Shielded: a cancelled build must still close its client and remove its scratch dir
        # (the mounts under it are unmounted by their own context managers first).
        cleanup = [asyncio.to_thread(fsutil.rmtree, ctx.workdir)]
        if ctx.client is not None:
            cleanup.append(ctx.client.aclose())
        await asyncio.shield(asyncio.gather(*cleanup, return_exceptions=True))


def prune_build_cache(store: LayerStore) -> int:
    """Delete build-cache entries whose layer file is gone (after ``images gc``); return how many.

    Such entries are misses anyway; this only keeps ``build-cache/`` from growing forever.
    Blocking: call it via ``asyncio.to_thread`` from async code.
    """
    removed = 0
    for path in (store.root / "build-cache").glob("*.json"):
        try:
            layer = LayerRef.model_validate_json(path.read_bytes())
            store.layer_path(layer.digest)
            continue
        except (OSError, ValueError, ImageError):
            pass
        path.unlink(missing_ok=True)
        removed += 1
    return removed


async def _build_base(ctx: _Ctx) -> StepResult:
    base = ctx.recipe.base
    started = time.monotonic()
    store = ctx.store
    ctx.report(0, "base", "resolving", 0.0)
    try:
        if isinstance(base, MmdebstrapBase):
            spec = base.mmdebstrap
            key = _cache_key("mmdebstrap", suite=spec.suite, variant=spec.variant, packages=sorted(spec.packages))

            async def build() -> LayerRef:
                return await _mmdebstrap_base(ctx, spec)

            layer, hit = await ctx.cached(key, build)
            ctx.stack = [layer]
        elif DIGEST_RE.match(base):
            key, hit = base, True
            size = (await asyncio.to_thread(store.layer_path, base)).stat().st_size
            ctx.stack = [LayerRef(digest=base, size=size, kind="base", description=f"layer {base}")]
        else:
            key = base
            hit = await asyncio.to_thread(store.has_image, base)

            def sub(stage: str, fraction: float) -> None:
                ctx.report(0, "base", stage, fraction)

            # ensure() builds built-in images (busybox, debian, python) on first use.
            manifest = await store.ensure(base, sub)
            for x in manifest.layers:  # one naming a layer twice (imported, say) keeps the first
                ctx.push(x)
            ctx.env, ctx.image_workdir, ctx.image_user = dict(manifest.env), manifest.workdir, manifest.user
            if not ctx.stack:
                raise RecipeError(f"image {base} has no layers")
    except (ImageError, OSError) as exc:
        raise RecipeError(f"base: {exc}") from exc
    ctx.report(0, "base", "ready", 1.0)
    top = ctx.stack[-1]
    return StepResult(0, "base", key, top.digest, hit, time.monotonic() - started, None, top.description)


async def _mmdebstrap_base(ctx: _Ctx, spec: MmdebstrapSpec) -> LayerRef:
    rootfs = ctx.scratch("base-rootfs")
    ctx.report(0, "base", f"mmdebstrap {spec.suite} ({spec.variant})", 0.1)
    mirror = await _mmdebstrap(rootfs, spec.suite, variant=spec.variant, include=spec.packages)
    await asyncio.to_thread(trim_debian_rootfs, rootfs)
    ctx.report(0, "base", "mkfs.erofs", 0.8)
    extra = f" + {', '.join(spec.packages)}" if spec.packages else ""
    layer = await ctx.store.add_layer_from_dir(
        rootfs, f"debian {spec.suite} {spec.variant}{extra} ({mirror})", kind="base"
    )
    await asyncio.to_thread(fsutil.rmtree, rootfs)
    return layer


__all__ = ["build_recipe", "prune_build_cache"]
