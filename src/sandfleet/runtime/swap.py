"""Compressed swap (zram) for paused sandboxes, set up by the daemon when the host has no swap.

Pausing a sandbox freezes its cgroup and pushes its memory out; anonymous pages need somewhere to go,
and a compressed in-memory swap device keeps them at a fraction of their size (agents' heaps compress
3-4x) without a disk. A host that already has swap (zram, zswap in front of a file, a partition) is
left as it is. The device stays after the daemon exits: paused sandboxes may still have pages in it.
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger("sandfleet.swap")

SYS_BLOCK = Path("/sys/block")
ZRAM_CONTROL = Path("/sys/class/zram-control")


class SwapSetupError(RuntimeError):
    pass


def active_swap(proc_swaps: Path = Path("/proc/swaps")) -> list[str]:
    """Devices or files in use as swap."""
    try:
        lines = proc_swaps.read_text().splitlines()[1:]
    except OSError:
        return []
    return [line.split()[0] for line in lines if line.strip()]


def _free_zram() -> Path:
    """An unused zram device (disksize 0), made with hot_add if none is free."""
    for dev in sorted(SYS_BLOCK.glob("zram*")):
        if (dev / "disksize").read_text().strip() == "0":
            return dev
    hot_add = ZRAM_CONTROL / "hot_add"
    if not hot_add.exists():
        raise SwapSetupError("no zram device (modprobe zram, or CONFIG_ZRAM in the kernel)")
    return SYS_BLOCK / f"zram{hot_add.read_text().strip()}"


def ensure_compressed_swap(size: int) -> str:
    """Make sure the host has swap; add a zram device of `size` bytes if it has none. Blocking.

    Returns a description for logs and `doctor`.
    """
    existing = active_swap()
    if existing:
        return f"existing swap: {', '.join(existing)}"
    if size <= 0:
        return "no swap (zram disabled by configuration): paused sandboxes keep their anonymous memory"
    dev = _free_zram()
    algorithms = (dev / "comp_algorithm").read_text().replace("[", "").replace("]", "").split()
    for algorithm in ("lz4", "lzo-rle", "lzo"):
        if algorithm in algorithms:
            (dev / "comp_algorithm").write_text(algorithm)
            break
    (dev / "disksize").write_text(str(size))
    node = f"/dev/{dev.name}"
    for argv in (["mkswap", node], ["swapon", "-p", "100", node]):
        res = subprocess.run(argv, capture_output=True, text=True)
        if res.returncode != 0:
            raise SwapSetupError(f"{' '.join(argv)} failed: {res.stderr.strip()}")
    log.info("compressed swap: %s, %d MiB", node, size >> 20)
    return f"zram swap {node} ({size >> 20} MiB) set up by the daemon"
