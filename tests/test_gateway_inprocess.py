"""The cluster gateway over in-process nodes: forwarding, fan-out, merging and partial failures in seconds.

Two `InProcessNode`s (the whole node service on the fake tier) reached through their ASGI routes, a
gateway with a static node list in front of them, and the SDK's `AsyncClient` talking to the gateway's
routes: everything between the SDK and the fake tier is the product's own code, with no Ray, no
socket and no root. tests/test_cluster.py is the proof on real nodes under Ray.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from sandfleet import AsyncClient, NotFoundError, ResourceExhaustedError, SandboxSpec, UnavailableError
from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.gateway import Gateway, create_gateway_app
from sandfleet.cluster.membership import Registration
from sandfleet.testing import InProcessNode

pytestmark = pytest.mark.unit

TOKEN = "cluster-admin-token"
KEYS = ("a0a0a0", "b1b1b1")


class Down(httpx.AsyncBaseTransport):
    """A node that stopped answering."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)


class Cluster:
    def __init__(self, nodes: dict[str, InProcessNode]) -> None:
        self.nodes = nodes
        self.down: set[str] = set()
        urls = [{"key": k, "url": f"http://node-{k}"} for k in nodes]
        config = GatewayConfig(nodes=urls, node_token=TOKEN, token=TOKEN, unreachable_after=1)
        self.gateway = Gateway(config, transport=self._transport)
        self.app = create_gateway_app(self.gateway)

    def _transport(self, url: str) -> httpx.AsyncBaseTransport:
        key = url.removeprefix("http://node-")
        node = self.nodes[key]
        inner = node.transport()
        down = self.down

        class Switch(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                if key in down:
                    return await Down().handle_async_request(request)
                return await inner.handle_async_request(request)

        return Switch()

    async def start(self) -> None:
        self.gateway.membership.apply(Registration(k, f"http://node-{k}", "default", True) for k in self.nodes)
        await self.refresh()

    async def refresh(self) -> None:
        await self.gateway.membership.refresh()
        self.gateway.refresh_placement()

    def client(self) -> AsyncClient:
        return AsyncClient(url="http://gateway", token=TOKEN, transport=httpx.ASGITransport(app=self.app))


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    a = InProcessNode(tmp_path / "a", token=TOKEN, node_key=KEYS[0])
    b = InProcessNode(tmp_path / "b", token=TOKEN, node_key=KEYS[1])
    async with a, b:
        c = Cluster({KEYS[0]: a, KEYS[1]: b})
        await c.start()
        try:
            yield c
        finally:
            await c.gateway.acks.close()
            await c.gateway.membership.close()


def _node_of(sandbox_id: str) -> str:
    return sandbox_id.split("-", 1)[1][:6]


async def test_creates_spread_and_each_call_reaches_the_node_that_holds_its_sandbox(cluster: Cluster) -> None:
    async with cluster.client() as fleet:
        sandboxes = [await fleet.create(image="busybox", labels={"job": "j1"}) for _ in range(8)]
        assert {_node_of(sb.id) for sb in sandboxes} == set(KEYS)
        for sb in sandboxes:
            r = await sb.exec("echo hi")
            assert (r.exit_code, r.stdout) == (0, "hi\n")
            held = await cluster.nodes[_node_of(sb.id)].service.core.list()
            assert sb.id in {s.id for s in held}
        listed = await fleet.list(labels={"job": "j1"})
        assert sorted(s.id for s in listed) == sorted(sb.id for sb in sandboxes)
        stopped = await fleet.stop_many({"job": "j1"})
        assert sorted(stopped) == sorted(sb.id for sb in sandboxes)
        assert await fleet.list(labels={"job": "j1"}) == []


async def test_a_node_that_stops_answering_leaves_the_others_served(cluster: Cluster) -> None:
    async with cluster.client() as fleet:
        by_node: dict[str, list[str]] = {}
        while set(by_node) != set(KEYS) or min(len(v) for v in by_node.values()) < 2:
            sb = await fleet.create(image="busybox", labels={"job": "j2"})
            by_node.setdefault(_node_of(sb.id), []).append(sb.id)
        gone, alive = KEYS
        cluster.down.add(gone)
        await cluster.refresh()
        # Creates go to the node that answers; its sandboxes are still served and listed.
        for _ in range(4):
            sb = await fleet.create(image="busybox", labels={"job": "j2"})
            assert _node_of(sb.id) == alive
            assert (await sb.exec("echo up")).stdout == "up\n"
        listed = {s.id for s in await fleet.list(labels={"job": "j2"})}
        assert set(by_node[alive]) <= listed
        assert not listed & set(by_node[gone])
        # A call on a sandbox of the silent node fails typed, not as a gateway error.
        with pytest.raises(UnavailableError, match=f"node {gone} unreachable"):
            await (await fleet.get(by_node[gone][0])).exec("true")
        # A job-level write says which nodes it could not reach, having done its part on the others.
        with pytest.raises(UnavailableError, match=f"done on 1 of 2 nodes; not on {gone}"):
            await fleet.pause_many({"job": "j2"})
        states = {s.id: s.state for s in await cluster.nodes[alive].service.core.list(labels={"job": "j2"})}
        assert set(states.values()) == {"paused"}, states
        cluster.down.clear()
        await cluster.refresh()
        assert (await (await fleet.get(by_node[gone][0])).exec("echo back")).stdout == "back\n"
        # The retry the error asked for: every sandbox of the job, on both nodes, is paused once.
        paused = await fleet.pause_many({"job": "j2"})
        assert set(by_node[gone]) <= set(paused)
        assert {s.state for s in await fleet.list(labels={"job": "j2"})} == {"paused"}


async def test_a_key_another_gateway_placed_gets_its_sandbox_when_nothing_else_can_take_it(cluster: Cluster) -> None:
    """A keyed create through a gateway that did not place the key (another gateway did, or this one
    before a restart), with every node closed to new creates: before answering that nothing can take
    it, the gateway asks the nodes who holds the key, and the holder answers with what it made."""
    async with cluster.client() as fleet:
        made = await fleet.create(image="busybox", idempotency_key="k-1")
    other = Cluster(cluster.nodes)  # a second gateway over the same nodes: it never saw the key
    await other.start()
    try:
        for node in cluster.nodes.values():
            await node.service.drain(True)
        await other.refresh()
        async with other.client() as fleet:
            again = await fleet.create(image="busybox", idempotency_key="k-1")
            assert again.id == made.id
            with pytest.raises(ResourceExhaustedError):  # a key nobody holds still finds no room
                await fleet.create(image="busybox", idempotency_key="k-2", timeout=1)
    finally:
        await other.gateway.acks.close()
        await other.gateway.membership.close()


async def test_each_kind_of_operation_is_served_through_the_gateway(cluster: Cluster) -> None:
    """The gateway's routes are made from the operations' declarations: a call on a sandbox reaches its
    node (a new operation, `set_labels`, too), a trajectory's calls reach the node holding it, lists
    and counts are merged from every node, and a node's own operation answers why it is not passed on."""
    async with cluster.client() as fleet:
        sandboxes = [await fleet.create(image="busybox", labels={"job": "j3"}) for _ in range(4)]
        assert {_node_of(sb.id) for sb in sandboxes} == set(KEYS)
        for i, sb in enumerate(sandboxes):
            await sb.set_labels({"job": "j3", "half": str(i % 2)})
        assert sorted(s.id for s in await fleet.list(labels={"half": "1"})) == sorted(s.id for s in sandboxes[1::2])
        jobs = await fleet.jobs("half")
        assert {g.value: g.count for g in jobs.jobs} == {"0": 2, "1": 2}
        traj = await fleet.trajectory("t-1", SandboxSpec(image="busybox"))
        assert (await traj.exec("echo step")).stdout == "step\n"
        again = await fleet.get_trajectory("t-1")
        assert [s.step for s in await again.steps()] == [0]
        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=cluster.app), base_url="http://gateway")
        async with raw:
            r = await raw.post("/v1/node/drain", json={"draining": True}, headers={"authorization": f"Bearer {TOKEN}"})
            assert (r.status_code, r.json()["error"]["code"]) == (400, "unsupported")
            assert "/v1/cluster/nodes/{key}/drain" in r.json()["error"]["message"]


