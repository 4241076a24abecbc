"""Pydantic models and errors for the local layer store."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LayerKind = Literal["base", "layer"]

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# Names are path-like ("debian", "base/debian"); tags follow the OCI tag grammar.
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
DEFAULT_TAG = "latest"


class ImageError(Exception):
    """Base class for image store errors."""


class ImageNotFoundError(ImageError, LookupError):
    """No manifest for the ref, and no built-in recipe to build it."""


class InvalidRefError(ImageError, ValueError):
    """The ref string is not a valid ``name[:tag]``."""


class LayerCorruptError(ImageError):
    """A layer file is missing or does not match its recorded size/digest."""


class ImageBuildError(ImageError):
    """Building a built-in image failed."""


class LayerRef(BaseModel):
    """One immutable EROFS layer, addressed by the sha256 of the image file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    digest: str = Field(pattern=DIGEST_RE.pattern)
    size: int = Field(ge=0)
    kind: LayerKind
    description: str = ""
    blob: str | None = Field(
        None,
        pattern=DIGEST_RE.pattern,
        description="on-demand layer: the file data lives in this blob of the shared store and `digest` names "
        "only the (small) metadata image, which is read locally",
    )
    blob_size: int | None = Field(None, ge=0)


class ImageManifest(BaseModel):
    """A named, tagged stack of layers (``layers`` is ordered bottom -> top)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_RE.pattern)
    tag: str = Field(pattern=TAG_RE.pattern)
    layers: list[LayerRef]
    created: float
    recipe: str = ""
    env: dict[str, str] = Field(default_factory=dict, description="environment defaults (an OCI config's Env)")
    workdir: str | None = Field(None, description="default working directory (an OCI config's WorkingDir)")
    user: str | None = Field(None, description="default user (an OCI config's User)")

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


def parse_ref(ref: str) -> tuple[str, str]:
    """Split ``name[:tag]`` (tag defaults to ``latest``) and validate both parts."""
    name, sep, tag = ref.partition(":")
    if not sep:
        tag = DEFAULT_TAG
    if not NAME_RE.match(name) or ".." in name.split("/"):
        raise InvalidRefError(f"invalid image name in ref {ref!r}")
    if not TAG_RE.match(tag):
        raise InvalidRefError(f"invalid image tag in ref {ref!r}")
    return name, tag


def canonical_ref(ref: str) -> str:
    name, tag = parse_ref(ref)
    return f"{name}:{tag}"
