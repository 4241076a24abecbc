"""A command's processes on the host: the CPU they used, and how long their tasks ran and waited for
a CPU (per-task scheduler counters).

A command is the process its sandbox's init started for it (`command_pid` finds it among the init's
children by its pid inside the sandbox) and that process's descendants; nothing else of the sandbox
(another command, a background server, the init) is read or counted. `/proc/<pid>/stat` gives each
process's CPU time, its own and that of the children it reaped; `/proc/<pid>/task/<tid>/schedstat`
gives, for each task, the nanoseconds it ran and the nanoseconds it sat runnable on a run queue
waiting for a CPU (which includes time its cgroup's CPU quota held it back). The two counters tell
a command the node starved (its tasks wanted a CPU and waited for one) from one that was slow or
idle on its own. They die with their task, so the caller samples while the command runs; a task
gone since the last look leaves its last reading in the totals.

Each look reads a few small files per task of the command's own tree (at most MAX_TASKS tasks);
callers read in a worker thread.
"""

from __future__ import annotations

import os
import time

_TICKS = os.sysconf("SC_CLK_TCK")
MAX_TASKS = 256  # tasks read per look at most (a sandbox's pids limit bounds them anyway)


def boot_ticks() -> int:
    """Now, in the clock /proc/<pid>/stat gives a task's start time in (ticks since boot)."""
    return int(time.clock_gettime(time.CLOCK_BOOTTIME) * _TICKS)


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode()
    except OSError:
        return None


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (field 3 on), or None if it is gone."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat[stat.rfind(")") + 2 :].split()


def command_pid(init: int, inside: int, since: int) -> int | None:
    """The host pid of the child of host process `init` whose pid in its pid namespace is `inside`
    (the last of its NSpid) and that started at or after `since` (boot_ticks()); None when there is
    none (it has exited)."""
    for child in reversed((_read(f"/proc/{init}/task/{init}/children") or "").split()):  # newest last
        status = _read(f"/proc/{child}/status")
        nspid = next((ln.split()[1:] for ln in (status or "").splitlines() if ln.startswith("NSpid:")), [])
        if nspid and nspid[-1] == str(inside):
            fields = _stat_fields(child)
            return int(child) if fields is not None and int(fields[19]) >= since else None
    return None


class TreeStats:
    """Process `root` (a host pid) and its descendants, each started at or after `since`
    (boot_ticks(); an older one is another process that reused a pid): as of the last `sample()`,
    the CPU they used and what their tasks ran and waited."""

    def __init__(self, root: int, since: int) -> None:
        self.root = root
        self.since = since
        self._tasks: dict[int, tuple[int, int]] = {}  # tid -> (ran ns, waited ns): tasks alive at the last look
        self._gone = (0, 0)  # what tasks gone since ran and waited, at their last reading
        self._cpu_ticks = 0

    def sample(self) -> None:
        """Read the tree now (microseconds per task)."""
        seen: dict[int, tuple[int, int]] = {}
        cpu, pending, complete = 0, [self.root], True
        while pending and complete:
            pid = pending.pop()
            fields = _stat_fields(pid)
            if fields is None or int(fields[19]) < self.since:  # field 22: starttime
                continue
            cpu += sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for name in tids:
                if len(seen) >= MAX_TASKS:
                    complete = False
                    break
                base = f"/proc/{pid}/task/{name}"
                children = _read(base + "/children")
                if children:
                    pending.extend(int(c) for c in children.split())
                sched = _read(base + "/schedstat")
                if sched is not None:
                    ran, waited = (int(x) for x in sched.split()[:2])
                    seen[int(name)] = (ran, waited)
        gone_ran, gone_waited = self._gone
        for tid, (ran, waited) in self._tasks.items():
            now = seen.get(tid)
            if now is None and not complete and len(seen) < 2 * MAX_TASKS:
                # Not read by a look cut at MAX_TASKS: it keeps its last reading (within a bound;
                # past it, a tree of hundreds of churning tasks may count one twice).
                seen[tid] = (ran, waited)
            elif now is None or now[0] < ran:
                # Gone, or its tid taken by a new task (the counters only grow): its last reading
                # stays in the totals.
                gone_ran, gone_waited = gone_ran + ran, gone_waited + waited
        self._gone = (gone_ran, gone_waited)
        self._tasks = seen
        self._cpu_ticks = max(self._cpu_ticks, cpu)  # a process that left the tree took its CPU along

    @property
    def cpu(self) -> float:
        """Seconds of CPU the processes used (theirs, and what the children they reaped used)."""
        return self._cpu_ticks / _TICKS

    @property
    def ran(self) -> float:
        """Seconds of CPU the tasks got."""
        return (self._gone[0] + sum(r for r, _ in self._tasks.values())) / 1e9

    @property
    def waited(self) -> float:
        """Seconds the tasks spent runnable, waiting for a CPU."""
        return (self._gone[1] + sum(w for _, w in self._tasks.values())) / 1e9
