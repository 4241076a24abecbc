"""`SandboxService`: what the HTTP API serves, as one protocol.

The routes (daemon/api/) are written against this protocol only, never against the node's
service or a backend: the node's `SandboxManager` implements it, and the cluster gateway will
implement the same one, so the routes, the OpenAPI document and the SDK stay one. Every method is
async (a gateway's answers come over the network), takes and returns wire models (sandfleet.models)
or plain values, and raises only `SandboxError`s. Streams come back as `EventStream`s, which the
route closes exactly once, also when its client left before the first byte.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator
from typing import Any, BinaryIO, Protocol, TypeVar

from sandfleet.errors import SandboxError
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

T_co = TypeVar("T_co", covariant=True)


class Terminal(Protocol):
    """A command on a pseudo-terminal: its output (bytes, then one ExecResult), keystrokes and window
    sizes in; `close` (idempotent) kills what still runs."""

    pid: int

    def output(self) -> AsyncIterator[bytes | ExecResult]: ...

    async def write(self, data: bytes) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...

    async def hold(self, stop: bool) -> None:
        """Flow control: stop reading the command's output (its writes then block), or read on."""
        ...

    async def close(self) -> None: ...


class EventStream(Protocol[T_co]):
    """Events of a stream the service started; `aclose` releases what it holds (idempotent)."""

    def __aiter__(self) -> EventStream[T_co]: ...

    async def __anext__(self) -> T_co: ...

    async def aclose(self) -> None: ...


