"""The node service's shared core: what every part of it needs, and the calls they share.

`NodeCore` holds the node's parts (backend, layer store, state store, metrics, admission, warm pools,
the sandbox table and the event journal), owns the service's task group, and implements what is
common to the concerns above it: get/list/ack, lifetimes, stop (with the table's stop hooks),
activity and in-flight bookkeeping, calls to a sandbox's agent under the daemon's own deadlines,
usage and CPU accounting. The concern modules (pausing, images, files, execs, sessions, creation,
snapshots, reaper, recovery) call down into it, never up.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import functools
import inspect
import logging
import math
import posixpath
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

from pydantic import ValidationError

from sandfleet.backends.base import LiveSandbox, TierBackend
from sandfleet.daemon.node.admission import Admission
from sandfleet.daemon.node.jobstats import JobBook
from sandfleet.daemon.node.lifecycle import (
    CREATING,
    FAILED,
    HOLDING_STATES,
    LIVE_STATES,
    PAUSED,
    RUNNING,
    STOPPED,
    STOPPING,
    EventJournal,
    Sandbox,
    SandboxTable,
)
from sandfleet.daemon.node.metrics import Metrics, NodeUsage, SandboxSample
from sandfleet.daemon.node.pool import WarmPools
from sandfleet.daemon.node.state import SandboxRow, StateStore
from sandfleet.errors import InternalError, InvalidArgumentError, SandboxError, UnavailableError, WrongStateError
from sandfleet.images import LayerStore
from sandfleet.models import SandboxEvent, SandboxInfo, SandboxSpec, Usage, shown
from sandfleet.runtime.agent_errors import ChannelClosedError

NODE_LABELS = "sandfleet."  # labels the node sets (verifiers, trajectories, pools, builds): its own

log = logging.getLogger("sandfleet.daemon")

T = TypeVar("T")

# Deadlines the daemon keeps itself, whatever the agent does.
DEADLINE_GRACE = 15.0  # beyond a command's own timeout: the agent's kill, the exit, the reply

LIVENESS_INTERVAL = 10.0  # while waiting on the agent: ping it this often

LIVENESS_TIMEOUT = 10.0  # an agent that does not answer a ping within this is reported unresponsive

AGENT_START_TIMEOUT = 30.0  # the agent confirms a command started (or takes its input) within this

CLAIM_WINDOW = 120.0  # a sandbox whose create was never answered is stopped after this (unless claimed)

ACTIVITY_FLUSH = 5.0  # last-activity times reach the state store this often

# An idempotency key as the node keeps it: (the project of what it made, the key). Keys of two
# projects never meet: a create of project A with B's key makes A a sandbox of its own.
KeyName = tuple[str | None, str]


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def wire_text(data: bytes, encoding: str) -> str:
    """Output for the wire: UTF-8 text (invalid bytes replaced) or base64 of the exact bytes."""
    return base64.b64encode(data).decode() if encoding == "base64" else _decode(data)


def store_row(sb: Sandbox, runtime: dict[str, Any], fingerprint: str | None = None) -> SandboxRow:
    """The state-store row of a sandbox being created or handed out (`fingerprint`: of the request
    its idempotency key came with, kept so that a retry after a restart is checked as before one)."""
    spec = sb.spec
    return SandboxRow(sb.id, sb.state, spec.backend, spec.model_dump(mode="json"), spec.labels, runtime,
                      sb.created_at, sb.last_active_at, None, None,
                      idempotency_key=sb.idempotency_key, acked=sb.acked, held=sb.held,
                      project=spec.project, idempotency_fingerprint=fingerprint)  # fmt: skip


# What a spec made by an older version may carry that this one bounds more tightly: dropped (with a
# log line) rather than the sandbox, so an upgrade never kills what runs.
_LOOSE_FIELDS = ("env", "labels", "workdir", "user", "hostname")


def lenient_spec(data: dict[str, Any]) -> SandboxSpec | None:
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


def is_busy(sb: Sandbox, now: float) -> bool:
    """Requests in flight keep a sandbox from its idle TTL and idle pause, until their deadlines."""
    return sb.inflight > 0 and now < sb.busy_until


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


def resolve_cwd(sb: Sandbox, cwd: str | None) -> str:
    """A working directory inside the sandbox: relative ones are taken from the sandbox's workdir."""
    if cwd is None:
        return sb.spec.workdir
    return cwd if cwd.startswith("/") else posixpath.normpath(posixpath.join(sb.spec.workdir, cwd))


