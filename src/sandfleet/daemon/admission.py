"""Node-level admission: refuse a create (retryable) rather than let the node degrade.

Per-sandbox cgroup limits keep one sandbox from hurting the others; admission keeps their sum
within what the node can carry. Three gates, cheapest first: the sandbox count, the memory committed
by limits (overcommitted by a factor, since agent sandboxes mostly idle) together with the memory
actually available, and the node's task count against pid_max (which binds before memory at
thousands of sandboxes on hosts with the default pid_max).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sandfleet.errors import ResourceExhaustedError
from sandfleet.models import Resources


@dataclass(frozen=True)
class AdmissionPolicy:
    max_sandboxes: int = 1000
    memory_overcommit: float = 16.0
    min_available_memory: int = 256 * 1024**2
    max_task_fraction: float = 0.9


def _meminfo(path: Path) -> dict[str, int]:
    out = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key] = int(parts[0]) * 1024
    return out


class Admission:
    def __init__(self, policy: AdmissionPolicy, proc: Path = Path("/proc")) -> None:
        self.policy = policy
        self.proc = proc
        self.committed_memory = 0  # sum of memory limits of running and creating sandboxes
        try:
            self.pid_max = int((proc / "sys/kernel/pid_max").read_text())
        except (OSError, ValueError):
            self.pid_max = 32768

    def admit(self, count: int, resources: Resources) -> None:
        """Raise ResourceExhaustedError (retryable) if one more sandbox would overload the node."""
        p = self.policy
        if count >= p.max_sandboxes:
            raise ResourceExhaustedError(f"node is full: {p.max_sandboxes} sandboxes")
        mem = _meminfo(self.proc / "meminfo")
        total = mem.get("MemTotal", 0)
        budget = int(total * p.memory_overcommit)
        if self.committed_memory + resources.memory > budget:
            raise ResourceExhaustedError(
                f"node memory is fully committed: {self.committed_memory + resources.memory} bytes of limits "
                f"would exceed {p.memory_overcommit:g} x {total} bytes"
            )
        if mem.get("MemAvailable", total) < p.min_available_memory:
            raise ResourceExhaustedError("node is under memory pressure (MemAvailable below the reserve)")
        try:
            tasks = int((self.proc / "loadavg").read_text().split()[3].split("/")[1])
        except (OSError, ValueError, IndexError):
            tasks = 0
        if tasks > self.pid_max * p.max_task_fraction:
            raise ResourceExhaustedError(f"node is out of task ids: {tasks} of pid_max {self.pid_max} in use")

    def commit(self, resources: Resources) -> None:
        self.committed_memory += resources.memory

    def release(self, resources: Resources) -> None:
        self.committed_memory = max(0, self.committed_memory - resources.memory)
