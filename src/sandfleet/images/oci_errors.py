"""What an OCI import refuses: its errors, the caps on what one import may unpack, its read size."""

from __future__ import annotations

from .models import ImageError, InvalidRefError

_CHUNK = 1 << 20
# Caps on what one import may unpack; import_image takes overrides. Entries: each costs inodes and
# bookkeeping (dir mtimes, whiteouts) while its layer unpacks. Bytes: of uncompressed tar, which
# is what lands in the staging dir (a small gzip can expand a thousandfold).
MAX_PATH_DEPTH = 256
MAX_ENTRIES_PER_LAYER = 2_000_000
MAX_LAYER_BYTES = 64 << 30
MAX_IMPORT_BYTES = 256 << 30
# The daemon runs environments of at most 32 layers (service.MAX_LAYERS: one overlay's mount
# options must fit a page), so an import merges layers down to this many.
MAX_LAYERS = 32


class OciImportError(ImageError):
    """The archive can't be imported: unreadable, inconsistent, unsupported or unsafe."""


class OciRefError(OciImportError, InvalidRefError):
    """No usable ``name:tag`` for the imported image: the caller has to pass one."""


__all__ = [
    "MAX_ENTRIES_PER_LAYER",
    "MAX_PATH_DEPTH",
    "MAX_IMPORT_BYTES",
    "MAX_LAYERS",
    "MAX_LAYER_BYTES",
    "OciImportError",
    "OciRefError",
]
