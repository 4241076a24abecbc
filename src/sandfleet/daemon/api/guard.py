"""What every HTTP call passes through before its route, as one plain ASGI layer: who calls
(authentication, read-only tokens), an answer for any exception a route lets out, and the call's
audit record. Plain ASGI rather than Starlette's `BaseHTTPMiddleware`, which ran each call in a task
group of its own with memory streams between (a fifth of the daemon's CPU per `exec`)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Protocol

from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandfleet.daemon.api.common import error_response, log
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.errors import InternalError, PermissionDeniedError, SandboxError

CALLER = "sandfleet.caller"  # where the authenticated caller is kept in the request's scope
_SANDBOX_PATH = re.compile(r"^/v1/sandboxes/(sb-[0-9a-f]{1,32})(?:/|$)")
_READS = ("GET", "HEAD")


class Caller(Protocol):
    """Who a request comes from, as the routes' layer needs to know it (daemon/security/iam.py's `Principal`)."""

    @property
    def name(self) -> str: ...

    @property
    def can_write(self) -> bool: ...

    def actor(self, host: str | None) -> str:
        """How the audit stream names it, calling from `host` (None: the unix socket)."""
        ...


# The caller an Authorization header ('' when there is none) stands for, or UnauthenticatedError. It
# also makes the caller current for the service the routes call (daemon/security/iam.py: `Iam.enter`).
Authenticate = Callable[[str], Caller]
# Records one call: (actor, {method, path, status, ms, sandbox_id, agent}) (`SandboxManager.audit_call`).
AuditCall = Callable[[str, dict[str, Any]], None]


class Auditor:
    """Writes a call's audit record: who, what, the answer's status and how long it took to start."""

    def __init__(self, record: AuditCall, authenticated: bool) -> None:
        self.record, self.authenticated = record, authenticated

    def __call__(self, conn: HTTPConnection, status: int, t0: float) -> None:
        path = conn.url.path
        m = _SANDBOX_PATH.match(path)
        try:
            self.record(
                _actor(conn, self.authenticated),
                {
                    "method": conn.scope.get("method", "WEBSOCKET"),
                    "path": path[:256],
                    "status": status,
                    "ms": round((time.perf_counter() - t0) * 1000, 2),
                    "sandbox_id": m.group(1) if m else None,
                    "agent": conn.headers.get("user-agent", "")[:64] or None,
                },
            )
        except Exception:
            log.exception("auditing %s failed", path[:100])


class Guard:
    """ASGI middleware around the API's routes (HTTP calls; WebSockets audit themselves)."""

    def __init__(self, app: ASGIApp, *, audit: Auditor, metrics: Metrics, authenticate: Authenticate | None) -> None:
        self.app, self.audit, self.metrics, self.authenticate = app, audit, metrics, authenticate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        conn = HTTPConnection(scope)
        if self.authenticate is not None:
            try:
                caller = self.authenticate(conn.headers.get("authorization", ""))
                scope[CALLER] = caller
                if not caller.can_write and scope["method"] not in _READS:
                    raise PermissionDeniedError(f"token {caller.name} is read-only")
            except SandboxError as exc:
                self.metrics.http_errors.labels(code=exc.code).inc()
                await self._answer(exc, conn, receive, send, t0)
                return
        started = False

        async def send_audited(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.audit(conn, message["status"], t0)
            await send(message)

        try:
            await self.app(scope, receive, send_audited)
        except Exception as exc:
            # Here rather than in an exception handler: Starlette re-raises after running an
            # Exception handler, and uvicorn then drops the client's keep-alive connection.
            if started:  # a stream broke after its status went out: nothing left to answer with
                raise
            wire = to_wire_error(exc)
            if isinstance(wire, InternalError):
                log.exception("unexpected error serving %s %s", scope["method"], scope["path"])
            else:
                log.warning("%s serving %s %s: %s", wire.code, scope["method"], scope["path"], exc)
            self.metrics.http_errors.labels(code=wire.code).inc()
            self.metrics.failures.labels(cause=wire.cause).inc()
            await self._answer(wire, conn, receive, send, t0)

    async def _answer(self, exc: SandboxError, conn: HTTPConnection, receive: Receive, send: Send, t0: float) -> None:
        response = error_response(exc)
        self.audit(conn, response.status_code, t0)
        await response(conn.scope, receive, send)


def _actor(conn: HTTPConnection, authenticated: bool) -> str:
    """Who called: the caller (`token:<name>@<host>`; the legacy token `token@<host>`), root's unix
    socket (`unix`); a refused caller as `token@<host>`; a TCP peer when nothing is checked."""
    client = conn.client
    host = client.host if client is not None and client.host else None
    caller: Caller | None = conn.scope.get(CALLER)
    if caller is not None:
        return caller.actor(host)
    if host is None:
        return "unix"
    return f"{'token' if authenticated else 'tcp'}@{host}"
