"""The unix socket's lane (client/_base/lane.py) against a raw socket server that answers as told:
kept-alive connections, a daemon that closed an idle one or restarted, `Connection: close`, chunked
bodies, silence (timeouts), a connection broken mid-call, no daemon at all, more calls at once than
the lane holds (the rest go through httpx), a forked child, and the request bytes httpx would send.
No daemon, no root."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from sandfleet import AsyncClient, Client
from sandfleet.client import _base as b
from sandfleet.client._base import lane
from sandfleet.errors import SandboxError, SandboxTimeoutError, UnavailableError

pytestmark = pytest.mark.unit

OK = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'


class Server:
    """Accepts on a unix socket; each request (head and content-length body) is answered by
    `answer(request_bytes, connection_number)`: bytes to send, then "close" or None (keep)."""

    def __init__(
        self, path: Path, answer: Callable[[bytes, int], tuple[bytes, str | None]], *, early: bool = False
    ) -> None:
        """`early`: answered once the head is in, the body unread (then the connection is closed)."""
        self.path, self.answer, self.early = path, answer, early
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(128)
        self.accepted = 0
        self.requests: list[bytes] = []
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn, self.accepted), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        buf = b""
        with contextlib.suppress(OSError):
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, rest = buf.partition(b"\r\n\r\n")
                if self.early:
                    self.requests.append(head)
                    conn.sendall(self.answer(head, number)[0])
                    conn.close()
                    return
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length")
                    ),
                    0,
                )
                while len(rest) < length:
                    rest += conn.recv(65536)
                request, buf = head + b"\r\n\r\n" + rest[:length], rest[length:]
                self.requests.append(request)
                reply, then = self.answer(request, number)
                conn.sendall(reply)
                if then == "close":
                    conn.close()
                    return

    def close_all(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()

    def stop(self) -> None:
        self.sock.close()
        self.close_all()


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(
        answer: Callable[[bytes, int], tuple[bytes, str | None]] = lambda r, n: (OK, None), early: bool = False
    ) -> Server:
        server = Server(tmp_path / f"d{len(servers)}.sock", answer, early=early)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def test_calls_share_a_kept_alive_connection_and_a_closed_one_is_replaced(serve: Callable[..., Server]) -> None:
    server = serve()
    with Client(server.path) as fleet:
        for _ in range(5):
            assert fleet._send(b.Call("GET", "/v1/x")) == b'{"ok":true}'
        assert server.accepted == 1
        server.close_all()  # the daemon restarted, or let the idle connection go
        assert fleet._send(b.Call("GET", "/v1/x")) == b'{"ok":true}'
        assert server.accepted == 2
    assert len(server.requests) == 6


def test_connection_close_and_chunked_answers(serve: Callable[..., Server]) -> None:
    chunked = b'HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\n{"a\r\n5\r\n":1}\n\r\n0\r\n\r\n'
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    server = serve(lambda r, n: (chunked, None) if b"chunked" in r else (closing, "close"))
    with Client(server.path) as fleet:
        assert fleet._send(b.Call("GET", "/v1/chunked")) == b'{"a":1}\n'
        assert fleet._send(b.Call("GET", "/v1/close")) == b"{}"
        assert fleet._send(b.Call("GET", "/v1/close")) == b"{}"
    assert server.accepted == 2  # the first kept for the second, which the daemon then closed


def test_errors_are_the_sdks(serve: Callable[..., Server], tmp_path: Path) -> None:
    body = b'{"error":{"code":"not_found","message":"no such sandbox sb-1","retryable":false}}'
    err = b"HTTP/1.1 404 Not Found\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    silent = serve(lambda r, n: (b"", None))
    broken = serve(lambda r, n: (b"HTTP/1.1 200 OK\r\ncontent-length: 50\r\n\r\n{", "close"))
    missing = serve(lambda r, n: (err, None))
    with Client(silent.path, timeout=0.5) as fleet, pytest.raises(SandboxTimeoutError):
        fleet._send(b.Call("GET", "/v1/x"))
    with Client(broken.path) as fleet, pytest.raises(UnavailableError, match="peer closed connection"):
        fleet._send(b.Call("POST", "/v1/x", json={"a": 1}))
    assert broken.accepted == 1  # a call that may have run is never sent twice
    with Client(missing.path) as fleet, pytest.raises(SandboxError) as info:
        fleet._send(b.Call("GET", "/v1/sandboxes/sb-1"))
    assert info.value.code == "not_found" and "sb-1" in str(info.value)
    with Client(tmp_path / "nothing.sock") as fleet, pytest.raises(UnavailableError, match="sandfleet serve"):
        fleet._send(b.Call("GET", "/v1/x"))
    smuggled = b.Call("GET", "/v1/x", headers={"x-a": "1\r\nx-b: 2"})
    with Client(missing.path) as fleet, pytest.raises(UnavailableError, match="cannot send"):
        fleet._send(smuggled)  # refused as under httpx (h11 there): nothing is written
    assert not [r for r in missing.requests if b"x-b" in r]


def test_more_calls_at_once_than_the_lane_holds_go_through_httpx(serve: Callable[..., Server]) -> None:
    gate = threading.Event()

    def slow(request: bytes, n: int) -> tuple[bytes, str | None]:
        gate.wait(5)
        return OK, None

    server = serve(slow)
    n = lane.MAX_CONNECTIONS + 16

    async def main() -> list[bytes]:
        async with AsyncClient(server.path) as fleet:
            calls = [asyncio.create_task(fleet._send(b.Call("GET", "/v1/x"))) for _ in range(n)]
            while len(server.requests) < n:  # noqa: ASYNC110 (the server is a thread: no event to wait on)
                await asyncio.sleep(0.01)
            gate.set()
            return await asyncio.gather(*calls)

    assert asyncio.run(main()) == [b'{"ok":true}'] * n
    agents = [r for r in server.requests if b"python-httpx" in r]
    assert len(agents) == n  # both ways send httpx's headers (the audit names the client the same)
    assert server.accepted >= n


def test_a_forked_child_never_writes_on_its_parents_connection(serve: Callable[..., Server]) -> None:
    server = serve()
    with Client(server.path) as fleet:
        fleet._send(b.Call("GET", "/v1/parent"))
        pid = os.fork()
        if pid == 0:  # the child: its own connection
            code = 0
            try:
                fleet._send(b.Call("GET", "/v1/child"))
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert fleet._send(b.Call("GET", "/v1/parent")) == b'{"ok":true}'
    assert server.accepted == 2
    assert [r.split(b" ")[1] for r in server.requests] == [b"/v1/parent", b"/v1/child", b"/v1/parent"]


def test_requests_are_written_as_httpx_writes_them(serve: Callable[..., Server]) -> None:
    server = serve()
    call = b.Call("PUT", "/v1/sandboxes/sb-1/files/a b/ü", params={"path": "/x y&z", "n": 3, "f": True},
                  json={"text": "ü\u2028", "n": None}, headers={"x-extra": "1"})  # fmt: skip
    with Client(server.path, token="t0k") as fleet:
        fleet._send(call)
        ours = server.requests[-1]
        want = fleet._http.build_request(call.method, call.path, params=call.params, json=call.json,
                                         headers=dict(call.headers))  # fmt: skip
    head, _, body = ours.partition(b"\r\n\r\n")
    line, *fields = head.split(b"\r\n")
    assert line == b"PUT " + want.url.raw_path + b" HTTP/1.1"
    assert body == want.read()
    headers = dict(f.split(b": ", 1) for f in fields)
    for name in (b"authorization", b"content-type", b"content-length", b"x-extra", b"user-agent"):
        assert headers[name] == want.headers[name.decode()].encode(), name
    assert b"accept-encoding" not in headers


def test_tests_own_transports_keep_to_httpx() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json={"ok": True})

    with Client("/nonexistent.sock", transport=httpx.MockTransport(handler)) as fleet:
        assert fleet._lane is None
        fleet._send(b.Call("GET", "/v1/x"))
    assert seen == ["/v1/x"]
    with Client(url="http://127.0.0.1:9") as fleet:
        assert fleet._lane is None  # TCP: httpx (TLS, proxies, gateways)


def _json(status: str, body: bytes, extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\n{extra}\r\n".encode() + body


def test_a_connect_that_fails_for_any_reason_was_never_sent(tmp_path: Path) -> None:
    """Not only no socket: a path too long, no permission, a full backlog are all "cannot reach"
    (so a create's retries know the daemon never had it)."""
    too_long = tmp_path / ("x" * 120)
    for client in (Client(too_long), AsyncClient(too_long)):
        with pytest.raises(UnavailableError, match="cannot reach the sandfleet daemon") as info:
            if isinstance(client, Client):
                client._send(b.Call("POST", "/v1/sandboxes", json={}))
            else:
                asyncio.run(client._send(b.Call("POST", "/v1/sandboxes", json={})))
        cause = b.transport_cause(info.value)
        assert cause is not None and not b.request_sent(cause)


def test_a_full_backlog_is_waited_out_not_taken_for_a_connection(tmp_path: Path) -> None:
    path = tmp_path / "full.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    waiting = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    waiting.connect(str(path))  # fills the backlog: the next non-blocking connect is EAGAIN

    def serve_later() -> None:
        threading.Event().wait(0.3)
        first, _ = listener.accept()
        first.close()
        conn, _ = listener.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(4096)
        conn.sendall(OK)

    threading.Thread(target=serve_later, daemon=True).start()

    async def main() -> bytes:
        async with AsyncClient(path) as fleet:
            return await fleet._send(b.Call("GET", "/v1/x"))

    assert asyncio.run(main()) == b'{"ok":true}'
    listener.close()
    waiting.close()


def test_the_timeout_bounds_each_read_not_a_whole_transfer(tmp_path: Path) -> None:
    path = tmp_path / "slow.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    body = b"0123456789"

    def trickle() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            conn.sendall(f"HTTP/1.1 200 OK\r\ncontent-length: {len(body)}\r\n\r\n".encode())
            for i in range(len(body)):
                threading.Event().wait(0.25)  # 2.5 s in all, never 1 s without a byte
                conn.sendall(body[i : i + 1])

    threading.Thread(target=trickle, daemon=True).start()
    with Client(path, timeout=1) as fleet:
        assert fleet._send(b.Call("GET", "/v1/file")) == body

    async def main() -> bytes:
        async with AsyncClient(path, timeout=1) as fleet:
            return await fleet._send(b.Call("GET", "/v1/file"))

    assert asyncio.run(main()) == body
    listener.close()


def test_an_early_answer_to_a_large_upload_is_read(serve: Callable[..., Server]) -> None:
    body = b'{"error":{"code":"permission_denied","message":"token t is read-only","retryable":false}}'
    server = serve(lambda r, n: (_json("403 Forbidden", body, "connection: close\r\n"), "close"), early=True)
    upload = b.Call("PUT", "/v1/sandboxes/sb-1/files/content", content=b"x" * (20 * 1024**2))
    with Client(server.path) as fleet, pytest.raises(SandboxError) as info:
        fleet._send(upload)
    assert info.value.code == "permission_denied"

    async def main() -> None:
        async with AsyncClient(server.path) as fleet:
            await fleet._send(upload)

    with pytest.raises(SandboxError) as ainfo:
        asyncio.run(main())
    assert ainfo.value.code == "permission_denied"


def test_bytes_after_an_answer_never_become_the_next_ones(serve: Callable[..., Server]) -> None:
    stale = _json("200 OK", b'"stale"')
    server = serve(lambda r, n: (OK + stale, None))
    with Client(server.path) as fleet:
        assert fleet._send(b.Call("GET", "/v1/x")) == b'{"ok":true}'
        assert fleet._send(b.Call("GET", "/v1/x")) == b'{"ok":true}'
    assert server.accepted == 2  # the connection with stray bytes was not kept


def test_interim_answers_are_skipped_and_a_body_may_end_with_the_connection(serve: Callable[..., Server]) -> None:
    """As h11 read them: a 1xx before the answer is passed over, a body without a length ends where the
    connection does (never kept), and what is not HTTP is a transport error, never a guess."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + OK
    unframed = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"until":"closed"}'
    garbage = b"HTTP/1.1 2x0 what\r\n\r\n"
    answers = {b"/v1/interim": (interim, None), b"/v1/unframed": (unframed, "close"), b"/v1/bad": (garbage, "close")}
    server = serve(lambda r, n: answers[r.split(b" ")[1]])
    with Client(server.path) as fleet:
        assert fleet._send(b.Call("GET", "/v1/interim")) == b'{"ok":true}'
        assert fleet._send(b.Call("GET", "/v1/interim")) == b'{"ok":true}'
        assert server.accepted == 1  # kept after an interim answer
        assert fleet._send(b.Call("GET", "/v1/unframed")) == b'{"until":"closed"}'
        with pytest.raises(UnavailableError, match="unreadable answer"):
            fleet._send(b.Call("GET", "/v1/bad"))
        for bad in (
            b.Call("GET", "/v1/x", headers={"x-a": "caf\u00e9"}),
            b.Call("GET /", "/v1/x"),
            b.Call("HEAD", "/x"),
        ):
            with pytest.raises(UnavailableError, match="cannot send"):
                fleet._send(bad)
    assert len(server.requests) == 4  # nothing of the refused ones was written


def test_an_answer_is_freed_with_its_call_and_odd_answers_fail_typed(serve: Callable[..., Server]) -> None:
    """A body is freed when its answer is dropped, not at the next garbage collection (RL loops often
    freeze or disable the collector); an upgrade answer is a transport error; a request cut short
    by an early answer never leaves its connection kept; the body's framing is the lane's."""
    upgrade = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n"
    server = serve(lambda r, n: (upgrade, "close") if b"/v1/up" in r else (OK, None))
    conn = lane.Connection.open(str(server.path), 5.0)
    gc.disable()
    try:
        answer = conn.exchange(lane.encode(b.Call("GET", "/v1/x"), {"host": "sandfleet"}), 5.0)
        assert answer.status == 200 and answer.keep_alive
        freed = weakref.ref(answer)
        del answer
        assert freed() is None
    finally:
        gc.enable()
        conn.close()
    with Client(server.path) as fleet:
        with pytest.raises(UnavailableError, match="unreadable answer"):
            fleet._send(b.Call("GET", "/v1/up"))
        for own in ({"content-length": "5"}, {"Transfer-Encoding": "chunked"}):
            with pytest.raises(UnavailableError, match="cannot send"):
                fleet._send(b.Call("POST", "/v1/x", json={}, headers=own))
    early = lane.Answer()
    early.feed(OK)
    early.release(sent=False)
    assert early.complete and not early.keep_alive


def test_a_closed_client_takes_no_call(serve: Callable[..., Server]) -> None:
    server = serve()
    fleet = Client(server.path)
    fleet._send(b.Call("GET", "/v1/x"))
    fleet.close()
    with pytest.raises(RuntimeError):
        fleet._send(b.Call("GET", "/v1/x"))  # as httpx says it
    assert server.accepted == 1


def test_a_tcp_lane_tries_each_address_and_keeps_what_it_may_open() -> None:
    """The gateway's lane to a node: an address that refuses is passed over for the next (as httpx
    does), a connection opened after the lane closed fails typed, and idle connections are kept up
    to the lane's own bound (a gateway closing them after each burst piles up TIME_WAIT)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    refused = closed.getsockname()[1]
    closed.close()

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _answer_all(c), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        real = loop.getaddrinfo

        async def two(host: str, p: int, **kw: object) -> list[tuple[object, ...]]:
            first = await real("127.0.0.1", refused, type=socket.SOCK_STREAM)
            return [*first, *(await real("127.0.0.1", port, type=socket.SOCK_STREAM))]

        loop.getaddrinfo = two  # type: ignore[method-assign,assignment]
        conn = await lane.AsyncConnection.open_tcp("node.test", 1, 5.0)
        answer = await conn.exchange(lane.encode(b.Call("GET", "/v1/x"), {"host": "node.test"}), 5.0)
        assert answer.status == 200 and bytes(answer.body) == b'{"ok":true}'
        conn.close()
        loop.getaddrinfo = real  # type: ignore[method-assign]

        pool: lane.Lane[lane.AsyncConnection] = lane.Lane(f"http://127.0.0.1:{port}", {}, limit=40, idle=40)

        def opener() -> Awaitable[lane.AsyncConnection]:
            return lane.AsyncConnection.open_tcp("127.0.0.1", port, 5.0)

        calls = [pool.call(lane.encode(b.Call("GET", "/v1/x"), pool.headers), opener, 5.0) for _ in range(40)]
        assert all(a is not None and a.status == 200 for a in await asyncio.gather(*calls))
        assert len(pool._idle) == 40  # all kept for the next burst
        pool.close()
        late = lane.Lane[lane.AsyncConnection](f"http://127.0.0.1:{port}", {})
        late.close()
        assert await late.call(lane.encode(b.Call("GET", "/v1/x"), late.headers), opener, 5.0) is None

    asyncio.run(main())
    listener.close()


def _answer_all(conn: socket.socket) -> None:
    buf = b""
    with conn, contextlib.suppress(OSError):
        while True:
            data = conn.recv(65536)
            if not data:
                return
            buf += data
            while b"\r\n\r\n" in buf:
                _, _, buf = buf.partition(b"\r\n\r\n")
                conn.sendall(OK)


def test_a_gateway_keeps_httpx_for_nodes_the_lane_cannot_write_to() -> None:
    from sandfleet.cluster.membership import Membership

    members = Membership("t0k")
    assert members._lane("http://10.0.0.1:8600") is not None
    for url in ("https://10.0.0.1:8600", "http://10.0.0.1:8600/prefix"):
        assert members._lane(url) is None, url
