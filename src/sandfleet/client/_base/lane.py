"""The unix socket's lane: one-response calls to a local daemon without httpx's layers.

A call to the node daemon on its unix socket is most of an RL step's own cost on the caller's side;
httpx (its client, httpcore's pool, h11) took ~0.4 ms of CPU per call there, four fifths of it not
the socket, and h11 alone, written and read directly, still ~75 us. On this lane a request's head is
written here, every name and value checked as h11 checks them (the lane's own headers once, when
first used), and the answer is read by httptools (llhttp, the parser under uvicorn): ~5 us, on a
kept-alive connection. Streams, WebSockets, TCP (TLS, proxies, several gateways) and tests' own
transports keep to httpx; so does any call beyond `MAX_CONNECTIONS` at once (the lane never
queues). Failures are raised as the httpx exceptions the transport mapping already reads
(`map_transport_error`, `request_sent`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import select
import socket
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Generic, TypeVar

import httptools
import httpx

from sandfleet.client._base.wire import Call

MAX_CONNECTIONS = 64  # open at once; a call finding all busy goes through httpx
MAX_IDLE = 16  # kept for the next calls
_CHUNK = 256 * 1024


# What h11 accepts (RFC 9110): a method or a field's name is a token; a field's value is visible
# characters with single spaces or tabs inside; a request target is visible characters.
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(rb"(?:[\x21-\x7e\x80-\xff]+(?:[ \t]+[\x21-\x7e\x80-\xff]+)*)?")
_VISIBLE = re.compile(rb"[\x21-\x7e]+")

Request = tuple[bytes, bytes]  # its head (request line and fields, CRLF CRLF) and its body


def _refused(what: str) -> httpx.LocalProtocolError:
    return httpx.LocalProtocolError(f"cannot send this request: {what}")


@functools.lru_cache(maxsize=4096)
def _target(path: str, query: str) -> bytes:
    """The request target as httpx would write it (its percent-encoding of the path)."""
    raw = httpx.URL(path).raw_path
    target = raw + b"?" + query.encode("ascii") if query else raw
    if not _VISIBLE.fullmatch(target):
        raise _refused(f"illegal target {target!r}")
    return target


def _field(name: str, value: str) -> bytes:
    try:
        key, val = name.encode("ascii"), value.encode("ascii")
    except UnicodeEncodeError:
        raise _refused(f"header {name!r} is not ASCII") from None
    if not _TOKEN.fullmatch(key) or not _VALUE.fullmatch(val):
        raise _refused(f"illegal header {name!r}: {value!r}")
    return key + b": " + val + b"\r\n"


@functools.lru_cache(maxsize=64)
def _fields(items: tuple[tuple[str, str], ...]) -> bytes:
    """A lane's own headers, checked and written once."""
    return b"".join(_field(name, value) for name, value in items)


