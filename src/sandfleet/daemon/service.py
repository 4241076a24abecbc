"""The node: its concerns wired together, and what is the node's own (health, load, drain, fence,
metrics, the audit stream). The routes call the concerns themselves (daemon/api/, as declared in
sandfleet/operations.py): nothing here hands a call on.

TierBackend-independent: a backend only creates/destroys sandboxes and hands back a `LiveSandbox`
(agent channel + root). Each concern lives in a module of its own, each calling only those below
it (docs/architecture.md lists them, bottom to top: lifecycle, core, pausing, ..., recovery).

Every long-lived task (reaper, event flusher, background processes, session readers) runs in the
service's task group; nothing is fire-and-forget.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandfleet import __version__
from sandfleet.backends.base import TierBackend, capabilities
from sandfleet.daemon.net.policy import NetworkConfig
from sandfleet.daemon.net.sandbox_network import Networking
from sandfleet.daemon.node.admission import Admission, AdmissionPolicy
from sandfleet.daemon.node.alerts import Alerts, AlertsConfig
from sandfleet.daemon.node.builds import Builds
from sandfleet.daemon.node.checkpoints import Checkpoints
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.creation import Creation
from sandfleet.daemon.node.execs import Execs
from sandfleet.daemon.node.fencing import Fencing
from sandfleet.daemon.node.image_service import Images
from sandfleet.daemon.node.jobstore import JobStore
from sandfleet.daemon.node.lifecycle import LIVE_STATES
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.daemon.node.monitor import Monitor
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.daemon.node.pool import WarmPools
from sandfleet.daemon.node.reaper import Reaper
from sandfleet.daemon.node.recovery import Recovery
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.daemon.node.sessions import Sessions
from sandfleet.daemon.node.snapshots import Snapshots
from sandfleet.daemon.node.state import StateStore
from sandfleet.daemon.node.stateless_calls import Calls
from sandfleet.daemon.rl.trajectories import Trajectories, TrajectoryConfig
from sandfleet.daemon.rl.verify import Verifier, VerifyConfig
from sandfleet.daemon.security.audit import AuditLog
from sandfleet.daemon.security.detectors import DetectorsConfig
from sandfleet.errors import UnsupportedError
from sandfleet.ids import new_node_key
from sandfleet.images import ImageManifest, LayerStore
from sandfleet.models import (
    AuditQuery,
    AuditRecord,
    Health,
    NodeLoad,
    ProjectUsage,
    SandboxSpec,
)

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient


class SandboxManager:
    """A node's sandbox service: its concerns (`core`, `creation`, `execs`, `files`, ...) and their lifetime."""

    def __init__(
        self,
        *,
        backends: builtins.list[TierBackend],
        store: LayerStore,
        state: StateStore,
        metrics: Metrics,
        admission: Admission | None = None,
        pools: WarmPools | None = None,
        stopped_retention: float = 300.0,
        reaper_interval: float = 1.0,
        build_missing_images: bool = True,
        snapshot_dir: Path | None = None,
        snapshot_retention: float | None = None,
        snapshot_max_bytes: int | None = None,
        checkpoint_standbys: bool = True,
        import_dirs: builtins.list[Path] | None = None,
        client_factory: Callable[[], AsyncClient] | None = None,
        network: NetworkConfig | None = None,
        detectors: DetectorsConfig | None = None,
        audit: AuditLog | None = None,
        run_dir: Path | None = None,
        monitor_interval: float = 5.0,
        trajectories: TrajectoryConfig | None = None,
        trajectory_dir: Path | None = None,
        verify: VerifyConfig | None = None,
        node_key: str | None = None,
        node_group: str = "default",
        node_labels: dict[str, str] | None = None,
        job_label: str = "job",
        alerts: AlertsConfig | None = None,
        metrics_per_sandbox: bool = False,
    ) -> None:
        """`client_factory`: a client of this node's own API (recipe builds create their build
        sandboxes through it)."""
        core = NodeCore(
            backends=backends,
            store=store,
            state=state,
            metrics=metrics,
            admission=admission or Admission(AdmissionPolicy()),
            pools=pools,
            stopped_retention=stopped_retention,
            reaper_interval=reaper_interval,
            node_key=node_key or new_node_key(),
            job_label=job_label,
            metrics_per_sandbox=metrics_per_sandbox,
        )
        self.core = core
        self.node_group = node_group
        self.node_labels = dict(node_labels or {})
        core.node_labels = self.node_labels
        self._image_refs: tuple[float, builtins.list[str]] = (-math.inf, [])
        self.audit = audit
        self.pauser = Pauser(core)
        self.alerts = Alerts(core.jobs, metrics, alerts or AlertsConfig(), lambda: core.pools)
        self.job_store = JobStore(core.jobs, state.path.parent / "jobs.json")
        self.monitor = Monitor(core, self.pauser, detectors or DetectorsConfig(), audit, monitor_interval)
        self.networking = Networking(
            core, self.pauser, self.monitor, network or NetworkConfig(), run_dir or Path("/run/sandfleet")
        )
        self.images = Images(core, build_missing_images=build_missing_images, import_dirs=import_dirs)
        self.builds = Builds(core, import_dirs=import_dirs, client_factory=client_factory)
        self.files = Files(core, self.pauser, self.images)
        self.execs = Execs(core, self.pauser, self.files, self.networking)
        self.sessions = Sessions(core, self.pauser, self.files, self.execs)
        self.creation = Creation(core, self.images, self.files, self.networking)
        self.calls = Calls(core, self.pauser, self.creation)
        self.snapshots = Snapshots(
            core,
            self.pauser,
            self.images,
            self.creation,
            self.execs,
            self.sessions,
            snapshot_dir=snapshot_dir,
            retention=snapshot_retention,
            max_bytes=snapshot_max_bytes,
        )
        self.checkpoints = Checkpoints(
            core,
            self.pauser,
            self.snapshots,
            self.networking,
            state.path.parent / "checkpoints",
            standbys=checkpoint_standbys,
        )
        self.verifier = Verifier(core, self.creation, self.execs, self.files, self.snapshots, verify)
        self.trajectories = Trajectories(
            core,
            self.creation,
            self.execs,
            self.files,
            self.snapshots,
            self.checkpoints,
            self.verifier,
            trajectory_dir or state.path.parent / "trajectories",
            trajectories,
        )
        self.reaper = Reaper(core, self.pauser, self.images, self.snapshots)
        self.recovery = Recovery(core, self.pauser, self.snapshots, self.networking)
        self.fencing = Fencing(core, self.trajectories, state.path.parent / "generation")
        self.started_at = time.time()

    @property
    def pools(self) -> WarmPools | None:
        return self.core.pools

    @pools.setter
    def pools(self, pools: WarmPools | None) -> None:
        """Warm pools are made after the service (they create through its image resolution)."""
        self.core.pools = pools

    async def run(self, ready: Callable[[], Awaitable[None]]) -> None:
        """Recover state, then serve until `ready` returns; `ready` runs once recovery is done."""
        core = self.core
        if self.audit is not None:
            await self.audit.start()
        async with asyncio.TaskGroup() as tg:
            core.tg = tg
            if self.audit is not None:
                core.spawn(self.audit.run(), name="audit-writer")
            await self.networking.start()
            await self.job_store.restore()  # (before recovery: what it finds counts in the jobs again)
            await self.recovery.recover()
            await self.checkpoints.recover()
            await self.trajectories.start()
            core.spawn(self.reaper.run(), name="reaper")
            core.spawn(self.checkpoints.standbys.run(), name="standby-sweeper")
            core.spawn(core.journal.run(), name="event-flusher")
            core.spawn(self.monitor.run(), name="monitor")
            core.spawn(core.jobs.run(), name="job-figures")
            core.spawn(self.job_store.run(), name="job-figures-saver")
            core.spawn(self.alerts.run(), name="alerts")
            if core.pools is not None:
                core.spawn(core.pools.run(core.spawn), name="warm-pools")
            try:
                await ready()
            finally:
                await self.trajectories.drain()
                core.shutting_down = True
                if core.pools is not None:
                    await core.pools.drain()
                await self.checkpoints.standbys.close()
                await core.journal.flush()
                await self.job_store.save()
                await core.state.touch_many(core.dirty_activity)
                await self.networking.close()
                if self.audit is not None:
                    await self.audit.flush()
                for task in list(core.tasks):
                    task.cancel()
        core.tg = None
        if self.audit is not None:
            await self.audit.close()

    def node_count(self) -> int:
        return self.core.node_count()

    async def resolve_environment(self, spec: SandboxSpec) -> ImageManifest:
        return await self.images.resolve_environment(spec)

    # -- node ------------------------------------------------------------------------------------

    async def health(self) -> Health:
        core = self.core
        return Health(
            status="ok",
            version=__version__,
            sandboxes_running=core.running_count(),
            backends=list(core.backends),
            pools=core.pools.sizes() if core.pools is not None else {},
            tiers={name: capabilities(backend) for name, backend in core.backends.items()},
        )

    async def node_load(self) -> NodeLoad:
        core = self.core
        now = time.monotonic()
        if now - self._image_refs[0] > 10.0:  # manifests are read from disk: not every second
            refs = sorted({m.ref for m in await asyncio.to_thread(core.store.list_images)})
            self._image_refs = (now, refs)
        return NodeLoad(
            key=core.node_key,
            group=self.node_group,
            labels=self.node_labels,
            draining=core.draining,
            sandboxes=core.table.count(*LIVE_STATES),
            capacity=core.admission.policy.max_sandboxes,
            tiers=list(core.backends),
            images=self._image_refs[1],
            projects={
                k: ProjectUsage(sandboxes=n, cpu=cpu, memory=mem)
                for k, (n, cpu, mem) in core.table.project_usage().items()
            },
            at=time.time(),
            generation=self.fencing.generation,
        )

    async def drain(self, draining: bool) -> NodeLoad:
        self.core.draining = draining
        log.info("node %s %s", self.core.node_key, "draining" if draining else "taking creates again")
        return await self.node_load()

    async def fence(self, generation: int) -> NodeLoad:
        await self.fencing.fence(generation)
        return await self.node_load()

    async def metrics_text(self) -> tuple[bytes, str]:
        metrics, adm = self.core.metrics, self.core.admission
        with contextlib.suppress(OSError), open("/proc/self/statm") as f:  # noqa: ASYNC230 (procfs)
            metrics.daemon_rss.set(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        metrics.admission_cpu_committed.set(adm.committed_cpu)
        metrics.admission_cpu_load.set(adm.cpu_load)
        metrics.admission_memory_committed.set(adm.committed_memory)
        metrics.pools_ready(self.core.pools.ready() if self.core.pools is not None else {})
        metrics.alive.set(self.core.running_count())  # (pauses and resumes move it too)
        # Per-sandbox series read thousands of cgroup files: off the event loop.
        return await asyncio.to_thread(generate_latest, metrics.registry), CONTENT_TYPE_LATEST

    # -- audit -------------------------------------------------------------------------------------

    def audit_call(self, actor: str, data: dict[str, Any]) -> None:
        """One API call, for the audit stream (the API's middleware calls it after answering)."""
        self.monitor.audit_record("api", data.pop("sandbox_id", None), data, actor=actor)

    async def read_audit(self, query: AuditQuery) -> builtins.list[AuditRecord]:
        audit = self._audit()
        rows = await audit.read(
            since=query.since,
            since_time=query.since_time,
            limit=query.limit,
            kinds=query.kinds,
            sandbox_id=query.sandbox_id,
            newest=query.newest,
        )
        return [AuditRecord.model_validate(r) for r in rows]

    async def follow_audit(self, query: AuditQuery, heartbeat: float) -> AsyncIterator[AuditRecord | None]:
        audit = self._audit()
        records = audit.follow(
            since=query.since,
            since_time=query.since_time,
            kinds=query.kinds,
            sandbox_id=query.sandbox_id,
            heartbeat=heartbeat,
        )
        async with contextlib.aclosing(records):
            async for r in records:
                yield None if r is None else AuditRecord.model_validate(r)

    def audit_last_seq(self) -> int:
        return self._audit().last_seq

    def _audit(self) -> AuditLog:
        if self.audit is None:
            raise UnsupportedError("this node keeps no audit stream")
        return self.audit
