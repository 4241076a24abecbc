"""The route cache (route_cache.py) picks the route the router would, for every declared operation of
the node's API and of the gateway's, asked once and again; misses (404, 405) go to the router; what a
caller sends cannot grow it."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.routing import BaseRoute, Match, Router

from sandfleet import route_cache
from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.gateway import Gateway, create_gateway_app
from sandfleet.daemon.api import create_app
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.operations import OPERATIONS

pytestmark = pytest.mark.unit


class _Nothing:
    """Stands for the node's concerns: routing never touches them."""

    def __getattr__(self, name: str) -> Any:
        return None


def _scope(method: str, path: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "root_path": "", "headers": [], "query_string": b""}


def _routers_way(router: Router, scope: dict[str, Any]) -> BaseRoute | None:
    for route in router.routes:
        if route.matches(scope)[0] is Match.FULL:
            return route
    return None


def _calls() -> list[tuple[str, str]]:
    out = []
    for op in OPERATIONS:
        path = op.path
        while "{" in path:
            start, end = path.index("{"), path.index("}")
            path = (
                path[:start]
                + ("a/b.txt" if ":path}" in path[start : end + 1] else "sb-0123456789abcdef")
                + path[end + 1 :]
            )
        out += [(method, path) for method in op.methods]
    return out


@pytest.mark.parametrize("which", ["node", "gateway"])
def test_every_operation_goes_to_the_route_the_router_picks(which: str) -> None:
    if which == "node":
        app = create_app(_Nothing(), _Nothing(), Metrics())  # type: ignore[arg-type]
    else:
        config = GatewayConfig(nodes=[{"key": "abcdef", "url": "http://127.0.0.1:9"}], node_token="n", token="t")
        app = create_gateway_app(Gateway(config))
    cache = app.router.middleware_stack
    assert isinstance(cache, route_cache.RouteCache)
    calls = _calls()
    assert len(calls) > 50
    for _ in range(2):  # asked, then remembered
        for method, path in calls:
            scope = _scope(method, path)
            assert cache.find(scope) is _routers_way(app.router, scope), (method, path)
    assert cache.find(_scope("GET", "/v1/no-such-thing")) is None  # the router answers 404
    assert cache.find(_scope("DELETE", "/v1/whoami")) is None  # and 405
    # every sandbox's exec is one key: a node's thousands of sandboxes do not push the rest out
    seen = len(cache._seen)
    for i in range(100):
        scope = _scope("POST", f"/v1/sandboxes/sb-{i:016x}/exec")
        assert cache.find(scope) is _routers_way(app.router, scope)
    assert len(cache._seen) <= seen + 1
    for i in range(route_cache.SIZE + 10):  # paths that are not ids: each its own key, the oldest go
        cache.find(_scope("POST", f"/v1/sandboxes/x{i}/exec"))
    assert len(cache._seen) == route_cache.SIZE
    cache.find(_scope("POST", "/v1/sandboxes/x" + "0" * 300 + "/exec"))
    assert not [k for k in cache._seen if len(k[1]) > route_cache.LONGEST]


def test_a_router_with_middleware_of_its_own_is_refused() -> None:
    from starlette.middleware import Middleware
    from starlette.middleware.gzip import GZipMiddleware

    with pytest.raises(ValueError, match="middleware"):
        route_cache.install(Router(routes=[], middleware=[Middleware(GZipMiddleware)]))


def test_calls_are_answered_the_same_asked_and_remembered() -> None:
    """Through the node's whole ASGI app: a remembered route is dispatched by the router's own code
    (FastAPI's, over that route alone), and misses answer as the router does."""
    import asyncio

    import httpx

    app = create_app(_Nothing(), _Nothing(), Metrics())  # type: ignore[arg-type]

    async def main() -> list[tuple[int, str]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            out = []
            for method, path in [("GET", "/v1/whoami")] * 3 + [("GET", "/v1/nothing"), ("DELETE", "/v1/whoami")]:
                r = await client.request(method, path)
                out.append((r.status_code, r.json().get("name") or r.json()["error"]["code"]))
            return out

    assert asyncio.run(main()) == [(200, "anonymous")] * 3 + [(404, "not_found"), (400, "invalid_argument")]
    assert len(app.router.middleware_stack._seen) == 1
