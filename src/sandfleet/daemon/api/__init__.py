"""The HTTP API (FastAPI), one router per resource: parse, call the node's concern that does the
work, map errors to `{code, message, retryable, cause}`. Each route is an operation declared in
sandfleet/operations.py (`Api.route`), scoped to the caller's project by a dependency made from that
declaration when projects are configured (daemon/security/tenancy.py).

The OpenAPI document FastAPI derives from these routes is checked into docs/openapi.json; a test
fails when the two drift apart, and tests validate live responses against the checked-in copy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Router
from starlette.types import ASGIApp, Receive, Scope, Send

from sandfleet import __version__, console, route_cache
from sandfleet.daemon.api import (
    execs,
    files,
    fusion,
    images,
    jobs,
    network,
    rl,
    sandboxes,
    sessions,
    snapshots,
    terminal,
)
from sandfleet.daemon.api import node as node_api
from sandfleet.daemon.api.common import ERRORS, Api, CheckedRoute, error_response
from sandfleet.daemon.api.guard import CALLER, Auditor, Authenticate, Caller, Guard
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
)
from sandfleet.models import WhoAmI, validation_message

if TYPE_CHECKING:
    from sandfleet.daemon.security.tenancy import Tenancy
    from sandfleet.daemon.service import SandboxManager


def create_app(
    node: SandboxManager,
    tenancy: Tenancy,
    metrics: Metrics,
    *,
    auth: Authenticate | None = None,
    lean_routes: bool = True,
) -> FastAPI:
    """The HTTP API of a node: its concerns (`node`), and the calls that depend on the caller's project
    (`tenancy`: with `[iam]` projects, also the scoping of every route).

    `auth`: authenticates each request (its Authorization header, '' when none) before anything else
    (`Iam.enter`: tokens, the daemon's single `token`, projects); a caller that cannot write (a
    read-only token) may only GET (and HEAD): every other method is `permission_denied` (every POST,
    PUT, PATCH and DELETE of the API acts). None: no authentication (root's unix socket).

    `lean_routes`: the plain JSON operations (exec among them) answered without FastAPI's layers
    (daemon/api/lean.py); False: every call through FastAPI (what the lean answers are held to)."""
    app = FastAPI(
        title="sandfleet",
        version=__version__,
        responses=ERRORS,
        description="Elastic sandboxes for agentic RL: the node daemon's API.",
    )
    app.router.route_class = CheckedRoute

    @app.exception_handler(SandboxError)
    async def _sandbox_error(_req: Request, exc: SandboxError) -> JSONResponse:
        metrics.http_errors.labels(code=exc.code).inc()
        metrics.failures.labels(cause=exc.cause).inc()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.http_errors.labels(code="invalid_argument").inc()
        metrics.failures.labels(cause="caller").inc()
        return error_response(InvalidArgumentError(validation_message(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFoundError("no such endpoint"))
        if exc.status_code == 405:
            return error_response(InvalidArgumentError("method not allowed on this endpoint"))
        if 400 <= exc.status_code < 500:  # e.g. a body FastAPI could not parse
            return error_response(InvalidArgumentError(f"bad request: {exc.detail}"[:300]))
        return error_response(InternalError(str(exc.detail)[:300]))

    audit = Auditor(lambda actor, call: node.audit_call(actor, call), auth is not None)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, minus its default 422 responses: validation errors here are 400s."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    api = Api(node, tenancy)

    @api.route(app.router, "whoami", tags=["node"])
    async def whoami(request: Request) -> WhoAmI:
        """Who the credentials of this call stand for, and whether they may act (the console asks)."""
        caller: Caller | None = request.scope.get(CALLER)
        if caller is None:
            unix = request.client is None or not request.client.host
            return WhoAmI(name="root" if unix else "anonymous", can_write=True)
        return WhoAmI(name=caller.name, can_write=caller.can_write, project=getattr(caller, "project", None))

    for resource in (node_api, sandboxes, jobs, snapshots, execs, sessions, files, images, network, rl):
        app.include_router(resource.router(api))
    app.include_router(terminal.router(api, auth, audit))
    app.include_router(network.port_router(api))
    app.include_router(fusion.router(api))
    api.check_complete()
    # The console's files hold no data: served ahead of the API's middleware (no token: the page asks
    # for one, then calls the API with it; not audited), straight from memory.
    app.add_middleware(Guard, audit=audit, metrics=metrics, authenticate=auth)
    app.add_middleware(ConsoleFirst, console=Router(routes=console.routes()))
    # FastAPI builds an included router's routes on the first request that reaches them (~0.5 s for
    # the whole API here): matching a path no route has builds them all now, so a trainer's first
    # call after a daemon restart does not pay for it.
    probe = {"type": "http", "path": "/-", "method": "GET", "root_path": "", "headers": [], "query_string": b""}
    for route in app.router.routes:
        route.matches(probe)
    cache = route_cache.install(app.router)
    for method, path, make in api.lean if lean_routes else ():
        cache.ahead(method, path, make)
    return app


CONSOLE = "/console"  # the web console's page and files (sandfleet/console), served to anyone


class ConsoleFirst:
    """ASGI middleware, the outermost: `/console` and below go to the console's routes."""

    def __init__(self, app: ASGIApp, console: ASGIApp) -> None:
        self.app, self.console = app, console

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == CONSOLE or path.startswith(CONSOLE + "/")):
            await self.console(scope, receive, send)
        else:
            await self.app(scope, receive, send)
