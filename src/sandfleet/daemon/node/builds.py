"""Recipe builds as jobs of the node: `sandfleet images build recipe.toml` and the SDK send the recipe
here (the one way into the layer store), and get its progress, each step and its commands' output
as a stream. `run` and `pip` steps run in build sandboxes the job creates through the node's own API
(`client_factory`); a client that goes away cancels the build.
"""

from __future__ import annotations

import asyncio
import builtins
import os
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.node.core import EventStream, NodeCore
from sandfleet.daemon.node.image_service import image_info
from sandfleet.errors import InvalidArgumentError
from sandfleet.images.recipe import Recipe, RecipeError
from sandfleet.images.recipe_build import build_recipe
from sandfleet.images.recipe_context import StepResult
from sandfleet.models import BuildEvent

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient


class Builds:
    def __init__(
        self,
        core: NodeCore,
        *,
        import_dirs: builtins.list[Path] | None,
        client_factory: Callable[[], AsyncClient] | None = None,
    ) -> None:
        self.core = core
        self.import_dirs = import_dirs
        self.client_factory = client_factory  # a client of this node, for build sandboxes

    async def build_recipe(self, text: str, base_dir: str) -> EventStream[BuildEvent]:
        # Resolved once: the check and the build see the same directory.
        base = Path(await asyncio.to_thread(os.path.realpath, base_dir))
        if not await asyncio.to_thread(base.is_dir):
            raise InvalidArgumentError(f"base_dir {base_dir!r} is not a directory on the node")
        if self.import_dirs is not None and not await asyncio.to_thread(_within, base, self.import_dirs):
            raise InvalidArgumentError(f"base_dir {base_dir!r} is outside the node's import_dirs")
        try:
            recipe = Recipe.parse(text, base, origin="recipe")
        except RecipeError as exc:
            raise to_wire_error(exc, limit=2000) from exc
        queue: asyncio.Queue[BuildEvent | BaseException | None] = asyncio.Queue()

        def progress(stage: str, fraction: float) -> None:
            queue.put_nowait(BuildEvent(type="progress", stage=stage, fraction=round(fraction, 4)))

        def on_step(r: StepResult) -> None:
            queue.put_nowait(
                BuildEvent(
                    type="step",
                    index=r.index,
                    kind=r.kind,
                    cache_hit=r.cache_hit,
                    layer=r.layer,
                    seconds=round(r.seconds, 3),
                    name=r.name,
                )
            )

        def on_output(index: int, stream: str, line: str) -> None:
            queue.put_nowait(BuildEvent(type="output", index=index, stream=stream, line=line))

        async def job() -> None:
            try:
                result = await build_recipe(
                    recipe,
                    self.core.store,
                    client_factory=self.client_factory,
                    progress=progress,
                    on_step=on_step,
                    on_output=on_output,
                )
                queue.put_nowait(
                    BuildEvent(
                        type="done",
                        image=image_info(result.manifest),
                        steps=len(result.steps),
                        cache_hits=result.cache_hits,
                    )
                )
            except Exception as exc:  # noqa: BLE001 (handed to the stream, typed there)
                queue.put_nowait(to_wire_error(exc, limit=2000))
            finally:
                queue.put_nowait(None)

        task = self.core.spawn(job(), name=f"build-{recipe.ref}")

        async def events() -> AsyncGenerator[BuildEvent, None]:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item

        async def release() -> None:
            if not task.done():  # the client went away: the build stops
                task.cancel()

        return EventStream(events(), release)


def _within(real: Path, dirs: builtins.list[Path]) -> bool:
    """Whether the resolved path `real` is one of `dirs` (symlinks resolved) or under one."""
    return any(real == d or d in real.parents for d in (Path(os.path.realpath(x)) for x in dirs))
