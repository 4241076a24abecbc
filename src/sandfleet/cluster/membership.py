"""The gateway's view of the cluster's nodes: who they are, whether they live, what they hold.

Two sources, kept apart:
- *registrations and liveness* come from discovery (Ray: each node's actor; or a fixed list). A node
  discovery reports dead is `lost`: its sandboxes answer `sandbox_lost`, for good, on every gateway.
- *load* is read by the gateway itself from each node's `/v1/node/load` over HTTP, about once a
  second: placement and quotas decide on it. A node that does not answer a few reads in a row is
  `unreachable` (no creates go there; calls naming its sandboxes are still passed on).

Each node has two HTTP clients: `http` for callers' calls passed on (exec streams and verifications
hold its connections for minutes), and a small `control` client for the gateway's own bookkeeping
(load reads, acks, drains), which a node busy with long calls never starves: a load read or an ack
queued behind callers' streams would make the node look unreachable and its new sandboxes unclaimed.

When discovery goes quiet (Ray's head lost), the last registrations stay and loads keep coming:
the gateway keeps serving the cluster it knew.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import httpx

from sandfleet.client._base import TCP_OPTIONS, AsyncConnection, Lane
from sandfleet.cluster.placement import NodeState
from sandfleet.errors import NotFoundError, SandboxLostError
from sandfleet.ids import node_of
from sandfleet.models import NodeLoad

log = logging.getLogger("sandfleet.cluster")

NodeStatus = Literal["alive", "draining", "unreachable", "lost"]


@dataclass(frozen=True)
class Registration:
    """What discovery says of a node."""

    key: str
    url: str
    group: str = "default"
    alive: bool | None = True  # None: discovery had no answer in time (keep what was known)
    generation: int = 0  # what it registered under (raised each time it is fenced)


@dataclass
class Node:
    key: str
    url: str
    group: str
    http: httpx.AsyncClient  # callers' calls passed on
    control: httpx.AsyncClient  # the gateway's own: load reads, acks, drains
    # one-answer JSON calls (creates, lookups) without httpx's layers (client/_base/lane.py); None:
    # through `http` (a test's transport, an https URL)
    lane: Lane[AsyncConnection] | None = None
    lost: bool = False
    lost_at: float | None = None  # when it was declared lost (wall clock)
    load: NodeLoad | None = None
    load_at: float = 0.0  # monotonic time the load was read
    failures: int = 0  # load reads failed in a row
    unreachable_after: int = 3
    generation: int = 0  # as registered: a node answering with a lower one was not fenced

    @property
    def status(self) -> NodeStatus:
        if self.lost:
            return "lost"
        if self.silent or self.load is None:
            return "unreachable"
        if self.load.draining:
            return "draining"
        return "alive"

    @property
    def silent(self) -> bool:
        """Its last load reads all failed: not worth waiting for an answer from (`load` None alone is
        a node not read yet, still asked)."""
        return self.failures >= self.unreachable_after


USER_AGENT = f"python-httpx/{httpx.__version__}"  # what nodes' audit records name, either way
CONTROL_CONNECTIONS = 4  # per node: a load read and an ack sender at a time, a drain


class Membership:
    def __init__(
        self,
        node_token: str,
        *,
        load_interval: float = 1.0,
        unreachable_after: int = 3,
        connections: int = 256,
        transport: Callable[[str], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        """`transport`: how to reach a node's URL (tests: an in-process node's routes); None: HTTP."""
        self._token = node_token
        self._transport = transport
        self.load_interval = load_interval
        self.unreachable_after = unreachable_after
        self.connections = connections  # per node, for callers' calls passed on
        self.nodes: dict[str, Node] = {}
        self.changed = asyncio.Event()  # set when the set of nodes or their loads changed
        self.gateways: list[str] = []  # other gateways' URLs, as discovery last saw them
        self._closing: set[asyncio.Task[None]] = set()  # clients of nodes gone, being closed

    # -- what discovery says ---------------------------------------------------------------------
    def apply(self, registrations: Iterable[Registration]) -> None:
        """Discovery's latest word. A node it lists as dead is lost. A node it no longer lists was
        taken out (`sandfleet cluster down`) or discovery lost its records (a new Ray head): it is
        dropped once it also stops answering, kept as long as it serves."""
        regs = list(registrations)
        listed = {r.key for r in regs}
        for key in [k for k, n in self.nodes.items() if k not in listed and n.status == "unreachable"]:
            self._close(self.nodes.pop(key))
            log.info("node %s left the cluster", key)
        for reg in regs:
            node = self.nodes.get(reg.key)
            if node is None or node.url != reg.url:
                if node is not None:
                    self._close(node)
                node = self.nodes[reg.key] = Node(
                    reg.key,
                    reg.url,
                    reg.group,
                    self._client(reg.url, self.connections),
                    self._client(reg.url, CONTROL_CONNECTIONS),
                    lane=self._lane(reg.url),
                    unreachable_after=self.unreachable_after,
                )
                log.info("node %s at %s (group %s) joined", reg.key, reg.url, reg.group)
            node.group = reg.group
            node.generation = reg.generation
            if reg.alive is False and not node.lost:
                node.lost, node.lost_at = True, time.time()
                log.warning("node %s is lost: its sandboxes are gone", reg.key)
                # Calls still waiting on it fail now (as sandbox_lost), not when TCP gives up.
                self._close(node)
                node.http = self._client(node.url, self.connections)
                node.control = self._client(node.url, CONTROL_CONNECTIONS)
                node.lane = self._lane(node.url)
            elif reg.alive is True and node.lost:
                # A node that came back under its key lost what it held when it died, and starts over.
                node.lost, node.lost_at, node.load, node.failures = False, None, None, 0
                log.info("node %s is back", reg.key)
        self.changed.set()

    def _client(self, url: str, connections: int) -> httpx.AsyncClient:
        # The limits are the transport's: a client given a transport ignores its own `limits`.
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=min(64, connections))
        transport = self._transport(url) if self._transport else None
        return httpx.AsyncClient(
            base_url=url,
            transport=transport or httpx.AsyncHTTPTransport(socket_options=TCP_OPTIONS, limits=limits),
            headers={"authorization": f"Bearer {self._token}"},
            timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=30.0),
        )

    def _lane(self, url: str) -> Lane[AsyncConnection] | None:
        target = httpx.URL(url)
        if (
            self._transport is not None
            or target.scheme != "http"
            or not target.host
            or target.raw_path not in (b"", b"/")
        ):
            return None  # a test's transport, TLS, or a path prefix (the lane writes the call's path as it is)
        headers = {
            "host": target.netloc.decode("ascii"),
            "accept": "*/*",
            "user-agent": f"python-httpx/{httpx.__version__}",
        }
        headers["authorization"] = f"Bearer {self._token}"  # the gateway's, unless a call carries its caller's
        limit = min(64, self.connections)
        return Lane(url, headers, limit=limit, idle=limit)

    def _close(self, node: Node) -> None:
        if node.lane is not None:
            node.lane.close()
        for client in (node.http, node.control):
            self._closing.add(asyncio.get_running_loop().create_task(client.aclose()))

    # -- what the gateway reads itself -----------------------------------------------------------
    async def refresh(self) -> None:
        """Read every node's load once (all at once)."""
        nodes = [n for n in self.nodes.values() if not n.lost]
        await asyncio.gather(*(self._read_load(n) for n in nodes))
        self.changed.set()

    async def _read_load(self, node: Node) -> None:
        try:
            r = await node.control.get("/v1/node/load", timeout=max(2.0, self.load_interval * 2))
            if r.status_code != 200:
                raise httpx.HTTPStatusError(f"HTTP {r.status_code}", request=r.request, response=r)
            load = NodeLoad.model_validate_json(r.content)
        except (httpx.HTTPError, ValueError) as exc:
            node.failures += 1
            if node.failures == self.unreachable_after:
                log.warning("node %s unreachable (%s): no creates go there", node.key, exc)
            return
        if load.key != node.key:
            node.failures += 1
            log.error("node at %s says it is %s, registered as %s: ignored", node.url, load.key, node.key)
            return
        if load.generation < node.generation:  # it holds what the cluster gave up on: never served
            node.failures += 1
            log.error(
                "node %s serves generation %d, registered as %d: ignored", node.key, load.generation, node.generation
            )
            return
        if node.failures >= self.unreachable_after:
            log.info("node %s reachable again", node.key)
        node.load, node.load_at, node.failures = load, time.monotonic(), 0

    async def run(self) -> None:
        """Read loads forever, every `load_interval` seconds."""
        while True:
            t0 = time.monotonic()
            await self.refresh()
            await asyncio.sleep(max(0.05, self.load_interval - (time.monotonic() - t0)))

    async def close(self) -> None:
        for node in self.nodes.values():
            if node.lane is not None:
                node.lane.close()
            await node.http.aclose()
            await node.control.aclose()
        await asyncio.gather(*self._closing, return_exceptions=True)

    # -- what the routes ask ---------------------------------------------------------------------
    def holder(self, object_id: str, what: str = "sandbox") -> Node:
        """The node holding a sandbox or snapshot id; `sandbox_lost` if that node died."""
        key = node_of(object_id)
        node = self.nodes.get(key) if key else None
        if node is None:
            raise NotFoundError(f"{what} {object_id[:80]} not found")
        if node.lost:
            raise SandboxLostError(f"{what} {object_id} is lost: its node {node.key} died or left the cluster")
        return node

    def reachable(self) -> list[Node]:
        """Nodes calls can go to (fan-outs: list, stop by label, ...)."""
        return [n for n in self.nodes.values() if not n.lost and n.status != "unreachable"]

    def live(self) -> list[Node]:
        """Nodes not lost, answering or not: what they hold still exists (writes to every node go to
        each of them, and say which did not answer)."""
        return [n for n in self.nodes.values() if not n.lost]

    def askable(self) -> tuple[list[Node], list[Node]]:
        """The live nodes split for a lookup (who holds this key, this trajectory): those worth asking,
        and those already `silent` (asking them would only wait out the lookup's timeout)."""
        live = self.live()
        return [n for n in live if not n.silent], [n for n in live if n.silent]

    def placement_view(self) -> list[NodeState]:
        out = []
        for n in self.nodes.values():
            load = n.load
            if load is None:
                continue
            status = n.status
            out.append(
                NodeState(
                    key=n.key,
                    group=load.group,
                    alive=status in ("alive", "draining"),
                    draining=load.draining,
                    tiers=frozenset(load.tiers),
                    images=frozenset(load.images),
                    labels=load.labels,
                    sandboxes=load.sandboxes,
                    capacity=load.capacity,
                    seen_at=n.load_at,
                )
            )
        return out

    def project_usage(self) -> Mapping[str, tuple[int, float, int]]:
        """Per project, what its live sandboxes hold across the nodes (as last read; not rolled up)."""
        total: dict[str, list[float]] = {}
        for n in self.nodes.values():
            if n.lost or n.load is None:
                continue
            for project, u in n.load.projects.items():
                row = total.setdefault(project, [0, 0.0, 0])
                row[0] += u.sandboxes
                row[1] += u.cpu
                row[2] += u.memory
        return {k: (int(v[0]), v[1], int(v[2])) for k, v in total.items()}
