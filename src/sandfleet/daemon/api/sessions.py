"""Shell sessions."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Request
from fastapi.responses import StreamingResponse

from sandfleet.daemon.api.common import (
    EXEC_BEAT,
    NDJSON,
    RAW_BODY,
    Api,
    CheckedRoute,
    file_body,
    stream,
)
from sandfleet.models import (
    ExecResult,
    Ok,
    SessionCreateRequest,
    SessionInfo,
    SessionList,
    SessionRunRequest,
)


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node = api.node

    @api.route(r, "create_session")
    async def create_session(
        sandbox_id: str, req: Annotated[SessionCreateRequest | None, Body()] = None
    ) -> SessionInfo:
        r = req or SessionCreateRequest()
        return await node.sessions.create_session(sandbox_id, r.env, r.cwd, r.user, r.pty)

    @api.route(r, "list_sessions")
    async def list_sessions(sandbox_id: str) -> SessionList:
        return SessionList(sessions=await node.sessions.list_sessions(sandbox_id))

    @api.route(r, "get_session")
    async def get_session(sandbox_id: str, session_id: str) -> SessionInfo:
        return await node.sessions.get_session(sandbox_id, session_id)

    @api.route(r, "session_run")
    async def session_run(sandbox_id: str, session_id: str, req: SessionRunRequest) -> ExecResult:
        return await node.sessions.session_run(sandbox_id, session_id, req)

    @api.route(r, "session_run_stream", response_class=StreamingResponse, responses=NDJSON)
    async def session_run_stream(sandbox_id: str, session_id: str, req: SessionRunRequest) -> StreamingResponse:
        """ExecEvent lines, as for exec/stream."""
        events = await node.sessions.session_run_stream(sandbox_id, session_id, req)
        return stream(events, EXEC_BEAT)

    @api.route(r, "session_stdin", openapi_extra=RAW_BODY)
    async def session_stdin(request: Request, sandbox_id: str, session_id: str, close: bool = False) -> Ok:
        """Bytes for the standard input of the command running in the session; `close` ends it."""
        await node.sessions.write_session_stdin(sandbox_id, session_id, await file_body(request), close)
        return Ok()

    @api.route(r, "close_session")
    async def close_session(sandbox_id: str, session_id: str) -> Ok:
        await node.sessions.close_session(sandbox_id, session_id)
        return Ok()

    return r
