"""A running command's CPU, watched: its budget enforced, and whether the node starved it.

On a saturated node a wall-clock timeout says little about a command: 64 test runs on 2 cores each
get 1/32 of a core, and a correct fix runs out of time. So a command may have a CPU budget
(`cpu_time`: past it the process tree is killed, cause `timeout`), and a command whose wall-clock
timeout fired is judged by what its tasks got: if they wanted a CPU and got less than half of what
they could have used (their CPU limit, or what they asked for if less), the node starved it, cause
`infra` (a trainer masks it) instead of `timeout`. A command that sleeps or waits on a read wants
no CPU: its timeout stays its own. Both count the command's own processes only (schedstat.py: the
process the sandbox's init started for it and its descendants), never the rest of its sandbox.

The watch is a timer on the event loop (no task), looking every timeout/10 seconds (0.5-5 s, or
cpu_time/10 within 0.1-1 s for a budget): a command that ends before the first look costs nothing.
A look reads /proc in a worker thread, and the next is set once it is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from sandfleet.models import ExecRequest, ExecResult
from sandfleet.runtime.schedstat import TreeStats, boot_ticks, command_pid

__all__ = ["CommandWatch", "boot_ticks"]

log = logging.getLogger(__name__)

WATCH_EVERY = (0.5, 5.0)  # timeout/10 within these; a shorter timeout is not judged (too short to tell)
BUDGET_EVERY = (0.1, 1.0)  # cpu_time/10 within these
# Starved: its tasks were runnable (running or waiting for a CPU) at least STARVED_DEMAND of the time,
# and got less than STARVED_SHARE of the CPU they could have used.
STARVED_SHARE = 0.5
STARVED_DEMAND = 0.25


@dataclass(frozen=True)
class Look:
    """What a look read of the command's processes (TreeStats' totals), and when."""

    at: float  # time.monotonic()
    cpu: float
    ran: float
    waited: float


class CommandWatch:
    """One command's watch, from its start to `judged(result)`."""

    def __init__(
        self,
        req: ExecRequest,
        *,
        init: int,
        pid: int,
        since: int,
        cpu_limit: float,
        node_cpus: float,
        kill: Callable[[], None],
    ) -> None:
        """`init`: the host pid of the sandbox's init, whose child the command is (0: its processes
        are not the host's to read: nothing to judge by); `pid`: the command's pid inside the
        sandbox; `since`: when it started (boot_ticks()); `kill`: SIGKILL its process tree."""
        self.req = req
        self.cpu_limit = min(cpu_limit, node_cpus)
        self.kill = kill
        self.init, self.pid, self.since = init, pid, since
        self.started = time.monotonic()
        self.exceeded = self.stopped = False
        self.tree: TreeStats | None = None  # found at the first look (most commands end before it)
        self.last: Look | None = None
        every = []
        if req.timeout is not None and req.timeout >= WATCH_EVERY[0]:
            every.append(min(max(req.timeout / 10, WATCH_EVERY[0]), WATCH_EVERY[1]))
        if req.cpu_time is not None:
            every.append(min(max(req.cpu_time / 10, BUDGET_EVERY[0]), BUDGET_EVERY[1]))
        self.every = min(every, default=WATCH_EVERY[1])
        self.handle: asyncio.TimerHandle | None = None
        if init > 0:
            self.handle = asyncio.get_running_loop().call_later(self.every, self._look)

    @staticmethod
    def wanted(req: ExecRequest) -> bool:
        """Whether a command needs watching: it has a CPU budget, or a timeout long enough to judge."""
        judged = req.timeout is not None and req.timeout >= WATCH_EVERY[0] and req.pty is None
        return req.cpu_time is not None or judged

    def _look(self) -> None:
        self.handle = None
        try:
            looking = asyncio.get_running_loop().run_in_executor(None, self._read)
        except RuntimeError:  # the daemon is shutting down (no more worker threads)
            return
        looking.add_done_callback(self._looked)

    def _read(self) -> Look | None:
        """In a worker thread: the command's processes now (None: it has ended)."""
        if self.tree is None:
            root = command_pid(self.init, self.pid, self.since)
            if root is None:
                return None
            self.tree = TreeStats(root, self.since)
        self.tree.sample()
        return Look(time.monotonic(), self.tree.cpu, self.tree.ran, self.tree.waited)

    def _looked(self, looking: asyncio.Future[Look | None]) -> None:
        if self.stopped or looking.cancelled():
            return
        if (exc := looking.exception()) is not None:
            log.warning("a command's CPU could not be read; it is no longer watched: %r", exc)
            return
        self.last = looking.result() or self.last
        if self.last is None:
            return  # ended before it was found
        if self.req.cpu_time is not None and self.last.cpu >= self.req.cpu_time:
            self.exceeded = True
            self.kill()
            return
        self.handle = asyncio.get_running_loop().call_later(self.every, self._look)

    def stop(self) -> None:
        self.stopped = True
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def starved(self) -> bool:
        """Whether the command's tasks wanted CPU and got less than STARVED_SHARE of what they could
        have used, over the time its looks cover."""
        if self.last is None or (wall := self.last.at - self.started) <= 0:
            return False
        demand = (self.last.ran + self.last.waited) / wall  # tasks runnable, on average
        return demand >= STARVED_DEMAND and self.last.ran / wall < STARVED_SHARE * min(self.cpu_limit, demand)

    def judged(self, result: ExecResult, cpu: float | None) -> ExecResult:
        """The command's result with what the watch saw: a CPU budget used up, a timeout the node
        caused. `cpu`: what the agent says the command used (its process and the descendants it
        reaped), if it says."""
        self.stop()
        update: dict[str, object] = {}
        if self.req.cpu_time is not None:
            update["cpu_seconds"] = round(max(cpu or 0.0, self.last.cpu if self.last else 0.0), 6)
        if self.exceeded and result.exit_code != 0 and not result.timed_out:
            update.update(timed_out=True, cpu_time_exceeded=True, cause="timeout")
        elif result.timed_out and self.starved():
            update.update(starved=True, cause="infra")
        return result.model_copy(update=update) if update else result