class NodeCore:
    def __init__(
        self,
        *,
        backends: builtins.list[TierBackend],
        store: LayerStore,
        state: StateStore,
        metrics: Metrics,
        admission: Admission,
        pools: WarmPools | None,
        stopped_retention: float,
        reaper_interval: float,
        node_key: str,
        job_label: str = "job",
        metrics_per_sandbox: bool = False,
    ) -> None:
        # The node's isolation tiers by name; a sandbox's is `sb.spec.backend`. The first is the default.
        self.backends: dict[str, TierBackend] = {b.name: b for b in backends}
        self.default_tier = backends[0].name
        self.store = store
        self.state = state
        self.metrics = metrics
        self.admission = admission
        self.pools = pools
        self.stopped_retention = stopped_retention
        self.reaper_interval = reaper_interval
        self.node_key = node_key  # in every sandbox and snapshot id this node makes (sandfleet.ids)
        self.table = SandboxTable()
        self.journal = EventJournal(state)
        self.jobs = JobBook(self.table, job_label)  # each job's figures, as things happen
        self.journal.taps.append(self.jobs.event)
        # (project, idempotency key) -> (the sandbox id it made, or the create still running; the
        # request's fingerprint). Keys are per project: another project's key is simply unused.
        self.keys: dict[KeyName, tuple[str | asyncio.Future[str], str]] = {}
        self.tg: asyncio.TaskGroup | None = None
        self.tasks: set[asyncio.Task[Any]] = set()
        self.dirty_activity: dict[str, float] = {}  # last-activity times not yet in the state store
        # What else holds node resources for a sandbox (a checkpoint restored ahead): released
        # before its stop returns.
        self.stop_hooks: builtins.list[Callable[[Sandbox], Awaitable[None]]] = []
        self.creating = 0  # creates admitted and not settled
        self.best_effort_cpu: dict[str, float] = {}  # CPU seconds of each best-effort sandbox, last seen
        self.best_effort_retired = 0.0  # what best-effort sandboxes that have stopped had used
        self.best_effort_ids: set[str] = set()  # running or paused best-effort sandboxes
        self.cpu_split: dict[str, float] = {}  # CPU seconds by QoS class, as `observe_cpu` last split them
        self.shutting_down = False
        self.draining = False  # cluster mode: finishing what it holds, taking no new creates
        self.claim_window = CLAIM_WINDOW  # the node's `claim_window` (config)
        self.node_labels: dict[str, str] = {}  # cluster mode: what `SandboxSpec.node_selector` matches
        metrics.track_sandboxes(self.usage_sources, per_sandbox=metrics_per_sandbox)

    def tier(self, sb: Sandbox) -> TierBackend:
        """The backend a sandbox lives on."""
        return self.backends[sb.spec.backend]

    def tier_for(self, name: str) -> TierBackend:
        """The backend of tier `name`, or the typed error of a node without it."""
        backend = self.backends.get(name)
        if backend is None:
            raise InvalidArgumentError(
                f"backend {name!r} is not available on this node (available: {', '.join(map(repr, self.backends))})"
            )
        return backend

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task[Any]:
        if self.tg is None:
            if inspect.iscoroutine(coro):
                coro.close()  # never started: no "was never awaited" warning
            raise UnavailableError("daemon is shutting down")
        task = self.tg.create_task(self._guard(coro, name), name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
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

    def running_count(self) -> int:
        return self.table.count(RUNNING)

    def node_count(self) -> int:
        """Sandboxes holding node resources: running or paused, being created, and warm in pools."""
        pooled = self.pools.pooled() if self.pools is not None else 0
        return self.table.count(RUNNING, PAUSED) + self.creating + pooled

    async def events(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[SandboxEvent]:
        self.sandbox(sandbox_id)
        return await self.journal.read(sandbox_id, after, limit)

    def sandbox(self, sandbox_id: str) -> Sandbox:
        return self.table.get(sandbox_id)

    def drop(self, sb: Sandbox) -> None:
        """No longer listed: out of the table, its idempotency key free again."""
        self.table.discard(sb)
        if sb.idempotency_key is not None:
            name = (sb.spec.project, sb.idempotency_key)
            entry = self.keys.get(name)
            if entry is not None and entry[0] == sb.id:
                del self.keys[name]

    async def forget(self, sb: Sandbox) -> None:
        """Persist a terminal state; drop the row at once when nothing is retained."""
        if self.stopped_retention <= 0:
            await self.journal.flush()
            await self.state.delete([sb.id])
            self.drop(sb)  # after the row: its idempotency key is free only once no row holds it
        else:
            await self.state.update(sb.id, state=sb.state, stopped_at=sb.stopped_at, stop_reason=sb.stop_reason)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        sb = self.sandbox(sandbox_id)
        self.ack_one(sb)  # whoever names it knows it: the create was heard
        return sb.info()

    def ack_one(self, sb: Sandbox) -> None:
        """The caller has the sandbox (its create's answer went out, or it was named since): it is
        no longer reaped as a create nobody heard about."""
        if not sb.acked:
            sb.acked = True
            self.spawn(self.state.update(sb.id, acked=1), name=f"ack-{sb.id}")

    async def ack(self, sandbox_ids: builtins.list[str]) -> None:
        """The answer naming these sandboxes was handed to the client (one write for all of them)."""
        heard = []
        for sandbox_id in sandbox_ids:
            sb = self.table.find(sandbox_id)
            if sb is not None and not sb.acked and sb.state in LIVE_STATES:
                sb.acked = True
                heard.append(sandbox_id)
        if heard:
            self.spawn(self.state.set_acked(heard), name="ack")

    async def update_lifetime(self, sandbox_id: str, fields: dict[str, float | None]) -> SandboxInfo:
        """Change a live sandbox's idle TTL and/or max lifetime (None removes that limit)."""
        sb = self.sandbox(sandbox_id)
        self.table.require(sb, (CREATING, RUNNING, PAUSED), "changing its lifetime")
        if fields:
            sb.spec = sb.spec.model_copy(update=fields)
            self.touch(sb)  # a new idle TTL counts from now
            await self.state.update(sb.id, spec=sb.spec.model_dump(mode="json"))
            self.journal.record(sb.id, "lifetime_changed", dict(fields))
        return sb.info()

    async def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> SandboxInfo:
        """Replace a live sandbox's labels (lists and label-wide calls select by the new ones at once).
        Labels under `sandfleet.` are the node's own (a verifier's, a trajectory's, a pool's: recovery
        and cleanup read them): kept as they are, and a request naming one is refused."""
        own = sorted(k for k in labels if k.startswith(NODE_LABELS))
        if own:
            raise InvalidArgumentError(f"label {shown(own[0])}: labels under {NODE_LABELS} are the node's own")
        sb = self.sandbox(sandbox_id)
        self.table.require(sb, (CREATING, RUNNING, PAUSED), "changing its labels")
        labels = {**labels, **{k: v for k, v in sb.spec.labels.items() if k.startswith(NODE_LABELS)}}
        if labels != sb.spec.labels:
            sb.spec = sb.spec.model_copy(update={"labels": labels})
            await self.state.update(sb.id, spec=sb.spec.model_dump(mode="json"), labels=labels)
            self.journal.record(sb.id, "labels_changed", {"labels": dict(labels)})
        return sb.info()

    async def update_lifetimes(self, labels: dict[str, str], fields: dict[str, float | None]) -> builtins.list[str]:
        ids = [sb.id for sb in self.matching(labels, (CREATING, RUNNING, PAUSED))]
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
            if labels and not sb.labelled(labels):
                continue
            out.append(sb.info())
        return out

    def on_agent_lost(self, sandbox_id: str) -> None:
        sb = self.table.find(sandbox_id)
        if sb is None or sb.state != RUNNING or self.tg is None:
            return
        self.journal.record(sandbox_id, "agent_lost", {})
        self.spawn(self.stop(sandbox_id, reason="sandbox init exited"), name=f"lost-{sandbox_id}")

    async def stop(self, sandbox_id: str, reason: str = "user") -> SandboxInfo:
        sb = self.sandbox(sandbox_id)
        if sb.state == CREATING:
            # Stopping mid-create would race the backend; let the create settle first.
            await asyncio.shield(sb.created.wait())
        if sb.state in (STOPPED, FAILED) and not sb.stop_failed:
            return sb.info()
        if sb.stop_task is None or (sb.stop_task.done() and sb.stop_failed):
            sb.stop_task = self.spawn(self._do_stop(sb, reason), name=f"stop-{sandbox_id}")
        await asyncio.shield(sb.stop_task)
        if sb.stop_failed:
            # It still runs (or may): say so. The reaper retries.
            raise InternalError(f"sandbox {sandbox_id} could not be stopped: {sb.stop_reason}")
        return sb.info()

    async def _do_stop(self, sb: Sandbox, reason: str) -> None:
        self.table.move(sb, STOPPING)
        if sb.id in self.best_effort_cpu and sb.live is not None:
            # Its final CPU time, so the admission's count of latency-sensitive use does not jump.
            with contextlib.suppress(OSError):
                self.best_effort_retired += self.tier(sb).cpu_seconds(sb.live)
                del self.best_effort_cpu[sb.id]
        try:
            # Not being able to record it (a full disk) must not keep a sandbox running: a restart
            # finds a row whose agent is gone and cleans up.
            await self.state.update(sb.id, state=STOPPING)
        except Exception:
            log.warning("sandbox %s: could not record that it is stopping; stopping it anyway", sb.id, exc_info=True)
        try:
            if sb.live is not None:
                await self.record_limits(sb, sb.live)
                await self.tier(sb).destroy(sb.live)
            for hook in self.stop_hooks:
                await hook(sb)
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
        self.dirty_activity.pop(sb.id, None)
        try:
            await self.forget(sb)
        except Exception:
            log.warning("sandbox %s: stopped, but the state store did not take it", sb.id, exc_info=True)
        self.metrics.stopped.labels(reason=reason.split(":")[0][:32]).inc()
        self.metrics.alive.set(self.running_count())

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]:
        ids = [s.id for s in self.matching(labels, HOLDING_STATES)]
        results = await asyncio.gather(*(self.stop(i, reason) for i in ids), return_exceptions=True)
        return [i for i, r in zip(ids, results, strict=True) if not isinstance(r, BaseException)]

    def matching(self, labels: dict[str, str], states: Iterable[str]) -> builtins.list[Sandbox]:
        return self.table.matching(labels, states)

    async def usage(self, sandbox_id: str) -> Usage:
        """Current and peak memory, CPU time, tasks and limit hits, from the backend (no resume)."""
        sb = self.sandbox(sandbox_id)
        if sb.live is None or sb.state not in HOLDING_STATES:
            raise WrongStateError(f"sandbox {sandbox_id} is {sb.state}")
        usage = await asyncio.to_thread(self.tier(sb).usage, sb.live)
        return usage.model_copy(update={"cpu_seconds": round(usage.cpu_seconds, 6)})

    def usage_sources(self) -> NodeUsage:
        """For the metrics scrape (in a worker thread): every sandbox holding resources, with what the
        monitor last read of it and a reader of its cgroup; and the CPU time used by QoS class."""
        sandboxes = [
            SandboxSample(
                sb.id,
                sb.state,
                sb.spec.qos,
                sb.memory_seen,
                sb.tasks_seen,
                functools.partial(self.tier(sb).usage, live),
            )
            for sb in self.table
            if (live := sb.live) is not None and sb.state in HOLDING_STATES
        ]
        # As `observe_cpu` last split it (one assignment on the event loop: never half updated here).
        return NodeUsage(sandboxes, self.cpu_split)

    def observe_cpu(self) -> None:
        """Feed admission the CPU time latency-sensitive sandboxes used: all sandboxes' (one counter
        that keeps what stopped ones used) minus best-effort ones' (alive, plus what those that
        stopped had used when last seen)."""
        best_effort = {}
        for sandbox_id in list(self.best_effort_ids):
            sb = self.table.find(sandbox_id)
            if sb is None or sb.live is None or sb.state not in HOLDING_STATES:
                self.best_effort_ids.discard(sandbox_id)
                continue
            best_effort[sandbox_id] = self.tier(sb).cpu_seconds(sb.live)
        for gone in self.best_effort_cpu.keys() - best_effort.keys():
            self.best_effort_retired += self.best_effort_cpu[gone]
        self.best_effort_cpu = best_effort
        be_total = sum(best_effort.values()) + self.best_effort_retired
        used = sum(b.cpu_seconds(None) for b in self.backends.values()) - be_total
        self.admission.observe_cpu(used, time.monotonic())
        self.cpu_split = {"latency_sensitive": used, "best_effort": be_total}

    def touch(self, sb: Sandbox) -> None:
        sb.last_active_at = time.time()
        self.dirty_activity[sb.id] = sb.last_active_at

    def busy(self, sb: Sandbox, timeout: float | None) -> float:
        """A request starts: until its deadline it keeps the sandbox from its idle TTL and the idle
        pause (never past it: a stuck request must not exempt the sandbox from its TTLs)."""
        sb.inflight += 1
        deadline = math.inf if timeout is None else time.time() + timeout + DEADLINE_GRACE
        sb.busy_until = max(sb.busy_until if sb.inflight > 1 else 0.0, deadline)
        self.touch(sb)
        return deadline

    def idle_done(self, sb: Sandbox) -> None:
        sb.inflight -= 1
        if sb.inflight == 0:
            sb.busy_until = 0.0
        self.touch(sb)

    async def await_agent(self, sb: Sandbox, live: LiveSandbox, aw: Awaitable[T], deadline: float) -> T:
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
                    raise self.unresponsive(sb, "its command did not end by its deadline")
                if sb.freeze_lock.locked():
                    continue  # frozen by us (a snapshot, a pause being taken): silence is expected
                limit = max(1.0, min(LIVENESS_TIMEOUT, deadline - time.time()))
                try:
                    await live.channel.ping(timeout=limit)
                except TimeoutError:
                    raise self.unresponsive(sb, f"no answer to a ping within {limit:.0f}s") from None
                except ChannelClosedError:
                    pass  # the task sees the closed channel too
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def unresponsive(self, sb: Sandbox, why: str) -> SandboxError:
        if not sb.unresponsive:
            sb.unresponsive = True
            self.journal.record(sb.id, "agent_unresponsive", {"reason": why})
            self.metrics.agent_unresponsive.inc()
            log.warning("sandbox %s: its agent is not answering (%s)", sb.id, why)
        return UnavailableError(f"sandbox {sb.id} is not answering: {why}; it keeps its TTLs and can be stopped")

    def watch_agent(self, sandbox_id: str, live: LiveSandbox) -> None:
        """What the agent reports on its own (a process of the sandbox tried to signal, trace or
        open it) becomes an `agent_attack` event of the sandbox."""
        live.channel.on_alert = lambda alert: self.journal.record(sandbox_id, "agent_attack", dict(alert))

    async def record_limits(self, sb: Sandbox, live: LiveSandbox) -> int:
        """Turn cgroup counters into events: OOM kills and refused forks since we last looked.
        Returns the number of new OOM kills."""
        try:
            stats = await asyncio.to_thread(self.tier(sb).usage, live)
        except OSError:
            return 0
        return self.note_limits(sb, stats)

    def note_limits(self, sb: Sandbox, stats: Usage) -> int:
        """`record_limits` for counters already read; returns the number of new OOM kills."""
        new_ooms = max(0, stats.oom_kills - sb.oom_kills)
        if new_ooms:
            self.journal.record(sb.id, "oom_kill", {"count": new_ooms, "limit": sb.spec.resources.memory})
            self.metrics.oom_kills.inc(new_ooms)
            sb.oom_kills, sb.oom_noted_at = stats.oom_kills, time.monotonic()
        if stats.pids_limit_hits > sb.pids_hits:
            self.journal.record(
                sb.id,
                "pids_limit",
                {"refused_forks": stats.pids_limit_hits - sb.pids_hits, "limit": sb.spec.resources.pids},
            )
            sb.pids_hits = stats.pids_limit_hits
        return new_ooms
