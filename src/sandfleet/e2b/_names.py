"""The names of a sandbox's users and groups (envd names a file's owner and group), read from its
/etc/passwd and /etc/group and kept a minute per sandbox."""

from __future__ import annotations

import collections
import time

from sandfleet.client.aio import AsyncSandbox
from sandfleet.errors import SandboxError

KEEP = 60.0  # seconds a sandbox's names are kept
MAX_SANDBOXES = 256
MAX_BYTES = 1 << 20  # of each file read

Names = tuple[dict[int, str], dict[int, str]]  # users, groups by id
_cache: collections.OrderedDict[str, tuple[float, Names]] = collections.OrderedDict()


def _table(text: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) > 2 and fields[2].isascii() and fields[2].isdigit():
            found.setdefault(int(fields[2]), fields[0])
    return found


async def names(sb: AsyncSandbox) -> Names:
    """Only ever asked after a call of the caller's on this sandbox succeeded (the names decorate
    entries that call returned), so the cache is by sandbox."""
    hit = _cache.get(sb.id)
    if hit is not None and time.monotonic() - hit[0] < KEEP:
        _cache.move_to_end(sb.id)
        return hit[1]
    tables: list[dict[int, str]] = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            tables.append(_table((await sb.files.read(path, length=MAX_BYTES)).decode(errors="replace")))
        except SandboxError:  # none there (a busybox image without one): numbers then
            tables.append({})
    found: Names = (tables[0], tables[1])
    _cache[sb.id] = (time.monotonic(), found)
    while len(_cache) > MAX_SANDBOXES:
        _cache.popitem(last=False)
    return found
