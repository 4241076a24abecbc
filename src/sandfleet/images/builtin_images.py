"""What a built-in image recipe is (`Builder`, `BuildContext`) and the registry they are in.

The recipes themselves (`builders`) sit on top of the store and register into `BUILTIN_IMAGES` when
`sandfleet.images` is imported."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .models import (
    ImageManifest,
    LayerRef,
    canonical_ref,
)

if TYPE_CHECKING:
    from .store import LayerStore, ProgressFn

log = logging.getLogger(__name__)


@dataclass
class BuildContext:
    """What a recipe gets: the store, a private scratch dir (removed afterwards), progress."""

    store: LayerStore
    workdir: Path
    progress: ProgressFn | None = None
    lo: float = 0.0
    hi: float = 1.0

    def report(self, stage: str, fraction: float) -> None:
        if self.progress is None:
            return
        frac = self.lo + (self.hi - self.lo) * min(max(fraction, 0.0), 1.0)
        try:
            self.progress(stage, frac)
        except Exception:  # a broken progress callback must not fail the build
            log.exception("progress callback failed")

    def sub(self, lo: float, hi: float) -> ProgressFn:
        """Progress callback for a nested build, mapped onto [lo, hi] of this one."""

        def cb(stage: str, fraction: float) -> None:
            self.report(stage, lo + (hi - lo) * fraction)

        return cb


_BUILDER_VERSION_RE = re.compile(r" \[builder v(\d+)\]$")


@dataclass(frozen=True)
class Builder:
    """A built-in recipe. ``build`` returns the full layer stack, bottom -> top.

    The manifest records ``manifest_recipe``: ``recipe``, plus ``[builder vN]`` from version 2 on.
    A stored image is rebuilt (`LayerStore.ensure`) when it is `outdated`: made by an older
    version of this builder (a lower ``[builder vN]``, or a recipe string in ``legacy_recipes``,
    the versions from before it was numbered), or when ``stale`` says so. An image of the same name
    that the builder did not make (imported, pushed) is never replaced. The old layers stay in the
    store: sandboxes and snapshots using them keep working, and `images gc` removes them once
    nothing does.
    """

    recipe: str
    build: Callable[[BuildContext], Awaitable[list[LayerRef]]]
    version: int = 1
    legacy_recipes: tuple[str, ...] = ()
    stale: Callable[[LayerStore, ImageManifest], bool] | None = None

    @property
    def manifest_recipe(self) -> str:
        return self.recipe if self.version <= 1 else f"{self.recipe} [builder v{self.version}]"

    def outdated(self, store: LayerStore, manifest: ImageManifest) -> bool:
        """Whether `manifest` (of this builder's ref) was made by an older version of it."""
        if self.stale is not None:
            return self.stale(store, manifest)
        if manifest.recipe in self.legacy_recipes:
            return True
        found = _BUILDER_VERSION_RE.search(manifest.recipe)
        return found is not None and int(found.group(1)) < self.version


BUILTIN_IMAGES: dict[str, Builder] = {}


def register_builtin(ref: str, builder: Builder) -> None:
    """Add (or replace) a built-in recipe; ``ref`` is ``name[:tag]``."""
    BUILTIN_IMAGES[canonical_ref(ref)] = builder
