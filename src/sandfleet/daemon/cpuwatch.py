"""A running command's CPU, watched: its budget enforced, and whether the node starved it.

On a saturated node a wall-clock timeout says little about a command: 64 test runs on 2 cores each
get 1/32 of a core, and a correct fix runs out of time. So a command may have a CPU budget
(`cpu_time`, read from its sandbox's cgroup: past it the process tree is killed, cause `timeout`),
and a command whose wall-clock timeout fired is judged by what its tasks got: if they wanted a CPU
and got less than half of what they could have used (their CPU limit, or what they asked for if
less), the node starved it, cause `infra` (a trainer masks it) instead of `timeout`. A command that
sleeps or waits on a read wants no CPU: its timeout stays its own.

The watch is a timer on the event loop (no task), looking every timeout/10 seconds (0.5-5 s, or
cpu_time/10 within 0.1-1 s for a budget): a command that ends before the first look costs nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from sandfleet.models import ExecRequest, ExecResult
from sandfleet.runtime.schedstat import TreeStats, boot_ticks

__all__ = ["CommandWatch", "boot_ticks"]

WATCH_EVERY = (0.5, 5.0)  # timeout/10 within these; a shorter timeout is not judged (too short to tell)
BUDGET_EVERY = (0.1, 1.0)  # cpu_time/10 within these
# Starved: its tasks were runnable (running or waiting for a CPU) at least STARVED_DEMAND of the time,
# and got less than STARVED_SHARE of the CPU they could have used.
STARVED_SHARE = 0.5
STARVED_DEMAND = 0.25


class CommandWatch:
    """One command's watch, from its start to `judged(result)`."""

    def __init__(
        self,
        req: ExecRequest,
        *,
        root: int,
        since: int,
        cpu_limit: float,
        node_cpus: float,
        cpu_seconds: Callable[[], float],
        kill: Callable[[], None],
    ) -> None:
        """`root`: the host pid whose descendants are the sandbox's processes (0: none to judge by);
        `since`: when the command started (boot_ticks()); `cpu_seconds`: the sandbox's CPU time;
        `kill`: SIGKILL the command's process tree."""
        self.req = req
        self.cpu_limit = min(cpu_limit, node_cpus)
        self.cpu_seconds, self.kill = cpu_seconds, kill
        self.started = self.looked_at = time.monotonic()
        self.exceeded = False
        self.cpu0 = self._cpu() if req.cpu_time is not None else 0.0
        every = []
        if req.timeout is not None and req.timeout >= WATCH_EVERY[0]:
            every.append(min(max(req.timeout / 10, WATCH_EVERY[0]), WATCH_EVERY[1]))
        if req.cpu_time is not None:
            every.append(min(max(req.cpu_time / 10, BUDGET_EVERY[0]), BUDGET_EVERY[1]))
        self.every = min(every, default=WATCH_EVERY[1])
        # A VM's root is its QEMU, whose threads are older than any command: nothing to judge there.
        self.root, self.since = root, since
        self.tree: TreeStats | None = None  # made at the first look (most commands end before it)
        self.handle: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(self.every, self._look)

    @staticmethod
    def wanted(req: ExecRequest) -> bool:
        """Whether a command needs watching: it has a CPU budget, or a timeout long enough to judge."""
        judged = req.timeout is not None and req.timeout >= WATCH_EVERY[0] and req.pty is None
        return req.cpu_time is not None or judged

    def _cpu(self) -> float:
        try:
            return self.cpu_seconds()
        except OSError:  # the sandbox is going away
            return 0.0

    def _look(self) -> None:
        self.handle = None
        if self.root > 0:
            self.tree = self.tree or TreeStats(self.root, self.since)
            self.tree.sample()
            self.looked_at = time.monotonic()
        if self.req.cpu_time is not None and self._cpu() - self.cpu0 >= self.req.cpu_time:
            self.exceeded = True
            self.kill()
            return
        self.handle = asyncio.get_running_loop().call_later(self.every, self._look)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def starved(self) -> bool:
        """Whether the command's tasks wanted CPU and got less than STARVED_SHARE of what they could
        have used, over the time its looks cover."""
        wall = self.looked_at - self.started
        if self.tree is None or wall <= 0:
            return False
        ran, waited = self.tree.ran, self.tree.waited
        demand = (ran + waited) / wall  # tasks runnable, on average
        return demand >= STARVED_DEMAND and ran / wall < STARVED_SHARE * min(self.cpu_limit, demand)

    def judged(self, result: ExecResult) -> ExecResult:
        """The command's result with what the watch saw: a CPU budget used up, a timeout the node caused."""
        self.stop()
        update: dict[str, object] = {}
        if self.req.cpu_time is not None:
            update["cpu_seconds"] = round(self._cpu() - self.cpu0, 6)
        if self.exceeded and result.exit_code != 0 and not result.timed_out:
            update.update(timed_out=True, cpu_time_exceeded=True, cause="timeout")
        elif result.timed_out and self.starved():
            update.update(starved=True, cause="infra")
        return result.model_copy(update=update) if update else result
