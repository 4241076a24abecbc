"""The lean answers (daemon/api/lean.py) are FastAPI's answers: for every operation served lean, good
and bad bodies get what the same node says with every call through FastAPI (`lean_routes=False`),
status and body; the lean path is the one that answered; and what lean cannot do as FastAPI would
goes to the router."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandfleet.daemon.api import create_app, lean
from sandfleet.operations import OPERATIONS
from sandfleet.route_cache import RouteCache
from sandfleet.testing import InProcessNode

pytestmark = pytest.mark.unit

# Fields that differ between two runs of the same call (timings, ids made per call).
VOLATILE = {"duration_ms", "started_at", "finished_at", "created_at", "id", "pid", "at", "elapsed_ms"}


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[InProcessNode]:
    async with InProcessNode(tmp_path, max_sandboxes=8) as n:
        yield n


def _apps(node: InProcessNode) -> tuple[httpx.AsyncClient, httpx.AsyncClient, dict[str, int]]:
    """(lean, routed) clients of one node, and how many calls each lean answer took itself."""
    routed = create_app(node.service, node.tenancy, node.metrics, lean_routes=False)
    cache = node.app.router.middleware_stack
    assert isinstance(cache, RouteCache)
    answered: dict[str, int] = {}

    def counting(app: Any, key: str) -> Callable[..., Awaitable[None]]:
        async def counted(scope: Any, receive: Any, send: Any) -> None:
            answered[key] = answered.get(key, 0) + 1
            await app(scope, receive, send)

        return counted

    for entries in cache._ahead.values():
        entries[:] = [(regex, convertors, counting(app, regex.pattern)) for regex, convertors, app in entries]
    mk = lambda app: httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")  # noqa: E731
    return mk(node.app), mk(routed), answered


def _body(r: httpx.Response) -> Any:
    """A JSON answer, or an ndjson stream's lines (heartbeats aside)."""
    if "ndjson" in r.headers["content-type"]:
        lines = [json.loads(line) for line in r.content.splitlines()]
        return [line for line in lines if line.get("type") != "heartbeat"]
    return json.loads(r.content)


def _same(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        return {k: None if k in VOLATILE else _same(a[k], b[k]) for k in a}
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b)
        return [_same(x, y) for x, y in zip(a, b, strict=True)]
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float))  # (seconds taken)
        return None
    assert a == b
    return a


BAD_BODIES: list[tuple[str, bytes, str]] = [
    ("empty", b"", "application/json"),
    ("not json", b"{nope", "application/json"),
    ("a list", b"[]", "application/json"),
    ("no fields", b"{}", "application/json"),
    ("wrong types", b'{"command": 5, "timeout": "soon", "labels": 3, "ids": 7, "pids": "x"}', "application/json"),
    ("an unknown field", b'{"command": "true", "no_such_field": 1}', "application/json"),
    ("a lone surrogate", b'{"command": "echo \\ud800"}', "application/json"),
    ("not UTF-8", b'{"command": "echo \xff"}', "application/json"),
    ("JSON with a charset", b'{"command": "true"}', "application/json; charset=utf-8"),
    ("JSON in capitals", b'{"command": "echo \\ud800"}', "Application/JSON"),
    ("a JSON type of its own", b'{"command": "echo \\ud800"}', "application/vnd.sandfleet+json"),
    ("nested past Python's recursion", b"[" * 100_000, "application/json"),
    ("not said to be JSON", b'{"command": "true"}', "text/plain"),
]


# A body each operation takes (a command otherwise); what it then does may still fail (the fake tier).
GOOD = {
    "run_code": b'{"code": "print(1)"}',
    "run_code_in": b'{"code": "print(1)"}',
    "run_code_many": b'{"calls": [{"code": "print(1)"}]}',  # (one: the lines come as calls end)
    "ack": b'{"sandboxes": []}',
    "keys": b'{"keys": ["k-1"]}',
    "update_lifetimes": b'{"labels": {"t": "none"}, "ttl": 60}',
    "resume_many": b'{"labels": {"t": "none"}}',
    "set_network_many": b'{"labels": {"t": "none"}, "network": {"mode": "none"}}',
    "rollback": b'{"checkpoint_id": "cp-0"}',
    "pack": b'{"image": "packed"}',
    "expose": b'{"port": 8000}',
    "open_trajectory": b'{"id": "tr-lean"}',
}


