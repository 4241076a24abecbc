"""`AsyncClient`: its lifecycle; its calls are those of the node, images, fleet and trajectories."""

from __future__ import annotations

import os
from collections.abc import Sequence

import httpx

from sandfleet.client import _base as b
from sandfleet.client.aio._fleet import _Fleet
from sandfleet.client.aio._images import _Images
from sandfleet.client.aio._node import _Node
from sandfleet.client.aio._rl import _Trajectories

# async-only: begin
# isort: split
from sandfleet.client._batch import CallBatcher

# async-only: end


class AsyncClient(_Node, _Images, _Fleet, _Trajectories):
    """Talks to a sandfleet daemon. `async with AsyncClient() as fleet: sb = await fleet.create(...)`.

    `timeout` (seconds) is the deadline of every call that has none of its own: a daemon that stops
    answering raises `SandboxTimeoutError` after it, streams included (there it bounds silence, never
    below `b.MIN_SILENCE`: the daemon sends heartbeats while a command is quiet). `transport`
    replaces the HTTP transport (tests pass an `httpx.MockTransport`); `socket`/`url` then only name
    the daemon in errors. Several URLs (a list, or comma-separated): a cluster's gateways, calls move
    to the next one when one fails (see `b.fail_over`).
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | Sequence[str] | None = None,
        *,
        url: str | Sequence[str] | None = None,
        token: str | None = None,
        timeout: float = b.DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = b.Endpoint.resolve(socket, url, token)
        self.timeout = b.check_timeout(timeout, b.DEFAULT_TIMEOUT)
        own_transport = transport is None
        if transport is None and self.endpoint.socket:
            transport = httpx.AsyncHTTPTransport(uds=self.endpoint.socket)
        elif transport is None:  # TCP: a request's headers and body leave at once (no Nagle wait)
            transport = httpx.AsyncHTTPTransport(socket_options=b.TCP_OPTIONS)
        self._http = httpx.AsyncClient(
            base_url=self.endpoint.url, transport=transport, timeout=self.timeout, headers=self.endpoint.headers()
        )
        # a local daemon's one-response calls skip httpx (b.lane); its streams and terminals keep to it
        self._lane = (
            b.Lane[b.AsyncConnection](self.endpoint.socket, self._http.headers)
            if own_transport and self.endpoint.socket
            else None
        )
        # async-only: begin
        self._batcher: CallBatcher | None = None
        # async-only: end

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._lane is not None:
            self._lane.close()
        await self._http.aclose()
