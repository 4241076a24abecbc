"""The node: health (with each tier's capabilities), Prometheus metrics, and what cluster mode
reads and sets of it (load, drain, fence; creates its gateways acknowledge; idempotency keys)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from sandfleet.daemon.api.common import (
    Api,
    CheckedRoute,
)
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


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "health")
    async def health() -> Health:
        return await tenancy.health()

    @api.route(r, "prometheus", response_class=Response)
    async def prometheus() -> Response:
        body, media_type = await node.metrics_text()
        return Response(body, media_type=media_type)

    @api.route(r, "load")
    async def load() -> NodeLoad:
        """What cluster placement and quotas read of this node (its gateways poll it)."""
        return await node.node_load()

    @api.route(r, "drain")
    async def drain(req: DrainRequest) -> NodeLoad:
        """Take no new creates (or take them again); what the node holds keeps running."""
        return await node.drain(req.draining)

    @api.route(r, "fence")
    async def fence(req: FenceRequest) -> NodeLoad:
        """Serve under a new generation: above the node's own, every sandbox it holds is stopped first
        (`sandfleet cluster up` fences a node the cluster declared lost before it rejoins)."""
        return await node.fence(req.generation)

    @api.route(r, "ack")
    async def ack(req: AckRequest) -> Ok:
        """These sandboxes' create answers reached their callers (a gateway says so of the creates it
        passed on): they are no longer stopped as creates nobody heard of."""
        await tenancy.ack(req.sandboxes)
        return Ok()

    @api.route(r, "keys")
    async def keys(req: KeysRequest) -> KeysHeld:
        """Which of these idempotency keys (each in its project) made or is making a sandbox here."""
        return KeysHeld(held=await tenancy.held_keys([(k.project, k.key) for k in req.keys]))

    return r
