"""The SDK alone, against fake daemons (`httpx.MockTransport`, and a raw socket for the silent-daemon
case): deadlines, create's retries and idempotency keys, streams and their heartbeats, request bodies.
No daemon, no root: these run anywhere in a second or two."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from sandfleet import AsyncClient, AsyncSandbox, Client, Sandbox
from sandfleet.client import _base
from sandfleet.client._base import deadlines
from sandfleet.errors import (
    WIRE_CODES,
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxTimeoutError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.models import ExecResult, ProcessInfo, SandboxInfo, SandboxSpec, SessionInfo, SnapshotInfo

pytestmark = pytest.mark.unit

Handler = Callable[[httpx.Request], httpx.Response]


# -- fakes ----------------------------------------------------------------------------------------------


class Fake:
    """A daemon as a table of (method, path) -> handler; records every request it gets."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.routes: dict[tuple[str, str], Handler] = {}

    def route(self, method: str, path: str, handler: Handler | httpx.Response | dict[str, Any]) -> None:
        if isinstance(handler, httpx.Response | dict):
            reply = handler
            self.routes[(method, path)] = lambda _req: reply if isinstance(reply, httpx.Response) else ok(reply)
        else:
            self.routes[(method, path)] = handler

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        handler = self.routes.get((request.method, request.url.path))
        if handler is None:
            return wire_error(404, "not_found", f"no route {request.method} {request.url.path}")
        return handler(request)

    def client(self, timeout: float = 60.0) -> Client:
        return Client(url="http://sandfleet", timeout=timeout, transport=httpx.MockTransport(self))

    def aclient(self, timeout: float = 60.0) -> AsyncClient:
        return AsyncClient(url="http://sandfleet", timeout=timeout, transport=httpx.MockTransport(self))

    def paths(self) -> list[str]:
        return [r.url.path for r in self.requests]

    def bodies(self) -> list[Any]:
        return [
            json.loads(r.content) if r.headers.get("content-type") == "application/json" else None
            for r in self.requests
        ]


class FakeStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """An ndjson response body: each line after its delay, then (optionally) silence; records being
    closed, which is what the SDK does to the HTTP response when it gives up on or leaves a stream."""

    def __init__(self, lines: list[tuple[float, dict[str, Any]]], hang: float = 0.0) -> None:
        self.lines = lines
        self.hang = hang
        self.closed = False

    def __iter__(self) -> Iterator[bytes]:
        for delay, line in self.lines:
            time.sleep(delay)
            yield json.dumps(line).encode() + b"\n"
        time.sleep(self.hang)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for delay, line in self.lines:
            await asyncio.sleep(delay)
            yield json.dumps(line).encode() + b"\n"
        await asyncio.sleep(self.hang)

    def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True


def ok(body: dict[str, Any], status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=body)


def wire_error(status: int, code: str, message: str, retryable: bool = False) -> httpx.Response:
    cause = WIRE_CODES[code].default_cause if code in WIRE_CODES else "infra"
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "retryable": retryable, "cause": cause}}
    )


def refused(message: str = "node full: 3 sandboxes") -> httpx.Response:
    return wire_error(429, "resource_exhausted", message, True)


def info(sandbox_id: str = "sb-1", state: str = "running") -> dict[str, Any]:
    spec = SandboxSpec()
    return SandboxInfo(id=sandbox_id, state=state, spec=spec, created_at=1.0, last_active_at=1.0).model_dump(  # type: ignore[arg-type]
        mode="json"
    )


def result(stdout: str = "", exit_code: int = 0, **kw: Any) -> dict[str, Any]:
    return ExecResult(exit_code=exit_code, stdout=stdout, stderr="", duration=0.01, **kw).model_dump(mode="json")


def stream(fs: FakeStream) -> Handler:
    return lambda _req: httpx.Response(200, stream=fs, headers={"content-type": "application/x-ndjson"})


HEARTBEAT: dict[str, Any] = {"type": "heartbeat"}
SB = "/v1/sandboxes/sb-1"


@pytest.fixture
def quick_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a stream's silence limit be the (tiny) client timeout of these tests."""
    monkeypatch.setattr(deadlines, "MIN_SILENCE", 0.0)


def sandbox(fake: Fake, fleet: Client) -> Sandbox:
    fake.route("GET", SB, info())
    return fleet.get("sb-1")


