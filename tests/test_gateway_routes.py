"""Every operation of the node API (docs/openapi.json) has its rule in the cluster gateway.

Without Ray or a node: the gateway's Starlette routes are matched against each operation, its path
parameters filled with marked values. An operation is served when a route of the same shape takes it:
each id the route reads (`sandbox_id`, `snapshot_id`, `trajectory_id`) comes from a parameter of the
operation, never from a literal segment (a new `POST /v1/sandboxes/foo` would otherwise be passed on as
a call on sandbox "foo"). The gateway's routes are made from the operations' declarations
(sandfleet/operations.py): one a gateway does not pass on says why (`gateway.NODE_ONLY`), and one
declared without a gateway rule stops the gateway from being made.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from starlette.routing import Match, Route

from sandfleet.cluster import gateway
from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.gateway import NODE_ONLY, Gateway, create_gateway_app
from sandfleet.operations import OPERATIONS as DECLARED
from sandfleet.operations import Operation

pytestmark = pytest.mark.unit

SPEC = json.loads((Path(__file__).resolve().parent.parent / "docs" / "openapi.json").read_text())
METHODS = ("get", "post", "put", "patch", "delete")
OPERATIONS = sorted((m.upper(), path) for path, ops in SPEC["paths"].items() for m in ops if m in METHODS)
IDS = ("sandbox_id", "snapshot_id", "trajectory_id", "key")


def _gateway() -> Gateway:
    return Gateway(GatewayConfig(nodes=[{"key": "abcdef", "url": "http://127.0.0.1:9"}], node_token="n", token="t"))


def _route_of(app: object, method: str, path: str) -> tuple[Route, dict[str, object]]:
    scope = {"type": "http", "path": path, "method": method, "root_path": ""}
    for route in app.routes:  # type: ignore[attr-defined]
        match, child = route.matches(scope)
        if match == Match.FULL:
            return route, child.get("path_params", {})
    raise LookupError(f"{method} {path}: no gateway route")


def _filled(path: str) -> tuple[str, set[str]]:
    """The path with each parameter a marked value; the values."""
    values: set[str] = set()

    def fill(m: re.Match[str]) -> str:
        value = "8080" if m.group(1) == "port" else f"p{len(values)}x"
        values.add(value)
        return value

    return re.sub(r"\{([^}]+)\}", fill, path), values


def test_every_operation_has_a_gateway_route_of_its_shape_or_a_reason_not_to() -> None:
    app = create_gateway_app(_gateway())
    problems = []
    for method, path in OPERATIONS:
        concrete, values = _filled(path)
        try:
            route, params = _route_of(app, method, concrete)
        except LookupError as exc:
            problems.append(str(exc))
            continue
        if (method, path) in NODE_ONLY:
            if route.path != path:
                problems.append(f"{method} {path} is node-only but routed as {route.path}")
            continue
        literal = {k: v for k, v in params.items() if k in IDS and v not in values}
        if literal:
            problems.append(f"{method} {path} is taken by {route.path} as a call on {literal}")
    assert not problems, "\n".join(problems)


def test_node_only_names_operations_that_exist() -> None:
    assert set(NODE_ONLY) <= set(OPERATIONS), set(NODE_ONLY) - set(OPERATIONS)
    assert all(why.strip() for why in NODE_ONLY.values())


async def test_a_node_only_operation_answers_unsupported_with_its_reason() -> None:
    app = create_gateway_app(_gateway())
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        for (method, path), why in NODE_ONLY.items():
            r = await http.request(method, path, headers={"authorization": "Bearer t"}, json={})
            error = r.json()["error"]
            assert (r.status_code, error["code"]) == (400, "unsupported"), (method, path, r.text)
            assert why in error["message"]


def test_an_operation_declared_without_a_gateway_rule_stops_the_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    new = Operation("count_things", ("POST",), "/v1/things/count", "fanned_out", "write")
    monkeypatch.setattr(gateway, "OPERATIONS", (*DECLARED, new))
    with pytest.raises(RuntimeError, match="count_things has no gateway rule"):
        create_gateway_app(_gateway())
    # A call on a sandbox is routed by its scope: to the node holding the sandbox.
    on_sandbox = Operation("count_files", ("GET",), "/v1/sandboxes/{sandbox_id}/files/count", "sandbox", "read")
    monkeypatch.setattr(gateway, "OPERATIONS", (*DECLARED, on_sandbox))
    route, params = _route_of(create_gateway_app(_gateway()), "GET", "/v1/sandboxes/sb-1/files/count")
    assert params == {"sandbox_id": "sb-1"} and route.path == on_sandbox.path
