"""The node: health (with each tier's capabilities), Prometheus metrics, and what cluster mode
reads and sets of it (load, drain, fence; creates its gateways acknowledge; idempotency keys)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from sandfleet.daemon.api.common import (
    CheckedRoute,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    AckRequest,
    DrainRequest,
    FenceRequest,
    Health,
    KeysHeld,
    KeysRequest,
    NodeLoad,
    Ok,
)


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.get("/v1/health", response_model=Health)
    async def health() -> Health:
        return await service.health()

    @r.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        body, media_type = await service.metrics_text()
        return Response(body, media_type=media_type)

    @r.get("/v1/node/load", response_model=NodeLoad)
    async def load() -> NodeLoad:
        """What cluster placement and quotas read of this node (its gateways poll it)."""
        return await service.node_load()

    @r.post("/v1/node/drain", response_model=NodeLoad)
    async def drain(req: DrainRequest) -> NodeLoad:
        """Take no new creates (or take them again); what the node holds keeps running."""
        return await service.drain(req.draining)

    @r.post("/v1/node/fence", response_model=NodeLoad)
    async def fence(req: FenceRequest) -> NodeLoad:
        """Serve under a new generation: above the node's own, every sandbox it holds is stopped first
        (`sandfleet cluster up` fences a node the cluster declared lost before it rejoins)."""
        return await service.fence(req.generation)

    @r.post("/v1/sandboxes/ack", response_model=Ok)
    async def ack(req: AckRequest) -> Ok:
        """These sandboxes' create answers reached their callers (a gateway says so of the creates it
        passed on): they are no longer stopped as creates nobody heard of."""
        await service.ack(req.sandboxes)
        return Ok()

    @r.post("/v1/sandboxes/keys", response_model=KeysHeld)
    async def keys(req: KeysRequest) -> KeysHeld:
        """Which of these idempotency keys (each in its project) made or is making a sandbox here."""
        return KeysHeld(held=await service.held_keys([(k.project, k.key) for k in req.keys]))

    return r