async def test_a_jobs_figures_and_the_alerts_are_added_up_over_nodes(cluster: Cluster) -> None:
    """GET /v1/jobs/{job} of every node that knows the job, added up; alerts of every node with its
    key, and a node the cluster lost as an alert of its own; nodes say when they were lost and how
    many creates were placed on each."""
    async with cluster.client() as fleet:
        sandboxes = [await fleet.create(image="busybox", labels={"job": "j5"}) for _ in range(4)]
        assert {_node_of(sb.id) for sb in sandboxes} == set(KEYS)
        for sb in sandboxes:
            assert (await sb.exec("exit 1")).exit_code == 1
        stats = await fleet.job("j5")
        assert stats.created == 4 and stats.execs == 4 and stats.failures == {"agent": 4}
        assert stats.states == {"running": 4}
        assert {s.node for s in stats.slowest} == set(KEYS)
        assert sorted(s.id for s in stats.slowest) == sorted(sb.id for sb in sandboxes)
        assert sum(p.created for p in stats.series) == 4
        assert {(g.value, g.failures) for g in (await fleet.jobs()).jobs} >= {("j5", 4)}
        with pytest.raises(NotFoundError):
            await fleet.job("no-such-job")
        assert await fleet.alerts() == []

        raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=cluster.app), base_url="http://gateway")
        auth = {"authorization": f"Bearer {TOKEN}"}
        async with raw:
            nodes = (await raw.get("/v1/cluster/nodes", headers=auth)).json()
            placed = {n["key"]: n["placed"] for n in nodes["nodes"]}
            assert sum(placed.values()) == 4 and all(placed.values()), placed
            assert {n["lost_at"] for n in nodes["nodes"]} == {None} and nodes["projects"] == []
            gone = KEYS[0]
            before = time.time()
            cluster.gateway.membership.apply(
                [
                    Registration(gone, f"http://node-{gone}", "default", False),
                    Registration(KEYS[1], f"http://node-{KEYS[1]}", "default", True),
                ]
            )
            nodes = (await raw.get("/v1/cluster/nodes", headers=auth)).json()
            lost = next(n for n in nodes["nodes"] if n["key"] == gone)
            assert lost["status"] == "lost" and lost["lost_at"] >= before
        alerts = await fleet.alerts()
        assert [(a.name, a.labels["node"], a.severity) for a in alerts] == [("node_lost", gone, "critical")]
        assert alerts[0].since == lost["lost_at"]
        # the figures of the node left: its own sandboxes only
        assert {s.node for s in (await fleet.job("j5")).slowest} == {KEYS[1]}


