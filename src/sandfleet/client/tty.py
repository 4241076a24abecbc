"""A sandbox's terminal on this process's own terminal (`sandfleet shell`): raw mode, keystrokes
relayed as typed, the window size followed on SIGWINCH, the terminal restored however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import termios
import tty

from sandfleet.client.aio import AsyncSandbox, AsyncTerminal

ENDING = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # ended from outside: give the terminal back first


def window(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal at `fd`; 24x80 when it reports none."""
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return max(1, size.lines or 24), max(1, size.columns or 80)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except BlockingIOError:  # a terminal that is not keeping up: wait for it
            select.select([], [fd], [])


async def attach(sb: AsyncSandbox, command: str | list[str] | None = None, *, fd_in: int = 0, fd_out: int = 1) -> int:
    """Run `command` (default: the login shell) on a terminal in `sb`, relayed to ours; its exit code."""
    rows, cols = window(fd_out)
    async with await sb.terminal(command, rows=rows, cols=cols) as term:
        saved = termios.tcgetattr(fd_in)
        loop = asyncio.get_running_loop()
        keys: asyncio.Queue[bytes] = asyncio.Queue()
        resized = asyncio.Event()
        me = asyncio.current_task()

        def on_key() -> None:
            try:
                keys.put_nowait(os.read(fd_in, 65536))
            except OSError:
                keys.put_nowait(b"")

        def on_continue() -> None:  # back from a stop (Ctrl-Z of ours, `fg`): raw again
            tty.setraw(fd_in)
            resized.set()

        tasks: list[asyncio.Task[None]] = []
        try:
            tty.setraw(fd_in)
            loop.add_reader(fd_in, on_key)
            loop.add_signal_handler(signal.SIGWINCH, resized.set)
            loop.add_signal_handler(signal.SIGCONT, on_continue)
            for signo in ENDING:
                loop.add_signal_handler(signo, me.cancel if me is not None else resized.set)
            tasks = [asyncio.create_task(_keys(term, keys)), asyncio.create_task(_resize(term, resized, fd_out))]
            while data := await term.read():
                write_all(fd_out, data)
        finally:
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            loop.remove_reader(fd_in)
            for signo in (signal.SIGWINCH, signal.SIGCONT, *ENDING):
                loop.remove_signal_handler(signo)
            termios.tcsetattr(fd_in, termios.TCSAFLUSH, saved)
    return term.result.exit_code if term.result is not None else 1


async def _keys(term: AsyncTerminal, keys: asyncio.Queue[bytes]) -> None:
    while data := await keys.get():
        await term.send(data)


async def _resize(term: AsyncTerminal, resized: asyncio.Event, fd: int) -> None:
    while True:
        await resized.wait()
        resized.clear()
        await term.resize(*window(fd))
