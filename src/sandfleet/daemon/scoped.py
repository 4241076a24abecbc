"""`ScopedService`: a `SandboxService` that confines each request to its principal's project.

It wraps the node's service (the routes see it in the manager's place when `[iam]` is configured) and
applies the principal the API's authentication made current (`iam.CURRENT`):

- creates (and batches, forks, restores, trajectories with a new sandbox) go into the principal's
  project by default, or into one of its subtree; elsewhere is `permission_denied`, as is a writable
  host mount (read-only ones only: a host directory is shared by every project). They must fit the
  quotas of their project and of every listed ancestor (`Iam.check_create`, `Iam.take_create`):
  otherwise `resource_exhausted` naming the project. Forks and restores keep the parent's project;
- a call naming a sandbox or snapshot of a project the principal does not see answers `not_found`,
  word for word as for one that does not exist (ids of other projects do not leak);
- trajectory ids are each project's own (the caller's project is passed to the node's service as
  their namespace): naming an id another project uses names the caller's own trajectory of that
  id, or none;
- lists and label-wide calls (stop, pause, resume, lifetimes, network) touch visible sandboxes only,
  and the node's health counts the sandboxes the principal sees (others' are theirs to know);
- read-only principals cannot act (also refused earlier by the API, by HTTP method);
- node-wide things: the audit stream and metrics need a root principal; changing the image store
  (delete, gc, push, import, recipe builds, pack) a root admin; anyone may list images and build a
  built-in one, and a writer may run stateless fncall calls: in its project (or one of its subtree),
  on workers pooled per project, which count as the project's sandboxes but are not refused by its
  quota (each pool is bounded by the tier's `max_workers`).

A root principal (the socket, root-scoped tokens) passes straight through: one context-variable read
and two attribute tests per call, nothing else (and a node without `[iam]` is not wrapped at all).

The ~45 calls whose first argument is a sandbox id are not written out by hand: `_reads(...)` and
`_writes(...)` make each from the protocol's own method, so they carry its exact signature (mypy
checks the wrapper against `SandboxService` member by member, and a method added to the protocol
without a line here is a type error where the wrapper is used as the service), and dispatch by name
to the wrapped service. `__getattr__` would have been shorter but untyped, and would let a new method
through unscoped.

Quotas count what the node holds (`SandboxTable.project_usage`, through `Directory`) plus the creates
this wrapper let through that have not answered yet, so concurrent creates cannot overshoot a quota
while their sandboxes are still being made. A sandbox being created is in the table too: when the
quick count refuses while creates are in flight, the exact count (the table's `creating` sandboxes
taken out once) decides, so a burst up to the quota is never refused for being counted twice.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar

from sandfleet.daemon.iam import Iam, Principal, Usage, UsageMap, current
from sandfleet.daemon.protocol import EventStream, SandboxService
from sandfleet.errors import (
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxNotFoundError,
    SnapshotNotFoundError,
    UnavailableError,
)
from sandfleet.models import (
    AuditQuery,
    AuditRecord,
    BuildEvent,
    ExecResult,
    Health,
    ImageInfo,
    NetworkPolicy,
    NodeLoad,
    RunCodeBatchItem,
    RunCodeRequest,
    SandboxInfo,
    SandboxSpec,
    SnapshotInfo,
    TrajectoryInfo,
    TrajectoryOpen,
    shown,
)

if TYPE_CHECKING:
    from sandfleet.daemon.service import SandboxManager

P = ParamSpec("P")
R = TypeVar("R")

_HOLDING = ("running", "paused")  # the states label-wide calls act on (lifecycle.HOLDING_STATES)
_CHANGEABLE = ("creating", "running", "paused")  # lifetimes


class Directory(Protocol):
    """What the scoped service looks up about the node's sandboxes, snapshots and trajectories."""

    def sandbox_spec(self, sandbox_id: str) -> SandboxSpec | None:
        """The spec of a sandbox the node lists (None: it lists none with this id)."""
        ...

    def snapshot_spec(self, snapshot_id: str) -> SandboxSpec | None:
        """The spec a restore of the snapshot starts from (None: unknown here)."""
        ...

    async def trajectory_exists(self, trajectory_id: str, project: str | None) -> bool:
        """Whether the project has a trajectory of this id."""
        ...

    def project_usage(self) -> UsageMap:
        """Per project (not rolled up): live sandboxes, their CPU and memory limits."""
        ...

    def key_made(self, project: str | None, key: str) -> bool:
        """Whether idempotency key (project, key) made a sandbox here (a create with it still
        running does not count: it may fail, and its retry then makes one)."""
        ...

    def creating_usage(self) -> UsageMap:
        """The same, of sandboxes still being created only (a full scan: the slow path)."""
        ...


