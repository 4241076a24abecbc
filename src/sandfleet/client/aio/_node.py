"""The client's calls on the node: health, load, drain, fence, stateless calls (`run_code`), audit."""

from __future__ import annotations

import builtins
from collections.abc import AsyncGenerator, Mapping, Sequence
from typing import Any, Literal

from sandfleet.client import _base as b
from sandfleet.client.aio._http import AsyncEventStream, _AsyncCalls
from sandfleet.errors import SandboxError
from sandfleet.models import AuditList, AuditRecord, DrainRequest, ExecResult, FenceRequest, NodeLoad, Resources

# async-only: begin
# isort: split
from sandfleet.client._batch import CallBatcher

# async-only: end


class _Node(_AsyncCalls):
    # async-only: begin
    _batcher: CallBatcher | None

    # async-only: end
    async def health(self) -> dict[str, Any]:
        import json

        result: dict[str, Any] = json.loads(await self._send(b.Call("GET", "/v1/health")))
        return result

    async def node_load(self) -> NodeLoad:
        """What cluster placement and quotas read of the node: its load, per-project usage, drain state."""
        return NodeLoad.model_validate_json(await self._send(b.Call("GET", "/v1/node/load")))

    async def drain(self, draining: bool = True) -> NodeLoad:
        """Take no new creates on this node (False: take them again); what it holds keeps running."""
        body = DrainRequest(draining=draining).model_dump()
        return NodeLoad.model_validate_json(await self._send(b.Call("POST", "/v1/node/drain", json=body)))

    async def fence(self, generation: int, *, timeout: float = 600.0) -> NodeLoad:
        """Cluster mode (`sandfleet cluster up` calls it): serve under `generation`; one above the
        node's own first stops every sandbox the node holds (the cluster declared the node lost)."""
        body = b.validated(FenceRequest, "fence request", {"generation": generation}).model_dump()
        call = b.Call("POST", "/v1/node/fence", json=body, timeout=b.check_timeout(timeout, 0))
        return NodeLoad.model_validate_json(await self._send(call))

    async def tiers(self) -> dict[str, builtins.list[str]]:
        """The isolation tiers the node runs, each with its capabilities (`pause`, `snapshot`, ...)."""
        tiers: dict[str, builtins.list[str]] = (await self.health()).get("tiers", {})
        return tiers

    async def run_code(
        self,
        code: str,
        *,
        language: Literal["python", "bash"] = "python",
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        output_limit: int | None = None,
        binary: bool = False,
        image: str | None = None,
        resources: Resources | None = None,
    ) -> ExecResult:
        """Run `code` as one stateless call on a pooled worker of the fncall tier: a fresh process
        forked from a warm interpreter (`image`, default the node's python image; `resources`: each
        worker's limits), in a scratch directory of its own holding `files` (relative paths), as an
        unprivileged user, with no network. Nothing it writes, leaves running or changes in memory
        is seen by the next call. Returns the same `ExecResult` as `exec`."""
        body = b.run_code_body(
            code,
            b.CommandOptions(stdin=stdin, env=env, timeout=timeout, output_limit=output_limit, binary=binary),
            language=language,
            files=files,
            image=image,
            resources=resources,
        )
        return await self._run_pooled(body)

    async def _run_one(self, body: dict[str, Any]) -> ExecResult:
        return await self._model(ExecResult, b.call_run_code(None, body, self.timeout))

    # async-only: begin
    async def _run_pooled(self, body: dict[str, Any]) -> ExecResult:
        """Calls made at the same time go to the daemon as one batch (client/_batch.py)."""
        if self._batcher is None:
            self._batcher = CallBatcher(self._run_one, self._run_batch)
        return await self._batcher.submit(body)

    async def _run_batch(
        self, bodies: builtins.list[dict[str, Any]]
    ) -> AsyncGenerator[tuple[int, ExecResult | SandboxError], None]:
        async with self._events(b.call_run_batch(bodies, self.timeout), b.run_batch_item) as outcomes:
            async for outcome in outcomes:
                yield outcome

    # async-only: end

    async def audit(
        self,
        *,
        since: int = 0,
        since_time: float | None = None,
        kinds: Sequence[str] | None = None,
        sandbox_id: str | None = None,
        limit: int = 1000,
        newest: bool = False,
    ) -> AuditList:
        """The node's audit records after seq `since` (API calls, connections allowed and refused,
        limits hit, detector findings), oldest first; `last_seq` is where to go on from. `newest`:
        the last `limit` of them (still oldest first) instead of the first."""
        query = b.audit_query(since, since_time, kinds, sandbox_id, limit, newest)
        return await self._model(AuditList, b.call_audit(query, follow=False))

    def follow_audit(
        self,
        *,
        since: int = 0,
        since_time: float | None = None,
        kinds: Sequence[str] | None = None,
        sandbox_id: str | None = None,
    ) -> AsyncEventStream[AuditRecord]:
        """The records `audit()` gives, then each new one as it is recorded, until closed."""
        query = b.audit_query(since, since_time, kinds, sandbox_id, 1000)
        return self._events(b.call_audit(query, follow=True), b.audit_record)
