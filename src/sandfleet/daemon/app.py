"""The HTTP API (FastAPI). Thin: parse, call the manager, map errors to `{code, message, retryable}`.

The OpenAPI document FastAPI derives from these routes is checked into docs/openapi.json; a test
fails when the two drift apart, and tests validate live responses against the checked-in copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Iterator
from typing import IO, Annotated, Any, BinaryIO, cast

from fastapi import Body, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandfleet import __version__
from sandfleet.daemon.service import SandboxManager, file_info
from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    UnauthenticatedError,
)
from sandfleet.models import (
    CreateBatchItem,
    CreateBatchRequest,
    CreateBatchResult,
    ErrorBody,
    ErrorResponse,
    EventList,
    ExecRequest,
    ExecResult,
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
    Ok,
    PackRequest,
    ProcessInfo,
    ProcessList,
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
    StopManyRequest,
    StopManyResult,
    StopRequest,
    Usage,
)
from sandfleet.runtime.files import SandboxFS

MAX_FILE_BODY = 256 * 1024**2
MAX_INT64 = 2**63 - 1
log = logging.getLogger("sandfleet.api")


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": desc}
    for status, desc in (
        (400, "invalid_argument"),
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


def _error_response(exc: SandboxError) -> JSONResponse:
    return JSONResponse({"error": exc.to_wire()}, status_code=exc.http_status)


def _parse_labels(label: list[str]) -> dict[str, str]:
    out = {}
    for item in label:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgumentError(f"label filter must be key=value, got {item!r}")
        out[key] = value
    return out


def _image_info(m: Any) -> ImageInfo:
    return ImageInfo(
        name=m.name,
        tag=m.tag,
        layers=[x.digest for x in m.layers],
        size=sum(x.size + (x.blob_size or 0) for x in m.layers),
        created=m.created,
        on_demand=any(x.blob is not None for x in m.layers),
    )


def create_app(manager: SandboxManager, *, token: str | None = None) -> FastAPI:
    app = FastAPI(
        title="sandfleet",
        version=__version__,
        responses=_ERRORS,
        description="Elastic sandboxes for agentic RL: the node daemon's API.",
    )
    metrics = manager.metrics

    @app.exception_handler(SandboxError)
    async def _sandbox_error(_req: Request, exc: SandboxError) -> JSONResponse:
        metrics.http_errors.labels(code=exc.code).inc()
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}")
        metrics.http_errors.labels(code="invalid_argument").inc()
        return _error_response(InvalidArgumentError("; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(NotFoundError("no such endpoint"))
        if exc.status_code == 405:
            return _error_response(InvalidArgumentError("method not allowed on this endpoint"))
        return _error_response(InternalError(str(exc.detail)))

    @app.middleware("http")
    async def _unexpected(request: Request, call_next: Any) -> Any:
        # A middleware, not an exception handler: Starlette re-raises after running an
        # Exception handler, and uvicorn then drops the client's keep-alive connection.
        try:
            return await call_next(request)
        except Exception as exc:
            log.exception("unexpected error serving %s %s", request.method, request.url.path)
            metrics.http_errors.labels(code="internal").inc()
            return _error_response(InternalError(f"internal error: {exc}"[:500]))

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
        return Health(
            status="ok",
            version=__version__,
            sandboxes_running=manager.running_count(),
            backends=[manager.backend.name],
            pools=manager.pools.sizes() if manager.pools is not None else {},
        )

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        with contextlib.suppress(OSError), open("/proc/self/statm") as f:  # noqa: ASYNC230 (procfs)
            metrics.daemon_rss.set(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
        adm = manager.admission
        metrics.admission_cpu_committed.set(adm.committed_cpu)
        metrics.admission_cpu_load.set(adm.cpu_load)
        metrics.admission_memory_committed.set(adm.committed_memory)
        # Per-sandbox series read thousands of cgroup files: off the event loop.
        body = await asyncio.to_thread(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # -- sandboxes ------------------------------------------------------------------------------

    @app.post("/v1/sandboxes", response_model=SandboxInfo, status_code=201)
    async def create(spec: SandboxSpec) -> SandboxInfo:
        return await manager.create(spec)

    @app.post("/v1/sandboxes/batch", response_model=CreateBatchResult)
    async def create_batch(req: CreateBatchRequest) -> CreateBatchResult:
        return _batch_result(await manager.create_batch(req.specs, req.concurrency))

    @app.get("/v1/sandboxes", response_model=SandboxList)
    async def list_sandboxes(
        label: Annotated[list[str], Query()] = [],  # noqa: B006
        state: SandboxState | None = None,
    ) -> SandboxList:
        return SandboxList(sandboxes=manager.list(_parse_labels(label), state))

    @app.post("/v1/sandboxes/stop", response_model=StopManyResult)
    async def stop_many(req: StopManyRequest) -> StopManyResult:
        if not req.labels:
            raise InvalidArgumentError("stop by labels needs at least one label")
        return StopManyResult(stopped=await manager.stop_many(req.labels, req.reason))

    @app.post("/v1/sandboxes/pause", response_model=IdList)
    async def pause_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await manager.pause_many(req.labels))

    @app.post("/v1/sandboxes/resume", response_model=IdList)
    async def resume_many(req: LabelsRequest) -> IdList:
        return IdList(sandboxes=await manager.resume_many(req.labels))

    @app.get("/v1/sandboxes/{sandbox_id}/usage", response_model=Usage)
    async def usage(sandbox_id: str) -> Usage:
        return await manager.usage(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/pause", response_model=SandboxInfo)
    async def pause(sandbox_id: str) -> SandboxInfo:
        return await manager.pause(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", response_model=SandboxInfo)
    async def resume(sandbox_id: str) -> SandboxInfo:
        return await manager.resume(sandbox_id)

    # -- snapshots and forks ----------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/snapshots", response_model=SnapshotInfo, status_code=201)
    async def snapshot(sandbox_id: str) -> SnapshotInfo:
        return await manager.snapshot(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", response_model=CreateBatchResult)
    async def fork(sandbox_id: str, req: Annotated[ForkRequest | None, Body()] = None) -> CreateBatchResult:
        req = req or ForkRequest()
        return _batch_result(await manager.fork(sandbox_id, req.count, req.labels))

    @app.post("/v1/sandboxes/{sandbox_id}/pack", response_model=ImageInfo, status_code=201)
    async def pack(sandbox_id: str, req: PackRequest) -> ImageInfo:
        return _image_info(await manager.pack(sandbox_id, req.image, req.exclude))

    @app.get("/v1/snapshots", response_model=SnapshotList)
    async def list_snapshots(sandbox_id: str | None = None) -> SnapshotList:
        return SnapshotList(snapshots=manager.list_snapshots(sandbox_id))

    @app.get("/v1/snapshots/{snapshot_id}", response_model=SnapshotInfo)
    async def get_snapshot(snapshot_id: str) -> SnapshotInfo:
        return manager.get_snapshot(snapshot_id)

    @app.delete("/v1/snapshots/{snapshot_id}", response_model=Ok)
    async def delete_snapshot(snapshot_id: str) -> Ok:
        await manager.delete_snapshot(snapshot_id)
        return Ok()

    @app.post("/v1/snapshots/{snapshot_id}/restore", response_model=CreateBatchResult)
    async def restore(snapshot_id: str, req: Annotated[ForkRequest | None, Body()] = None) -> CreateBatchResult:
        req = req or ForkRequest()
        return _batch_result(await manager.restore(snapshot_id, req.count, req.labels))

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def get(sandbox_id: str) -> SandboxInfo:
        return manager.get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo)
    async def stop(sandbox_id: str, req: Annotated[StopRequest | None, Body()] = None) -> SandboxInfo:
        return await manager.stop(sandbox_id, reason=req.reason if req else "user")

    @app.get("/v1/sandboxes/{sandbox_id}/events", response_model=EventList)
    async def events(
        sandbox_id: str,
        after: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
        limit: Annotated[int, Query(ge=1, le=10000)] = 1000,
    ) -> EventList:
        return EventList(events=await manager.events(sandbox_id, after, limit))

    # -- exec -----------------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
    async def exec_(sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await manager.exec(sandbox_id, req)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/exec/stream",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "ExecEvent per line"}},
    )
    async def exec_stream(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        events = await manager.exec_stream(sandbox_id, req)

        async def lines() -> AsyncIterator[bytes]:
            try:
                async for ev in events:
                    yield ev.model_dump_json(exclude_none=True).encode() + b"\n"
            except SandboxError as exc:
                yield json.dumps({"type": "error", "error": exc.to_wire()}).encode() + b"\n"
            finally:
                await events.aclose()  # a client gone mid-stream: the command is killed, not left running

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/processes", response_model=ProcessInfo, status_code=201)
    async def start_process(sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await manager.start_process(sandbox_id, req)

    @app.get("/v1/sandboxes/{sandbox_id}/processes", response_model=ProcessList)
    async def list_processes(sandbox_id: str) -> ProcessList:
        return ProcessList(processes=manager.list_processes(sandbox_id))

    @app.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def get_process(
        sandbox_id: str, process_id: str, wait: Annotated[float, Query(ge=0, le=3600)] = 0
    ) -> ProcessInfo:
        return await manager.wait_process(sandbox_id, process_id, wait)

    @app.delete("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def kill_process(
        sandbox_id: str, process_id: str, signal: Annotated[int, Query(ge=1, le=64)] = 9
    ) -> ProcessInfo:
        return await manager.kill_process(sandbox_id, process_id, signal)

    # -- sessions ---------------------------------------------------------------------------------

    @app.post("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionInfo, status_code=201)
    async def create_session(
        sandbox_id: str, req: Annotated[SessionCreateRequest | None, Body()] = None
    ) -> SessionInfo:
        r = req or SessionCreateRequest()
        return await manager.create_session(sandbox_id, r.env, r.cwd, r.user)

    @app.get("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionList)
    async def list_sessions(sandbox_id: str) -> SessionList:
        return SessionList(sessions=manager.list_sessions(sandbox_id))

    @app.post("/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run", response_model=ExecResult)
    async def session_run(sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        return await manager.session_run(sandbox_id, session_id, req.command, req.timeout, req.output_limit)

    @app.delete("/v1/sandboxes/{sandbox_id}/sessions/{session_id}", response_model=Ok)
    async def close_session(sandbox_id: str, session_id: str) -> Ok:
        await manager.close_session(sandbox_id, session_id)
        return Ok()

    # -- files ------------------------------------------------------------------------------------

    async def _body(request: Request) -> bytes:
        """The request body, refused past MAX_FILE_BODY whether or not a Content-Length was sent."""
        if int(request.headers.get("content-length") or 0) > MAX_FILE_BODY:
            raise InvalidArgumentError(f"body larger than {MAX_FILE_BODY} bytes; upload a tar in parts")
        data = bytearray()
        async for chunk in request.stream():
            data.extend(chunk)
            if len(data) > MAX_FILE_BODY:
                raise InvalidArgumentError(f"body larger than {MAX_FILE_BODY} bytes; upload a tar in parts")
        return bytes(data)

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
        data = await manager.file_op(sandbox_id, lambda fs: fs.read(path, offset=offset, length=length))
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
        owner = await manager.file_owner(sandbox_id, user)

        def op(fs: SandboxFS) -> FileInfo:
            fs.write(path, data, mode=mode, uid=owner.uid, gid=owner.gid, append=append)
            return file_info(fs.stat(path, follow_symlinks=True))

        return await manager.file_op(sandbox_id, op, ("file_write", {"path": path, "bytes": len(data)}))

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", response_model=FileList)
    async def list_files(sandbox_id: str, path: str = "/") -> FileList:
        stats = await manager.file_op(sandbox_id, lambda fs: fs.list(path))
        return FileList(files=[file_info(s) for s in stats])

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", response_model=FileInfo)
    async def stat_file(sandbox_id: str, path: str, follow_symlinks: bool = False) -> FileInfo:
        return file_info(await manager.file_op(sandbox_id, lambda fs: fs.stat(path, follow_symlinks=follow_symlinks)))

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", response_model=FileInfo)
    async def mkdir(
        sandbox_id: str,
        path: str,
        parents: bool = True,
        user: str | None = None,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o755,
    ) -> FileInfo:
        owner = await manager.file_owner(sandbox_id, user)

        def op(fs: SandboxFS) -> FileInfo:
            fs.mkdir(path, parents=parents, mode=mode, uid=owner.uid, gid=owner.gid)
            return file_info(fs.stat(path))

        return await manager.file_op(sandbox_id, op, ("mkdir", {"path": path}))

    @app.delete("/v1/sandboxes/{sandbox_id}/files", response_model=Ok)
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Ok:
        await manager.file_op(
            sandbox_id,
            lambda fs: fs.remove(path, recursive=recursive),
            ("file_remove", {"path": path, "recursive": recursive}),
        )
        return Ok()

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/tar",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-tar": {}}}},
    )
    async def download(sandbox_id: str, path: str = "/") -> StreamingResponse:
        def op(fs: SandboxFS) -> IO[bytes]:
            # Spooled: at most 16 MiB of an archive in daemon memory, the rest in a temp file.
            spool: IO[bytes] = tempfile.SpooledTemporaryFile(max_size=16 * 1024**2)  # noqa: SIM115
            try:
                fs.write_tar(path, spool)
                spool.seek(0)
            except BaseException:
                spool.close()
                raise
            return spool

        spool = await manager.file_op(sandbox_id, op)

        def chunks() -> Iterator[bytes]:
            try:
                while chunk := spool.read(1024**2):
                    yield chunk
            finally:
                spool.close()

        return StreamingResponse(chunks(), media_type="application/x-tar")

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files/tar",
        response_model=Ok,
        openapi_extra={"requestBody": {"content": {"application/x-tar": {}}, "required": True}},
    )
    async def upload(request: Request, sandbox_id: str, path: str = "/", user: str | None = None) -> Ok:
        owner = await manager.file_owner(sandbox_id, user)
        with tempfile.SpooledTemporaryFile(max_size=8 * 1024**2) as spool:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > 4 * MAX_FILE_BODY:
                    raise InvalidArgumentError("tar upload too large")
                await asyncio.to_thread(spool.write, chunk)
            spool.seek(0)
            tar_stream = cast(BinaryIO, spool)

            def op(fs: SandboxFS) -> None:
                fs.upload_tar(path, tar_stream, uid=owner.uid, gid=owner.gid)

            await manager.file_op(sandbox_id, op, ("upload", {"path": path, "bytes": size}))
        return Ok()

    # -- images -----------------------------------------------------------------------------------

    @app.get("/v1/images", response_model=ImageList)
    async def images() -> ImageList:
        manifests = await asyncio.to_thread(manager.store.list_images)
        return ImageList(images=[_image_info(m) for m in manifests])

    @app.delete("/v1/images/{ref:path}", response_model=Ok)
    async def delete_image(ref: str) -> Ok:
        await manager.delete_image(ref)
        return Ok()

    @app.post("/v1/images/gc", response_model=GcResult)
    async def gc_images(min_age: Annotated[float, Query(ge=0)] = 600.0) -> GcResult:
        removed, freed = await manager.gc_images(min_age)
        return GcResult(removed=removed, bytes=freed)

    @app.post("/v1/images/push", response_model=ImageInfo)
    async def push_image(ref: str) -> ImageInfo:
        return _image_info(await manager.push_image(ref))

    @app.post("/v1/images/import", response_model=ImageInfo)
    async def import_image(req: ImportRequest) -> ImageInfo:
        return _image_info(await manager.import_image(req.path, req.ref))

    @app.post("/v1/images/build", response_model=ImageInfo)
    async def build_image(ref: str) -> ImageInfo:
        return _image_info(await manager.resolve_image(ref))

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
