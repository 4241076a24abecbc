"""Tenancy: what each request's project may see and use of the node, and what it may make.

The principal is the one the API's authentication made current (`iam.CURRENT`). Two parts:
- every operation's scope and access, declared in sandfleet/operations.py, are checked by a route
  dependency (`Tenancy.admit`, added by `Api.route` in daemon/api/common.py) before its handler
  runs: a call naming a sandbox or snapshot of a project the principal does not see answers
  `not_found`, word for word as for one that does not exist (ids of other projects do not leak); one
  that acts needs a principal that may act; node-wide data (audit, metrics, load) needs a root
  principal, and node-wide changes (the image store: delete, gc, push, import, recipe builds, pack;
  drain, fence) an admin of the root;
- `Tenancy` (here) serves the calls whose arguments or answers depend on the project:
  - creates (and batches, forks, restores, trajectories with a new sandbox) go into the principal's
    project by default, or into one of its subtree; elsewhere is `permission_denied`, as is a
    writable host mount (read-only ones only: a host directory is shared by every project). They must
    fit the quotas of their project and of every listed ancestor (`Iam.check_create`,
    `Iam.take_create`): otherwise `resource_exhausted` naming the project. Forks and restores keep
    the parent's project;
  - trajectory ids are each project's own (the caller's project is their namespace): naming an id
    another project uses names the caller's own trajectory of that id, or none;
  - lists and label-wide calls (stop, pause, resume, lifetimes, network) touch visible sandboxes
    only, and the node's health counts the sandboxes the principal sees (others' are theirs to know);
  - stateless fncall calls run in the caller's project (or one of its subtree), on workers pooled
    per project, which count as the project's sandboxes but are not refused by its quota (each pool
    is bounded by the tier's `max_workers`).

A node without `[iam]` projects has no principal to scope by (`iam` None): each call goes straight to
the node's concern, and the routes carry no dependency. A root principal passes through with one
context-variable read and an attribute test.

Quotas count what the node holds (`SandboxTable.project_usage`, through `Directory`) plus the creates
let through that have not answered yet, so concurrent creates cannot overshoot a quota while their
sandboxes are still being made. A sandbox being created is in the table too: when the quick count
refuses while creates are in flight, the exact count (the table's `creating` sandboxes taken out once)
decides, so a burst up to the quota is never refused for being counted twice.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from sandfleet.daemon.security.iam import CURRENT, Iam, Principal, Usage, UsageMap, current
from sandfleet.errors import (
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxNotFoundError,
    SnapshotNotFoundError,
    UnavailableError,
)
from sandfleet.models import (
    Health,
    NetworkPolicy,
    QuotaUse,
    Refusal,
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
    from sandfleet.operations import Operation


_HOLDING = ("running", "paused")  # the states label-wide calls act on (lifecycle.HOLDING_STATES)
_CHANGEABLE = ("creating", "running", "paused")  # lifetimes


class Directory(Protocol):
    """What tenancy looks up about the node's sandboxes, snapshots and trajectories."""

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


def hidden_sandbox(sandbox_id: str) -> SandboxNotFoundError:
    return SandboxNotFoundError(f"sandbox {sandbox_id[:80]} not found")  # as SandboxTable.get says it


def hidden_snapshot(snapshot_id: str) -> SnapshotNotFoundError:
    return SnapshotNotFoundError(f"snapshot {shown(snapshot_id)} not found")  # as Snapshots says it


