"""Where the daemon is (`Endpoint`: a unix socket, a node's URL, or several gateways) and how a
call moves on when one fails (`fail_over`, `Route`); transport errors as the `SandboxError` tree."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import httpx

from sandfleet.client._base.wire import Call
from sandfleet.errors import InvalidArgumentError, SandboxError, SandboxTimeoutError, UnavailableError, error_from_wire

DEFAULT_SOCKET = "/run/sandfleet/sandfleet.sock"
# With several gateways: a connection not made within this many seconds moves on to the next one.
FAILOVER_CONNECT = 5.0


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is: a unix socket (default), or HTTP URLs (a node's, or one or several
    cluster gateways': `urls`, the first used first) with a bearer token."""

    socket: str | None
    url: str
    token: str | None
    urls: tuple[str, ...] = ()

    @classmethod
    def resolve(
        cls, socket: str | os.PathLike[str] | Sequence[str] | None, url: str | Sequence[str] | None, token: str | None
    ) -> Endpoint:
        if url is None and isinstance(socket, str) and socket.startswith(("http://", "https://")):
            url, socket = socket, None  # Client("http://gateway:8600", token=...)
        elif url is None and isinstance(socket, list | tuple):
            url, socket = socket, None  # Client(["http://gw1:8600", "http://gw2:8600"], token=...)
        url = url or os.environ.get("SANDFLEET_URL")
        token = token or os.environ.get("SANDFLEET_TOKEN")
        if url:
            urls = tuple(u.strip().rstrip("/") for u in (url.split(",") if isinstance(url, str) else url) if u.strip())
            if not urls:
                raise InvalidArgumentError("no URL given")
            return cls(None, urls[0], token, urls)
        sock = str(socket or os.environ.get("SANDFLEET_SOCKET") or DEFAULT_SOCKET)
        return cls(sock, "http://sandfleet", token, ("http://sandfleet",))

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self) -> str:
        if self.socket:
            return f"unix socket {self.socket}"
        return self.url if len(self.urls) < 2 else "any of " + ", ".join(self.urls)

    def timeout(self, timeout: float | httpx.Timeout) -> float | httpx.Timeout:
        """A call's timeouts, the connect phase cut to FAILOVER_CONNECT when other gateways wait."""
        if len(self.urls) < 2:
            return timeout
        t = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        connect = min(t.connect or FAILOVER_CONNECT, FAILOVER_CONNECT)
        return httpx.Timeout(connect=connect, read=t.read, write=t.write, pool=t.pool)


def fail_over(
    http: httpx.Client | httpx.AsyncClient, endpoint: Endpoint, base: httpx.URL, exc: BaseException, call: Call
) -> bool:
    """After a transport failure of `call` at `base`: with several gateways, every later call goes
    to the next one. True when `call` itself may be sent there at once: it surely never reached
    `base` (no connection was made), or it is a read that did not time out. Anything else is for
    the caller's own retries (creates have them, with their idempotency key)."""
    if len(endpoint.urls) < 2:
        return False
    if http.base_url == base:
        here = str(base).rstrip("/")
        i = endpoint.urls.index(here) if here in endpoint.urls else -1
        http.base_url = endpoint.urls[(i + 1) % len(endpoint.urls)]
    if not request_sent(exc):
        return True
    return call.method in ("GET", "HEAD") and not isinstance(exc, httpx.TimeoutException)


class Route:
    """One call's way through the gateways: where it was last sent, and whether a transport failure
    there sends it to the next one (`fail_over`, at most once per gateway)."""

    def __init__(self, http: httpx.Client | httpx.AsyncClient, endpoint: Endpoint, call: Call) -> None:
        self.http, self.endpoint, self.call = http, endpoint, call
        self.left = len(endpoint.urls)
        self.base = http.base_url

    def sending(self) -> None:
        self.base = self.http.base_url

    def failed(self, exc: Exception, again: bool = True) -> SandboxError | None:
        """After a transport failure: None if the call is to be sent again (to the next gateway),
        else the error to raise. `again` False: it is not (a stream whose items were given)."""
        self.left -= 1
        if again and fail_over(self.http, self.endpoint, self.base, exc, self.call) and self.left > 0:
            return None
        return map_transport_error(exc, self.endpoint)


def transport_cause(exc: SandboxError) -> BaseException | None:
    """The transport exception a SandboxError was raised from (`map_transport_error`), if any."""
    cause = exc.__cause__
    return cause if isinstance(cause, httpx.HTTPError | OSError) else None


def request_sent(cause: BaseException) -> bool:
    """False when the request surely never reached the daemon: no connection was made."""
    return not isinstance(
        cause,
        httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout | FileNotFoundError | ConnectionRefusedError,
    )


# httpx writes a request's headers and body separately; without TCP_NODELAY the body waits for the
# ACK of the headers, which the server delays (40 ms on Linux): every small call over TCP paid it.
TCP_OPTIONS: Final = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]


def raise_for(response_status: int, body: bytes, endpoint: Endpoint) -> None:
    if response_status < 400:
        return
    try:
        decoded: object = json.loads(body)
    except ValueError:
        decoded = body[:200].decode(errors="replace")
    raise error_from_wire(decoded, status=response_status)


def map_transport_error(exc: Exception, endpoint: Endpoint) -> SandboxError:
    if isinstance(exc, httpx.TimeoutException):
        return SandboxTimeoutError(f"request to sandfleet at {endpoint.describe()} timed out ({type(exc).__name__})")
    if isinstance(exc, httpx.ConnectError | FileNotFoundError | ConnectionRefusedError):
        if endpoint.socket:
            return UnavailableError(
                f"cannot reach the sandfleet daemon at {endpoint.describe()} (is `sandfleet serve` running?)"
            )
        return UnavailableError(f"cannot reach sandfleet at {endpoint.describe()} ({type(exc).__name__})")
    return UnavailableError(f"transport error talking to sandfleet at {endpoint.describe()}: {exc}")
