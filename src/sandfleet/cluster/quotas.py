"""Project quotas at a gateway, with no central call per create.

Every gateway reads each node's per-project usage with its load (about once a second), so each
knows the whole cluster's usage, a second old. Between two reads, a gateway may admit only its
share of each quota's headroom (about 1/G of it, G the gateways registered in Ray) on top of its
own admissions since the read: the gateways together never hand out more than the headroom,
whatever the order of their creates, and no gateway waits on another. Nodes check the same quotas
again against what they hold (the last word, as for capacity). What this costs: near a quota's
limit a create can be refused by one gateway while another's share sits unused, until the next
read moves the headroom; a gateway whose share is spent passes such a create to the project's first
gateway (one extra hop, near the limit only) rather than refusing it.
"""

from __future__ import annotations

import collections
import hashlib
import math
import time
from collections.abc import Callable

from sandfleet.cluster.membership import Membership
from sandfleet.daemon.security.iam import Iam
from sandfleet.errors import ResourceExhaustedError
from sandfleet.models import Refusal, SandboxSpec


class ShareSpent(ResourceExhaustedError):
    """This gateway's share of a quota is spent while the cluster still has headroom: the create may
    be passed to `owner`, the project's first gateway, which holds a share as long as any is left
    (so a client bound to one gateway can use a quota to its last unit)."""

    def __init__(self, message: str, owner: str) -> None:
        super().__init__(message)
        self.owner = owner


class GatewayQuotas:
    def __init__(self, iam: Iam, membership: Membership, me: str) -> None:
        self.iam = iam
        self.membership = membership
        self.me = me  # this gateway's URL: its place in each project's order of gateways
        # (monotonic time, project, cpu, memory) of this gateway's admissions not yet in a load read
        self._recent: collections.deque[tuple[float, str, float, int]] = collections.deque()
        # a refusal: the listed project whose quota refused (the gateway's metric), the spec, why
        self.refused: Callable[[str, SandboxSpec, Refusal, ResourceExhaustedError], None] = lambda *_: None

    def _mine(self, now: float) -> dict[str, tuple[int, float, int]]:
        # Ours older than every node's last load read are in the nodes' counts; a node whose reads
        # fail keeps them counted here (never counted nowhere).
        reads = [n.load_at for n in self.membership.nodes.values() if not n.lost and n.load is not None]
        horizon = min(reads, default=now) - 0.5 * self.membership.load_interval
        while self._recent and self._recent[0][0] < horizon:
            self._recent.popleft()
        out: dict[str, list[float]] = {}
        for _t, project, cpu, mem in self._recent:
            row = out.setdefault(project, [0, 0.0, 0])
            row[0] += 1
            row[1] += cpu
            row[2] += mem
        return {k: (int(v[0]), v[1], int(v[2])) for k, v in out.items()}

    def order(self, project: str) -> list[str]:
        """The gateways in `project`'s order, the same on every gateway (rendezvous hashing of the
        project with each gateway's URL). The first holds a share whenever any headroom is left."""
        urls = set(self.membership.gateways) | {self.me}
        return sorted(urls, key=lambda u: hashlib.sha256(f"{project}\0{u}".encode()).digest())

    def admit(self, spec: SandboxSpec, now: float | None = None) -> None:
        """Refuse (`resource_exhausted`, naming the project) a create this gateway's share of its
        project's quotas cannot hold; count it in the share otherwise.

        A share is counted in creates of the size asked: with headroom for n more (as of the last
        load read) and G gateways, each may place n // G, and the first n % G gateways in the
        project's order one more: together exactly n, so the last unit of a quota is never split
        into shares too small to use. Exact when a project's sandboxes are the same size (a job's
        are); with mixed sizes the nodes' own check is the backstop."""
        project = spec.project
        if project is None:
            return
        now = time.monotonic() if now is None else now
        cpu, mem = spec.resources.cpu, int(spec.resources.memory)
        order = self.order(project)
        rank, gateways = order.index(self.me), len(order)
        chain = [(path, q) for path, q in self.iam.chain(project) if q.bounds()]
        if chain:
            paths = tuple(path for path, _ in chain)
            read = self.iam.rollup(self.membership.project_usage(), paths)
            mine = self.iam.rollup(self._mine(now), paths)
            for path, quota in chain:
                for i, (dim, asked) in enumerate((("sandboxes", 1.0), ("cpu", cpu), ("memory", float(mem)))):
                    limit = getattr(quota, dim)
                    if limit is None or asked <= 0:
                        continue
                    units = max(0, math.floor((limit - read[path][i]) / asked + 1e-9))
                    allowed = units // gateways + (1 if rank < units % gateways else 0)
                    if mine[path][i] + asked > allowed * asked + 1e-9:
                        used = read[path][i] + mine[path][i]
                        amount = f"{int(limit)} sandboxes" if dim == "sandboxes" else f"{limit:g} {dim}"
                        if units > 0 and rank != 0:  # the first gateway of the project holds a share
                            raise ShareSpent(f"project {path}: this gateway's share of its quota is spent", order[0])
                        err = ResourceExhaustedError(f"project {path}: quota of {amount} reached ({used:g} in use)")
                        self.refused(path, spec, "quota", err)
                        raise err
        if self.iam.rated(project):
            try:
                self.iam.take_create(project, share=1.0 / gateways, now=now)
            except ResourceExhaustedError as err:
                rated = [path for path, q in self.iam.chain(project) if q.creates_per_second is not None]
                self.refused(rated[0] if rated else project, spec, "rate", err)  # a listed project (the metric's)
                raise
        self._recent.append((now, project, cpu, mem))

    def forget(self, spec: SandboxSpec) -> None:
        """A create admitted here did not make a sandbox: its share is free again."""
        for i in range(len(self._recent) - 1, -1, -1):
            if self._recent[i][1] == spec.project:
                del self._recent[i]
                return