async def asandbox(fake: Fake, fleet: AsyncClient) -> AsyncSandbox:
    fake.route("GET", SB, info())
    return await fleet.get("sb-1")


# -- create: waiting for capacity, idempotency keys --------------------------------------------------------


def _refuse_then_create(fake: Fake, refusals: int) -> None:
    count = 0

    def create(_req: httpx.Request) -> httpx.Response:
        nonlocal count
        count += 1
        return refused(f"full #{count}") if count <= refusals else ok(info(), 201)

    fake.route("POST", "/v1/sandboxes", create)


def _one_key(fake: Fake) -> str:
    keys = {r.headers["idempotency-key"] for r in fake.requests}
    assert len(keys) == 1, keys
    return keys.pop()


def test_create_retries_refusals_with_one_key_until_created() -> None:
    fake = Fake()
    _refuse_then_create(fake, 3)
    with fake.client(timeout=5) as fleet:
        sb = fleet.create(image="busybox")
    assert sb.id == "sb-1" and len(fake.requests) == 4
    assert re.fullmatch(r"[0-9a-f]{32}", _one_key(fake))
    # Each attempt waits no longer than the client's timeout.
    assert all(r.extensions["timeout"]["read"] <= 5 for r in fake.requests)


async def test_async_create_retries_refusals_with_one_key_until_created() -> None:
    fake = Fake()
    _refuse_then_create(fake, 2)
    async with fake.aclient(timeout=5) as fleet:
        sb = await fleet.create(SandboxSpec(image="busybox"), idempotency_key="job-7:rollout-3")
    assert sb.id == "sb-1" and len(fake.requests) == 3
    assert _one_key(fake) == "job-7:rollout-3"


def test_create_raises_the_last_refusal_at_its_deadline() -> None:
    fake = Fake()
    _refuse_then_create(fake, 1000)
    with fake.client() as fleet:
        t0 = time.monotonic()
        with pytest.raises(ResourceExhaustedError) as err:
            fleet.create(image="busybox", timeout=1.0)
        elapsed = time.monotonic() - t0
    assert 1.0 - _base.MIN_ATTEMPT - 0.05 < elapsed < 1.2  # retried until the last attempt that fits
    assert len(fake.requests) >= 3 and err.value.message == f"full #{len(fake.requests)}"
    _one_key(fake)


@pytest.mark.parametrize(
    "lost",
    [httpx.ReadTimeout("timed out"), httpx.RemoteProtocolError("Server disconnected"), httpx.ReadError("reset")],
    ids=["timeout", "disconnected", "reset"],
)
def test_create_retries_a_lost_answer_with_the_same_key(lost: Exception) -> None:
    # The first attempt reached the daemon and its answer was lost; the daemon then restarts (refused
    # connections) and answers the retry with the sandbox the first attempt made.
    fake = Fake()
    failures: list[Exception] = [lost, httpx.ConnectError("refused")]

    def create(_req: httpx.Request) -> httpx.Response:
        if failures:
            raise failures.pop(0)
        return ok(info(), 201)

    fake.route("POST", "/v1/sandboxes", create)
    with fake.client(timeout=5) as fleet:
        assert fleet.create(image="busybox").id == "sb-1"
    assert len(fake.requests) == 3
    _one_key(fake)


async def test_async_create_retries_a_lost_answer_with_the_same_key() -> None:
    fake = Fake()
    failures: list[Exception] = [httpx.RemoteProtocolError("Server disconnected")]

    def create(_req: httpx.Request) -> httpx.Response:
        if failures:
            raise failures.pop(0)
        return ok(info(), 201)

    fake.route("POST", "/v1/sandboxes", create)
    async with fake.aclient(timeout=5) as fleet:
        assert (await fleet.create(image="busybox")).id == "sb-1"
    assert len(fake.requests) == 2
    _one_key(fake)


