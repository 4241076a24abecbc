"""The shapes a concern hands the routes back: `EventStream` (ndjson streams, closed exactly once by
the route, also when its client left before the first byte) and `Terminal` (a command on a
pseudo-terminal)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, TypeVar

from sandfleet.models import (
    ExecResult,
)

T_co = TypeVar("T_co", covariant=True)


class Terminal(Protocol):
    """A command on a pseudo-terminal: its output (bytes, then one ExecResult), keystrokes and window
    sizes in; `close` (idempotent) kills what still runs."""

    pid: int

    def output(self) -> AsyncIterator[bytes | ExecResult]: ...

    async def write(self, data: bytes) -> None: ...

    async def resize(self, rows: int, cols: int) -> None: ...

    async def hold(self, stop: bool) -> None:
        """Flow control: stop reading the command's output (its writes then block), or read on."""
        ...

    async def close(self) -> None: ...


class EventStream(Protocol[T_co]):
    """Events of a stream the service started; `aclose` releases what it holds (idempotent)."""

    def __aiter__(self) -> EventStream[T_co]: ...

    async def __anext__(self) -> T_co: ...

    async def aclose(self) -> None: ...
