"""The node's `SandboxService`: its parts wired together, and the protocol's calls handed to them.

Backend-independent: a backend only creates/destroys sandboxes and hands back a `LiveSandbox`
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
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sandfleet import __version__
from sandfleet.backends.base import TierBackend as Backend
from sandfleet.backends.base import capabilities
from sandfleet.daemon.admission import Admission, AdmissionPolicy
from sandfleet.daemon.audit import AuditLog
from sandfleet.daemon.builds import Builds
from sandfleet.daemon.core import EventStream, NodeCore, log
from sandfleet.daemon.creation import Creation
from sandfleet.daemon.detectors import DetectorsConfig
from sandfleet.daemon.execs import Execs, Terminal
from sandfleet.daemon.fencing import Fencing
from sandfleet.daemon.files import Files
from sandfleet.daemon.fncall import Calls
from sandfleet.daemon.images import Images
from sandfleet.daemon.lifecycle import LIVE_STATES
from sandfleet.daemon.metrics import Metrics
from sandfleet.daemon.monitor import Monitor
from sandfleet.daemon.network import NetworkConfig
from sandfleet.daemon.networking import Networking
from sandfleet.daemon.pausing import Pauser
from sandfleet.daemon.pool import WarmPools
from sandfleet.daemon.reaper import Reaper
from sandfleet.daemon.recovery import Recovery
from sandfleet.daemon.sessions import Sessions
from sandfleet.daemon.snapshots import Snapshots
from sandfleet.daemon.state import StateStore
from sandfleet.daemon.trajectories import Trajectories, TrajectoryConfig
from sandfleet.daemon.verify import Verifier, VerifyConfig
from sandfleet.errors import SandboxError, UnsupportedError
from sandfleet.ids import new_node_key
from sandfleet.images import ImageManifest, LayerStore
from sandfleet.models import (
    AuditQuery,
    AuditRecord,
    BuildEvent,
    ExecEvent,
    ExecRequest,
    ExecResult,
    ExposedPort,
    FileEvent,
    FileInfo,
    Health,
    ImageInfo,
    NetworkPolicy,
    NodeLoad,
    ProcessInfo,
    ProjectUsage,
    ReproRecord,
    RunCodeBatchItem,
    RunCodeRequest,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SessionInfo,
    SessionRunRequest,
    SnapshotInfo,
    StepRequest,
    StepResult,
    TerminalRequest,
    TerminalSize,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryOpen,
    Usage,
    VerifyRequest,
    VerifyResult,
)

if TYPE_CHECKING:
    from sandfleet.client.aio import AsyncClient


class SandboxManager:
    """The node's implementation of `SandboxService` (daemon/protocol.py)."""

    def __init__(
        self,
        *,
        backends: builtins.list[Backend],
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
        )
        self.core = core
        self.node_group = node_group
        self.node_labels = dict(node_labels or {})
        core.node_labels = self.node_labels
        self._image_refs: tuple[float, builtins.list[str]] = (-math.inf, [])
        self.audit = audit
        self.pauser = Pauser(core)
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
        self.verifier = Verifier(core, self.creation, self.execs, self.files, self.snapshots, verify)
        self.trajectories = Trajectories(
            core,
            self.creation,
            self.execs,
            self.files,
            self.snapshots,
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
            await self.recovery.recover()
            await self.trajectories.start()
            core.spawn(self.reaper.run(), name="reaper")
            core.spawn(core.journal.run(), name="event-flusher")
            core.spawn(self.monitor.run(), name="monitor")
            if core.pools is not None:
                core.spawn(core.pools.run(core.spawn), name="warm-pools")
            try:
                await ready()
            finally:
                await self.trajectories.drain()
                core.shutting_down = True
                if core.pools is not None:
                    await core.pools.drain()
                await core.journal.flush()
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

    async def held_keys(self, keys: builtins.list[tuple[str | None, str]]) -> builtins.list[bool]:
        return [self.creation.holds(project, key) for project, key in keys]

    async def metrics_text(self) -> tuple[bytes, str]:
        metrics, adm = self.core.metrics, self.core.admission
        with contextlib.suppress(OSError), open("/proc/self/statm") as f:  # noqa: ASYNC230 (procfs)
            metrics.daemon_rss.set(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        metrics.admission_cpu_committed.set(adm.committed_cpu)
        metrics.admission_cpu_load.set(adm.cpu_load)
        metrics.admission_memory_committed.set(adm.committed_memory)
        # Per-sandbox series read thousands of cgroup files: off the event loop.
        return await asyncio.to_thread(generate_latest, metrics.registry), CONTENT_TYPE_LATEST

    # -- sandboxes -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, idempotency_key: str | None = None) -> SandboxInfo:
        self.creation.check_draining(idempotency_key, spec.project)
        return await self.creation.create(spec, idempotency_key=idempotency_key)

    async def create_batch(
        self,
        specs: builtins.list[SandboxSpec],
        concurrency: int,
        idempotency_keys: builtins.list[str | None] | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        self.creation.check_draining()
        return await self.creation.create_batch(specs, concurrency, idempotency_keys)

    async def ack(self, sandbox_ids: builtins.list[str]) -> None:
        await self.core.ack(sandbox_ids)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return await self.core.get(sandbox_id)

    async def list(self, labels: dict[str, str] | None = None, state: str | None = None) -> builtins.list[SandboxInfo]:
        return await self.core.list(labels, state)

    async def update_lifetime(self, sandbox_id: str, fields: dict[str, float | None]) -> SandboxInfo:
        return await self.core.update_lifetime(sandbox_id, fields)

    async def update_lifetimes(self, labels: dict[str, str], fields: dict[str, float | None]) -> builtins.list[str]:
        return await self.core.update_lifetimes(labels, fields)

    async def stop(self, sandbox_id: str, reason: str = "user") -> SandboxInfo:
        return await self.core.stop(sandbox_id, reason)

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]:
        return await self.core.stop_many(labels, reason)

    async def events(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> builtins.list[SandboxEvent]:
        return await self.core.events(sandbox_id, after, limit)

    async def usage(self, sandbox_id: str) -> Usage:
        return await self.core.usage(sandbox_id)

    async def pause(self, sandbox_id: str) -> SandboxInfo:
        return await self.pauser.pause(sandbox_id)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self.pauser.resume(sandbox_id)

    async def pause_many(self, labels: dict[str, str]) -> builtins.list[str]:
        return await self.pauser.pause_many(labels)

    async def resume_many(self, labels: dict[str, str]) -> builtins.list[str]:
        return await self.pauser.resume_many(labels)

    # -- network -------------------------------------------------------------------------------

    async def set_network(self, sandbox_id: str, network: NetworkPolicy) -> SandboxInfo:
        return await self.networking.set_network(sandbox_id, network)

    async def set_network_many(self, labels: dict[str, str], network: NetworkPolicy) -> builtins.list[str]:
        return await self.networking.set_network_many(labels, network)

    async def expose(self, sandbox_id: str, port: int) -> ExposedPort:
        return await self.networking.expose(sandbox_id, port)

    async def unexpose(self, sandbox_id: str, port: int) -> None:
        await self.networking.unexpose(sandbox_id, port)

    async def list_exposed(self, sandbox_id: str) -> builtins.list[ExposedPort]:
        return await self.networking.list_exposed(sandbox_id)

    async def open_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await self.networking.open_port(sandbox_id, port)

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

    # -- snapshots, fork, pack -------------------------------------------------------------------

    async def snapshot(
        self, sandbox_id: str, *, ttl: float | None = None, labels: dict[str, str] | None = None
    ) -> SnapshotInfo:
        return await self.snapshots.snapshot(sandbox_id, ttl=ttl, labels=labels)

    async def fork(
        self, sandbox_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        return await self.snapshots.fork(sandbox_id, count, labels, idempotency_key=idempotency_key)

    async def restore(
        self, snapshot_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        return await self.snapshots.restore(snapshot_id, count, labels, idempotency_key=idempotency_key)

    async def list_snapshots(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        return await self.snapshots.list_snapshots(sandbox_id, labels)

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self.snapshots.get_snapshot(snapshot_id)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.snapshots.delete_snapshot(snapshot_id)

    async def pack(self, sandbox_id: str, ref: str, exclude: builtins.list[str]) -> ImageInfo:
        return await self.snapshots.pack(sandbox_id, ref, exclude)

    # -- RL: trajectories and verification -------------------------------------------------------

    async def open_trajectory(self, req: TrajectoryOpen, project: str | None = None) -> TrajectoryInfo:
        return await self.trajectories.open(req, project=project)

    async def get_trajectory(self, trajectory_id: str, project: str | None = None) -> TrajectoryInfo:
        return await self.trajectories.get(trajectory_id, project=project)

    async def list_trajectories(
        self, labels: dict[str, str], state: str | None, project: str | None = None
    ) -> builtins.list[TrajectoryInfo]:
        return await self.trajectories.list(labels, state, project=project)

    async def trajectory_step(self, trajectory_id: str, req: StepRequest, project: str | None = None) -> StepResult:
        return await self.trajectories.step(trajectory_id, req, project=project)

    async def trajectory_steps(self, trajectory_id: str, project: str | None = None) -> builtins.list[StepResult]:
        return await self.trajectories.steps(trajectory_id, project=project)

    async def verify_trajectory(
        self, trajectory_id: str, req: VerifyRequest, project: str | None = None
    ) -> VerifyResult:
        return await self.trajectories.verify(trajectory_id, req, project=project)

    async def close_trajectory(
        self, trajectory_id: str, req: TrajectoryClose, project: str | None = None
    ) -> TrajectoryInfo:
        return await self.trajectories.close(trajectory_id, req, project=project)

    async def delete_trajectory(self, trajectory_id: str, project: str | None = None) -> None:
        await self.trajectories.delete(trajectory_id, project=project)

    async def trajectory_record(self, trajectory_id: str, project: str | None = None) -> ReproRecord:
        return await self.trajectories.record(trajectory_id, project=project)

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        return await self.verifier.verify(sandbox_id, req)

    # -- exec and background processes ------------------------------------------------------------

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await self.execs.exec(sandbox_id, req)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> EventStream[ExecEvent]:
        return await self.execs.exec_stream(sandbox_id, req)

    async def open_terminal(self, sandbox_id: str, req: TerminalRequest) -> Terminal:
        return await self.execs.open_terminal(sandbox_id, req)

    async def run_code(self, req: RunCodeRequest) -> ExecResult:
        return await self.calls.run(req)

    async def run_code_many(self, reqs: builtins.list[RunCodeRequest]) -> EventStream[RunCodeBatchItem]:
        return await self.calls.run_many(reqs)

    async def run_code_in(self, sandbox_id: str, req: RunCodeRequest) -> ExecResult:
        return await self.calls.run_in(sandbox_id, req)

    async def start_process(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await self.execs.start_process(sandbox_id, req)

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return await self.execs.list_processes(sandbox_id)

    async def wait_process(self, sandbox_id: str, process_id: str, timeout: float | None) -> ProcessInfo:
        return await self.execs.wait_process(sandbox_id, process_id, timeout)

    async def kill_process(self, sandbox_id: str, process_id: str, signo: int = signal.SIGKILL) -> ProcessInfo:
        return await self.execs.kill_process(sandbox_id, process_id, signo)

    async def write_process_stdin(self, sandbox_id: str, process_id: str, data: bytes, close: bool) -> None:
        await self.execs.write_process_stdin(sandbox_id, process_id, data, close)

    # -- sessions --------------------------------------------------------------------------------

    async def create_session(
        self, sandbox_id: str, env: dict[str, str], cwd: str | None, user: str | None, pty: TerminalSize | None = None
    ) -> SessionInfo:
        return await self.sessions.create_session(sandbox_id, env, cwd, user, pty)

    async def list_sessions(self, sandbox_id: str) -> builtins.list[SessionInfo]:
        return await self.sessions.list_sessions(sandbox_id)

    async def get_session(self, sandbox_id: str, session_id: str) -> SessionInfo:
        return await self.sessions.get_session(sandbox_id, session_id)

    async def session_run(self, sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        return await self.sessions.session_run(sandbox_id, session_id, req)

    async def session_run_stream(
        self, sandbox_id: str, session_id: str, req: SessionRunRequest
    ) -> EventStream[ExecEvent]:
        return await self.sessions.session_run_stream(sandbox_id, session_id, req)

    async def write_session_stdin(self, sandbox_id: str, session_id: str, data: bytes, close: bool) -> None:
        await self.sessions.write_session_stdin(sandbox_id, session_id, data, close)

    async def close_session(self, sandbox_id: str, session_id: str) -> None:
        await self.sessions.close_session(sandbox_id, session_id)

    # -- files -----------------------------------------------------------------------------------

    async def read_file(self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self.files.read_file(sandbox_id, path, offset, length)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int, user: str | None, append: bool
    ) -> FileInfo:
        return await self.files.write_file(sandbox_id, path, data, mode=mode, user=user, append=append)

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        return await self.files.list_files(sandbox_id, path)

    async def stat_file(self, sandbox_id: str, path: str, follow_symlinks: bool) -> FileInfo:
        return await self.files.stat_file(sandbox_id, path, follow_symlinks)

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool, mode: int, user: str | None) -> FileInfo:
        return await self.files.make_dir(sandbox_id, path, parents=parents, mode=mode, user=user)

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self.files.remove_path(sandbox_id, path, recursive)

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        return await self.files.download_tar(sandbox_id, path)

    async def upload_limit(self, sandbox_id: str) -> int:
        return await self.files.upload_limit(sandbox_id)

    async def upload_tar(self, sandbox_id: str, path: str, tar: BinaryIO, size: int, user: str | None) -> None:
        await self.files.upload_tar(sandbox_id, path, tar, size, user)

    async def watch(self, sandbox_id: str, path: str, recursive: bool) -> EventStream[FileEvent]:
        return await self.files.watch(sandbox_id, path, recursive)

    # -- images ----------------------------------------------------------------------------------

    async def list_images(self) -> builtins.list[ImageInfo]:
        return await self.images.list_images()

    async def build_image(self, ref: str) -> ImageInfo:
        return await self.images.build_image(ref)

    async def build_recipe(self, recipe: str, base_dir: str) -> EventStream[BuildEvent]:
        return await self.builds.build_recipe(recipe, base_dir)

    async def delete_image(self, ref: str) -> None:
        await self.images.delete_image(ref)

    async def gc_images(self, min_age: float = 600.0) -> tuple[builtins.list[str], int]:
        return await self.images.gc_images(min_age)

    async def push_image(self, ref: str) -> ImageInfo:
        return await self.images.push_image(ref)

    async def import_image(self, path: str, ref: str | None) -> ImageInfo:
        return await self.images.import_image(path, ref)