def test_create_without_a_daemon_fails_fast() -> None:
    fake = Fake()

    def create(_req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused")

    fake.route("POST", "/v1/sandboxes", create)
    with fake.client(timeout=30) as fleet, pytest.raises(UnavailableError) as err:
        fleet.create(image="busybox")
    assert len(fake.requests) == 1 and "idempotency_key" not in err.value.message


def test_create_whose_outcome_stays_unknown_names_its_key() -> None:
    fake = Fake()

    def create(_req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out")

    fake.route("POST", "/v1/sandboxes", create)
    with fake.client() as fleet, pytest.raises(SandboxTimeoutError) as err:
        fleet.create(image="busybox", timeout=1.0, idempotency_key="k-1")
    assert len(fake.requests) >= 2 and _one_key(fake) == "k-1"
    assert "idempotency_key='k-1'" in err.value.message
    assert isinstance(err.value.__cause__, SandboxTimeoutError)


def test_create_checks_its_arguments_before_sending() -> None:
    fake = Fake()
    with fake.client() as fleet:
        with pytest.raises(InvalidArgumentError):
            fleet.create(image="busybox", idempotency_key="no spaces allowed")
        with pytest.raises(InvalidArgumentError):
            fleet.create(image="busybox", timeout=0)
        with pytest.raises(InvalidArgumentError):
            fleet.create(image="UPPER CASE")
    assert fake.requests == []


def test_create_many_keys_each_spec_and_resends_it_on_retries() -> None:
    fake = Fake()
    replies: list[Callable[[list[str]], httpx.Response]] = [
        lambda keys: (_ for _ in ()).throw(httpx.RemoteProtocolError("Server disconnected")),
        lambda keys: ok(
            {
                "results": [
                    {"sandbox": info("sb-a")},
                    {"error": {"code": "resource_exhausted", "message": "full", "retryable": True, "cause": "infra"}},
                    {"sandbox": info("sb-c")},
                ]
            }
        ),
        lambda keys: ok({"results": [{"sandbox": info("sb-b")}]}),
    ]

    def batch(req: httpx.Request) -> httpx.Response:
        return replies.pop(0)(json.loads(req.content)["idempotency_keys"])

    fake.route("POST", "/v1/sandboxes/batch", batch)
    with fake.client(timeout=5) as fleet:
        made = fleet.create_many([SandboxSpec(), SandboxSpec(), SandboxSpec()])
    assert [s.id for s in made if not isinstance(s, SandboxError)] == ["sb-a", "sb-b", "sb-c"]
    first, again, last = (body["idempotency_keys"] for body in fake.bodies())
    assert len(set(first)) == 3 and again == first  # the lost batch is resent with the same keys
    assert last == [first[1]]  # the refused spec keeps its key


def test_create_many_gives_up_refusals_after_retry_for() -> None:
    fake = Fake()
    fake.route(
        "POST",
        "/v1/sandboxes/batch",
        lambda _req: ok(
            {
                "results": [
                    {"error": {"code": "resource_exhausted", "message": "full", "retryable": True, "cause": "infra"}}
                ]
            }
        ),
    )
    with fake.client(timeout=30) as fleet:
        (outcome,) = fleet.create_many([SandboxSpec()], retry_for=0)
    assert isinstance(outcome, ResourceExhaustedError) and len(fake.requests) == 1


def test_calls_honour_the_client_timeout_and_builds_their_own() -> None:
    fake = Fake()
    fake.route("GET", SB, info())
    batch = {"results": [{"sandbox": info("sb-2")}]}
    snap = SnapshotInfo(id="snap-1", sandbox_id="sb-1", created_at=1.0, size_bytes=1, seconds=0.1)
    image = {"name": "x", "tag": "1", "layers": [], "size": 0, "created": 1.0}
    fake.route("POST", "/v1/sandboxes", ok(info(), 201))
    fake.route("POST", "/v1/sandboxes/batch", batch)
    fake.route("POST", SB + "/snapshots", ok(snap.model_dump(mode="json"), 201))
    fake.route("POST", SB + "/fork", batch)
    fake.route("POST", "/v1/snapshots/snap-1/restore", batch)
    fake.route("POST", "/v1/sandboxes/pause", {"sandboxes": []})
    fake.route("POST", "/v1/sandboxes/resume", {"sandboxes": []})
    fake.route("POST", SB + "/pack", ok(image, 201))
    fake.route("POST", "/v1/images/build", image)
    with fake.client(timeout=7) as fleet:
        sb = fleet.get("sb-1")
        fleet.create()
        fleet.create_many([SandboxSpec()])
        sb.snapshot()
        sb.fork(2)
        fleet.restore("snap-1")
        fleet.pause_many({"job": "x"})
        fleet.resume_many({"job": "x"})
        unary = len(fake.requests)
        sb.pack("x:1")
        fleet.build_image("busybox")
        sb.fork(timeout=3)
    waits = [max(r.extensions["timeout"].values()) for r in fake.requests]
    assert all(w <= 7 for w in waits[:unary]), list(zip(fake.paths(), waits, strict=True))
    assert waits[unary:] == [_base.BUILD_TIMEOUT, _base.BUILD_TIMEOUT, pytest.approx(3, abs=0.1)]


def test_fork_and_restore_send_an_idempotency_key() -> None:
    fake = Fake()
    fake.route("GET", SB, info())
    lost = [httpx.ReadError("reset")]

    def fork(_req: httpx.Request) -> httpx.Response:
        if lost:
            raise lost.pop()
        return ok({"results": [{"sandbox": info("sb-2")}, {"sandbox": info("sb-3")}]})

    fake.route("POST", SB + "/fork", fork)
    fake.route("POST", "/v1/snapshots/snap-1/restore", {"results": [{"sandbox": info("sb-4")}]})
    with fake.client(timeout=5) as fleet:
        children = fleet.get("sb-1").fork(2, {"k": "v"})
        (restored,) = fleet.restore("snap-1", idempotency_key="restore-1")
    assert [c.id for c in children if not isinstance(c, SandboxError)] == ["sb-2", "sb-3"]
    assert not isinstance(restored, SandboxError) and restored.id == "sb-4"
    _, lost_fork, fork_again, restore = fake.bodies()
    assert lost_fork == fork_again and lost_fork["count"] == 2 and lost_fork["labels"] == {"k": "v"}
    assert re.fullmatch(r"[0-9a-f]{32}", lost_fork["idempotency_key"])
    assert restore["idempotency_key"] == "restore-1"


# -- exec: one response or a stream, heartbeats, the silence deadline ----------------------------------


def test_exec_runs_short_commands_in_one_response_and_long_ones_streamed() -> None:
    fake = Fake()
    fake.route("POST", SB + "/exec", result("one\n"))
    fake.route("POST", SB + "/exec/stream", stream(FakeStream([(0, {"type": "exit", "result": result("s\n")})])))
    with fake.client(timeout=60) as fleet:
        sb = sandbox(fake, fleet)
        assert sb.exec("echo one", timeout=60).stdout == "one\n"
        assert sb.exec("sleep 1000", timeout=None).stdout == "s\n"
    assert fake.paths()[1:] == [SB + "/exec", SB + "/exec/stream"]
    assert fake.bodies()[1:] == [{"command": "echo one", "timeout": 60.0}, {"command": "sleep 1000", "timeout": None}]
    # The one-response exec waits for the command's timeout plus a margin for the daemon's answer.
    assert fake.requests[1].extensions["timeout"]["read"] == 60 + _base.EXEC_MARGIN


def _quiet_command(beats: int, every: float) -> FakeStream:
    lines = [(0.0, {"type": "stdout", "data": "started\n"})]
    lines += [(every, HEARTBEAT)] * beats
    lines += [
        (every, {"type": "stdout", "data": "done\n"}),
        (0.0, {"type": "exit", "result": result("started\ndone\n")}),
    ]
    return FakeStream(lines)


def test_heartbeats_keep_a_quiet_command_alive_and_are_swallowed(quick_silence: None) -> None:
    fake = Fake()
    fake.route("POST", SB + "/exec/stream", lambda _req: stream(_quiet_command(5, 0.08))(_req))
    with fake.client(timeout=0.3) as fleet:  # the command is quiet for 0.48 s, past the client's timeout
        sb = sandbox(fake, fleet)
        assert sb.exec("quiet", timeout=None).stdout == "started\ndone\n"
        events = list(sb.exec_stream("quiet", timeout=None))
    assert [e.type for e in events] == ["stdout", "stdout", "exit"]
    assert events[-1].result is not None and events[-1].result.ok


async def test_async_heartbeats_keep_a_quiet_command_alive_and_are_swallowed(quick_silence: None) -> None:
    fake = Fake()
    fake.route("POST", SB + "/exec/stream", lambda _req: stream(_quiet_command(5, 0.08))(_req))
    async with fake.aclient(timeout=0.3) as fleet:
        sb = await asandbox(fake, fleet)
        assert (await sb.exec("quiet", timeout=None)).stdout == "started\ndone\n"
        events = [e async for e in sb.exec_stream("quiet", timeout=3600)]
    assert [e.type for e in events] == ["stdout", "stdout", "exit"]


def test_a_silent_stream_raises_a_timeout_and_is_closed(quick_silence: None) -> None:
    fake = Fake()
    silent = FakeStream([(0, {"type": "stdout", "data": "started\n"}), (0.8, HEARTBEAT)])
    fake.route("POST", SB + "/exec/stream", stream(silent))
    with fake.client(timeout=0.3) as fleet:
        sb = sandbox(fake, fleet)
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeoutError, match="sent nothing"):
            sb.exec("sleep 1000", timeout=None)
        assert time.monotonic() - t0 < 1.5
    assert silent.closed


async def test_async_silent_stream_raises_a_timeout_and_is_closed(quick_silence: None) -> None:
    fake = Fake()
    silent = FakeStream([(0, {"type": "stdout", "data": "started\n"})], hang=30)
    fake.route("POST", SB + "/exec/stream", stream(silent))
    async with fake.aclient(timeout=0.3) as fleet:
        sb = await asandbox(fake, fleet)
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeoutError, match="sent nothing"):
            await sb.exec("sleep 1000", timeout=None)
        assert time.monotonic() - t0 < 1.5
    assert silent.closed


