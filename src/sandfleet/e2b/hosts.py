"""E2B's sandbox hosts, `<port>-<sandbox id>.<domain>`: what `get_host(port)` names, and where
E2B's SDK sends envd's calls when it is given a domain and no sandbox URL. A wildcard name for the
domain pointing at the layer (and a TLS terminator: the SDK speaks https to these hosts) makes them
reach it; the Host header says the rest:

- envd's port (49983) and the interpreter's (49999) are the layer's own routes, for the sandbox the
  host names (as the E2b-Sandbox-Id header names it otherwise);
- any other port: the request is passed to the server on that port in the sandbox, through
  sandfleet's `expose` and its HTTP route, with the caller's key (E2B-Traffic-Access-Token, the
  header E2B's SDK sends for a sandbox without public traffic, or X-Access-Token). The layer holds
  no credential of its own: a port is never reached without the key of the sandbox's project.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from urllib.parse import quote

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from sandfleet.e2b._upstream import Upstream, edge_error, envd_key, owner
from sandfleet.errors import InvalidArgumentError, SandboxError, UnauthenticatedError

ENVD_PORT = 49983
INTERPRETER_PORT = 49999
# `<port>-<a sandfleet sandbox id>.`: nothing else is taken for a sandbox's host (a layer named
# `1-2-3-4.sslip.io` is not "port 1 of sandbox 2-3-4").
_HOST = re.compile(r"(\d{1,5})-(sb-[0-9a-f]{16})\.")
_DOT_SEGMENT = re.compile(rb"(?:^|/)(?:\.|%2e){1,2}(?:/|$)", re.IGNORECASE)
_BODILESS = ("GET", "HEAD", "OPTIONS", "DELETE", "TRACE")
# Headers that are the hop's, not the request's (RFC 9110 7.6.1), and the caller's credentials.
_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
    b"host",
    b"authorization",
    b"x-access-token",
    b"e2b-traffic-access-token",
}
EXPOSED_FOR = 60.0  # seconds a port once exposed is not asked for again
MAX_EXPOSED = 4096


def sandbox_host(host: str) -> tuple[int, str] | None:
    """(port, sandbox id) of a sandbox's host name, None for another name."""
    m = _HOST.match(host)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        return None
    return int(m.group(1)), m.group(2)


class HostRouting:
    """ASGI: a request to a sandbox's host goes to that sandbox's port; any other to `app`."""

    def __init__(self, app: ASGIApp, upstream: Upstream) -> None:
        self.app = app
        self.upstream = upstream
        # Every tenant's port traffic shares this pool: wide, so long streams of some do not starve others.
        self._http = httpx.AsyncClient(
            base_url=upstream.url,
            timeout=httpx.Timeout(upstream.timeout, read=None),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
        )
        self._exposed: OrderedDict[tuple[str, str, int], float] = OrderedDict()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = None
        if scope["type"] in ("http", "websocket"):
            host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            target = sandbox_host(host)
        if target is None:
            await self.app(scope, receive, send)
            return
        port, sandbox_id = target
        if port in (ENVD_PORT, INTERPRETER_PORT):
            headers = [(k, v) for k, v in scope["headers"] if k != b"e2b-sandbox-id"]
            headers.append((b"e2b-sandbox-id", sandbox_id.encode()))
            await self.app({**scope, "headers": headers}, receive, send)
            return
        if scope["type"] != "http":  # a WebSocket to a sandbox's port: not passed on (yet)
            await send({"type": "websocket.close", "code": 1008})
            return
        response = await self._to_port(Request(scope, receive), sandbox_id, port)
        await response(scope, receive, send)

    async def _to_port(self, request: Request, sandbox_id: str, port: int) -> Response:
        key = envd_key(request.headers)
        try:
            if not key:
                raise UnauthenticatedError(
                    "a sandbox's port is reached with its project's key in E2B-Traffic-Access-Token"
                )
            await self._expose(key, sandbox_id, port)
        except SandboxError as exc:
            return edge_error(exc)
        # The path and query as the caller sent them (never decoded and normalised again: a `..`
        # must not climb out of the port's route into the rest of sandfleet's API with the key).
        raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
        if _DOT_SEGMENT.search(raw) or b"%2f" in raw.lower() or b"\\" in raw:
            return edge_error(InvalidArgumentError("a path of a sandbox's port has no dot segments or encoded slashes"))
        query: bytes = request.scope.get("query_string", b"")
        target = f"/v1/sandboxes/{quote(sandbox_id, safe='')}/ports/{port}".encode() + raw
        url = self._http.base_url.copy_with(raw_path=target + (b"?" + query if query else b""))
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
        headers.append((b"authorization", f"Bearer {key}".encode()))
        if b"accept-encoding" not in {k.lower() for k, _ in headers}:  # not httpx's: the body passes as it is
            headers.append((b"accept-encoding", b"identity"))
        has_body = request.method not in _BODILESS or "content-length" in request.headers
        sent = self._http.build_request(
            request.method, url, headers=headers, content=request.stream() if has_body else None
        )
        try:
            answer = await self._http.send(sent, stream=True)
        except httpx.HTTPError:
            return JSONResponse({"code": 502, "message": f"port {port} did not answer"}, status_code=502)
        response = StreamingResponse(_body(answer), status_code=answer.status_code)
        response.raw_headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in _HOP]
        response.background = BackgroundTask(answer.aclose)  # a caller gone before the first byte too
        return response

    async def _expose(self, key: str, sandbox_id: str, port: int) -> None:
        """The port exposed (an idempotent call of sandfleet's), at most once a minute per key."""
        name = (owner(key), sandbox_id, port)
        now = time.monotonic()
        if self._exposed.get(name, 0.0) > now:
            self._exposed.move_to_end(name)
            return
        await self.upstream.sandbox(key, sandbox_id).expose(port)
        self._exposed[name] = now + EXPOSED_FOR
        while len(self._exposed) > MAX_EXPOSED:
            self._exposed.popitem(last=False)

    async def aclose(self) -> None:
        await self._http.aclose()


async def _body(answer: httpx.Response) -> AsyncIterator[bytes]:
    """The port's answer as it comes; its connection closed at the end, or when the caller goes."""
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:
        await answer.aclose()
