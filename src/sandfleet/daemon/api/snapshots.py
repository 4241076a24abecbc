"""Snapshots, restores, forks and pack."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Body, Query

from sandfleet.daemon.api.common import (
    CheckedRoute,
    Forwarded,
    acked,
    batch_result,
    parse_labels,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    CreateBatchResult,
    ForkRequest,
    ImageInfo,
    Ok,
    PackRequest,
    SandboxInfo,
    SnapshotInfo,
    SnapshotList,
    SnapshotRequest,
)


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.post("/v1/sandboxes/{sandbox_id}/snapshots", response_model=SnapshotInfo, status_code=201)
    async def snapshot(sandbox_id: str, req: Annotated[SnapshotRequest | None, Body()] = None) -> SnapshotInfo:
        req = req or SnapshotRequest()
        return await service.snapshot(sandbox_id, ttl=req.ttl, labels=req.labels)

    @r.post("/v1/sandboxes/{sandbox_id}/fork", response_model=CreateBatchResult)
    async def fork(
        sandbox_id: str,
        background: BackgroundTasks,
        req: Annotated[ForkRequest | None, Body()] = None,
        forwarded: Forwarded = None,
    ) -> CreateBatchResult:
        req = req or ForkRequest()
        results = await service.fork(sandbox_id, req.count, req.labels, idempotency_key=req.idempotency_key)
        acked(service, background, [r.id for r in results if isinstance(r, SandboxInfo)], forwarded)
        return batch_result(results)

    @r.post("/v1/sandboxes/{sandbox_id}/pack", response_model=ImageInfo, status_code=201)
    async def pack(sandbox_id: str, req: PackRequest) -> ImageInfo:
        return await service.pack(sandbox_id, req.image, req.exclude)

    @r.get("/v1/snapshots", response_model=SnapshotList)
    async def list_snapshots(
        sandbox_id: str | None = None,
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
    ) -> SnapshotList:
        return SnapshotList(snapshots=await service.list_snapshots(sandbox_id, parse_labels(label)))

    @r.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotInfo)
    async def get_snapshot(snapshot_id: str) -> SnapshotInfo:
        return await service.get_snapshot(snapshot_id)

    @r.delete("/v1/snapshots/{snapshot_id}", response_model=Ok)
    async def delete_snapshot(snapshot_id: str) -> Ok:
        await service.delete_snapshot(snapshot_id)
        return Ok()

    @r.post("/v1/snapshots/{snapshot_id}/restore", response_model=CreateBatchResult)
    async def restore(
        snapshot_id: str,
        background: BackgroundTasks,
        req: Annotated[ForkRequest | None, Body()] = None,
        forwarded: Forwarded = None,
    ) -> CreateBatchResult:
        req = req or ForkRequest()
        results = await service.restore(snapshot_id, req.count, req.labels, idempotency_key=req.idempotency_key)
        acked(service, background, [r.id for r in results if isinstance(r, SandboxInfo)], forwarded)
        return batch_result(results)

    return r
