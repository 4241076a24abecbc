# Generated from client/aio/_http.py by scripts/gen_sync_client.py: do not edit.
"""How the async client sends calls: one answer, or an ndjson stream (`EventStream`), retried
creates and idempotent calls; the base of the client's calls (`_Calls`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import httpx
from pydantic import BaseModel

from sandfleet.client import _base as b
from sandfleet.errors import SandboxError
from sandfleet.models import ExecResult

if TYPE_CHECKING:
    from sandfleet.client.sync._client import Client

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class _Calls:
    """What every group of the client's calls builds on: the daemon's endpoint, the client's
    timeout, its HTTP client, and how a call is sent."""

    endpoint: b.Endpoint
    timeout: float
    _http: httpx.Client
    _lane: b.Lane[b.Connection] | None

    @property
    def _client(self) -> Client:
        """This client (a group of its calls is only ever a part of an `Client`)."""
        return cast("Client", self)

    def _send(self, call: b.Call) -> bytes:
        if self._lane is not None:
            answer = self._by_lane(self._lane, call)
            if answer is not None:
                body = bytes(answer.body)
                b.raise_for(answer.status, body, self.endpoint)
                return body
        route = b.Route(self._http, self.endpoint, call)  # several gateways: on to the next where safe
        while True:
            route.sending()
            try:
                resp = self._http.request(
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

    def _by_lane(self, lane: b.Lane[b.Connection], call: b.Call) -> b.Answer | None:
        """`call` on the unix socket's lane (b.lane); None when all its connections are busy."""
        timeout = b.request_timeout(call, self.timeout)
        try:
            request = b.encode(call, lane.headers)
            return lane.call_sync(request, lambda: b.Connection.open(lane.address, timeout), timeout)
        except (httpx.HTTPError, OSError) as exc:
            raise b.map_transport_error(exc, self.endpoint) from exc

    def _model(self, model: type[M], call: b.Call) -> M:
        return b.decode(model, self._send(call))

    def _stream(self, call: b.Call, decode: Callable[[bytes], T | None]) -> Generator[T | None, None]:
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
                with self._http.stream(
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
                        b.raise_for(resp.status_code, resp.read(), self.endpoint)
                    yield None
                    lines = resp.iter_lines()
                    while (line := b.next_line_sync(lines, silence, deadline)) is not None:
                        if line and (item := decode(line.encode())) is not None:
                            yield item
                return
            except (httpx.HTTPError, OSError) as exc:
                if (err := route.failed(exc, again=not opened)) is not None:
                    raise err from exc

    def _events(self, call: b.Call, decode: Callable[[bytes], T | None]) -> EventStream[T]:
        return EventStream(self._stream(call, decode))

    def _streamed_result(self, call: b.Call) -> ExecResult:
        """Run a command through its streaming endpoint and return its result (the `exit` event's)."""
        result: ExecResult | None = None
        with self._events(call, b.exec_event) as events:
            for event in events:
                if event.type == "exit":
                    result = b.exit_result(event)
        if result is None:
            raise b.no_exit()
        return result

    def _retrying(
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
                return self._model(model, call)
            except SandboxError as exc:
                reason = attempts.retry_reason(exc)
                if reason is None or (reason == "refused" and not refusals) or not deadline.allows(reason == "refused"):
                    final = attempts.final(exc)
                    if final is exc:
                        raise
                    raise final from exc
                time.sleep(deadline.backoff(reason == "refused"))

    def _idempotent(self, model: type[M], call: b.Call, retry_for: float) -> M:
        """Send a call that is safe to repeat (a trajectory's open, step, verify, close) until it is
        answered: a lost answer, a daemon restarting or a full node is retried with backoff for up to
        `retry_for` seconds; then the last error is raised."""
        deadline = b.Deadline(retry_for)
        while True:
            try:
                return self._model(model, call)
            except SandboxError as exc:
                if not exc.retryable or not deadline.allows(refused=False):
                    raise
            time.sleep(deadline.backoff())


class EventStream(Generic[T]):
    """A stream of the daemon's (a command's output, a directory's changes): an `Iterator` of
    its events, heartbeats swallowed. It opens at `with` (or the first iteration) and closes
    when the `with` is left, on `close()`, at its end or on an error; closing it ends what
    it was for on the daemon (a streamed command is killed, a watch removed)."""

    def __init__(self, items: Generator[T | None, None]) -> None:
        self._items = items  # None first, once the daemon answered; then the events
        self._opened = False

    def open(self) -> EventStream[T]:
        """Send the request and wait for the daemon's answer (a watch is in place once this returns)."""
        if not self._opened:
            self._opened = True
            next(self._items, None)
        return self

    def __iter__(self) -> EventStream[T]:
        return self

    def __next__(self) -> T:
        self.open()
        while (item := next(self._items)) is None:
            pass
        return item

    def close(self) -> None:
        self._items.close()

    def __enter__(self) -> EventStream[T]:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
