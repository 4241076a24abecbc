"""How long a command's processes ran and how long they waited for a CPU (per-task scheduler counters).

`/proc/<pid>/task/<tid>/schedstat` holds, for each task, the nanoseconds it ran and the nanoseconds
it sat runnable on a run queue waiting for a CPU (which includes time its cgroup's CPU quota held it
back). Summed over the tasks a command started, the two tell a command the node starved (its
tasks wanted a CPU and waited for one) from one that was slow or idle on its own. The counters die
with their task, so the caller samples while the command runs and each task's last reading is kept.
"""

from __future__ import annotations

import os
import time

_TICKS = os.sysconf("SC_CLK_TCK")
MAX_TASKS = 256  # tasks read per sample at most (a sandbox's pids limit bounds them anyway)


def boot_ticks() -> int:
    """Now, in the clock /proc/<pid>/stat gives a task's start time in (ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode()
    except OSError:
        return None


class TreeStats:
    """The tasks below process `root` (its descendants' threads) that started at or after `since`
    (boot_ticks()): what they ran and waited, as of the last `sample()`."""

    def __init__(self, root: int, since: int) -> None:
        self.root = root
        self.since = since
        self._tasks: dict[tuple[int, int], tuple[int, int]] = {}  # (tid, start) -> (ran ns, waited ns)

    def sample(self) -> None:
        """Walk the tree now (reads /proc; microseconds per task)."""
        pending, walked = [self.root], 0
        while pending and walked < MAX_TASKS:
            pid = pending.pop()
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                walked += 1
                base = f"/proc/{pid}/task/{tid}"
                children = _read(base + "/children")
                if children:
                    pending.extend(int(c) for c in children.split())
                stat, sched = _read(base + "/stat"), _read(base + "/schedstat")
                if stat is None or sched is None:
                    continue
                try:
                    start = int(stat[stat.rfind(")") + 2 :].split()[19])  # field 22: starttime
                    ran, waited = (int(x) for x in sched.split()[:2])
                except (ValueError, IndexError):
                    continue
                if start >= self.since:
                    self._tasks[(int(tid), start)] = (ran, waited)

    @property
    def ran(self) -> float:
        """Seconds of CPU the tasks got."""
        return sum(r for r, _ in self._tasks.values()) / 1e9

    @property
    def waited(self) -> float:
        """Seconds the tasks spent runnable, waiting for a CPU."""
        return sum(w for _, w in self._tasks.values()) / 1e9
