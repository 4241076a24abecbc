"""Warm pools: sandboxes created ahead of demand and handed out, once, on create.

A pool is keyed by image and resource shape: everything that is fixed when the runtime starts a
sandbox. Everything else in a spec (env, workdir, user, labels, TTLs) is applied per request, so a
pooled sandbox serves any spec with its key. A pooled sandbox is never returned to a pool: it is
handed out to exactly one caller and destroyed when that caller stops it.

Pool members have no state row: after a daemon crash they are residue without a row, which the next
start removes like any other. Targets are the configured size plus, when `adaptive_max` > 0, enough
to cover one `horizon` of the recent create rate for that key.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from sandfleet.backends.base import LiveSandbox, TierBackend
from sandfleet.daemon.node.admission import Admission
from sandfleet.errors import ResourceExhaustedError, SandboxError
from sandfleet.images import ImageManifest
from sandfleet.models import Resources, SandboxSpec
from sandfleet.runtime.agent_errors import AgentError

log = logging.getLogger("sandfleet.pool")
WARM_UP_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class PoolConfig(BaseModel):
    """One warm pool: `size` sandboxes of `image` with `resources`, kept ready."""

    model_config = ConfigDict(extra="forbid")

    image: str | None = Field(
        None, description="image reference, as callers will ask for it (default busybox unless `layers` is given)"
    )
    layers: list[str] = Field(default_factory=list, description="layers on top of `image`, as callers ask for them")
    resources: Resources = Field(default_factory=Resources)
    size: int = Field(8, ge=0, le=10000, description="sandboxes kept ready")


@dataclass(frozen=True)
class PoolKey:
    backend: str
    image: str | None
    layers: tuple[str, ...]
    resources: Resources

    def spec(self) -> SandboxSpec:
        return SandboxSpec(backend=self.backend, image=self.image, layers=list(self.layers), resources=self.resources)

    def describe(self) -> str:
        r = self.resources
        return f"{self.spec().environment()} cpu={r.cpu:g} mem={r.memory} pids={r.pids} disk={r.disk}"


@dataclass
class _Pool:
    key: PoolKey
    configured: int = 0
    ready: collections.deque[LiveSandbox] = field(default_factory=collections.deque)
    filling: int = 0
    rate: float = 0.0  # creates/s, exponentially weighted
    last_demand: float = 0.0
    image: ImageManifest | None = None  # what the last member was made from (its env/workdir/user defaults)


def pool_key(spec: SandboxSpec) -> PoolKey | None:
    """The pool a spec can be served from, or None (bind mounts, hostnames, the QoS class and tier
    options are fixed at start; pools hold latency-sensitive sandboxes without options)."""
    if spec.mounts or spec.hostname is not None or spec.qos != "latency_sensitive" or spec.options is not None:
        return None
    return PoolKey(spec.backend, spec.image, tuple(spec.layers), spec.resources)


class WarmPools:
    def __init__(
        self,
        *,
        backend: TierBackend,
        admission: Admission,
        resolve_environment: Callable[[SandboxSpec], Awaitable[ImageManifest]],
        new_id: Callable[[], str],
        sandbox_count: Callable[[], int],
        configured: list[PoolConfig],
        adaptive_max: int = 0,
        refill_concurrency: int = 2,
        horizon: float = 1.0,
        debounce: float = 0.05,
    ) -> None:
        self.backend = backend
        self.admission = admission
        self.resolve_environment = resolve_environment
        self.new_id = new_id
        self.sandbox_count = sandbox_count
        self.adaptive_max = adaptive_max
        self.refill_concurrency = refill_concurrency
        self.horizon = horizon
        self.debounce = debounce
        self.pools: dict[PoolKey, _Pool] = {}
        for cfg in configured:
            key = pool_key(
                SandboxSpec(backend=backend.name, image=cfg.image, layers=cfg.layers, resources=cfg.resources)
            )
            assert key is not None
            self.pools.setdefault(key, _Pool(key)).configured += cfg.size
        self._dead: list[tuple[PoolKey, LiveSandbox]] = []
        self._wake = asyncio.Event()
        self._slots = asyncio.Semaphore(refill_concurrency)
        self._closing = False

    # -- accounting ---------------------------------------------------------------------------

    def pooled(self) -> int:
        return sum(len(p.ready) + p.filling for p in self.pools.values())

    def layer_digests(self) -> set[str]:
        """Layers the ready members run on (image garbage collection keeps them)."""
        return {str(d) for p in self.pools.values() for live in p.ready for d in live.runtime.get("layers", [])}

    def sizes(self) -> dict[str, int]:
        return {p.key.describe(): len(p.ready) for p in self.pools.values()}

    def ready(self) -> dict[str, int]:
        """Members ready in each configured pool (`sandfleet_pool_ready`)."""
        return {p.key.describe(): len(p.ready) for p in self.pools.values() if p.configured}

    def empty(self) -> list[str]:
        """The configured pools with no member ready (a create of theirs waits for a cold start)."""
        return [p.key.describe() for p in self.pools.values() if p.configured and not p.ready]

    def target(self, pool: _Pool, now: float) -> int:
        adaptive = 0
        if self.adaptive_max > 0 and now - pool.last_demand < 60:
            adaptive = min(self.adaptive_max, math.ceil(pool.rate * self.horizon))
        return pool.configured + adaptive

    # -- hand-out -----------------------------------------------------------------------------

    def image(self, key: PoolKey | None) -> ImageManifest | None:
        """The environment the members of pool `key` were made from (None: no member yet)."""
        pool = self.pools.get(key) if key is not None else None
        return pool.image if pool is not None else None

    def take(self, key: PoolKey | None) -> LiveSandbox | None:
        """A ready sandbox of pool `key` (`pool_key(spec)`), or None; records demand either way."""
        if key is None or (key not in self.pools and self.adaptive_max == 0):
            return None
        pool = self.pools.setdefault(key, _Pool(key))
        now = time.monotonic()
        if pool.last_demand:
            gap = max(now - pool.last_demand, 1e-3)
            pool.rate = 0.8 * pool.rate + 0.2 * (1.0 / gap)
        pool.last_demand = now
        self._wake.set()
        while pool.ready:
            live = pool.ready.popleft()
            if not live.channel.closed:
                live.channel.on_close = None
                return live
            self._dead.append((key, live))  # died while waiting: the refill loop removes it
        return None

    # -- refill ---------------------------------------------------------------------------------

    async def run(self, spawn: Callable[[Awaitable[None], str], object]) -> None:
        """Keep every pool at its target; `spawn` starts a guarded task in the daemon's task group."""
        while not self._closing:
            for pool in self.pools.values():
                for live in [x for x in pool.ready if x.channel.closed]:
                    pool.ready.remove(live)
                    self._dead.append((pool.key, live))
            while self._dead:
                await self._destroy(*self._dead.pop())
            now = time.monotonic()
            for pool in list(self.pools.values()):
                short = self.target(pool, now) - len(pool.ready) - pool.filling
                for _ in range(max(0, short)):
                    if self._slots.locked():
                        break
                    pool.filling += 1
                    await self._slots.acquire()
                    spawn(self._fill_one(pool), f"pool-fill-{pool.key.describe()}")
            self._wake.clear()
            try:
                async with asyncio.timeout(0.25):
                    await self._wake.wait()
            except TimeoutError:
                pass
            else:
                # Let the request that took a sandbox (and its first exec) finish before a refill
                # competes with it for the CPU: on a small node that halves hand-out latency.
                await asyncio.sleep(self.debounce)

    async def _fill_one(self, pool: _Pool) -> None:
        key = pool.key
        committed = False
        try:
            self.admission.admit(self.sandbox_count(), key.resources)
            self.admission.commit(key.resources)
            committed = True
            spec = key.spec()
            image = await self.resolve_environment(spec)
            live = await self.backend.create(self.new_id(), spec, image)
            if self._closing:
                await self.backend.destroy(live)
                self.admission.release(key.resources)
                return
            live.channel.on_close = lambda _ch: self._wake.set()
            await self._warm_up(live)
            pool.image = image
            pool.ready.append(live)
            committed = False  # the budget now travels with the pooled sandbox
        except ResourceExhaustedError:
            await asyncio.sleep(1.0)  # the node is full: pools yield to real demand
        except SandboxError:
            log.exception("warm pool %s: create failed", key.describe())
            await asyncio.sleep(1.0)
        finally:
            if committed:
                self.admission.release(key.resources)
            pool.filling -= 1
            self._slots.release()
            self._wake.set()

    @staticmethod
    async def _warm_up(live: LiveSandbox) -> None:
        """Run one `true` through the shell, as a user's first exec would, so that exec finds the
        overlay's lookups and the shell's pages warm. Leaves nothing behind; a failure just leaves
        the sandbox cold."""
        try:
            process = await live.channel.start(["/bin/sh", "-c", "true"], env={"PATH": WARM_UP_PATH}, timeout=5)
            await process.wait()
        except (SandboxError, AgentError, OSError) as exc:
            log.debug("warm-up of pooled sandbox %s failed: %s", live.id, exc)

    async def shrink(self) -> None:
        """Destroy pooled sandboxes beyond their pool's current target (demand went away)."""
        now = time.monotonic()
        for pool in self.pools.values():
            while len(pool.ready) > self.target(pool, now):
                live = pool.ready.pop()
                await self._destroy(pool.key, live)

    async def drain(self) -> None:
        """Destroy every pooled sandbox (daemon shutdown)."""
        self._closing = True
        self._wake.set()
        for pool in self.pools.values():
            while pool.ready:
                await self._destroy(pool.key, pool.ready.pop())

    async def _destroy(self, key: PoolKey, live: LiveSandbox) -> None:
        try:
            await self.backend.destroy(live)
        except Exception:
            log.exception("destroying pooled sandbox %s failed", live.id)
            return  # keeps its budget; residue is cleaned at the next start
        self.admission.release(key.resources)
