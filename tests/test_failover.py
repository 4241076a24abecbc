"""The SDK over several gateways, against fake ones (`httpx.MockTransport`): a gateway that fails
sends every later call to the next; a call is sent again there at once only when that is safe (it
never reached the first, or it is a read); a create whose answer was lost is retried with its key,
marked so the next gateway looks for what it made; the errors name the gateways, not a daemon.
The real thing (gateways SIGKILLed mid-burst) is tests/test_cluster.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sandfleet import AsyncClient, Client, SandboxSpec
from sandfleet.client import _base
from sandfleet.errors import SandboxError, UnavailableError
from test_sdk_unit import Fake, info, ok, result

pytestmark = pytest.mark.unit

GATEWAYS = ["http://gw-a:8600", "http://gw-b:8600"]


class Gateways:
    """Two fake gateways, told apart by host; a gateway that is `down` refuses every connection."""

    def __init__(self) -> None:
        self.by_host = {"gw-a": Fake(), "gw-b": Fake()}
        self.down: set[str] = set()

    def __getitem__(self, host: str) -> Fake:
        return self.by_host[host]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.host in self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return self.by_host[request.url.host](request)

    def route(self, method: str, path: str, handler: Any) -> None:
        for fake in self.by_host.values():
            fake.route(method, path, handler)

    def client(self, timeout: float = 10.0) -> Client:
        return Client(GATEWAYS, token="t", timeout=timeout, transport=httpx.MockTransport(self))

    def aclient(self, timeout: float = 10.0) -> AsyncClient:
        return AsyncClient(url=GATEWAYS, token="t", timeout=timeout, transport=httpx.MockTransport(self))


def failing(*errors: Exception) -> Callable[[httpx.Request], httpx.Response]:
    """A handler raising `errors` in turn (the request reached the gateway), then answering a sandbox."""
    left = list(errors)

    def handle(_req: httpx.Request) -> httpx.Response:
        if left:
            raise left.pop(0)
        return ok(info(), 201)

    return handle


def test_calls_move_to_the_next_gateway_when_one_refuses_connections() -> None:
    gws = Gateways()
    gws.route("GET", "/v1/sandboxes/sb-1", info())
    gws.down.add("gw-a")
    with gws.client() as fleet:
        assert fleet.get("sb-1").id == "sb-1"
        assert fleet.get("sb-1").id == "sb-1"  # straight to gw-b now
    assert len(gws["gw-b"].requests) == 2 and not gws["gw-a"].requests
    # With another gateway to go to, a connection not made in FAILOVER_CONNECT seconds moves on.
    assert gws["gw-b"].requests[0].extensions["timeout"]["connect"] == _base.FAILOVER_CONNECT


async def test_async_calls_and_streams_move_to_the_next_gateway() -> None:
    gws = Gateways()
    gws.route("GET", "/v1/sandboxes/sb-1", info())
    lines = [{"type": "stdout", "data": "hi\n"}, {"type": "exit", "result": result("hi\n")}]
    body = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    gws.route("POST", "/v1/sandboxes/sb-1/exec/stream", lambda _r: httpx.Response(200, content=body))
    gws.down.add("gw-a")
    async with gws.aclient() as fleet:
        sb = await fleet.get("sb-1")
        gws.down, gws["gw-b"].requests[:] = {"gw-b"}, []  # now gw-b dies, gw-a is back
        events = [e async for e in sb.exec_stream("echo hi")]
    assert [e.type for e in events] == ["stdout", "exit"]
    assert [r.url.host for r in gws["gw-a"].requests] == ["gw-a"]


def test_a_create_whose_answer_was_lost_is_retried_at_the_next_gateway_marked() -> None:
    gws = Gateways()
    gws["gw-a"].route("POST", "/v1/sandboxes", failing(httpx.RemoteProtocolError("Server disconnected")))
    gws["gw-b"].route("POST", "/v1/sandboxes", ok(info(), 201))
    with gws.client() as fleet:
        assert fleet.create(image="busybox").id == "sb-1"
    (first,), (second,) = gws["gw-a"].requests, gws["gw-b"].requests
    assert first.headers["idempotency-key"] == second.headers["idempotency-key"]
    assert _base.RETRIED not in first.headers and second.headers[_base.RETRIED] == "1"


async def test_a_batch_whose_answer_was_lost_is_retried_marked() -> None:
    gws = Gateways()
    batch = {"results": [{"sandbox": info("sb-1")}, {"sandbox": info("sb-2")}]}
    gws["gw-a"].route("POST", "/v1/sandboxes/batch", failing(httpx.ReadError("reset")))
    gws["gw-b"].route("POST", "/v1/sandboxes/batch", ok(batch))
    async with gws.aclient() as fleet:
        made = await fleet.create_many([SandboxSpec(image="busybox")] * 2)
    assert [getattr(m, "id", m) for m in made] == ["sb-1", "sb-2"]
    (first,), (second,) = gws["gw-a"].requests, gws["gw-b"].requests
    assert gws["gw-a"].bodies()[0]["idempotency_keys"] == gws["gw-b"].bodies()[0]["idempotency_keys"]
    assert _base.RETRIED not in first.headers and second.headers[_base.RETRIED] == "1"


def test_a_first_attempt_is_not_marked_even_with_the_callers_own_key() -> None:
    # A marked create costs a request to every node: a trainer passing deterministic keys must not pay
    # it on every create. Only a key the caller says another process may have used is looked for first.
    gws = Gateways()
    gws.route("POST", "/v1/sandboxes", ok(info(), 201))
    gws.route("GET", "/v1/sandboxes/sb-1", info())
    gws.route("POST", "/v1/sandboxes/sb-1/fork", ok({"results": [{"sandbox": info("sb-2")}]}))
    with gws.client() as fleet:

        def marked() -> list[str | None]:
            return [r.headers.get(_base.RETRIED) for r in gws["gw-a"].requests if r.method == "POST"]

        fleet.create(image="busybox")
        fleet.create(image="busybox", idempotency_key="job-7:rollout-3")
        fleet.get("sb-1").fork(1, idempotency_key="job-7:fork")  # goes to its node, which decides by key
        assert marked() == [None, None, None]
        fleet.create(image="busybox", idempotency_key="job-7:rollout-3", key_reused=True)  # a restarted trainer
        fleet.create(image="busybox", key_reused=True)  # a fresh key was used by nobody
        assert marked() == [None, None, None, "1", None]


def test_a_write_whose_answer_was_lost_is_not_sent_again() -> None:
    # An exec that reached a gateway which then died may have run: the SDK does not run it twice.
    gws = Gateways()
    gws.route("GET", "/v1/sandboxes/sb-1", info())
    gws["gw-a"].route("POST", "/v1/sandboxes/sb-1/exec", failing(httpx.ReadError("reset")))
    gws["gw-b"].route("POST", "/v1/sandboxes/sb-1/exec", ok(result("ran\n")))
    with gws.client() as fleet:
        sb = fleet.get("sb-1")
        with pytest.raises(UnavailableError):
            sb.exec("echo ran", timeout=5)
        assert not [r for r in gws["gw-b"].requests if r.url.path.endswith("/exec")]
        assert sb.exec("echo ran", timeout=5).stdout == "ran\n"  # the next call: at gw-b
    assert [r.url.host for r in gws["gw-b"].requests] == ["gw-b"]


def test_a_read_whose_answer_was_lost_is_asked_of_the_next_gateway() -> None:
    gws = Gateways()
    gws["gw-a"].route("GET", "/v1/sandboxes/sb-1", failing(httpx.RemoteProtocolError("Server disconnected")))
    gws["gw-b"].route("GET", "/v1/sandboxes/sb-1", info())
    with gws.client() as fleet:
        assert fleet.get("sb-1").id == "sb-1"


def test_no_gateway_answering_is_a_typed_error_naming_them() -> None:
    gws = Gateways()
    gws.down |= {"gw-a", "gw-b"}
    with gws.client() as fleet, pytest.raises(UnavailableError) as err:
        fleet.create(image="busybox")
    assert "sandfleet serve" not in err.value.message
    assert all(url in err.value.message for url in GATEWAYS), err.value.message
    assert len(gws["gw-a"].requests) + len(gws["gw-b"].requests) == 0  # both refused: tried once each
    with Client(url="http://gw-a:8600", transport=httpx.MockTransport(gws)) as one, pytest.raises(SandboxError) as e:
        one.health()
    assert "sandfleet serve" not in e.value.message and "http://gw-a:8600" in e.value.message
    local = _base.Endpoint.resolve("/run/sandfleet/x.sock", None, None)  # a local daemon's socket: the hint stays
    assert "is `sandfleet serve` running?" in _base.map_transport_error(httpx.ConnectError("refused"), local).message


def test_gateways_from_a_list_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDFLEET_URL", "http://gw-a:8600/, http://gw-b:8600")
    with Client() as fleet:
        assert fleet.endpoint.urls == tuple(GATEWAYS) and fleet.endpoint.socket is None
    with Client(url=("http://gw-c:1",)) as fleet:
        assert fleet.endpoint.urls == ("http://gw-c:1",) and fleet.endpoint.url == "http://gw-c:1"
