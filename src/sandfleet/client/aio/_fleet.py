"""The client's calls on sandboxes as a fleet: create (retried, idempotent), create_many, get, list,
jobs, the label-selected calls (stop, pause, resume, network, lifetimes), snapshots and restores."""

from __future__ import annotations

import asyncio
import builtins
import functools
from collections.abc import Mapping, Sequence
from typing import Any

from sandfleet.client import _base as b
from sandfleet.client._base import UNSET, Unset
from sandfleet.client.aio._http import _AsyncCalls
from sandfleet.client.aio._sandbox import AsyncSandbox
from sandfleet.errors import SandboxError
from sandfleet.models import (
    Alert,
    AlertList,
    CreateBatchResult,
    IdList,
    JobList,
    JobStats,
    NetworkPolicy,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
    SnapshotInfo,
    SnapshotList,
    StopManyResult,
)


class _Fleet(_AsyncCalls):
    async def create(
        self,
        spec: SandboxSpec | None = None,
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        key_reused: bool = False,
        **fields: Any,
    ) -> AsyncSandbox:
        """Create a sandbox from a spec or from SandboxSpec fields (`image=..., resources=...`).

        Waits for capacity: a full node's refusal (`ResourceExhaustedError`) is retried with backoff
        until `timeout` (default: the client's) runs out, then the last refusal is raised (each
        attempt waits at most the client's timeout, and only starts with `b.MIN_ATTEMPT` s left). Every
        attempt carries one Idempotency-Key (`idempotency_key`, or a fresh one), so an attempt whose
        answer was lost (timeout, broken connection, a daemon restart) is retried without ever making
        a second sandbox. An error raised while the outcome is unknown names the key: repeat the
        create with it to get the sandbox if it was made. `key_reused`: `idempotency_key` may have
        been used by another process (a trainer before its restart): in a cluster, the gateway asks
        every node which holds it before placing the create (one small request per node); without
        it, a first attempt is placed as new.
        """
        full = b.spec_from(spec, fields)
        attempts = b.CreateAttempts(b.idempotency_key(idempotency_key), reused=key_reused and bool(idempotency_key))
        deadline = b.Deadline(b.check_timeout(timeout, self.timeout))
        info = await self._retrying(
            lambda key, t: b.call_create(full, key, t), SandboxInfo, attempts, deadline, refusals=True
        )
        return AsyncSandbox(self._client, info)

    async def create_many(
        self,
        specs: Sequence[SandboxSpec],
        *,
        concurrency: int = 16,
        batch_size: int = 64,
        timeout: float | None = None,
        retry_for: float | None = None,
        project: str | None = None,
    ) -> builtins.list[AsyncSandbox | SandboxError]:
        """Create one sandbox per spec; one result per spec, in order: the sandbox or its SandboxError.
        `project`: the project of the specs that name none.

        Specs travel `batch_size` to a request (one round trip per batch, not per sandbox), two
        requests in flight, and the daemon runs `concurrency` creates of each batch at once. Each
        item succeeds or fails on its own. Everything is over within `timeout` (default: the client's).
        Refusals of a full node (`ResourceExhaustedError`) are retried with backoff for up to
        `retry_for` seconds (default: until the timeout). Each spec has its own idempotency key, sent
        again on its retries, so a batch whose answer was lost is retried without duplicates.
        """
        specs = b.in_project(specs, project)
        attempts = [b.CreateAttempts(b.new_idempotency_key()) for _ in specs]
        deadline = b.Deadline(b.check_timeout(timeout, self.timeout), retry_refusals_for=retry_for)
        results: dict[int, AsyncSandbox | SandboxError] = {}
        pending = builtins.list(range(len(specs)))
        while pending:
            per_request = deadline.attempt_timeout(self.timeout)
            chunks = [pending[i : i + batch_size] for i in range(0, len(pending), batch_size)]
            calls = [
                functools.partial(
                    self._create_batch,
                    [(i, specs[i], attempts[i].key) for i in chunk],
                    concurrency,
                    per_request,
                    any(attempts[i].retried for i in chunk),
                )
                for chunk in chunks
            ]
            pending = []
            only_refused = True
            for chunk_results in await b.gather_bounded(2, calls):
                for index, outcome in chunk_results:
                    if isinstance(outcome, SandboxError):
                        reason = attempts[index].retry_reason(outcome)
                        if reason is not None and deadline.allows(reason == "refused"):
                            pending.append(index)
                            only_refused = only_refused and reason == "refused"
                            continue
                        outcome = attempts[index].final(outcome)
                    results[index] = outcome
            if pending:
                await asyncio.sleep(deadline.backoff(only_refused))
        return [results[i] for i in range(len(specs))]

    async def _create_batch(
        self, chunk: Sequence[tuple[int, SandboxSpec, str]], concurrency: int, timeout: float, retried: bool = False
    ) -> builtins.list[tuple[int, AsyncSandbox | SandboxError]]:
        call = b.call_create_batch([spec for _, spec, _ in chunk], [key for *_, key in chunk], concurrency, timeout)
        call = b.retried(call, retried)
        try:
            reply = await self._model(CreateBatchResult, call)
        except SandboxError as exc:
            return [(index, exc) for index, _, _ in chunk]
        return [
            (index, AsyncSandbox(self._client, item.sandbox) if item.sandbox else b.item_error(item))
            for (index, _, _), item in zip(chunk, reply.results, strict=True)
        ]

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """Attach to an existing sandbox by id (e.g. from another process, after a trainer restart)."""
        return AsyncSandbox(self._client, await self._model(SandboxInfo, b.Call("GET", b.sandbox_path(sandbox_id))))

    async def list(
        self, labels: Mapping[str, str] | None = None, state: str | None = None, *, project: str | None = None
    ) -> list[SandboxInfo]:
        """Sandboxes carrying all of `labels` (and in `project` or under it), in `state`: creating,
        running, paused, stopping, stopped, failed, `live` (the first four) or `all`; None (the
        default) lists live ones only."""
        return (await self._model(SandboxList, b.call_list(b.selector(labels, project), state))).sandboxes

    async def jobs(
        self,
        key: str = "job",
        labels: Mapping[str, str] | None = None,
        state: str | None = None,
        *,
        project: str | None = None,
    ) -> JobList:
        """Sandboxes (live ones by default; `state` as in `list`) grouped by the value of label `key`
        (a job, a team, ...), counted by state: `fleet.jobs().jobs[0].states` -> {"running": 98, ...}."""
        return await self._model(JobList, b.call_jobs(key, b.selector(labels, project), state))

    async def job(self, value: str, *, stuck_after: float = 600.0) -> JobStats:
        """The figures of job `value` (a value of the node's job label, "job" by default): creates,
        stops, commands, steps, failures by cause with recent examples, OOM kills, verifications and
        rewards, over the last hour; its CPU and memory against quotas; its stuck (no request for
        `stuck_after` seconds) and slowest sandboxes."""
        return await self._model(JobStats, b.call_job(value, stuck_after))

    async def alerts(self) -> builtins.list[Alert]:
        """The alerts firing (on the node, or every node of a cluster, and its lost nodes)."""
        return (await self._model(AlertList, b.Call("GET", "/v1/alerts"))).alerts

    async def stop_many(
        self, labels: Mapping[str, str] | None = None, reason: str = "user", *, project: str | None = None
    ) -> builtins.list[str]:
        """Stop every live sandbox with these labels (and in `project` or under it); the ids stopped."""
        selected = b.selector(labels, project)
        call = b.Call("POST", "/v1/sandboxes/stop", json={"labels": selected, "reason": reason})
        return (await self._model(StopManyResult, call)).stopped

    async def pause_many(
        self, labels: Mapping[str, str] | None = None, *, project: str | None = None, timeout: float | None = None
    ) -> builtins.list[str]:
        """Pause every running sandbox with these labels (and in `project` or under it: a preempted
        trainer's whole job); the ids paused. Waits up to `timeout` seconds (default: the client's)."""
        call = b.call_labels("pause", b.selector(labels, project), b.check_timeout(timeout, self.timeout))
        return (await self._model(IdList, call)).sandboxes

    async def resume_many(
        self, labels: Mapping[str, str] | None = None, *, project: str | None = None, timeout: float | None = None
    ) -> builtins.list[str]:
        """Resume every paused sandbox with these labels (and in `project`); the ids resumed (`timeout`
        as `pause_many`)."""
        call = b.call_labels("resume", b.selector(labels, project), b.check_timeout(timeout, self.timeout))
        return (await self._model(IdList, call)).sandboxes

    async def set_network(
        self,
        labels: Mapping[str, str],
        network: NetworkPolicy | str | Sequence[str] | Mapping[str, bool],
        *,
        timeout: float | None = None,
    ) -> builtins.list[str]:
        """Give every running or paused sandbox with these labels the egress policy `network` (a
        job's next stage: open for setup, closed while the agent works); the ids changed."""
        call = b.call_set_network_many(labels, b.network_policy(network), b.check_timeout(timeout, self.timeout))
        return (await self._model(IdList, call)).sandboxes

    async def set_lifetimes(
        self,
        labels: Mapping[str, str],
        *,
        idle_ttl: float | None | Unset = UNSET,
        max_lifetime: float | None | Unset = UNSET,
        pause_after: float | None | Unset = UNSET,
    ) -> builtins.list[str]:
        """Change the idle TTL, max lifetime (seconds after creation) and/or idle seconds before a
        pause of every live sandbox with these labels; only the limits given change, None removes
        one. The ids changed."""
        call = b.call_set_lifetimes(labels, idle_ttl, max_lifetime, pause_after)
        return (await self._model(IdList, call)).sandboxes

    async def restore(
        self,
        snapshot_id: str,
        count: int = 1,
        labels: Mapping[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> builtins.list[AsyncSandbox | SandboxError]:
        """`count` new sandboxes from a snapshot (processes, memory, files); one result per child, in
        order. Works after the snapshot's sandbox stopped. A lost answer is retried with the same
        idempotency key (given, or a fresh one) within `timeout` (default: the client's)."""
        attempts = b.CreateAttempts(b.idempotency_key(idempotency_key))
        deadline = b.Deadline(b.check_timeout(timeout, self.timeout))
        reply = await self._retrying(
            lambda key, t: b.call_restore(snapshot_id, count, labels, key, t),
            CreateBatchResult,
            attempts,
            deadline,
            refusals=False,
        )
        return self._batch(reply)

    async def snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """The node's snapshots (of one sandbox, live or stopped, when `sandbox_id` is given)."""
        return (await self._model(SnapshotList, b.call_snapshots(sandbox_id))).snapshots

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self._send(b.Call("DELETE", b.snapshot_path(snapshot_id)))

    def _batch(self, reply: CreateBatchResult) -> builtins.list[AsyncSandbox | SandboxError]:
        return [
            AsyncSandbox(self._client, item.sandbox) if item.sandbox else b.item_error(item) for item in reply.results
        ]
