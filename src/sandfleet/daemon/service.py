"""The sandbox manager: lifecycle, exec, sessions, files, events, TTLs, restart recovery.

Backend-independent: a backend only creates/destroys sandboxes and hands back a `LiveSandbox`
(agent channel + root). Every long-lived task (reaper, event flusher, background processes, session
readers) runs in the manager's task group; nothing is fire-and-forget.
"""

from __future__ import annotations

import asyncio
import builtins
import codecs
import collections
import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from pydantic import ValidationError

from sandfleet.backends.base import Backend, LiveSandbox
from sandfleet.daemon.admission import Admission, AdmissionPolicy
from sandfleet.daemon.metrics import Metrics
from sandfleet.daemon.pool import WarmPools, pool_key
from sandfleet.daemon.state import SandboxRow, StateStore
from sandfleet.errors import (
    DataLossError,
    ImageNotFoundError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxTimeoutError,
    SnapshotNotFoundError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.images import (
    ImageBuildError,
    ImageError,
    ImageManifest,
    InvalidRefError,
    LayerCorruptError,
    LayerRef,
    LayerStore,
    fsutil,
    oci,
    parse_ref,
)
from sandfleet.images import ImageNotFoundError as StoreImageNotFound
from sandfleet.images.recipe import prune_build_cache
from sandfleet.models import (
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ProcessInfo,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SessionInfo,
    SnapshotInfo,
    Usage,
)
from sandfleet.runtime import proc as procmod
from sandfleet.runtime.agent import (
    SCOPE_DESCENDANTS,
    SCOPE_TREE,
    AgentError,
    ChannelClosedError,
    ExecProcess,
    ExecStartError,
    ExitInfo,
    OutputChunk,
    ProtocolError,
)
from sandfleet.runtime.cgroups import CgroupStats
from sandfleet.runtime.files import FileOpError, FileStat, SandboxFS

log = logging.getLogger("sandfleet.daemon")
T = TypeVar("T")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_FILE_ERRORS: dict[str, type[SandboxError]] = {
    "not_found": NotFoundError,
    "exists": WrongStateError,
    "not_a_directory": InvalidArgumentError,
    "is_a_directory": InvalidArgumentError,
    "permission_denied": PermissionDeniedError,
    "crosses_mount": PermissionDeniedError,
    "invalid_path": InvalidArgumentError,
    "too_large": InvalidArgumentError,
    "no_space": ResourceExhaustedError,
    "io_error": InternalError,
}


def _first_of_each(layers: list[LayerRef]) -> list[LayerRef]:
    """A stack without repeats. A layer named twice (two images on one base) keeps its first,
    lowest position: the shared base stays at the bottom, under what each image changed."""
    return list({x.digest: x for x in layers}.values())  # a dict keeps each key's first slot


def new_sandbox_id() -> str:
    return "sb-" + secrets.token_hex(8)


@dataclass
class User:
    uid: int
    gid: int
    home: str


@dataclass
class BackgroundProcess:
    id: str
    command: str | list[str]
    started_at: float
    process: ExecProcess
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    result: ExecResult | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)


class SessionStream:
    """One stream of a session shell, for the command now running: bounded memory whatever it prints.

    Keeps the first `limit` bytes (plus slack), a short window to spot the end marker across chunk
    boundaries, and whatever follows the marker (the exit status line).
    """

    def __init__(self) -> None:
        self.reset(b"", 0)

    def reset(self, marker: bytes, limit: int) -> None:
        self.marker = marker
        self.limit = limit
        self.head = bytearray()
        self.window = bytearray()
        self.total = 0
        self.marker_at: int | None = None
        self.after = bytearray()

    def feed(self, data: bytes) -> None:
        if not self.marker:  # between commands: output of stray background jobs is dropped
            return
        if self.marker_at is not None:
            self.after.extend(data[: 256 - len(self.after)])
            return
        keep = self.limit + len(self.marker) + 256 - len(self.head)
        if keep > 0:
            self.head.extend(data[:keep])
        start = self.total - len(self.window)
        self.window.extend(data)
        self.total += len(data)
        idx = self.window.find(self.marker)
        if idx >= 0:
            self.marker_at = start + idx
            self.after.extend(self.window[idx + len(self.marker) :][:256])
        else:
            del self.window[: max(0, len(self.window) - len(self.marker))]

    def done(self, *, need_line: bool) -> bool:
        return self.marker_at is not None and (not need_line or b"\n" in self.after)

    def content_length(self) -> int:
        return self.marker_at if self.marker_at is not None else self.total

    def kept(self) -> bytes:
        return bytes(self.head[: min(self.limit, self.content_length())])

    def truncated(self) -> bool:
        return self.content_length() > self.limit


@dataclass
class Session:
    id: str
    shell: str
    created_at: float
    process: ExecProcess
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    out: SessionStream = field(default_factory=SessionStream)
    err: SessionStream = field(default_factory=SessionStream)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    dead: bool = False


# How many Sandbox objects are in each state, kept as states change: admission and the gauges
# need the number running or paused on every create, and counting 5,000 entries each time shows.
STATE_COUNTS: collections.Counter[str] = collections.Counter()


@dataclass
class Sandbox:
    id: str
    spec: SandboxSpec
    state: str
    created_at: float
    last_active_at: float
    live: LiveSandbox | None = None
    stopped_at: float | None = None
    stop_reason: str | None = None
    users: dict[str, User] = field(default_factory=lambda: {"root": User(0, 0, "/root")})
    sessions: dict[str, Session] = field(default_factory=dict)
    processes: dict[str, BackgroundProcess] = field(default_factory=dict)
    inflight: int = 0
    stop_task: asyncio.Task[None] | None = None
    stop_failed: bool = False
    created: asyncio.Event = field(default_factory=asyncio.Event)
    oom_kills: int = 0
    pids_hits: int = 0
    pause_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Paused on request (not by the idle policy): kept past its idle TTL, e.g. while its trainer is
    # preempted; max_lifetime still applies.
    held: bool = False

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "state" and not self.__dict__.get("_forgotten"):
            old = self.__dict__.get("state")
            if old != value:
                if old is not None:
                    STATE_COUNTS[old] -= 1
                STATE_COUNTS[value] += 1
        super().__setattr__(name, value)

    def forget(self) -> None:
        """No longer tracked (dropped from the manager): out of the state counts."""
        if not self.__dict__.get("_forgotten"):
            STATE_COUNTS[self.state] -= 1
            self.__dict__["_forgotten"] = True

    def info(self) -> SandboxInfo:
        return SandboxInfo(
            id=self.id,
            state=cast(SandboxState, self.state),
            spec=self.spec,
            created_at=self.created_at,
            last_active_at=self.last_active_at,
            stopped_at=self.stopped_at,
            stop_reason=self.stop_reason,
        )


@dataclass
class SnapshotRecord:
    info: SnapshotInfo
    path: Path
    spec: SandboxSpec  # of the sandbox it was taken from: what a restore starts
    meta: dict[str, Any]  # the backend's, for restore
    restoring: int = 0
    deleted: bool = False  # asked to go; its files go once no restore reads them


MAX_SNAPSHOTS_PER_SANDBOX = 16
# Lower layers of one overlay: the mount options (one ~100-byte path per layer) must fit a page.
MAX_LAYERS = 32
CACHE_TRIM_INTERVAL = 60.0


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _exec_result(out: bytes, err: bytes, ex: ExitInfo) -> ExecResult:
    return ExecResult(
        exit_code=ex.exit_code,
        stdout=_decode(out),
        stderr=_decode(err),
        duration=ex.duration,
        timed_out=ex.timed_out,
        stdout_truncated=ex.stdout_truncated,
        stderr_truncated=ex.stderr_truncated,
        signal=ex.signal,
    )


def _row(sb: Sandbox, runtime: dict[str, Any]) -> SandboxRow:
    """The state-store row of a sandbox being created or handed out."""
    spec = sb.spec
    return SandboxRow(sb.id, sb.state, spec.backend, spec.model_dump(mode="json"), spec.labels, runtime,
                      sb.created_at, sb.last_active_at, None, None)  # fmt: skip


