"""How the async client sends calls: one answer, or an ndjson stream (`AsyncEventStream`), retried
creates and idempotent calls; the base of the client's calls (`_AsyncCalls`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import httpx
from pydantic import BaseModel

from sandfleet.client import _base as b
from sandfleet.errors import SandboxError
from sandfleet.models import ExecResult

if TYPE_CHECKING:
    from sandfleet.client.aio._client import AsyncClient

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class _AsyncCalls:
    """What every group of the client's calls builds on: the daemon's endpoint, the client's
    timeout, its HTTP client, and how a call is sent."""

    endpoint: b.Endpoint
    timeout: float
    _http: httpx.AsyncClient
    _lane: b.Lane[b.AsyncConnection] | None

    @property
    def _client(self) -> AsyncClient:
        """This client (a group of its calls is only ever a part of an `AsyncClient`)."""
        return cast("AsyncClient", self)

    async def _send(self, call: b.Call) -> bytes:
        if self._lane is not None:
            answer = await self._by_lane(self._lane, call)
            if answer is not None:
                body = bytes(answer.body)
                b.raise_for(answer.status, body, self.endpoint)
                return body
        route = b.Route(self._http, self.endpoint, call)  # several gateways: on to the next where safe
        while True:
            route.sending()
            try:
                resp = await self._http.request(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.json,
                    content=call.content,
                    headers=dict(call.headers),
                    timeout=self.endpoint.timeout(b.request_timeout(call, self.timeout)),
                )
                break
            except (httpx.HTTPError, OSError) as exc:
                if (err := route.failed(exc)) is not None:
                    raise err from exc
        b.raise_for(resp.status_code, resp.content, self.endpoint)
        return resp.content

    async def _by_lane(self, lane: b.Lane[b.AsyncConnection], call: b.Call) -> b.Answer | None:
        """`call` on the unix socket's lane (b.lane); None when all its connections are busy."""
        timeout = b.request_timeout(call, self.timeout)
        try:
            request = b.encode(call, lane.headers)
            return await lane.call(request, lambda: b.AsyncConnection.open(lane.address, timeout), timeout)
        except (httpx.HTTPError, OSError) as exc:
            raise b.map_transport_error(exc, self.endpoint) from exc

    async def _model(self, model: type[M], call: b.Call) -> M:
        return b.decode(model, await self._send(call))

    async def _stream(self, call: b.Call, decode: Callable[[bytes], T | None]) -> AsyncGenerator[T | None, None]:
        """None once the daemon answered (the stream is open), then the items of its ndjson stream,
        `decode`d (None: a heartbeat, swallowed). Silence longer than the client's timeout (see
        `b.silence_limit`) or a stream outlasting `call.timeout` raises SandboxTimeoutError; leaving
        (an error, a timeout, the generator closed or dropped) closes the connection, and the daemon
        ends what the stream was for."""
        silence = b.silence_limit(self.timeout)
        deadline = b.stream_deadline(call, time.monotonic())
        route = b.Route(self._http, self.endpoint, call)
        opened = False  # once the daemon answered, a failure ends the stream (items were given)
        while True:
            route.sending()
            try:
                async with self._http.stream(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.json,
                    content=call.content,
                    headers=dict(call.headers),
                    timeout=self.endpoint.timeout(b.stream_timeouts(self.timeout)),
                ) as resp:
                    opened = True
                    if resp.status_code >= 400:
                        b.raise_for(resp.status_code, await resp.aread(), self.endpoint)
                    yield None
                    lines = resp.aiter_lines()
                    while (line := await b.next_line(lines, silence, deadline)) is not None:
                        if line and (item := decode(line.encode())) is not None:
                            yield item
                return
            except (httpx.HTTPError, OSError) as exc:
                if (err := route.failed(exc, again=not opened)) is not None:
                    raise err from exc

    def _events(self, call: b.Call, decode: Callable[[bytes], T | None]) -> AsyncEventStream[T]:
        return AsyncEventStream(self._stream(call, decode))

    async def _streamed_result(self, call: b.Call) -> ExecResult:
        """Run a command through its streaming endpoint and return its result (the `exit` event's)."""
        result: ExecResult | None = None
        async with self._events(call, b.exec_event) as events:
            async for event in events:
                if event.type == "exit":
                    result = b.exit_result(event)
        if result is None:
            raise b.no_exit()
        return result

    async def _retrying(
        self,
        make: Callable[[str, float], b.Call],
        model: type[M],
        attempts: b.CreateAttempts,
        deadline: b.Deadline,
        refusals: bool,
    ) -> M:
        """Send `make(key, attempt_timeout)` until an answer settles it: a lost answer (timeout, broken
        connection) is retried with the same idempotency key, a full node's refusal too when
        `refusals`, each while the deadline leaves room; then the last error is raised."""
        while True:
            try:
                call = b.retried(make(attempts.key, deadline.attempt_timeout(self.timeout)), attempts.retried)
                return await self._model(model, call)
            except SandboxError as exc:
                reason = attempts.retry_reason(exc)
                if reason is None or (reason == "refused" and not refusals) or not deadline.allows(reason == "refused"):
                    final = attempts.final(exc)
                    if final is exc:
                        raise
                    raise final from exc
                await asyncio.sleep(deadline.backoff(reason == "refused"))

    async def _idempotent(self, model: type[M], call: b.Call, retry_for: float) -> M:
        """Send a call that is safe to repeat (a trajectory's open, step, verify, close) until it is
        answered: a lost answer, a daemon restarting or a full node is retried with backoff for up to
        `retry_for` seconds; then the last error is raised."""
        deadline = b.Deadline(retry_for)
        while True:
            try:
                return await self._model(model, call)
            except SandboxError as exc:
                if not exc.retryable or not deadline.allows(refused=False):
                    raise
            await asyncio.sleep(deadline.backoff())


class AsyncEventStream(Generic[T]):
    """A stream of the daemon's (a command's output, a directory's changes): an `AsyncIterator` of
    its events, heartbeats swallowed. It opens at `async with` (or the first iteration) and closes
    when the `async with` is left, on `aclose()`, at its end or on an error; closing it ends what
    it was for on the daemon (a streamed command is killed, a watch removed)."""

    def __init__(self, items: AsyncGenerator[T | None, None]) -> None:
        self._items = items  # None first, once the daemon answered; then the events
        self._opened = False

    async def open(self) -> AsyncEventStream[T]:
        """Send the request and wait for the daemon's answer (a watch is in place once this returns)."""
        if not self._opened:
            self._opened = True
            await anext(self._items, None)
        return self

    def __aiter__(self) -> AsyncEventStream[T]:
        return self

    async def __anext__(self) -> T:
        await self.open()
        while (item := await anext(self._items)) is None:
            pass
        return item

    async def aclose(self) -> None:
        await self._items.aclose()

    async def __aenter__(self) -> AsyncEventStream[T]:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
