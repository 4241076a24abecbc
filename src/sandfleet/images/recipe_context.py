"""One recipe build's state: its layer stack, build cache, progress callbacks and daemon client; its results."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .models import (
    ImageError,
    ImageManifest,
    LayerRef,
    parse_ref,
)
from .recipe import CACHE_VERSION, RecipeError
from .store import LayerStore, ProgressFn

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient

    from .recipe import Recipe

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One layer of the result. ``index`` 0 is the base; [[step]]s are numbered from 1."""

    index: int
    kind: str  # "base" or one of STEP_KINDS
    key: str  # cache key (for a ref/digest base: the ref or digest itself)
    layer: str  # digest of the step's layer (for a multi-layer base image: its top layer)
    cache_hit: bool
    seconds: float
    name: str | None = None  # image ref the layer was also published as
    description: str = ""


@dataclass
class BuildResult:
    manifest: ImageManifest
    steps: list[StepResult] = field(default_factory=list)

    @property
    def cache_hits(self) -> int:
        return sum(s.cache_hit for s in self.steps)


def _cache_key(kind: str, **inputs: Any) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "kind": kind, **inputs}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class _Ctx:
    recipe: Recipe
    store: LayerStore
    client_factory: Callable[[], AsyncClient] | None
    progress: ProgressFn | None
    build_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    stack: list[LayerRef] = field(default_factory=list)
    client: AsyncClient | None = None
    workdir: Path = Path()
    # Environment defaults of the image so far: the base image's, then the recipe's.
    env: dict[str, str] = field(default_factory=dict)
    image_workdir: str | None = None
    image_user: str | None = None
    on_step: Callable[[StepResult], None] | None = None
    on_output: Callable[[int, str, str], None] | None = None

    @property
    def cache_dir(self) -> Path:
        return self.store.root / "build-cache"

    def report(self, index: int, kind: str, stage: str, fraction: float) -> None:
        if self.progress is None:
            return
        total = len(self.recipe.steps) + 1
        overall = (index + min(max(fraction, 0.0), 1.0)) / total
        try:
            self.progress(f"[{index}/{total - 1}] {kind}: {stage}", overall)
        except Exception:  # a broken progress callback must not fail the build
            log.exception("progress callback failed")

    def step_done(self, result: StepResult) -> None:
        if self.on_step is not None:
            try:
                self.on_step(result)
            except Exception:  # a broken callback must not fail the build
                log.exception("on_step callback failed")

    def output(self, index: int, stream: str, line: str) -> None:
        if self.on_output is not None:
            try:
                self.on_output(index, stream, line)
            except Exception:
                log.exception("on_output callback failed")

    # ------------------------------------------------------------------ cache

    def _cache_get(self, key: str) -> LayerRef | None:
        path = self.cache_dir / f"{key}.json"
        try:
            layer = LayerRef.model_validate_json(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable build cache entry %s: %s", path, exc)
            return None
        try:
            lp = self.store.layer_path(layer.digest)
        except ImageError:
            return None  # the layer was GC'd (or damaged): rebuild
        if lp.stat().st_size != layer.size:
            return None
        self._touch([layer])
        return layer

    def _cache_put(self, key: str, layer: LayerRef) -> None:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / f"{key}.json"
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            tmp.write_text(layer.model_dump_json(indent=2) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _touch(self, layers: list[LayerRef]) -> None:
        # LayerStore.gc spares layers stored or used (LayerStore.touch) within its min_age (600 s
        # by default). A cached layer no manifest names yet could otherwise be deleted between its
        # cache hit and the final manifest. The use stamp is a file of its own: the layer file is
        # not touched, so its verification stays valid.
        for layer in layers:
            if self.store.layer_ref(layer.digest) is not None:
                continue
            with contextlib.suppress(OSError, ImageError):
                self.store.touch(self.store.layer_path(layer.digest))

    async def cached(self, key: str, build: Callable[[], Awaitable[LayerRef]]) -> tuple[LayerRef, bool]:
        hit = await asyncio.to_thread(self._cache_get, key)
        if hit is not None:
            return hit, True
        layer = await build()
        await asyncio.to_thread(self._cache_put, key, layer)
        return layer, False

    def push(self, layer: LayerRef) -> bool:
        """Put ``layer`` on top of the stack, unless the stack has it already: return whether it did.

        An overlay cannot mount a layer twice, and the daemon keeps the first (lowest) occurrence
        of a layer named twice in an environment; the stack keeps that one too, so it is always
        mountable and exactly what build sandboxes run on. Moving the layer up instead would put
        it above layers that were built on top of it.
        """
        if any(x.digest == layer.digest for x in self.stack):
            return False
        self.stack.append(layer)
        return True

    def below(self) -> list[str]:
        return [x.digest for x in self.stack]

    def scratch(self, name: str) -> Path:
        return self.workdir / name

    # ------------------------------------------------------------------ daemon

    def get_client(self) -> AsyncClient:
        if self.client is None:
            if self.client_factory is None:
                raise RecipeError("needs a running daemon (build_recipe got no client_factory)")
            self.client = self.client_factory()
        return self.client


async def _publish_step(ctx: _Ctx, i: int, kind: str, key: str, ref: str, layer: LayerRef) -> str:
    name, tag = parse_ref(ref)
    record = {"recipe": ctx.recipe.ref, "step": i, "kind": kind, "key": key}
    await asyncio.to_thread(ctx.store.put_manifest, name, tag, [layer], recipe=json.dumps(record))
    return f"{name}:{tag}"


__all__ = ["BuildResult", "StepResult"]
