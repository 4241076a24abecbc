"""Images: what a node holds, recipe builds, imports, gc."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sandfleet.models.common import MAX_PATH, MAX_REF, AbsPath, _Model


class ImageInfo(_Model):
    name: str
    tag: str
    layers: list[str]
    size: int = Field(description="bytes of the layer files (for on-demand layers: metadata plus data blobs)")
    created: float
    on_demand: bool = Field(False, description="its file data is read on demand from the shared store")


MAX_RECIPE = 1024**2


class RecipeBuildRequest(_Model):
    """A recipe (TOML text) for the daemon to build into its store; its `copy` and `git` sources are
    read from `base_dir` on the daemon's host (as `images import` reads archives)."""

    recipe: str = Field(max_length=MAX_RECIPE, description="the recipe's TOML text")
    base_dir: AbsPath = Field(description="the directory relative sources are read from (daemon's host)")


class BuildEvent(_Model):
    """One line of a recipe build's stream: progress, each step as it finishes (with the output of
    its commands before it), then one `done` carrying the image; `heartbeat` while nothing else."""

    type: Literal["progress", "output", "step", "done", "heartbeat"]
    stage: str | None = Field(None, description="progress: what the build is doing")
    fraction: float | None = Field(None, description="progress: how much of the build is done, 0..1")
    index: int | None = Field(None, description="output, step: the step's index (0: the base)")
    kind: str | None = Field(None, description="step: base, apt, pip, copy, git or run")
    cache_hit: bool | None = None
    layer: str | None = Field(None, description="step: the digest of the step's layer")
    seconds: float | None = None
    name: str | None = Field(None, description="step: the image the step's layer was published as, if any")
    stream: Literal["stdout", "stderr"] | None = None
    line: str | None = Field(None, description="output: one line a run or pip step printed")
    image: ImageInfo | None = Field(None, description="done: the image built")
    steps: int | None = Field(None, description="done: how many steps (the base included)")
    cache_hits: int | None = Field(None, description="done: how many came from the build cache")


class ImportRequest(_Model):
    path: str = Field(
        max_length=MAX_PATH,
        description="a `docker save` tarball, an OCI image layout directory or its tar (daemon's host)",
    )
    ref: str | None = Field(
        None, max_length=MAX_REF, description="name:tag for the image; default: the archive's own tag"
    )


class ImageList(_Model):
    images: list[ImageInfo]


class GcResult(_Model):
    removed: list[str] = Field(description="digests of the layer files deleted")
    bytes: int = Field(description="disk freed")
