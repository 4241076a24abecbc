"""What the routers share: bounded, checked request bodies (CheckedRoute), error responses, ndjson
streams with heartbeats, and the small helpers of several resources."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import APIRouter, BackgroundTasks, Depends, Header, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.types import ASGIApp

from sandfleet.daemon.api import lean
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.protocol import EventStream
from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    SandboxError,
)
from sandfleet.models import (
    MAX_REF,
    BuildEvent,
    CreateBatchItem,
    CreateBatchResult,
    ErrorBody,
    ErrorResponse,
    ExecEvent,
    FileEvent,
    SandboxInfo,
)
from sandfleet.operations import OPERATIONS, Operation

MAX_FILE_BODY = 256 * 1024**2
MAX_INT64 = 2**63 - 1

if TYPE_CHECKING:
    from sandfleet.daemon.security.tenancy import Tenancy
    from sandfleet.daemon.service import SandboxManager

F = TypeVar("F", bound=Callable[..., Any])
OPERATION = {op.name: op for op in OPERATIONS}

log = logging.getLogger("sandfleet.api")


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": desc}
    for status, desc in (
        (400, "invalid_argument or unsupported"),
        (401, "unauthenticated"),
        (403, "permission_denied"),
        (404, "not_found"),
        (409, "wrong_state"),
        (429, "resource_exhausted"),
        (500, "internal, data_loss"),
        (503, "unavailable"),
        (504, "timeout"),
    )
}


ImageRefParam = Annotated[str, Path(max_length=MAX_REF, description="name:tag")]
ImageRefQuery = Annotated[str, Query(max_length=MAX_REF, description="name:tag")]
MAX_JSON_BODY = 64 * 1024**2  # the largest JSON request (32 MiB of stdin, as base64)
HEARTBEAT = 5.0  # seconds between heartbeat lines on a quiet stream


def error_response(exc: SandboxError) -> JSONResponse:
    return JSONResponse({"error": exc.to_wire()}, status_code=exc.http_status)


def _check_text(value: object) -> None:
    """A JSON value must hold only strings that are valid Unicode: a lone UTF-16 surrogate
    (`"\\ud800"`) decodes into Python but can be neither stored nor answered."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            item.encode("utf-8")  # raises UnicodeEncodeError on a lone surrogate (C speed)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


async def read_capped(request: Request, limit: int, too_large: str) -> bytes:
    """The request body, refused (`too_large`) past `limit` bytes whether or not a Content-Length was sent."""
    if int(request.headers.get("content-length") or 0) > limit:
        raise InvalidArgumentError(too_large)
    data = bytearray()
    async for chunk in request.stream():
        data.extend(chunk)
        if len(data) > limit:
            raise InvalidArgumentError(too_large)
    return bytes(data)


