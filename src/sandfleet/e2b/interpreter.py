"""E2B's code interpreter (`e2b_code_interpreter`, its port 49999): `run_code` in a persistent
Python kernel per context, inside the sandbox (_kernel.py, run by the sandbox's python3 and
reached over a Unix socket there); each execution is one streamed exec relaying the kernel's lines."""

from __future__ import annotations

import importlib.resources
import json
import posixpath
import secrets
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from sandfleet.client.aio import AsyncProcess, AsyncSandbox
from sandfleet.e2b._upstream import Upstream, not_found_message, resolve
from sandfleet.errors import InvalidArgumentError, NotFoundError, SandboxError, SandboxNotFoundError
from sandfleet.models.execs import MAX_OUTPUT

DIR = "/tmp/.e2b-kernel"  # in the sandbox: the kernel's source, and a socket per context
KERNEL = f"{DIR}/kernel.py"
DEFAULT = "default"  # the context of executions that name none
LANGUAGES = {None, "", "python", "python3"}
NO_KERNEL = (2, 3)  # the client's exits when the kernel (or its source) is not there yet


def _text_error(exc: SandboxError) -> Response:
    """The interpreter's errors are plain text; a sandbox that is not there is the edge's 502."""
    if isinstance(exc, SandboxNotFoundError):
        return PlainTextResponse(not_found_message(exc), status_code=502)
    return PlainTextResponse(str(exc), status_code=exc.http_status)


def _socket(context_id: str) -> str:
    if not context_id.replace("-", "").isalnum():
        raise InvalidArgumentError("a context id is letters, digits and dashes")
    return f"{DIR}/{context_id}.sock"


class Interpreter:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.source = importlib.resources.files("sandfleet.e2b").joinpath("_kernel.py").read_bytes()

    def routes(self) -> list[Route]:
        def route(path: str, fn: Any, method: str) -> Route:
            async def endpoint(request: Request) -> Response:
                try:
                    return await fn(request, self.upstream.envd_sandbox(request.headers))  # type: ignore[no-any-return]
                except SandboxError as exc:
                    return _text_error(exc)

            return Route(path, endpoint, methods=[method])

        return [
            route("/execute", self.execute, "POST"),
            route("/contexts", self.create_context, "POST"),
            route("/contexts", self.list_contexts, "GET"),
            route("/contexts/{context_id}", self.delete_context, "DELETE"),
            route("/contexts/{context_id}/restart", self.restart_context, "POST"),
        ]

    async def _start(self, sb: AsyncSandbox, context_id: str, cwd: str | None = None) -> None:
        """A kernel for the context (its source written first; its first callers wait for it)."""
        sock = _socket(context_id)
        await sb.files.write(KERNEL, self.source)
        await sb.files.write(sock + ".starting", b"")
        await sb.start(["python3", KERNEL, "serve", sock], cwd=cwd)

    async def execute(self, request: Request, sb: AsyncSandbox) -> Response:
        body = await _json(request)
        code, context_id, language = body.get("code"), body.get("context_id"), body.get("language")
        if not isinstance(code, str):
            raise InvalidArgumentError("code must be a string")
        if context_id and language:
            raise InvalidArgumentError("give a context or a language, not both")
        if language not in LANGUAGES:
            raise InvalidArgumentError(f"language {language!r} is not served: sandfleet's kernel runs Python")
        sock = _socket(context_id or DEFAULT)
        line = json.dumps({"code": code, "env_vars": body.get("env_vars") or {}})
        argv = ["python3", KERNEL, "run", sock]
        first = sb.exec_stream(argv, stdin=line, timeout=None, output_limit=MAX_OUTPUT)
        await first.open()  # a sandbox that is not there fails here, as an HTTP error

        async def lines() -> AsyncIterator[bytes]:
            stream = first
            for attempt in range(2):
                sent, status = False, 0
                async with stream as events:
                    async for ev in events:
                        if ev.type == "stdout" and ev.data:
                            sent = True
                            yield ev.data.encode()
                        elif ev.type == "exit" and ev.result is not None:
                            status = ev.result.exit_code
                if sent or status not in NO_KERNEL:
                    return
                if attempt == 0:
                    if context_id:
                        yield _line({"type": "error", "name": "ContextNotFound", "value": context_id, "traceback": ""})
                        return
                    await self._start(sb, DEFAULT)
                    stream = sb.exec_stream(argv, stdin=line, timeout=None, output_limit=MAX_OUTPUT)
            yield _line(
                {"type": "error", "name": "KernelUnavailable", "value": "the kernel did not start", "traceback": ""}
            )

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def create_context(self, request: Request, sb: AsyncSandbox) -> Response:
        body = await _json(request)
        language = body.get("language")
        if language not in LANGUAGES:
            raise InvalidArgumentError(f"language {language!r} is not served: sandfleet's kernel runs Python")
        cwd = resolve(body["cwd"]) if isinstance(body.get("cwd"), str) else resolve(".")
        context_id = secrets.token_hex(8)
        await self._start(sb, context_id, cwd)
        return JSONResponse({"id": context_id, "language": "python", "cwd": cwd})

    async def list_contexts(self, request: Request, sb: AsyncSandbox) -> Response:
        found = [
            {"id": posixpath.basename(f.path)[: -len(".sock")], "language": "python", "cwd": ""}
            for f in await _listing(sb)
            if f.name.endswith(".sock")
        ]
        return JSONResponse(found)

    async def delete_context(self, request: Request, sb: AsyncSandbox) -> Response:
        context_id = request.path_params["context_id"]
        await self._kill(sb, context_id)
        return Response(status_code=204)

    async def restart_context(self, request: Request, sb: AsyncSandbox) -> Response:
        context_id = request.path_params["context_id"]
        await self._kill(sb, context_id)
        await self._start(sb, context_id)
        return Response(status_code=204)

    async def _kill(self, sb: AsyncSandbox, context_id: str) -> None:
        sock = _socket(context_id)
        kernels = [p for p in await sb.processes() if p.running and p.command == ["python3", KERNEL, "serve", sock]]
        if not kernels:
            raise NotFoundError(f"context {context_id} not found")
        for p in kernels:
            await AsyncProcess(sb, p).kill()
        await sb.files.remove(sock)


async def _listing(sb: AsyncSandbox) -> list[Any]:
    try:
        return await sb.files.list(DIR)
    except NotFoundError:
        return []


def _line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj) + "\n").encode()


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise InvalidArgumentError(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidArgumentError("the body must be a JSON object")
    return body
