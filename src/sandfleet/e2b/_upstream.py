"""sandfleet's API as an E2B caller: one client per API key."""

from __future__ import annotations

import asyncio
import base64
import collections
import hashlib
import posixpath
from typing import Any

from starlette.responses import JSONResponse

from sandfleet.client import AsyncClient
from sandfleet.client.aio import AsyncSandbox
from sandfleet.errors import InvalidArgumentError, SandboxError, SandboxNotFoundError, UnauthenticatedError
from sandfleet.models import SandboxInfo

MAX_CLIENTS = 64  # keys served at once (each its own connection pool); the least recent is closed
HOME = "/home/user"  # where envd's relative paths lead: the home of E2B's user (e2b/base.toml makes it)


def resolve(path: str) -> str:
    """An envd path: absolute, or relative to the user's home."""
    if not path:
        raise InvalidArgumentError("a path is required")
    return posixpath.normpath(posixpath.join(HOME, path))


def envd_user(headers: Any, query: Any = None) -> str | None:
    """The user an envd call names: `Authorization: Basic base64(user:)` (Connect calls) or the
    `username` query parameter (/files); None: the sandbox's default user."""
    if query is not None and (name := query.get("username")):
        return str(name)
    auth = headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:
            name = base64.b64decode(auth[6:].strip(), validate=True).decode().partition(":")[0]
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidArgumentError("the Authorization header is not HTTP Basic") from exc
        return name or None
    return None


def not_found_message(exc: Exception) -> str:
    """A sandbox that is not there, in the words E2B's SDK reads as "not running" (`was not found`)."""
    return f"the sandbox was not found ({exc})"


def edge_error(exc: SandboxError) -> JSONResponse:
    """envd's error body ({code, message}); a sandbox that is not there is the edge's 502, in the
    words E2B's SDK reads as "not running"."""
    if isinstance(exc, SandboxNotFoundError):
        return JSONResponse({"code": 502, "message": not_found_message(exc)}, status_code=502)
    return JSONResponse({"code": exc.http_status, "message": str(exc)}, status_code=exc.http_status)


def envd_key(headers: Any) -> str | None:
    """The key an envd call carries: X-Access-Token (envd, the interpreter's /execute), else
    E2B-Traffic-Access-Token (the interpreter's other calls): both are the create's answer."""
    key: str | None = headers.get("x-access-token") or headers.get("e2b-traffic-access-token")
    return key


def owner(key: str | None) -> str:
    """Who holds something the E2B layer keeps between calls (a terminal, a watcher): the key's digest."""
    return hashlib.sha256((key or "").encode()).hexdigest()


class Upstream:
    """The node's or gateway's API at `url`, called with each E2B key as its sandfleet token."""

    def __init__(self, url: str, timeout: float) -> None:
        self.url = url
        self.timeout = timeout
        self._clients: collections.OrderedDict[str, AsyncClient] = collections.OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()

    def client(self, key: str | None) -> AsyncClient:
        if not key:
            raise UnauthenticatedError("an E2B API key (X-API-Key) or access token (X-Access-Token) is required")
        name = owner(key)
        found = self._clients.pop(name, None)
        if found is None:
            found = AsyncClient(url=self.url, token=key, timeout=self.timeout)
            if len(self._clients) >= MAX_CLIENTS:
                _, oldest = self._clients.popitem(last=False)
                # Closed once its calls are done; a flood of keys (bogus ones too) closes at once past
                # MAX_CLIENTS waiting, so what it holds stays bounded.
                wait = self.timeout if len(self._closing) < MAX_CLIENTS else 0.0
                task = asyncio.create_task(self._close_later(oldest, wait))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)
        self._clients[name] = found
        return found

    @staticmethod
    async def _close_later(client: AsyncClient, wait: float) -> None:
        await asyncio.sleep(wait)  # a call of that key may still be using it
        await client.aclose()

    def sandbox(self, key: str | None, sandbox_id: str) -> AsyncSandbox:
        """A handle on `sandbox_id` without asking for it first (its first call says if it is there)."""
        info = SandboxInfo.model_construct(id=sandbox_id)  # type: ignore[call-arg]  # only its id is read
        return AsyncSandbox(self.client(key), info)

    def envd_sandbox(self, headers: Any) -> AsyncSandbox:
        """The sandbox an envd call names (E2b-Sandbox-Id), as the key it carries (X-Access-Token)."""
        sandbox_id = headers.get("e2b-sandbox-id")
        if not sandbox_id:
            raise InvalidArgumentError("the E2b-Sandbox-Id header is required")
        return self.sandbox(envd_key(headers), sandbox_id)

    async def aclose(self) -> None:
        for task in list(self._closing):
            task.cancel()
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
