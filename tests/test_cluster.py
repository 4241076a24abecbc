"""Cluster mode on a real Ray cluster on this machine: a head and three worker Ray nodes
(`ray start`, each its own process group, so one can be killed like a machine), three node daemons
on their own state dirs, sockets and cgroup parents, registered with `sandfleet cluster up`, and two
gateways (`sandfleet gateway`) that find them through Ray.

The tests run in file order: the last ones kill a node, then Ray's head.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxLostError,
)
from sandfleet.ids import node_of

from conftest import Daemon, destroy_daemon, make_daemon, wait_until
from leakcheck import sandbox_processes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="node daemons need root")

ADMIN = "cluster-admin-token-0123456789"
TEAM_A = "team-a-grpo-token-0123456789"
TEAM_B = "team-b-token-0123456789abcdef"
READER = "team-a-reader-token-01234567"
KEYS = ("c10001", "c10002", "c10003")
IAM = f"""
[[iam.projects]]
path = "team-a"
quota = {{ sandboxes = 6 }}
[[iam.projects]]
path = "team-a/grpo"
quota = {{ sandboxes = 4 }}
[[iam.projects]]
path = "team-b"
[[iam.tokens]]
name = "grpo"
token = "{TEAM_A}"
project = "team-a/grpo"
[[iam.tokens]]
name = "b"
token = "{TEAM_B}"
project = "team-b"
[[iam.tokens]]
name = "reader"
token = "{READER}"
project = "team-a"
role = "read-only"
"""
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
# Ray's own defaults take ~20-55 s to call a node dead; a test cluster says so within seconds.
FAST_HEALTH = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 4,
    "health_check_initial_delay_ms": 0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(args, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _killpg(p: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@dataclass
class Cluster:
    root: Path
    address: str
    head: subprocess.Popen[bytes]
    workers: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    daemons: dict[str, Daemon] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    gateways: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)

    def client(self, i: int = 0, token: str = ADMIN) -> Client:
        return Client(self.gateway_urls[i], token=token, timeout=60)

    def nodes(self, i: int = 0) -> dict[str, str]:
        r = httpx.get(f"{self.gateway_urls[i]}/v1/cluster/nodes", headers={"authorization": f"Bearer {ADMIN}"})
        return {n["key"]: n["status"] for n in r.json()["nodes"]}


def _ray_node_alive(c: Cluster, name: str) -> bool:
    code = (
        "import ray,sys; ray.init(address=sys.argv[1], logging_level=40, log_to_driver=False);"
        "print(any(n['Alive'] and n['NodeName']==sys.argv[2] for n in ray.nodes()))"
    )
    out = subprocess.run([sys.executable, "-c", code, c.address, name], env=ENV, capture_output=True, text=True)
    return out.stdout.strip().endswith("True")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    port = free_port()
    ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    assert ray, "the `ray` command (pip's `cluster` extra) is not installed"
    common = ["--block", "--disable-usage-stats", f"--object-store-memory={80 * 1024**2}"]
    head = _start(
        [ray, "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false", "--node-name=head",
         "--system-config=" + json.dumps(FAST_HEALTH), *common],
        root / "head.log",
    )  # fmt: skip
    c = Cluster(root, f"127.0.0.1:{port}", head)
    try:
        for key in KEYS:  # one at a time: Ray nodes starting together on one machine race for socket names
            c.workers[key] = _start(
                [ray, "start", f"--address={c.address}", "--num-cpus=1", f"--node-name={key}", *common],
                root / f"ray-{key}.log",
            )
            assert wait_until(lambda k=key: _ray_node_alive(c, k), timeout=90, interval=1), f"Ray node {key}"
        for key in KEYS:
            tcp = free_port()
            labels = 'node_labels = { pool = "gpu" }\n' if key == KEYS[1] else ""
            d = make_daemon(
                f"cl-{key}", f'tcp = "127.0.0.1:{tcp}"\ntoken = "{ADMIN}"\nnode_key = "{key}"\n' + labels + IAM
            )
            c.daemons[key] = d
            c.urls[key] = f"http://127.0.0.1:{tcp}"
            d.start()
            up = subprocess.run(
                [sys.executable, "-m", "sandfleet", "cluster", "up", "--address", c.address, "--config",
                 str(d.config), "--url", c.urls[key], "--ray-node", key],
                env=ENV, capture_output=True, text=True, timeout=180,
            )  # fmt: skip
            assert up.returncode == 0, up.stdout + up.stderr
            assert json.loads(up.stdout.strip().splitlines()[-1])["node"] == key
        for i in range(2):
            gport = free_port()
            cfg = root / f"gateway{i}.toml"
            cfg.write_text(
                f'listen = "127.0.0.1:{gport}"\nray_address = "{c.address}"\nnode_token = "{ADMIN}"\n'
                f'token = "{ADMIN}"\nload_interval = 0.5\n' + IAM
            )
            c.gateways.append(
                _start([sys.executable, "-m", "sandfleet", "gateway", "--config", str(cfg)], root / f"gw{i}.log")
            )
            c.gateway_urls.append(f"http://127.0.0.1:{gport}")
        for i in range(2):

            def all_alive(i: int = i) -> bool:
                try:
                    return c.nodes(i) == dict.fromkeys(KEYS, "alive")
                except (httpx.HTTPError, ValueError, KeyError):
                    return False

            assert wait_until(all_alive, timeout=120, interval=0.5), (root / f"gw{i}.log").read_text()[-3000:]
        yield c
    finally:
        for g in c.gateways:
            _killpg(g, signal.SIGTERM)
        for p in c.workers.values():
            _killpg(p)
        _killpg(head)
        parents = {key: d.cgroup_parent for key, d in c.daemons.items()}
        for key, d in c.daemons.items():
            destroy_daemon(d)
            assert not d.root.exists(), key
        for key, parent in parents.items():  # no cgroup of a sandbox outlived its node
            left = [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/{parent.strip('/')}/*") if p.is_dir()]
            assert not left and not sandbox_processes(parent), (key, left)


def test_creates_spread_over_nodes_and_every_call_works_through_either_gateway(cluster: Cluster) -> None:
    with cluster.client(0) as g0, cluster.client(1) as g1:
        made = [(g0 if i % 2 else g1).create(image="busybox", labels={"job": "spread"}) for i in range(12)]
        nodes = {node_of(sb.id) for sb in made}
        assert nodes == set(KEYS), [sb.id for sb in made]  # 12 creates over 3 empty nodes reach all 3
        for i, sb in enumerate(made[:3]):
            other = g0 if i % 2 == 0 else g1  # not the gateway that made it
            s = other.get(sb.id)
            assert s.exec("echo $((6*7))").stdout == "42\n"
            s.files.write("/tmp/note", "through a gateway")
            assert s.files.read_text("/tmp/note") == "through a gateway"
            assert any(f.name == "note" for f in s.files.list("/tmp"))
            with s.session() as sess:
                sess.run("cd /tmp && X=7")
                assert sess.run("echo $X $PWD").stdout == "7 /tmp\n"
            chunks = [e.data for e in s.exec_stream("for i in 1 2 3; do echo $i; done") if e.type == "stdout"]
            assert "".join(chunks) == "1\n2\n3\n"
            assert s.usage().pids >= 1
            assert s.events()
            with s.terminal("sh", rows=31, cols=97) as t:  # the WebSocket relayed to its node
                t.send("stty size\r")
                t.expect(b"31 97\r\n")
                t.resize(20, 60)
                t.send("stty size; exit 4\r")
                t.expect(b"20 60\r\n")
                assert t.wait(10).exit_code == 4
        # pause and resume, snapshot and fork: on the sandbox's own node, through the other gateway
        s = g1.get(made[0].id)
        s.pause()
        assert g0.get(s.id).info.state == "paused"
        s.resume()
        snap = s.snapshot()
        assert node_of(snap.id) == node_of(s.id)
        forks = s.fork(2)
        assert all(node_of(f.id) == node_of(s.id) for f in forks)
        restored = g0.restore(snap.id, 1)
        assert node_of(restored[0].id) == node_of(s.id)
        assert {x.id for x in g0.snapshots()} >= {snap.id}
        # list through either gateway sees all; job-level stop by label stops them on every node
        listed0 = {x.id for x in g0.list(labels={"job": "spread"})}
        listed1 = {x.id for x in g1.list(labels={"job": "spread"})}
        assert {sb.id for sb in made} <= listed0 and listed0 == listed1
        # pages of the merged list (the console's): newest first, every sandbox once, across nodes
        paged: list[str] = []
        cursor = None
        with httpx.Client(base_url=cluster.gateway_urls[0], headers={"authorization": f"Bearer {ADMIN}"}) as raw:
            while True:
                params = {"label": "job=spread", "limit": "5", **({"after": cursor} if cursor else {})}
                page = raw.get("/v1/sandboxes", params=params).json()
                paged += [x["id"] for x in page["sandboxes"]]
                assert page["total"] == len(listed0)
                if (cursor := page["next"]) is None:
                    break
            assert paged == [x.id for x in sorted(g0.list(labels={"job": "spread"}), key=lambda x: -x.created_at)]
            assert raw.get("/v1/whoami").json()["can_write"] is True
            assert raw.get("/console/").status_code in (200, 503)  # the console's page (503: not vendored)
        assert set(g1.pause_many(labels={"job": "spread"})) >= {sb.id for sb in made[3:6]}
        assert set(g0.resume_many(labels={"job": "spread"})) >= {sb.id for sb in made[3:6]}
        stopped = g1.stop_many(labels={"job": "spread"})
        assert {sb.id for sb in made} <= set(stopped)
        for f in [*forks, *restored]:
            f.stop()
        g0.delete_snapshot(snap.id)
        assert not g0.list(labels={"job": "spread"})


def test_batch_and_trajectory_through_gateways(cluster: Cluster) -> None:
    with cluster.client(0) as g0, cluster.client(1) as g1:
        batch = g0.create_many([SandboxSpec(image="busybox", labels={"job": "batch"}) for _ in range(9)])
        assert all(not isinstance(b, SandboxError) for b in batch), batch
        assert len({node_of(b.id) for b in batch if not isinstance(b, SandboxError)}) >= 2
        assert len(g1.stop_many(labels={"job": "batch"})) == 9
        t = g0.trajectory("cluster-rollout-1", SandboxSpec(image="busybox"), seed=3)
        r = t.exec("echo step0")
        again = g1.get_trajectory("cluster-rollout-1")  # found by the other gateway
        assert again.sandbox.id == t.sandbox.id and r.stdout == "step0\n"
        assert again.exec("echo step0").stdout == "step0\n"  # a restarted trainer's replay, from the log
        assert again.exec("echo step1").stdout == "step1\n"
        assert [s.step for s in g1.get_trajectory("cluster-rollout-1").steps()] == [0, 1]
        t.close()
        t.delete()


def test_a_ray_trainer_finds_the_gateways_through_ray(cluster: Cluster) -> None:
    """What a trainer's driver (or any Ray task) does: no address of ours passed around."""
    code = (
        "import json, sys, ray, sandfleet.ray\n"
        "ray.init(address=sys.argv[1], logging_level=40, log_to_driver=False)\n"
        "print(json.dumps(sorted(sandfleet.ray.gateways())))\n"
        "with sandfleet.ray.connect(token=sys.argv[2]) as fleet, fleet.create(image='busybox') as sb:\n"
        "    print(sb.exec('echo via-ray').stdout.strip(), sb.id)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, cluster.address, ADMIN], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    urls, result = out.stdout.strip().splitlines()[-2:]
    assert json.loads(urls) == sorted(cluster.gateway_urls)
    word, sandbox_id = result.split()
    assert word == "via-ray" and node_of(sandbox_id) in KEYS


def test_projects_quotas_and_tokens_hold_across_the_cluster(cluster: Cluster) -> None:
    with cluster.client(0, TEAM_A) as a0, cluster.client(1, TEAM_A) as a1, cluster.client(1, TEAM_B) as b:
        mine = [(a0 if i % 2 else a1).create(image="busybox", labels={"job": "quota"}) for i in range(4)]
        assert {sb.info.spec.project for sb in mine} == {"team-a/grpo"}
        with pytest.raises(ResourceExhaustedError, match="team-a/grpo"):
            a0.create(image="busybox", timeout=3)
        # B sees none of A's, and cannot touch them (not found, not "forbidden": ids do not leak)
        assert not [x for x in b.list() if x.spec.project != "team-b"]
        with pytest.raises(NotFoundError):
            b.get(mine[0].id)
        with pytest.raises(NotFoundError):
            httpx_stop(cluster, mine[1].id, TEAM_B)
        with pytest.raises(PermissionDeniedError):
            b.create(image="busybox", project="team-a/grpo")
        with cluster.client(0, READER) as ro:
            assert {x.id for x in ro.list(labels={"job": "quota"})} == {sb.id for sb in mine}
            with pytest.raises(PermissionDeniedError):
                ro.create(image="busybox")
            with pytest.raises(PermissionDeniedError):  # a terminal acts: refused by the node, through the gateway
                ro.get(mine[0].id).terminal("sh")
            with pytest.raises(PermissionDeniedError):
                ro.get(mine[0].id).stop()
        sb_b = b.create(image="busybox")
        assert sb_b.info.spec.project == "team-b"
    with cluster.client(1) as admin:  # job-level calls by project, across the nodes
        assert {x.id for x in admin.list(project="team-a")} == {sb.id for sb in mine}
        assert set(admin.pause_many(project="team-a/grpo")) == {sb.id for sb in mine}
        assert set(admin.resume_many(project="team-a")) == {sb.id for sb in mine}
        assert set(admin.stop_many(project="team-a")) == {sb.id for sb in mine}
        assert admin.stop_many(project="team-b") == [sb_b.id]


def httpx_stop(cluster: Cluster, sandbox_id: str, token: str) -> None:
    with Client(cluster.gateway_urls[0], token=token) as c:
        c.get(sandbox_id).stop()


def test_gateway_answers_bad_input_with_typed_errors_and_serves_node_wide_calls(cluster: Cluster) -> None:
    url = cluster.gateway_urls[0]
    auth = {"authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=url, timeout=30) as http:
        cases = [
            (http.post("/v1/sandboxes", json={"image": "busybox"}), 401, "unauthenticated"),
            (http.post("/v1/sandboxes", headers=auth, content=b"{not json"), 400, "invalid_argument"),
            (http.post("/v1/sandboxes", headers=auth, json={"resources": {"cpu": -1}}), 400, "invalid_argument"),
            (http.post("/v1/sandboxes", headers=auth, json={"backend": "nope"}), 400, "invalid_argument"),
            (http.get("/v1/sandboxes/sb-ffffff0123456789", headers=auth), 404, "not_found"),
            (http.get("/v1/sandboxes/not-an-id/usage", headers=auth), 404, "not_found"),
            (http.get("/v1/snapshots/snap-ffffff0123456789", headers=auth), 404, "not_found"),
            (http.get("/v1/no/such/route", headers=auth), 404, "not_found"),
            (http.get("/v1/audit/follow", headers=auth), 400, "unsupported"),
            (http.post("/v1/cluster/nodes/c10001/drain", headers={"authorization": f"Bearer {TEAM_A}"}), 403,
             "permission_denied"),
        ]  # fmt: skip
        for r, status, code in cases:
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), (r.request.url, r.text)
    with cluster.client(1) as g:
        health = g.health()
        assert health["status"] == "ok" and "container" in health["tiers"]
        assert any(i.name == "busybox" for i in g.images())
        sb = g.create(image="busybox")
        sb.exec("true")
        records = g.audit(sandbox_id=sb.id).records
        assert records and all(r.sandbox_id == sb.id for r in records)
        assert g.audit(limit=50).records
        sb.stop()


def test_a_node_selector_places_on_the_nodes_carrying_its_labels(cluster: Cluster) -> None:
    with cluster.client(0) as g:
        made = g.create_many([SandboxSpec(image="busybox", node_selector={"pool": "gpu"}) for _ in range(3)])
        made.append(g.create(image="busybox", node_selector={"pool": "gpu"}))
        assert {node_of(sb.id) for sb in made if not isinstance(sb, SandboxError)} == {KEYS[1]}, made
        with pytest.raises(InvalidArgumentError, match="pool=tpu"):
            g.create(image="busybox", node_selector={"pool": "tpu"})
        for sb in made:
            assert not isinstance(sb, SandboxError)
            sb.stop()
    with Client(cluster.daemons[KEYS[0]].socket) as direct, pytest.raises(InvalidArgumentError, match="pool=gpu"):
        direct.create(image="busybox", node_selector={"pool": "gpu"})  # the node has the last word


def test_a_drained_node_takes_no_creates(cluster: Cluster) -> None:
    key = KEYS[0]
    r = httpx.post(
        f"{cluster.gateway_urls[0]}/v1/cluster/nodes/{key}/drain",
        json={"draining": True},
        headers={"authorization": f"Bearer {ADMIN}"},
    )
    assert r.status_code == 200 and r.json()["draining"] is True
    try:
        assert wait_until(lambda: cluster.nodes(1).get(key) == "draining", timeout=10)
        with cluster.client(1) as g:
            made = [g.create(image="busybox", labels={"job": "drain"}) for _ in range(8)]
            assert key not in {node_of(sb.id) for sb in made}
            g.stop_many(labels={"job": "drain"})
    finally:
        with Client(cluster.daemons[key].socket) as direct:
            direct.drain(False)


def test_a_killed_node_is_lost_and_creates_avoid_it(cluster: Cluster) -> None:
    victim = KEYS[2]
    with cluster.client(0) as g0, cluster.client(1) as g1:
        made = [g0.create(image="busybox", labels={"job": "kill"}) for _ in range(9)]
        on_victim = [sb for sb in made if node_of(sb.id) == victim]
        assert on_victim
        _killpg(cluster.workers[victim])  # the machine dies: its Ray node and its daemon
        cluster.daemons[victim].kill()
        for i in range(2):
            assert wait_until(lambda i=i: cluster.nodes(i).get(victim) == "lost", timeout=60, interval=0.5)
        for g in (g0, g1):
            with pytest.raises(SandboxLostError) as info:
                g.get(on_victim[0].id).exec("true")
            assert info.value.cause == "infra" and not info.value.retryable
        again = [g1.create(image="busybox", labels={"job": "kill"}) for _ in range(6)]
        assert victim not in {node_of(sb.id) for sb in again}
        others = [sb for sb in made if node_of(sb.id) != victim] + again
        stopped = set(g0.stop_many(labels={"job": "kill"}))
        assert {sb.id for sb in others} <= stopped
    # the dead machine's daemon, started again, cleans up after itself (the fixture stops the rest)
    cluster.daemons[victim].start()


def test_gateways_keep_serving_when_rays_head_dies(cluster: Cluster) -> None:
    with cluster.client(0) as g0, cluster.client(1) as g1:
        made = [g0.create(image="busybox", labels={"job": "headless"}) for _ in range(4)]
        _killpg(cluster.head)
        time.sleep(3)  # the watchers lose Ray
        for sb in made:
            for g in (g0, g1):
                assert g.get(sb.id).exec("echo alive").stdout == "alive\n"
        late = g1.create(image="busybox", labels={"job": "headless"})  # placement on the membership known
        assert node_of(late.id) in KEYS[:2]
        assert len(g0.stop_many(labels={"job": "headless"})) == 5
