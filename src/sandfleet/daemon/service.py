"""The sandbox manager: lifecycle, exec, sessions, files, events, TTLs, restart recovery.

Backend-independent: a backend only creates/destroys sandboxes and hands back a `LiveSandbox`
(agent channel + root). Every long-lived task (reaper, event flusher, background processes, session
readers) runs in the manager's task group; nothing is fire-and-forget.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import codecs
import contextlib
import errno
import functools
import json
import logging
import math
import os
import posixpath
import re
import secrets
import shlex
import shutil
import signal
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Generic, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from sandfleet import __version__
from sandfleet.backends.base import Backend, LiveSandbox
from sandfleet.daemon import failpoints
from sandfleet.daemon.admission import Admission, AdmissionPolicy
from sandfleet.daemon.lifecycle import (
    CREATING,
    FAILED,
    HOLDING_STATES,
    LIVE_STATES,
    PAUSED,
    RUNNING,
    STOPPED,
    STOPPING,
    BackgroundProcess,
    CommandRun,
    EventJournal,
    Sandbox,
    SandboxTable,
    Session,
    User,
    new_sandbox_id,
)
from sandfleet.daemon.metrics import Metrics
from sandfleet.daemon.pool import WarmPools, pool_key
from sandfleet.daemon.state import SandboxRow, StateConflictError, StateDiskFullError, StateStore
from sandfleet.errors import (
    DataLossError,
    ImageNotFoundError,
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
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
    MAX_COMMAND,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEvent,
    FileInfo,
    Health,
    ImageInfo,
    ProcessInfo,
    SandboxEvent,
    SandboxInfo,
    SandboxSpec,
    SessionInfo,
    SessionRunRequest,
    SnapshotInfo,
    Usage,
    shown,
)
from sandfleet.runtime import proc as procmod
from sandfleet.runtime.agent import (
    NONCE_LEN,
    SCOPE_DESCENDANTS,
    SCOPE_TREE,
    AgentError,
    ChannelClosedError,
    CommandExit,
    ExecProcess,
    ExecStartError,
    ExitInfo,
    OutputChunk,
    ProtocolError,
    WatchEvent,
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
    "changed": WrongStateError,  # the sandbox moved things under a walk: stopped rather than followed
}


def _first_of_each(layers: list[LayerRef]) -> list[LayerRef]:
    """A stack without repeats. A layer named twice (two images on one base) keeps its first,
    lowest position: the shared base stays at the bottom, under what each image changed."""
    return list({x.digest: x for x in layers}.values())  # a dict keeps each key's first slot


@dataclass
class SnapshotRecord:
    info: SnapshotInfo
    path: Path
    spec: SandboxSpec  # of the sandbox it was taken from: what a restore starts
    meta: dict[str, Any]  # the backend's, for restore
    restoring: int = 0
    deleted: bool = False  # asked to go; its files go once no restore reads them


MAX_SNAPSHOTS_PER_SANDBOX = 256
SNAPSHOT_IN_PROGRESS = 3600.0  # a snapshot directory without its snapshot.json younger than this is being made
_SNAPSHOT_ID_RE = re.compile(r"^snap-[0-9a-f]{16}$")
CLAIM_WINDOW = 120.0  # a sandbox whose create was never answered is stopped after this (unless claimed)
# Lower layers of one overlay: the mount options (one ~100-byte path per layer) must fit a page.
MAX_LAYERS = 32
CACHE_TRIM_INTERVAL = 60.0
ACTIVITY_FLUSH = 5.0  # last-activity times reach the state store this often
PACK_TIMEOUT = 3600.0


# Deadlines the daemon keeps itself, whatever the agent does.
DEADLINE_GRACE = 15.0  # beyond a command's own timeout: the agent's kill, the exit, the reply
SESSION_LOST_GRACE = 5.0  # the agent's wait for a shell to report after a timeout (agent.c LOST_GRACE_US)
LIVENESS_INTERVAL = 10.0  # while waiting on the agent: ping it this often
LIVENESS_TIMEOUT = 10.0  # an agent that does not answer a ping within this is reported unresponsive
KILL_WAIT = 2.0  # after a fatal signal to a background process: wait this long for its exit
AGENT_START_TIMEOUT = 30.0  # the agent confirms a command started (or takes its input) within this
FATAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP})
PASSWD_MAX_BYTES = 4 * 1024**2  # of /etc/passwd read to resolve a user name
MAX_SESSIONS = 64  # open sessions per sandbox
IN_ISDIR = 0x40000000
_WATCH_KINDS = (  # inotify mask bit -> FileEvent type, first match wins
    (0x4000, "overflow"),  # IN_Q_OVERFLOW
    (0x100, "create"),  # IN_CREATE
    (0x200 | 0x400, "delete"),  # IN_DELETE, IN_DELETE_SELF
    (0x40, "rename_from"),  # IN_MOVED_FROM
    (0x80, "rename_to"),  # IN_MOVED_TO
    (0x2 | 0x8, "modify"),  # IN_MODIFY, IN_CLOSE_WRITE
    (0x4, "chmod"),  # IN_ATTRIB
)


def _watch_kind(mask: int) -> str | None:
    return next((kind for bits, kind in _WATCH_KINDS if mask & bits), None)


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _text(data: bytes, encoding: str) -> str:
    """Output for the wire: UTF-8 text (invalid bytes replaced) or base64 of the exact bytes."""
    return base64.b64encode(data).decode() if encoding == "base64" else _decode(data)


def _exec_result(out: bytes, err: bytes, ex: ExitInfo, encoding: str = "utf-8") -> ExecResult:
    return ExecResult(
        exit_code=ex.exit_code,
        stdout=_text(out, encoding),
        stderr=_text(err, encoding),
        duration=ex.duration,
        timed_out=ex.timed_out,
        stdout_truncated=ex.stdout_truncated,
        stderr_truncated=ex.stderr_truncated,
        signal=ex.signal,
        encoding=encoding,
    )


def _row(sb: Sandbox, runtime: dict[str, Any]) -> SandboxRow:
    """The state-store row of a sandbox being created or handed out."""
    spec = sb.spec
    return SandboxRow(sb.id, sb.state, spec.backend, spec.model_dump(mode="json"), spec.labels, runtime,
                      sb.created_at, sb.last_active_at, None, None,
                      idempotency_key=sb.idempotency_key, acked=sb.acked, held=sb.held)  # fmt: skip


def _argv(req: ExecRequest) -> list[str]:
    """A string command runs under /bin/sh -c; a list is the argv itself."""
    return ["/bin/sh", "-c", req.command] if isinstance(req.command, str) else list(req.command)


def _start_failure(exc: ExecStartError, req: ExecRequest) -> ExecResult:
    # Shell conventions: 127 = not found, 126 = found but not runnable.
    code = 127 if exc.errno == errno.ENOENT else 126
    return ExecResult(exit_code=code, stdout="", stderr=f"sandfleet: {_argv(req)[0]}: {exc.message}\n", duration=0.0)


class EventStream(Generic[T]):
    """The events of a stream the service started, whose resources (a request in flight, a session's
    lock, a watch) are released exactly once: when the events end, when the caller closes it, or
    when it is closed without ever being iterated (a client that went away before the first byte,
    where an async generator's `finally` would never run)."""

    def __init__(self, gen: AsyncGenerator[T, None], release: Callable[[], Awaitable[None]]) -> None:
        self._gen = gen
        self._release = release
        self._released = False

    def __aiter__(self) -> EventStream[T]:
        return self

    async def __anext__(self) -> T:
        return await self._gen.__anext__()

    async def release(self) -> None:
        if not self._released:
            self._released = True
            await self._release()

    async def aclose(self) -> None:
        try:
            await self._gen.aclose()
        finally:
            await self.release()


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
        snapshot_retention: float | None = None,
        snapshot_max_bytes: int | None = None,
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
        self.table = SandboxTable()
        self.table.on_stopped(self._release_execs)
        self.snapshot_dir = snapshot_dir
        self.snapshot_retention = snapshot_retention
        self.snapshot_max_bytes = snapshot_max_bytes
        self.import_dirs = import_dirs
        self.snapshots: dict[str, SnapshotRecord] = {}
        # idempotency key -> (the sandbox id it made, or the create still running; the request's fingerprint)
        self._keys: dict[str, tuple[str | asyncio.Future[str], str]] = {}
        self._last_trim = time.monotonic()
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self.pools = pools
        self.journal = EventJournal(state)
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
            self._spawn(self.journal.run(), name="event-flusher")
            if self.pools is not None:
                self._spawn(self.pools.run(self._spawn), name="warm-pools")
            try:
                await ready()
            finally:
                self._stopping = True
                if self.pools is not None:
                    await self.pools.drain()
                await self.journal.flush()
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
        now = time.time()
        repause: builtins.list[str] = []
        for row in rows:
            spec = _lenient_spec(row.spec)
            if spec is None:
                # A row this version cannot read must not keep the daemon from starting.
                log.error("sandbox %s: unreadable spec in the state store; removing it", row.id)
                await self.backend.cleanup(row.id, row.runtime)
                await self.state.delete([row.id])
                continue
            unheard = not row.acked and row.idempotency_key is None
            if row.idempotency_key is not None:  # a retry of its create gets this one, stopped or not
                self._keys[row.idempotency_key] = (row.id, "")
            if row.state in HOLDING_STATES and not unheard:
                # adopt() thaws a paused sandbox first (a frozen agent cannot answer): it comes back
                # running; one paused on request is paused again below, its idle policy may pause
                # the others again.
                live = await self.backend.adopt(row.id, row.runtime)
                if live is not None:
                    sb = self._recovered(row, spec, RUNNING, now)
                    sb.live = live
                    if not sb.acked:  # a create whose answer was lost: its retry (same key) claims it
                        sb.claim_by = now + CLAIM_WINDOW
                    self.admission.commit(spec.resources)
                    live.channel.on_close = lambda _ch, sid=row.id: self._on_agent_lost(sid)
                    self.table.add(sb)
                    self.journal.record(row.id, "adopted", {"agent_pid": live.agent_pid})
                    if spec.qos == "best_effort":
                        self._best_effort_ids.add(row.id)
                    if row.state == PAUSED and row.held:
                        repause.append(row.id)
                    continue
            if row.state not in (STOPPED, FAILED):  # it was live (or a state this version does not know)
                await self.backend.cleanup(row.id, row.runtime)
                sb = self._recovered(row, spec, FAILED if row.state == CREATING else STOPPED, now)
                sb.stop_reason = sb.stop_reason or (
                    "its create was never answered" if unheard else "lost in daemon restart"
                )
                sb.stopped_at = time.time()
                self.journal.record(row.id, "stopped", {"reason": sb.stop_reason})
                self.table.add(sb)
                await self._forget(sb)
                continue
            self.table.add(self._recovered(row, spec, row.state, now))
        leftovers = self.backend.leftovers()
        orphans = (set(leftovers.get("sandbox_dirs", [])) | set(leftovers.get("cgroups", []))) - known
        if self.state.reset_from is not None:
            # The database was damaged and set aside: what still runs is taken back from the node.
            orphans -= await self._rebuild(orphans)
        await self._recover_snapshots()
        # Residue with no row at all (a crash between mkdir and insert, warm pool members).
        for name in orphans:
            await self.backend.cleanup(name, {})
        for sandbox_id in repause:
            with contextlib.suppress(SandboxError):
                await self.pause(sandbox_id)
        self.metrics.alive.set(self.running_count())

    def _recovered(self, row: SandboxRow, spec: SandboxSpec, state: str, now: float) -> Sandbox:
        """The record of a sandbox a previous daemon left in the state store, in `state`."""
        return Sandbox(
            row.id,
            spec,
            state,
            row.created_at,
            # Activity reaches the store every ACTIVITY_FLUSH seconds: the last use before a crash
            # may not have, so the sandbox is given the benefit of the doubt (never reaped early).
            min(now, row.last_active_at + ACTIVITY_FLUSH + self.reaper_interval),
            stopped_at=row.stopped_at,
            stop_reason=row.stop_reason,
            idempotency_key=row.idempotency_key,
            acked=bool(row.acked),
        )

    async def _rebuild(self, candidates: set[str]) -> set[str]:
        """After the state database was lost: adopt the sandboxes still running on the node (their
        cgroups and agents say what they are), with what can be known of their specs. Returns the
        ids taken back."""
        taken: set[str] = set()
        # Rows still readable in the damaged file give back the spec (labels, env, TTLs) of theirs.
        salvaged = {row.id: row for row in getattr(self.state, "salvaged", [])}
        lost = "events and exec history; for sandboxes whose row was lost too: labels, env, user, workdir, TTLs"
        for sandbox_id in sorted(candidates):
            found = await self.backend.recover(sandbox_id)
            if found is None:
                continue
            live, resources = found
            spec = SandboxSpec(image=None, layers=[], resources=resources, labels={"sandfleet.recovered": "true"})
            row = salvaged.get(sandbox_id)
            if row is not None:
                with contextlib.suppress(ValidationError):
                    spec = SandboxSpec.model_validate(row.spec)
            now = time.time()
            sb = Sandbox(sandbox_id, spec, RUNNING, now, now, live=live)
            self.table.add(sb)
            await self.state.insert(_row(sb, live.runtime))
            self.admission.commit(spec.resources)
            live.channel.on_close = lambda _ch, sid=sandbox_id: self._on_agent_lost(sid)
            self.journal.record(sandbox_id, "recovered", {"from": str(self.state.reset_from), "lost": lost})
            taken.add(sandbox_id)
        log.warning(
            "state database %s was damaged (%s) and set aside: %d running sandboxes were taken back from "
            "the node; lost: %s",
            self.state.reset_from,
            self.state.reset_reason,
            len(taken),
            lost,
        )
        return taken

    async def health(self) -> Health:
        return Health(
            status="ok",
            version=__version__,
            sandboxes_running=self.running_count(),
            backends=[self.backend.name],
            pools=self.pools.sizes() if self.pools is not None else {},
        )

    async def metrics_text(self) -> tuple[bytes, str]:
        """The Prometheus exposition of the node's metrics, and its content type."""
        with contextlib.suppress(OSError), open("/proc/self/statm") as f:  # noqa: ASYNC230 (procfs)
            self.metrics.daemon_rss.set(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        adm = self.admission
        self.metrics.admission_cpu_committed.set(adm.committed_cpu)
        self.metrics.admission_cpu_load.set(adm.cpu_load)
        self.metrics.admission_memory_committed.set(adm.committed_memory)
        # Per-sandbox series read thousands of cgroup files: off the event loop.
        return await asyncio.to_thread(generate_latest, self.metrics.registry), CONTENT_TYPE_LATEST

    def running_count(self) -> int:
        return self.table.count(RUNNING)

    def node_count(self) -> int:
        """Sandboxes holding node resources: running or paused, being created, and warm in pools."""
        pooled = self.pools.pooled() if self.pools is not None else 0
        return self.table.count(RUNNING, PAUSED) + self._creating + pooled

    # -- events -----------------------------------------------------------------------------------

    async def events(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[SandboxEvent]:
        self._get(sandbox_id)
        return await self.journal.read(sandbox_id, after, limit)

    # -- create / get / list / stop ---------------------------------------------------------------

    def _get(self, sandbox_id: str) -> Sandbox:
        return self.table.get(sandbox_id)

    async def _ready(self, sandbox_id: str) -> tuple[Sandbox, LiveSandbox]:
        """The sandbox, running: a paused one is resumed first (any request resumes it)."""
        sb = self._get(sandbox_id)
        if not sb.acked:
            self._ack(sb)
        if sb.state == PAUSED:
            await self._resume(sb, transparent=True)
        return self._running(sandbox_id)

    def _running(self, sandbox_id: str) -> tuple[Sandbox, LiveSandbox]:
        sb = self._get(sandbox_id)
        if sb.state != RUNNING or sb.live is None:
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

    async def create_batch(
        self,
        specs: list[SandboxSpec],
        concurrency: int,
        idempotency_keys: builtins.list[str | None] | None = None,
    ) -> list[SandboxInfo | SandboxError]:
        """Create each spec, `concurrency` at a time; each item succeeds or fails on its own."""
        limit = asyncio.Semaphore(concurrency)
        keys = idempotency_keys or [None] * len(specs)

        async def one(spec: SandboxSpec, key: str | None) -> SandboxInfo | SandboxError:
            async with limit:
                try:
                    return await self.create(spec, idempotency_key=key)
                except SandboxError as exc:
                    return exc
                except StateDiskFullError as exc:
                    return ResourceExhaustedError(f"the node's state disk is full: {exc}"[:300])
                except Exception as exc:  # noqa: BLE001 (one item's bug must not fail its siblings)
                    log.exception("create in a batch failed")
                    return InternalError(f"create failed: {exc}")

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(one(spec, key)) for spec, key in zip(specs, keys, strict=True)]
        return [t.result() for t in tasks]

    async def _claimed(self, key: str, fingerprint: str) -> SandboxInfo | None:
        """What an idempotency key already made (waiting for a create with it still running)."""
        while True:
            entry = self._keys.get(key)
            if entry is None:
                return None
            made, seen = entry
            if seen != fingerprint and seen != "":
                raise InvalidArgumentError(f"idempotency key {shown(key)} was used for another request")
            if isinstance(made, asyncio.Future):
                with contextlib.suppress(Exception):
                    await asyncio.shield(made)
                continue  # settled: look again (a failed create frees its key)
            sb = self.table.find(made)
            if sb is None:  # forgotten since (stopped and past retention): the key is free again
                self._keys.pop(key, None)
                return None
            if sb.state == CREATING:
                await asyncio.shield(sb.created.wait())
            self._ack(sb)
            return sb.info()

    async def create(self, spec: SandboxSpec, *, idempotency_key: str | None = None) -> SandboxInfo:
        """Create a sandbox. With an idempotency key, a create retried after a timeout, a broken
        connection or a daemon crash returns the sandbox the first one made."""
        if idempotency_key is None:
            info = await self._create(spec, None)
            failpoints.hit("create_before_answer")
            return info
        fingerprint = spec.model_dump_json(exclude_unset=True)
        existing = await self._claimed(idempotency_key, fingerprint)
        if existing is not None:
            return existing
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._keys[idempotency_key] = (fut, fingerprint)
        try:
            info = await self._create(spec, idempotency_key)
        except BaseException as exc:
            self._keys.pop(idempotency_key, None)
            fut.set_exception(exc if isinstance(exc, Exception) else InternalError("create cancelled"))
            fut.exception()  # retrieved: waiters look again
            raise
        self._keys[idempotency_key] = (info.id, fingerprint)
        fut.set_result(info.id)
        failpoints.hit("create_before_answer")
        return info

    async def _create(self, spec: SandboxSpec, key: str | None) -> SandboxInfo:
        self._check_backend(spec)
        if self.pools is not None:
            pkey = pool_key(spec)
            pooled = self.pools.image(pkey)  # what the pool's members were made from
            # Before taking a member: a spec the image's defaults make invalid must not cost one.
            effective = self._with_image_defaults(spec, pooled) if pooled is not None else spec
            live = self.pools.take(pkey)
            if live is not None:
                return await self._hand_out(effective, live, key)
        self._admit(spec)
        try:
            image = await self.resolve_environment(spec)
            spec = self._with_image_defaults(spec, image)
        except BaseException:
            self._creating -= 1
            self.admission.release(spec.resources)
            raise
        created = {"image": spec.environment(), "layers": [x.digest for x in image.layers]}
        return await self._start_admitted(spec, lambda sid: self.backend.create(sid, spec, image), created, key)

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
        self,
        spec: SandboxSpec,
        start: Callable[[str], Awaitable[LiveSandbox]],
        created: dict[str, Any],
        key: str | None = None,
    ) -> SandboxInfo:
        """Record a new sandbox, start it with `start(id)` (a create or a restore), make it running."""
        # Until the backend holds the resources, a failure must hand the admission budget back.
        holds_budget = True
        t0 = time.perf_counter()
        try:
            sandbox_id = new_sandbox_id()
            now = time.time()
            sb = Sandbox(sandbox_id, spec, CREATING, now, now, idempotency_key=key, acked=False)
            sb.claim_by = now + CLAIM_WINDOW
            self.table.add(sb)
            finished = sb.created  # set however this create ends; a concurrent stop waits on it
            try:
                await self.state.insert(_row(sb, {}))
            except BaseException as exc:
                self.table.discard(sb)
                finished.set()
                if isinstance(exc, StateConflictError):  # a row with this key is still being removed
                    raise UnavailableError("a sandbox made with this idempotency key is being removed: retry") from exc
                raise
            try:
                live = await start(sandbox_id)
            except BaseException as exc:
                if sb.idempotency_key is not None:  # a failed create answers no retry: its key is free
                    sb.idempotency_key = None
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.state.update(sandbox_id, idempotency_key=None))
                self.table.move(sb, FAILED)
                sb.stopped_at, sb.stop_reason = time.time(), f"create failed: {exc}"[:500]
                self.journal.record(sandbox_id, "create_failed", {"error": str(exc)[:500]})
                await asyncio.shield(self._forget(sb))
                self.metrics.create_failures.inc()
                finished.set()
                raise
            sb.live = live
            holds_budget = False  # released by stop from here on
            live.channel.on_close = lambda _ch: self._on_agent_lost(sandbox_id)
            self.table.move(sb, RUNNING)
            finished.set()
            await self.state.update(sandbox_id, state=RUNNING, runtime=live.runtime)
            await self._settle_create(sb, live, created, t0)
        finally:
            self._creating -= 1
            if holds_budget:
                self.admission.release(spec.resources)
        return sb.info()

    async def _hand_out(self, spec: SandboxSpec, live: LiveSandbox, key: str | None = None) -> SandboxInfo:
        """Give a warm sandbox to this caller (its budget is already committed) and make it theirs."""
        t0 = time.perf_counter()
        now = time.time()
        sb = Sandbox(live.id, spec, RUNNING, now, now, live=live, idempotency_key=key, acked=False)
        sb.claim_by = now + CLAIM_WINDOW
        sb.created.set()
        self.table.add(sb)
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
        self.journal.record(sb.id, "created", created)
        self.metrics.created.inc()
        self.metrics.create_seconds.observe(time.perf_counter() - t0)
        self.metrics.alive.set(self.running_count())

    def _drop(self, sb: Sandbox) -> None:
        """No longer listed: out of the table, its idempotency key free again."""
        self.table.discard(sb)
        if sb.idempotency_key is not None:
            entry = self._keys.get(sb.idempotency_key)
            if entry is not None and entry[0] == sb.id:
                del self._keys[sb.idempotency_key]

    async def _forget(self, sb: Sandbox) -> None:
        """Persist a terminal state; drop the row at once when nothing is retained."""
        if self.stopped_retention <= 0:
            await self.journal.flush()
            await self.state.delete([sb.id])
            self._drop(sb)  # after the row: its idempotency key is free only once no row holds it
        else:
            await self.state.update(sb.id, state=sb.state, stopped_at=sb.stopped_at, stop_reason=sb.stop_reason)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        sb = self._get(sandbox_id)
        self._ack(sb)  # whoever names it knows it: the create was heard
        return sb.info()

    def _ack(self, sb: Sandbox) -> None:
        """The caller has the sandbox (its create's answer went out, or it was named since): it is
        no longer reaped as a create nobody heard about."""
        if not sb.acked:
            sb.acked = True
            self._spawn(self.state.update(sb.id, acked=1), name=f"ack-{sb.id}")

    async def ack(self, sandbox_ids: builtins.list[str]) -> None:
        """The answer naming these sandboxes was handed to the client (one write for all of them)."""
        heard = []
        for sandbox_id in sandbox_ids:
            sb = self.table.find(sandbox_id)
            if sb is not None and not sb.acked and sb.state in LIVE_STATES:
                sb.acked = True
                heard.append(sandbox_id)
        if heard:
            self._spawn(self.state.set_acked(heard), name="ack")

    async def update_lifetime(self, sandbox_id: str, fields: dict[str, float | None]) -> SandboxInfo:
        """Change a live sandbox's idle TTL and/or max lifetime (None removes that limit)."""
        sb = self._get(sandbox_id)
        if sb.state not in (CREATING, RUNNING, PAUSED):
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}")
        if fields:
            sb.spec = sb.spec.model_copy(update=fields)
            self._touch(sb)  # a new idle TTL counts from now
            await self.state.update(sb.id, spec=sb.spec.model_dump(mode="json"))
            self.journal.record(sb.id, "lifetime_changed", dict(fields))
        return sb.info()

    async def update_lifetimes(self, labels: dict[str, str], fields: dict[str, float | None]) -> builtins.list[str]:
        ids = [sb.id for sb in self._matching(labels, (CREATING, RUNNING, PAUSED))]
        for sandbox_id in ids:
            with contextlib.suppress(SandboxError):
                await self.update_lifetime(sandbox_id, fields)
        return ids

    async def list(self, labels: dict[str, str] | None = None, state: str | None = None) -> list[SandboxInfo]:
        """Sandboxes with these labels; `state`: one state, "live" (the default: not stopped or
        failed) or "all"."""
        wanted: frozenset[str] | None = LIVE_STATES if state in (None, "live") else None
        if state not in (None, "live", "all"):
            wanted = frozenset({state}) if state is not None else None
        out = []
        for sb in self.table:
            if wanted is not None and sb.state not in wanted:
                continue
            if labels and any(sb.spec.labels.get(k) != v for k, v in labels.items()):
                continue
            out.append(sb.info())
        return out

    def _on_agent_lost(self, sandbox_id: str) -> None:
        sb = self.table.find(sandbox_id)
        if sb is None or sb.state != RUNNING or self._tg is None:
            return
        self.journal.record(sandbox_id, "agent_lost", {})
        self._spawn(self.stop(sandbox_id, reason="sandbox init exited"), name=f"lost-{sandbox_id}")

    async def stop(self, sandbox_id: str, reason: str = "user") -> SandboxInfo:
        sb = self._get(sandbox_id)
        if sb.state == CREATING:
            # Stopping mid-create would race the backend; let the create settle first.
            await asyncio.shield(sb.created.wait())
        if sb.state in (STOPPED, FAILED) and not sb.stop_failed:
            return sb.info()
        if sb.stop_task is None or (sb.stop_task.done() and sb.stop_failed):
            sb.stop_task = self._spawn(self._do_stop(sb, reason), name=f"stop-{sandbox_id}")
        await asyncio.shield(sb.stop_task)
        if sb.stop_failed:
            # It still runs (or may): say so. The reaper retries.
            raise InternalError(f"sandbox {sandbox_id} could not be stopped: {sb.stop_reason}")
        return sb.info()

    async def _do_stop(self, sb: Sandbox, reason: str) -> None:
        self.table.move(sb, STOPPING)
        if sb.id in self._best_effort_cpu and sb.live is not None:
            # Its final CPU time, so the admission's count of latency-sensitive use does not jump.
            with contextlib.suppress(OSError):
                self._best_effort_retired += self.backend.cpu_seconds(sb.live)
                del self._best_effort_cpu[sb.id]
        try:
            # Not being able to record it (a full disk) must not keep a sandbox running: a restart
            # finds a row whose agent is gone and cleans up.
            await self.state.update(sb.id, state=STOPPING)
        except Exception:
            log.warning("sandbox %s: could not record that it is stopping; stopping it anyway", sb.id, exc_info=True)
        try:
            if sb.live is not None:
                await self._record_limits(sb, sb.live)
                await self.backend.destroy(sb.live)
        except Exception as exc:
            # Still holds resources: keep the row `stopping` (a restart retries) and let the reaper
            # retry the stop; the admission budget stays taken until it succeeds.
            log.exception("stopping sandbox %s failed", sb.id)
            self.table.move(sb, FAILED)
            sb.stop_failed, sb.stop_reason = True, f"stop failed: {exc}"[:500]
            self.journal.record(sb.id, "stop_failed", {"error": str(exc)[:500]})
            self.metrics.alive.set(self.running_count())
            return
        sb.stop_failed = False
        sb.stopped_at, sb.stop_reason = time.time(), reason
        self.table.move(sb, STOPPED)
        self.admission.release(sb.spec.resources)
        self.journal.record(sb.id, "stopped", {"reason": reason})
        self._dirty_activity.pop(sb.id, None)
        try:
            await self._forget(sb)
        except Exception:
            log.warning("sandbox %s: stopped, but the state store did not take it", sb.id, exc_info=True)
        self.metrics.stopped.labels(reason=reason.split(":")[0][:32]).inc()
        self.metrics.alive.set(self.running_count())

    @staticmethod
    def _release_execs(sb: Sandbox) -> None:
        """Stop hook: its background processes and sessions will never answer again."""
        for bp in sb.processes.values():
            bp.lost = bp.lost or f"sandbox {sb.id} stopped ({sb.stop_reason})"
            bp.done.set()
        for session in sb.sessions.values():
            session.dead = True

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]:
        ids = [s.id for s in self._matching(labels, HOLDING_STATES)]
        results = await asyncio.gather(*(self.stop(i, reason) for i in ids), return_exceptions=True)
        return [i for i, r in zip(ids, results, strict=True) if not isinstance(r, BaseException)]

    def _matching(self, labels: dict[str, str], states: Iterable[str]) -> builtins.list[Sandbox]:
        return self.table.matching(labels, states)

    # -- snapshots, restore, fork ------------------------------------------------------------------

    async def snapshot(
        self,
        sandbox_id: str,
        *,
        ttl: float | None = None,
        labels: dict[str, str] | None = None,
        temporary: bool = False,
    ) -> SnapshotInfo:
        """Checkpoint a sandbox (a paused one is resumed for it and paused again); it keeps running.
        The snapshot outlives the sandbox: it is kept until deleted or until its ttl (default: the
        node's snapshot_retention) runs out. `temporary`: a fork's, deleted right after."""
        if self.snapshot_dir is None:
            raise UnavailableError("snapshots are not enabled on this daemon")
        was = self._get(sandbox_id)
        was_paused, was_held = was.state == PAUSED, was.held
        if not temporary:
            if len(self._snapshots_of(sandbox_id)) >= MAX_SNAPSHOTS_PER_SANDBOX:
                raise ResourceExhaustedError(
                    f"sandbox {sandbox_id} has {MAX_SNAPSHOTS_PER_SANDBOX} snapshots already: delete one first"
                )
            used = sum(r.info.size_bytes for r in self.snapshots.values() if not r.deleted)
            if self.snapshot_max_bytes is not None and used >= self.snapshot_max_bytes:
                raise ResourceExhaustedError(
                    f"the node's snapshot store holds {used} of {self.snapshot_max_bytes} bytes "
                    "(snapshot_max_bytes): delete snapshots first"
                )
        sb, live = await self._ready(sandbox_id)
        async with sb.pause_lock:
            if sb.state != RUNNING or sb.live is not live:
                raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
            snapshot_id = "snap-" + secrets.token_hex(8)
            path = self.snapshot_dir / snapshot_id
            t0 = time.perf_counter()
            inherit = self._inheritance(sb)
            try:
                meta = await self.backend.snapshot(live, path)
                meta["keep_execs"] = [s["exec_id"] for s in inherit["sessions"]]
                meta["keep_execs"] += [p["exec_id"] for p in inherit["processes"]]
                meta["inherit"] = inherit
                seconds = time.perf_counter() - t0
                size = await asyncio.to_thread(fsutil.disk_usage, path)
                now = time.time()
                keep_for = ttl if ttl is not None else self.snapshot_retention
                info = SnapshotInfo(
                    id=snapshot_id,
                    sandbox_id=sb.id,
                    created_at=now,
                    size_bytes=size,
                    seconds=round(seconds, 4),
                    labels=labels or {},
                    expires_at=None if keep_for is None else now + keep_for,
                )
                record = {"info": info.model_dump(mode="json"), "spec": sb.spec.model_dump(mode="json"), "meta": meta}
                await asyncio.to_thread(_write_json, path / "snapshot.json", record)
                if sb.state != RUNNING:  # stopped meanwhile (stop does not wait for the pause lock)
                    raise WrongStateError(f"sandbox {sandbox_id} stopped while its snapshot was taken")
            except BaseException:
                await asyncio.to_thread(shutil.rmtree, path, True)
                raise
            self.snapshots[snapshot_id] = SnapshotRecord(info, path, sb.spec, meta)
            self._touch(sb)
            self.journal.record(sb.id, "snapshot", {"snapshot": snapshot_id, "bytes": size, "seconds": info.seconds})
            self.metrics.snapshot_seconds.observe(seconds)
        if was_paused:
            with contextlib.suppress(SandboxError):
                await self.pause(sandbox_id, by_policy=not was_held)
        return info

    @staticmethod
    def _inheritance(sb: Sandbox) -> dict[str, builtins.list[dict[str, Any]]]:
        """The sessions and background processes a child of this moment keeps (same ids): their
        processes are in the snapshot, the handles to drive them are these."""
        sessions = [
            {"id": s.id, "exec_id": s.process.id, "pid": s.process.pid, "shell": s.shell, "created_at": s.created_at}
            for s in sb.sessions.values()
            if not s.dead
        ]
        processes = [
            {
                "id": bp.id,
                "exec_id": bp.process.id,
                "pid": bp.process.pid,
                "command": bp.command,
                "started_at": bp.started_at,
                "encoding": bp.encoding,
                "limit": bp.limit,
                "stdout": base64.b64encode(bytes(bp.stdout)).decode(),
                "stderr": base64.b64encode(bytes(bp.stderr)).decode(),
            }
            for bp in sb.processes.values()
            if not bp.done.is_set()
        ]
        return {"sessions": sessions, "processes": processes}

    def _inherit(self, sb: Sandbox, live: LiveSandbox, inherit: dict[str, Any]) -> None:
        """Handles in a restored child for its parent's sessions and background processes."""
        for s in inherit.get("sessions", []):
            proc = live.inherited.get(int(s["exec_id"]))
            if proc is not None:
                self._add_session(sb, Session(str(s["id"]), str(s["shell"]), float(s["created_at"]), proc))
        for p in inherit.get("processes", []):
            proc = live.inherited.get(int(p["exec_id"]))
            if proc is None:
                continue
            bp = BackgroundProcess(
                str(p["id"]), p["command"], float(p["started_at"]), proc, encoding=p["encoding"], limit=int(p["limit"])
            )
            bp.stdout.extend(base64.b64decode(p["stdout"]))
            bp.stderr.extend(base64.b64decode(p["stderr"]))
            sb.processes[bp.id] = bp
            req = ExecRequest(command=bp.command, timeout=None, output_limit=bp.limit, encoding=bp.encoding)
            self._spawn(self._collect(sb, bp, req), name=f"bg-{sb.id}-{bp.id}")

    def _snapshot(self, snapshot_id: str) -> SnapshotRecord:
        rec = self.snapshots.get(snapshot_id)
        if rec is None and self.snapshot_dir is not None and _SNAPSHOT_ID_RE.match(snapshot_id):
            # one another node (sharing snapshot_dir) took since this daemon started
            rec = _load_snapshot(self.snapshot_dir / snapshot_id, time.time())
            if rec is not None:
                self.snapshots[snapshot_id] = rec
        if rec is None or rec.deleted:
            raise SnapshotNotFoundError(f"snapshot {shown(snapshot_id)} not found")
        return rec

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return self._snapshot(snapshot_id).info

    async def list_snapshots(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        return self._snapshots_of(sandbox_id, labels)

    def _snapshots_of(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        return [
            r.info
            for r in self.snapshots.values()
            if not r.deleted
            and (sandbox_id is None or r.info.sandbox_id == sandbox_id)
            and all(r.info.labels.get(k) == v for k, v in (labels or {}).items())
        ]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._drop_snapshot(self._snapshot(snapshot_id))

    async def _drop_snapshot(self, rec: SnapshotRecord) -> None:
        rec.deleted = True
        if rec.restoring == 0 and self.snapshots.pop(rec.info.id, None) is not None:
            await asyncio.to_thread(shutil.rmtree, rec.path, True)

    async def _expire_snapshots(self, now: float) -> None:
        for rec in list(self.snapshots.values()):
            if rec.info.expires_at is not None and now > rec.info.expires_at and not rec.deleted:
                log.info("snapshot %s expired", rec.info.id)
                await self._drop_snapshot(rec)

    async def _recover_snapshots(self) -> None:
        """Keep every readable snapshot that has not expired (they outlive their sandboxes)."""
        if self.snapshot_dir is None:
            return
        # Root only: snapshots hold sandboxes' files (owned by their uids) and memory.
        self.snapshot_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.snapshot_dir, 0o700)
        now = time.time()
        for path in await asyncio.to_thread(lambda: sorted(self.snapshot_dir.iterdir()) if self.snapshot_dir else []):
            rec = await asyncio.to_thread(_load_snapshot, path, now)
            if rec is not None:
                self.snapshots[rec.info.id] = rec
                continue
            with contextlib.suppress(OSError):
                if not (path / "snapshot.json").exists() and now - path.stat().st_mtime < SNAPSHOT_IN_PROGRESS:
                    continue  # being taken right now (by another node sharing the directory)
            log.warning("snapshot directory %s is unreadable or expired: removing it", path)
            await asyncio.to_thread(shutil.rmtree, path, True)

    async def _batch_key(
        self, key: str, fingerprint: str, count: int
    ) -> builtins.list[SandboxInfo | SandboxError] | None:
        """A fork or restore retried with its idempotency key: the children the first one made
        (waiting for it if it still runs); None if the key is new."""
        while True:
            entry = self._keys.get(key)
            if entry is None:
                if f"{key}#0" not in self._keys:
                    return None
                entry = ("batch", fingerprint)  # made before a restart: its children's rows carry the keys
            made, seen = entry
            if seen != fingerprint:
                raise InvalidArgumentError(f"idempotency key {shown(key)} was used for another request")
            if not isinstance(made, asyncio.Future):
                break
            with contextlib.suppress(Exception):
                await asyncio.shield(made)  # then look again: it made its children, or nothing
        out: builtins.list[SandboxInfo | SandboxError] = []
        for i in range(count):
            child = await self._claimed(f"{key}#{i}", "")
            out.append(child if child is not None else InternalError("this child was not made (it failed)"))
        return out

    async def _keyed_batch(
        self, key: str | None, fingerprint: str, count: int, make: Callable[[], Awaitable[builtins.list[Any]]]
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """Run a fork or restore under its idempotency key: a concurrent or later retry waits for it
        and gets the same children."""
        if key is None:
            return await make()
        done = await self._batch_key(key, fingerprint, count)
        if done is not None:
            return done
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._keys[key] = (fut, fingerprint)
        try:
            results = await make()
        except BaseException:
            self._keys.pop(key, None)  # it made nothing: a retry runs it again
            fut.set_result("failed")
            raise
        self._keys[key] = ("batch", fingerprint)
        fut.set_result("batch")
        return results

    def _child_spec(self, rec: SnapshotRecord, labels: dict[str, str] | None) -> SandboxSpec:
        """The spec of a restored child: the snapshot's, with the caller's labels added (validated
        together: a parent's labels plus a fork's may not exceed what any spec may carry)."""
        try:
            return SandboxSpec.model_validate(
                {**rec.spec.model_dump(exclude_unset=True), "labels": {**rec.spec.labels, **(labels or {})}}
            )
        except ValidationError as exc:
            errors = "; ".join(str(e["msg"])[:200] for e in exc.errors()[:3])
            raise InvalidArgumentError(f"the children's labels are not valid: {errors}") from exc

    async def restore(
        self,
        snapshot_id: str,
        count: int = 1,
        labels: dict[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` new sandboxes from a snapshot, started together; each succeeds or fails on its own.
        Each child keeps the parent's sessions and background processes (same ids)."""
        rec = self._snapshot(snapshot_id)
        spec = self._child_spec(rec, labels)
        fingerprint = json.dumps(["restore", snapshot_id, count, sorted((labels or {}).items())])
        return await self._keyed_batch(
            idempotency_key, fingerprint, count, lambda: self._restore(rec, spec, count, idempotency_key)
        )

    async def _restore(
        self, rec: SnapshotRecord, spec: SandboxSpec, count: int, key: str | None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        created = {"snapshot": rec.info.id, "source": rec.info.sandbox_id}
        inherit = rec.meta.get("inherit", {})

        async def one(index: int) -> SandboxInfo | SandboxError:
            child_key = None if key is None else f"{key}#{index}"
            try:
                self._check_backend(spec)
                self._admit(spec)
                info = await self._start_admitted(
                    spec, lambda sid: self.backend.restore(sid, spec, rec.path, rec.meta), created, child_key
                )
                if child_key is not None:
                    self._keys[child_key] = (info.id, "")
                child = self.table.find(info.id)
                if child is not None and child.live is not None:
                    self._inherit(child, child.live, inherit)
                return info
            except SandboxError as exc:
                return exc
            except StateDiskFullError as exc:
                return ResourceExhaustedError(f"the node's state disk is full: {exc}"[:300])
            except Exception as exc:  # noqa: BLE001 (one child's failure must not fail its siblings)
                log.exception("restore of %s failed", rec.info.id)
                return InternalError(f"restore failed: {exc}"[:300])

        rec.restoring += 1
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(i)) for i in range(count)]
        finally:
            rec.restoring -= 1
            if rec.deleted:
                await self._drop_snapshot(rec)
        return [t.result() for t in tasks]

    async def fork(
        self,
        sandbox_id: str,
        count: int = 1,
        labels: dict[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """`count` copies of a live (or paused) sandbox: a snapshot, restored `count` times, deleted."""
        fingerprint = json.dumps(["fork", sandbox_id, count, sorted((labels or {}).items())])

        async def make() -> builtins.list[SandboxInfo | SandboxError]:
            snap = await self.snapshot(sandbox_id, temporary=True)
            try:
                rec = self._snapshot(snap.id)
                return await self._restore(rec, self._child_spec(rec, labels), count, idempotency_key)
            finally:
                rec2 = self.snapshots.get(snap.id)
                if rec2 is not None:
                    await self._drop_snapshot(rec2)

        return await self._keyed_batch(idempotency_key, fingerprint, count, make)

    # -- pack: a live sandbox's changes as a new image ----------------------------------------------

    async def pack(self, sandbox_id: str, ref: str, exclude: builtins.list[str]) -> ImageInfo:
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
        self._busy(sb, PACK_TIMEOUT)  # not paused by the idle policy meanwhile
        try:
            await self.backend.export_writable_layer(live, staging)
            for rel in scrub:
                await asyncio.to_thread(_scrub, staging, rel)
            layer = await self.store.add_layer_from_dir(
                staging, f"changes of sandbox {sandbox_id}", kind="layer", shift_ids=False
            )
        finally:
            self._idle_done(sb)
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
        self.journal.record(sandbox_id, "packed", {"image": manifest.ref, "layer": layer.digest, "bytes": layer.size})
        return image_info(manifest)

    async def list_images(self) -> builtins.list[ImageInfo]:
        return [image_info(m) for m in await asyncio.to_thread(self.store.list_images)]

    async def build_image(self, ref: str) -> ImageInfo:
        """The image `ref`, built from its built-in recipe if the node does not have it yet."""
        return image_info(await self.resolve_image(ref))

    async def push_image(self, ref: str) -> ImageInfo:
        """Publish a local image to the shared store as on-demand layers."""
        if self.store.shared is None:
            raise InvalidArgumentError("no shared store is configured (shared_image_dir)")
        try:
            return image_info(await self.store.push(ref))
        except InvalidRefError as exc:
            raise InvalidArgumentError(f"invalid image reference {ref!r}: {exc}") from exc
        except StoreImageNotFound as exc:
            raise ImageNotFoundError(f"image {ref} not found") from exc
        except LayerCorruptError as exc:
            raise DataLossError(str(exc)) from exc
        except ImageError as exc:
            raise InternalError(f"pushing {ref} failed: {exc}") from exc

    async def import_image(self, path: str, ref: str | None) -> ImageInfo:
        """An OCI image (docker save tarball, OCI layout or its tar) on this host, as an image."""
        source = Path(path)
        if not source.is_absolute() or not await asyncio.to_thread(source.exists):
            raise InvalidArgumentError(f"import source {path!r} must be an absolute path that exists on the node")
        try:
            # `within` is checked on the opened file, so a path swapped after any check cannot escape.
            return image_info(await oci.import_image(self.store, source, ref, within=self.import_dirs))
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
        for sb in self.table:
            if sb.live is not None and sb.state in LIVE_STATES:
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
        if sb.live is None or sb.state not in HOLDING_STATES:
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
            if sb.state == PAUSED:
                if not by_policy and not sb.held:
                    sb.held = True
                    await self.state.update(sb.id, held=1)
                return sb.info()
            if sb.state != RUNNING or sb.live is None:
                raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not running")
            if _is_busy(sb, time.time()):
                raise WrongStateError(f"sandbox {sandbox_id} has {sb.inflight} request(s) in flight")
            t0 = time.perf_counter()
            before, after = await self.backend.pause(sb.live)
            self.table.move(sb, PAUSED)
            sb.held = not by_policy
            await self.state.update(sb.id, state=PAUSED, held=int(sb.held))
            seconds = time.perf_counter() - t0
            self.journal.record(
                sb.id, "paused", {"memory_before": before, "memory_after": after, "seconds": round(seconds, 4)}
            )
            self.metrics.paused.inc()
            return sb.info()

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        sb = self._get(sandbox_id)
        if sb.state == PAUSED:
            await self._resume(sb, transparent=False)
        elif sb.state != RUNNING:
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}, not paused")
        return sb.info()

    async def _resume(self, sb: Sandbox, *, transparent: bool) -> None:
        async with sb.pause_lock:
            if sb.state != PAUSED or sb.live is None:
                return
            t0 = time.perf_counter()
            await self.backend.resume(sb.live)
            self.table.move(sb, RUNNING)
            sb.held = False
            self._touch(sb)
            await self.state.update(sb.id, state=RUNNING, held=0)
            seconds = round(time.perf_counter() - t0, 4)
            self.journal.record(sb.id, "resumed", {"transparent": transparent, "seconds": seconds})
            self.metrics.resumed.labels(transparent=str(transparent).lower()).inc()

    async def pause_many(self, labels: dict[str, str], concurrency: int = 16) -> builtins.list[str]:
        """Pause every running sandbox with these labels (busy ones are skipped); the ids paused."""
        return await self._for_each(self._matching(labels, (RUNNING,)), self.pause, concurrency)

    async def resume_many(self, labels: dict[str, str], concurrency: int = 16) -> builtins.list[str]:
        return await self._for_each(self._matching(labels, (PAUSED,)), self.resume, concurrency)

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
        for sb in self.table:
            if sb.stop_failed:
                if retry_stops and sb.stop_task is not None and sb.stop_task.done():
                    self._spawn(self.stop(sb.id, reason="retry"), name=f"retry-stop-{sb.id}")
                continue
            if sb.state in HOLDING_STATES and not _is_busy(sb, now):
                spec = sb.spec
                idle = now - sb.last_active_at
                if not sb.acked and now > sb.claim_by:
                    self._spawn(self.stop(sb.id, reason="never claimed"), name=f"unclaimed-{sb.id}")
                elif spec.idle_ttl is not None and idle > spec.idle_ttl and not (sb.state == PAUSED and sb.held):
                    self._spawn(self.stop(sb.id, reason="idle_ttl"), name=f"ttl-{sb.id}")
                elif spec.max_lifetime is not None and now - sb.created_at > spec.max_lifetime:
                    self._spawn(self.stop(sb.id, reason="max_lifetime"), name=f"ttl-{sb.id}")
                elif sb.state == RUNNING and spec.pause_after is not None and idle > spec.pause_after:
                    self._spawn(self._auto_pause(sb.id), name=f"pause-{sb.id}")
            elif sb.state == RUNNING and spec_expired(sb, now):
                self._spawn(self.stop(sb.id, reason="max_lifetime"), name=f"ttl-{sb.id}")
            elif sb.state in (STOPPED, FAILED) and sb.stopped_at and now - sb.stopped_at > self.stopped_retention:
                await self.state.delete([sb.id])
                self._drop(sb)
        if time.monotonic() - last_flush > ACTIVITY_FLUSH:
            dirty, self._dirty_activity = self._dirty_activity, {}
            try:
                await self.state.touch_many(dirty)
            except BaseException:
                self._dirty_activity = dirty | self._dirty_activity
                raise
            last_flush = time.monotonic()
        if self.pools is not None:
            await self.pools.shrink()
        await self._expire_snapshots(now)
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
            for sb in self.table
            if (live := sb.live) is not None and sb.state in HOLDING_STATES
        ]

    def _observe_cpu(self) -> None:
        """Feed admission the CPU time latency-sensitive sandboxes used: all sandboxes' (one counter
        that keeps what stopped ones used) minus best-effort ones' (alive, plus what those that
        stopped had used when last seen)."""
        best_effort = {}
        for sandbox_id in list(self._best_effort_ids):
            sb = self.table.find(sandbox_id)
            if sb is None or sb.live is None or sb.state not in HOLDING_STATES:
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
            # Streamed through a capped parser in a worker thread: a 62 MB /etc/passwd costs the
            # sandbox's own disk, never the daemon's memory or its event loop.
            try:
                found = await self._fs(live, lambda fs: fs.lookup_user(name, max_bytes=PASSWD_MAX_BYTES))
            except NotFoundError:
                found = None
            if found is None:
                raise InvalidArgumentError(f"user {shown(name)} does not exist in the sandbox")
            user = User(*found)
        if not 0 <= user.uid < 65536 or not 0 <= user.gid < 65536:
            raise InvalidArgumentError(f"user {shown(name)} is outside the sandbox's id range")
        if len(sb.users) < 64:
            sb.users[name] = user
        return user

    # -- exec -------------------------------------------------------------------------------------

    @staticmethod
    def _cwd(sb: Sandbox, cwd: str | None) -> str:
        """A working directory inside the sandbox: relative ones are taken from the sandbox's workdir."""
        if cwd is None:
            return sb.spec.workdir
        return cwd if cwd.startswith("/") else posixpath.normpath(posixpath.join(sb.spec.workdir, cwd))

    async def _start(
        self,
        sb: Sandbox,
        live: LiveSandbox,
        req: ExecRequest,
        *,
        setsid: bool = False,
        keep_stdin: bool = False,
        uncapped: bool = False,
        session: bool = False,
        nondump: bool = False,
    ) -> ExecProcess:
        user = await self._user(sb, live, req.user or sb.spec.user)
        argv = _argv(req)
        env = {"PATH": DEFAULT_PATH, "HOME": user.home, "HOSTNAME": sb.spec.hostname or sb.id}
        env.update(sb.spec.env)
        env.update(req.env)
        data = req.stdin_bytes()
        keep = keep_stdin or req.keep_stdin_open
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):  # even an agent that stopped reading
                process = await live.channel.start(
                    argv,
                    env=env,
                    cwd=self._cwd(sb, req.cwd),
                    uid=user.uid,
                    gid=user.gid,
                    timeout=req.timeout,
                    out_cap=None if uncapped else req.output_limit,
                    stdin=data is not None or keep,
                    setsid=setsid,
                    merge_stderr=req.merge_stderr,
                    session=session,
                    nondump=nondump,
                )
        except TimeoutError:
            raise self._unresponsive(sb, f"a command did not start within {AGENT_START_TIMEOUT:.0f}s") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} is not answering (its init exited)") from exc
        except ValueError as exc:  # the one agent message would exceed its 64 KiB
            raise InvalidArgumentError(
                f"the command, its environment and working directory are too large together ({exc}); "
                "write a script file and run it"
            ) from exc
        if data is not None or (keep is False and (req.stdin is not None or req.stdin_b64 is not None)):
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):
                    if data:
                        await process.write_stdin(data)
                    if not keep:
                        await process.close_stdin()
            except TimeoutError:
                live.channel.kill_nowait(process.id)
                raise self._unresponsive(sb, "it stopped reading the command's standard input") from None
            except ChannelClosedError as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command started") from exc
        return process

    def _busy(self, sb: Sandbox, timeout: float | None) -> float:
        """A request starts: until its deadline it keeps the sandbox from its idle TTL and the idle
        pause (never past it: a stuck request must not exempt the sandbox from its TTLs)."""
        sb.inflight += 1
        deadline = math.inf if timeout is None else time.time() + timeout + DEADLINE_GRACE
        sb.busy_until = max(sb.busy_until if sb.inflight > 1 else 0.0, deadline)
        self._touch(sb)
        return deadline

    def _idle_done(self, sb: Sandbox) -> None:
        sb.inflight -= 1
        if sb.inflight == 0:
            sb.busy_until = 0.0
        self._touch(sb)

    async def _await_agent(self, sb: Sandbox, live: LiveSandbox, aw: Awaitable[T], deadline: float) -> T:
        """Wait for an answer of the agent, but never forever: past `deadline` (wall clock; inf for
        none), or as soon as the agent stops answering pings while we wait, the sandbox is reported
        (event `agent_unresponsive`) and the caller gets a typed error."""
        task: asyncio.Future[T] = asyncio.ensure_future(aw)
        try:
            while True:
                wait = min(LIVENESS_INTERVAL, deadline - time.time())
                if wait > 0:
                    done, _ = await asyncio.wait({task}, timeout=wait)
                    if done:
                        return task.result()
                if time.time() >= deadline:
                    raise self._unresponsive(sb, "its command did not end by its deadline")
                if sb.pause_lock.locked():
                    continue  # frozen by us (a snapshot, a pause being taken): silence is expected
                limit = max(1.0, min(LIVENESS_TIMEOUT, deadline - time.time()))
                try:
                    await live.channel.ping(timeout=limit)
                except TimeoutError:
                    raise self._unresponsive(sb, f"no answer to a ping within {limit:.0f}s") from None
                except ChannelClosedError:
                    pass  # the task sees the closed channel too
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _unresponsive(self, sb: Sandbox, why: str) -> SandboxError:
        if not sb.unresponsive:
            sb.unresponsive = True
            self.journal.record(sb.id, "agent_unresponsive", {"reason": why})
            self.metrics.agent_unresponsive.inc()
            log.warning("sandbox %s: its agent is not answering (%s)", sb.id, why)
        return UnavailableError(f"sandbox {sb.id} is not answering: {why}; it keeps its TTLs and can be stopped")

    async def _after_exec(
        self, sb: Sandbox, req: ExecRequest, result: ExecResult, out_bytes: int, err_bytes: int
    ) -> ExecResult:
        """Record the exec; returns the result, with `oom_killed` set when the kernel's OOM killer
        ended it (a SIGKILL the cgroup counted as an OOM kill since we last looked)."""
        cmd = req.command if isinstance(req.command, str) else shlex.join(req.command)
        # Only a failed command can have hit a limit (killed, or a refused fork reported on stderr);
        # reading the cgroup after every successful exec would cost a thread hop for nothing.
        if sb.live is not None and (result.exit_code >= 128 or (result.exit_code != 0 and result.stderr)):
            new_ooms = await self._record_limits(sb, sb.live)
            killed = result.signal == signal.SIGKILL or result.exit_code == 128 + signal.SIGKILL
            if new_ooms and killed and not result.timed_out:
                result = result.model_copy(update={"oom_killed": True})
        self.journal.record(
            sb.id,
            "exec",
            {
                "command": cmd[:1000],
                "exit_code": result.exit_code,
                "duration": round(result.duration, 6),
                "stdout_bytes": out_bytes,
                "stderr_bytes": err_bytes,
                "timed_out": result.timed_out,
                **({"oom_killed": True} if result.oom_killed else {}),
            },
        )
        if result.truncated:
            self.journal.record(
                sb.id,
                "output_truncated",
                {"stdout_bytes": out_bytes, "stderr_bytes": err_bytes, "limit": req.output_limit},
            )
        if result.timed_out:
            self.journal.record(sb.id, "exec_timeout", {"command": cmd[:1000], "timeout": req.timeout})
        return result

    async def _record_limits(self, sb: Sandbox, live: LiveSandbox) -> int:
        """Turn cgroup counters into events: OOM kills and refused forks since we last looked.
        Returns the number of new OOM kills."""
        try:
            stats = await asyncio.to_thread(self.backend.stats, live)
        except OSError:
            return 0
        new_ooms = max(0, stats.oom_kills - sb.oom_kills)
        if new_ooms:
            self.journal.record(sb.id, "oom_kill", {"count": new_ooms, "limit": sb.spec.resources.memory})
            self.metrics.oom_kills.inc(new_ooms)
            sb.oom_kills = stats.oom_kills
        if stats.pids_limit_hits > sb.pids_hits:
            self.journal.record(
                sb.id,
                "pids_limit",
                {"refused_forks": stats.pids_limit_hits - sb.pids_hits, "limit": sb.spec.resources.pids},
            )
            sb.pids_hits = stats.pids_limit_hits
        return new_ooms

    async def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        sb, live = await self._ready(sandbox_id)
        if req.background:
            raise InvalidArgumentError("use the processes endpoint for background=true")
        deadline = self._busy(sb, req.timeout)
        t0 = time.perf_counter()
        try:
            try:
                process = await self._start(sb, live, req)
            except ExecStartError as exc:
                return _start_failure(exc, req)
            try:
                out, err, ex = await self._await_agent(sb, live, process.wait(), deadline)
            except (ChannelClosedError, ProtocolError) as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command ran") from exc
            except BaseException:
                if not live.channel.closed:  # abandoned (deadline, client gone): don't leave it running
                    live.channel.kill_nowait(process.id)
                raise
            result = _exec_result(out, err, ex, req.encoding)
            return await self._after_exec(sb, req, result, ex.stdout_bytes, ex.stderr_bytes)
        finally:
            self._idle_done(sb)
            self.metrics.execs.inc()
            self.metrics.exec_seconds.observe(time.perf_counter() - t0)

    async def exec_stream(self, sandbox_id: str, req: ExecRequest) -> EventStream[ExecEvent]:
        """Validate and start now (so errors surface before streaming), then yield events."""
        sb, live = await self._ready(sandbox_id)
        deadline = self._busy(sb, req.timeout)
        try:
            process = await self._start(sb, live, req)
        except ExecStartError as exc:
            self._idle_done(sb)
            failed = _start_failure(exc, req)

            async def failed_stream() -> AsyncGenerator[ExecEvent, None]:
                yield ExecEvent(type="stderr", data=_text(failed.stderr.encode(), req.encoding))
                yield ExecEvent(type="exit", result=failed.model_copy(update={"encoding": req.encoding}))

            return EventStream(failed_stream(), _nothing)
        except BaseException:
            self._idle_done(sb)
            raise
        finished = False

        async def release() -> None:
            self._idle_done(sb)
            self.metrics.execs.inc()
            if not finished and not live.channel.closed:
                # The client went away (mid-stream, or before it began): don't leave the command running.
                live.channel.kill_nowait(process.id)

        async def stream() -> AsyncGenerator[ExecEvent, None]:
            nonlocal finished
            decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
            out: builtins.list[bytes] = []
            err: builtins.list[bytes] = []
            events = process.events()
            try:
                while True:
                    try:
                        ev = await self._await_agent(sb, live, anext(events), deadline)
                    except StopAsyncIteration:
                        break
                    if isinstance(ev, OutputChunk):
                        (out if ev.stream == "stdout" else err).append(ev.data)
                        if req.encoding == "base64":
                            yield ExecEvent(type=ev.stream, data=base64.b64encode(ev.data).decode())
                        else:
                            text = decoders[ev.stream].decode(ev.data)
                            if text:
                                yield ExecEvent(type=ev.stream, data=text)
                    elif isinstance(ev, ExitInfo):
                        result = _exec_result(b"".join(out), b"".join(err), ev, req.encoding)
                        result = await self._after_exec(sb, req, result, ev.stdout_bytes, ev.stderr_bytes)
                        finished = True
                        yield ExecEvent(type="exit", result=result)
                        break
            except (ChannelClosedError, ProtocolError) as exc:
                raise UnavailableError(f"sandbox {sb.id} stopped while the command ran") from exc
            finally:
                await wrapped.release()

        wrapped = EventStream(stream(), release)
        return wrapped

    # -- background processes -------------------------------------------------------------------

    async def start_process(self, sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        try:
            process = await self._start(sb, live, req, setsid=True)
        except ExecStartError as exc:
            raise InvalidArgumentError(_start_failure(exc, req).stderr.strip()) from exc
        bp = BackgroundProcess(
            "p-" + secrets.token_hex(6),
            req.command,
            time.time(),
            process,
            encoding=req.encoding,
            limit=req.output_limit,
        )
        sb.processes[bp.id] = bp
        self._spawn(self._collect(sb, bp, req), name=f"bg-{sb.id}-{bp.id}")
        self.journal.record(sb.id, "process_started", {"process_id": bp.id, "command": str(req.command)[:1000]})
        return self._process_info(bp)

    async def _collect(self, sb: Sandbox, bp: BackgroundProcess, req: ExecRequest) -> None:
        try:
            async for ev in bp.process.events():
                if isinstance(ev, OutputChunk):
                    buf = bp.stdout if ev.stream == "stdout" else bp.stderr
                    buf.extend(ev.data[: max(0, bp.limit - len(buf))])  # the agent caps it too
                elif isinstance(ev, ExitInfo):
                    result = _exec_result(bytes(bp.stdout), bytes(bp.stderr), ev, bp.encoding)
                    bp.result = await self._after_exec(sb, req, result, ev.stdout_bytes, ev.stderr_bytes)
        except AgentError:
            bp.lost = bp.lost or "its sandbox's agent went away"
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
            raise NotFoundError(f"process {shown(process_id)} not found in sandbox {sandbox_id}")
        return sb, bp

    def _check_finished(self, sb: Sandbox, bp: BackgroundProcess) -> None:
        """A process that will never report an exit is an error, not a result of None."""
        if bp.done.is_set() and bp.result is None:
            why = bp.lost or f"sandbox {sb.id} is {sb.state}"
            raise WrongStateError(f"process {bp.id} ended without an exit status: {why}")

    async def list_processes(self, sandbox_id: str) -> builtins.list[ProcessInfo]:
        return [self._process_info(bp) for bp in self._get(sandbox_id).processes.values()]

    async def wait_process(self, sandbox_id: str, process_id: str, timeout: float | None) -> ProcessInfo:
        sb, bp = self._bg(sandbox_id, process_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await bp.done.wait()
        self._check_finished(sb, bp)
        return self._process_info(bp)

    async def kill_process(self, sandbox_id: str, process_id: str, signo: int = signal.SIGKILL) -> ProcessInfo:
        """Signal the process's tree; for a signal that ends processes, wait briefly for its exit so
        the answer says what happened, not what was before."""
        sb, bp = self._bg(sandbox_id, process_id)
        if bp.result is None and not bp.done.is_set():
            if sb.live is None or sb.live.channel.closed or sb.state not in HOLDING_STATES:
                raise WrongStateError(f"sandbox {sb.id} is {sb.state}: process {bp.id} is gone with it")
            if sb.state == PAUSED:
                await self._ready(sandbox_id)
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):
                    await bp.process.signal(signo, SCOPE_TREE)
            except TimeoutError:
                raise self._unresponsive(sb, "it stopped taking signals") from None
            if signo in FATAL_SIGNALS:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(KILL_WAIT):
                        await bp.done.wait()
        self._check_finished(sb, bp)
        return self._process_info(bp)

    async def write_process_stdin(self, sandbox_id: str, process_id: str, data: bytes, close: bool) -> None:
        sb, bp = self._bg(sandbox_id, process_id)
        if bp.done.is_set() or sb.live is None or sb.live.channel.closed:
            raise WrongStateError(f"process {bp.id} has ended")
        await self._ready(sandbox_id)
        self._touch(sb)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                if data:
                    await bp.process.write_stdin(data)
                if close:
                    await bp.process.close_stdin()
        except TimeoutError:
            raise self._unresponsive(sb, "it stopped reading a process's standard input") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc

    # -- sessions ---------------------------------------------------------------------------------

    async def create_session(
        self, sandbox_id: str, env: dict[str, str], cwd: str | None, user: str | None
    ) -> SessionInfo:
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        if len([s for s in sb.sessions.values() if not s.dead]) >= MAX_SESSIONS:
            raise ResourceExhaustedError(f"sandbox {sb.id} has {MAX_SESSIONS} sessions open: close one first")
        shell, shielded = await self._session_shell(live)
        req = ExecRequest(command=[shell], env=env, cwd=cwd, user=user, timeout=None, output_limit=0)
        try:
            # Output is capped per command by the agent (SRUN), dropped and counted between commands.
            process = await self._start(
                sb, live, req, setsid=True, keep_stdin=True, uncapped=True, session=True, nondump=shielded
            )
        except ExecStartError as exc:
            raise InvalidArgumentError(f"cannot start a shell in the sandbox: {exc.message}") from exc
        session = Session("s-" + secrets.token_hex(6), shell, time.time(), process)
        self._add_session(sb, session)
        self.journal.record(sb.id, "session_created", {"session_id": session.id, "shell": shell})
        return self._session_info(session)

    async def _session_shell(self, live: LiveSandbox) -> tuple[str, bool]:
        """The shell for a session, and whether it may start non-dumpable: bash and dash give up the
        differing effective gid the agent starts them with (busybox ash would keep it)."""
        with contextlib.suppress(SandboxError):
            st = await self._fs(live, lambda fs: fs.stat("/bin/bash", follow_symlinks=True))
            if st.type == "file":
                return "/bin/bash", True
        target = ""
        with contextlib.suppress(SandboxError):
            target = (await self._fs(live, lambda fs: fs.stat("/bin/sh"))).link_target or ""
        return "/bin/sh", posixpath.basename(target) in ("dash", "bash")

    def _add_session(self, sb: Sandbox, session: Session) -> None:
        sb.sessions[session.id] = session
        self._spawn(self._session_reader(sb, session), name=f"session-{sb.id}-{session.id}")

    @staticmethod
    def _session_info(s: Session) -> SessionInfo:
        return SessionInfo(id=s.id, shell=s.shell, created_at=s.created_at, busy=s.current is not None)

    async def _session_reader(self, sb: Sandbox, session: Session) -> None:
        try:
            async for ev in session.process.events():
                cur = session.current
                if isinstance(ev, OutputChunk):
                    if cur is None:
                        continue
                    buf = cur.out if ev.stream == "stdout" else cur.err
                    buf.extend(ev.data[: max(0, cur.limit - len(buf))])  # the agent caps it too
                    if cur.stream is not None:
                        cur.stream.put_nowait(ev)
                elif isinstance(ev, CommandExit):
                    if cur is not None and ev.seq != cur.seq:
                        continue  # the end of a command given up earlier
                    if ev.dropped_before:
                        self.journal.record(sb.id, "session_output_dropped", {"session_id": session.id,
                                                                       "bytes": ev.dropped_before})  # fmt: skip
                    if cur is not None and cur.ended is not None and not cur.ended.done():
                        cur.ended.set_result(ev)
                    if cur is not None and cur.stream is not None:
                        cur.stream.put_nowait(ev)
        except AgentError:
            pass
        finally:
            session.dead = True
            cur = session.current
            if cur is not None:
                if cur.ended is not None and not cur.ended.done():
                    cur.ended.set_exception(WrongStateError(f"session {session.id} ended while running the command"))
                if cur.stream is not None:
                    cur.stream.put_nowait(None)

    def _session(self, sandbox_id: str, session_id: str) -> tuple[Sandbox, Session]:
        sb = self._get(sandbox_id)
        session = sb.sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"session {shown(session_id)} not found in sandbox {sandbox_id}")
        return sb, session

    async def list_sessions(self, sandbox_id: str) -> builtins.list[SessionInfo]:
        return [self._session_info(s) for s in self._get(sandbox_id).sessions.values() if not s.dead]

    async def get_session(self, sandbox_id: str, session_id: str) -> SessionInfo:
        _sb, session = self._session(sandbox_id, session_id)
        if session.dead:
            raise WrongStateError(f"session {session_id} has exited")
        return self._session_info(session)

    def _script(self, req: SessionRunRequest, nonce: str) -> bytes:
        """What the shell runs for one command: `command eval` keeps a syntax error from ending the
        shell; the status goes to the agent through fd 100, which only the shell itself may write
        (the agent checks the sender's pid), with a nonce no other process can read."""
        stdin = "<&101" if req.stdin is not None or req.stdin_b64 is not None or req.keep_stdin_open else "</dev/null"
        merge = " 2>&1" if req.merge_stderr else ""
        return (
            f"command eval {shlex.quote(req.command)} {stdin}{merge}\n"
            f"command printf '%s %d\\n' '{nonce}' \"$?\" >&100\n"
        ).encode()

    async def _session_begin(
        self, sandbox_id: str, session_id: str, req: SessionRunRequest, *, stream: bool
    ) -> tuple[Sandbox, LiveSandbox, Session, CommandRun, float]:
        """Take the session's lock and start one command in it (the caller releases the lock)."""
        sb, session = self._session(sandbox_id, session_id)
        _sb, live = await self._ready(sandbox_id)
        wait = None if req.timeout is None else req.timeout + DEADLINE_GRACE
        try:
            async with asyncio.timeout(wait):  # behind another command of the session
                await session.lock.acquire()
        except TimeoutError:
            raise SandboxTimeoutError(
                f"session {session_id} stayed busy with another command for {wait:.0f}s"
            ) from None
        try:
            if session.dead:
                raise WrongStateError(f"session {session_id} has exited")
            deadline = self._busy(sb, None if req.timeout is None else req.timeout + SESSION_LOST_GRACE)
            loop = asyncio.get_running_loop()
            data = req.stdin_bytes()
            session.next_seq += 1
            run = CommandRun(req.output_limit, req.encoding, ended=loop.create_future(), seq=session.next_seq)
            run.stdin_open = data is not None or req.keep_stdin_open
            if stream:
                run.stream = asyncio.Queue()
            session.current = run
            nonce = secrets.token_hex(NONCE_LEN // 2)
            try:
                async with asyncio.timeout(AGENT_START_TIMEOUT):  # even an agent that stopped reading
                    await session.process.run_command(
                        self._script(req, nonce),
                        nonce.encode(),
                        timeout=req.timeout,
                        out_cap=req.output_limit,
                        stdin=run.stdin_open,
                        seq=run.seq,
                    )
                    if data:
                        await session.process.write_command_stdin(data)
                    if data is not None and not req.keep_stdin_open:
                        await session.process.close_command_stdin()
                        run.stdin_open = False
            except BaseException as exc:
                session.current = None
                self._idle_done(sb)
                if isinstance(exc, ChannelClosedError):
                    raise UnavailableError(f"sandbox {sb.id} stopped") from exc
                if isinstance(exc, TimeoutError):
                    session.dead = True
                    live.channel.kill_nowait(session.process.id, SCOPE_TREE)
                    raise self._unresponsive(sb, "it stopped taking a session's command") from None
                # Cut off mid-script (the caller went away): the shell's input is in an unknown
                # state, so the session ends rather than run half a command later.
                session.dead = True
                live.channel.kill_nowait(session.process.id, SCOPE_TREE)
                raise
            return sb, live, session, run, deadline
        except BaseException:
            session.lock.release()
            raise

    def _session_end(self, sb: Sandbox, session: Session) -> None:
        session.current = None
        self._idle_done(sb)
        session.lock.release()

    async def _session_result(
        self, sb: Sandbox, session: Session, req: SessionRunRequest, run: CommandRun, ev: CommandExit
    ) -> ExecResult:
        if ev.lost:
            session.dead = True
            with contextlib.suppress(ChannelClosedError):
                await session.process.signal(signal.SIGKILL, SCOPE_TREE)
            if ev.timed_out:
                raise SandboxTimeoutError(
                    f"command timed out after {req.timeout}s and the session's shell did not recover; "
                    "the session was closed"
                )
            raise WrongStateError(f"session {session.id} exited while running the command")
        result = ExecResult(
            exit_code=ev.status,
            stdout=_text(bytes(run.out), req.encoding),
            stderr=_text(bytes(run.err), req.encoding),
            duration=ev.duration,
            timed_out=ev.timed_out,
            stdout_truncated=ev.stdout_truncated,
            stderr_truncated=ev.stderr_truncated,
            encoding=req.encoding,
        )
        as_exec = ExecRequest(
            command=req.command[: MAX_COMMAND - 1], timeout=req.timeout, output_limit=req.output_limit
        )
        return await self._after_exec(sb, as_exec, result, ev.stdout_bytes, ev.stderr_bytes)

    async def session_run(self, sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        sb, live, session, run, deadline = await self._session_begin(sandbox_id, session_id, req, stream=False)
        try:
            assert run.ended is not None
            ev = await self._await_agent(sb, live, asyncio.shield(run.ended), deadline)
            return await self._session_result(sb, session, req, run, ev)
        except BaseException:
            if run.ended is not None and not run.ended.done() and not live.channel.closed:
                # abandoned (client gone, agent stuck): kill what the shell runs, keep the shell
                live.channel.kill_nowait(session.process.id, SCOPE_DESCENDANTS)
            raise
        finally:
            self._session_end(sb, session)

    async def session_run_stream(
        self, sandbox_id: str, session_id: str, req: SessionRunRequest
    ) -> EventStream[ExecEvent]:
        sb, live, session, run, deadline = await self._session_begin(sandbox_id, session_id, req, stream=True)
        finished = False

        async def release() -> None:
            if not finished and not live.channel.closed and not session.dead:
                live.channel.kill_nowait(session.process.id, SCOPE_DESCENDANTS)
                with contextlib.suppress(TimeoutError, WrongStateError):
                    async with asyncio.timeout(SESSION_LOST_GRACE):
                        assert run.ended is not None
                        await asyncio.shield(run.ended)  # the shell reports; the next command may start
            self._session_end(sb, session)

        async def stream() -> AsyncGenerator[ExecEvent, None]:
            nonlocal finished
            decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}
            assert run.stream is not None
            try:
                while True:
                    item = await self._await_agent(sb, live, run.stream.get(), deadline)
                    if item is None:
                        raise WrongStateError(f"session {session.id} ended while running the command")
                    if isinstance(item, OutputChunk):
                        if req.encoding == "base64":
                            yield ExecEvent(type=item.stream, data=base64.b64encode(item.data).decode())
                        elif text := decoders[item.stream].decode(item.data):
                            yield ExecEvent(type=item.stream, data=text)
                    else:
                        result = await self._session_result(sb, session, req, run, item)
                        finished = True
                        yield ExecEvent(type="exit", result=result)
                        return
            finally:
                await wrapped.release()

        wrapped = EventStream(stream(), release)
        return wrapped

    async def write_session_stdin(self, sandbox_id: str, session_id: str, data: bytes, close: bool) -> None:
        sb, session = self._session(sandbox_id, session_id)
        run = session.current
        if session.dead or run is None or not run.stdin_open:
            raise WrongStateError(
                f"session {session_id} has no command running with an open stdin "
                "(run it with stdin or keep_stdin_open=true)"
            )
        self._touch(sb)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                if data:
                    await session.process.write_command_stdin(data)
                if close:
                    run.stdin_open = False
                    await session.process.close_command_stdin()
        except TimeoutError:
            raise self._unresponsive(sb, "it stopped reading a session command's standard input") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc

    async def close_session(self, sandbox_id: str, session_id: str) -> None:
        sb, session = self._session(sandbox_id, session_id)
        sb.sessions.pop(session_id, None)
        if not session.dead and sb.live is not None and not sb.live.channel.closed:
            await session.process.signal(signal.SIGKILL, SCOPE_TREE)
        self.journal.record(sb.id, "session_closed", {"session_id": session_id})

    # -- file watches -------------------------------------------------------------------------------

    async def watch(self, sandbox_id: str, path: str, recursive: bool) -> EventStream[FileEvent]:
        """File changes under a directory, from inotify run by the sandbox's agent (so the watches
        count against the sandbox's own inotify share, not the daemon's)."""
        sb, live = await self._ready(sandbox_id)
        target = self._cwd(sb, path)
        try:
            async with asyncio.timeout(AGENT_START_TIMEOUT):
                w = await live.channel.watch(target, recursive=recursive)
        except TimeoutError:
            raise self._unresponsive(sb, "it did not take a watch") from None
        except ChannelClosedError as exc:
            raise UnavailableError(f"sandbox {sb.id} stopped") from exc
        except ValueError as exc:  # a NUL in the path, or longer than one message
            raise InvalidArgumentError(f"cannot watch {shown(target)}: {exc}") from exc
        # the agent answers a watch it cannot set up with its end at once: surface that as an error
        first: WatchEvent | None = None
        try:
            first = await w.next(timeout=0.2)
            if first is None:
                raise InvalidArgumentError(f"cannot watch {shown(target)}: not a directory in the sandbox")
        except TimeoutError:
            pass
        except AgentError as exc:
            raise InvalidArgumentError(f"cannot watch {shown(target)}: {exc}") from exc

        async def events() -> AsyncGenerator[FileEvent, None]:
            last: tuple[str, str] | None = None
            pending = first
            try:
                while True:
                    ev = pending if pending is not None else await w.next()
                    pending = None
                    if ev is None:
                        return
                    kind = _watch_kind(ev.mask)
                    if kind is None or (kind, ev.path) == last:
                        continue  # a write shows as several IN_MODIFY: one event
                    last = (kind, ev.path)
                    yield FileEvent(type=kind, path=ev.path, is_dir=bool(ev.mask & IN_ISDIR))
            except AgentError as exc:
                raise UnavailableError(f"the watch of {shown(target)} ended: {exc}") from exc
            finally:
                await w.close()

        return EventStream(events(), w.close)

    # -- files ------------------------------------------------------------------------------------

    async def _fs(
        self, live: LiveSandbox, op: Callable[[SandboxFS], T], *, cwd: str = "/", mutating: bool = False
    ) -> T:
        def run() -> T:
            fd = self.backend.open_root(live)
            try:
                # A write that replaced or removed a directory the sandbox has a mount on would detach
                # that mount in the sandbox (the daemon sees its tree from another mount namespace).
                points = self.backend.mount_points(live) if mutating else frozenset()
                return op(SandboxFS(fd, uid_base=live.uid_base, cwd=cwd, mount_points=points))
            finally:
                os.close(fd)

        try:
            return await asyncio.to_thread(run)
        except FileOpError as exc:
            cls = _FILE_ERRORS.get(exc.kind, InternalError)
            raise cls(str(exc)[:1000]) from exc
        except FileNotFoundError as exc:
            raise UnavailableError(f"sandbox {live.id} is no longer running") from exc

    async def read_file(self, sandbox_id: str, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return await self._file_op(sandbox_id, lambda fs: fs.read(path, offset=offset, length=length))

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, *, mode: int, user: str | None, append: bool
    ) -> FileInfo:
        owner = await self._file_owner(sandbox_id, user)

        def op(fs: SandboxFS) -> FileInfo:
            fs.write(path, data, mode=mode, uid=owner.uid, gid=owner.gid, append=append)
            return file_info(fs.stat(path, follow_symlinks=True))

        return await self._file_op(sandbox_id, op, ("file_write", {"path": path, "bytes": len(data)}), mutating=True)

    async def list_files(self, sandbox_id: str, path: str) -> builtins.list[FileInfo]:
        return [file_info(st) for st in await self._file_op(sandbox_id, lambda fs: fs.list(path))]

    async def stat_file(self, sandbox_id: str, path: str, follow_symlinks: bool) -> FileInfo:
        return file_info(await self._file_op(sandbox_id, lambda fs: fs.stat(path, follow_symlinks=follow_symlinks)))

    async def make_dir(self, sandbox_id: str, path: str, *, parents: bool, mode: int, user: str | None) -> FileInfo:
        owner = await self._file_owner(sandbox_id, user)

        def op(fs: SandboxFS) -> FileInfo:
            fs.mkdir(path, parents=parents, mode=mode, uid=owner.uid, gid=owner.gid)
            return file_info(fs.stat(path))

        return await self._file_op(sandbox_id, op, ("mkdir", {"path": path}), mutating=True)

    async def remove_path(self, sandbox_id: str, path: str, recursive: bool) -> None:
        await self._file_op(
            sandbox_id,
            lambda fs: fs.remove(path, recursive=recursive),
            ("file_remove", {"path": path, "recursive": recursive}),
            mutating=True,
        )

    async def download_tar(self, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        limit = self._download_limit(sandbox_id)
        return await self._file_stream(sandbox_id, lambda fs: fs.iter_tar(path, max_bytes=limit))

    async def upload_limit(self, sandbox_id: str) -> int:
        """The largest tar an upload may send: the sandbox's writable layer, plus the tar's headers."""
        disk = self._get(sandbox_id).spec.resources.disk
        return disk + disk // 8 + 1024**2

    async def upload_tar(self, sandbox_id: str, path: str, tar: BinaryIO, size: int, user: str | None) -> None:
        owner = await self._file_owner(sandbox_id, user)

        def op(fs: SandboxFS) -> None:
            fs.upload_tar(path, tar, uid=owner.uid, gid=owner.gid)

        await self._file_op(sandbox_id, op, ("upload", {"path": path, "bytes": size}), mutating=True)

    async def _file_op(
        self,
        sandbox_id: str,
        op: Callable[[SandboxFS], T],
        event: tuple[str, dict[str, Any]] | None = None,
        *,
        mutating: bool = False,
    ) -> T:
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        result = await self._fs(live, op, cwd=sb.spec.workdir, mutating=mutating)
        if event is not None:
            self.journal.record(sb.id, event[0], event[1])
        return result

    async def _file_owner(self, sandbox_id: str, user: str | None) -> User:
        sb, live = await self._ready(sandbox_id)
        return await self._user(sb, live, user or sb.spec.user)

    def _download_limit(self, sandbox_id: str) -> int:
        """The most a download of the sandbox's tree can carry: what its writable layer holds at
        most plus what its read-only layers hold (by their files' sizes)."""
        sb = self._get(sandbox_id)
        layers = sb.live.runtime.get("layers", []) if sb.live is not None else []
        total = sb.spec.resources.disk
        for digest in layers:
            with contextlib.suppress(SandboxError, OSError, LayerCorruptError):
                ref = self._layer_by_digest(str(digest))
                total += 4 * (ref.size + (ref.blob_size or 0))  # EROFS compresses (lz4hc: ~2x, be generous)
        return total

    async def _file_stream(
        self, sandbox_id: str, produce: Callable[[SandboxFS], Iterator[bytes]]
    ) -> AsyncGenerator[bytes, None]:
        """Chunks `produce` makes from the sandbox's tree in a worker thread, a few at a time (the
        daemon's memory stays bounded whatever the size); an error before the first chunk is the
        request's (a typed 4xx), a later one ends the stream short."""
        sb, live = await self._ready(sandbox_id)
        self._touch(sb)
        cwd = sb.spec.workdir

        def chunks() -> Iterator[bytes]:
            fd = self.backend.open_root(live)
            try:
                yield from produce(SandboxFS(fd, uid_base=live.uid_base, cwd=cwd))
            finally:
                os.close(fd)

        gen = _thread_chunks(chunks)
        try:
            first = await anext(gen, b"")
        except FileOpError as exc:
            await gen.aclose()
            raise _FILE_ERRORS.get(exc.kind, InternalError)(str(exc)[:1000]) from exc

        async def rest() -> AsyncGenerator[bytes, None]:
            try:
                if first:
                    yield first
                async for chunk in gen:
                    yield chunk
            finally:
                await gen.aclose()

        return rest()


async def _thread_chunks(produce: Callable[[], Iterator[bytes]], depth: int = 4) -> AsyncGenerator[bytes, None]:
    """Chunks a worker thread produces, at most `depth` of them buffered."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(depth)
    stop = threading.Event()

    def put(item: bytes | BaseException | None) -> None:
        asyncio.run_coroutine_threadsafe(queue.put(item), loop).result()

    def run() -> None:
        try:
            for chunk in produce():
                if stop.is_set():
                    return
                put(chunk)
        except BaseException as exc:  # noqa: BLE001 (handed to the consumer)
            if not stop.is_set():
                put(exc)
            return
        if not stop.is_set():
            put(None)

    worker = asyncio.ensure_future(asyncio.to_thread(run))
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while not worker.done():  # unblock a pending put so the thread sees `stop` and ends
            with contextlib.suppress(asyncio.QueueEmpty):
                queue.get_nowait()
            await asyncio.sleep(0.005)


def _load_snapshot(path: Path, now: float) -> SnapshotRecord | None:
    """A snapshot from its directory (its snapshot.json), unless unreadable or expired."""
    try:
        record = json.loads((path / "snapshot.json").read_text())
        info = SnapshotInfo.model_validate(record["info"])
        if info.id != path.name or (info.expires_at is not None and info.expires_at <= now):
            return None
        spec = _lenient_spec(record["spec"])
        return None if spec is None else SnapshotRecord(info, path, spec, dict(record["meta"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


async def _nothing() -> None:
    return None


# What a spec made by an older version may carry that this one bounds more tightly: dropped (with a
# log line) rather than the sandbox, so an upgrade never kills what runs.
_LOOSE_FIELDS = ("env", "labels", "workdir", "user", "hostname")


def _lenient_spec(data: dict[str, Any]) -> SandboxSpec | None:
    try:
        return SandboxSpec.model_validate(data)
    except ValidationError:
        pass
    try:
        spec = SandboxSpec.model_validate({k: v for k, v in data.items() if k not in _LOOSE_FIELDS})
    except ValidationError:
        return None
    log.warning("a stored spec no longer valid: its %s were dropped", ", ".join(_LOOSE_FIELDS))
    return spec


def _write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _is_busy(sb: Sandbox, now: float) -> bool:
    """Requests in flight keep a sandbox from its idle TTL and idle pause, until their deadlines."""
    return sb.inflight > 0 and now < sb.busy_until


def spec_expired(sb: Sandbox, now: float) -> bool:
    return sb.spec.max_lifetime is not None and now - sb.created_at > sb.spec.max_lifetime


def image_info(m: ImageManifest) -> ImageInfo:
    return ImageInfo(
        name=m.name,
        tag=m.tag,
        layers=[x.digest for x in m.layers],
        size=sum(x.size + (x.blob_size or 0) for x in m.layers),
        created=m.created,
        on_demand=any(x.blob is not None for x in m.layers),
    )


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
