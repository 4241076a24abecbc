"""Node-level admission: refuse a create (retryable) rather than let the node degrade.

Per-sandbox cgroup limits keep one sandbox from hurting the others; admission keeps their sum
within what the node can carry. Gates, cheapest first: the sandbox count; CPU committed by requests
(overcommitted by `cpu_overcommit`, since ~90 % of agent sandboxes use a few percent of what they
ask for) and CPU observed in use by latency-sensitive sandboxes (best-effort work yields, so it does
not count); the memory committed by limits (overcommitted by a separate, smaller factor) together
with the memory actually available; and the node's task count against pid_max (which binds before
memory at thousands of sandboxes on hosts with the default pid_max).

`CpuQueue` is the other side of the same budget for work the node starts on its own (a
verification's checks, CPU-bound by nature): it waits for CPUs to be free instead of being refused.
What it runs counts in the observed load like any latency-sensitive sandbox, so its capacity stays
below `max_cpu_load` (verify.py: half of it by default): the queue alone never refuses other creates.
Its sandboxes are not refused for the load in turn (their CPUs are the queue's): another tenant that
saturates the node holds up its own creates, not the node's verifications.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from sandfleet.errors import ResourceExhaustedError
from sandfleet.models import Resources


@dataclass(frozen=True)
class AdmissionPolicy:
    max_sandboxes: int = 1000
    cpu_overcommit: float = 32.0
    max_cpu_load: float | None = 0.95  # share of the node's CPUs latency-sensitive sandboxes may be using
    memory_overcommit: float = 16.0
    min_available_memory: int = 256 * 1024**2
    max_task_fraction: float = 0.9


# How long a reading of /proc/meminfo and /proc/loadavg serves admissions. Both are gates against
# pressure, not budgets (the committed sums are exact), and reading them per create cost ~5 % of the
# daemon's CPU in a burst; at 1,000 creates/s a reading is at most ~50 sandboxes old.
PRESSURE_TTL_S = 0.05


def _meminfo(path: Path) -> dict[str, int]:
    out = {}
    with open(path, "rb") as f:
        data = f.read()
    for line in data.splitlines():
        key, _, rest = line.partition(b":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.decode()] = int(parts[0]) * 1024
    return out


class Admission:
    def __init__(self, policy: AdmissionPolicy, proc: Path = Path("/proc")) -> None:
        self.policy = policy
        self.proc = proc
        self.committed_memory = 0  # sum of memory limits of running and creating sandboxes
        self.committed_cpu = 0.0  # sum of CPU requests of the same
        self.cpus = len(os.sched_getaffinity(0)) or 1
        self.cpu_load = 0.0  # CPUs latency-sensitive sandboxes used over the last observation
        self._last_cpu: tuple[float, float] | None = None
        try:
            self.pid_max = int((proc / "sys/kernel/pid_max").read_text())
        except (OSError, ValueError):
            self.pid_max = 32768
        self.memory_total = _meminfo(proc / "meminfo").get("MemTotal", 0)
        self._pressure: tuple[float, int, int] | None = None  # (when, MemAvailable, tasks)

    def _read_pressure(self) -> tuple[int, int]:
        """MemAvailable and the node's task count, read at most every PRESSURE_TTL_S."""
        now = time.monotonic()
        if self._pressure is None or now - self._pressure[0] > PRESSURE_TTL_S:
            available = _meminfo(self.proc / "meminfo").get("MemAvailable", self.memory_total)
            try:
                with open(self.proc / "loadavg", "rb") as f:
                    tasks = int(f.read().split()[3].split(b"/")[1])
            except (OSError, ValueError, IndexError):
                tasks = 0
            self._pressure = (now, available, tasks)
        return self._pressure[1], self._pressure[2]

    def admit(self, count: int, resources: Resources, *, cpu_held: bool = False) -> None:
        """Raise ResourceExhaustedError (retryable) if one more sandbox would overload the node.
        `cpu_held`: its CPU is held in a CpuQueue, out of the load budget: the load gate is not its."""
        p = self.policy
        if count >= p.max_sandboxes:
            raise ResourceExhaustedError(f"node is full: {p.max_sandboxes} sandboxes")
        cpu_budget = p.cpu_overcommit * self.cpus
        if self.committed_cpu + resources.requested_cpu > cpu_budget + 1e-9:
            raise ResourceExhaustedError(
                f"node CPU is fully committed: {self.committed_cpu + resources.requested_cpu:g} CPUs of requests "
                f"would exceed {p.cpu_overcommit:g} x {self.cpus}"
            )
        if p.max_cpu_load is not None and not cpu_held and self.cpu_load > p.max_cpu_load * self.cpus:
            raise ResourceExhaustedError(
                f"node CPU is saturated: sandboxes are using {self.cpu_load:.2f} of {self.cpus} CPUs"
            )
        total = self.memory_total
        budget = int(total * p.memory_overcommit)
        if self.committed_memory + resources.memory > budget:
            raise ResourceExhaustedError(
                f"node memory is fully committed: {self.committed_memory + resources.memory} bytes of limits "
                f"would exceed {p.memory_overcommit:g} x {total} bytes"
            )
        available, tasks = self._read_pressure()
        if available < p.min_available_memory:
            raise ResourceExhaustedError("node is under memory pressure (MemAvailable below the reserve)")
        if tasks > self.pid_max * p.max_task_fraction:
            raise ResourceExhaustedError(f"node is out of task ids: {tasks} of pid_max {self.pid_max} in use")

    def commit(self, resources: Resources) -> None:
        self.committed_memory += resources.memory
        self.committed_cpu += resources.requested_cpu

    def release(self, resources: Resources) -> None:
        self.committed_memory = max(0, self.committed_memory - resources.memory)
        self.committed_cpu = max(0.0, self.committed_cpu - resources.requested_cpu)

    def observe_cpu(self, cpu_seconds: float, now: float) -> None:
        """Record the CPU time latency-sensitive sandboxes have used in total (sampled by the reaper)."""
        last, self._last_cpu = self._last_cpu, (cpu_seconds, now)
        if last is not None and now - last[1] > 0.05:
            self.cpu_load = max(0.0, (cpu_seconds - last[0]) / (now - last[1]))


class CpuQueue:
    """Room for CPU-bound work the node does on its callers' behalf (a verification's checks): each
    holds the CPUs it may use while it runs, up to `capacity` in all; the rest wait their turn in
    order (first come, first served, so a big request is not passed over forever). One that asks for
    more than the capacity holds all of it."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.held = 0.0
        self._waiting: deque[tuple[float, asyncio.Future[None]]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, cpus: float) -> float:
        """Wait for room for `cpus`; returns what was taken (give it back with `release`)."""
        cpus = min(cpus, self.capacity)
        if not self._waiting and self.held + cpus <= self.capacity + 1e-9:
            self.held += cpus
            return cpus
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (cpus, fut)
        self._waiting.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():  # granted as it was cancelled: give it back
                self.release(cpus)
            else:
                self._waiting.remove(entry)
                self._grant()  # it may have been the head holding others back
            raise
        return cpus

    def release(self, cpus: float) -> None:
        self.held = max(0.0, self.held - cpus)
        self._grant()

    def _grant(self) -> None:
        while self._waiting and self.held + self._waiting[0][0] <= self.capacity + 1e-9:
            cpus, fut = self._waiting.popleft()
            self.held += cpus
            fut.set_result(None)