class CheckedRoute(APIRoute):
    """Every JSON body is bounded, strict UTF-8 and free of lone surrogates before FastAPI parses
    it into the request model: bad input is a 400 and never reaches the service."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            has_json = lean.is_json(request.headers.get("content-type", ""))
            if request.method in ("POST", "PUT", "PATCH", "DELETE") and has_json:
                request._body, _value = await checked_json(request)  # FastAPI reads the body from here
            return await handler(request)

        return checked


async def checked_json(request: Request) -> tuple[bytes, Any]:
    """A JSON request's body, bounded, UTF-8 and free of lone surrogates (else a 400), with its value
    (`lean.NOT_JSON` when it is no JSON: FastAPI then says so, as a 400)."""
    body = await read_capped(request, MAX_JSON_BODY, f"request body larger than {MAX_JSON_BODY} bytes")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgumentError(f"request body is not UTF-8 (byte {exc.start})") from None
    try:
        value = lean.json_value(text)
        _check_text(value)
    except RecursionError:
        raise InvalidArgumentError("request body nested too deeply") from None
    except UnicodeEncodeError:
        raise InvalidArgumentError("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)") from None
    return body, value


def stream(events: EventStream[Any], beat: bytes, *, first: BaseModel | None = None) -> StreamingResponse:
    """An ndjson response of `events` (after `first`, a line known already); closing them is the
    response's background task too, so a client that left before the first byte (the body never
    iterated) still releases what they hold."""
    lines = _lines(events, beat)
    if first is not None:
        lines = _after(first.model_dump_json(exclude_none=True).encode() + b"\n", lines)
    return StreamingResponse(lines, media_type="application/x-ndjson", background=BackgroundTask(events.aclose))


async def _after(line: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield line
    async for item in rest:
        yield item


async def _lines(events: AsyncIterator[BaseModel], beat: bytes, interval: float = HEARTBEAT) -> AsyncIterator[bytes]:
    """ndjson lines of `events`, a heartbeat line whenever none came for `interval` seconds (so
    a client can tell a quiet stream from a daemon that stopped), an error line on a SandboxError;
    leaving early (the client went away) closes `events`, which cleans up behind it."""
    it = events.__aiter__()
    nxt: asyncio.Future[BaseModel] = asyncio.ensure_future(it.__anext__())
    try:
        while True:
            done, _ = await asyncio.wait({nxt}, timeout=interval)
            if not done:
                yield beat
                continue
            try:
                ev = nxt.result()
            except StopAsyncIteration:
                return
            yield ev.model_dump_json(exclude_none=True).encode() + b"\n"
            nxt = asyncio.ensure_future(it.__anext__())
    except SandboxError as exc:
        yield json.dumps({"type": "error", "error": exc.to_wire()}).encode() + b"\n"
    except Exception as exc:  # noqa: BLE001 (the stream's status line went out already)
        wire = to_wire_error(exc)
        if isinstance(wire, InternalError):
            log.exception("stream failed")
        yield json.dumps({"type": "error", "error": wire.to_wire()}).encode() + b"\n"
    finally:
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


def parse_labels(label: list[str]) -> dict[str, str]:
    out = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"label filter must be key=value, got {item!r}")
        out[key] = value
    return out


def batch_result(results: list[SandboxInfo | SandboxError]) -> CreateBatchResult:
    return CreateBatchResult(
        results=[
            CreateBatchItem(error=ErrorBody.model_validate(r.to_wire()))
            if isinstance(r, SandboxError)
            else CreateBatchItem(sandbox=r)
            for r in results
        ]
    )


NDJSON: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/x-ndjson": {}}, "description": "one JSON object per line"}
}
RAW_BODY = {"requestBody": {"content": {"application/octet-stream": {}}, "required": False}}
EXEC_BEAT = ExecEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"
FILE_BEAT = FileEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"
BUILD_BEAT = BuildEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"


# A create a cluster gateway passed on: the node's answer goes to the gateway, not to the caller, so
# the gateway acknowledges it (POST /v1/sandboxes/ack) once its own caller has the answer.
Forwarded = Annotated[str | None, Header(alias="x-sandfleet-forwarded", include_in_schema=False)]


def acked(node: SandboxManager, background: BackgroundTasks, ids: list[str], forwarded: str | None = None) -> None:
    """Once the answer naming these sandboxes has gone out: they were heard (see `ack`); not for a
    `forwarded` create (its gateway acknowledges it)."""
    if forwarded is None:
        background.add_task(node.core.ack, ids)


async def file_body(request: Request) -> bytes:
    return await read_capped(request, MAX_FILE_BODY, f"body larger than {MAX_FILE_BODY} bytes; upload a tar in parts")


class Api:
    """What the routers are made from: the node's concerns (`node`), the calls that depend on the
    caller's project (`tenancy`), and `route`, which registers a handler as the operation declared
    under its name in sandfleet/operations.py."""

    def __init__(self, node: SandboxManager, tenancy: Tenancy) -> None:
        self.node = node
        self.tenancy = tenancy
        self.registered: set[str] = set()
        # (method, path, answer given the router's dispatch): the operations `lean` serves
        self.lean: list[tuple[str, str, Callable[[ASGIApp], ASGIApp]]] = []
        self.paths: list[tuple[str, str]] = []  # (method, path) of every route so far, in the router's order

    def route(self, r: APIRouter, name: str, **extra: Any) -> Callable[[F], F]:
        """Register the decorated handler on `r` as operation `name`: its method(s), path, answer and
        status as declared, and (with projects configured) the dependency that scopes it to the caller
        (`Tenancy.admit`). `extra`: what only the route knows (a response class, OpenAPI extras)."""
        op = OPERATION[name]
        options = set(extra)  # the caller's, for `lean.body_model`
        if name in self.registered:
            raise RuntimeError(f"operation {name} has two handlers")
        self.registered.add(name)
        if op.answer is not None:
            extra.setdefault("response_model", op.answer)
        if op.status != 200:
            extra.setdefault("status_code", op.status)
        if self.tenancy.iam is not None:
            extra["dependencies"] = [Depends(self._admits(op))]

        def register(fn: F) -> F:
            for method in op.methods:
                # Several methods: one operation each (OpenAPI wants unique ids), `to_port_get`, ...
                one: dict[str, Any] = {}
                if len(op.methods) > 1:
                    one["operation_id"] = f"{op.route_name}_{method.lower()}"
                r.add_api_route(op.path, fn, methods=[method], name=op.route_name, **one, **extra)
            # Lean stands in for a route that is FastAPI's as it is (CheckedRoute, no dependency of
            # its router's own) and that no earlier route can take a call from (the router's first
            # match answers).
            plain = r.route_class is CheckedRoute and not r.dependencies
            body = lean.body_model(op, fn, options) if plain else None
            method = op.methods[0]
            if body is not None and not any(m == method and lean.overlaps(p, op.path) for m, p in self.paths):
                self.lean.append((method, op.path, lean.lean_app(op, fn, body, self.tenancy, checked_json)))
            self.paths += [(m, op.path) for m in op.methods]
            return fn

        return register

    def _admits(self, op: Operation) -> Callable[[Request], Coroutine[Any, Any, None]]:
        tenancy = self.tenancy

        async def admitted(request: Request) -> None:
            await tenancy.admit(op, request.path_params)

        return admitted

    def check_complete(self) -> None:
        """Every declared operation has its handler (a declaration without one is a mistake)."""
        missing = sorted(set(OPERATION) - self.registered)
        if missing:
            raise RuntimeError(f"declared operations without a route: {missing}")