class Tenancy:
    """The calls whose arguments or answers depend on the caller's project (see the module doc); with
    no `[iam]` projects, each goes straight to the node's concern."""

    def __init__(self, node: SandboxManager, iam: Iam | None) -> None:
        self.node = node
        self.iam = iam
        self.directory = NodeDirectory(node)
        self._pending: dict[str, list[float]] = {}  # project -> [sandboxes, cpu, memory] of creates in flight

    def _principal(self) -> Principal | None:
        """The caller, when projects are configured (None: nothing to scope)."""
        return None if self.iam is None else current()

    async def admit(self, op: Operation, params: Mapping[str, Any]) -> None:
        """The caller may make call `op` with these path parameters: it may act if the call acts, it is
        the root (or its admin) if the call needs it, and it sees what the call names. The route
        dependency of every declared operation when projects are configured."""
        p = current()
        if op.writes:
            p.require_write()
        if op.access == "root":
            p.require_root(op.needs)
        elif op.access == "admin":
            p.require_root_admin(op.needs)
        if p.project is None:
            return
        if op.scope == "sandbox":
            self.visible_sandbox(params["sandbox_id"], p)
        elif op.scope == "snapshot":
            await self.visible_snapshot(params["snapshot_id"], p)

    @staticmethod
    def project() -> str | None:
        """The caller's project: the namespace of its trajectory ids (None: the root's)."""
        p = CURRENT.get()
        return None if p is None else p.project

    async def visible_snapshot(self, snapshot_id: str, p: Principal) -> SnapshotInfo:
        info = await self.node.snapshots.get_snapshot(snapshot_id)
        if not p.sees(info.project):
            raise hidden_snapshot(snapshot_id)
        return info

    def visible_sandbox(self, sandbox_id: str, p: Principal) -> None:
        if p.project is not None:
            spec = self.directory.sandbox_spec(sandbox_id)
            if spec is None or not p.sees(spec.project):
                raise hidden_sandbox(sandbox_id)

    def sees(self) -> Callable[[str | None], bool]:
        """Whether the caller sees a project's data (everything, for the root or with no projects)."""
        p = self._principal()
        return (lambda _project: True) if p is None or p.project is None else p.sees

    def is_root(self) -> bool:
        p = self._principal()
        return p is None or p.project is None

    # -- quotas ----------------------------------------------------------------------------------

    def quota_uses(self, projects: Iterable[str | None] | None = None) -> builtins.list[QuotaUse]:
        """The quotas `projects` count against (None: every project's), with what their subtrees hold here."""
        return [] if self.iam is None else self.iam.uses(self.directory.project_usage(), projects)

    @property
    def _quotas(self) -> Iam:
        """The projects' quotas (asked only with projects configured)."""
        assert self.iam is not None
        return self.iam

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
        if not any(self._quotas.bounded(project) for project, _ in wanted):
            return out
        for exact in (False, True):
            usage = self._usage(exact)
            refused = False
            for i, (project, spec) in enumerate(wanted):
                out[i] = None
                if not self._quotas.bounded(project):
                    continue
                cpu, mem = spec.resources.cpu, spec.resources.memory
                try:
                    self._quotas.check_create(project, cpu, mem, usage)
                except ResourceExhaustedError as exc:
                    out[i], refused = exc, True
                    continue
                assert project is not None
                n, ucpu, umem = usage.get(project, (0, 0.0, 0))
                usage[project] = (n + 1, ucpu + cpu, int(umem + mem))
            if not refused or not self._pending:
                break
        for (project, _), err in zip(wanted, out, strict=True):
            if err is not None:
                self._refused(project)
        return out

    def _refused(self, project: str | None, n: int = 1) -> None:
        """Count a create refused by a quota, under the listed project it counts against first (a
        project a caller names needs not be listed: the metric's labels are the configuration's)."""
        chain = self._quotas.chain(project)
        self.node.core.metrics.quota_refusals.labels(project=chain[0][0] if chain else "").inc(n)

    @contextmanager
    def _admitted(self, wanted: list[tuple[str | None, SandboxSpec]]) -> Iterator[None]:
        """Count these creates (already checked) as in use until the call making them answers."""
        held: list[tuple[str, float, int]] = []
        for project, spec in wanted:
            if project is not None and self._quotas.bounded(project):
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
                self._quotas.take_create(project, n)
            except ResourceExhaustedError as exc:
                self._refused(project, n)
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

    def _admit_all(
        self, project: str | None, spec: SandboxSpec, count: int, labels: dict[str, str] | None = None
    ) -> None:
        """All `count` sandboxes of `spec` fit, or the refusal is raised (and counted in their job:
        `labels`, those they get on top of the spec's)."""
        err: SandboxError | None = next((e for e in self._check([(project, spec)] * count) if e is not None), None)
        why: Refusal = "quota"
        if err is None:
            refused = self._rate([(project, spec)] * count)
            err, why = next(iter(refused.values()), None), "rate"
        if err is not None:
            made = spec.model_copy(update={"labels": {**spec.labels, **(labels or {})}, "project": project})
            self.node.core.jobs.refused([made] * count, why, err)
            raise err

    # -- node ------------------------------------------------------------------------------------

    async def health(self) -> Health:
        health = await self.node.health()
        p = self._principal()
        if p is None or p.project is None:
            return health
        # How many sandboxes other projects run is theirs to know: the count is of those it sees.
        running = sum(1 for s in await self.node.core.list(None, "running") if p.sees(s.spec.project))
        return health.model_copy(update={"sandboxes_running": running})

    async def held_keys(self, keys: builtins.list[tuple[str | None, str]]) -> builtins.list[bool]:
        """Only keys of projects the principal creates in (as its creates would be placed): another
        project's key is simply not held (never an oracle)."""
        p = self._principal()
        placed: list[tuple[str | None, str] | None] = list(keys)
        if p is not None:
            placed = []
            for project, key in keys:
                try:
                    placed.append((p.place(project), key))
                except PermissionDeniedError:
                    placed.append(None)
        return [k is not None and self.node.creation.holds(*k) for k in placed]

    async def ack(self, sandbox_ids: builtins.list[str]) -> None:
        p = self._principal()
        if p is not None and p.project is not None:
            sandbox_ids = [i for i in sandbox_ids if (s := self.directory.sandbox_spec(i)) and p.sees(s.project)]
        await self.node.core.ack(sandbox_ids)

    # -- sandboxes -------------------------------------------------------------------------------

    async def create(self, spec: SandboxSpec, *, idempotency_key: str | None = None) -> SandboxInfo:
        p = self._principal()
        if p is not None and (p.project is not None or spec.project is not None):
            spec = _placed(p, spec)
        project = spec.project
        self.node.creation.check_draining([spec], idempotency_key)
        create = self.node.creation.create
        if p is None or self.iam is None or not self.iam.chain(project) or self._held(project, idempotency_key):
            return await create(spec, idempotency_key=idempotency_key)
        self._admit_all(project, spec, 1)
        with self._admitted([(project, spec)]):
            return await create(spec, idempotency_key=idempotency_key)

    async def create_batch(
        self,
        specs: builtins.list[SandboxSpec],
        concurrency: int,
        idempotency_keys: builtins.list[str | None] | None = None,
    ) -> builtins.list[SandboxInfo | SandboxError]:
        p = self._principal()
        create_batch = self.node.creation.create_batch
        if p is None or (p.project is None and all(s.project is None for s in specs)):
            self.node.creation.check_draining(specs)
            return await create_batch(specs, concurrency, idempotency_keys)
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
        self.node.creation.check_draining([spec for _, spec in wanted])  # (counted in the jobs it may make)
        # An item whose key already made its sandbox here is a retry: it takes no quota again.
        keys = idempotency_keys or [None] * len(specs)
        retried = self._held_each([(w[0], keys[i]) for w, i in zip(wanted, where, strict=True)])
        go = [(w, i) for w, i, r in zip(wanted, where, retried, strict=True) if r]
        new = [(w, i) for w, i, r in zip(wanted, where, retried, strict=True) if not r]
        checked = self._check([w for w, _ in new])
        fits = [(w, i) for (w, i), err in zip(new, checked, strict=True) if err is None]
        jobs = self.node.core.jobs
        for ((_, spec), i), err in zip(new, checked, strict=True):
            if err is not None:
                results[i] = err
                jobs.refused([spec], "quota", err)
        refused = self._rate([w for w, _ in fits])
        for w, i in fits:
            if w[0] in refused:
                results[i] = refused[w[0]]
                jobs.refused([w[1]], "rate", refused[w[0]])
            else:
                go.append((w, i))
        if go:
            go_keys = [keys[i] for _, i in go] if idempotency_keys is not None else None
            with self._admitted([w for w, _ in fits if w[0] not in refused]):
                made = await create_batch([w[1] for w, _ in go], concurrency, go_keys)
            for (_, i), r in zip(go, made, strict=True):
                results[i] = r
        return [r if r is not None else UnavailableError("not created") for r in results]

    async def list(self, labels: dict[str, str] | None = None, state: str | None = None) -> builtins.list[SandboxInfo]:
        got = await self.node.core.list(labels, state)
        p = self._principal()
        return got if p is None or p.project is None else [s for s in got if p.sees(s.spec.project)]

    async def _visible_ids(self, p: Principal, labels: dict[str, str], states: tuple[str, ...]) -> builtins.list[str]:
        return [s.id for s in await self.node.core.list(labels, "all") if s.state in states and p.sees(s.spec.project)]

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

    def _scoped(self) -> Principal | None:
        """The caller of a label-wide call when it is a project's (None: it sees the whole node)."""
        p = self._principal()
        return p if p is not None and p.project is not None else None

    async def update_lifetimes(self, labels: dict[str, str], fields: dict[str, float | None]) -> builtins.list[str]:
        core = self.node.core
        if (p := self._scoped()) is None:
            return await core.update_lifetimes(labels, fields)
        ids = await self._visible_ids(p, labels, _CHANGEABLE)
        await self._each(ids, lambda i: core.update_lifetime(i, fields))
        return ids  # as the node's: every matching sandbox, changed or not

    async def stop_many(self, labels: dict[str, str], reason: str = "user") -> builtins.list[str]:
        core = self.node.core
        if (p := self._scoped()) is None:
            return await core.stop_many(labels, reason)
        return await self._each(await self._visible_ids(p, labels, _HOLDING), lambda i: core.stop(i, reason))

    async def pause_many(self, labels: dict[str, str]) -> builtins.list[str]:
        pauser = self.node.pauser
        if (p := self._scoped()) is None:
            return await pauser.pause_many(labels)
        return await self._each(await self._visible_ids(p, labels, ("running",)), pauser.pause)

    async def resume_many(self, labels: dict[str, str]) -> builtins.list[str]:
        pauser = self.node.pauser
        if (p := self._scoped()) is None:
            return await pauser.resume_many(labels)
        return await self._each(await self._visible_ids(p, labels, ("paused",)), pauser.resume)

    async def set_network_many(self, labels: dict[str, str], network: NetworkPolicy) -> builtins.list[str]:
        networking = self.node.networking
        if (p := self._scoped()) is None:
            return await networking.set_network_many(labels, network)
        ids = await self._visible_ids(p, labels, _HOLDING)
        return await self._each(ids, lambda i: networking.set_network(i, network))

    # -- snapshots, fork -------------------------------------------------------------------------

    async def fork(
        self, sandbox_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """(The route's dependency made sure the caller sees the sandbox and may act.)"""
        fork = self.node.snapshots.fork
        spec = self.directory.sandbox_spec(sandbox_id)
        if self._unbounded(spec, idempotency_key):
            return await fork(sandbox_id, count, labels, idempotency_key=idempotency_key)
        assert spec is not None
        self._admit_all(spec.project, spec, count, labels)
        with self._admitted([(spec.project, spec)] * count):
            return await fork(sandbox_id, count, labels, idempotency_key=idempotency_key)

    async def restore(
        self, snapshot_id: str, count: int, labels: dict[str, str] | None = None, *, idempotency_key: str | None = None
    ) -> builtins.list[SandboxInfo | SandboxError]:
        """(The route's dependency made sure the caller sees the snapshot and may act.)"""
        restore = self.node.snapshots.restore
        spec = self.directory.snapshot_spec(snapshot_id)
        if self._unbounded(spec, idempotency_key):
            return await restore(snapshot_id, count, labels, idempotency_key=idempotency_key)
        assert spec is not None
        self._admit_all(spec.project, spec, count, labels)
        with self._admitted([(spec.project, spec)] * count):
            return await restore(snapshot_id, count, labels, idempotency_key=idempotency_key)

    def _unbounded(self, spec: SandboxSpec | None, key: str | None) -> bool:
        """Copies of `spec` need no quota check: no projects here, no quota over its project, or a
        retry of copies already made (their first child's key, `key#0`, is held)."""
        return self.iam is None or spec is None or not self.iam.chain(spec.project) or self._held(spec.project, key, 0)

    async def list_snapshots(
        self, sandbox_id: str | None = None, labels: dict[str, str] | None = None
    ) -> builtins.list[SnapshotInfo]:
        got = await self.node.snapshots.list_snapshots(sandbox_id, labels)
        p = self._principal()
        return got if p is None or p.project is None else [s for s in got if p.sees(s.project)]

    # -- RL: trajectories ------------------------------------------------------------------------

    async def open_trajectory(self, req: TrajectoryOpen) -> TrajectoryInfo:
        """The caller's project's trajectory `req.id`."""
        open_ = self.node.trajectories.open
        p = self._principal()
        if p is None:
            return await open_(req, project=self.project())
        spec: SandboxSpec | None = None
        placed = p.project
        if req.spec is not None:  # placed first: opened again, the arguments are the same as then
            spec = _placed(p, req.spec)
            if spec is not req.spec:
                req = req.model_copy(update={"spec": spec})
            placed = spec.project
        if await self.directory.trajectory_exists(req.id, p.project):  # opened again (its create maybe retried)
            return await open_(req, project=p.project)
        if req.sandbox_id is not None:
            p.require_write()
            self.visible_sandbox(req.sandbox_id, p)
            return await open_(req, project=p.project)
        if req.snapshot_id is not None:
            info = await self.visible_snapshot(req.snapshot_id, p)
            spec = self.directory.snapshot_spec(req.snapshot_id)
            placed = spec.project if spec is not None else info.project
        assert self.iam is not None
        if spec is None or not self.iam.chain(placed):
            return await open_(req, project=p.project)
        self._admit_all(placed, spec, 1, req.labels)
        with self._admitted([(placed, spec)]):
            return await open_(req, project=p.project)

    async def list_trajectories(self, labels: dict[str, str], state: str | None) -> builtins.list[TrajectoryInfo]:
        return await self.node.trajectories.list(labels, state, project=self.project())

    # -- stateless calls -------------------------------------------------------------------------

    def placed_call(self, req: RunCodeRequest) -> RunCodeRequest:
        """A pooled call in its project (the principal's by default, or one of its subtree): workers
        are pooled per project, never shared across."""
        p = self._principal()
        if p is None:
            return req
        p.require_write()
        project = p.place(req.project)
        return req if project == req.project else req.model_copy(update={"project": project})
