"""Sandboxes: create (one, a batch), list, get, lifetimes, stop, pause, resume, usage, events."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from fastapi import APIRouter, BackgroundTasks, Body, Header, Query
from fastapi.responses import Response

from sandfleet.daemon.api.common import (
    MAX_INT64,
    Api,
    CheckedRoute,
    Forwarded,
    acked,
    batch_result,
    log,
    parse_labels,
)
from sandfleet.errors import (
    InvalidArgumentError,
)
from sandfleet.models import (
    CreateBatchRequest,
    CreateBatchResult,
    EventList,
    IdList,
    LabelsRequest,
    LifetimeManyRequest,
    LifetimeUpdate,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    SetLabelsRequest,
    StopManyRequest,
    StopManyResult,
    StopRequest,
    Usage,
    list_page,
)


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "create")
    async def create(
        spec: SandboxSpec,
        background: BackgroundTasks,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                max_length=128,
                pattern=r"^[A-Za-z0-9._:-]{1,128}$",
                description="a retried create with the same key returns the sandbox the first one made",
            ),
        ] = None,
        forwarded: Forwarded = None,
    ) -> SandboxInfo:
        info = await tenancy.create(spec, idempotency_key=idempotency_key)
        acked(node, background, [info.id], forwarded)
        return info

    @api.route(r, "create_batch")
    async def create_batch(
        req: CreateBatchRequest, background: BackgroundTasks, forwarded: Forwarded = None
    ) -> CreateBatchResult:
        results = await tenancy.create_batch(req.specs, req.concurrency, req.idempotency_keys)
        acked(node, background, [r.id for r in results if isinstance(r, SandboxInfo)], forwarded)
        return batch_result(results)

    @api.route(r, "list_sandboxes")
    async def list_sandboxes(
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
        state: Annotated[
            SandboxState | Literal["live", "all"] | None,
            Query(description="one state, `live` (the default: not stopped or failed) or `all`"),
        ] = None,
        limit: Annotated[
            int | None,
            Query(ge=1, le=10000, description="a page of at most this many, newest first (default: all, unordered)"),
        ] = None,
        after: Annotated[str | None, Query(max_length=80, description="the `next` cursor of the previous page")] = None,
    ) -> Response:
        found = await tenancy.list(parse_labels(label), state)
        tail = b""
        if limit is not None or after is not None:
            try:
                found, cursor, total = list_page(found, limit or 1000, after, _stamp)
            except ValueError as exc:
                raise InvalidArgumentError(str(exc)) from None
            tail = b',"next":' + (b"null" if cursor is None else json.dumps(cursor).encode())
            tail += b',"total":' + str(total).encode()
        # Each sandbox on its own: one that cannot be encoded is left out (and logged), never the
        # reason nobody can list.
        items = []
        for info in found:
            try:
                items.append(info.model_dump_json().encode())
            except (ValueError, UnicodeError):
                log.exception("sandbox %s cannot be listed", info.id)
        return Response(b'{"sandboxes":[' + b",".join(items) + b"]" + tail + b"}", media_type="application/json")

    @api.route(r, "update_lifetimes")
    async def update_lifetimes(req: LifetimeManyRequest) -> IdList:
        return IdList(sandboxes=await tenancy.update_lifetimes(req.labels, req.changes()))

    @api.route(r, "stop_many")
    async def stop_many(req: StopManyRequest) -> StopManyResult:
        if not req.labels:
            raise InvalidArgumentError("stop by labels needs at least one label")
        return StopManyResult(stopped=await tenancy.stop_many(req.labels, req.reason))

    @api.route(r, "pause_many")
    async def pause_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await tenancy.pause_many(req.labels))

    @api.route(r, "resume_many")
    async def resume_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await tenancy.resume_many(req.labels))

    @api.route(r, "usage")
    async def usage(sandbox_id: str) -> Usage:
        return await node.core.usage(sandbox_id)

    @api.route(r, "pause")
    async def pause(sandbox_id: str) -> SandboxInfo:
        return await node.pauser.pause(sandbox_id)

    @api.route(r, "resume")
    async def resume(sandbox_id: str) -> SandboxInfo:
        return await node.pauser.resume(sandbox_id)

    @api.route(r, "get")
    async def get(sandbox_id: str) -> SandboxInfo:
        return await node.core.get(sandbox_id)

    @api.route(r, "update_lifetime")
    async def update_lifetime(sandbox_id: str, req: LifetimeUpdate) -> SandboxInfo:
        return await node.core.update_lifetime(sandbox_id, req.changes())

    @api.route(r, "stop")
    async def stop(sandbox_id: str, req: Annotated[StopRequest | None, Body()] = None) -> SandboxInfo:
        return await node.core.stop(sandbox_id, reason=req.reason if req else "user")

    @api.route(r, "set_labels")
    async def set_labels(sandbox_id: str, req: SetLabelsRequest) -> SandboxInfo:
        return await node.core.set_labels(sandbox_id, req.labels)

    @api.route(r, "events")
    async def events(
        sandbox_id: str,
        after: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> EventList:
        return EventList(events=await node.core.events(sandbox_id, after, limit))

    return r


def _stamp(info: SandboxInfo) -> tuple[float, str]:
    return info.created_at, info.id