async def test_a_streamed_command_is_bounded_by_its_own_timeout(
    quick_silence: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(deadlines, "EXEC_MARGIN", 0.0)
    fake = Fake()
    endless = FakeStream([(0.05, HEARTBEAT)] * 200)  # a daemon that never reports the exit
    fake.route("POST", SB + "/exec/stream", stream(endless))
    async with fake.aclient(timeout=0.2) as fleet:
        sb = await asandbox(fake, fleet)
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeoutError, match="deadline"):
            await sb.exec("sleep 1000", timeout=0.5)  # longer than the client's timeout: streamed
        assert 0.4 < time.monotonic() - t0 < 1.5
    assert endless.closed


def test_leaving_a_stream_early_closes_it(quick_silence: None) -> None:
    fake = Fake()
    endless = FakeStream([(0, {"type": "stdout", "data": "tick\n"})] * 3, hang=30)
    fake.route("POST", SB + "/exec/stream", stream(endless))
    with fake.client(timeout=5) as fleet:
        sb = sandbox(fake, fleet)
        for event in sb.exec_stream("yes", timeout=None):
            assert event.data == "tick\n"
            break
        assert endless.closed  # dropped: closed at once, and the daemon kills the command


def test_stream_errors_are_typed() -> None:
    fake = Fake()
    broken = {
        "type": "error",
        "error": {"code": "unavailable", "message": "sandbox sb-1 stopped", "retryable": True, "cause": "infra"},
    }
    replies = [
        FakeStream([(0, {"type": "stdout", "data": "x"}), (0, broken)]),
        FakeStream([(0, {"type": "stdout", "data": "x"})]),  # ends without an exit
    ]
    fake.route("POST", SB + "/exec/stream", lambda req: stream(replies.pop(0))(req))
    with fake.client() as fleet:
        sb = sandbox(fake, fleet)
        with pytest.raises(UnavailableError, match="stopped"):
            sb.exec("x", timeout=None)
        with pytest.raises(UnavailableError, match="ended before"):
            sb.exec("x", timeout=None)
        fake.route("POST", SB + "/exec/stream", wire_error(404, "not_found", "sandbox sb-1 not found"))
        with pytest.raises(SandboxNotFoundError):
            list(sb.exec_stream("x"))