class NodeDirectory:
    """`Directory` over the node's `SandboxManager`: dict lookups, nothing awaited on the hot path."""

    def __init__(self, manager: SandboxManager) -> None:
        self.manager = manager

    def sandbox_spec(self, sandbox_id: str) -> SandboxSpec | None:
        sb = self.manager.core.table.find(sandbox_id)
        return None if sb is None else sb.spec

    def snapshot_spec(self, snapshot_id: str) -> SandboxSpec | None:
        rec = self.manager.snapshots.records.get(snapshot_id)
        return None if rec is None or rec.deleted else rec.spec

    async def trajectory_exists(self, trajectory_id: str, project: str | None) -> bool:
        return await self.manager.trajectories.exists(trajectory_id, project=project)

    def project_usage(self) -> UsageMap:
        return self.manager.core.table.project_usage()

    def key_made(self, project: str | None, key: str) -> bool:
        entry = self.manager.core.keys.get((project, key))
        return entry is not None and isinstance(entry[0], str)

    def creating_usage(self) -> UsageMap:
        out: dict[str, Usage] = {}
        for sb in self.manager.core.table:
            if sb.state == "creating":
                n, cpu, mem = out.get(sb.spec.project or "", (0, 0.0, 0))
                out[sb.spec.project or ""] = (n + 1, cpu + sb.spec.resources.cpu, mem + sb.spec.resources.memory)
        return out


def _placed(p: Principal, spec: SandboxSpec) -> SandboxSpec:
    """`spec` as principal `p` may create it: in its project (by default) or one under it, and with
    host mounts read-only for a project's token (a host directory one project writes and another
    mounts would carry data between them: the root's to grant); `permission_denied` otherwise."""
    project = p.place(spec.project)
    if p.project is not None and any(not m.read_only for m in spec.mounts):
        raise PermissionDeniedError(
            f"token {p.name} may mount host paths read-only only (project {p.project}): a writable one needs the root"
        )
    return spec if project == spec.project else spec.model_copy(update={"project": project})


def _call_placed(p: Principal, req: RunCodeRequest) -> RunCodeRequest:
    """A pooled call in its project (the principal's by default, or one of its subtree): workers are
    pooled per project, never shared across."""
    p.require_write()
    project = p.place(req.project)
    return req if project == req.project else req.model_copy(update={"project": project})


def _hidden_sandbox(sandbox_id: str) -> SandboxNotFoundError:
    return SandboxNotFoundError(f"sandbox {sandbox_id[:80]} not found")  # as SandboxTable.get says it


def _hidden_snapshot(snapshot_id: str) -> SnapshotNotFoundError:
    return SnapshotNotFoundError(f"snapshot {shown(snapshot_id)} not found")  # as Snapshots says it


_Method = Callable[Concatenate[Any, str, P], Coroutine[Any, Any, R]]
_Scoped = Callable[Concatenate["ScopedService", str, P], Coroutine[Any, Any, R]]


