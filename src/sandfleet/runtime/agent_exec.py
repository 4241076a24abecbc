"""One running command of the agent (`ExecProcess`) and one directory watch (`AgentWatch`), as the daemon sees them."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from sandfleet.runtime.agent_errors import ChannelClosedError
from sandfleet.runtime.agent_wire import (
    MAX_PAYLOAD,
    MSG_CMDIN,
    MSG_HOLD,
    MSG_UNWATCH,
    SCOPE_GROUP,
    SRUN_HEAD,
    SRUN_STDIN,
    ExitInfo,
    OutputChunk,
    WatchEvent,
    encode_message,
    encode_resize,
    encode_signal,
    encode_srun,
    encode_stdin,
)

if TYPE_CHECKING:
    from sandfleet.runtime.agent import AgentChannel
    from sandfleet.runtime.agent_wire import Event


class ExecProcess:
    """One command running under the agent. Events are consumed by a single reader."""

    def __init__(self, channel: AgentChannel, exec_id: int) -> None:
        self.id = exec_id
        self.pid = -1
        self._channel = channel
        self._queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()
        self._exit: ExitInfo | None = None
        self._error: BaseException | None = None
        self._abandoned = False  # start() was cancelled: discard output, kill on STARTED

    @property
    def exit_info(self) -> ExitInfo | None:
        return self._exit

    def _push(self, item: Event) -> None:
        if isinstance(item, ExitInfo):
            self._exit = item
        if not self._abandoned:
            self._queue.put_nowait(item)

    def _fail(self, exc: BaseException) -> None:
        if self._exit is None and self._error is None:
            self._error = exc
            self._queue.put_nowait(exc)

    async def write_stdin(self, data: bytes) -> None:
        for off in range(0, len(data), MAX_PAYLOAD):  # empty data would mean EOF: send nothing
            await self._channel._send(encode_stdin(self.id, data[off : off + MAX_PAYLOAD]))

    async def close_stdin(self) -> None:
        await self._channel._send(encode_stdin(self.id, b""))

    async def signal(self, signo: int, scope: int = SCOPE_GROUP) -> None:
        await self._channel._send(encode_signal(self.id, signo, scope))

    async def resize(self, rows: int, cols: int) -> None:
        """A terminal exec's new window size (its foreground job gets SIGWINCH)."""
        await self._channel._send(encode_resize(self.id, rows, cols))

    async def hold(self, stop: bool) -> None:
        """A terminal exec: stop reading its output (what it writes then blocks), or read on."""
        await self._channel._send(encode_message(MSG_HOLD, self.id, struct.pack("<I", 1 if stop else 0)))

    async def run_command(
        self, script: bytes, nonce: bytes, *, timeout: float | None, out_cap: int, stdin: bool = False, seq: int = 0
    ) -> None:
        """Begin one command of a session shell: the agent forwards its output (within `out_cap`
        per stream) until the shell reports, with `nonce`, through its status socket; the events
        then carry a CommandExit with this `seq`. `script` must end by reporting (see the daemon's
        session code); it travels inside the SRUN datagram when it fits."""
        timeout_ms = 0 if timeout is None else max(1, int(timeout * 1000 + 0.999))
        flags = SRUN_STDIN if stdin else 0
        first = script[: MAX_PAYLOAD - SRUN_HEAD]
        await self._channel._send(encode_srun(self.id, nonce, timeout_ms, out_cap, flags, seq, first))
        await self.write_stdin(script[len(first) :])

    async def write_command_stdin(self, data: bytes) -> None:
        """Bytes for the stdin of the session command now running (started with stdin=True)."""
        for off in range(0, len(data), MAX_PAYLOAD):
            await self._channel._send(encode_message(MSG_CMDIN, self.id, data[off : off + MAX_PAYLOAD]))

    async def close_command_stdin(self) -> None:
        await self._channel._send(encode_message(MSG_CMDIN, self.id, b""))

    async def events(self) -> AsyncIterator[Event]:
        """Yield OutputChunks (and, for a session, a CommandExit per command), then the final
        ExitInfo. Raises ChannelClosedError if the channel dies."""
        while True:
            if self._queue.empty():
                if self._error is not None:
                    raise self._error
                if self._exit is not None:  # already fully consumed
                    yield self._exit
                    return
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if isinstance(item, ExitInfo):
                return

    def collected(self) -> tuple[bytes, bytes, ExitInfo] | None:
        """What `wait` returns, when the exit is in already (everything before it is queued), else
        None: taken without a suspension."""
        if self._exit is None or self._error is not None or self._queue.qsize() == 0:
            return None
        out: list[bytes] = []
        err: list[bytes] = []
        while True:
            ev = self._queue.get_nowait()
            if isinstance(ev, ExitInfo):
                return b"".join(out), b"".join(err), ev
            if isinstance(ev, OutputChunk):
                (out if ev.stream == "stdout" else err).append(ev.data)

    async def wait(self) -> tuple[bytes, bytes, ExitInfo]:
        """Collect all output until exit."""
        out: list[bytes] = []
        err: list[bytes] = []
        async for ev in self.events():
            if isinstance(ev, ExitInfo):
                return b"".join(out), b"".join(err), ev
            if isinstance(ev, OutputChunk):
                (out if ev.stream == "stdout" else err).append(ev.data)
        raise AssertionError("unreachable: events() ends with ExitInfo")


IN_Q_OVERFLOW = 0x4000


class AgentWatch:
    """File-change events under a directory of the sandbox, from the agent's inotify."""

    MAX_QUEUED = 10000  # beyond this, events are dropped and counted (a slow reader costs no memory)

    def __init__(self, channel: AgentChannel, watch_id: int) -> None:
        self.id = watch_id
        self._channel = channel
        self._queue: asyncio.Queue[WatchEvent | None] = asyncio.Queue()
        self._error: BaseException | None = None
        self._ended = False
        self.dropped = 0

    def _push(self, ev: WatchEvent) -> None:
        if self._queue.qsize() >= self.MAX_QUEUED:
            if not self.dropped:  # the reader learns that events were lost, once per gap
                self._queue.put_nowait(WatchEvent(IN_Q_OVERFLOW, ""))
            self.dropped += 1
            return
        self.dropped = 0
        self._queue.put_nowait(ev)

    def _end(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._error = error
            self._queue.put_nowait(None)

    async def next(self, timeout: float | None = None) -> WatchEvent | None:  # noqa: ASYNC109
        """The next event; None once the watch has ended (raises if it ended on an error);
        TimeoutError if nothing came within `timeout`."""
        async with asyncio.timeout(timeout):
            item = await self._queue.get()
        if item is None:
            self._queue.put_nowait(None)  # stay ended for later callers
            if self._error is not None:
                raise self._error
        return item

    async def close(self) -> None:
        if not self._ended:
            self._channel._watches.pop(self.id, None)
            self._end(None)
            with contextlib.suppress(ChannelClosedError):
                await self._channel._send(encode_message(MSG_UNWATCH, self.id))