class SandboxService(Protocol):
    # -- node ------------------------------------------------------------------------------------
    async def health(self) -> Health: ...

    async def metrics_text(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...

    async def node_load(self) -> NodeLoad:
        """What placement and quotas read of the node (cluster mode polls it)."""
        ...

    async def drain(self, draining: bool) -> NodeLoad:
        """Stop (or resume) taking new creates; what the node holds keeps running."""
        ...

    async def fence(self, generation: int) -> NodeLoad:
        """Cluster mode: serve under `generation`; one above the node's own first stops every
        sandbox it holds (the cluster declared the node lost and told their callers so)."""
        ...

    async def held_keys(self, keys: builtins.list[tuple[str | None, str]]) -> builtins.list[bool]:
        """Per (project, idempotency key): whether a create with it made (or is making) a sandbox here."""
        ...

    # -- sandboxes -------------------------------------------------------------------------------
    async def create(self, spec: SandboxSpec, *, idempotency_key: str | None = None) -> SandboxInfo: ...

    async def create_batch(
        self,
        specs: builtins.list[SandboxSpec],
        concurrency: int,
        idempotency_keys: builtins.list[str | None] | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]: ...

    async def ack(self, sandbox_ids: builtins.list[str]) -> None:
        """The answer naming these sandboxes went out to the client."""
        ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(
        self, labels: dict[str, str] | None = None, state: str | None = None
    ) -> builtins.list[SandboxInfo]: ...

    async def update_lifetime(self, sandbox_id: str, fields: dict[str, float | None]) -> SandboxInfo: ...

    async def update_lifetimes(self, labels: dict[str, str], fields: dict[str, float | None]) -> builtins.list[str]: ...

    async def stop(self, sandbox_id: str, reason: str = "user") -> SandboxInfo: ...

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]: ...

    async def events(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> builtins.list[SandboxEvent]: ...

    async def usage(self, sandbox_id: str) -> Usage: ...

    async def pause(self, sandbox_id: str) -> SandboxInfo: ...

    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    async def pause_many(self, labels: dict[str, str]) -> builtins.list[str]: ...

    async def resume_many(self, labels: dict[str, str]) -> builtins.list[str]: ...

    # -- snapshots, fork, pack -------------------------------------------------------------------
    async def snapshot(
        self, sandbox_id: str, *, ttl: float | None = None, labels: dict[str, str] | None = None
    ) -> SnapshotInfo: ...

    async def fork(
        self, sandbox_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]: ...

    async def restore(
        self, snapshot_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]: ...

    async def list_snapshots(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]: ...

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo: ...

    async def delete_snapshot(self, snapshot_id: str) -> None: ...

    async def pack(self, sandbox_id: str, ref: str, exclude: builtins.list[str]) -> ImageInfo: ...

    # -- network -------------------------------------------------------------------------------
    async def set_network(self, sandbox_id: str, network: NetworkPolicy) -> SandboxInfo:
        """Make `network` the sandbox's egress policy, at once (connections it no longer allows close)."""
        ...

    async def set_network_many(self, labels: dict[str, str], network: NetworkPolicy) -> builtins.list[str]: ...

    async def expose(self, sandbox_id: str, port: int) -> ExposedPort: ...

    async def unexpose(self, sandbox_id: str, port: int) -> None: ...

    async def list_exposed(self, sandbox_id: str) -> builtins.list[ExposedPort]: ...

    async def open_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A byte stream to a server listening on an exposed port of the sandbox."""
        ...

    # -- audit ---------------------------------------------------------------------------------
    def audit_call(self, actor: str, data: dict[str, Any]) -> None:
        """Record one API call in the audit stream (never blocks)."""
        ...

    async def read_audit(self, query: AuditQuery) -> builtins.list[AuditRecord]: ...

    def follow_audit(self, query: AuditQuery, heartbeat: float) -> AsyncIterator[AuditRecord | None]:
        """The records `read_audit` gives, then each new one as it comes; None after `heartbeat`
        seconds of silence (a keep-alive)."""
        ...

    def audit_last_seq(self) -> int: ...

    # -- RL: trajectories (exactly-once steps) and verification apart from the agent ------------
    # `project`: whose trajectory ids these are (each project has its own; None: the root's). The
    # node's scoped service passes the caller's; a node without projects has the root's only.
    async def open_trajectory(self, req: TrajectoryOpen, project: str | None = None) -> TrajectoryInfo:
        """Open (or re-open: same id, same arguments) a rollout's trajectory and its sandbox."""
        ...

    async def get_trajectory(self, trajectory_id: str, project: str | None = None) -> TrajectoryInfo: ...

    async def list_trajectories(
        self, labels: dict[str, str], state: str | None, project: str | None = None
    ) -> builtins.list[TrajectoryInfo]: ...

    async def trajectory_step(self, trajectory_id: str, req: StepRequest, project: str | None = None) -> StepResult:
        """Take step `req.step` once; asked again, its logged result."""
        ...

    async def trajectory_steps(self, trajectory_id: str, project: str | None = None) -> builtins.list[StepResult]: ...

    async def verify_trajectory(
        self, trajectory_id: str, req: VerifyRequest, project: str | None = None
    ) -> VerifyResult: ...

    async def close_trajectory(
        self, trajectory_id: str, req: TrajectoryClose, project: str | None = None
    ) -> TrajectoryInfo: ...

    async def delete_trajectory(self, trajectory_id: str, project: str | None = None) -> None: ...

    async def trajectory_record(self, trajectory_id: str, project: str | None = None) -> ReproRecord: ...

    async def verify(self, sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        """Run checks in a fresh sandbox: the sandbox's pre-agent state, its changes, hidden layers."""
        ...

    # -- exec and background processes ------------------------------------------------------------
    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...

    async def run_code(self, req: RunCodeRequest) -> ExecResult:
        """A stateless call on a pooled worker of the fncall tier."""
        ...

    async def run_code_many(self, reqs: builtins.list[RunCodeRequest]) -> EventStream[RunCodeBatchItem]:
        """Stateless calls on pooled workers, all at once; each outcome as it completes."""
        ...

    async def run_code_in(self, sandbox_id: str, req: RunCodeRequest) -> ExecResult:
        """A stateless call on the worker sandbox `sandbox_id` (of the fncall tier)."""
        ...

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> EventStream[ExecEvent]: ...

    async def open_terminal(self, sandbox_id: str, req: TerminalRequest) -> Terminal:
        """A command on a new pseudo-terminal (the terminal WebSocket); the caller closes it."""
        ...

    async def start_process(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo: ...

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]: ...

    async def wait_process(self, sandbox_id: str, process_id: str, timeout: float | None) -> ProcessInfo: ...

    async def kill_process(self, sandbox_id: str, process_id: str, signo: int = 9) -> ProcessInfo: ...

    async def write_process_stdin(self, sandbox_id: str, process_id: str, data: bytes, close: bool) -> None: ...

    # -- sessions --------------------------------------------------------------------------------
    async def create_session(
        self, sandbox_id: str, env: dict[str, str], cwd: str | None, user: str | None, pty: TerminalSize | None = None
    ) -> SessionInfo: ...

    async def list_sessions(self, sandbox_id: str) -> builtins.list[SessionInfo]: ...

    async def get_session(self, sandbox_id: str, session_id: str) -> SessionInfo: ...

    async def session_run(self, sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult: ...

    async def session_run_stream(
        self, sandbox_id: str, session_id: str, req: SessionRunRequest
    ) -> EventStream[ExecEvent]: ...

    async def write_session_stdin(self, sandbox_id: str, session_id: str, data: bytes, close: bool) -> None: ...

    async def close_session(self, sandbox_id: str, session_id: str) -> None: ...

    # -- files -----------------------------------------------------------------------------------
    async def read_file(self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None) -> bytes: ...

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int, user: str | None, append: bool
    ) -> FileInfo: ...

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]: ...

    async def stat_file(self, sandbox_id: str, path: str, follow_symlinks: bool) -> FileInfo: ...

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool, mode: int, user: str | None) -> FileInfo: ...

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None: ...

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """A tar of `path`, streamed; an error before the first chunk is raised here."""
        ...

    async def upload_limit(self, sandbox_id: str) -> int:
        """The most bytes a tar upload into the sandbox may carry."""
        ...

    async def upload_tar(self, sandbox_id: str, path: str, tar: BinaryIO, size: int, user: str | None) -> None: ...

    async def watch(self, sandbox_id: str, path: str, recursive: bool) -> EventStream[FileEvent]: ...

    # -- images ----------------------------------------------------------------------------------
    async def list_images(self) -> builtins.list[ImageInfo]: ...

    async def build_image(self, ref: str) -> ImageInfo: ...

    async def build_recipe(self, recipe: str, base_dir: str) -> EventStream[BuildEvent]:
        """Build a recipe into the node's store; its progress, steps and output as they come."""
        ...

    async def delete_image(self, ref: str) -> None: ...

    async def gc_images(self, min_age: float = 600.0) -> tuple[builtins.list[str], int]: ...

    async def push_image(self, ref: str) -> ImageInfo: ...

    async def import_image(self, path: str, ref: str | None) -> ImageInfo: ...
