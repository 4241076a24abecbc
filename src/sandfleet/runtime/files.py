"""The former name of what backends/container.py still imports: `openat2` and `mount_points`.

`files` is also daemon/files.py; this alias goes once backends/ imports `runtime.openat2` and
`runtime.sandboxfs.paths` itself (backends/ is being moved by another change).
"""

from sandfleet.runtime.openat2 import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2
from sandfleet.runtime.sandboxfs.paths import mount_points

__all__ = ["RESOLVE_BENEATH", "RESOLVE_NO_MAGICLINKS", "RESOLVE_NO_SYMLINKS", "mount_points", "openat2"]
