"""The node: health (with each tier's capabilities), Prometheus metrics, and what cluster mode
reads and sets of it (load, drain)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from sandfleet.daemon.api.common import (
    CheckedRoute,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    DrainRequest,
    Health,
    NodeLoad,
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

    return r
