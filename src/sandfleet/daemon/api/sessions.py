"""Shell sessions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Request
from fastapi.responses import StreamingResponse

from sandfleet.daemon.api.common import (
    EXEC_BEAT,
    NDJSON,
    RAW_BODY,
    CheckedRoute,
    file_body,
    stream,
)
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    ExecResult,
    Ok,
    SessionCreateRequest,
    SessionInfo,
    SessionList,
    SessionRunRequest,
)


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.post("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionInfo, status_code=201)
    async def create_session(
        sandbox_id: str, req: Annotated[SessionCreateRequest | None, Body()] = None
    ) -> SessionInfo:
        r = req or SessionCreateRequest()
        return await service.create_session(sandbox_id, r.env, r.cwd, r.user, r.pty)

    @r.get("/v1/sandboxes/{sandbox_id}/sessions", response_model=SessionList)
    async def list_sessions(sandbox_id: str) -> SessionList:
        return SessionList(sessions=await service.list_sessions(sandbox_id))

    @r.get("/v1/sandboxes/{sandbox_id}/sessions/{session_id}", response_model=SessionInfo)
    async def get_session(sandbox_id: str, session_id: str) -> SessionInfo:
        return await service.get_session(sandbox_id, session_id)

    @r.post("/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run", response_model=ExecResult)
    async def session_run(sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        return await service.session_run(sandbox_id, session_id, req)

    @r.post(
        "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run/stream",
        response_class=StreamingResponse,
        responses=NDJSON,
    )
    async def session_run_stream(sandbox_id: str, session_id: str, req: SessionRunRequest) -> StreamingResponse:
        """ExecEvent lines, as for exec/stream."""
        events = await service.session_run_stream(sandbox_id, session_id, req)
        return stream(events, EXEC_BEAT)

    @r.post("/v1/sandboxes/{sandbox_id}/sessions/{session_id}/stdin", response_model=Ok, openapi_extra=RAW_BODY)
    async def session_stdin(request: Request, sandbox_id: str, session_id: str, close: bool = False) -> Ok:
        """Bytes for the standard input of the command running in the session; `close` ends it."""
        await service.write_session_stdin(sandbox_id, session_id, await file_body(request), close)
        return Ok()

    @r.delete("/v1/sandboxes/{sandbox_id}/sessions/{session_id}", response_model=Ok)
    async def close_session(sandbox_id: str, session_id: str) -> Ok:
        await service.close_session(sandbox_id, session_id)
        return Ok()

    return r
