"""The cluster gateway: the node's HTTP API over many nodes, holding no state of its own.

Any number of gateways serve the same API (docs/openapi.json) a node does, so the SDK and every
client work unchanged. What a gateway does per call:
- a call naming a sandbox or snapshot goes to the node in its id (`sandfleet.ids`), passed on as it
  came (forward.py); a dead node's ids answer `sandbox_lost`;
- a create is placed (placement.py: filter, spill over node groups, power of two choices over loads
  about a second old plus this gateway's own recent placements), checked against the caller's
  project quotas (quotas.py: this gateway's share of each quota's headroom, no central call), and
  sent to the chosen node, which has the last word: a node that refuses (full, draining) is left
  out and the create placed again;
- a batch is placed at once (2m sampled nodes for m sandboxes) and sent as one batch per node;
- list and job-level calls (stop, pause, resume, lifetimes, network by label) go to every node
  with the caller's own credentials, and the answers are merged; a write that could not reach a
  node says which;
- trajectories go to the node of their sandbox, found once and remembered (per caller's project);
- a create's sandbox is acknowledged to its node once the caller has the answer (acks.py), so one
  whose answer was lost (this gateway died) is reaped by its node; a retried create (the SDK marks
  it) asks the nodes which holds its idempotency key and goes there, whichever gateway it reaches.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from sandfleet import __version__, console, route_cache
from sandfleet.cluster.core import error_answer, json_object, log
from sandfleet.cluster.fan_out import FanOut
from sandfleet.cluster.forward import call_json, forward, json_response
from sandfleet.cluster.membership import Node
from sandfleet.cluster.terminal import relay as relay_terminal
from sandfleet.cluster.trajectory_routing import TrajectoryRouting
from sandfleet.daemon.security.iam import Principal
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SandboxError,
    UnsupportedError,
)
from sandfleet.operations import OPERATIONS

# Operations of the node API a gateway does not pass on, and why (sandfleet/operations.py): each answers
# `unsupported` with its reason.
NODE_ONLY = {(method, op.path): op.why for op in OPERATIONS if op.gateway == "node_only" for method in op.methods}


class Gateway(TrajectoryRouting, FanOut):
    """A gateway: its creates and trajectories, its calls over every node (the mixins), and the rest here."""

    async def whoami(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        return json_response({"name": principal.name, "can_write": principal.can_write, "project": principal.project})

    async def sandbox_call(self, request: Request) -> Response:
        return await forward(self.membership.holder(request.path_params["sandbox_id"]), request)

    async def snapshot_call(self, request: Request) -> Response:
        return await forward(self.membership.holder(request.path_params["snapshot_id"], "snapshot"), request)

    # -- the cluster itself ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """The cluster's tiers and live sandboxes: all of them for a root token, the caller's
        projects' for a scoped one (what other projects run is theirs)."""
        principal: Principal = request.state.principal
        tiers: dict[str, list[str]] = {}
        running = 0
        for n in self.membership.nodes.values():
            if n.load is not None and not n.lost:
                if principal.project is None:
                    running += n.load.sandboxes
                else:
                    running += sum(u.sandboxes for p, u in n.load.projects.items() if principal.sees(p or None))
                for t in n.load.tiers:
                    tiers.setdefault(t, [])
        reachable = self.membership.reachable()
        if reachable:  # capabilities as a node reports them (every node runs the same build)
            try:
                h = await call_json(reachable[0], "GET", "/v1/health")
                tiers = {**tiers, **h.get("tiers", {})}
            except SandboxError:
                pass
        return json_response(
            {
                "status": "ok" if reachable else "degraded",
                "version": __version__,
                "sandboxes_running": running,
                "backends": sorted(tiers),
                "pools": {},
                "tiers": tiers,
            }
        )

    async def nodes(self, request: Request) -> Response:
        """Every node: for a root token, all the gateway knows (URL, generation, load); for a token
        scoped to a project, what it may use (status, group, labels, tiers, draining) and its own
        projects' usage: no node URL, no count of other projects' sandboxes, no node's image list."""
        principal: Principal = request.state.principal
        root = principal.project is None

        def entry(n: Node) -> dict[str, Any]:
            load = n.load.model_dump() if n.load is not None else None
            if load is not None:
                load["projects"] = {p: u for p, u in load["projects"].items() if root or principal.sees(p or None)}
            out = {"key": n.key, "group": n.group, "status": n.status}
            if root:
                age = round(time.monotonic() - n.load_at, 3) if n.load else None
                more = {"load": load, "load_age": age, "lost_at": n.lost_at, "placed": self.placer.placed[n.key]}
                return out | {"url": n.url, "generation": n.generation} | more
            shown = ("labels", "draining", "tiers", "projects")
            return out | {"load": {k: load[k] for k in shown} if load is not None else None}

        nodes = [entry(n) for n in sorted(self.membership.nodes.values(), key=lambda n: n.key)]
        projects = self.iam.uses(self.membership.project_usage())  # every project's quota, cluster-wide
        if not root:
            projects = [q for q in projects if principal.sees(q.project)]
        return json_response(
            {"nodes": nodes, "gateways": self.membership.gateways, "projects": [q.model_dump() for q in projects]}
        )

    async def drain(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        if principal.project is not None or principal.role != "admin":
            raise PermissionDeniedError("draining a node takes a root admin token")
        node = self.membership.nodes.get(request.path_params["key"])
        if node is None or node.lost:
            raise NotFoundError(f"node {request.path_params['key'][:16]} not in the cluster")
        body = await json_object(request)
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            raise InvalidArgumentError("draining must be true or false")
        data = await call_json(node, "POST", "/v1/node/drain", json_body={"draining": draining}, control=True)
        await self.membership.refresh()
        return json_response(data)

    async def node_only(self, request: Request) -> Response:
        why = NODE_ONLY.get((request.method, request.url.path), "")
        raise UnsupportedError(f"{request.method} {request.url.path} is not served by a gateway: {why}")

    async def prometheus(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        if principal.project is not None:
            raise PermissionDeniedError(f"token {principal.name} is scoped to a project: metrics need the root")
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def create_gateway_app(gw: Gateway) -> Starlette:
    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                request.state.principal = gw.iam.authenticate(request.headers.get("authorization", ""))
                return await handler(request)
            except SandboxError as exc:
                gw.metrics.errors.labels(code=exc.code).inc()
                return error_answer(exc)
            except Exception as exc:
                log.exception("unexpected error serving %s %s", request.method, request.url.path)
                gw.metrics.errors.labels(code="internal").inc()
                return error_answer(SandboxError(f"gateway error: {type(exc).__name__}"))

        return run

    # One route per declared operation, to the handler its declaration names (by default its scope's:
    # a call naming a sandbox goes to the node holding it); then the gateway's own.
    routes: list[BaseRoute] = []
    for op in OPERATIONS:
        handler = getattr(gw, op.gateway_handler, None) if op.gateway_handler else None
        if handler is None:
            raise RuntimeError(f"operation {op.name} has no gateway rule (sandfleet/operations.py: `gateway`)")
        routes.append(Route(op.path, guarded(handler), methods=list(op.methods)))
    routes += [
        Route("/v1/cluster/nodes", guarded(gw.nodes), methods=["GET"]),
        Route("/v1/cluster/nodes/{key:str}/drain", guarded(gw.drain), methods=["POST"]),
    ]

    async def terminal(ws: WebSocket) -> None:
        await relay_terminal(ws, gw.iam, gw.membership)

    routes += [
        WebSocketRoute("/v1/sandboxes/{sandbox_id:str}/terminal", terminal),
        *console.routes(),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return error_answer(NotFoundError("no such endpoint"))

    async def bad_method(request: Request, exc: Exception) -> Response:
        return error_answer(InvalidArgumentError("method not allowed on this endpoint"))

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})
    route_cache.install(app.router)
    app.state.gateway = gw
    return app
