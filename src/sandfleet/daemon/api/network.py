"""Network: a sandbox's egress policy, its exposed ports (and HTTP to them), the node's audit stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Annotated

import h11
from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import StreamingResponse

from sandfleet.daemon.api.common import HEARTBEAT, NDJSON, Api, CheckedRoute
from sandfleet.errors import UnavailableError
from sandfleet.models import (
    AuditList,
    AuditQuery,
    AuditRecord,
    ExposedPort,
    ExposedPortList,
    ExposeRequest,
    IdList,
    NetworkManyRequest,
    NetworkUpdate,
    Ok,
    SandboxInfo,
)

# Headers that describe one hop, or carry the caller's credentials for the daemon (its token, the
# cookies of the daemon's origin): never passed on.
_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"authorization",
        b"cookie",
        b"host",
        b"content-length",
    }
)
# What a sandbox's server answers that would act on the daemon's origin (the console's and the API's)
# beyond this one answer, whatever the document's CSP: state the browser keeps for the origin
# (cookies, wiped storage, service worker scopes, HSTS, alternative services, origin-keyed agent
# clusters, client hints, network error reports), credentials asked for on it (a Basic prompt, whose
# answer the browser would send with every later call), other origins let in on it (CORS, timing),
# fetches made on it (Link preloads, Refresh). Dropped; what binds the answer alone (its own CSP,
# frame options, COOP/COEP/CORP, permissions) is passed on.
_ORIGIN_WIDE = frozenset(
    {
        b"set-cookie",
        b"set-cookie2",
        b"clear-site-data",
        b"service-worker-allowed",
        b"strict-transport-security",
        b"alt-svc",
        b"origin-agent-cluster",
        b"accept-ch",
        b"critical-ch",
        b"nel",
        b"report-to",
        b"reporting-endpoints",
        b"www-authenticate",
        b"timing-allow-origin",
        b"link",
        b"refresh",
        b"supports-loading-mode",
        b"public-key-pins",
        b"public-key-pins-report-only",
        b"expect-ct",
    }
)
RESPONSE_TIMEOUT = 300.0  # seconds a server in a sandbox may take to start answering
CHUNK = 256 * 1024


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "set_network")
    async def set_network(sandbox_id: str, req: NetworkUpdate) -> SandboxInfo:
        return await node.networking.set_network(sandbox_id, req.network)

    @api.route(r, "set_network_many")
    async def set_network_many(req: NetworkManyRequest) -> IdList:
        return IdList(sandboxes=await tenancy.set_network_many(req.labels, req.network))

    @api.route(r, "expose")
    async def expose(sandbox_id: str, req: ExposeRequest) -> ExposedPort:
        return await node.networking.expose(sandbox_id, req.port)

    @api.route(r, "list_exposed")
    async def list_exposed(sandbox_id: str) -> ExposedPortList:
        return ExposedPortList(ports=await node.networking.list_exposed(sandbox_id))

    @api.route(r, "unexpose")
    async def unexpose(sandbox_id: str, port: Annotated[int, PathParam(ge=1, le=65535)]) -> Ok:
        await node.networking.unexpose(sandbox_id, port)
        return Ok()

    @api.route(r, "audit")
    async def audit(
        since: Annotated[int, Query(ge=0, le=2**62, description="records with a greater seq")] = 0,
        since_time: Annotated[float | None, Query(ge=0, le=2**40, description="records from this time")] = None,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
        kind: Annotated[list[str], Query(max_length=32, description="only these kinds (repeatable)")] = [],  # noqa: B006
        sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
        newest: Annotated[
            bool, Query(description="the last `limit` matching records (oldest first), not the first")
        ] = False,
    ) -> AuditList:
        q = AuditQuery(
            since=since,
            since_time=since_time,
            limit=limit,
            kinds=[k[:64] for k in kind] or None,
            sandbox_id=sandbox_id,
            newest=newest,
        )
        records = await node.read_audit(q)
        return AuditList(records=records, last_seq=records[-1].seq if records else since)

    @api.route(r, "follow_audit", response_class=StreamingResponse, responses=NDJSON)
    async def follow_audit(
        since: Annotated[int, Query(ge=0, le=2**62, description="records with a greater seq")] = 0,
        since_time: Annotated[float | None, Query(ge=0, le=2**40, description="records from this time")] = None,
        kind: Annotated[list[str], Query(max_length=32, description="only these kinds (repeatable)")] = [],  # noqa: B006
        sandbox_id: Annotated[str | None, Query(max_length=64)] = None,
    ) -> StreamingResponse:
        """What `GET /v1/audit` gives, then each record as it is recorded (JSON lines, a heartbeat line
        every 5 s of silence), until the client leaves."""
        q = AuditQuery(since=since, since_time=since_time, kinds=[k[:64] for k in kind] or None, sandbox_id=sandbox_id)
        # Asked here, not in the body's generator: a refusal (who may read the audit) is the answer's
        # status, not a connection reset once the 200 went out.
        return StreamingResponse(_audit_lines(node.follow_audit(q, HEARTBEAT)), media_type="application/x-ndjson")

    return r


def port_router(api: Api) -> APIRouter:
    """HTTP to an exposed port: a plain route (the body streams through, whatever its type)."""
    r = APIRouter()
    node = api.node

    async def to_port(
        sandbox_id: str, port: Annotated[int, PathParam(ge=1, le=65535)], path: str, request: Request
    ) -> StreamingResponse:
        reader, writer = await node.networking.open_port(sandbox_id, port)
        try:
            conn = h11.Connection(h11.CLIENT)
            headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP]
            headers.append((b"host", f"127.0.0.1:{port}".encode()))
            has_body = request.method not in ("GET", "HEAD", "OPTIONS") or "transfer-encoding" in request.headers
            length = request.headers.get("content-length")
            if length is not None:
                headers.append((b"content-length", length.encode()))
            elif has_body:
                headers.append((b"transfer-encoding", b"chunked"))
            headers.append((b"connection", b"close"))
            target = _target(request, port)
            writer.write(conn.send(h11.Request(method=request.method, target=target, headers=headers)))
            if length is not None or has_body:
                async for chunk in request.stream():
                    if chunk:
                        writer.write(conn.send(h11.Data(data=chunk)))
                        await writer.drain()
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            async with asyncio.timeout(RESPONSE_TIMEOUT):
                head = await _next(conn, reader)
                while isinstance(head, h11.InformationalResponse):
                    head = await _next(conn, reader)
            if not isinstance(head, h11.Response):
                raise UnavailableError(f"port {port} of sandbox {sandbox_id} closed without an HTTP answer")
        except (h11.ProtocolError, ConnectionError, TimeoutError, OSError) as exc:
            writer.transport.abort()
            raise UnavailableError(f"port {port} of sandbox {sandbox_id}: no HTTP answer ({exc})") from exc
        except BaseException:
            writer.transport.abort()
            raise
        resp = StreamingResponse(_body(conn, reader, writer), status_code=head.status_code)
        resp.raw_headers = [(k, v) for k, v in head.headers if _answered(k.lower())]
        # What a sandbox serves shares the API's origin (and the console's): as a sandboxed document
        # it gets an opaque origin of its own, so its scripts cannot read the console's token.
        resp.raw_headers.append((b"content-security-policy", SANDBOXED))
        return resp

    # One operation per method (OpenAPI wants unique operation ids): `to_port_get`, ...
    summary = "HTTP to a server on an exposed port of the sandbox (the API's authentication applies)"
    api.route(r, "to_port", response_class=StreamingResponse, summary=summary)(to_port)
    return r


SANDBOXED = b"sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"


def _target(request: Request, port: int) -> bytes:
    """The request's target past `.../ports/{port}`, as the caller sent it (still percent-encoded:
    the server in the sandbox decodes it, and a space or a `?` in a name arrives as it was meant)."""
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    rest = raw.split(b"/ports/%d" % port, 1)[-1] or b"/"
    query: bytes = request.scope.get("query_string", b"")
    return rest + (b"?" + query if query else b"")


def _answered(name: bytes) -> bool:
    """Whether a header (lower case) of a sandbox's answer reaches the caller."""
    if name == b"content-length":
        return True
    return name not in _HOP and name not in _ORIGIN_WIDE and not name.startswith(b"access-control-")


async def _next(conn: h11.Connection, reader: asyncio.StreamReader) -> object:
    while True:
        ev = conn.next_event()
        if ev is not h11.NEED_DATA:
            return ev
        conn.receive_data(await reader.read(CHUNK))


async def _body(
    conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> AsyncIterator[bytes]:
    try:
        while True:
            ev = await _next(conn, reader)
            if isinstance(ev, h11.Data):
                yield bytes(ev.data)
            else:
                return
    except (h11.ProtocolError, ConnectionError, OSError):
        return
    finally:
        writer.transport.abort()


async def _audit_lines(it: AsyncIterator[AuditRecord | None]) -> AsyncIterator[bytes]:
    beat = json.dumps({"type": "heartbeat"}).encode() + b"\n"
    try:
        async for rec in it:
            yield beat if rec is None else rec.model_dump_json().encode() + b"\n"
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
