"""A terminal WebSocket through the gateway: the caller's connection relayed, frame for frame, to the
same endpoint on the node holding the sandbox, with the caller's own credentials (the node decides
what they may do; see daemon/api/terminal.py for the protocol)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from contextlib import AbstractAsyncContextManager

import httpx
import wsproto.events
from httpx_ws import (
    AsyncWebSocketSession,
    WebSocketDisconnect,
    WebSocketNetworkError,
    WebSocketUpgradeError,
    aconnect_ws,
)
from starlette.websockets import WebSocket, WebSocketState
from starlette.websockets import WebSocketDisconnect as ClientGone

from sandfleet.client._base import TERMINAL_FRAME, TERMINAL_PROTOCOL, terminal_credentials, terminal_origin_ok
from sandfleet.cluster.membership import Membership
from sandfleet.daemon.security.iam import Iam
from sandfleet.errors import PermissionDeniedError, SandboxError, UnavailableError


async def relay(ws: WebSocket, iam: Iam, membership: Membership) -> None:
    offered = [str(p) for p in ws.scope.get("subprotocols") or ()]  # ASGI's list (not always a header)
    await ws.accept(subprotocol=TERMINAL_PROTOCOL if TERMINAL_PROTOCOL in offered else None)
    sandbox_id = ws.path_params["sandbox_id"]
    try:
        credentials = terminal_credentials(offered, ws.headers.get("authorization", ""))
        origin = ws.headers.get("origin")
        if not terminal_origin_ok(origin, ws.headers.get("host", "")):
            raise PermissionDeniedError("a terminal opened from another site is refused")
        iam.authenticate(credentials)
        node = membership.holder(sandbox_id)
        try:
            connect: AbstractAsyncContextManager[AsyncWebSocketSession] = aconnect_ws(
                f"/v1/sandboxes/{sandbox_id}/terminal",
                node.http,
                headers={"authorization": credentials},
                subprotocols=[TERMINAL_PROTOCOL],
                max_message_size_bytes=TERMINAL_FRAME,
                queue_size=8,  # frames read ahead from the node: its flow control reaches past us
                keepalive_ping_interval_seconds=None,
            )
            async with connect as upstream:
                await _pipe(ws, upstream)
        except* (httpx.HTTPError, OSError, WebSocketUpgradeError, WebSocketNetworkError) as eg:
            why = type(eg.exceptions[0]).__name__  # the exception's text may name the node's address
            raise UnavailableError(f"node {node.key} holding {sandbox_id} is unreachable: {why}") from None
    except* SandboxError as eg:
        await _fail(ws, eg.exceptions[0])  # type: ignore[arg-type]
    except* ClientGone:
        pass


async def _pipe(ws: WebSocket, upstream: AsyncWebSocketSession) -> None:
    async def down() -> None:  # node -> caller
        while True:
            try:
                event = await upstream.receive()
            except WebSocketDisconnect as exc:
                await ws.close(exc.code or 1000)
                return
            if isinstance(event, wsproto.events.BytesMessage):
                await ws.send_bytes(bytes(event.data))
            elif isinstance(event, wsproto.events.TextMessage):
                await ws.send_text(event.data)

    async def up() -> None:  # caller -> node
        while True:
            msg = await ws.receive()
            if msg["type"] == "websocket.disconnect":
                return
            if msg.get("bytes") is not None:
                await upstream.send_bytes(msg["bytes"])
            elif msg.get("text") is not None:
                await upstream.send_text(msg["text"])

    tasks = [asyncio.create_task(down()), asyncio.create_task(up())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _fail(ws: WebSocket, exc: SandboxError) -> None:
    if ws.client_state != WebSocketState.CONNECTED or ws.application_state != WebSocketState.CONNECTED:
        return
    with contextlib.suppress(ClientGone, RuntimeError, OSError):
        await ws.send_text(json.dumps({"type": "error", "error": exc.to_wire()}))
        await ws.close(4000 + exc.http_status)
