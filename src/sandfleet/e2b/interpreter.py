"""E2B's code interpreter (`e2b_code_interpreter`, its port 49999): `run_code` in a persistent
Python kernel per context, inside the sandbox (_kernel.py, run by the sandbox's python3 and
reached over a Unix socket there); each execution is one streamed exec relaying the kernel's lines."""

from __future__ import annotations

import contextlib
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
from sandfleet.models import ProcessInfo
from sandfleet.models.execs import MAX_OUTPUT

DIR = "/tmp/.e2b-kernel"  # in the sandbox: the kernel's source, and a socket per context
KERNEL = f"{DIR}/kernel.py"
DEFAULT = "default"  # the context of executions that name none (Python's); another language's is DEFAULT-<it>
LANGUAGES = ("python", "bash")  # a bash context runs each cell as a bash script, its output as stdout
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

    async def _start(self, sb: AsyncSandbox, context_id: str, cwd: str, language: str = "python") -> None:
        """A kernel for the context (its source written first; its first callers wait for it). Its
        command names its context and directory, so the sandbox's process list is the contexts'."""
        sock = _socket(context_id)
        await sb.files.write(KERNEL, self.source)
        await sb.files.write(sock + ".starting", b"")
        await sb.start([*_kernel(context_id), cwd, language], cwd=cwd)

    async def _kernels(self, sb: AsyncSandbox) -> list[ProcessInfo]:
        """The running kernels, oldest first."""
        running = [p for p in await sb.processes() if p.running and _id_of(p) and p.command[:4] == _kernel(_id_of(p))]
        return sorted(running, key=lambda p: p.started_at)

    async def execute(self, request: Request, sb: AsyncSandbox) -> Response:
        body = await _json(request)
        code, context_id, language = body.get("code"), body.get("context_id"), body.get("language")
        if not isinstance(code, str):
            raise InvalidArgumentError("code must be a string")
        if context_id is not None and not isinstance(context_id, str):
            raise InvalidArgumentError("context_id must be a string")
        if context_id and language:
            raise InvalidArgumentError("give a context or a language, not both")
        language = _language(language)
        default = DEFAULT if language == "python" else f"{DEFAULT}-{language}"
        sock = _socket(context_id or default)
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise InvalidArgumentError("env_vars must map names to strings")
        line = json.dumps({"code": code, "env_vars": env})
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
                    await self._start(sb, default, resolve("."), language)
                    stream = sb.exec_stream(argv, stdin=line, timeout=None, output_limit=MAX_OUTPUT)
            yield _line(
                {"type": "error", "name": "KernelUnavailable", "value": "the kernel did not start", "traceback": ""}
            )

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    async def create_context(self, request: Request, sb: AsyncSandbox) -> Response:
        body = await _json(request)
        language = _language(body.get("language"))
        cwd = resolve(body["cwd"]) if isinstance(body.get("cwd"), str) else resolve(".")
        context_id = secrets.token_hex(8)
        await self._start(sb, context_id, cwd, language)
        return JSONResponse({"id": context_id, "language": language, "cwd": cwd})

    async def list_contexts(self, request: Request, sb: AsyncSandbox) -> Response:
        """The default context (started by its first execution), then the ones made, oldest first."""
        found = [{"id": DEFAULT, "language": "python", "cwd": resolve(".")}]
        found += [
            {"id": _id_of(p), "language": _language_of(p), "cwd": _cwd_of(p)}
            for p in await self._kernels(sb)
            if _id_of(p) != DEFAULT
        ]
        return JSONResponse(found)

    async def delete_context(self, request: Request, sb: AsyncSandbox) -> Response:
        context_id = request.path_params["context_id"]
        await self._kill(sb, context_id)
        return Response(status_code=204)

    async def restart_context(self, request: Request, sb: AsyncSandbox) -> Response:
        """A fresh kernel in the context's directory (the default context's: its first)."""
        context_id = request.path_params["context_id"]
        killed = await self._kill(sb, context_id, missing_ok=context_id == DEFAULT)
        if killed:
            await self._start(sb, context_id, _cwd_of(killed[0]), _language_of(killed[0]))
        else:
            await self._start(sb, context_id, resolve("."))
        return Response(status_code=204)

    async def _kill(self, sb: AsyncSandbox, context_id: str, missing_ok: bool = False) -> list[ProcessInfo]:
        sock = _socket(context_id)
        kernels = [p for p in await self._kernels(sb) if _id_of(p) == context_id]
        if not kernels and not missing_ok:
            raise NotFoundError(f"context {context_id} not found")
        for p in kernels:
            await AsyncProcess(sb, p).kill()
        for leftover in (sock, sock + ".starting"):  # a kernel killed as it started has neither
            with contextlib.suppress(NotFoundError):
                await sb.files.remove(leftover)
        return kernels


def _kernel(context_id: str) -> list[str]:
    return ["python3", KERNEL, "serve", f"{DIR}/{context_id}.sock"]


def _id_of(p: ProcessInfo) -> str:
    """The context a kernel serves, from its command ("" for another process)."""
    if not isinstance(p.command, list) or len(p.command) < 4 or not p.command[3].startswith(DIR + "/"):
        return ""
    return posixpath.basename(p.command[3]).removesuffix(".sock")


def _cwd_of(p: ProcessInfo) -> str:
    return p.command[4] if isinstance(p.command, list) and len(p.command) > 4 else resolve(".")


def _language_of(p: ProcessInfo) -> str:
    return p.command[5] if isinstance(p.command, list) and len(p.command) > 5 else "python"


def _language(given: object) -> str:
    """E2B's language names (as its server normalises them), of those served."""
    if given is not None and not isinstance(given, str):
        raise InvalidArgumentError("language must be a string")
    language = (given or "").strip().lower()
    language = {"": "python", "python3": "python", "sh": "bash"}.get(language, language)
    if language not in LANGUAGES:
        raise InvalidArgumentError(f"language {given!r} is not served: sandfleet's kernels run Python and bash")
    return language


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
