"""Fencing: a node the cluster declared lost comes back under a new generation, holding nothing.

When a cluster declares a node lost (its Ray node left), gateways answer `sandbox_lost` for
everything it held, and callers start their work anew elsewhere. If the node then returns (its
daemon restarted and adopted its sandboxes, or a partition healed), those sandboxes must not be
served again: `sandfleet cluster up` fences the node before registering it, with a generation one
above the one the cluster gave up on. A fence to a higher generation stops every sandbox the node
holds, sets its trajectories' logs aside and drops its idempotency keys (callers were told all of
it is lost: an id or a key used again makes something new, here or elsewhere, never what was
given up), then records the generation in `<state_dir>/generation` (in that order: a crash in
between fences again); the node reports its generation in its load, and gateways take no node whose
generation is below the one it registered under. A fence to the node's own generation or lower
does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.lifecycle import LIVE_STATES
from sandfleet.daemon.rl.trajectories import Trajectories
from sandfleet.errors import InternalError


class Fencing:
    def __init__(self, core: NodeCore, trajectories: Trajectories, path: Path) -> None:
        self.core = core
        self.trajectories = trajectories
        self.path = path  # holds the generation, one decimal number
        self.generation = 0
        self._lock = asyncio.Lock()

    async def load(self) -> None:
        """The generation a previous daemon recorded (0: never fenced)."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.generation = int((await asyncio.to_thread(self.path.read_text)).strip())

    async def fence(self, generation: int) -> None:
        async with self._lock:
            if generation <= self.generation:
                return
            reason = f"fenced: the cluster declared node {self.core.node_key} lost (now generation {generation})"
            held = [sb.id for sb in self.core.table.matching({}, LIVE_STATES)]
            log.warning("fenced at generation %d: stopping the %d sandboxes held", generation, len(held))
            results = await asyncio.gather(*(self.core.stop(i, reason) for i in held), return_exceptions=True)
            failed = [i for i, r in zip(held, results, strict=True) if isinstance(r, BaseException)]
            if failed:  # something still runs: the generation stays, so the next fence tries again
                raise InternalError(f"fence: {len(failed)} sandboxes could not be stopped (e.g. {failed[0]}): retry")
            await self.trajectories.fence("fenced")
            await self._drop_keys()
            await asyncio.to_thread(_write, self.path, generation)
            self.generation = generation

    async def _drop_keys(self) -> None:
        """Forget every idempotency key, in memory and in the rows kept (a restart reads them back)."""
        self.core.keys.clear()
        for row in await self.core.state.all():
            if row.idempotency_key is not None:
                await self.core.state.update(row.id, idempotency_key=None, idempotency_fingerprint=None)


def _write(path: Path, generation: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{generation}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
