"""Commands: exec (whole or streamed) and background processes."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
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
    ExecEvent,
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


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "exec_")
    async def exec_(sandbox_id: str, req: ExecRequest) -> ExecResult:
        return await node.execs.exec(sandbox_id, req)

    @api.route(r, "run_code")
    async def run_code(req: RunCodeRequest) -> ExecResult:
        """A stateless call on a pooled worker of the fncall tier (a fresh process per call)."""
        return await node.calls.run(tenancy.placed_call(req))

    @api.route(r, "run_code_many", response_class=StreamingResponse, responses=NDJSON)
    async def run_code_many(req: RunCodeBatchRequest) -> StreamingResponse:
        """RunCodeBatchItem lines, one per call as it completes (`index` into `calls`); `heartbeat`
        every 5 s while none completes. Leaving early cancels the calls still running."""
        return stream(await node.calls.run_many([tenancy.placed_call(c) for c in req.calls]), RUN_BEAT)

    @api.route(r, "run_code_in")
    async def run_code_in(sandbox_id: str, req: RunCodeRequest) -> ExecResult:
        """A stateless call on this worker sandbox (of the fncall tier)."""
        return await node.calls.run_in(sandbox_id, req)

    @api.route(r, "exec_stream", response_class=StreamingResponse, responses=NDJSON)
    async def exec_stream(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        """ExecEvent lines: output chunks, then one `exit`; `heartbeat` every 5 s while quiet."""
        events = await node.execs.exec_stream(sandbox_id, req)
        return stream(events, EXEC_BEAT)

    @api.route(r, "start_process")
    async def start_process(sandbox_id: str, req: ExecRequest) -> ProcessInfo:
        return await node.execs.start_process(sandbox_id, req)

    @api.route(r, "list_processes")
    async def list_processes(sandbox_id: str) -> ProcessList:
        return ProcessList(processes=await node.execs.list_processes(sandbox_id))

    @api.route(r, "get_process")
    async def get_process(
        sandbox_id: str, process_id: str, wait: Annotated[float, Query(ge=0, le=3600)] = 0
    ) -> ProcessInfo:
        return await node.execs.wait_process(sandbox_id, process_id, wait)

    @api.route(r, "kill_process")
    async def kill_process(
        sandbox_id: str, process_id: str, signal: Annotated[int, Query(ge=1, le=64)] = 9
    ) -> ProcessInfo:
        return await node.execs.kill_process(sandbox_id, process_id, signal)

    @api.route(r, "start_process_stream", response_class=StreamingResponse, responses=NDJSON)
    async def start_process_stream(sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        """start_process and process_output in one call: a `started` line carrying the process, then
        its output as it comes and its `exit` (leaving early does not stop the process)."""
        started = await node.execs.start_process(sandbox_id, req)
        output = await node.execs.process_output(sandbox_id, started.id)
        return stream(output, EXEC_BEAT, first=ExecEvent(type="started", process=started))

    @api.route(r, "process_output", response_class=StreamingResponse, responses=NDJSON)
    async def process_output(sandbox_id: str, process_id: str) -> StreamingResponse:
        """ExecEvent lines: what the process printed so far, each chunk as it comes, then one `exit`
        (output the process printed past its output limit is not kept); `heartbeat` every 5 s while quiet."""
        return stream(await node.execs.process_output(sandbox_id, process_id), EXEC_BEAT)

    @api.route(r, "process_stdin", openapi_extra=RAW_BODY)
    async def process_stdin(request: Request, sandbox_id: str, process_id: str, close: bool = False) -> Ok:
        """Bytes for the process's standard input (started with keep_stdin_open); `close` ends it."""
        await node.execs.write_process_stdin(sandbox_id, process_id, await file_body(request), close)
        return Ok()

    return r
