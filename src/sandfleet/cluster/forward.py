"""Passing a caller's request on to a node, and reading nodes' answers, over HTTP.

A call naming a sandbox goes to its node as it came (method, path, query, the caller's own
credentials, the body streamed), and the node's answer comes back as it went (status, headers,
body streamed): exec streams, file transfers and exposed ports need no code of their own here, and
the node, not the gateway, decides what the caller may do. Only hop-by-hop headers are dropped.
"""

from __future__ import annotations

import functools
from typing import Any

import httpx
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from sandfleet.client._base import Answer, AsyncConnection, Call, Lane, encode
from sandfleet.cluster.json_codec import dumps, loads
from sandfleet.cluster.membership import Node
from sandfleet.errors import SandboxError, SandboxLostError, UnavailableError, error_from_wire

# RFC 9110 7.6.1, and what the HTTP client sets itself.
_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "host"}
)


def _unreachable(node: Node, exc: Exception) -> SandboxError:
    if node.lost:
        return SandboxLostError(f"node {node.key} died or left the cluster: what it held is gone")
    err = UnavailableError(f"node {node.key} unreachable: {type(exc).__name__}")
    # Whether the node may have got the request: a create is placed again elsewhere only if not.
    err.sent = not isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)  # type: ignore[attr-defined]
    return err


def passed_headers(request: Request, *, drop_length: bool = False) -> list[tuple[str, str]]:
    out = []
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in _HOP or (drop_length and lk == "content-length"):
            continue
        out.append((k, v))
    return out


SMALL = 1024**2  # bodies up to this size are read whole: fewer event-loop turns than a relay
# A one-answer call to a node (create, list, stop by label ...): a node that goes silent this long is
# unavailable. Streams passed on have no such bound (the node bounds them: exec timeouts, heartbeats).
CALL_TIMEOUT = httpx.Timeout(connect=5.0, read=300.0, write=60.0, pool=30.0)
# A question every node is asked before a create or a trajectory is placed (which holds this key, this
# trajectory): a node silent this long is taken as silent, so one hung daemon costs seconds, not minutes.
LOOKUP_TIMEOUT = httpx.Timeout(3.0)
# The gateway's own calls on its control client (acks, drain): small answers, never queued behind callers'.
CONTROL_TIMEOUT = httpx.Timeout(connect=5.0, read=10.0, write=10.0, pool=5.0)


async def forward(
    node: Node,
    request: Request,
    *,
    body: bytes | None = None,
    path: str | None = None,
    headers: dict[str, str] | None = None,
    whole: bool = False,
) -> Response:
    """The caller's request, sent to `node` (with `headers` added); the node's answer, streamed back
    (read whole when it is small and sized: most answers are a few hundred bytes of JSON; and always
    with `whole`: an answer the gateway must read, whose size its request bounds)."""
    # The path as the caller sent it (still percent-encoded: an exposed port's path may hold %2F).
    raw = path or request.scope.get("raw_path", b"").decode("latin-1") or request.url.path
    url = httpx.URL(raw + (f"?{request.url.query}" if request.url.query else ""))
    length = request.headers.get("content-length")
    if body is None and (length is None and request.method in ("GET", "HEAD", "DELETE")):
        body = b""  # nothing to stream: no chunked empty body on a GET
    elif body is None and length is not None and length.isdigit() and int(length) <= SMALL:
        body = await request.body()
    content: Any = body if body is not None else request.stream()
    req = node.http.build_request(
        request.method,
        url,
        headers=passed_headers(request, drop_length=body is not None),
        content=content,
    )
    # The caller's credentials, not the gateway's: the node decides what this caller may do.
    if "authorization" not in request.headers:
        req.headers.pop("authorization", None)
    req.headers.update(headers or {})
    try:
        resp = await node.http.send(req, stream=True)
    except httpx.HTTPError as exc:
        raise _unreachable(node, exc) from exc
    back = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
    size = resp.headers.get("content-length")
    if whole or (size is not None and size.isdigit() and int(size) <= SMALL):
        try:
            data = await resp.aread()
        except httpx.HTTPError as exc:
            raise _unreachable(node, exc) from exc
        finally:
            await resp.aclose()
        back.pop("content-length", None)
        back.pop("content-encoding", None)  # aread() decoded it
        return Response(data, status_code=resp.status_code, headers=back)
    return StreamingResponse(
        resp.aiter_raw(), status_code=resp.status_code, headers=back, background=BackgroundTask(resp.aclose)
    )


async def call_json(
    node: Node,
    method: str,
    path: str,
    *,
    request: Request | None = None,
    json_body: Any = None,
    params: Any = None,
    headers: dict[str, str] | None = None,
    timeout: httpx.Timeout = CALL_TIMEOUT,
    control: bool = False,
) -> Any:
    """One call to a node whose answer is JSON: the parsed answer, or the node's error raised.
    With `request`, the call carries that caller's credentials (the node scopes what it answers);
    `control`: one of the gateway's own (an ack), on the node's control client."""
    hdrs = dict(headers or {})
    content = None
    if json_body is not None:
        content = dumps(json_body)
        hdrs["content-type"] = "application/json"
    if request is not None:
        auth = request.headers.get("authorization")
        if auth is None:
            raise UnavailableError("no credentials to pass on")  # the gateway always has a caller's
        hdrs["authorization"] = auth
    try:
        answer = None
        if node.lane is not None and not control:
            answer = await _by_lane(node.lane, Call(method, path, params, content=content, headers=hdrs), timeout)
        if answer is not None:
            status, body = answer.status, bytes(answer.body)
        else:
            http = node.control if control else node.http
            r = await http.request(method, path, content=content, params=params, headers=hdrs, timeout=timeout)
            status, body = r.status_code, r.content
    except httpx.HTTPError as exc:
        raise _unreachable(node, exc) from exc
    try:
        data = loads(body) if body else None
    except ValueError as exc:
        raise UnavailableError(f"node {node.key} answered HTTP {status} without JSON") from exc
    if status >= 400:
        raise error_from_wire(data, status=status)
    return data


@functools.lru_cache(maxsize=1024)
def _host_port(url: str) -> tuple[str, int]:
    target = httpx.URL(url)
    return target.host, target.port or 80


async def _by_lane(lane: Lane[AsyncConnection], call: Call, timeout: httpx.Timeout) -> Answer | None:
    """A one-answer call on the node's lane (as the SDK's, over TCP); None: all its connections busy."""
    host, port = _host_port(lane.address)
    connect = timeout.connect or 5.0
    return await lane.call(
        encode(call, lane.headers), lambda: AsyncConnection.open_tcp(host, port, connect), timeout.read or 1e9
    )


def json_response(data: Any, status: int = 200, background: BackgroundTask | None = None) -> Response:
    return Response(
        dumps(data, allow_nan=True), status_code=status, media_type="application/json", background=background
    )