def encode(call: Call, headers: Mapping[str, str]) -> Request:
    """A call's HTTP/1.1 request: its head (every name and value checked) and its body. `headers`:
    the lane's, lower-case names; a call's own win, whatever their case."""
    body = b""
    own: dict[str, str] = {}
    if call.json is not None:
        body = json.dumps(call.json, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        own["content-type"] = "application/json"
    elif call.content is not None:
        body = call.content
    own.update((k.lower(), v) for k, v in call.headers.items())
    if "transfer-encoding" in own or "content-length" in own:  # the body's framing is the lane's own
        raise _refused("a call's own content-length or transfer-encoding")
    if body or call.method in ("POST", "PUT", "PATCH"):
        own["content-length"] = str(len(body))
    method = call.method.encode("ascii", "replace")
    if not _TOKEN.fullmatch(method) or method == b"HEAD":  # (an answer to HEAD has no body to read)
        raise _refused(f"method {call.method!r} is not sent on the lane")
    query = str(httpx.QueryParams(call.params)) if call.params else ""
    if own.keys() & headers.keys():
        headers = {k: v for k, v in headers.items() if k not in own}
    parts = [method, b" ", _target(call.path, query), b" HTTP/1.1\r\n", _fields(tuple(headers.items()))]
    parts += [_field(name, value) for name, value in own.items()]
    parts.append(b"\r\n")
    return b"".join(parts), body


class Answer:
    """A response as httptools reads it off one connection (`Connection.exchange`)."""

    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.complete = False
        self.keep_alive = False
        self._interim = False  # a 1xx answer before the real one: skipped, as h11 does
        self._framed = False  # a content-length or chunked body (else: read until the daemon closes)
        self._stray = False  # bytes after the answer: the connection is not kept (a desync)
        # The parser calls back into this answer (a reference cycle): dropped once it is read
        # (`release`), so a body is freed with its answer, not at the next garbage collection.
        self._parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self._stray = self._stray or self.complete

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        status = self._parser.get_status_code()
        self._interim = 100 <= status < 200
        if not self._interim and not self.complete:
            self.status = status

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body += body

    def on_message_complete(self) -> None:
        if self._interim or self.complete:
            self._interim, self._framed = False, False
            return
        assert self._parser is not None
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    def next_events(self) -> bool:
        """True while the answer needs more bytes."""
        return not self.complete

    def feed(self, data: bytes) -> None:
        """The next bytes off the connection (b"": the daemon closed its end)."""
        if not data:
            if self.status and not self._framed:  # a body that ends where the connection does
                self.complete, self.keep_alive = True, False
                return
            if self.status:
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
            raise httpx.RemoteProtocolError("the daemon closed the connection before answering")
        assert self._parser is not None, "fed after it was read"
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # (an upgrade: not ours)
            if not self.complete:
                raise httpx.RemoteProtocolError(f"unreadable answer from the daemon: {exc!r}") from None
            self._stray = True
        # kept only if nothing follows the answer
        self.keep_alive = self.keep_alive and not self._stray

    def release(self, *, sent: bool = True) -> None:
        """Done reading (or failed): the parser goes. `sent`: False if the request was cut short (the
        daemon answered early and closed): the connection is never kept then."""
        self._parser = None
        self.keep_alive = self.keep_alive and sent


def _frames(request: Request) -> list[bytes]:
    """What to write: one buffer for a small request; a large one's body apart (never copied)."""
    head, body = request
    return [head + body] if len(body) <= _CHUNK else [head, body]


def _connect_error(path: str, exc: OSError) -> httpx.ConnectError:
    # any failure to connect (no socket, refused, a full backlog, no permission): never sent, and
    # said as the httpx path says it (`map_transport_error`: is the daemon there?)
    return httpx.ConnectError(f"cannot connect to {path}: {exc}")


@contextlib.contextmanager
def _connecting(where: str, sock: socket.socket | None = None) -> Iterator[list[socket.socket]]:
    """Around a connect: the socket (given, or put in the list yielded) closed on any failure, which
    is raised as httpx's (any failure to connect was never sent: `map_transport_error`, `request_sent`)."""
    made: list[socket.socket] = [] if sock is None else [sock]
    try:
        yield made
    except BaseException as exc:
        for s in made:
            s.close()
        if isinstance(exc, TimeoutError):
            raise httpx.ConnectTimeout(f"connecting to {where} timed out") from None
        if isinstance(exc, OSError):
            raise _connect_error(where, exc) from exc
        raise


@contextlib.contextmanager
def _exchanging() -> Iterator[None]:
    """Around a request and its answer: socket failures raised as httpx's."""
    try:
        yield
    except TimeoutError:
        raise httpx.ReadTimeout("the daemon did not answer in time") from None
    except OSError as exc:
        raise httpx.RemoteProtocolError(f"connection to the daemon broke: {exc}") from None


def _open(path: str, timeout: float) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with _connecting(path, sock):
        sock.settimeout(timeout)
        sock.connect(path)
    return sock


def _gone(sock: socket.socket) -> bool:
    """Whether an idle kept-alive connection was closed by the daemon (it restarted, or let it go):
    readable while idle means its end (or stray bytes: unusable either way)."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


class Connection:
    """A blocking connection to the daemon's unix socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    def open(cls, path: str, timeout: float) -> Connection:
        return cls(_open(path, timeout))

    def exchange(self, request: Request, timeout: float) -> Answer:
        """Write the request and read its answer; `timeout` bounds each write and each read (as httpx's
        does): a large transfer that keeps moving is never cut."""
        answer = Answer()
        sent = False
        try:
            with _exchanging():
                self.sock.settimeout(timeout)
                try:
                    for data in _frames(request):
                        view = memoryview(data)
                        while view:  # sendall's timeout would bound the whole body
                            view = view[self.sock.send(view[:_CHUNK]) :]
                    sent = True
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the daemon answered early (an error) and closed: its answer is still to read
                while answer.next_events():
                    answer.feed(self.sock.recv(_CHUNK))
        finally:
            answer.release(sent=sent)
        return answer

    def close(self) -> None:
        self.sock.close()


class AsyncConnection:
    """A connection to the daemon's unix socket for an event loop (non-blocking socket)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @classmethod
    async def open(cls, path: str, timeout: float) -> AsyncConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _connecting(path, sock):
            sock.setblocking(False)
            async with asyncio.timeout(timeout):
                delay = 0.001
                while True:
                    try:
                        sock.connect(path)  # a unix socket connects at once, or its backlog is full
                        break
                    except BlockingIOError:  # (asyncio's sock_connect would take that for connected)
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, 0.05)
        return cls(sock)

    @classmethod
    async def open_tcp(cls, host: str, port: int, timeout: float) -> AsyncConnection:
        """A connection over TCP (the gateway's to a node), its small writes never held back (no Nagle)."""
        loop = asyncio.get_running_loop()
        with _connecting(f"{host}:{port}") as made:
            async with asyncio.timeout(timeout):
                addresses = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                for i, (family, kind, proto, _, address) in enumerate(addresses):  # each in turn, as httpx
                    sock = socket.socket(family, kind, proto)
                    made[:] = [sock]
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    try:
                        await loop.sock_connect(sock, address)
                        break
                    except OSError:
                        sock.close()
                        made.clear()
                        if i == len(addresses) - 1:
                            raise
        return cls(made[0])

    async def exchange(self, request: Request, timeout: float) -> Answer:
        """As `Connection.exchange`: `timeout` bounds each write and each read."""
        loop = asyncio.get_running_loop()
        answer = Answer()
        sent = False
        try:
            with _exchanging():
                try:
                    for data in _frames(request):
                        view = memoryview(data)
                        for i in range(0, len(view), _CHUNK):
                            async with asyncio.timeout(timeout):
                                await loop.sock_sendall(self.sock, view[i : i + _CHUNK])
                    sent = True
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the daemon answered early (an error) and closed: its answer is still to read
                while answer.next_events():
                    async with asyncio.timeout(timeout):
                        data = await loop.sock_recv(self.sock, _CHUNK)
                    answer.feed(data)
        finally:
            answer.release(sent=sent)
        return answer

    def close(self) -> None:
        self.sock.close()


C = TypeVar("C", Connection, AsyncConnection)


class Lane(Generic[C]):
    """The connections of one client to its daemon (`address`: where the caller opens them): idle
    ones kept (last used first), at most MAX_CONNECTIONS open. Thread-safe (a blocking client may be
    shared by threads); a child process after fork() starts with none (it must never write on its
    parent's connections) and a fresh lock. Closed, it takes no call (they go to httpx, which
    refuses them as closed) and the calls on its connections end at once (as httpx's `aclose`)."""

    def __init__(
        self, address: str, headers: Mapping[str, Any], *, limit: int = MAX_CONNECTIONS, idle: int = MAX_IDLE
    ) -> None:
        """`limit`: connections open at once; `idle`: kept between calls (a gateway keeps all it may
        open: a connection closed after each burst leaves a TIME_WAIT entry behind on TCP)."""
        self.address = address
        # httpx's own (user agent, the token), less compression: the daemon never compresses
        self.headers = {"host": "sandfleet", **{k: v for k, v in headers.items() if k != "accept-encoding"}}
        self.limit, self.max_idle = limit, idle
        self._idle: list[C] = []
        self._busy: set[C] = set()
        self._open = 0
        self._closed = False
        self._lock = threading.Lock()
        _LANES.add(self)

    def _forked(self) -> None:
        self._idle, self._busy, self._open, self._lock = [], set(), 0, threading.Lock()  # the parent's

    def take(self) -> C | None:
        """An idle connection, or None: open a new one if `room()` (then `opened`), else use httpx."""
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not _gone(conn.sock):
                    self._busy.add(conn)
                    return conn
                conn.close()
                self._open -= 1
            return None

    def room(self) -> bool:
        """Reserves room for a new connection (give it back with `discard` if none is made)."""
        with self._lock:
            if self._closed or self._open >= self.limit:
                return False
            self._open += 1
            return True

    def opened(self, conn: C) -> None:
        with self._lock:
            self._busy.add(conn)
        if self._closed:
            with contextlib.suppress(OSError):  # already reset: the exchange fails all the same
                conn.sock.shutdown(socket.SHUT_RDWR)

    def put(self, conn: C, answer: Answer) -> None:
        """A connection whose call was answered: kept if the daemon keeps it and room is left."""
        with self._lock:
            self._busy.discard(conn)
            if not self._closed and answer.keep_alive and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
            self._open -= 1
        conn.close()

    def discard(self, conn: C | None) -> None:
        """A connection that failed (or was never made): closed, its room given back."""
        with self._lock:
            self._open -= 1
            if conn is not None:
                self._busy.discard(conn)
        if conn is not None:
            conn.close()

    async def call(
        self: Lane[AsyncConnection],
        request: Request,
        open_: Callable[[], Awaitable[AsyncConnection]],
        timeout: float,
    ) -> Answer | None:
        """`request` on a connection of the lane (`open_` makes one when none is idle); None: all
        its connections are busy (the caller goes through httpx)."""
        conn = self.take()
        if conn is None and not self.room():
            return None
        try:
            if conn is None:
                conn = await open_()
                self.opened(conn)
            answer = await conn.exchange(request, timeout)
        except BaseException:
            self.discard(conn)
            raise
        self.put(conn, answer)
        return answer

    def call_sync(
        self: Lane[Connection], request: Request, open_: Callable[[], Connection], timeout: float
    ) -> Answer | None:
        """`call` for a blocking client."""
        conn = self.take()
        if conn is None and not self.room():
            return None
        try:
            if conn is None:
                conn = open_()
                self.opened(conn)
            answer = conn.exchange(request, timeout)
        except BaseException:
            self.discard(conn)
            raise
        self.put(conn, answer)
        return answer

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
            self._open -= len(idle)
            busy = list(self._busy)
        for conn in idle:
            conn.close()
        for conn in busy:  # their calls read the end and fail (the connection then goes)
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)


_LANES: weakref.WeakSet[Lane[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for lane in list(_LANES):
        lane._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)
