"""Terminals: the WebSocket protocol's messages, and who may open one (the daemon and the gateway
check a browser's credentials and origin with these)."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from sandfleet.client._base.commands import CommandOptions
from sandfleet.client._base.wire import _sb, _validated
from sandfleet.errors import InternalError, SandboxError, UnavailableError, error_from_wire
from sandfleet.models import ExecResult, TerminalRequest, TerminalResize

TERMINAL_PROTOCOL = "sandfleet.terminal"
TERMINAL_FRAME = 1 << 20  # the largest WebSocket message a terminal accepts (output comes in <= 64 KiB)
TERMINAL_OPEN_TIMEOUT = 30.0  # from the upgrade to the daemon's `started`
EXPECT_KEEP = 2 * 1024**2  # `expect`: output kept while looking for a match (halved when past it)
EXPECT_OVERLAP = 4096  # ... and how far back into what was searched a match may begin


TERMINAL_BEARER = "sandfleet.bearer."  # + base64url(token), no padding: a browser's credentials


def terminal_credentials(subprotocols: Sequence[str], authorization: str) -> str:
    """The Authorization header a terminal WebSocket stands for: a browser, which cannot set headers
    on one, sends its token as the subprotocol `sandfleet.bearer.<base64url>` ('' when none)."""
    for proto in subprotocols:
        proto = proto.strip()
        if proto.startswith(TERMINAL_BEARER):
            raw = proto[len(TERMINAL_BEARER) :]
            try:
                token = base64.b64decode(raw + "=" * (-len(raw) % 4), altchars=b"-_", validate=True).decode()
                return "Bearer " + (token or "\0")
            except (ValueError, UnicodeDecodeError):
                return "Bearer \0"  # a token no one has: refused like any wrong one
    return authorization


def terminal_origin_ok(origin: str | None, host: str) -> bool:
    """A terminal WebSocket a browser opened from a page of this host (or a client that is not a
    browser: no Origin): never one from another site's page, credentials or not."""
    if origin is None:
        return True
    return urlsplit(origin).netloc.lower() == host.lower()


def terminal_path(sandbox_id: str) -> str:
    return _sb(sandbox_id, "/terminal")


def terminal_start(command: str | list[str] | None, options: CommandOptions, *, rows: int, cols: int) -> str:
    """The terminal's first message: a TerminalRequest, checked here (bad input fails before connecting)."""
    fields = {"type": "start", "command": command, "rows": rows, "cols": cols, **options.fields()}
    return _validated(TerminalRequest, "terminal request", fields).model_dump_json(exclude_unset=True)


def terminal_resize(rows: int, cols: int) -> str:
    return _validated(TerminalResize, "terminal size", {"type": "resize", "rows": rows, "cols": cols}).model_dump_json()


def terminal_message(text: str) -> dict[str, Any]:
    """A text frame of the daemon: `started`, `exit` (returned), or `error` (raised)."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise InternalError(f"malformed terminal message from the daemon: {text[:200]!r}") from exc
    if not isinstance(data, dict):
        raise InternalError(f"malformed terminal message from the daemon: {text[:200]!r}")
    if data.get("type") == "error":
        raise error_from_wire(data)
    return data


def terminal_result(data: dict[str, Any]) -> ExecResult:
    try:
        return ExecResult.model_validate(data.get("result"))
    except ValueError as exc:
        raise InternalError(f"malformed terminal exit from the daemon: {exc}") from exc


def terminal_closed(code: int | None, reason: str | None) -> SandboxError:
    """The daemon closed the terminal without saying why in a message first."""
    return UnavailableError(f"the terminal's connection closed (code {code}{': ' + reason if reason else ''})")