class SilentDaemon:
    """A real socket that answers a stream's headers and one heartbeat, then says nothing more (a
    SIGSTOPped daemon) until the client hangs up, which it records."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.hung_up = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            conn.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
            while length and len(body) < int(length.group(1)):
                body += conn.recv(65536)
            line = json.dumps(HEARTBEAT).encode() + b"\n"
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
                + f"{len(line):x}\r\n".encode()
                + line
                + b"\r\n"
            )
            with contextlib.suppress(OSError):
                while conn.recv(65536):
                    pass
                self.hung_up.set()

    def close(self) -> None:
        self.server.close()
        self.thread.join(15)


@pytest.fixture
def silent_daemon() -> Iterator[SilentDaemon]:
    d = SilentDaemon()
    yield d
    d.close()


def test_a_stopped_daemon_times_out_a_streamed_exec(quick_silence: None, silent_daemon: SilentDaemon) -> None:
    with Client(url=silent_daemon.url, timeout=0.3) as fleet:
        target = Sandbox(fleet, SandboxInfo.model_validate(info()))
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeoutError):
            target.exec("sleep 1000", timeout=None)
        assert time.monotonic() - t0 < 3
    assert silent_daemon.hung_up.wait(5), "the SDK left the connection open"


async def test_async_stopped_daemon_times_out_a_streamed_exec(quick_silence: None, silent_daemon: SilentDaemon) -> None:
    async with AsyncClient(url=silent_daemon.url, timeout=0.3) as fleet:
        target = AsyncSandbox(fleet, SandboxInfo.model_validate(info()))
        t0 = time.monotonic()
        with pytest.raises(SandboxTimeoutError):
            await target.exec("sleep 1000", timeout=None)
        assert time.monotonic() - t0 < 3
    assert await asyncio.to_thread(silent_daemon.hung_up.wait, 5), "the SDK left the connection open"


def test_exec_options_and_binary_output() -> None:
    fake = Fake()
    raw = b"\x00\x01\xfe\xff"
    fake.route("POST", SB + "/exec", result(base64.b64encode(raw).decode(), encoding="base64"))
    with fake.client() as fleet:
        sb = sandbox(fake, fleet)
        r = sb.exec(["cat"], stdin=b"\x00\xffbin", binary=True, merge_stderr=True, cwd="sub/dir", timeout=5)
        sb.exec("cat", stdin="text", env={"A": "1"}, user="nobody", output_limit=10, timeout=5)
        with pytest.raises(InvalidArgumentError):
            sb.exec("", timeout=5)
    assert r.stdout_bytes == raw and r.stdout == base64.b64encode(raw).decode()
    binary, text = fake.bodies()[1:]
    assert binary == {
        "command": ["cat"],
        "timeout": 5.0,
        "stdin_b64": base64.b64encode(b"\x00\xffbin").decode(),
        "merge_stderr": True,
        "encoding": "base64",
        "cwd": "sub/dir",  # relative: to the sandbox's working directory
    }
    assert text == {
        "command": "cat",
        "timeout": 5.0,
        "stdin": "text",
        "env": {"A": "1"},
        "user": "nobody",
        "output_limit": 10,
    }


# -- lifetimes, listing -------------------------------------------------------------------------------


def test_set_lifetime_sends_only_the_limits_given() -> None:
    fake = Fake()
    fake.route("PATCH", SB, info())
    fake.route("POST", "/v1/sandboxes/lifetimes", {"sandboxes": ["sb-1", "sb-2"]})
    with fake.client() as fleet:
        sb = sandbox(fake, fleet)
        sb.set_lifetime(idle_ttl=30)
        sb.set_lifetime(max_lifetime=None)
        sb.set_lifetime(idle_ttl=None, max_lifetime=3600)
        sb.set_lifetime(pause_after=5)
        assert fleet.set_lifetimes({"job": "x"}, idle_ttl=None) == ["sb-1", "sb-2"]
        with pytest.raises(InvalidArgumentError):
            sb.set_lifetime()
        with pytest.raises(InvalidArgumentError):
            sb.set_lifetime(idle_ttl=-1)
        with pytest.raises(InvalidArgumentError):
            fleet.set_lifetimes({}, idle_ttl=10)
    assert fake.bodies()[1:] == [
        {"idle_ttl": 30.0},
        {"max_lifetime": None},
        {"idle_ttl": None, "max_lifetime": 3600.0},
        {"pause_after": 5.0},
        {"labels": {"job": "x"}, "idle_ttl": None},
    ]


async def test_async_set_lifetime() -> None:
    fake = Fake()
    fake.route("PATCH", SB, info())
    async with fake.aclient() as fleet:
        sb = await asandbox(fake, fleet)
        assert (await sb.set_lifetime(max_lifetime=120)).id == "sb-1"
    assert fake.bodies()[-1] == {"max_lifetime": 120.0}


def test_list_passes_state_through() -> None:
    fake = Fake()
    fake.route("GET", "/v1/sandboxes", {"sandboxes": [info("sb-9", "stopped")]})
    with fake.client() as fleet:
        fleet.list()
        fleet.list({"job": "x"}, state="all")
        [stopped] = fleet.list(state="stopped")
    assert stopped.state == "stopped"
    params = [list(r.url.params.multi_items()) for r in fake.requests]
    assert params == [[], [("label", "job=x"), ("state", "all")], [("state", "stopped")]]


# -- files.watch ----------------------------------------------------------------------------------------


def _changes(hang: float = 0.0) -> FakeStream:
    return FakeStream(
        [
            (0, {"type": "create", "path": "out/a.txt"}),
            (0, HEARTBEAT),
            (0, {"type": "modify", "path": "out/a.txt"}),
            (0, HEARTBEAT),
            (0, {"type": "create", "path": "out/sub", "is_dir": True}),
        ],
        hang=hang,
    )


def test_watch_yields_changes_and_skips_heartbeats() -> None:
    fake = Fake()
    changes = _changes()
    fake.route("GET", SB + "/files/watch", stream(changes))
    with fake.client() as fleet:
        events = list(sandbox(fake, fleet).files.watch())
    assert [(e.type, e.path, e.is_dir) for e in events] == [
        ("create", "out/a.txt", False),
        ("modify", "out/a.txt", False),
        ("create", "out/sub", True),
    ]
    assert dict(fake.requests[-1].url.params) == {"path": ".", "recursive": "true"}
    assert changes.closed


def test_watch_is_in_place_once_entered_and_closed_when_left() -> None:
    fake = Fake()
    changes = _changes(hang=30)
    fake.route("GET", SB + "/files/watch", stream(changes))
    with fake.client() as fleet:
        sb = sandbox(fake, fleet)
        watch = sb.files.watch("out")
        assert len(fake.requests) == 1  # nothing sent yet
        with watch as events:
            assert fake.paths()[-1] == SB + "/files/watch"  # the daemon answered: the watch is in place
            first = next(events)
        assert changes.closed
    assert first.type == "create"


async def test_async_watch_stops_when_the_caller_does() -> None:
    fake = Fake()
    changes = _changes(hang=30)  # a watch never ends by itself
    fake.route("GET", SB + "/files/watch", stream(changes))
    async with fake.aclient() as fleet:
        sb = await asandbox(fake, fleet)
        seen = []
        async with sb.files.watch("out", recursive=False) as events:
            assert fake.paths()[-1] == SB + "/files/watch"
            async for event in events:
                seen.append(event.type)
                if len(seen) == 2:
                    break
        assert changes.closed  # the HTTP response is closed as soon as the caller leaves
        # Without `async with`, the first iteration opens it and `aclose()` closes it.
        again = _changes(hang=30)
        fake.route("GET", SB + "/files/watch", stream(again))
        watch = sb.files.watch()
        assert (await anext(watch)).type == "create"
        await watch.aclose()
        assert again.closed
    assert seen == ["create", "modify"]
    assert dict(fake.requests[1].url.params) == {"path": "out", "recursive": "false"}


# -- processes, sessions, snapshots --------------------------------------------------------------------


def _process(running: bool, result_: dict[str, Any] | None = None) -> dict[str, Any]:
    return ProcessInfo.model_validate(
        {"id": "p-1", "command": "cat", "running": running, "started_at": 1.0, "result": result_}
    ).model_dump(mode="json")


def test_process_stdin_and_wait_errors() -> None:
    fake = Fake()
    fake.route("POST", SB + "/processes", ok(_process(True), 201))
    fake.route("POST", SB + "/processes/p-1/stdin", {"ok": True})
    waits = [
        wire_error(409, "wrong_state", "sandbox sb-1 stopped before process p-1 finished"),
        ok(_process(False)),  # finished without a result: no silent None either
        ok(_process(False, result("abc"))),
    ]
    fake.route("GET", SB + "/processes/p-1", lambda _req: waits.pop(0))
    with fake.client() as fleet:
        p = sandbox(fake, fleet).start("cat", stdin=b"\x00", keep_stdin_open=True)
        p.write_stdin("abc")
        p.close_stdin()
        with pytest.raises(WrongStateError, match="stopped"):
            p.wait(1)
        with pytest.raises(WrongStateError):
            p.wait(1)
        done = p.wait(1)
    assert done.result is not None and done.result.stdout == "abc"
    start, write, close = fake.requests[1:4]
    assert json.loads(start.content) == {
        "command": "cat",
        "timeout": None,
        "stdin_b64": base64.b64encode(b"\x00").decode(),
        "keep_stdin_open": True,
    }
    assert (write.content, write.url.params["close"], write.headers["content-type"]) == (
        b"abc",
        "false",
        "application/octet-stream",
    )
    assert (close.content, close.url.params["close"]) == (b"", "true")


def _session(session_id: str = "s-1", busy: bool = False) -> dict[str, Any]:
    return SessionInfo(id=session_id, shell="/bin/sh", created_at=1.0, busy=busy).model_dump(mode="json")


def test_sessions_attach_run_and_stdin(quick_silence: None) -> None:
    fake = Fake()
    fake.route("GET", SB + "/sessions", {"sessions": [_session("s-1", busy=True)]})
    fake.route("GET", SB + "/sessions/s-1", _session())
    fake.route("POST", SB + "/sessions/s-1/run", result("short\n"))
    fake.route("POST", SB + "/sessions/s-1/run/stream", lambda req: stream(_quiet_command(3, 0.1))(req))
    fake.route("POST", SB + "/sessions/s-1/stdin", {"ok": True})
    with fake.client(timeout=0.3) as fleet:
        sb = sandbox(fake, fleet)
        [listed] = sb.sessions()
        assert listed.busy
        s = sb.attach_session("s-1")
        assert s.run("echo short", timeout=0.2).stdout == "short\n"
        assert s.run("quiet", timeout=None, stdin=b"\x01", keep_stdin_open=True).stdout == "started\ndone\n"
        assert [e.type for e in s.run_stream("quiet", merge_stderr=True)] == ["stdout", "stdout", "exit"]
        s.write_stdin(b"more", close=True)
        with pytest.raises(InvalidArgumentError):
            sb.attach_session("../s-1")
    assert fake.paths()[3:] == [
        SB + "/sessions/s-1/run",
        SB + "/sessions/s-1/run/stream",
        SB + "/sessions/s-1/run/stream",
        SB + "/sessions/s-1/stdin",
    ]
    short, quiet, streamed, _ = fake.bodies()[3:]
    assert short == {"command": "echo short", "timeout": 0.2}
    assert quiet == {"command": "quiet", "timeout": None, "stdin_b64": "AQ==", "keep_stdin_open": True}
    assert streamed == {"command": "quiet", "timeout": 60.0, "merge_stderr": True}
    assert fake.requests[-1].url.params["close"] == "true" and fake.requests[-1].content == b"more"


async def test_async_session_run_streams_past_the_client_timeout(quick_silence: None) -> None:
    fake = Fake()
    fake.route("GET", SB + "/sessions/s-1", _session())
    fake.route("POST", SB + "/sessions/s-1/run/stream", lambda req: stream(_quiet_command(6, 0.1))(req))
    async with fake.aclient(timeout=0.3) as fleet:
        s = await (await asandbox(fake, fleet)).attach_session("s-1")
        r = await s.run("quiet", timeout=None, binary=False)
    assert r.stdout == "started\ndone\n"


def test_snapshot_body_only_when_asked() -> None:
    fake = Fake()
    snap = SnapshotInfo(id="snap-1", sandbox_id="sb-1", created_at=1.0, size_bytes=1, seconds=0.1, expires_at=61.0)
    fake.route("POST", SB + "/snapshots", ok(snap.model_dump(mode="json"), 201))
    fake.route("GET", "/v1/snapshots", {"snapshots": [snap.model_dump(mode="json")]})
    with fake.client() as fleet:
        sb = sandbox(fake, fleet)
        sb.snapshot()
        assert sb.snapshot(ttl=60, labels={"step": "3"}).expires_at == 61.0
        assert [s.id for s in fleet.snapshots("sb-1")] == ["snap-1"]
    assert fake.requests[1].content == b""
    assert fake.bodies()[2] == {"ttl": 60.0, "labels": {"step": "3"}}
    assert dict(fake.requests[3].url.params) == {"sandbox_id": "sb-1"}
