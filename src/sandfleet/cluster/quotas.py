"""Project quotas at a gateway, with no central call per create.

Every gateway reads each node's per-project usage with its load (about once a second), so each
knows the whole cluster's usage, a second old. Between two reads, a gateway may admit only its
share of each quota's headroom (1/G of it, G the gateways discovery sees) on top of its own
admissions since the read: the gateways together never hand out more than the headroom, whatever
the order of their creates, and no gateway waits on another. Nodes check the same quotas again
against what they hold (the last word, as for capacity). What this costs: a small quota's
headroom, split G ways, can refuse a create early while another gateway's share sits unused, for
at most one refresh interval.
"""

from __future__ import annotations

import collections
import time

from sandfleet.cluster.membership import Membership
from sandfleet.daemon.iam import Iam
from sandfleet.models import SandboxSpec


class GatewayQuotas:
    def __init__(self, iam: Iam, membership: Membership, *, gateways: int = 1) -> None:
        self.iam = iam
        self.membership = membership
        self.gateways = gateways  # how many gateways share each headroom (discovery updates it)
        # (monotonic time, project, cpu, memory) of this gateway's admissions not yet in a load read
        self._recent: collections.deque[tuple[float, str, float, int]] = collections.deque()

    def _mine(self, now: float) -> dict[str, tuple[int, float, int]]:
        horizon = now - 2.5 * self.membership.load_interval  # older ones are in the nodes' counts
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        out: dict[str, list[float]] = {}
        for _t, project, cpu, mem in self._recent:
            row = out.setdefault(project, [0, 0.0, 0])
            row[0] += 1
            row[1] += cpu
            row[2] += mem
        return {k: (int(v[0]), v[1], int(v[2])) for k, v in out.items()}

    def admit(self, spec: SandboxSpec, now: float | None = None) -> None:
        """Refuse (`resource_exhausted`, naming the project) a create this gateway's share of its
        project's quotas cannot hold; count it in the share otherwise."""
        project = spec.project
        if project is None:
            return
        now = time.monotonic() if now is None else now
        share = 1.0 / max(1, self.gateways)
        cpu, mem = spec.resources.cpu, int(spec.resources.memory)
        if self.iam.bounded(project):
            read = self.membership.project_usage()
            usage = dict(read)
            for k, (n, c, m) in self._mine(now).items():
                was = usage.get(k, (0, 0.0, 0))
                usage[k] = (was[0] + n, was[1] + c, was[2] + m)
            self.iam.check_create(project, cpu, mem, usage, share=share, baseline=read)
        elif not self.iam.rated(project):
            return
        self.iam.take_create(project, share=share, now=now)
        self._recent.append((now, project, cpu, mem))

    def forget(self, spec: SandboxSpec) -> None:
        """A create admitted here did not make a sandbox: its share is free again."""
        for i in range(len(self._recent) - 1, -1, -1):
            if self._recent[i][1] == spec.project:
                del self._recent[i]
                return
