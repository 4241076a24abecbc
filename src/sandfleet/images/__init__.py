"""Local image store: content-addressed EROFS layers, name:tag manifests, built-in recipes."""

from .builders import debian_mirror  # imported first: it registers the built-in recipes
from .builtin_images import BUILTIN_IMAGES, BuildContext, Builder, register_builtin
from .fsutil import DiffStats, diff_trees, shift_ownership
from .models import (
    ImageBuildError,
    ImageError,
    ImageManifest,
    ImageNotFoundError,
    InvalidRefError,
    LayerCorruptError,
    LayerKind,
    LayerRef,
    canonical_ref,
    parse_ref,
)
from .oci_errors import OciImportError
from .oci_import import import_image
from .recipe import Recipe, RecipeError
from .recipe_build import build_recipe
from .recipe_context import BuildResult, StepResult
from .store import LayerStore, ProgressFn

__all__ = [
    "BUILTIN_IMAGES",
    "BuildContext",
    "BuildResult",
    "Builder",
    "DiffStats",
    "ImageBuildError",
    "ImageError",
    "ImageManifest",
    "ImageNotFoundError",
    "InvalidRefError",
    "LayerCorruptError",
    "LayerKind",
    "LayerRef",
    "LayerStore",
    "OciImportError",
    "ProgressFn",
    "Recipe",
    "RecipeError",
    "StepResult",
    "build_recipe",
    "canonical_ref",
    "debian_mirror",
    "diff_trees",
    "import_image",
    "parse_ref",
    "register_builtin",
    "shift_ownership",
]