def _by_sandbox(method: _Method[P, R], write: bool) -> _Scoped[P, R]:
    name = method.__name__

    async def call(self: ScopedService, sandbox_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        self.sandbox_principal(sandbox_id, write)
        fn: Callable[Concatenate[str, P], Coroutine[Any, Any, R]] = getattr(self.inner, name)
        return await fn(sandbox_id, *args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"`{name}` of a sandbox the caller sees ({'acting' if write else 'reading'})."
    return call


def _reads(method: _Method[P, R]) -> _Scoped[P, R]:
    """A call reading a sandbox: the sandbox must be visible."""
    return _by_sandbox(method, write=False)


def _writes(method: _Method[P, R]) -> _Scoped[P, R]:
    """A call acting on a sandbox: visible, and a principal that may act."""
    return _by_sandbox(method, write=True)


def _by_trajectory(method: _Method[P, R], write: bool) -> _Scoped[P, R]:
    """A call naming a trajectory: the id is looked up among the caller's project's."""
    name = method.__name__

    async def call(self: ScopedService, trajectory_id: str, /, *args: P.args, **kwargs: P.kwargs) -> R:
        p = current()
        if write:
            p.require_write()
        fn: Callable[..., Coroutine[Any, Any, R]] = getattr(self.inner, name)
        return await fn(trajectory_id, *args, **{**kwargs, "project": p.project})

    call.__name__ = call.__qualname__ = name
    return call


class ScopedService:
    """The node's service, as each request's principal may see and use it (see the module doc)."""

    def __init__(self, inner: SandboxService, iam: Iam, directory: Directory) -> None:
        self.inner = inner
        self.iam = iam
        self.directory = directory
        self._pending: dict[str, list[float]] = {}  # project -> [sandboxes, cpu, memory] of creates in flight

    # -- who may do what -------------------------------------------------------------------------

    def sandbox_principal(self, sandbox_id: str, write: bool) -> Principal:
        p = current()
        if write and not p.can_write:
            p.require_write()
        if p.project is not None:
            spec = self.directory.sandbox_spec(sandbox_id)
            if spec is None or not p.sees(spec.project):
                raise _hidden_sandbox(sandbox_id)
        return p

    async def _visible_snapshot(self, snapshot_id: str, p: Principal) -> SnapshotInfo:
        info = await self.inner.get_snapshot(snapshot_id)
        if not p.sees(info.project):
            raise _hidden_snapshot(snapshot_id)
        return info

    # -- quotas ----------------------------------------------------------------------------------

    def _usage(self, exact: bool) -> dict[str, Usage]:
        usage = dict(self.directory.project_usage())
        if exact:  # sandboxes being made are in the table and in the pending counts: once only
            for key, (n, cpu, mem) in self.directory.creating_usage().items():
                un, ucpu, umem = usage.get(key, (0, 0.0, 0))
                usage[key] = (un - n, ucpu - cpu, umem - mem)
        for key, row in self._pending.items():
            un, ucpu, umem = usage.get(key, (0, 0.0, 0))
            usage[key] = (un + int(row[0]), ucpu + row[1], umem + int(row[2]))
        return usage

    def _check(self, wanted: list[tuple[str | None, SandboxSpec]]) -> list[SandboxError | None]:
        """Which of these new sandboxes fit their projects' quotas, in order (each counting those
        before it): None for one that fits, the refusal for one that does not."""
        out: list[SandboxError | None] = [None] * len(wanted)
        if not any(self.iam.bounded(project) for project, _ in wanted):
            return out
        for exact in (False, True):
            usage = self._usage(exact)
            refused = False
            for i, (project, spec) in enumerate(wanted):
                out[i] = None
                if not self.iam.bounded(project):
                    continue
                cpu, mem = spec.resources.cpu, spec.resources.memory
                try:
                    self.iam.check_create(project, cpu, mem, usage)
                except ResourceExhaustedError as exc:
                    out[i], refused = exc, True
                    continue
                assert project is not None
                n, ucpu, umem = usage.get(project, (0, 0.0, 0))
                usage[project] = (n + 1, ucpu + cpu, int(umem + mem))
            if not refused or not self._pending:
                break
        return out

    @contextmanager
    def _admitted(self, wanted: list[tuple[str | None, SandboxSpec]]) -> Iterator[None]:
        """Count these creates (already checked) as in use until the call making them answers."""
        held: list[tuple[str, float, int]] = []
        for project, spec in wanted:
            if project is not None and self.iam.bounded(project):
                row = self._pending.setdefault(project, [0, 0.0, 0])
                row[0] += 1
                row[1] += spec.resources.cpu
                row[2] += spec.resources.memory
                held.append((project, spec.resources.cpu, spec.resources.memory))
        try:
            yield
        finally:
            for project, cpu, mem in held:
                row = self._pending[project]
                row[0] -= 1
                row[1] -= cpu
                row[2] -= mem
                if row[0] <= 0:
                    del self._pending[project]

    def _rate(self, wanted: list[tuple[str | None, SandboxSpec]]) -> dict[str | None, SandboxError]:
        """Take the creates from each project's creates-per-second quota; the projects refused."""
        counts: dict[str | None, int] = {}
        for project, _ in wanted:
            counts[project] = counts.get(project, 0) + 1
        refused: dict[str | None, SandboxError] = {}
        for project, n in counts.items():
            try:
                self.iam.take_create(project, n)
            except ResourceExhaustedError as exc:
                refused[project] = exc
        return refused

    def _held_each(self, keys: builtins.list[tuple[str | None, str | None]]) -> builtins.list[bool]:
        """Whether each (project, key) already made its sandbox here: a retry, which gets that sandbox
        and takes no quota again (a retry refused at the quota would leave its sandbox unclaimed, and
        a gateway would place it anew: a second sandbox)."""
        return [key is not None and self.directory.key_made(project, key) for project, key in keys]

    def _held(self, project: str | None, key: str | None, child: int | None = None) -> bool:
        """`_held_each` of one key (of a fork or restore: its first child's, `key#0`)."""
        if key is not None and child is not None:
            key = f"{key}#{child}"
        return self._held_each([(project, key)])[0]

    def _admit_all(self, project: str | None, spec: SandboxSpec, count: int) -> None:
        """All `count` sandboxes of `spec` fit, or the refusal is raised."""
        for err in self._check([(project, spec)] * count):
            if err is not None:
                raise err
        refused = self._rate([(project, spec)] * count)
        if refused:
            raise next(iter(refused.values()))

    # -- node ------------------------------------------------------------------------------------

    async def health(self) -> Health:
        health = await self.inner.health()
        p = current()
        if p.project is None:
            return health
        # How many sandboxes other projects run is theirs to know: the count is of those it sees.
        running = sum(1 for s in await self.inner.list(None, "running") if p.sees(s.spec.project))
        return health.model_copy(update={"sandboxes_running": running})

    async def metrics_text(self) -> tuple[bytes, str]:
        current().require_root("the node's metrics")
        return await self.inner.metrics_text()

    async def node_load(self) -> NodeLoad:
        current().require_root("the node's load")
        return await self.inner.node_load()

    async def drain(self, draining: bool) -> NodeLoad:
        current().require_root_admin("draining the node")
        return await self.inner.drain(draining)

    async def fence(self, generation: int) -> NodeLoad:
        current().require_root_admin("fencing the node")
        return await self.inner.fence(generation)

    async def held_keys(self, keys: builtins.list[tuple[str | None, str]]) -> builtins.list[bool]:
        """Only keys of projects the principal creates in (as its creates would be placed): another
        project's key is simply not held (never an oracle)."""
        p = current()
        placed: list[tuple[str | None, str] | None] = []
        for project, key in keys:
            try:
                placed.append((p.place(project), key))
            except PermissionDeniedError:
                placed.append(None)
        asked = [k for k in placed if k is not None]
        held = iter(await self.inner.held_keys(asked) if asked else [])
        return [k is not None and next(held) for k in placed]

    # -- sandboxes -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, idempotency_key: str | None = None) -> SandboxInfo:
        p = current()
        p.require_write()
        if p.project is None and spec.project is None:
            return await self.inner.create(spec, idempotency_key=idempotency_key)
        spec = _placed(p, spec)
        project = spec.project
        if not self.iam.chain(project) or self._held(project, idempotency_key):
            return await self.inner.create(spec, idempotency_key=idempotency_key)
        self._admit_all(project, spec, 1)
        with self._admitted([(project, spec)]):
            return await self.inner.create(spec, idempotency_key=idempotency_key)

    async def create_batch(
        self,
        specs: builtins.list[SandboxSpec],
        concurrency: int,
        idempotency_keys: builtins.list[str | None] | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        p = current()
        p.require_write()
        if p.project is None and all(s.project is None for s in specs):
            return await self.inner.create_batch(specs, concurrency, idempotency_keys)
        results: list[SandboxInfo | SandboxError | None] = [None] * len(specs)
        wanted: list[tuple[str | None, SandboxSpec]] = []
        where: list[int] = []
        for i, spec in enumerate(specs):
            try:
                placed = _placed(p, spec)
            except PermissionDeniedError as exc:
                results[i] = exc
                continue
            wanted.append((placed.project, placed))
            where.append(i)
        # An item whose key already made its sandbox here is a retry: it takes no quota again.
        keys = idempotency_keys or [None] * len(specs)
        retried = self._held_each([(w[0], keys[i]) for w, i in zip(wanted, where, strict=True)])
        go = [(w, i) for w, i, r in zip(wanted, where, retried, strict=True) if r]
        new = [(w, i) for w, i, r in zip(wanted, where, retried, strict=True) if not r]
        checked = self._check([w for w, _ in new])
        fits = [(w, i) for (w, i), err in zip(new, checked, strict=True) if err is None]
        for (_, i), err in zip(new, checked, strict=True):
            if err is not None:
                results[i] = err
        refused = self._rate([w for w, _ in fits])
        for w, i in fits:
            if w[0] in refused:
                results[i] = refused[w[0]]
            else:
                go.append((w, i))
        if go:
            go_keys = [keys[i] for _, i in go] if idempotency_keys is not None else None
            with self._admitted([w for w, _ in fits if w[0] not in refused]):
                made = await self.inner.create_batch([w[1] for w, _ in go], concurrency, go_keys)
            for (_, i), r in zip(go, made, strict=True):
                results[i] = r
        return [r if r is not None else UnavailableError("not created") for r in results]

    async def ack(self, sandbox_ids: builtins.list[str]) -> None:
        p = current()
        if p.project is not None:
            sandbox_ids = [i for i in sandbox_ids if (s := self.directory.sandbox_spec(i)) and p.sees(s.project)]
        await self.inner.ack(sandbox_ids)

    async def list(self, labels: dict[str, str] | None = None, state: str | None = None) -> builtins.list[SandboxInfo]:
        p = current()
        got = await self.inner.list(labels, state)
        return got if p.project is None else [s for s in got if p.sees(s.spec.project)]

    async def _visible_ids(self, p: Principal, labels: dict[str, str], states: tuple[str, ...]) -> builtins.list[str]:
        return [s.id for s in await self.inner.list(labels, "all") if s.state in states and p.sees(s.spec.project)]

    async def _each(
        self, ids: builtins.list[str], op: Callable[[str], Coroutine[Any, Any, object]]
    ) -> builtins.list[str]:
        """`op` on each id, 16 at a time; the ids it succeeded on (failures are skipped, as the node's
        label-wide calls skip them)."""
        limit = asyncio.Semaphore(16)

        async def one(sandbox_id: str) -> bool:
            async with limit:
                try:
                    await op(sandbox_id)
                except SandboxError:
                    return False
                return True

        done = await asyncio.gather(*(one(i) for i in ids))
        return [i for i, ok in zip(ids, done, strict=True) if ok]

    async def update_lifetime(self, sandbox_id: str, fields: dict[str, float | None]) -> SandboxInfo:
        self.sandbox_principal(sandbox_id, True)
        return await self.inner.update_lifetime(sandbox_id, fields)

    async def update_lifetimes(self, labels: dict[str, str], fields: dict[str, float | None]) -> builtins.list[str]:
        p = current()
        p.require_write()
        if p.project is None:
            return await self.inner.update_lifetimes(labels, fields)
        ids = await self._visible_ids(p, labels, _CHANGEABLE)
        await self._each(ids, lambda i: self.inner.update_lifetime(i, fields))
        return ids  # as the node's: every matching sandbox, changed or not

    async def stop(self, sandbox_id: str, reason: str = "user") -> SandboxInfo:
        self.sandbox_principal(sandbox_id, True)
        return await self.inner.stop(sandbox_id, reason)

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]:
        p = current()
        p.require_write()
        if p.project is None:
            return await self.inner.stop_many(labels, reason)
        ids = await self._visible_ids(p, labels, _HOLDING)
        return await self._each(ids, lambda i: self.inner.stop(i, reason))

    async def pause_many(self, labels: dict[str, str]) -> builtins.list[str]:
        p = current()
        p.require_write()
        if p.project is None:
            return await self.inner.pause_many(labels)
        return await self._each(await self._visible_ids(p, labels, ("running",)), self.inner.pause)

    async def resume_many(self, labels: dict[str, str]) -> builtins.list[str]:
        p = current()
        p.require_write()
        if p.project is None:
            return await self.inner.resume_many(labels)
        return await self._each(await self._visible_ids(p, labels, ("paused",)), self.inner.resume)

    get = _reads(SandboxService.get)
    events = _reads(SandboxService.events)
    usage = _reads(SandboxService.usage)
    pause = _writes(SandboxService.pause)
    resume = _writes(SandboxService.resume)

    # -- snapshots, fork, pack -------------------------------------------------------------------

    snapshot = _writes(SandboxService.snapshot)

    async def fork(
        self, sandbox_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        self.sandbox_principal(sandbox_id, True)
        spec = self.directory.sandbox_spec(sandbox_id)
        if spec is None or not self.iam.chain(spec.project) or self._held(spec.project, idempotency_key, 0):
            return await self.inner.fork(sandbox_id, count, labels, idempotency_key=idempotency_key)
        self._admit_all(spec.project, spec, count)
        with self._admitted([(spec.project, spec)] * count):
            return await self.inner.fork(sandbox_id, count, labels, idempotency_key=idempotency_key)

    async def restore(
        self, snapshot_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        p = current()
        p.require_write()
        info = await self._visible_snapshot(snapshot_id, p)
        spec = self.directory.snapshot_spec(snapshot_id)
        project = spec.project if spec is not None else info.project
        if spec is None or not self.iam.chain(project) or self._held(project, idempotency_key, 0):
            return await self.inner.restore(snapshot_id, count, labels, idempotency_key=idempotency_key)
        self._admit_all(project, spec, count)
        with self._admitted([(project, spec)] * count):
            return await self.inner.restore(snapshot_id, count, labels, idempotency_key=idempotency_key)

    async def list_snapshots(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        p = current()
        got = await self.inner.list_snapshots(sandbox_id, labels)
        return got if p.project is None else [s for s in got if p.sees(s.project)]

    async def get_snapshot(self, snapshot_id: str) -> SnapshotInfo:
        return await self._visible_snapshot(snapshot_id, current())

    async def delete_snapshot(self, snapshot_id: str) -> None:
        p = current()
        p.require_write()
        await self._visible_snapshot(snapshot_id, p)
        await self.inner.delete_snapshot(snapshot_id)

    async def pack(self, sandbox_id: str, ref: str, exclude: builtins.list[str]) -> ImageInfo:
        self.sandbox_principal(sandbox_id, True).require_root_admin("packing into the node's shared image store")
        return await self.inner.pack(sandbox_id, ref, exclude)

    # -- network -------------------------------------------------------------------------------

    set_network = _writes(SandboxService.set_network)

    async def set_network_many(self, labels: dict[str, str], network: NetworkPolicy) -> builtins.list[str]:
        p = current()
        p.require_write()
        if p.project is None:
            return await self.inner.set_network_many(labels, network)
        return await self._each(
            await self._visible_ids(p, labels, _HOLDING), lambda i: self.inner.set_network(i, network)
        )

    expose = _writes(SandboxService.expose)
    unexpose = _writes(SandboxService.unexpose)
    list_exposed = _reads(SandboxService.list_exposed)
    open_port = _reads(SandboxService.open_port)  # what a server in the sandbox answers: as its HTTP method says

    # -- audit ---------------------------------------------------------------------------------

    def audit_call(self, actor: str, data: dict[str, Any]) -> None:
        self.inner.audit_call(actor, data)

    async def read_audit(self, query: AuditQuery) -> builtins.list[AuditRecord]:
        current().require_root("reading the node's audit stream")
        return await self.inner.read_audit(query)

    def follow_audit(self, query: AuditQuery, heartbeat: float) -> AsyncIterator[AuditRecord | None]:
        current().require_root("reading the node's audit stream")
        return self.inner.follow_audit(query, heartbeat)

    def audit_last_seq(self) -> int:
        current().require_root("reading the node's audit stream")
        return self.inner.audit_last_seq()

    # -- RL: trajectories and verification -------------------------------------------------------

    async def open_trajectory(self, req: TrajectoryOpen, project: str | None = None) -> TrajectoryInfo:
        """The caller's project's trajectory `req.id` (`project` is the caller's, whatever is passed)."""
        p = current()
        p.require_write()
        spec: SandboxSpec | None = None
        placed = p.project
        if req.spec is not None:  # placed first: opened again, the arguments are the same as then
            spec = _placed(p, req.spec)
            if spec is not req.spec:
                req = req.model_copy(update={"spec": spec})
            placed = spec.project
        if await self.directory.trajectory_exists(req.id, p.project):  # opened again (its create maybe retried)
            return await self.inner.open_trajectory(req, p.project)
        if req.sandbox_id is not None:
            self.sandbox_principal(req.sandbox_id, True)
            return await self.inner.open_trajectory(req, p.project)
        if req.snapshot_id is not None:
            info = await self._visible_snapshot(req.snapshot_id, p)
            spec = self.directory.snapshot_spec(req.snapshot_id)
            placed = spec.project if spec is not None else info.project
        if spec is None or not self.iam.chain(placed):
            return await self.inner.open_trajectory(req, p.project)
        self._admit_all(placed, spec, 1)
        with self._admitted([(placed, spec)]):
            return await self.inner.open_trajectory(req, p.project)

    get_trajectory = _by_trajectory(SandboxService.get_trajectory, write=False)
    trajectory_step = _by_trajectory(SandboxService.trajectory_step, write=True)
    trajectory_steps = _by_trajectory(SandboxService.trajectory_steps, write=False)
    verify_trajectory = _by_trajectory(SandboxService.verify_trajectory, write=True)
    close_trajectory = _by_trajectory(SandboxService.close_trajectory, write=True)
    delete_trajectory = _by_trajectory(SandboxService.delete_trajectory, write=True)
    trajectory_record = _by_trajectory(SandboxService.trajectory_record, write=False)

    async def list_trajectories(
        self, labels: dict[str, str], state: str | None, project: str | None = None
    ) -> builtins.list[TrajectoryInfo]:
        return await self.inner.list_trajectories(labels, state, current().project)

    verify = _writes(SandboxService.verify)

    # -- exec and background processes ------------------------------------------------------------

    exec = _writes(SandboxService.exec)
    exec_stream = _writes(SandboxService.exec_stream)
    open_terminal = _writes(SandboxService.open_terminal)
    run_code_in = _writes(SandboxService.run_code_in)
    start_process = _writes(SandboxService.start_process)
    list_processes = _reads(SandboxService.list_processes)
    wait_process = _reads(SandboxService.wait_process)
    kill_process = _writes(SandboxService.kill_process)
    write_process_stdin = _writes(SandboxService.write_process_stdin)

    async def run_code(self, req: RunCodeRequest) -> ExecResult:
        return await self.inner.run_code(_call_placed(current(), req))

    async def run_code_many(self, reqs: builtins.list[RunCodeRequest]) -> EventStream[RunCodeBatchItem]:
        p = current()
        return await self.inner.run_code_many([_call_placed(p, req) for req in reqs])

    # -- sessions --------------------------------------------------------------------------------

    create_session = _writes(SandboxService.create_session)
    list_sessions = _reads(SandboxService.list_sessions)
    get_session = _reads(SandboxService.get_session)
    session_run = _writes(SandboxService.session_run)
    session_run_stream = _writes(SandboxService.session_run_stream)
    write_session_stdin = _writes(SandboxService.write_session_stdin)
    close_session = _writes(SandboxService.close_session)

    # -- files -----------------------------------------------------------------------------------

    read_file = _reads(SandboxService.read_file)
    write_file = _writes(SandboxService.write_file)
    list_files = _reads(SandboxService.list_files)
    stat_file = _reads(SandboxService.stat_file)
    make_dir = _writes(SandboxService.make_dir)
    remove_path = _writes(SandboxService.remove_path)
    download_tar = _reads(SandboxService.download_tar)
    upload_limit = _reads(SandboxService.upload_limit)
    upload_tar = _writes(SandboxService.upload_tar)
    watch = _reads(SandboxService.watch)

    # -- images ----------------------------------------------------------------------------------

    async def list_images(self) -> builtins.list[ImageInfo]:
        return await self.inner.list_images()

    async def build_image(self, ref: str) -> ImageInfo:
        current().require_write()
        return await self.inner.build_image(ref)

    async def build_recipe(self, recipe: str, base_dir: str) -> EventStream[BuildEvent]:
        current().require_root_admin("a recipe build (it reads the node's files)")
        return await self.inner.build_recipe(recipe, base_dir)

    async def delete_image(self, ref: str) -> None:
        current().require_root_admin("deleting from the node's image store")
        await self.inner.delete_image(ref)

    async def gc_images(self, min_age: float = 600.0) -> tuple[builtins.list[str], int]:
        current().require_root_admin("collecting the node's image store")
        return await self.inner.gc_images(min_age)

    async def push_image(self, ref: str) -> ImageInfo:
        current().require_root_admin("pushing to the shared image store")
        return await self.inner.push_image(ref)

    async def import_image(self, path: str, ref: str | None) -> ImageInfo:
        current().require_root_admin("importing an archive from the node's disk")
        return await self.inner.import_image(path, ref)
