"""`AsyncTerminal`: a command on a pseudo-terminal in a sandbox, over a WebSocket."""

from __future__ import annotations

import contextlib
import queue
import re
import time
from typing import TYPE_CHECKING, Any

import httpx
import wsproto.events
from httpx_ws import (
    AsyncWebSocketSession,
    WebSocketDisconnect,
    WebSocketNetworkError,
    WebSocketUpgradeError,
    aconnect_ws,
)
from wsproto.utilities import LocalProtocolError

from sandfleet.client import _base as b
from sandfleet.errors import SandboxTimeoutError, WrongStateError
from sandfleet.models import ExecResult

if TYPE_CHECKING:
    from sandfleet.client.aio._sandbox import AsyncSandbox


class AsyncTerminal:
    """A command on a pseudo-terminal in a sandbox (`AsyncSandbox.terminal`). Output is read with
    `read()` / `expect()`; `result` is set once the command exited (`wait()`)."""

    def __init__(self, sandbox: AsyncSandbox) -> None:
        self.sandbox = sandbox
        self.pid = -1
        self.result: ExecResult | None = None
        self._stack = contextlib.AsyncExitStack()
        self._ws: AsyncWebSocketSession | None = None
        self._pending = bytearray()  # read but not yet returned by expect()

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _open(self, start: str) -> None:
        c = self.sandbox._c
        base = c._http.base_url
        try:
            ws: AsyncWebSocketSession = await self._stack.enter_async_context(
                aconnect_ws(
                    b.terminal_path(self.sandbox.id),
                    c._http,
                    subprotocols=[b.TERMINAL_PROTOCOL],
                    max_message_size_bytes=b.TERMINAL_FRAME,
                    queue_size=64,  # frames read ahead; past them the daemon holds the command back
                    keepalive_ping_interval_seconds=None,
                )
            )
            self._ws = ws
            with contextlib.suppress(LocalProtocolError):  # refused at once: its error message is read next
                await ws.send_text(start)
            first = await self._next(b.TERMINAL_OPEN_TIMEOUT)
            if not isinstance(first, dict) or first.get("type") != "started":
                raise b.terminal_closed(None, "no `started` message")
            self.pid = int(first.get("pid", -1))
        except WebSocketUpgradeError as exc:
            await self.aclose()
            b.raise_for(exc.response.status_code, exc.response.content, c.endpoint)
            raise b.terminal_closed(exc.response.status_code, "not upgraded") from exc
        except (httpx.HTTPError, OSError) as exc:
            await self.aclose()
            b.fail_over(c._http, c.endpoint, base, exc, b.Call("GET", b.terminal_path(self.sandbox.id)))  # later calls
            raise b.map_transport_error(exc, c.endpoint) from exc
        except BaseException:
            await self.aclose()
            raise

    async def _next(self, timeout: float | None) -> bytes | dict[str, Any] | None:
        """The next frame: bytes of output, a message (dict), None after the exit or on timeout."""
        if self._ws is None:
            return None
        try:
            event = await self._ws.receive(timeout)
        except (TimeoutError, queue.Empty):
            return None
        except WebSocketDisconnect as exc:
            self._ws = None
            if self.result is None:
                raise b.terminal_closed(exc.code, exc.reason) from None
            return None
        except WebSocketNetworkError as exc:
            self._ws = None
            raise b.map_transport_error(exc, self.sandbox._c.endpoint) from exc
        if isinstance(event, wsproto.events.BytesMessage):
            return bytes(event.data)
        if isinstance(event, wsproto.events.TextMessage):
            msg = b.terminal_message(event.data)
            if msg.get("type") == "exit":
                self.result = b.terminal_result(msg)
            return msg
        return await self._next(timeout)

    async def send(self, data: str | bytes) -> None:
        """Keystrokes: text (UTF-8) or bytes, as a terminal sends them ("\\r" is Enter)."""
        if self._ws is None:
            raise WrongStateError("the terminal is closed")
        raw = b.as_bytes(data)
        for off in range(0, len(raw), 32 * 1024):
            await self._ws.send_bytes(raw[off : off + 32 * 1024])

    async def resize(self, rows: int, cols: int) -> None:
        if self._ws is None:
            raise WrongStateError("the terminal is closed")
        await self._ws.send_text(b.terminal_resize(rows, cols))

    async def read(self, timeout: float | None = None) -> bytes:
        """Output that has arrived (waiting up to `timeout` for some; None: until some comes);
        b"" once the command exited, or when nothing came in time."""
        if self._pending:
            out = bytes(self._pending)
            self._pending.clear()
            return out
        while self._ws is not None:
            item = await self._next(timeout)
            if item is None:
                return b""
            if isinstance(item, bytes):
                return item
            if self.result is not None:
                return b""
        return b""

    async def expect(self, pattern: str | bytes | re.Pattern[bytes], timeout: float = 10.0) -> bytes:
        """Output up to and including the first match of `pattern` (a substring, or a compiled bytes
        regex matching at most 4 KiB); the rest stays for the next read. Of a flood before the match
        only the last MiB is kept. SandboxTimeoutError when it does not come in time."""
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(b.as_bytes(pattern)))
        deadline = time.monotonic() + timeout
        seen = bytearray(self._pending)
        self._pending.clear()
        start = 0  # where a match may still begin: each chunk is searched once (with some overlap)
        while (m := regex.search(seen, start)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self._ws is None:
                self._pending[:] = seen
                raise SandboxTimeoutError(f"{regex.pattern!r} did not appear in {timeout}s: {bytes(seen[-300:])!r}")
            item = await self._next(left)
            if isinstance(item, bytes):
                if len(seen) > b.EXPECT_KEEP:  # a flood before the match: keep its end only
                    del seen[: len(seen) - b.EXPECT_KEEP // 2]
                start = max(0, len(seen) - b.EXPECT_OVERLAP)
                seen += item
        self._pending[:] = seen[m.end() :]
        return bytes(seen[: m.end()])

    async def wait(self, timeout: float | None = None) -> ExecResult:
        """Read (and drop) output until the command exits; its result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.result is None:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self._ws is None:
                raise SandboxTimeoutError(f"the terminal's command did not exit within {timeout}s")
            await self._next(left)
        return self.result

    async def aclose(self) -> None:
        """Disconnect: the daemon kills what still runs on the terminal."""
        ws, self._ws = self._ws, None
        try:
            if ws is not None:
                with contextlib.suppress(Exception):
                    await ws.close()
        finally:
            with contextlib.suppress(Exception):
                await self._stack.aclose()
