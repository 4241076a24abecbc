"""Creating sandboxes: admission, a warm-pool hand-out or a cold create, batches, idempotency keys.

A create takes its admission budget first, resolves the image (building a built-in one if allowed),
applies the image's defaults, records the sandbox `creating` (the row written while the backend
starts it), and moves it to `running` once its agent said hello; a failure anywhere hands the budget back and leaves a
`failed` record. With an idempotency key, a retried create (after a timeout, a broken connection or
a daemon restart) gets the sandbox the first one made. Keys are per project (the spec's): a key of
another project is simply unused, so keys (a trajectory's `trajectory:<id>` is predictable) neither
hand out nor reveal another project's sandboxes. Restores (snapshots.py) start through
`start_admitted` too.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.daemon import failpoints
from sandfleet.daemon.net.sandbox_network import Networking
from sandfleet.daemon.node.core import KeyName, NodeCore, log, store_row
from sandfleet.daemon.node.image_service import Images
from sandfleet.daemon.node.lifecycle import CREATING, FAILED, RUNNING, Sandbox, new_sandbox_id
from sandfleet.daemon.node.pool import pool_key
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.daemon.node.state import StateConflictError, StateDiskFullError
from sandfleet.errors import InternalError, InvalidArgumentError, ResourceExhaustedError, SandboxError, UnavailableError
from sandfleet.models import SandboxInfo, SandboxSpec, shown

KEY_BEING_REMOVED = "a sandbox made with this idempotency key is being removed: retry"


class Creation:
    def __init__(self, core: NodeCore, images: Images, files: Files, networking: Networking) -> None:
        self.core = core
        self.images = images
        self.files = files
        self.networking = networking

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

    def holds(self, project: str | None, key: str) -> bool:
        """Whether this node holds idempotency key `key` of `project`: a sandbox made with it, or a
        create with it still running (a retried create that reached another gateway asks)."""
        return (project, key) in self.core.keys

    async def claimed(self, name: KeyName, fingerprint: str) -> SandboxInfo | None:
        """What an idempotency key (project, key) already made (waiting for a create with it still
        running); a key made by another request of the project is `invalid_argument`."""
        while True:
            entry = self.core.keys.get(name)
            if entry is None:
                return None
            made, seen = entry
            if seen != fingerprint and seen != "":  # "": kept by a version that did not record it
                raise InvalidArgumentError(f"idempotency key {shown(name[1])} was used for another request")
            if isinstance(made, asyncio.Future):
                with contextlib.suppress(Exception):
                    await asyncio.shield(made)
                continue  # settled: look again (a failed create frees its key)
            sb = self.core.table.find(made)
            if sb is None:  # forgotten since (stopped and past retention): the key is free again
                self.core.keys.pop(name, None)
                return None
            if sb.state == CREATING:
                await asyncio.shield(sb.created.wait())
            self.core.ack_one(sb)
            return sb.info()

    async def create(
        self, spec: SandboxSpec, *, idempotency_key: str | None = None, cpu_held: bool = False
    ) -> SandboxInfo:
        """Create a sandbox. With an idempotency key, a create retried after a timeout, a broken
        connection or a daemon crash returns the sandbox the first one made. `cpu_held`: its CPU is
        held in a CpuQueue (the node's own work, a verifier): the CPU load does not refuse it."""
        if idempotency_key is None:
            info = await self._create(spec, None, cpu_held=cpu_held)
            failpoints.hit("create_before_answer")
            return info
        fingerprint = spec.model_dump_json(exclude_unset=True)
        name = (spec.project, idempotency_key)
        existing = await self.claimed(name, fingerprint)
        if existing is not None:
            return existing
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.core.keys[name] = (fut, fingerprint)
        try:
            info = await self._create(spec, idempotency_key, fingerprint)
        except BaseException as exc:
            self.core.keys.pop(name, None)
            fut.set_exception(exc if isinstance(exc, Exception) else InternalError("create cancelled"))
            fut.exception()  # retrieved: waiters look again
            raise
        self.core.keys[name] = (info.id, fingerprint)
        fut.set_result(info.id)
        failpoints.hit("create_before_answer")
        return info

    async def _create(
        self, spec: SandboxSpec, key: str | None, fingerprint: str | None = None, *, cpu_held: bool = False
    ) -> SandboxInfo:
        self.check_backend(spec)
        self.check_node_selector(spec)
        self.networking.check(spec)
        if self.core.pools is not None:
            pkey = pool_key(spec)
            pooled = self.core.pools.image(pkey)  # what the pool's members were made from
            # Before taking a member: a spec the image's defaults make invalid must not cost one.
            effective = self.images.with_image_defaults(spec, pooled) if pooled is not None else spec
            live = self.core.pools.take(pkey)
            if live is not None:
                return await self._hand_out(effective, live, key, fingerprint)
        self.admit(spec, cpu_held=cpu_held)
        try:
            image = await self.images.resolve_environment(spec)
            spec = self.images.with_image_defaults(spec, image)
        except BaseException:
            self.core.creating -= 1
            self.core.admission.release(spec.resources)
            raise
        created = {"image": spec.environment(), "layers": [x.digest for x in image.layers]}
        tier = self.core.tier_for(spec.backend)
        return await self.start_admitted(
            spec, lambda sid: tier.create(sid, spec, image), created, key, fingerprint=fingerprint
        )

    def check_draining(self, specs: Sequence[SandboxSpec], key: str | None = None) -> None:
        """A caller's new sandboxes (create, batch, a trajectory's; in their projects): refused while
        the node drains, and counted in their jobs. The node's own (verifiers, fncall workers), forks
        and restores of its snapshots, and a retried create whose idempotency key (of the spec's
        project) already made its sandbox still go through."""
        if not self.core.draining or (key is not None and (specs[0].project, key) in self.core.keys):
            return
        err = UnavailableError(f"node {self.core.node_key} is draining: it takes no new sandboxes")
        self.core.jobs.refused(specs, "draining", err)
        raise err

    def check_node_selector(self, spec: SandboxSpec) -> None:
        """A sandbox that asks for node labels this node does not carry is not for this node."""
        labels = self.core.node_labels
        missing = {k: v for k, v in spec.node_selector.items() if labels.get(k) != v}
        if missing:
            shown = ", ".join(f"{k}={v}" for k, v in sorted(missing.items()))[:300]
            raise InvalidArgumentError(f"this node does not carry the labels the sandbox asks for: {shown}")

    def check_backend(self, spec: SandboxSpec) -> None:
        if self.core.shutting_down:
            raise UnavailableError("daemon is shutting down")
        self.core.tier_for(spec.backend)

    def admit(self, spec: SandboxSpec, *, cpu_held: bool = False) -> None:
        """Take the spec's admission budget (or raise ResourceExhaustedError); counts as creating."""
        try:
            self.core.admission.admit(self.core.node_count(), spec.resources, cpu_held=cpu_held)
        except ResourceExhaustedError as exc:
            self.core.metrics.rejected.inc()
            self.core.jobs.refused([spec], "capacity", exc)
            raise
        self.core.admission.commit(spec.resources)
        self.core.creating += 1

    async def start_admitted(
        self,
        spec: SandboxSpec,
        start: Callable[[str], Awaitable[LiveSandbox]],
        created: dict[str, Any],
        key: str | None = None,
        *,
        fingerprint: str | None = None,
    ) -> SandboxInfo:
        """Record a new sandbox, start it with `start(id)` (a create or a restore), make it running;
        `key` and `fingerprint`: its idempotency key and the request's, kept in its row."""
        # Until the backend holds the resources, a failure must hand the admission budget back.
        holds_budget = True
        t0 = time.perf_counter()
        try:
            sandbox_id = new_sandbox_id(self.core.node_key)
            now = time.time()
            sb = Sandbox(sandbox_id, spec, CREATING, now, now, idempotency_key=key, acked=False)
            sb.claim_by = now + self.core.claim_window
            self.core.table.add(sb)
            finished = sb.created  # set however this create ends; a concurrent stop waits on it
            # The row is written while the sandbox starts (its round trip to the state thread is off
            # the create's path). Every later operation on it queues behind it, and a crash before it
            # lands leaves parts no row names, which recovery removes. A row refused (its key still
            # held by a row being removed, a full disk) takes the started sandbox down again.
            try:
                row = self.core.state.insert(store_row(sb, {}, fingerprint))
                row.add_done_callback(_retrieved)
                if self.core.state.full:  # refused before anything starts, while the disk is full
                    await asyncio.shield(row)
            except BaseException as exc:
                self.core.table.discard(sb)
                finished.set()
                if isinstance(exc, StateConflictError):
                    raise UnavailableError(KEY_BEING_REMOVED) from exc
                raise
            try:
                live = await start(sandbox_id)
            except BaseException as start_failure:
                failure = start_failure
                row_failure = row.exception() if row.done() and not row.cancelled() else None
                if isinstance(start_failure, Exception) and isinstance(row_failure, StateDiskFullError):
                    failure = row_failure  # retryable, where a tier's own ENOSPC is not
                if sb.idempotency_key is not None:  # a failed create answers no retry: its key is free
                    sb.idempotency_key = None
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.core.state.update(sandbox_id, idempotency_key=None))
                self.core.table.move(sb, FAILED)
                sb.stopped_at, sb.stop_reason = time.time(), f"create failed: {failure}"[:500]
                cause = failure.cause if isinstance(failure, SandboxError) else "infra"
                self.core.journal.record(sandbox_id, "create_failed", {"error": str(failure)[:500], "cause": cause})
                await asyncio.shield(self.core.forget(sb))
                self.core.metrics.create_failures.inc()
                finished.set()
                if failure is not start_failure:
                    raise failure from start_failure
                raise
            sb.live = live
            holds_budget = False  # released by stop from here on
            live.channel.on_close = lambda _ch: self.core.on_agent_lost(sandbox_id)
            self.core.table.move(sb, RUNNING)
            finished.set()
            try:
                await asyncio.shield(row)
            except Exception as exc:  # it runs, but no row names it: taken down, a failed create
                said, raised = _refused_row(exc)
                sb.idempotency_key = None  # (no row holds it)
                with contextlib.suppress(SandboxError):
                    await self._failed_late(sb, said, "its row could not be written")
                raise raised from None
            if sb.state == RUNNING:  # (a stop that came meanwhile has written its own state)
                await self.core.state.update(sandbox_id, state=RUNNING, runtime=live.runtime)
            await self._settle_create(sb, live, created, t0)
        finally:
            self.core.creating -= 1
            if holds_budget:
                self.core.admission.release(spec.resources)
        return sb.info()

    async def _hand_out(
        self, spec: SandboxSpec, live: LiveSandbox, key: str | None = None, fingerprint: str | None = None
    ) -> SandboxInfo:
        """Give a warm sandbox to this caller (its budget is already committed) and make it theirs."""
        t0 = time.perf_counter()
        now = time.time()
        sb = Sandbox(live.id, spec, RUNNING, now, now, live=live, idempotency_key=key, acked=False)
        sb.claim_by = now + self.core.claim_window
        sb.created.set()
        self.core.table.add(sb)
        live.channel.on_close = lambda _ch: self.core.on_agent_lost(sb.id)
        await self.core.state.insert(store_row(sb, live.runtime, fingerprint))
        self.core.metrics.pool_hits.inc()
        await self._settle_create(sb, live, {"image": spec.environment(), "pooled": True}, t0)
        return sb.info()

    async def _failed_late(self, sb: Sandbox, exc: SandboxError, reason: str) -> None:
        """A create that failed once its sandbox ran: recorded as a failed create, then stopped."""
        self.core.journal.record(sb.id, "create_failed", {"error": str(exc)[:500], "cause": exc.cause})
        self.core.metrics.create_failures.inc()
        await self.core.stop(sb.id, reason=reason)

    async def _settle_create(self, sb: Sandbox, live: LiveSandbox, created: dict[str, Any], t0: float) -> None:
        """The last step of every create, cold or pooled: check the spec's user exists, then record it."""
        if sb.spec.user != "root":
            try:
                await self.files.user(sb, live, sb.spec.user)
            except SandboxError as exc:
                await self._failed_late(sb, exc, "invalid user")
                raise
        self.core.watch_agent(sb.id, live)
        if not sb.spec.network.none:
            try:
                await self.networking.attach(sb)
            except OSError as exc:
                err = UnavailableError(f"the sandbox's network policy could not be applied: {exc}")
                await self._failed_late(sb, err, "network policy could not be applied")
                raise err from exc
        if sb.spec.qos == "best_effort":
            self.core.best_effort_ids.add(sb.id)
        self.core.journal.record(sb.id, "created", created)
        self.core.metrics.created.inc()
        self.core.metrics.create_seconds.observe(time.perf_counter() - t0)
        self.core.metrics.alive.set(self.core.running_count())


def _refused_row(exc: Exception) -> tuple[SandboxError, BaseException]:
    """A refused row's failure as its create's journal says it, and as its caller gets it."""
    if isinstance(exc, StateConflictError):
        err = UnavailableError(KEY_BEING_REMOVED)
        return err, err
    if isinstance(exc, SandboxError):
        return exc, exc
    if isinstance(exc, StateDiskFullError):  # (the API answers it as this)
        return ResourceExhaustedError(f"the node's state disk is full: {exc}"[:300]), exc
    return UnavailableError(f"the node could not write the sandbox's row: {exc}"[:300]), exc


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """A row's outcome is read even when the create failed first (no 'never retrieved' warning)."""
    if not fut.cancelled():
        fut.exception()
