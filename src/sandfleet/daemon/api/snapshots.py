"""Snapshots, restores, forks, checkpoints and pack."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, BackgroundTasks, Body, Query

from sandfleet.daemon.api.common import (
    Api,
    CheckedRoute,
    Forwarded,
    acked,
    batch_result,
    parse_labels,
)
from sandfleet.models import (
    CheckpointInfo,
    CheckpointList,
    CheckpointRequest,
    CreateBatchResult,
    ForkRequest,
    ImageInfo,
    Ok,
    PackRequest,
    RollbackRequest,
    RollbackResult,
    SandboxInfo,
    SnapshotInfo,
    SnapshotList,
    SnapshotRequest,
)


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "snapshot")
    async def snapshot(sandbox_id: str, req: Annotated[SnapshotRequest | None, Body()] = None) -> SnapshotInfo:
        req = req or SnapshotRequest()
        return await node.snapshots.snapshot(sandbox_id, ttl=req.ttl, labels=req.labels)

    @api.route(r, "fork")
    async def fork(
        sandbox_id: str,
        background: BackgroundTasks,
        req: Annotated[ForkRequest | None, Body()] = None,
        forwarded: Forwarded = None,
    ) -> CreateBatchResult:
        req = req or ForkRequest()
        results = await tenancy.fork(sandbox_id, req.count, req.labels, idempotency_key=req.idempotency_key)
        acked(node, background, [r.id for r in results if isinstance(r, SandboxInfo)], forwarded)
        return batch_result(results)

    @api.route(r, "checkpoint")
    async def checkpoint(sandbox_id: str, req: Annotated[CheckpointRequest | None, Body()] = None) -> CheckpointInfo:
        return await node.checkpoints.checkpoint(sandbox_id, (req or CheckpointRequest()).labels)

    @api.route(r, "list_checkpoints")
    async def list_checkpoints(sandbox_id: str) -> CheckpointList:
        return CheckpointList(checkpoints=await node.checkpoints.list_checkpoints(sandbox_id))

    @api.route(r, "delete_checkpoint")
    async def delete_checkpoint(sandbox_id: str, checkpoint_id: str) -> Ok:
        await node.checkpoints.delete_checkpoint(sandbox_id, checkpoint_id)
        return Ok()

    @api.route(r, "rollback")
    async def rollback(sandbox_id: str, req: RollbackRequest) -> RollbackResult:
        return await node.checkpoints.rollback(sandbox_id, req.checkpoint_id)

    @api.route(r, "pack")
    async def pack(sandbox_id: str, req: PackRequest) -> ImageInfo:
        return await node.snapshots.pack(sandbox_id, req.image, req.exclude)

    @api.route(r, "list_snapshots")
    async def list_snapshots(
        sandbox_id: str | None = None,
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
    ) -> SnapshotList:
        return SnapshotList(snapshots=await tenancy.list_snapshots(sandbox_id, parse_labels(label)))

    @api.route(r, "get_snapshot")
    async def get_snapshot(snapshot_id: str) -> SnapshotInfo:
        return await node.snapshots.get_snapshot(snapshot_id)

    @api.route(r, "delete_snapshot")
    async def delete_snapshot(snapshot_id: str) -> Ok:
        await node.snapshots.delete_snapshot(snapshot_id)
        return Ok()

    @api.route(r, "restore")
    async def restore(
        snapshot_id: str,
        background: BackgroundTasks,
        req: Annotated[ForkRequest | None, Body()] = None,
        forwarded: Forwarded = None,
    ) -> CreateBatchResult:
        req = req or ForkRequest()
        results = await tenancy.restore(snapshot_id, req.count, req.labels, idempotency_key=req.idempotency_key)
        acked(node, background, [r.id for r in results if isinstance(r, SandboxInfo)], forwarded)
        return batch_result(results)

    return r
