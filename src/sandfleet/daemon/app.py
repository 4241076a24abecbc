"""The HTTP API (FastAPI). Thin: parse, call the manager, map errors to `{code, message, retryable}`.

The OpenAPI document FastAPI derives from these routes is checked into docs/openapi.json; a test
fails when the two drift apart, and tests validate live responses against the checked-in copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, BinaryIO, Literal, cast

from fastapi import BackgroundTasks, Body, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandfleet import __version__
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.metrics import Metrics
from sandfleet.daemon.protocol import EventStream, SandboxService
from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    UnauthenticatedError,
)
from sandfleet.models import (
    MAX_PATH,
    MAX_REF,
    BuildEvent,
    CreateBatchItem,
    CreateBatchRequest,
    CreateBatchResult,
    ErrorBody,
    ErrorResponse,
    EventList,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileEvent,
    FileInfo,
    FileList,
    ForkRequest,
    GcResult,
    Health,
    IdList,
    ImageInfo,
    ImageList,
    ImportRequest,
    LabelsRequest,
    LifetimeManyRequest,
    LifetimeUpdate,
    Ok,
    PackRequest,
    ProcessInfo,
    ProcessList,
    RecipeBuildRequest,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
    SandboxState,
    SessionCreateRequest,
    SessionInfo,
    SessionList,
    SessionRunRequest,
    SnapshotInfo,
    SnapshotList,
    SnapshotRequest,
    StopManyRequest,
    StopManyResult,
    StopRequest,
    Usage,
)

MAX_FILE_BODY = 256 * 1024**2
MAX_INT64 = 2**63 - 1
log = logging.getLogger("sandfleet.api")


_ERRORS: dict[int | str, dict[str, Any]] = {
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


def _error_response(exc: SandboxError) -> JSONResponse:
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


async def _read_capped(request: Request, limit: int, too_large: str) -> bytes:
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
            has_json = "json" in request.headers.get("content-type", "")
            if request.method in ("POST", "PUT", "PATCH", "DELETE") and has_json:
                body = await _read_capped(request, MAX_JSON_BODY, f"request body larger than {MAX_JSON_BODY} bytes")
                try:
                    text = body.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise InvalidArgumentError(f"request body is not UTF-8 (byte {exc.start})") from None
                if text.strip():
                    try:
                        _check_text(json.loads(text))
                    except UnicodeEncodeError:
                        raise InvalidArgumentError(
                            "request body holds a lone UTF-16 surrogate (\\ud800-\\udfff)"
                        ) from None
                    except ValueError:
                        pass  # not JSON: FastAPI says so, as a 400
                request._body = body  # FastAPI reads the body from here
            return await handler(request)

        return checked


def _stream(events: EventStream[Any], beat: bytes) -> StreamingResponse:
    """An ndjson response of `events`; closing them is the response's background task too, so a client
    that left before the first byte (the body never iterated) still releases what they hold."""
    return StreamingResponse(
        _lines(events, beat), media_type="application/x-ndjson", background=BackgroundTask(events.aclose)
    )


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
        log.exception("stream failed")
        yield json.dumps({"type": "error", "error": InternalError(f"stream failed: {exc}"[:300]).to_wire()}).encode()
    finally:
        if not nxt.done():
            nxt.cancel()
            with contextlib.suppress(BaseException):
                await nxt
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()


def _parse_labels(label: list[str]) -> dict[str, str]:
    out = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"label filter must be key=value, got {item!r}")
        out[key] = value
    return out


def create_app(service: SandboxService, metrics: Metrics, *, token: str | None = None) -> FastAPI:
    """The HTTP API over any `SandboxService` (the node's, or later a gateway's)."""
    app = FastAPI(
        title="sandfleet",
        version=__version__,
        responses=_ERRORS,
        description="Elastic sandboxes for agentic RL: the node daemon's API.",
    )
    app.router.route_class = CheckedRoute

    @app.exception_handler(SandboxError)
    async def _sandbox_error(_req: Request, exc: SandboxError) -> JSONResponse:
        metrics.http_errors.labels(code=exc.code).inc()
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")[:100]
            parts.append(f"{loc}: {str(err.get('msg'))[:300]}")  # never the (unbounded) input itself
        metrics.http_errors.labels(code="invalid_argument").inc()
        return _error_response(InvalidArgumentError("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(NotFoundError("no such endpoint"))
        if exc.status_code == 405:
            return _error_response(InvalidArgumentError("method not allowed on this endpoint"))
        if 400 <= exc.status_code < 500:  # e.g. a body FastAPI could not parse
            return _error_response(InvalidArgumentError(f"bad request: {exc.detail}"[:300]))
        return _error_response(InternalError(str(exc.detail)[:300]))

    @app.middleware("http")
    async def _unexpected(request: Request, call_next: Any) -> Any:
        # A middleware, not an exception handler: Starlette re-raises after running an
        # Exception handler, and uvicorn then drops the client's keep-alive connection.
        try:
            return await call_next(request)
        except Exception as exc:
            wire = to_wire_error(exc)
            if isinstance(wire, InternalError):
                log.exception("unexpected error serving %s %s", request.method, request.url.path)
            else:
                log.warning("%s serving %s %s: %s", wire.code, request.method, request.url.path, exc)
            metrics.http_errors.labels(code=wire.code).inc()
            return _error_response(wire)

    def openapi() -> dict[str, Any]:
        """FastAPI's document, minus its default 422 responses: validation errors here are 400s."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    if token:

        @app.middleware("http")
        async def _auth(request: Request, call_next: Any) -> Any:
            header = request.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {token}".encode()):
                return _error_response(UnauthenticatedError("missing or invalid bearer token"))
            return await call_next(request)

    # -- node -----------------------------------------------------------------------------------

    @app.get("/v1/health", response_model=Health)
    async def health() -> Health:
        return await service.health()

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        body, media_type = await service.metrics_text()
        return Response(body, media_type=media_type)

    # -- sandboxes ------------------------------------------------------------------------------

    def _acked(background: BackgroundTasks, ids: list[str]) -> None:
        """Once the answer naming these sandboxes has gone out: they were heard (see `ack`)."""
        background.add_task(service.ack, ids)

    @app.post("/v1/sandboxes", response_model=SandboxInfo, status_code=201)
    async def create(
        spec: SandboxSpec,
        background: BackgroundTasks,
        idempotency_key: Annotated[
            str | None,
            Header(
                alias="Idempotency-Key",
                max_length=128,
                pattern=r"^[A-Za-z0-9._:-]{1,128}$",
                description="a retried create with the same key returns the sandbox the first one made",
            ),
        ] = None,
    ) -> SandboxInfo:
        info = await service.create(spec, idempotency_key=idempotency_key)
        _acked(background, [info.id])
        return info

    @app.post("/v1/sandboxes/batch", response_model=CreateBatchResult)
    async def create_batch(req: CreateBatchRequest, background: BackgroundTasks) -> CreateBatchResult:
        results = await service.create_batch(req.specs, req.concurrency, req.idempotency_keys)
        _acked(background, [r.id for r in results if isinstance(r, SandboxInfo)])
        return _batch_result(results)

    @app.get("/v1/sandboxes", response_model=SandboxList)
    async def list_sandboxes(
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
        state: Annotated[
            SandboxState | Literal["live", "all"] | None,
            Query(description="one state, `live` (the default: not stopped or failed) or `all`"),
        ] = None,
    ) -> Response:
        # Each sandbox on its own: one that cannot be encoded is left out (and logged), never the
        # reason nobody can list.
        items = []
        for info in await service.list(_parse_labels(label), state):
            try:
                items.append(info.model_dump_json().encode())
            except (ValueError, UnicodeError):
                log.exception("sandbox %s cannot be listed", info.id)
        return Response(b'{"sandboxes":[' + b",".join(items) + b"]}", media_type="application/json")

    @app.post("/v1/sandboxes/lifetimes", response_model=IdList)
    async def update_lifetimes(req: LifetimeManyRequest) -> IdList:
        fields = {k: getattr(req, k) for k in req.model_fields_set & {"idle_ttl", "max_lifetime"}}
        return IdList(sandboxes=await service.update_lifetimes(req.labels, fields))

    @app.post("/v1/sandboxes/stop", response_model=StopManyResult)
    async def stop_many(req: StopManyRequest) -> StopManyResult:
        if not req.labels:
            raise InvalidArgumentError("stop by labels needs at least one label")
        return StopManyResult(stopped=await service.stop_many(req.labels, req.reason))

    @app.post("/v1/sandboxes/pause", response_model=IdList)
    async def pause_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await service.pause_many(req.labels))

    @app.post("/v1/sandboxes/resume", response_model=IdList)
    async def resume_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await service.resume_many(req.labels))

    @app.get("/v1/sandboxes/{sandbox_id}/usage", response_model=Usage)
    async def usage(sandbox_id: str) -> Usage:
        return await service.usage(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
    async def pause(sandbox_id: str) -> SandboxInfo:
        return await service.pause(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
    async def resume(sandbox_id: str) -> SandboxInfo:
        return await service.resume(sandbox_id)

    # -- snapshots and forks ----------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/snapshots", response_model=SnapshotInfo, status_code=201)
    async def snapshot(sandbox_id: str, req: Annotated[SnapshotRequest | None, Body()] = None) -> SnapshotInfo:
        req = req or SnapshotRequest()
        return await service.snapshot(sandbox_id, ttl=req.ttl, labels=req.labels)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", response_model=CreateBatchResult)
    async def fork(
        sandbox_id: str, background: BackgroundTasks, req: Annotated[ForkRequest | None, Body()] = None
    ) -> CreateBatchResult:
        req = req or ForkRequest()
        results = await service.fork(sandbox_id, req.count, req.labels, idempotency_key=req.idempotency_key)
        _acked(background, [r.id for r in results if isinstance(r, SandboxInfo)])
        return _batch_result(results)

    @app.post("/v1/sandboxes/{sandbox_id}/pack", response_model=ImageInfo, status_code=201)
    async def pack(sandbox_id: str, req: PackRequest) -> ImageInfo:
        return await service.pack(sandbox_id, req.image, req.exclude)

    @app.get("/v1/snapshots", response_model=SnapshotList)
    async def list_snapshots(
        sandbox_id: str | None = None,
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
    ) -> SnapshotList:
        return SnapshotList(snapshots=await service.list_snapshots(sandbox_id, _parse_labels(label)))

    @app.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotInfo)
    async def get_snapshot(snapshot_id: str) -> SnapshotInfo:
        return await service.get_snapshot(snapshot_id)

    @app.delete("/v1/snapshots/{snapshot_id}", response_model=Ok)
    async def delete_snapshot(snapshot_id: str) -> Ok:
        await service.delete_snapshot(snapshot_id)
        return Ok()

    @app.post("/v1/snapshots/{snapshot_id}/restore", response_model=CreateBatchResult)
    async def restore(
        snapshot_id: str, background: BackgroundTasks, req: Annotated[ForkRequest | None, Body()] = None
    ) -> CreateBatchResult:
        req = req or ForkRequest()
        results = await service.restore(snapshot_id, req.count, req.labels, idempotency_key=req.idempotency_key)
        _acked(background, [r.id for r in results if isinstance(r, SandboxInfo)])
        return _batch_result(results)

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def get(sandbox_id: str) -> SandboxInfo:
        return await service.get(sandbox_id)

    @app.patch("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def update_lifetime(sandbox_id: str, req: LifetimeUpdate) -> SandboxInfo:
        fields = {k: getattr(req, k) for k in req.model_fields_set & {"idle_ttl", "max_lifetime"}}
        return await service.update_lifetime(sandbox_id, fields)

    @app.delete("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def stop(sandbox_id: str, req: Annotated[StopRequest | None, Body()] = None) -> SandboxInfo:
        return await service.stop(sandbox_id, reason=req.reason if req else "user")

    @app.get("/v1/sandboxes/{sandbox_id}/events", response_model=EventList)
    async def events(
        sandbox_id: str,
        after: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> EventList:
        return EventList(events=await service.events(sandbox_id, after, limit))

    # -- exec -----------------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
    async def exec_(sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await service.exec(sandbox_id, req)

    beat = ExecEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"
    ndjson: dict[int | str, dict[str, Any]] = {
        200: {"content": {"application/x-ndjson": {}}, "description": "one JSON object per line"}
    }

    @app.post("/v1/sandboxes/{sandbox_id}/exec/stream", response_class=StreamingResponse, responses=ndjson)
    async def exec_stream(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        """ExecEvent lines: output chunks, then one `exit`; `heartbeat` every 5 s while quiet."""
        events = await service.exec_stream(sandbox_id, req)
        return _stream(events, beat)

    @app.post("/v1/sandboxes/{sandbox_id}/processes", response_model=ProcessInfo, status_code=201)
    async def start_process(sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await service.start_process(sandbox_id, req)

    @app.get("/v1/sandboxes/{sandbox_id}/processes", response_model=ProcessList)
    async def list_processes(sandbox_id: str) -> ProcessList:
        return ProcessList(processes=await service.list_processes(sandbox_id))

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def get_process(
        sandbox_id: str, process_id: str, wait: Annotated[float, Query(ge=0, le=3600)] = 0
    ) -> ProcessInfo:
        return await service.wait_process(sandbox_id, process_id, wait)

    @app.delete("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def kill_process(
        sandbox_id: str, process_id: str, signal: Annotated[int, Query(ge=1, le=64)] = 9
    ) -> ProcessInfo:
        return await service.kill_process(sandbox_id, process_id, signal)

    raw_body = {"requestBody": {"content": {"application/octet-stream": {}}, "required": False}}

    @app.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin", response_model=Ok, openapi_extra=raw_body)
    async def process_stdin(request: Request, sandbox_id: str, process_id: str, close: bool = False) -> Ok:
        """Bytes for the process's standard input (started with keep_stdin_open); `close` ends it."""
        await service.write_process_stdin(sandbox_id, process_id, await _body(request), close)
        return Ok()

    # -- sessions ---------------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionInfo, status_code=201)
    async def create_session(
        sandbox_id: str, req: Annotated[SessionCreateRequest | None, Body()] = None
    ) -> SessionInfo:
        r = req or SessionCreateRequest()
        return await service.create_session(sandbox_id, r.env, r.cwd, r.user)

    @app.get("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionList)
    async def list_sessions(sandbox_id: str) -> SessionList:
        return SessionList(sessions=await service.list_sessions(sandbox_id))

    @app.get("/v1/sandboxes/{sandbox_id}/sessions/{session_id}", response_model=SessionInfo)
    async def get_session(sandbox_id: str, session_id: str) -> SessionInfo:
        return await service.get_session(sandbox_id, session_id)

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run", response_model=ExecResult)
    async def session_run(sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        return await service.session_run(sandbox_id, session_id, req)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run/stream",
        response_class=StreamingResponse,
        responses=ndjson,
    )
    async def session_run_stream(sandbox_id: str, session_id: str, req: SessionRunRequest) -> StreamingResponse:
        """ExecEvent lines, as for exec/stream."""
        events = await service.session_run_stream(sandbox_id, session_id, req)
        return _stream(events, beat)

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session_id}/stdin", response_model=Ok, openapi_extra=raw_body)
    async def session_stdin(request: Request, sandbox_id: str, session_id: str, close: bool = False) -> Ok:
        """Bytes for the standard input of the command running in the session; `close` ends it."""
        await service.write_session_stdin(sandbox_id, session_id, await _body(request), close)
        return Ok()

    @app.delete("/v1/sandboxes/{sandbox_id}/sessions/{session_id}", response_model=Ok)
    async def close_session(sandbox_id: str, session_id: str) -> Ok:
        await service.close_session(sandbox_id, session_id)
        return Ok()

    # -- files ------------------------------------------------------------------------------------

    async def _body(request: Request) -> bytes:
        return await _read_capped(
            request, MAX_FILE_BODY, f"body larger than {MAX_FILE_BODY} bytes; upload a tar in parts"
        )

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/content",
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def read_file(
        sandbox_id: str,
        path: str,
        offset: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
        length: Annotated[int | None, Query(ge=0, le=MAX_INT64)] = None,
    ) -> Response:
        data = await service.read_file(sandbox_id, path, offset, length)
        return Response(data, media_type="application/octet-stream")

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files/content",
        response_model=FileInfo,
        openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}},
    )
    async def write_file(
        request: Request,
        sandbox_id: str,
        path: str,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
        user: str | None = None,
        append: bool = False,
    ) -> FileInfo:
        data = await _body(request)
        return await service.write_file(sandbox_id, path, data, mode=mode, user=user, append=append)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=FileList)
    async def list_files(sandbox_id: str, path: str = "/") -> FileList:
        return FileList(files=await service.list_files(sandbox_id, path))

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=FileInfo)
    async def stat_file(sandbox_id: str, path: str, follow_symlinks: bool = False) -> FileInfo:
        return await service.stat_file(sandbox_id, path, follow_symlinks)

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", response_model=FileInfo)
    async def mkdir(
        sandbox_id: str,
        path: str,
        parents: bool = True,
        user: str | None = None,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o755,
    ) -> FileInfo:
        return await service.make_dir(sandbox_id, path, parents=parents, mode=mode, user=user)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", response_model=Ok)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Ok:
        await service.remove_path(sandbox_id, path, recursive)
        return Ok()

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/tar",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-tar": {}}}},
    )
    async def download(sandbox_id: str, path: str = "/") -> StreamingResponse:
        """A tar of a file or directory, streamed as it is read (never spooled on the node); a
        sparse file counts by what it really stores, and a tree larger than the sandbox could hold
        is refused."""
        return StreamingResponse(await service.download_tar(sandbox_id, path), media_type="application/x-tar")

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files/tar",
        response_model=Ok,
        openapi_extra={"requestBody": {"content": {"application/x-tar": {}}, "required": True}},
    )
    async def upload(request: Request, sandbox_id: str, path: str = "/", user: str | None = None) -> Ok:
        # Never more than the sandbox's writable layer could take (plus the tar's own headers).
        cap = await service.upload_limit(sandbox_id)
        with tempfile.SpooledTemporaryFile(max_size=8 * 1024**2) as spool:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise InvalidArgumentError(f"tar upload larger than the sandbox's disk allows ({cap} bytes)")
                await asyncio.to_thread(spool.write, chunk)
            spool.seek(0)
            await service.upload_tar(sandbox_id, path, cast(BinaryIO, spool), size, user)
        return Ok()

    file_beat = FileEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"

    @app.get("/v1/sandboxes/{sandbox_id}/files/watch", response_class=StreamingResponse, responses=ndjson)
    async def watch(
        sandbox_id: str,
        path: Annotated[str, Query(min_length=1, max_length=MAX_PATH, pattern=r"^[^\x00]+$")] = ".",
        recursive: bool = True,
    ) -> StreamingResponse:
        """FileEvent lines for changes under a directory (create, modify, delete, rename_from,
        rename_to, chmod; overflow when events were lost), until the client goes away."""
        events = await service.watch(sandbox_id, path, recursive)
        return _stream(events, file_beat)

    # -- images -----------------------------------------------------------------------------------

    @app.get("/v1/images", response_model=ImageList)
    async def images() -> ImageList:
        return ImageList(images=await service.list_images())

    @app.delete("/v1/images/{ref:path}", response_model=Ok)
    async def delete_image(ref: ImageRefParam) -> Ok:
        await service.delete_image(ref)
        return Ok()

    @app.post("/v1/images/gc", response_model=GcResult)
    async def gc_images(min_age: Annotated[float, Query(ge=0)] = 600.0) -> GcResult:
        removed, freed = await service.gc_images(min_age)
        return GcResult(removed=removed, bytes=freed)

    @app.post("/v1/images/push", response_model=ImageInfo)
    async def push_image(ref: ImageRefQuery) -> ImageInfo:
        return await service.push_image(ref)

    @app.post("/v1/images/import", response_model=ImageInfo)
    async def import_image(req: ImportRequest) -> ImageInfo:
        return await service.import_image(req.path, req.ref)

    @app.post("/v1/images/build", response_model=ImageInfo)
    async def build_image(ref: ImageRefQuery) -> ImageInfo:
        return await service.build_image(ref)

    build_beat = BuildEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"

    @app.post("/v1/images/recipes", response_class=StreamingResponse, responses=ndjson)
    async def build_recipe(req: RecipeBuildRequest) -> StreamingResponse:
        """BuildEvent lines: progress, each step as it finishes (its commands' output before it),
        then one `done` with the image; closing the connection cancels the build."""
        return _stream(await service.build_recipe(req.recipe, req.base_dir), build_beat)

    return app


def _batch_result(results: list[SandboxInfo | SandboxError]) -> CreateBatchResult:
    return CreateBatchResult(
        results=[
            CreateBatchItem(error=ErrorBody.model_validate(r.to_wire()))
            if isinstance(r, SandboxError)
            else CreateBatchItem(sandbox=r)
            for r in results
        ]
    )
