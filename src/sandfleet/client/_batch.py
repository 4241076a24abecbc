"""Coalescing of stateless calls in the async SDK: calls made at the same time travel as one request.

A trainer scoring a group of rollouts issues tens of `run_code` calls at once, and each costs the
SDK and the daemon about a millisecond of CPU per HTTP request, more than a trivial call itself.
So `AsyncClient.run_code` hands its call here: calls submitted in the same turn of the event loop
go out together as one batch (a call alone goes out alone, on the one-call endpoint), with
`max_in_flight` batches at a time; calls made while that many are out wait for the next, but no
longer than `linger` (those batches may be long calls: a short call does not queue behind them),
and then go out as one batch more, up to `max_forced` batches in all (each is a connection).
Each call still gets its own result (or its own typed error) as soon as the daemon streams it back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from sandfleet.errors import SandboxError, UnavailableError
from sandfleet.models import ExecResult

Body = dict[str, Any]
Outcome = ExecResult | SandboxError


class CallBatcher:
    def __init__(
        self,
        one: Callable[[Body], Awaitable[ExecResult]],
        many: Callable[[list[Body]], AsyncGenerator[tuple[int, Outcome], None]],
        *,
        max_in_flight: int = 4,
        max_batch: int = 256,
        linger: float = 0.01,
        max_forced: int = 16,
    ) -> None:
        self._one = one
        self._many = many
        self._max_in_flight = max_in_flight
        self._max_batch = max_batch
        self._linger = linger
        self._max_forced = max(max_forced, max_in_flight)
        self._late: asyncio.TimerHandle | None = None  # sends what still waits at `linger`
        self._pending: list[tuple[Body, asyncio.Future[ExecResult]]] = []
        self._scheduled = False
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()

    async def submit(self, body: Body) -> ExecResult:
        fut: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self._pending.append((body, fut))
        self._schedule()
        return await fut

    def _schedule(self) -> None:
        if self._scheduled or not self._pending:
            return
        if self._in_flight < self._max_in_flight:
            self._scheduled = True
            # after this turn of the loop: the calls made in it go together
            asyncio.get_running_loop().call_soon(self._flush)
        elif self._late is None and self._in_flight < self._max_forced:
            self._late = asyncio.get_running_loop().call_later(self._linger, self._flush, True)

    def _flush(self, late: bool = False) -> None:
        self._scheduled = False
        if late:
            self._late = None
        while self._pending and self._in_flight < (self._max_forced if late else self._max_in_flight):
            batch, self._pending = self._pending[: self._max_batch], self._pending[self._max_batch :]
            batch = [(body, fut) for body, fut in batch if not fut.done()]  # callers that left
            if not batch:
                continue
            self._in_flight += 1
            task = asyncio.get_running_loop().create_task(self._send(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if self._late is not None and not self._pending:
            self._late.cancel()
            self._late = None
        elif self._pending:
            self._schedule()  # what every slot left waiting: its `linger` starts now

    async def _send(self, batch: list[tuple[Body, asyncio.Future[ExecResult]]]) -> None:
        try:
            if len(batch) == 1:
                body, fut = batch[0]
                result = await self._one(body)
                if not fut.done():
                    fut.set_result(result)
                return
            async for index, outcome in self._many([body for body, _ in batch]):
                fut = batch[index][1]
                if fut.done():
                    continue
                if isinstance(outcome, SandboxError):
                    fut.set_exception(outcome)
                else:
                    fut.set_result(outcome)
        except BaseException as exc:  # the request itself failed: every call of it that has no outcome
            for _body, fut in batch:
                if not fut.done():
                    fut.set_exception(exc if isinstance(exc, Exception) else UnavailableError("call cancelled"))
            if not isinstance(exc, Exception):
                raise
        finally:
            for _body, fut in batch:
                if not fut.done():
                    fut.set_exception(UnavailableError("the daemon's batch ended without this call's outcome"))
            self._in_flight -= 1
            self._schedule()
