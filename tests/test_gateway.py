"""A gateway over real node daemons, without Ray: two daemons (TCP, a token, node keys, a short claim
window) and one `sandfleet gateway` over a fixed `nodes` list, under the conditions the cluster
tests do not reach cheaply: every connection to a node held by callers' long calls, answers too
large to pass through whole, a node that hangs (SIGSTOP: it accepts connections and never answers),
a trajectory held by two nodes, a keyed create retried at its project's quota.

The gateway-to-node path is the one a Ray-discovered cluster uses (tests/test_cluster.py runs
that, with Ray, under faults).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.ids import node_of

from conftest import Daemon, destroy_daemon, make_daemon, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="node daemons need root")

ADMIN = "gateway-test-admin-token-0123456789"
KEYS = ("d10001", "d10002")
CLAIM_WINDOW = 4
CONNECTIONS = 4  # per node, for callers' calls: small, so a test can hold them all
# Quotas the gateway enforces and the nodes do not ("qa"), and the other way round ("qb"): each side
# of a keyed create retried at its quota, on its own.
PROJECTS = '[[iam.projects]]\npath = "qa"\n{qa}[[iam.projects]]\npath = "qb"\n{qb}'
ONE = "quota = { sandboxes = 1 }\n"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Setup:
    daemons: dict[str, Daemon]
    urls: dict[str, str]
    gateway: str
    process: subprocess.Popen[bytes]
    log: Path

    def nodes(self) -> dict[str, str]:
        r = httpx.get(f"{self.gateway}/v1/cluster/nodes", headers=AUTH, timeout=10)
        return {n["key"]: n["status"] for n in r.json()["nodes"]}

    def direct(self, key: str) -> Client:
        return Client(self.daemons[key].socket, timeout=60)

    def state(self, sandbox_id: str) -> str | None:
        """A sandbox's state as its node says (over the node's own socket: no gateway in the way)."""
        with self.direct(node_of(sandbox_id) or "") as c:
            found = [s for s in c.list() if s.id == sandbox_id]
            return found[0].state if found else None


AUTH = {"authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    root = tmp_path_factory.mktemp("gateway")
    daemons: dict[str, Daemon] = {}
    urls: dict[str, str] = {}
    process = None
    try:
        for i, key in enumerate(KEYS):
            port = _free_port()
            d = make_daemon(
                f"gw-{key}",
                f'tcp = "127.0.0.1:{port}"\ntoken = "{ADMIN}"\nnode_key = "{key}"\nclaim_window = {CLAIM_WINDOW}\n'
                f'node_labels = {{ pool = "p{i}" }}\n' + PROJECTS.format(qa="", qb=ONE),
            )
            daemons[key], urls[key] = d, f"http://127.0.0.1:{port}"
            d.start()
        listen = f"127.0.0.1:{_free_port()}"
        nodes = "".join(f'[[nodes]]\nkey = "{k}"\nurl = "{u}"\n' for k, u in urls.items())
        cfg = root / "gateway.toml"
        cfg.write_text(
            f'listen = "{listen}"\nnode_token = "{ADMIN}"\ntoken = "{ADMIN}"\nload_interval = 0.5\n'
            f"node_connections = {CONNECTIONS}\n" + nodes + PROJECTS.format(qa=ONE, qb="")
        )
        log = root / "gateway.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "sandfleet", "gateway", "--config", str(cfg)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        s = Setup(daemons, urls, f"http://{listen}", process, log)

        def alive() -> bool:
            try:
                return s.nodes() == dict.fromkeys(KEYS, "alive")
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        assert wait_until(alive, timeout=60, interval=0.2), log.read_text()[-3000:]
        yield s
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        for d in daemons.values():
            with_cont(d)
            destroy_daemon(d)


def with_cont(d: Daemon) -> None:
    """A daemon a test stopped (SIGSTOP) runs again."""
    if d.process.started and d.process.alive():
        os.kill(d.pid, signal.SIGCONT)


def clean(setup: Setup) -> None:
    """Every sandbox of every node stopped (each test leaves the nodes as it found them)."""
    for key in KEYS:
        with setup.direct(key) as c:
            for sb in c.list():
                c.get(sb.id).stop()


def live_ids(setup: Setup) -> list[str]:
    """The sandboxes the nodes hold, as they say."""
    out = []
    for key in KEYS:
        with setup.direct(key) as c:
            out += [sb.id for sb in c.list()]
    return out


def gw(setup: Setup, timeout: float = 60) -> httpx.Client:
    return httpx.Client(base_url=setup.gateway, headers=AUTH, timeout=timeout)


@pytest.mark.slow
def test_acks_and_load_reads_get_through_while_callers_hold_every_connection(setup: Setup) -> None:
    """Long calls (exec streams here; long execs, verifications waiting their turn) hold every
    connection the gateway keeps to a node. A create answered meanwhile is still acknowledged (not
    reaped after the claim window as one nobody heard of), and the node still reads as alive."""
    on_a = {"image": "busybox", "node_selector": {"pool": "p0"}}

    async def run() -> tuple[str, list[str]]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=setup.gateway, headers=AUTH, timeout=120, limits=limits) as http:
            sb = (await http.post("/v1/sandboxes", json=on_a)).json()["id"]

            async def hold(command: str) -> None:
                async with http.stream("POST", f"/v1/sandboxes/{sb}/exec/stream", json={"command": command}) as r:
                    async for _ in r.aiter_raw():
                        pass

            # Every connection to the node busy: one call ending soon, the others for the whole test.
            holding = [asyncio.create_task(hold("sleep 3"))]
            holding += [asyncio.create_task(hold("sleep 60")) for _ in range(CONNECTIONS - 1)]
            await asyncio.sleep(1.5)
            # The create waits for the short call's connection; another long call queues behind it and
            # takes that connection when the create's answer comes back: then the ack is sent.
            create = asyncio.create_task(http.post("/v1/sandboxes", json=on_a))
            await asyncio.sleep(0.5)
            holding.append(asyncio.create_task(hold("sleep 60")))
            made = (await create).json()["id"]
            seen = []
            for _ in range(CLAIM_WINDOW + 4):  # past the claim window and a reaper sweep
                await asyncio.sleep(1)
                seen.append((await asyncio.to_thread(setup.nodes))[KEYS[0]])
            for t in holding:
                t.cancel()
            await asyncio.gather(*holding, return_exceptions=True)
            return made, seen

    made, seen = asyncio.run(run())
    try:
        assert node_of(made) == KEYS[0]
        # Load reads were not starved, and the create was acknowledged (not reaped).
        assert (set(seen), setup.state(made)) == ({"alive"}, "running"), (seen, setup.log.read_text()[-2000:])
    finally:
        clean(setup)


@pytest.mark.slow
def test_forked_children_are_acknowledged_however_large_the_answer(setup: Setup) -> None:
    """A fork's children each carry the parent's spec (env up to 32 KiB, 64 labels): 24 of them pass
    1 MiB, which the gateway streams on instead of reading. It still acknowledges them: none is
    reaped after the claim window."""
    env = {"A": "x" * 16000, "B": "y" * 16000}
    labels = {f"l{i:02d}": "v" * 256 for i in range(60)}
    with gw(setup) as http:
        parent = http.post("/v1/sandboxes", json={"image": "busybox", "env": env, "labels": labels}).json()["id"]
        r = http.post(f"/v1/sandboxes/{parent}/fork", json={"count": 24})
        assert r.status_code == 200 and len(r.content) > 1024**2, (r.status_code, len(r.content))
        children = [i["sandbox"]["id"] for i in r.json()["results"]]
        assert len(children) == 24
    try:
        time.sleep(CLAIM_WINDOW + 3)
        states = {setup.state(c) for c in children}
        assert states == {"running"}, states
    finally:
        clean(setup)


def test_a_hung_node_costs_lookups_seconds_and_never_a_second_trajectory(setup: Setup) -> None:
    """A node's daemon hangs (SIGSTOP: its socket still accepts, nothing answers). A retried create
    (which asks every node for its key) is placed within seconds, not after a 300 s read timeout;
    a new trajectory is refused `unavailable` within seconds (the silent node may hold that id: it is
    never opened a second time elsewhere), and once the node answers again it opens."""
    silent = setup.daemons[KEYS[1]]
    on_a = {"image": "busybox", "node_selector": {"pool": "p0"}}
    trajectory = {"id": f"hung-{secrets.token_hex(4)}", "spec": on_a}
    os.kill(silent.pid, signal.SIGSTOP)
    try:
        with gw(setup, timeout=30) as http:
            for phase in ("just silent", "unreachable"):
                if phase == "unreachable":
                    assert wait_until(lambda: setup.nodes()[KEYS[1]] == "unreachable", timeout=30)
                t0 = time.monotonic()
                retry = {"idempotency-key": secrets.token_hex(8), "x-sandfleet-retry": "1"}
                r = http.post("/v1/sandboxes", json=on_a, headers=retry)
                took = time.monotonic() - t0
                assert r.status_code == 201 and took < 12, (phase, r.status_code, took)
                t0 = time.monotonic()
                r = http.post("/v1/trajectories", json=trajectory)
                took = time.monotonic() - t0
                assert (r.status_code, r.json()["error"]["code"]) == (503, "unavailable"), (phase, r.text)
                assert KEYS[1] in r.json()["error"]["message"] and took < 12, (phase, took)
        with setup.direct(KEYS[0]) as c:
            assert not c.trajectories()  # nothing opened while the silent node could hold it
    finally:
        os.kill(silent.pid, signal.SIGCONT)
    try:
        assert wait_until(lambda: setup.nodes()[KEYS[1]] == "alive", timeout=30)
        with gw(setup) as http:
            r = http.post("/v1/trajectories", json=trajectory)
            assert r.status_code == 200 and r.json()["state"] == "open", r.text
            assert http.delete(f"/v1/trajectories/{trajectory['id']}").status_code < 300
    finally:
        clean(setup)


def test_a_trajectory_two_nodes_answer_for_goes_to_the_live_copy_or_is_refused(setup: Setup) -> None:
    """Two nodes hold a trajectory of one id (a node fenced after the cluster gave it up, whose stale
    copy is back, and the copy opened elsewhere meanwhile): the gateway never picks one silently.
    Both with a live sandbox: `sandbox_lost`, naming both; one whose sandbox stopped: the other."""
    tid = f"twice-{secrets.token_hex(4)}"
    made = {}
    for key in KEYS:
        with setup.direct(key) as c:
            made[key] = c.trajectory(tid, SandboxSpec(image="busybox")).sandbox
    try:
        with gw(setup) as http:
            r = http.get(f"/v1/trajectories/{tid}")
            assert (r.status_code, r.json()["error"]["code"]) == (410, "sandbox_lost"), r.text
            assert all(key in r.json()["error"]["message"] for key in KEYS)
            with setup.direct(KEYS[0]) as c:
                c.get(made[KEYS[0]].id).stop()  # the stale copy's sandbox, as fencing stops it
            r = http.get(f"/v1/trajectories/{tid}")
            assert r.status_code == 200 and r.json()["sandbox_id"] == made[KEYS[1]].id, r.text
        with Client(setup.gateway, token=ADMIN) as fleet:
            t = fleet.get_trajectory(tid)
            assert t.sandbox is not None and t.sandbox.id == made[KEYS[1]].id
            assert t.exec("echo hi").stdout == "hi\n"
    finally:
        for key in KEYS:
            with setup.direct(key) as c:
                c.get_trajectory(tid).delete()
        clean(setup)


def test_a_keyed_create_retried_at_its_quota_gets_what_its_key_made(setup: Setup) -> None:
    """Project qa is at its quota (the gateway's; the nodes count none for it). A create, a batch item
    and a fork retried with a key a node already holds take no new share: each gets what its key
    made, whichever gateway placed it first (here: made on a node directly), marked or not."""
    spec = {"image": "busybox", "project": "qa", "labels": {"job": "quota"}}
    key = secrets.token_hex(8)
    with gw(setup) as http, setup.direct(KEYS[1]) as b:
        first = http.post("/v1/sandboxes", json=spec, headers={"idempotency-key": key}).json()["id"]
        elsewhere = b.create(SandboxSpec.model_validate(spec), idempotency_key=f"{key}-b")  # another gateway's
        forks = [f.id for f in b.get(elsewhere.id).fork(1, idempotency_key=f"{key}-f")]
        assert wait_until(lambda: http.post("/v1/sandboxes", json=spec).status_code == 429, timeout=10)
        try:
            for headers, made in (
                ({"idempotency-key": key, "x-sandfleet-retry": "1"}, first),  # its answer lost here
                ({"idempotency-key": f"{key}-b"}, elsewhere.id),  # a restarted trainer's, unmarked
            ):
                r = http.post("/v1/sandboxes", json=spec, headers=headers)
                assert (r.status_code, r.json().get("id")) == (201, made), r.text
            batch = {"specs": [spec, spec], "idempotency_keys": [key, f"{key}-new"]}
            items = http.post("/v1/sandboxes/batch", json=batch).json()["results"]
            assert items[0].get("sandbox", {}).get("id") == first, items
            assert items[1]["error"]["code"] == "resource_exhausted"  # a new one: over the quota
            r = http.post(f"/v1/sandboxes/{elsewhere.id}/fork", json={"count": 1, "idempotency_key": f"{key}-f"})
            assert r.status_code == 200 and [i["sandbox"]["id"] for i in r.json()["results"]] == forks, r.text
        finally:
            clean(setup)


def test_a_keyed_create_its_node_refuses_is_not_placed_elsewhere(setup: Setup) -> None:
    """The node a keyed create went to refuses its retry (here: the node's own quota for qb, which it
    checked before the key in older nodes). The gateway must not place it on another node: that
    would make a second sandbox for one key. The retry gets the sandbox or the refusal."""
    spec = {"image": "busybox", "project": "qb"}
    key = secrets.token_hex(8)
    with gw(setup) as http:
        first = http.post("/v1/sandboxes", json=spec, headers={"idempotency-key": key}).json()["id"]
        try:
            r = http.post("/v1/sandboxes", json=spec, headers={"idempotency-key": key, "x-sandfleet-retry": "1"})
            assert r.json().get("id") == first or r.json()["error"]["code"] == "resource_exhausted", r.text
            assert live_ids(setup) == [first]
        finally:
            clean(setup)


def test_e2b_programs_run_through_the_gateway(setup: Setup) -> None:
    """`sandfleet e2b` over the gateway instead of one node: E2B's SDK creates sandboxes placed on
    both nodes, runs commands (followed, fed stdin), files and code in each, lists and kills them:
    every call reaches the node holding its sandbox, so an E2B program scales out unchanged."""
    e2b = pytest.importorskip("e2b")
    code_interpreter = pytest.importorskip("e2b_code_interpreter")
    from sandfleet.e2b import TEMPLATE_RECIPES

    for key in KEYS:  # E2B's templates on each node (cache hits of the shared store after the first)
        with Client(setup.daemons[key].socket, timeout=900) as c:
            for recipe in TEMPLATE_RECIPES:
                c.build_recipe(recipe)
    listen = f"127.0.0.1:{_free_port()}"
    layer = subprocess.Popen(
        [sys.executable, "-m", "sandfleet", "e2b", "--upstream", setup.gateway, "--listen", listen]
    )
    opts = {"api_key": ADMIN, "api_url": f"http://{listen}", "sandbox_url": f"http://{listen}"}
    made = []
    try:

        def up() -> bool:
            try:
                return httpx.get(f"http://{listen}/templates", headers={"x-api-key": ADMIN}).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=30)
        for _ in range(4):  # the gateway spreads them over its two nodes
            made.append(code_interpreter.Sandbox.create(timeout=120, metadata={"via": "gateway"}, **opts))
        assert {node_of(s.sandbox_id) for s in made} == set(KEYS)
        for s in made:
            s.files.write("who.txt", s.sandbox_id)
            cat = s.commands.run("cat", background=True, stdin=True)
            s.commands.send_stdin(cat.pid, "fed\n")
            s.commands.close_stdin(cat.pid)
            assert cat.wait().stdout == "fed\n"
            assert s.commands.run("cat who.txt; whoami").stdout == f"{s.sandbox_id}user\n"
            assert s.run_code("open('who.txt').read()").text == s.sandbox_id
        listed = e2b.Sandbox.list(query=e2b.SandboxQuery(metadata={"via": "gateway"}), **opts).next_items()
        assert sorted(i.sandbox_id for i in listed) == sorted(s.sandbox_id for s in made)
    finally:
        for s in made:
            s.kill()
        layer.terminate()
        layer.wait(15)
    assert not live_ids(setup)
