"""Sandboxes: create (one, a batch), list, get, lifetimes, stop, pause, resume, usage, events."""

from __future__ import annotations

import collections
import json
from typing import Annotated, Literal

from fastapi import APIRouter, BackgroundTasks, Body, Header, Query
from fastapi.responses import Response

from sandfleet.daemon.api.common import (
    MAX_INT64,
    CheckedRoute,
    Forwarded,
    acked,
    batch_result,
    log,
    parse_labels,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.errors import (
    InvalidArgumentError,
)
from sandfleet.models import (
    LABEL_KEY,
    CreateBatchRequest,
    CreateBatchResult,
    EventList,
    IdList,
    JobGroup,
    JobList,
    LabelsRequest,
    LifetimeManyRequest,
    LifetimeUpdate,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
    SandboxState,
    StopManyRequest,
    StopManyResult,
    StopRequest,
    Usage,
    list_page,
    shown,
)


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.post("/v1/sandboxes", response_model=SandboxInfo, status_code=201)
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
        info = await service.create(spec, idempotency_key=idempotency_key)
        acked(service, background, [info.id], forwarded)
        return info

    @r.post("/v1/sandboxes/batch", response_model=CreateBatchResult)
    async def create_batch(
        req: CreateBatchRequest, background: BackgroundTasks, forwarded: Forwarded = None
    ) -> CreateBatchResult:
        results = await service.create_batch(req.specs, req.concurrency, req.idempotency_keys)
        acked(service, background, [r.id for r in results if isinstance(r, SandboxInfo)], forwarded)
        return batch_result(results)

    @r.get("/v1/sandboxes", response_model=SandboxList)
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
        found = await service.list(parse_labels(label), state)
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

    @r.get("/v1/jobs", response_model=JobList)
    async def jobs(
        key: Annotated[str, Query(max_length=63, description="the label whose values group sandboxes")] = "job",
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
        state: Annotated[
            SandboxState | Literal["live", "all"] | None,
            Query(description="one state, `live` (the default) or `all`"),
        ] = None,
    ) -> JobList:
        """Sandboxes grouped by the value of label `key`, counted by state (the console's jobs page:
        counts of thousands of sandboxes without sending them)."""
        if not LABEL_KEY.match(key):
            raise InvalidArgumentError(f"key: {shown(key)} is not a label key")
        return group_by_label(await service.list(parse_labels(label), state), key)

    @r.post("/v1/sandboxes/lifetimes", response_model=IdList)
    async def update_lifetimes(req: LifetimeManyRequest) -> IdList:
        fields = {k: getattr(req, k) for k in req.model_fields_set & {"idle_ttl", "max_lifetime"}}
        return IdList(sandboxes=await service.update_lifetimes(req.labels, fields))

    @r.post("/v1/sandboxes/stop", response_model=StopManyResult)
    async def stop_many(req: StopManyRequest) -> StopManyResult:
        if not req.labels:
            raise InvalidArgumentError("stop by labels needs at least one label")
        return StopManyResult(stopped=await service.stop_many(req.labels, req.reason))

    @r.post("/v1/sandboxes/pause", response_model=IdList)
    async def pause_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await service.pause_many(req.labels))

    @r.post("/v1/sandboxes/resume", response_model=IdList)
    async def resume_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await service.resume_many(req.labels))

    @r.get("/v1/sandboxes/{sandbox_id}/usage", response_model=Usage)
    async def usage(sandbox_id: str) -> Usage:
        return await service.usage(sandbox_id)

    @r.post("/v1/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
    async def pause(sandbox_id: str) -> SandboxInfo:
        return await service.pause(sandbox_id)

    @r.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
    async def resume(sandbox_id: str) -> SandboxInfo:
        return await service.resume(sandbox_id)

    @r.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def get(sandbox_id: str) -> SandboxInfo:
        return await service.get(sandbox_id)

    @r.patch("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def update_lifetime(sandbox_id: str, req: LifetimeUpdate) -> SandboxInfo:
        fields = {k: getattr(req, k) for k in req.model_fields_set & {"idle_ttl", "max_lifetime"}}
        return await service.update_lifetime(sandbox_id, fields)

    @r.delete("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def stop(sandbox_id: str, req: Annotated[StopRequest | None, Body()] = None) -> SandboxInfo:
        return await service.stop(sandbox_id, reason=req.reason if req else "user")

    @r.get("/v1/sandboxes/{sandbox_id}/events", response_model=EventList)
    async def events(
        sandbox_id: str,
        after: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> EventList:
        return EventList(events=await service.events(sandbox_id, after, limit))

    return r


def _stamp(info: SandboxInfo) -> tuple[float, str]:
    return info.created_at, info.id


def group_by_label(infos: list[SandboxInfo], key: str) -> JobList:
    groups: dict[str | None, collections.Counter[str]] = {}
    for info in infos:
        groups.setdefault(info.spec.labels.get(key), collections.Counter())[info.state] += 1
    jobs = [
        JobGroup(value=value, count=sum(states.values()), states=dict(states))
        for value, states in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
    ]
    return JobList(key=key, jobs=jobs, total=len(infos))