def _argv(req: ExecRequest) -> list[str]:
    """A string command runs under /bin/sh -c; a list is the argv itself."""
    return ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else list(req.command)


def _start_failure(exc: ExecStartError, req: ExecRequest) -> ExecResult:
    # Shell conventions: 127 = not found, 126 = found but not runnable.
    code = 127 if exc.errno == errno.ENOENT else 126
    return ExecResult(exit_code=code, stdout="", stderr=f"sandfleet: {_argv(req)[0]}: {exc.message}\n", duration=0.0)


class SandboxManager:
    def __init__(
        self,
        *,
        backend: Backend,
        store: LayerStore,
        state: StateStore,
        metrics: Metrics,
        admission: Admission | None = None,
        pools: WarmPools | None = None,
        stopped_retention: float = 300.0,
        reaper_interval: float = 1.0,
        build_missing_images: bool = True,
        snapshot_dir: Path | None = None,
        import_dirs: builtins.list[Path] | None = None,
    ) -> None:
        self.backend = backend
        self.store = store
        self.state = state
        self.metrics = metrics
        self.admission = admission or Admission(AdmissionPolicy())
        self.stopped_retention = stopped_retention
        self.reaper_interval = reaper_interval
        self.build_missing_images = build_missing_images
        self.sandboxes: dict[str, Sandbox] = {}
        self.snapshot_dir = snapshot_dir
        self.import_dirs = import_dirs
        self.snapshots: dict[str, SnapshotRecord] = {}
        self._last_trim = time.monotonic()
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.pools = pools
        self._events: list[tuple[str, float, str, dict[str, Any]]] = []
        self._events_flushed = asyncio.Event()
        self._dirty_activity: dict[str, float] = {}
        self._creating = 0
        self.metrics.track_sandboxes(self._usage_sources)
        self._best_effort_cpu: dict[str, float] = {}  # CPU seconds of each best-effort sandbox, last seen
        self._best_effort_retired = 0.0  # what best-effort sandboxes that have stopped had used
        self._best_effort_ids: set[str] = set()  # running or paused best-effort sandboxes
        self._stopping = False
        self.started_at = time.time()

    # -- lifecycle of the manager ---------------------------------------------------------------

    async def run(self, ready: Callable[[], Awaitable[None]]) -> None:
        """Recover state, then serve until `ready` returns; `ready` runs once recovery is done."""
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            await self.recover()
            self._spawn(self._reaper(), name="reaper")
            self._spawn(self._event_flusher(), name="event-flusher")
            if self.pools is not None:
                self._spawn(self.pools.run(self._spawn), name="warm-pools")
            try:
                await ready()
            finally:
                self._stopping = True
                if self.pools is not None:
                    await self.pools.drain()
                await self._flush_events()
                await self.state.touch_many(self._dirty_activity)
                for task in list(self._tasks):
                    task.cancel()
        self._tg = None

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        if self._tg is None:
            raise UnavailableError("daemon is shutting down")
        task = self._tg.create_task(self._guard(coro, name), name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @staticmethod
    async def _guard(coro: Awaitable[Any], name: str) -> Any:
        """A failing background task is logged; it must never cancel the task group (the daemon)."""
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s failed", name)
            return None

    async def recover(self) -> None:
        """Re-adopt live sandboxes of a previous daemon; clean every half-created or dead one."""
        rows = await self.state.all()
        known = {r.id for r in rows}
        for row in rows:
            try:
                spec = SandboxSpec.model_validate(row.spec)
            except ValidationError:
                # A row this version cannot read must not keep the daemon from starting.
                log.exception("sandbox %s: unreadable spec in the state store; removing it", row.id)
                await self.backend.cleanup(row.id, row.runtime)
                await self.state.delete([row.id])
                continue
            sb = Sandbox(
                row.id,
                spec,
                row.state,
                row.created_at,
                row.last_active_at,
                stopped_at=row.stopped_at,
                stop_reason=row.stop_reason,
            )
            if row.state in ("running", "paused"):
                # adopt() thaws a paused sandbox first (a frozen agent cannot answer): it comes back
                # running, and its idle policy may pause it again.
                live = await self.backend.adopt(row.id, row.runtime)
                if live is not None:
                    sb.live = live
                    sb.state = "running"
                    self.admission.commit(spec.resources)
                    live.channel.on_close = lambda _ch, sid=row.id: self._on_agent_lost(sid)
                    self.sandboxes[row.id] = sb
                    self._event(row.id, "adopted", {"agent_pid": live.agent_pid})
                    if spec.qos == "best_effort":
                        self._best_effort_ids.add(row.id)
                    continue
            if row.state in ("running", "paused", "creating", "stopping"):
                await self.backend.cleanup(row.id, row.runtime)
                sb.state = "stopped" if row.state != "creating" else "failed"
                sb.stop_reason = sb.stop_reason or "lost in daemon restart"
                sb.stopped_at = time.time()
                self._event(row.id, "stopped", {"reason": sb.stop_reason})
                self.sandboxes[row.id] = sb
                await self._forget(sb)
                continue
            self.sandboxes[row.id] = sb
        await self._recover_snapshots()
        # Residue with no row at all (a crash between mkdir and insert).
        leftovers = self.backend.leftovers()
        for name in set(leftovers.get("sandbox_dirs", [])) | set(leftovers.get("cgroups", [])):
            if name not in known:
                await self.backend.cleanup(name, {})
        self.metrics.alive.set(self.running_count())

    def running_count(self) -> int:
        return STATE_COUNTS["running"]

    def node_count(self) -> int:
        """Sandboxes holding node resources: running or paused, being created, and warm in pools."""
        pooled = self.pools.pooled() if self.pools is not None else 0
        return STATE_COUNTS["running"] + STATE_COUNTS["paused"] + self._creating + pooled

    # -- events -----------------------------------------------------------------------------------

    def _event(self, sandbox_id: str, kind: str, data: dict[str, Any] | None = None) -> None:
        self._events.append((sandbox_id, time.time(), kind, data or {}))

    async def _flush_events(self) -> None:
        batch, self._events = self._events, []
        try:
            await self.state.add_events(batch)
        except BaseException:
            self._events[:0] = batch  # keep them for the next flush
            raise

    async def _event_flusher(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            try:
                await self._flush_events()
            except Exception:
                log.exception("writing events failed; they stay queued for the next flush")

    async def events(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[SandboxEvent]:
        self._get(sandbox_id)
        await self._flush_events()
        rows = await self.state.events(sandbox_id, after, limit)
        return [SandboxEvent.model_validate(r) for r in rows]

    # -- create / get / list / stop ---------------------------------------------------------------

    def _get(self, sandbox_id: str) -> Sandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None:
            raise SandboxNotFoundError(f"sandbox {sandbox_id} not found")
        return sb

    async def _ready(self, sandbox_id: str) -> tuple[Sandbox, LiveSandbox]:
        """The sandbox, running: a paused one is resumed first (any request resumes it)."""
        sb = self._get(sandbox_id)
        if sb.state == "paused":
            await self._resume(sb, transparent=True)
        return self._running(sandbox_id)

    def _running(self, sandbox_id: str) -> tuple[Sandbox, LiveSandbox]:
        sb = self._get(sandbox_id)
        if sb.state != "running" or sb.live is None:
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
        return sb, sb.live

    async def resolve_image(self, ref: str) -> ImageManifest:
        try:
            if self.build_missing_images:
                return await self.store.ensure(ref)
            return self.store.resolve(ref)
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found (see `sandfleet images`)") from exc
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except ImageBuildError as exc:
            raise InternalError(f"building image {ref} failed: {exc}") from exc

    async def resolve_environment(self, spec: SandboxSpec) -> ImageManifest:
        """The layer stack a spec asks for: `image`'s layers, then each of `layers` (an image ref
        adds its whole stack, a digest one layer), bottom -> top. A layer named twice keeps its
        first, lowest position. Environment defaults (env, workdir, user) of later entries win."""
        if not spec.layers:
            assert spec.image is not None
            m = await self.resolve_image(spec.image)
            if len({x.digest for x in m.layers}) < len(m.layers):  # the overlay refuses a repeated lower
                m = m.model_copy(update={"layers": _first_of_each(m.layers)})
            self._check_layer_count(m)
            return m
        stack: builtins.list[LayerRef] = []
        env: dict[str, str] = {}
        workdir = user = None
        for ref in ([spec.image] if spec.image else []) + spec.layers:
            if ref.startswith("sha256:"):
                layer = await asyncio.to_thread(self._layer_by_digest, ref)
                stack.append(layer)
                continue
            m = await self.resolve_image(ref)
            stack.extend(m.layers)
            env.update(m.env)
            workdir, user = m.workdir or workdir, m.user or user
        m = ImageManifest(
            name="environment",
            tag="stack",
            layers=_first_of_each(stack),
            created=time.time(),
            env=env,
            workdir=workdir,
            user=user,
        )
        self._check_layer_count(m)
        return m

    @staticmethod
    def _check_layer_count(image: ImageManifest) -> None:
        if len(image.layers) > MAX_LAYERS:
            raise InvalidArgumentError(f"the environment has {len(image.layers)} layers; at most {MAX_LAYERS}")

    def _layer_by_digest(self, digest: str) -> LayerRef:
        try:
            return self.store.layer_ref_or_file(digest)
        except LayerCorruptError as exc:
            if self.store.has_layer(digest):
                raise DataLossError(str(exc)) from exc
            raise ImageNotFoundError(f"image layer {digest} not found in the layer store") from exc

    @staticmethod
    def _with_image_defaults(spec: SandboxSpec, image: ImageManifest) -> SandboxSpec:
        """The spec with the image's environment defaults filled in where the caller set none,
        validated like the caller's own fields (an imported image may carry anything)."""
        update: dict[str, Any] = {}
        if image.env:
            update["env"] = {**image.env, **spec.env}
        if image.workdir and "workdir" not in spec.model_fields_set:
            update["workdir"] = image.workdir
        if image.user and "user" not in spec.model_fields_set:
            update["user"] = image.user.split(":", 1)[0]
        if not update:
            return spec
        try:
            merged = SandboxSpec.model_validate({**spec.model_dump(exclude_unset=True), **update})
        except ValidationError as exc:
            errors = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise InvalidArgumentError(f"the image's defaults are not valid ({errors}); set them in the spec") from exc
        return merged

    async def create_batch(self, specs: list[SandboxSpec], concurrency: int) -> list[SandboxInfo | SandboxError]:
        """Create each spec, `concurrency` at a time; each item succeeds or fails on its own."""
        limit = asyncio.Semaphore(concurrency)

        async def one(spec: SandboxSpec) -> SandboxInfo | SandboxError:
            async with limit:
                try:
                    return await self.create(spec)
                except SandboxError as exc:
                    return exc
                except Exception as exc:  # noqa: BLE001 (one item's bug must not fail its siblings)
                    log.exception("create in a batch failed")
                    return InternalError(f"create failed: {exc}")

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(spec)) for spec in specs]
        return [t.result() for t in tasks]

    async def create(self, spec: SandboxSpec) -> SandboxInfo:
        self._check_backend(spec)
        if self.pools is not None:
            key = pool_key(spec)
            pooled = self.pools.image(key)  # what the pool's members were made from
            # Before taking a member: a spec the image's defaults make invalid must not cost one.
            effective = self._with_image_defaults(spec, pooled) if pooled is not None else spec
            live = self.pools.take(key)
            if live is not None:
                return await self._hand_out(effective, live)
        self._admit(spec)
        try:
            image = await self.resolve_environment(spec)
            spec = self._with_image_defaults(spec, image)
        except BaseException:
            self._creating -= 1
            self.admission.release(spec.resources)
            raise
        created = {"image": spec.environment(), "layers": [x.digest for x in image.layers]}
        return await self._start_admitted(spec, lambda sid: self.backend.create(sid, spec, image), created)

    def _check_backend(self, spec: SandboxSpec) -> None:
        if self._stopping:
            raise UnavailableError("daemon is shutting down")
        if spec.backend != self.backend.name:
            raise InvalidArgumentError(
                f"backend {spec.backend!r} is not available on this node (available: {self.backend.name!r})"
            )

    def _admit(self, spec: SandboxSpec) -> None:
        """Take the spec's admission budget (or raise ResourceExhaustedError); counts as creating."""
        try:
            self.admission.admit(self.node_count(), spec.resources)
        except ResourceExhaustedError:
            self.metrics.rejected.inc()
            raise
        self.admission.commit(spec.resources)
        self._creating += 1

    async def _start_admitted(
        self, spec: SandboxSpec, start: Callable[[str], Awaitable[LiveSandbox]], created: dict[str, Any]
    ) -> SandboxInfo:
        """Record a new sandbox, start it with `start(id)` (a create or a restore), make it running."""
        # Until the backend holds the resources, a failure must hand the admission budget back.
        holds_budget = True
        t0 = time.perf_counter()
        try:
            sandbox_id = new_sandbox_id()
            now = time.time()
            sb = Sandbox(sandbox_id, spec, "creating", now, now)
            self.sandboxes[sandbox_id] = sb
            finished = sb.created  # set however this create ends; a concurrent stop waits on it
            try:
                await self.state.insert(_row(sb, {}))
            except BaseException:
                self.sandboxes.pop(sandbox_id, None)
                sb.forget()
                finished.set()
                raise
            try:
                live = await start(sandbox_id)
            except BaseException as exc:
                sb.state, sb.stopped_at, sb.stop_reason = "failed", time.time(), f"create failed: {exc}"[:500]
                self._event(sandbox_id, "create_failed", {"error": str(exc)[:500]})
                await asyncio.shield(self._forget(sb))
                self.metrics.create_failures.inc()
                finished.set()
                raise
            sb.live = live
            holds_budget = False  # released by stop from here on
            live.channel.on_close = lambda _ch: self._on_agent_lost(sandbox_id)
            sb.state = "running"
            finished.set()
            await self.state.update(sandbox_id, state="running", runtime=live.runtime)
            await self._settle_create(sb, live, created, t0)
        finally:
            self._creating -= 1
            if holds_budget:
                self.admission.release(spec.resources)
        return sb.info()

    async def _hand_out(self, spec: SandboxSpec, live: LiveSandbox) -> SandboxInfo:
        """Give a warm sandbox to this caller (its budget is already committed) and make it theirs."""
        t0 = time.perf_counter()
        now = time.time()
        sb = Sandbox(live.id, spec, "running", now, now, live=live)
        sb.created.set()
        self.sandboxes[sb.id] = sb
        live.channel.on_close = lambda _ch: self._on_agent_lost(sb.id)
        await self.state.insert(_row(sb, live.runtime))
        self.metrics.pool_hits.inc()
        await self._settle_create(sb, live, {"image": spec.environment(), "pooled": True}, t0)
        return sb.info()

    async def _settle_create(self, sb: Sandbox, live: LiveSandbox, created: dict[str, Any], t0: float) -> None:
        """The last step of every create, cold or pooled: check the spec's user exists, then record it."""
        if sb.spec.user != "root":
            try:
                await self._user(sb, live, sb.spec.user)
            except SandboxError:
                await self.stop(sb.id, reason="invalid user")
                raise
        if sb.spec.qos == "best_effort":
            self._best_effort_ids.add(sb.id)
        self._event(sb.id, "created", created)
        self.metrics.created.inc()
        self.metrics.create_seconds.observe(time.perf_counter() - t0)
        self.metrics.alive.set(self.running_count())

    async def _forget(self, sb: Sandbox) -> None:
        """Persist a terminal state; drop the row at once when nothing is retained."""
        if self.stopped_retention <= 0:
            if self.sandboxes.pop(sb.id, None) is not None:
                sb.forget()
            await self._flush_events()
            await self.state.delete([sb.id])
        else:
            await self.state.update(sb.id, state=sb.state, stopped_at=sb.stopped_at, stop_reason=sb.stop_reason)

    def get(self, sandbox_id: str) -> SandboxInfo:
        return self._get(sandbox_id).info()

    def list(self, labels: dict[str, str] | None = None, state: str | None = None) -> list[SandboxInfo]:
        out = []
        for sb in self.sandboxes.values():
            if state is not None and sb.state != state:
                continue
            if labels and any(sb.spec.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(sb.info())
        return out

    def _on_agent_lost(self, sandbox_id: str) -> None:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state != "running" or self._tg is None:
            return
        self._event(sandbox_id, "agent_lost", {})
        self._spawn(self.stop(sandbox_id, reason="sandbox init exited"), name=f"lost-{sandbox_id}")

    async def stop(self, sandbox_id: str, reason: str = "user") -> SandboxInfo:
        sb = self._get(sandbox_id)
        if sb.state == "creating":
            # Stopping mid-create would race the backend; let the create settle first.
            await asyncio.shield(sb.created.wait())
        if sb.state in ("stopped", "failed") and not sb.stop_failed:
            return sb.info()
        if sb.stop_task is None or (sb.stop_task.done() and sb.stop_failed):
            sb.stop_task = self._spawn(self._do_stop(sb, reason), name=f"stop-{sandbox_id}")
        await asyncio.shield(sb.stop_task)
        return sb.info()

    async def _do_stop(self, sb: Sandbox, reason: str) -> None:
        sb.state = "stopping"
        if sb.id in self._best_effort_cpu and sb.live is not None:
            # Its final CPU time, so the admission's count of latency-sensitive use does not jump.
            with contextlib.suppress(OSError):
                self._best_effort_retired += self.backend.cpu_seconds(sb.live)
                del self._best_effort_cpu[sb.id]
        try:
            await self.state.update(sb.id, state="stopping")
            if sb.live is not None:
                await self._record_limits(sb, sb.live)
                await self.backend.destroy(sb.live)
        except Exception as exc:
            # Still holds resources: keep the row `stopping` (a restart retries) and let the reaper
            # retry the stop; the admission budget stays taken until it succeeds.
            log.exception("stopping sandbox %s failed", sb.id)
            sb.state, sb.stop_failed, sb.stop_reason = "failed", True, f"stop failed: {exc}"[:500]
            self._event(sb.id, "stop_failed", {"error": str(exc)[:500]})
            self.metrics.alive.set(self.running_count())
            return
        sb.stop_failed = False
        for bp in sb.processes.values():
            bp.done.set()
        for session in sb.sessions.values():
            session.dead = True
            session.changed.set()
        sb.state, sb.stopped_at, sb.stop_reason = "stopped", time.time(), reason
        for rec in [r for r in self.snapshots.values() if r.info.sandbox_id == sb.id]:
            await self._drop_snapshot(rec)
        self.admission.release(sb.spec.resources)
        self._event(sb.id, "stopped", {"reason": reason})
        self._dirty_activity.pop(sb.id, None)
        await self._forget(sb)
        self.metrics.stopped.labels(reason=reason.split(":")[0][:32]).inc()
        self.metrics.alive.set(self.running_count())

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]:
        ids = [s.id for s in self._matching(labels, ("running", "paused"))]
        await asyncio.gather(*(self.stop(i, reason) for i in ids))
        return ids

    def _matching(self, labels: dict[str, str], states: tuple[str, ...]) -> builtins.list[Sandbox]:
        return [
            sb
            for sb in self.sandboxes.values()
            if sb.state in states and all(sb.spec.labels.get(k) == v for k, v in labels.items())
        ]

    # -- snapshots, restore, fork ------------------------------------------------------------------

    async def snapshot(self, sandbox_id: str) -> SnapshotInfo:
        """Checkpoint a sandbox (a paused one is resumed for it and paused again); it keeps running."""
        if self.snapshot_dir is None:
            raise UnavailableError("snapshots are not enabled on this daemon")
        was = self._get(sandbox_id)
        was_paused, was_held = was.state == "paused", was.held
        sb, live = await self._ready(sandbox_id)
        async with sb.pause_lock:
            if sb.state != "running" or sb.live is not live:
                raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
            if len(self.list_snapshots(sandbox_id)) >= MAX_SNAPSHOTS_PER_SANDBOX:
                raise ResourceExhaustedError(
                    f"sandbox {sandbox_id} has {MAX_SNAPSHOTS_PER_SANDBOX} snapshots already: delete one first"
                )
            snapshot_id = "snap-" + secrets.token_hex(8)
            path = self.snapshot_dir / snapshot_id
            t0 = time.perf_counter()
            try:
                meta = await self.backend.snapshot(live, path)
                seconds = time.perf_counter() - t0
                size = await asyncio.to_thread(fsutil.disk_usage, path)
                info = SnapshotInfo(
                    id=snapshot_id, sandbox_id=sb.id, created_at=time.time(), size_bytes=size, seconds=round(seconds, 4)
                )
                record = {"info": info.model_dump(mode="json"), "spec": sb.spec.model_dump(mode="json"), "meta": meta}
                await asyncio.to_thread((path / "snapshot.json").write_text, json.dumps(record))
                if sb.state != "running":  # stopped meanwhile (stop does not wait for the pause lock)
                    raise WrongStateError(f"sandbox {sandbox_id} stopped while its snapshot was taken")
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, path, True)
                raise
            self.snapshots[snapshot_id] = SnapshotRecord(info, path, sb.spec, meta)
            self._touch(sb)
            self._event(sb.id, "snapshot", {"snapshot": snapshot_id, "bytes": size, "seconds": info.seconds})
            self.metrics.snapshot_seconds.observe(seconds)
        if was_paused:
            with contextlib.suppress(SandboxError):
                await self.pause(sandbox_id, by_policy=not was_held)
        return info

    def _snapshot(self, snapshot_id: str) -> SnapshotRecord:
        rec = self.snapshots.get(snapshot_id)
        if rec is None or rec.deleted:
            raise SnapshotNotFoundError(f"snapshot {snapshot_id} not found")
        return rec

    def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self._snapshot(snapshot_id).info

    def list_snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        return [
            r.info
            for r in self.snapshots.values()
            if not r.deleted and (sandbox_id is None or r.info.sandbox_id == sandbox_id)
        ]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._drop_snapshot(self._snapshot(snapshot_id))

    async def _drop_snapshot(self, rec: SnapshotRecord) -> None:
        rec.deleted = True
        if rec.restoring == 0 and self.snapshots.pop(rec.info.id, None) is not None:
            await asyncio.to_thread(shutil.rmtree, rec.path, True)

    async def _recover_snapshots(self) -> None:
        """Keep the snapshots of sandboxes that were adopted; delete every other one."""
        if self.snapshot_dir is None:
            return
        # Root only: snapshots hold sandboxes' files (owned by their uids) and memory.
        self.snapshot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.snapshot_dir, 0o700)
        for path in await asyncio.to_thread(lambda: sorted(self.snapshot_dir.iterdir()) if self.snapshot_dir else []):
            try:
                record = json.loads(await asyncio.to_thread((path / "snapshot.json").read_text))
                info = SnapshotInfo.model_validate(record["info"])
                owner = self.sandboxes.get(info.sandbox_id)
                if owner is not None and owner.state == "running" and info.id == path.name:
                    spec = SandboxSpec.model_validate(record["spec"])
                    self.snapshots[info.id] = SnapshotRecord(info, path, spec, dict(record["meta"]))
                    continue
            except (OSError, ValueError, KeyError, TypeError):
                pass
            await asyncio.to_thread(shutil.rmtree, path, True)

    async def restore(
        self, snapshot_id: str, count: int = 1, labels: dict[str, str] | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` new sandboxes from a snapshot, started together; each succeeds or fails on its own."""
        rec = self._snapshot(snapshot_id)
        spec = rec.spec.model_copy(update={"labels": {**rec.spec.labels, **(labels or {})}})
        created = {"snapshot": rec.info.id, "source": rec.info.sandbox_id}

        async def one() -> SandboxInfo | SandboxError:
            try:
                self._check_backend(spec)
                self._admit(spec)
                return await self._start_admitted(
                    spec, lambda sid: self.backend.restore(sid, spec, rec.path, rec.meta), created
                )
            except SandboxError as exc:
                return exc
            except Exception as exc:  # noqa: BLE001 (one child's failure must not fail its siblings)
                log.exception("restore of %s failed", snapshot_id)
                return InternalError(f"restore failed: {exc}")

        rec.restoring += 1
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one()) for _ in range(count)]
        finally:
            rec.restoring -= 1
            if rec.deleted:
                await self._drop_snapshot(rec)
        return [t.result() for t in tasks]

    async def fork(
        self, sandbox_id: str, count: int = 1, labels: dict[str, str] | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` copies of a live (or paused) sandbox: a snapshot, restored `count` times, deleted."""
        snap = await self.snapshot(sandbox_id)
        try:
            return await self.restore(snap.id, count, labels)
        finally:
            rec = self.snapshots.get(snap.id)
            if rec is not None:
                await self._drop_snapshot(rec)

    # -- pack: a live sandbox's changes as a new image ----------------------------------------------

    async def pack(self, sandbox_id: str, ref: str, exclude: builtins.list[str]) -> ImageManifest:
        """A new image: the sandbox's layers plus one new layer holding what it changed.

        `exclude`: absolute paths whose changes are dropped (build caches, shell history, answer
        files): under them the new image shows the base layers' content, as before the sandbox ran.
        The manifest's recipe records which sandbox (and image) it was packed from, and when.
        """
        try:
            name, tag = parse_ref(ref)
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        scrub = [_inside_path(path) for path in exclude]
        sb, live = await self._ready(sandbox_id)
        base = await asyncio.to_thread(self._layer_refs, [str(d) for d in live.runtime.get("layers", [])])
        staging = self.store.tmp_dir / f"pack-{secrets.token_hex(8)}"
        sb.inflight += 1  # not paused by the idle policy meanwhile
        try:
            await self.backend.export_writable_layer(live, staging)
            for rel in scrub:
                await asyncio.to_thread(_scrub, staging, rel)
            layer = await self.store.add_layer_from_dir(
                staging, f"changes of sandbox {sandbox_id}", kind="layer", shift_ids=False
            )
        finally:
            sb.inflight -= 1
            await asyncio.to_thread(shutil.rmtree, staging, True)
        recipe = {
            "packed_from": sandbox_id,
            "labels": sb.spec.labels,  # who built it: the job / agent that owned the sandbox
            "image": sb.spec.environment(),
            "excluded": scrub,
            "packed_at": time.time(),
        }
        layers = [*base, layer]
        # The source image's defaults carry over; the caller's own env (maybe secrets) does not.
        source: ImageManifest | None = None
        with contextlib.suppress(SandboxError):  # the image may be gone since: no defaults then
            source = await self.resolve_environment(sb.spec)
        manifest = await asyncio.to_thread(
            functools.partial(
                self.store.put_manifest,
                name,
                tag,
                layers,
                recipe=json.dumps(recipe),
                env=source.env if source else None,
                workdir=source.workdir if source else None,
                user=source.user if source else None,
            )
        )
        self._event(sandbox_id, "packed", {"image": manifest.ref, "layer": layer.digest, "bytes": layer.size})
        return manifest

    async def push_image(self, ref: str) -> ImageManifest:
        """Publish a local image to the shared store as on-demand layers."""
        if self.store.shared is None:
            raise InvalidArgumentError("no shared store is configured (shared_image_dir)")
        try:
            return await self.store.push(ref)
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found") from exc
        except LayerCorruptError as exc:
            raise DataLossError(str(exc)) from exc
        except ImageError as exc:
            raise InternalError(f"pushing {ref} failed: {exc}") from exc

    async def import_image(self, path: str, ref: str | None) -> ImageManifest:
        """An OCI image (docker save tarball, OCI layout or its tar) on this host, as an image."""
        source = Path(path)
        if not source.is_absolute() or not await asyncio.to_thread(source.exists):
            raise InvalidArgumentError(f"import source {path!r} must be an absolute path that exists on the node")
        try:
            # `within` is checked on the opened file, so a path swapped after any check cannot escape.
            return await oci.import_image(self.store, source, ref, within=self.import_dirs)
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference: {exc}") from exc
        except oci.OciImportError as exc:
            raise InvalidArgumentError(f"cannot import {path}: {exc}") from exc
        except ImageError as exc:  # building the EROFS layers failed
            raise InternalError(f"importing {path} failed: {exc}") from exc

    async def delete_image(self, ref: str) -> None:
        try:
            await asyncio.to_thread(self.store.remove_image, ref)
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found") from exc

    async def gc_images(self, min_age: float = 600.0) -> tuple[builtins.list[str], int]:
        """Delete layers nothing refers to: no image, no sandbox of this daemon, no snapshot."""
        keep: set[str] = set()
        for sb in self.sandboxes.values():
            if sb.live is not None and sb.state in ("creating", "running", "paused", "stopping"):
                keep.update(str(d) for d in sb.live.runtime.get("layers", []))
        for rec in self.snapshots.values():
            keep.update(str(d) for d in rec.meta.get("layers", []))
        if self.pools is not None:
            keep.update(self.pools.layer_digests())
        # A mounted layer's file cannot really go (the mount holds it): unmount the unused ones first.
        await self.backend.unmount_unused_layers()
        keep |= self.backend.busy_layers()  # and never one a create is mounting right now
        removed, freed = await asyncio.to_thread(self.store.gc, keep, min_age=min_age)
        trimmed, trimmed_bytes = await self._trim_image_cache(keep)
        removed, freed = removed + trimmed, freed + trimmed_bytes
        if removed:
            await asyncio.to_thread(prune_build_cache, self.store)  # recipe steps whose layer went
            log.info("image gc removed %d layers (%d bytes)", len(removed), freed)
        return removed, freed

    async def _trim_image_cache(self, keep: set[str]) -> tuple[builtins.list[str], int]:
        """Hold the local copies of shared-store layers to `image_cache_max`: over it, unused
        layers are unmounted (a mounted file frees nothing), then the least recently used go."""
        limit = self.store.cache_max
        if limit is None or await asyncio.to_thread(self.store.local_bytes) <= limit:
            return [], 0
        await self.backend.unmount_unused_layers()
        return await asyncio.to_thread(self.store.trim, limit, keep, self.backend.remove_layer_if_idle)

    def _layer_refs(self, digests: builtins.list[str]) -> builtins.list[LayerRef]:
        return [self._layer_by_digest(digest) for digest in digests]

    # -- pause and resume ---------------------------------------------------------------------------

    async def usage(self, sandbox_id: str) -> Usage:
        """Current and peak memory, CPU time, tasks and limit hits, from the cgroup (no resume)."""
        sb = self._get(sandbox_id)
        if sb.live is None or sb.state not in ("running", "paused"):
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}")
        st = await asyncio.to_thread(self.backend.stats, sb.live)
        return Usage(
            memory_bytes=st.memory_bytes,
            memory_peak_bytes=st.memory_peak_bytes,
            cpu_seconds=round(st.cpu_seconds, 6),
            pids=st.pids,
            oom_kills=st.oom_kills,
            pids_limit_hits=st.pids_limit_hits,
        )

    async def pause(self, sandbox_id: str, *, by_policy: bool = False) -> SandboxInfo:
        """Freeze the sandbox and push its memory out (to swap / dropped page cache)."""
        sb = self._get(sandbox_id)
        async with sb.pause_lock:
            if sb.state == "paused":
                sb.held = sb.held or not by_policy
                return sb.info()
            if sb.state != "running" or sb.live is None:
                raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
            if sb.inflight:
                raise WrongStateError(f"sandbox {sandbox_id} has {sb.inflight} request(s) in flight")
            t0 = time.perf_counter()
            before, after = await self.backend.pause(sb.live)
            sb.state, sb.held = "paused", not by_policy
            await self.state.update(sb.id, state="paused")
            seconds = time.perf_counter() - t0
            self._event(sb.id, "paused", {"memory_before": before, "memory_after": after, "seconds": round(seconds, 4)})
            self.metrics.paused.inc()
            return sb.info()

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self._get(sandbox_id)
        if sb.state == "paused":
            await self._resume(sb, transparent=False)
        elif sb.state != "running":
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not paused")
        return sb.info()

    async def _resume(self, sb: Sandbox, *, transparent: bool) -> None:
        async with sb.pause_lock:
            if sb.state != "paused" or sb.live is None:
                return
            t0 = time.perf_counter()
            await self.backend.resume(sb.live)
            sb.state, sb.held = "running", False
            self._touch(sb)
            await self.state.update(sb.id, state="running")
            self._event(sb.id, "resumed", {"transparent": transparent, "seconds": round(time.perf_counter() - t0, 4)})
            self.metrics.resumed.labels(transparent=str(transparent).lower()).inc()

    async def pause_many(self, labels: dict[str, str], concurrency: int = 16) -> builtins.list[str]:
        """Pause every running sandbox with these labels (busy ones are skipped); the ids paused."""
        return await self._for_each(self._matching(labels, ("running",)), self.pause, concurrency)

    async def resume_many(self, labels: dict[str, str], concurrency: int = 16) -> builtins.list[str]:
        return await self._for_each(self._matching(labels, ("paused",)), self.resume, concurrency)

    async def _for_each(
        self, sandboxes: builtins.list[Sandbox], op: Callable[[str], Awaitable[SandboxInfo]], concurrency: int
    ) -> builtins.list[str]:
        limit = asyncio.Semaphore(concurrency)
        done: builtins.list[str] = []

        async def one(sb: Sandbox) -> None:
            async with limit:
                try:
                    await op(sb.id)
                    done.append(sb.id)
                except SandboxError as exc:
                    log.info("%s of %s skipped: %s", getattr(op, "__name__", "op"), sb.id, exc)

        async with asyncio.TaskGroup() as tg:
            for sb in sandboxes:
                tg.create_task(one(sb))
        return done

    # -- TTL reaper ---------------------------------------------------------------------------------

    async def _reaper(self) -> None:
        last_flush = time.monotonic()
        last_retry = time.monotonic()
        while True:
            await asyncio.sleep(self.reaper_interval)
            try:
                last_flush, last_retry = await self._sweep(last_flush, last_retry)
            except Exception:
                log.exception("reaper sweep failed; retrying at the next one")

    async def _sweep(self, last_flush: float, last_retry: float) -> tuple[float, float]:
        """One pass of the reaper: TTLs, retention, stop retries, activity flush, orphan reaping."""
        now = time.time()
        retry_stops = time.monotonic() - last_retry > 10
        if retry_stops:
            last_retry = time.monotonic()
        for sb in list(self.sandboxes.values()):
            if sb.stop_failed:
                if retry_stops and sb.stop_task is not None and sb.stop_task.done():
                    self._spawn(self.stop(sb.id, reason="retry"), name=f"retry-stop-{sb.id}")
                continue
            if sb.state in ("running", "paused") and sb.inflight == 0:
                spec = sb.spec
                idle = now - sb.last_active_at
                if spec.idle_ttl is not None and idle > spec.idle_ttl and not (sb.state == "paused" and sb.held):
                    self._spawn(self.stop(sb.id, reason="idle_ttl"), name=f"ttl-{sb.id}")
                elif spec.max_lifetime is not None and now - sb.created_at > spec.max_lifetime:
                    self._spawn(self.stop(sb.id, reason="max_lifetime"), name=f"ttl-{sb.id}")
                elif sb.state == "running" and spec.pause_after is not None and idle > spec.pause_after:
                    self._spawn(self._auto_pause(sb.id), name=f"pause-{sb.id}")
            elif sb.state == "running" and spec_expired(sb, now):
                self._spawn(self.stop(sb.id, reason="max_lifetime"), name=f"ttl-{sb.id}")
            elif sb.state in ("stopped", "failed") and sb.stopped_at and now - sb.stopped_at > self.stopped_retention:
                if self.sandboxes.pop(sb.id, None) is not None:
                    sb.forget()
                await self.state.delete([sb.id])
        if time.monotonic() - last_flush > 5:
            dirty, self._dirty_activity = self._dirty_activity, {}
            try:
                await self.state.touch_many(dirty)
            except BaseException:
                self._dirty_activity = dirty | self._dirty_activity
                raise
            last_flush = time.monotonic()
        if self.pools is not None:
            await self.pools.shrink()
        if self.store.cache_max is not None and time.monotonic() - self._last_trim > CACHE_TRIM_INTERVAL:
            self._last_trim = time.monotonic()
            await self._trim_image_cache(set())
        procmod.reap_orphans()
        with contextlib.suppress(OSError):
            self._observe_cpu()
        return last_flush, last_retry

    def _usage_sources(self) -> builtins.list[tuple[str, str, str, Callable[[], CgroupStats]]]:
        """For the metrics scrape (in a worker thread): every sandbox holding resources, with a reader."""
        return [
            (sb.id, sb.state, sb.spec.qos, functools.partial(self.backend.stats, live))
            for sb in list(self.sandboxes.values())
            if (live := sb.live) is not None and sb.state in ("running", "paused")
        ]

    def _observe_cpu(self) -> None:
        """Feed admission the CPU time latency-sensitive sandboxes used: all sandboxes' (one counter
        that keeps what stopped ones used) minus best-effort ones' (alive, plus what those that
        stopped had used when last seen)."""
        best_effort = {}
        for sandbox_id in list(self._best_effort_ids):
            sb = self.sandboxes.get(sandbox_id)
            if sb is None or sb.live is None or sb.state not in ("running", "paused"):
                self._best_effort_ids.discard(sandbox_id)
                continue
            best_effort[sandbox_id] = self.backend.cpu_seconds(sb.live)
        for gone in self._best_effort_cpu.keys() - best_effort.keys():
            self._best_effort_retired += self._best_effort_cpu[gone]
        self._best_effort_cpu = best_effort
        used = self.backend.cpu_seconds(None) - sum(best_effort.values()) - self._best_effort_retired
        self.admission.observe_cpu(used, time.monotonic())

    async def _auto_pause(self, sandbox_id: str) -> None:
        with contextlib.suppress(WrongStateError):  # a request came in meanwhile
            await self.pause(sandbox_id, by_policy=True)

    def _touch(self, sb: Sandbox) -> None:
        sb.last_active_at = time.time()
        self._dirty_activity[sb.id] = sb.last_active_at

    # -- users ------------------------------------------------------------------------------------

    async def _user(self, sb: Sandbox, live: LiveSandbox, name: str) -> User:
        user = sb.users.get(name)
        if user is not None:
            return user
        if name.isdigit():
            user = User(int(name), int(name), "/")
        else:
            try:
                passwd = await self._fs(live, lambda fs: fs.read("/etc/passwd"))
            except NotFoundError:
                passwd = b""
            for line in passwd.decode(errors="replace").splitlines():
                parts = line.split(":")
                if len(parts) >= 6 and parts[0] == name and parts[2].isdigit() and parts[3].isdigit():
                    user = User(int(parts[2]), int(parts[3]), parts[5] or "/")
                    break
            else:
                raise InvalidArgumentError(f"user {name!r} does not exist in the sandbox")
        if not 0 <= user.uid < 65536 or not 0 <= user.gid < 65536:
            raise InvalidArgumentError(f"user {name!r} is outside the sandbox's id range")
        sb.users[name] = user
        return user

    # -- exec -------------------------------------------------------------------------------------

    async def _start(
        self,
        sb: Sandbox,
        live: LiveSandbox,
        req: ExecRequest,
        *,
        setsid: bool = False,
        keep_stdin: bool = False,
        uncapped: bool = False,
    ) -> ExecProcess:
        user = await self._user(sb, live, req.user or sb.spec.user)
        argv = _argv(req)
        env = {"PATH": DEFAULT_PATH, "HOME": user.home, "HOSTNAME": sb.spec.hostname or sb.id}
        env.update(sb.spec.env)
        env.update(req.env)
        try:
            process = await live.channel.start(
                argv,
                env=env,
                cwd=req.cwd or sb.spec.workdir,
                uid=user.uid,
                gid=user.gid,
                timeout=req.timeout,
                out_cap=None if uncapped else req.output_limit,
                stdin=req.stdin is not None or keep_stdin,
                setsid=setsid,
            )
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} is not answering (its init exited)") from exc
        if req.stdin is not None:
            try:
                await process.write_stdin(req.stdin.encode())
                await process.close_stdin()
            except ChannelClosedError as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command started") from exc
        return process

    async def _after_exec(
        self, sb: Sandbox, req: ExecRequest, result: ExecResult, out_bytes: int, err_bytes: int
    ) -> None:
        cmd = req.command if isinstance(req.command, str) else shlex.join(req.command)
        self._event(
            sb.id,
            "exec",
            {
                "command": cmd[:1000],
                "exit_code": result.exit_code,
                "duration": round(result.duration, 6),
                "stdout_bytes": out_bytes,
                "stderr_bytes": err_bytes,
                "timed_out": result.timed_out,
            },
        )
        if result.truncated:
            self._event(
                sb.id,
                "output_truncated",
                {"stdout_bytes": out_bytes, "stderr_bytes": err_bytes, "limit": req.output_limit},
            )
        if result.timed_out:
            self._event(sb.id, "exec_timeout", {"command": cmd[:1000], "timeout": req.timeout})
        # Only a failed command can have hit a limit (killed, or a refused fork reported on stderr);
        # reading the cgroup after every successful exec would cost a thread hop for nothing.
        if sb.live is not None and (result.exit_code >= 128 or (result.exit_code != 0 and result.stderr)):
            await self._record_limits(sb, sb.live)

    async def _record_limits(self, sb: Sandbox, live: LiveSandbox) -> None:
        """Turn cgroup counters into events: OOM kills and refused forks since we last looked."""
        try:
            stats = await asyncio.to_thread(self.backend.stats, live)
        except OSError:
            return
        if stats.oom_kills > sb.oom_kills:
            self._event(sb.id, "oom_kill", {"count": stats.oom_kills - sb.oom_kills, "limit": sb.spec.resources.memory})
            self.metrics.oom_kills.inc(stats.oom_kills - sb.oom_kills)
            sb.oom_kills = stats.oom_kills
        if stats.pids_limit_hits > sb.pids_hits:
            self._event(
                sb.id,
                "pids_limit",
                {"refused_forks": stats.pids_limit_hits - sb.pids_hits, "limit": sb.spec.resources.pids},
            )
            sb.pids_hits = stats.pids_limit_hits

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        sb, live = await self._ready(sandbox_id)
        if req.background:
            raise InvalidArgumentError("use the processes endpoint for background=true")
        sb.inflight += 1
        self._touch(sb)
        t0 = time.perf_counter()
        try:
            try:
                process = await self._start(sb, live, req)
            except ExecStartError as exc:
                return _start_failure(exc, req)
            try:
                out, err, ex = await process.wait()
            except (ChannelClosedError, ProtocolError) as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command ran") from exc
            result = _exec_result(out, err, ex)
            await self._after_exec(sb, req, result, ex.stdout_bytes, ex.stderr_bytes)
            return result
        finally:
            sb.inflight -= 1
            self._touch(sb)
            self.metrics.execs.inc()
            self.metrics.exec_seconds.observe(time.perf_counter() - t0)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> AsyncGenerator[ExecEvent, None]:
        """Validate and start now (so errors surface before streaming), then yield events."""
        sb, live = await self._ready(sandbox_id)
        sb.inflight += 1
        self._touch(sb)
        try:
            process = await self._start(sb, live, req)
        except ExecStartError as exc:
            sb.inflight -= 1
            failed = _start_failure(exc, req)

            async def failed_stream() -> AsyncGenerator[ExecEvent, None]:
                yield ExecEvent(type="stderr", data=failed.stderr)
                yield ExecEvent(type="exit", result=failed)

            return failed_stream()
        except BaseException:
            sb.inflight -= 1
            raise

        async def stream() -> AsyncGenerator[ExecEvent, None]:
            decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
            out: builtins.list[bytes] = []
            err: builtins.list[bytes] = []
            finished = False
            try:
                async for ev in process.events():
                    if isinstance(ev, OutputChunk):
                        (out if ev.stream == "stdout" else err).append(ev.data)
                        text = decoders[ev.stream].decode(ev.data)
                        if text:
                            yield ExecEvent(type=ev.stream, data=text)
                    else:
                        result = _exec_result(b"".join(out), b"".join(err), ev)
                        await self._after_exec(sb, req, result, ev.stdout_bytes, ev.stderr_bytes)
                        finished = True
                        yield ExecEvent(type="exit", result=result)
            except (ChannelClosedError, ProtocolError) as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command ran") from exc
            finally:
                sb.inflight -= 1  # first: nothing below may skip it
                self._touch(sb)
                self.metrics.execs.inc()
                if not finished and not live.channel.closed:
                    # The client went away mid-stream: don't leave the command running.
                    with contextlib.suppress(Exception):
                        await process.signal(signal.SIGKILL, SCOPE_TREE)

        return stream()

    # -- background processes -------------------------------------------------------------------

    async def start_process(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        try:
            process = await self._start(sb, live, req, setsid=True)
        except ExecStartError as exc:
            raise InvalidArgumentError(_start_failure(exc, req).stderr.strip()) from exc
        bp = BackgroundProcess("p-" + secrets.token_hex(6), req.command, time.time(), process)
        sb.processes[bp.id] = bp
        self._spawn(self._collect(sb, bp, req), name=f"bg-{sb.id}-{bp.id}")
        self._event(sb.id, "process_started", {"process_id": bp.id, "command": str(req.command)[:1000]})
        return self._process_info(bp)

    async def _collect(self, sb: Sandbox, bp: BackgroundProcess, req: ExecRequest) -> None:
        try:
            async for ev in bp.process.events():
                if isinstance(ev, OutputChunk):
                    (bp.stdout if ev.stream == "stdout" else bp.stderr).extend(ev.data)
                else:
                    bp.result = _exec_result(bytes(bp.stdout), bytes(bp.stderr), ev)
                    await self._after_exec(sb, req, bp.result, ev.stdout_bytes, ev.stderr_bytes)
        except AgentError:
            pass  # the sandbox went away; the process record shows it never finished
        finally:
            bp.done.set()

    def _process_info(self, bp: BackgroundProcess) -> ProcessInfo:
        return ProcessInfo(
            id=bp.id,
            command=bp.command,
            running=bp.result is None and not bp.done.is_set(),
            started_at=bp.started_at,
            result=bp.result,
        )

    def _bg(self, sandbox_id: str, process_id: str) -> tuple[Sandbox, BackgroundProcess]:
        sb = self._get(sandbox_id)
        bp = sb.processes.get(process_id)
        if bp is None:
            raise NotFoundError(f"process {process_id} not found in sandbox {sandbox_id}")
        return sb, bp

    def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return [self._process_info(bp) for bp in self._get(sandbox_id).processes.values()]

    async def wait_process(self, sandbox_id: str, process_id: str, timeout: float | None) -> ProcessInfo:
        _sb, bp = self._bg(sandbox_id, process_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await bp.done.wait()
        return self._process_info(bp)

    async def kill_process(self, sandbox_id: str, process_id: str, signo: int = signal.SIGKILL) -> ProcessInfo:
        sb, bp = self._bg(sandbox_id, process_id)
        if bp.result is None and sb.live is not None and not sb.live.channel.closed:
            await bp.process.signal(signo, SCOPE_TREE)
        return self._process_info(bp)

    # -- sessions ---------------------------------------------------------------------------------

    async def create_session(
        self, sandbox_id: str, env: dict[str, str], cwd: str | None, user: str | None
    ) -> SessionInfo:
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        shell = "/bin/sh"
        with contextlib.suppress(SandboxError):
            st = await self._fs(live, lambda fs: fs.stat("/bin/bash", follow_symlinks=True))
            if st.type == "file":
                shell = "/bin/bash"
        req = ExecRequest(command=[shell], env=env, cwd=cwd, user=user, timeout=None, output_limit=0)
        try:
            # The shell's output is bounded per command by SessionStream, not by the agent.
            process = await self._start(sb, live, req, setsid=True, keep_stdin=True, uncapped=True)
        except ExecStartError as exc:
            raise InternalError(f"cannot start a shell in the sandbox: {exc.message}") from exc
        session = Session("s-" + secrets.token_hex(6), shell, time.time(), process)
        sb.sessions[session.id] = session
        self._spawn(self._session_reader(session), name=f"session-{sb.id}-{session.id}")
        self._event(sb.id, "session_created", {"session_id": session.id, "shell": shell})
        return SessionInfo(id=session.id, shell=shell, created_at=session.created_at)

    async def _session_reader(self, session: Session) -> None:
        try:
            async for ev in session.process.events():
                if isinstance(ev, OutputChunk):
                    (session.out if ev.stream == "stdout" else session.err).feed(ev.data)
                    session.changed.set()
        except AgentError:
            pass
        finally:
            session.dead = True
            session.changed.set()

    def _session(self, sandbox_id: str, session_id: str) -> tuple[Sandbox, Session]:
        sb = self._get(sandbox_id)
        session = sb.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"session {session_id} not found in sandbox {sandbox_id}")
        return sb, session

    def list_sessions(self, sandbox_id: str) -> builtins.list[SessionInfo]:
        return [
            SessionInfo(id=s.id, shell=s.shell, created_at=s.created_at)
            for s in self._get(sandbox_id).sessions.values()
            if not s.dead
        ]

    async def session_run(
        self, sandbox_id: str, session_id: str, command: str, timeout: float | None, output_limit: int
    ) -> ExecResult:
        sb, session = self._session(sandbox_id, session_id)
        await self._ready(sandbox_id)
        if "\0" in command:
            raise InvalidArgumentError("command contains a NUL byte")
        async with session.lock:
            if session.dead:
                raise WrongStateError(f"session {session_id} has exited")
            sb.inflight += 1
            self._touch(sb)
            try:
                return await self._session_run(sb, session, command, timeout, output_limit)
            finally:
                sb.inflight -= 1
                self._touch(sb)

    async def _session_run(
        self, sb: Sandbox, session: Session, command: str, timeout: float | None, output_limit: int
    ) -> ExecResult:
        marker = f"__SANDFLEET_{secrets.token_hex(8)}__".encode()
        # `command eval`: a syntax error fails that command only; plain eval would exit a POSIX shell.
        script = (
            f"command eval {shlex.quote(command)} </dev/null\n"
            f"printf '\\n%s %d\\n' '{marker.decode()}' \"$?\"\n"
            f"printf '\\n%s\\n' '{marker.decode()}' >&2\n"
        )
        session.out.reset(b"\n" + marker, output_limit)
        session.err.reset(b"\n" + marker, output_limit)
        t0 = time.monotonic()
        timed_out = False
        try:
            await session.process.write_stdin(script.encode())
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc

        def finished() -> bool:
            # stdout's marker line carries the exit status: wait for its newline too.
            return session.out.done(need_line=True) and session.err.done(need_line=False)

        async def wait_done(limit: float | None) -> bool:
            async with asyncio.timeout(limit):
                while not finished():
                    if session.dead:
                        raise WrongStateError(f"session {session.id} exited while running the command")
                    session.changed.clear()
                    await session.changed.wait()
            return True

        try:
            await wait_done(timeout)
        except TimeoutError:
            timed_out = True
            # Kill what the shell is running, keep the shell (and its cwd/env) alive.
            with contextlib.suppress(ChannelClosedError):
                await session.process.signal(signal.SIGKILL, SCOPE_DESCENDANTS)
            try:
                await wait_done(5.0)
            except TimeoutError:
                session.dead = True
                with contextlib.suppress(ChannelClosedError):
                    await session.process.signal(signal.SIGKILL, SCOPE_TREE)
                raise SandboxTimeoutError(
                    f"command timed out after {timeout}s and the session's shell did not recover; "
                    "the session was closed"
                ) from None
        status = session.out.after.split(b"\n", 1)[0].strip()
        result = ExecResult(
            exit_code=int(status) if status.lstrip(b"-").isdigit() else -1,
            stdout=_decode(session.out.kept()),
            stderr=_decode(session.err.kept()),
            duration=time.monotonic() - t0,
            timed_out=timed_out,
            stdout_truncated=session.out.truncated(),
            stderr_truncated=session.err.truncated(),
        )
        req = ExecRequest(command=command, timeout=timeout, output_limit=output_limit)
        await self._after_exec(sb, req, result, session.out.content_length(), session.err.content_length())
        return result

    async def close_session(self, sandbox_id: str, session_id: str) -> None:
        sb, session = self._session(sandbox_id, session_id)
        sb.sessions.pop(session_id, None)
        if not session.dead and sb.live is not None and not sb.live.channel.closed:
            await session.process.signal(signal.SIGKILL, SCOPE_TREE)
        self._event(sb.id, "session_closed", {"session_id": session_id})

    # -- files ------------------------------------------------------------------------------------

    async def _fs(self, live: LiveSandbox, op: Callable[[SandboxFS], T]) -> T:
        def run() -> T:
            fd = self.backend.open_root(live)
            try:
                return op(SandboxFS(fd, uid_base=live.uid_base))
            finally:
                os.close(fd)

        try:
            return await asyncio.to_thread(run)
        except FileOpError as exc:
            cls = _FILE_ERRORS.get(exc.kind, InternalError)
            raise cls(str(exc)) from exc
        except FileNotFoundError as exc:
            raise UnavailableError(f"sandbox {live.id} is no longer running") from exc

    async def file_op(
        self, sandbox_id: str, op: Callable[[SandboxFS], T], event: tuple[str, dict[str, Any]] | None = None
    ) -> T:
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        result = await self._fs(live, op)
        if event is not None:
            self._event(sb.id, event[0], event[1])
        return result

    async def file_owner(self, sandbox_id: str, user: str | None) -> User:
        sb, live = await self._ready(sandbox_id)
        return await self._user(sb, live, user or sb.spec.user)


def spec_expired(sb: Sandbox, now: float) -> bool:
    return sb.spec.max_lifetime is not None and now - sb.created_at > sb.spec.max_lifetime


def file_info(st: FileStat) -> FileInfo:
    return FileInfo(
        path=st.path,
        name=st.name,
        type=st.type,
        size=st.size,
        mode=st.mode,
        uid=st.uid,
        gid=st.gid,
        mtime=st.mtime,
        link_target=st.link_target,
    )


def _inside_path(path: str) -> str:
    """An absolute path inside the sandbox, normalised, as a relative path of its root."""
    if not path.startswith("/") or "\0" in path:
        raise InvalidArgumentError(f"excluded path {path!r} must be absolute")
    norm = os.path.normpath(path).lstrip("/")
    if not norm or norm == "." or norm.split("/")[0] == "..":
        raise InvalidArgumentError(f"excluded path {path!r} must name something below /")
    return norm


def _scrub(root: Path, rel: str) -> None:
    """Drop `rel` from a copied writable layer, never following a symlink the sandbox made."""
    parts = rel.split("/")
    cur = root
    for part in parts[:-1]:
        cur = cur / part
        if cur.is_symlink() or not cur.is_dir():
            return  # nothing of the layer lies below a symlink or a file
    final = cur / parts[-1]
    if final.is_dir() and not final.is_symlink():
        shutil.rmtree(final)
    elif os.path.lexists(final):
        final.unlink()
