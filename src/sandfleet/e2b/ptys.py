"""E2B's PTYs: each a sandfleet terminal this server holds from its create until its command exits
(or its sandbox stops), as envd holds its PTY processes: a reader task keeps its recent output for
whoever follows it, its Start stream or a Connect after a disconnect. Input, resizes and signals
come by pid."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from sandfleet.client.aio import AsyncSandbox, AsyncTerminal
from sandfleet.errors import ResourceExhaustedError, SandboxError
from sandfleet.models import ExecResult

MAX_PTYS = 64  # held at once per key
BACKLOG = 1 << 20  # a PTY's recent output kept for its followers (the newest)

Key = tuple[str, str, int]  # (the key's digest, sandbox, pid)


@dataclass
class Pty:
    """A held terminal and its recent output: a follower starts where the output stops having been
    delivered to anyone (what a follower that left was never sent, a new one gets)."""

    terminal: AsyncTerminal
    argv: list[str]
    recent: bytearray = field(default_factory=bytearray)  # the last BACKLOG bytes of its output
    start: int = 0  # the offset of recent[0] in all its output
    delivered: int = 0  # output before this offset went out to a follower
    grew: asyncio.Event = field(default_factory=asyncio.Event)
    result: ExecResult | None = None
    ended: bool = False  # its command exited (or its terminal closed): nothing more comes
    task: asyncio.Task[None] | None = None

    def add(self, data: bytes) -> None:
        self.recent += data
        if len(self.recent) > BACKLOG:
            cut = len(self.recent) - BACKLOG
            del self.recent[:cut]
            self.start += cut
        self.grew.set()

    async def follow(self) -> AsyncIterator[bytes]:
        """Its output from what was not delivered yet, until its end."""
        pos = max(self.delivered, self.start)
        while True:
            end = self.start + len(self.recent)
            if pos < end:
                chunk = bytes(self.recent[max(0, pos - self.start) :])
                pos = end
                yield chunk
                self.delivered = max(self.delivered, pos)  # the caller asked for more: it went out
                continue
            if self.ended:
                return
            self.grew.clear()
            await self.grew.wait()


class Ptys:
    def __init__(self) -> None:
        self._held: dict[Key, Pty] = {}

    def get(self, key: Key) -> Pty | None:
        return self._held.get(key)

    def of(self, holder: str, sandbox_id: str) -> list[tuple[int, Pty]]:
        return [(k[2], p) for k, p in self._held.items() if k[:2] == (holder, sandbox_id)]

    async def open(
        self, sb: AsyncSandbox, holder: str, argv: list[str], rows: int, cols: int, **options: object
    ) -> tuple[int, Pty]:
        if sum(k[0] == holder for k in self._held) >= MAX_PTYS:
            raise ResourceExhaustedError(f"at most {MAX_PTYS} PTYs at once: end one first")
        terminal = await sb.terminal(argv, rows=rows, cols=cols, **options)  # type: ignore[arg-type]
        key = (holder, sb.id, terminal.pid)
        pty = Pty(terminal, argv)
        self._held[key] = pty
        pty.task = asyncio.create_task(self._read(key, pty))
        return terminal.pid, pty

    async def _read(self, key: Key, pty: Pty) -> None:
        try:
            while data := await pty.terminal.read():
                pty.add(data)
            pty.result = pty.terminal.result
        except SandboxError:  # its sandbox went away: the followers see an end without a status
            pass
        finally:
            self._held.pop(key, None)
            pty.ended = True
            pty.grew.set()
            with contextlib.suppress(Exception):
                await pty.terminal.aclose()

    def close(self) -> None:
        for pty in self._held.values():
            if pty.task is not None:
                pty.task.cancel()