async def test_every_lean_operation_answers_as_fastapi_does(node: InProcessNode) -> None:
    lean_client, routed_client, answered = _apps(node)
    async with lean_client, routed_client:
        made = await routed_client.post("/v1/sandboxes", json={"image": "busybox", "labels": {"t": "lean"}})
        assert made.status_code in (200, 201), made.text
        sandbox = made.json()["id"]
        served = {(m, p) for m, p, _ in _lean_routes(node)}
        assert {("POST", "/v1/sandboxes/{sandbox_id}/exec"), ("POST", "/v1/run"), ("POST", "/v1/run/batch")} <= served
        assert ("POST", "/v1/sandboxes/{sandbox_id}/exec/stream") in served
        ops = [op for op in OPERATIONS if (op.methods[0], op.path) in served]
        assert len(ops) == len(served)
        for op in ops:
            if op.name in ("drain", "fence", "stop_many", "pause_many", "import_image", "build_recipe"):
                bodies = BAD_BODIES  # (a good one changes the node for the calls after it)
            else:
                bodies = [*BAD_BODIES, ("good", GOOD.get(op.name, b'{"command": "echo hi"}'), "application/json")]
            # a sandbox, one that does not exist, and ids the route's own limits refuse
            for sid, other in ((sandbox, "tr-0"), ("sb-0000000000000000", "bad..!id"), (sandbox, "x" * 200)):
                path = op.path_of(sandbox_id=sid, session_id=other, trajectory_id=other)
                for what, body, ctype in bodies:
                    headers = {"content-type": ctype}
                    a = await lean_client.post(path, content=body, headers=headers)
                    b = await routed_client.post(path, content=body, headers=headers)
                    where = f"{op.name} {what} ({sid})"
                    assert a.status_code == b.status_code, f"{where}: {a.text} / {b.text}"
                    assert a.headers["content-type"] == b.headers["content-type"], where
                    _same(_body(a), _body(b))
        exec_calls = answered[next(p for p in answered if "exec" in p)]
        assert exec_calls == 3 * (len(BAD_BODIES) + 1)  # every call to exec met the lean answer first


async def test_a_lean_exec_is_the_exec(node: InProcessNode) -> None:
    lean_client, routed_client, answered = _apps(node)
    async with lean_client, routed_client:
        sandbox = (await lean_client.post("/v1/sandboxes", json={"image": "busybox"})).json()["id"]
        r = await lean_client.post(f"/v1/sandboxes/{sandbox}/exec", json={"command": "echo hi; exit 3"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        assert (r.json()["exit_code"], r.json()["stdout"]) == (3, "hi\n")
        assert int(r.headers["content-length"]) == len(r.content)
        assert sum(answered.values()) == 1
        # a trailing slash, a method the route does not have: the router's answers, as before
        for method, path in (("POST", f"/v1/sandboxes/{sandbox}/exec/"), ("GET", f"/v1/sandboxes/{sandbox}/exec")):
            got = await lean_client.request(method, path, json={})
            want = await routed_client.request(method, path, json={})
            assert (got.status_code, got.content) == (want.status_code, want.content)
        assert sum(answered.values()) == 1


def test_a_route_an_earlier_one_can_take_calls_from_is_not_served_lean() -> None:
    assert lean.overlaps("/v1/sandboxes/{sandbox_id}/exec", "/v1/sandboxes/stop/exec")
    assert lean.overlaps("/v1/files/{path:path}", "/v1/files/a/b")
    assert not lean.overlaps("/v1/sandboxes/{sandbox_id}/exec", "/v1/sandboxes/{sandbox_id}/run")
    assert not lean.overlaps("/v1/sandboxes/ack", "/v1/sandboxes/{sandbox_id}/ack")
    assert lean.overlaps("/v1/sandboxes/run{suffix}", "/v1/sandboxes/running")


def _lean_routes(node: InProcessNode) -> list[tuple[str, str, Any]]:
    from sandfleet.daemon.api.common import Api

    found: list[Api] = []
    original = Api.__init__

    def keep(self: Api, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        found.append(self)

    Api.__init__ = keep  # type: ignore[method-assign]
    try:
        create_app(node.service, node.tenancy, node.metrics)
    finally:
        Api.__init__ = original  # type: ignore[method-assign]
    return found[0].lean


@pytest.mark.parametrize("ctype", ["Application/JSON", "application/json; charset=UTF-8", "application/x-spec+json"])
async def test_a_json_body_is_checked_however_its_type_is_spelled(node: InProcessNode, ctype: str) -> None:
    # (a create is not served lean: FastAPI's route, through CheckedRoute)
    async with node.client() as fleet, httpx.AsyncClient(transport=node.transport(), base_url="http://node") as raw:
        r = await raw.post(
            "/v1/sandboxes",
            content=b'{"image": "busybox", "labels": {"k": "\\ud800"}}',
            headers={"content-type": ctype},
        )
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        assert await fleet.list() == []  # refused before anything was made
