"""The node: health (with each tier's capabilities) and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from sandfleet.daemon.api.common import (
    CheckedRoute,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    Health,
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

    return r
