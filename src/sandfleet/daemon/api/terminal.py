"""Terminals: a command on a pseudo-terminal, relayed over a WebSocket (`sb.terminal()`, `sandfleet
shell`, the console's terminal).

`GET /v1/sandboxes/{id}/terminal`, upgraded. Credentials: the Authorization header, or (browsers
cannot set headers on a WebSocket) the subprotocol `sandfleet.bearer.<base64url of the token>` next
to `sandfleet.terminal`, which the server selects. Then:

- client -> server: first a text frame, a `TerminalRequest` (`{"type": "start", "rows": 24, ...}`);
  then binary frames are keystrokes, and text frames `{"type": "resize", "rows": R, "cols": C}`;
- server -> client: text `{"type": "started", "pid": N}`; binary frames are the terminal's output;
  text `{"type": "exit", "result": ExecResult}`, then a normal close (1000);
- a failure at any point is a text `{"type": "error", "error": {code, message, retryable, cause}}`,
  then a close with code 4000 + the HTTP status its code has elsewhere (4400, 4401, 4403, 4404, ...).

The client leaving kills what runs on the terminal.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, WebSocket
from pydantic import ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from sandfleet.client._base import TERMINAL_PROTOCOL, terminal_credentials, terminal_origin_ok
from sandfleet.daemon.api.common import OPERATION, Api, log
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.protocol import Terminal
from sandfleet.errors import InternalError, InvalidArgumentError, PermissionDeniedError, SandboxError
from sandfleet.models import ExecResult, TerminalRequest, TerminalResize, shown, validation_message

PROTOCOL = TERMINAL_PROTOCOL
START_TIMEOUT = 10.0  # for the start message, after the upgrade
MAX_INPUT = 64 * 1024  # one keystroke frame (a paste), bytes
FRAME = 64 * 1024  # output bytes per frame to the client
HIGH = 1024**2  # output waiting for the client past which the agent stops reading the terminal
LOW = 256 * 1024  # ... and below which it reads on


class _Ended(Exception):
    """One side of the relay is over: the other stops too."""


def credentials(ws: WebSocket) -> str:
    """The Authorization header this connection stands for ('' when none)."""
    return terminal_credentials(offered(ws), ws.headers.get("authorization", ""))


def offered(ws: WebSocket) -> list[str]:
    """The subprotocols the client offered (ASGI's scope has them; the header may be gone from it)."""
    return [str(p) for p in ws.scope.get("subprotocols") or ()]


def check_origin(ws: WebSocket) -> None:
    origin = ws.headers.get("origin")
    if not terminal_origin_ok(origin, ws.headers.get("host", "")):
        raise PermissionDeniedError(f"a terminal opened from another site ({shown(origin or '')}) is refused")


def router(
    api: Api,
    auth: Callable[[str], Any] | None,
    audit: Callable[[WebSocket, int, float], None],
) -> APIRouter:
    r = APIRouter()
    node, tenancy = api.node, api.tenancy
    opening = OPERATION["terminal_doc"]

    @api.route(r, "terminal_doc", response_model=None)
    async def terminal_doc(sandbox_id: str) -> None:
        """A WebSocket (this GET must be an upgrade): a command on a new pseudo-terminal in the sandbox.

        Credentials: the Authorization header, or the subprotocol `sandfleet.bearer.<base64url token>`
        next to `sandfleet.terminal`. Client: first a text frame, a `TerminalRequest` (`{"type":
        "start", "rows": 24, "cols": 80, "command": ...}`); then binary frames are keystrokes and text
        frames `{"type": "resize", "rows": R, "cols": C}`. Server: `{"type": "started", "pid": N}`,
        binary frames of output, `{"type": "exit", "result": ExecResult}` and a normal close; on a
        failure `{"type": "error", "error": {...}}` and a close with code 4000 + the HTTP status. A
        read-only token is refused. Leaving kills what runs on the terminal."""
        raise InvalidArgumentError("this endpoint is a WebSocket: send a GET with `Upgrade: websocket`")

    @r.websocket("/v1/sandboxes/{sandbox_id}/terminal")
    async def terminal(ws: WebSocket, sandbox_id: str) -> None:
        await ws.accept(subprotocol=PROTOCOL if PROTOCOL in offered(ws) else None)
        t0 = time.perf_counter()
        term: Terminal | None = None
        status = 200
        try:
            check_origin(ws)
            if auth is not None:
                caller = auth(credentials(ws))  # also makes the caller current (tenancy reads it)
                ws.scope["sandfleet.caller"] = caller
                if not caller.can_write:
                    raise PermissionDeniedError(f"token {caller.name} is read-only")
            if tenancy.iam is not None:  # the route's scoping, as a dependency does it for the GET
                await tenancy.admit(opening, {"sandbox_id": sandbox_id})
            req = await _start_request(ws)
            term = await node.execs.open_terminal(sandbox_id, req)
            audit(ws, 101, t0)  # opened (and again when it closes, with how)
            await ws.send_text(json.dumps({"type": "started", "pid": term.pid}))
            await _relay(ws, term)
        except WebSocketDisconnect:
            pass
        except Exception as exc:
            wire = exc if isinstance(exc, SandboxError) else to_wire_error(exc)
            if isinstance(wire, InternalError):
                log.exception("unexpected error serving a terminal of %s", sandbox_id)
            status = wire.http_status
            await _fail(ws, wire)
        finally:
            if term is not None:
                await term.close()
            audit(ws, status, t0)

    return r


async def _start_request(ws: WebSocket) -> TerminalRequest:
    try:
        async with asyncio.timeout(START_TIMEOUT):
            msg = await ws.receive()
    except TimeoutError:
        raise InvalidArgumentError(f"no start message within {START_TIMEOUT:.0f}s") from None
    if msg["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(msg.get("code", 1000))
    if msg.get("text") is None:
        raise InvalidArgumentError("the first message must be a text frame: a TerminalRequest")
    try:
        return TerminalRequest.model_validate_json(msg["text"])
    except ValidationError as exc:
        raise InvalidArgumentError(validation_message(exc.errors())) from None


async def _relay(ws: WebSocket, term: Terminal) -> None:
    """Output to the client through a bounded backlog: past HIGH bytes not yet sent, the agent stops
    reading the terminal (its writer blocks, as on a real terminal) until the client caught up to
    LOW. A slow or stalled client costs the node at most about HIGH, never the whole flood."""
    backlog = bytearray()
    ready = asyncio.Event()
    ended: list[ExecResult | None] = []
    held = False

    async def agent_side() -> None:
        nonlocal held
        async for item in term.output():
            if isinstance(item, ExecResult):
                ended.append(item)
                break
            backlog.extend(item)
            ready.set()
            if not held and len(backlog) > HIGH:
                held = True
                await term.hold(True)
        if not ended:
            ended.append(None)
        ready.set()

    async def client_side() -> None:
        nonlocal held
        while True:
            await ready.wait()
            ready.clear()
            while backlog:
                chunk = bytes(backlog[:FRAME])
                del backlog[:FRAME]
                await ws.send_bytes(chunk)
                if held and len(backlog) < LOW:
                    held = False
                    await term.hold(False)
            if ended:
                if ended[0] is not None:
                    await ws.send_text(json.dumps({"type": "exit", "result": ended[0].model_dump(mode="json")}))
                    await ws.close(1000)
                raise _Ended

    async def keys() -> None:
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                raise _Ended
            data = msg.get("bytes")
            if data is not None:
                if len(data) > MAX_INPUT:
                    raise InvalidArgumentError(f"an input frame is larger than {MAX_INPUT} bytes")
                if data:
                    await term.write(data)
                continue
            try:
                resize = TerminalResize.model_validate_json(msg.get("text") or "")
            except ValidationError as exc:
                raise InvalidArgumentError(validation_message(exc.errors())) from None
            await term.resize(resize.rows, resize.cols)

    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(agent_side())
            tg.create_task(client_side())
            tg.create_task(keys())
    except* (_Ended, WebSocketDisconnect, OSError):
        pass  # one side is over (OSError: the client's connection went away mid-send)
    except* SandboxError as eg:
        raise eg.exceptions[0] from None


async def _fail(ws: WebSocket, exc: SandboxError) -> None:
    if ws.application_state != WebSocketState.CONNECTED or ws.client_state != WebSocketState.CONNECTED:
        return
    try:
        await ws.send_text(json.dumps({"type": "error", "error": exc.to_wire()}))
        await ws.close(4000 + exc.http_status)
    except (WebSocketDisconnect, RuntimeError, OSError):
        pass