async def test_batches_and_bodies_cross_the_gateway_with_their_json_meaning(cluster: Cluster) -> None:
    """The gateway reads and writes JSON with pydantic-core (cluster/json_codec.py): a batch's specs
    reach the nodes whole (labels of any script), its keys keep their meaning (the same batch again
    gets the same sandboxes), and a body that is not JSON (NaN) or holds a number beyond a float's
    range (read as an infinity, it could only be passed on as null: a lifetime lifted) is the
    caller's mistake, the sandbox's limits unchanged."""
    headers = {"authorization": f"Bearer {TOKEN}"}
    labels = [{"job": "j6", "name": f"ñ-{i}-\u2603", "quote": 'a"b\\c'} for i in range(6)]
    batch = {
        "specs": [{"image": "busybox", "labels": lab} for lab in labels],
        "idempotency_keys": [f"j6-key-{i}" for i in range(6)],
    }
    raw = httpx.AsyncClient(transport=httpx.ASGITransport(app=cluster.app), base_url="http://gateway")
    async with raw:
        first = await raw.post("/v1/sandboxes/batch", json=batch, headers=headers)
        assert first.status_code == 200, first.text
        items = first.json()["results"]
        assert [i["sandbox"]["spec"]["labels"] for i in items] == labels
        assert {_node_of(i["sandbox"]["id"]) for i in items} == set(KEYS)
        again = await raw.post("/v1/sandboxes/batch", json=batch, headers=headers)
        assert [i["sandbox"]["id"] for i in again.json()["results"]] == [i["sandbox"]["id"] for i in items]
        sandbox_id = items[0]["sandbox"]["id"]
        for body in (b'{"count": NaN}', b'{"count": Infinity}', b'{"count": 1'):
            r = await raw.post(
                f"/v1/sandboxes/{sandbox_id}/fork", content=body, headers=headers | {"content-type": "application/json"}
            )
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_argument"), body
        lifetimes = {"labels": {"job": "j6"}, "max_lifetime": 3600, "idle_ttl": 600}
        r = await raw.post("/v1/sandboxes/lifetimes", json=lifetimes, headers=headers)
        assert r.status_code == 200, r.text
        for body in (
            b'{"labels": {"job": "j6"}, "max_lifetime": 1e400}',
            b'{"labels": {"job": "j6"}, "idle_ttl": -1e999}',
        ):
            r = await raw.post(
                "/v1/sandboxes/lifetimes", content=body, headers=headers | {"content-type": "application/json"}
            )
            assert (r.status_code, r.json()["error"]["code"]) == (400, "invalid_argument"), body
    async with cluster.client() as fleet:
        held = await fleet.list(labels={"job": "j6"})
        assert sorted(s.id for s in held) == sorted(i["sandbox"]["id"] for i in items)
        assert {(s.spec.max_lifetime, s.spec.idle_ttl) for s in held} == {(3600, 600)}
