"""Commands: exec (whole or streamed) and background processes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
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
    ExecRequest,
    ExecResult,
    Ok,
    ProcessInfo,
    ProcessList,
    RunCodeBatchItem,
    RunCodeBatchRequest,
    RunCodeRequest,
)

RUN_BEAT = RunCodeBatchItem(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
    async def exec_(sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await service.exec(sandbox_id, req)

    @r.post("/v1/run", response_model=ExecResult)
    async def run_code(req: RunCodeRequest) -> ExecResult:
        """A stateless call on a pooled worker of the fncall tier (a fresh process per call)."""
        return await service.run_code(req)

    @r.post("/v1/run/batch", response_class=StreamingResponse, responses=NDJSON)
    async def run_code_many(req: RunCodeBatchRequest) -> StreamingResponse:
        """RunCodeBatchItem lines, one per call as it completes (`index` into `calls`); `heartbeat`
        every 5 s while none completes. Leaving early cancels the calls still running."""
        return stream(await service.run_code_many(req.calls), RUN_BEAT)

    @r.post("/v1/sandboxes/{sandbox_id}/run", response_model=ExecResult)
    async def run_code_in(sandbox_id: str, req: RunCodeRequest) -> ExecResult:
        """A stateless call on this worker sandbox (of the fncall tier)."""
        return await service.run_code_in(sandbox_id, req)

    @r.post("/v1/sandboxes/{sandbox_id}/exec/stream", response_class=StreamingResponse, responses=NDJSON)
    async def exec_stream(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        """ExecEvent lines: output chunks, then one `exit`; `heartbeat` every 5 s while quiet."""
        events = await service.exec_stream(sandbox_id, req)
        return stream(events, EXEC_BEAT)

    @r.post("/v1/sandboxes/{sandbox_id}/processes", response_model=ProcessInfo, status_code=201)
    async def start_process(sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await service.start_process(sandbox_id, req)

    @r.get("/v1/sandboxes/{sandbox_id}/processes", response_model=ProcessList)
    async def list_processes(sandbox_id: str) -> ProcessList:
        return ProcessList(processes=await service.list_processes(sandbox_id))

    @r.get("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def get_process(
        sandbox_id: str, process_id: str, wait: Annotated[float, Query(ge=0, le=3600)] = 0
    ) -> ProcessInfo:
        return await service.wait_process(sandbox_id, process_id, wait)

    @r.delete("/v1/sandboxes/{sandbox_id}/processes/{process_id}", response_model=ProcessInfo)
    async def kill_process(
        sandbox_id: str, process_id: str, signal: Annotated[int, Query(ge=1, le=64)] = 9
    ) -> ProcessInfo:
        return await service.kill_process(sandbox_id, process_id, signal)

    @r.post("/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin", response_model=Ok, openapi_extra=RAW_BODY)
    async def process_stdin(request: Request, sandbox_id: str, process_id: str, close: bool = False) -> Ok:
        """Bytes for the process's standard input (started with keep_stdin_open); `close` ends it."""
        await service.write_process_stdin(sandbox_id, process_id, await file_body(request), close)
        return Ok()

    return r
