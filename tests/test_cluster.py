"""Cluster mode on a real Ray cluster on this machine: a head and three worker Ray nodes
(`ray start`, each its own process group, so one can be killed like a machine), three node daemons
on their own state dirs, sockets and cgroup parents, registered with `sandfleet cluster up`, and two
gateways (`sandfleet gateway`) that find them through Ray.

The tests run in file order: an early one cuts a node off from Ray (and brings it back, fenced,
early enough for the node's re-registration grace to be over when it is killed); the last ones kill
a node's daemon, a gateway (and bring each back), a node (and bring it back), then Ray's head.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from sandfleet import AsyncClient, Client, SandboxSpec
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxLostError,
    UnavailableError,
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
SPEC = Path(__file__).resolve().parent.parent / "docs" / "openapi.json"
ENV = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled")
RAY_COMMON = ["--block", "--disable-usage-stats", f"--object-store-memory={80 * 1024**2}"]
# Seconds a node keeps a sandbox whose create answer reached no caller (a gateway died): short here.
CLAIM_WINDOW = 6
# Seconds a node's daemon may be dead (its Ray node alive) before the cluster gives it up: longer than
# a test that kills a daemon and starts it again keeps it down.
LOST_AFTER = 15
AUTH = {"authorization": f"Bearer {ADMIN}"}
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
    ray: str = "ray"
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

    def start_worker(self, key: str) -> None:
        """The Ray node of machine `key` (again, after it was killed)."""
        self.workers[key] = _start(
            [self.ray, "start", f"--address={self.address}", "--num-cpus=1", f"--node-name={key}", *RAY_COMMON],
            self.root / f"ray-{key}.log",
        )
        assert wait_until(lambda: _ray_node_alive(self, key), timeout=90, interval=1), f"Ray node {key}"

    def cluster_up(self, key: str) -> dict[str, object]:
        """`sandfleet cluster up` for node `key`: its last line (node, generation, ...)."""
        up = subprocess.run(
            [sys.executable, "-m", "sandfleet", "cluster", "up", "--address", self.address, "--config",
             str(self.daemons[key].config), "--url", self.urls[key], "--ray-node", key],
            env=ENV, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert up.returncode == 0, up.stdout + up.stderr
        line: dict[str, object] = json.loads(up.stdout.strip().splitlines()[-1])
        assert line["node"] == key
        return line

    def start_gateway(self, i: int) -> None:
        """Gateway `i` (again, on the same port, after it was killed)."""
        cfg = self.root / f"gateway{i}.toml"
        if not cfg.exists():
            cfg.write_text(
                f'listen = "127.0.0.1:{free_port()}"\nray_address = "{self.address}"\nnode_token = "{ADMIN}"\n'
                f'token = "{ADMIN}"\nload_interval = 0.5\nlost_after = {LOST_AFTER}\n' + IAM
            )
        process = _start([sys.executable, "-m", "sandfleet", "gateway", "--config", str(cfg)], self.root / f"gw{i}.log")
        url = "http://" + tomllib.loads(cfg.read_text())["listen"]
        if i < len(self.gateways):
            self.gateways[i] = process
        else:
            self.gateways.append(process)
            self.gateway_urls.append(url)

    def wait_alive(self, i: int, keys: tuple[str, ...] = KEYS) -> None:
        def all_alive() -> bool:
            try:
                return self.nodes(i) == dict.fromkeys(keys, "alive")
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        assert wait_until(all_alive, timeout=120, interval=0.5), (self.root / f"gw{i}.log").read_text()[-3000:]


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
    head = _start(
        [ray, "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false", "--node-name=head",
         "--system-config=" + json.dumps(FAST_HEALTH), *RAY_COMMON],
        root / "head.log",
    )  # fmt: skip
    c = Cluster(root, f"127.0.0.1:{port}", head, ray)
    try:
        for key in KEYS:  # one at a time: Ray nodes starting together on one machine race for socket names
            c.start_worker(key)
        for key in KEYS:
            tcp = free_port()
            labels = 'node_labels = { pool = "gpu" }\n' if key == KEYS[1] else ""
            d = make_daemon(
                f"cl-{key}",
                f'tcp = "127.0.0.1:{tcp}"\ntoken = "{ADMIN}"\nnode_key = "{key}"\nclaim_window = {CLAIM_WINDOW}\n'
                + labels
                + IAM,
            )
            c.daemons[key] = d
            c.urls[key] = f"http://127.0.0.1:{tcp}"
            d.start()
            assert c.cluster_up(key).get("generation", 0) == 0
        for i in range(2):
            c.start_gateway(i)
        for i in range(2):
            c.wait_alive(i)
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


def test_a_node_lost_in_a_partition_is_fenced_when_it_rejoins(cluster: Cluster) -> None:
    """A node's Ray node goes (cut off from Ray's head) while its daemon runs on: the cluster calls it
    lost and its callers hear `sandbox_lost`. Back in the cluster, it serves none of what it held."""
    victim = KEYS[2]
    trajectory = f"fenced-{secrets.token_hex(4)}"
    with cluster.client(0, TEAM_B) as g:
        made = []
        while victim not in {node_of(sb.id) for sb in made}:
            made.append(g.create(image="busybox", labels={"job": "fence"}))
        on_victim = {sb.id for sb in made if node_of(sb.id) == victim}
        g.trajectory(trajectory, sandbox_id=next(iter(on_victim)))
        _killpg(cluster.workers[victim])
        for i in range(2):
            assert wait_until(lambda i=i: cluster.nodes(i).get(victim) == "lost", timeout=60, interval=0.5)
        with pytest.raises(SandboxLostError):
            g.get(next(iter(on_victim))).exec("true")
        with pytest.raises(SandboxLostError):
            g.get_trajectory(trajectory)
        with httpx.Client(base_url=cluster.gateway_urls[0], headers={"authorization": f"Bearer {TEAM_A}"}) as a:
            # What the gateway remembers of B's trajectory is B's: to A it is an id like any unused one.
            answers = [a.get(f"/v1/trajectories/{t}") for t in (trajectory, f"fenced-{secrets.token_hex(4)}")]
            assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(404, "not_found")] * 2
        with Client(cluster.daemons[victim].socket) as direct:
            assert {x.id for x in direct.list(labels={"job": "fence"})} == on_victim  # still running there
            before = direct.node_load().generation
            cluster.start_worker(victim)
            assert cluster.cluster_up(victim)["generation"] == before + 1
            assert not direct.list(labels={"job": "fence"})  # fenced: what callers were told is lost, stopped
            assert direct.node_load().generation == before + 1
        for i in range(2):
            cluster.wait_alive(i)
        for sandbox_id in on_victim:
            with pytest.raises(NotFoundError):
                g.get(sandbox_id).exec("true")
        assert set(g.stop_many(labels={"job": "fence"})) == {sb.id for sb in made} - on_victim
        with pytest.raises(NotFoundError):  # its log set aside by the fence: no node answers for it
            g.get_trajectory(trajectory)


def test_a_ray_trainer_finds_the_gateways_through_ray(cluster: Cluster) -> None:
    """What a trainer's driver (or any Ray task) does: no address of ours passed around."""
    code = (
        "import json, sys, ray, sandfleet.ray\n"
        "ray.init(address=sys.argv[1], logging_level=40, log_to_driver=False)\n"
        "print(json.dumps(sorted(sandfleet.ray.gateways())))\n"
        "with sandfleet.ray.connect(token=sys.argv[2]) as fleet, fleet.create(image='busybox') as sb:\n"
        "    print(json.dumps(sorted(fleet.endpoint.urls)))\n"  # every gateway: the others are fail-overs
        "    print(sb.exec('echo via-ray').stdout.strip(), sb.id)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, cluster.address, ADMIN], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    urls, known, result = out.stdout.strip().splitlines()[-3:]
    assert json.loads(urls) == json.loads(known) == sorted(cluster.gateway_urls)
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


def test_a_project_token_sees_only_what_it_may_use_of_the_cluster(cluster: Cluster) -> None:
    with cluster.client(0, TEAM_A) as a, cluster.client(0, TEAM_B) as b, cluster.client(0) as admin:
        mine = a.create(image="busybox", labels={"job": "view"})
        bkey = f"bkey-{secrets.token_hex(4)}"
        theirs = [b.create(image="busybox", labels={"job": "view"}, idempotency_key=f"{bkey}-{i}") for i in range(2)]
        assert wait_until(lambda: admin.health()["sandboxes_running"] >= 3, timeout=10)
        # Its own project's, not the cluster's (3 and more): one an earlier test of team-a stopped may
        # still be counted for a moment under load.
        assert wait_until(lambda: a.health()["sandboxes_running"] == 1, timeout=20)
        with httpx.Client(base_url=cluster.gateway_urls[0], timeout=30) as http:
            scoped = http.get("/v1/cluster/nodes", headers={"authorization": f"Bearer {TEAM_A}"}).json()
            root = http.get("/v1/cluster/nodes", headers={"authorization": f"Bearer {ADMIN}"}).json()
        assert {n["url"] for n in root["nodes"]} == set(cluster.urls.values())  # the root sees all
        shown = json.dumps(scoped)
        assert not any(url in shown for url in cluster.urls.values()), shown  # no node's address
        for node in scoped["nodes"]:
            assert set(node) == {"key", "group", "status", "load"}
            assert set(node["load"]) == {"labels", "draining", "tiers", "projects"}  # no totals, no images
            assert set(node["load"]["projects"]) <= {"team-a/grpo"}
        assert sum(n["load"]["projects"].get("team-a/grpo", {}).get("sandboxes", 0) for n in scoped["nodes"]) == 1
        assert {i.name for i in a.images()} >= {"busybox"}  # what it may create from (decided: see docs/cluster.md)
        with httpx.Client(base_url=cluster.urls[node_of(theirs[0].id)], timeout=30) as node:
            # The node's cluster-mode routes: a project's token fences no node (that would stop every
            # project's sandboxes), learns nothing of another project's keys, acknowledges nothing of theirs.
            as_a = {"authorization": f"Bearer {TEAM_A}"}
            r = node.post("/v1/node/fence", json={"generation": 99}, headers=as_a)
            assert (r.status_code, r.json()["error"]["code"]) == (403, "permission_denied")
            keys = {"keys": [{"key": f"{bkey}-0", "project": "team-b"}, {"key": f"{bkey}-0"}]}
            assert node.post("/v1/sandboxes/keys", json=keys, headers=as_a).json() == {"held": [False, False]}
            as_root = {"authorization": f"Bearer {ADMIN}"}
            assert node.post("/v1/sandboxes/keys", json=keys, headers=as_root).json() == {"held": [True, False]}
        assert b.get(theirs[0].id).info.state == "running"
        for sb in [mine, *theirs]:
            sb.stop()


# Bodies that pass validation, so each call reaches the point where the node looks the object up.
_EXEC = {"command": "cat /tmp/secret"}
BODIES: dict[tuple[str, str], dict[str, object]] = {
    ("PATCH", "/v1/sandboxes/{sandbox_id}"): {"json": {"idle_ttl": 600}},
    ("DELETE", "/v1/sandboxes/{sandbox_id}"): {"json": {"reason": "probe"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/exec"): {"json": _EXEC},
    ("POST", "/v1/sandboxes/{sandbox_id}/exec/stream"): {"json": _EXEC},
    ("POST", "/v1/sandboxes/{sandbox_id}/processes"): {"json": _EXEC},
    ("POST", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin"): {"content": b"x"},
    ("POST", "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run"): {"json": _EXEC},
    ("POST", "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run/stream"): {"json": _EXEC},
    ("POST", "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/stdin"): {"content": b"x"},
    ("POST", "/v1/sandboxes/{sandbox_id}/run"): {"json": {"code": "print(1)"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/verify"): {"json": {"command": "true"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/pack"): {"json": {"image": "probe:a"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/rollback"): {"json": {"checkpoint_id": "{checkpoint_id}"}},
    ("POST", "/v1/sandboxes/{sandbox_id}/ports"): {"json": {"port": 8080}},
    ("PUT", "/v1/sandboxes/{sandbox_id}/network"): {"json": {"network": "none"}},
    ("PUT", "/v1/sandboxes/{sandbox_id}/files/content"): {"content": b"x"},
    ("PUT", "/v1/sandboxes/{sandbox_id}/files/tar"): {"content": b"\0" * 1024},
    ("POST", "/v1/trajectories/{trajectory_id}/steps"): {"json": {"step": 0, "action": {"exec": _EXEC}}},
    ("POST", "/v1/trajectories/{trajectory_id}/verify"): {"json": {"command": "true"}},
    ("POST", "/v1/sandboxes/stop"): {"json": {"labels": {"job": "{job}"}}},
    ("POST", "/v1/sandboxes/pause"): {"json": {"labels": {"job": "{job}"}}},
    ("POST", "/v1/sandboxes/resume"): {"json": {"labels": {"job": "{job}"}}},
    ("POST", "/v1/sandboxes/lifetimes"): {"json": {"labels": {"job": "{job}"}, "idle_ttl": 600}},
    ("POST", "/v1/sandboxes/network"): {"json": {"labels": {"job": "{job}"}, "network": "none"}},
    ("POST", "/v1/sandboxes"): {"json": {"backend": "nope"}},  # A's own creates: nothing of B's to compare
    ("POST", "/v1/sandboxes/batch"): {"json": {"specs": [{"backend": "nope"}]}},
    ("POST", "/v1/trajectories"): {"json": {"id": "{trajectory_id}", "spec": {"image": "busybox"}}},
    ("GET", "/v1/sandboxes"): {"params": {"label": "job={job}", "state": "all"}},
    ("GET", "/v1/snapshots"): {"params": {"sandbox_id": "{sandbox_id}"}},
    ("GET", "/v1/audit"): {"params": {"sandbox_id": "{sandbox_id}"}},
    ("GET", "/v1/jobs"): {"params": {"label": "job={job}"}},
    ("POST", "/v1/images/build"): {"params": {"ref": "busybox"}},
    ("POST", "/v1/images/push"): {"params": {"ref": "busybox"}},
    ("DELETE", "/v1/images/{ref}"): {},
}
FILE_PARAMS = {"path": "/tmp/secret"}
GATEWAY_ONLY = [
    ("GET", "/v1/cluster/nodes"),
    ("POST", "/v1/cluster/nodes/{key}/drain"),
]


def _fill(value: object, ids: dict[str, str]) -> object:
    if isinstance(value, str):
        return value.format(**ids) if "{" in value else value
    if isinstance(value, dict):
        return {k: _fill(v, ids) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, ids) for v in value]
    return value


def test_another_projects_objects_answer_as_missing_through_every_gateway_route(cluster: Cluster) -> None:
    """Project A's token against project B's sandbox, snapshot, trajectory, session, process, labels
    and idempotency key, through every route the gateway serves (its route table, iterated: a route
    added later is covered or this fails): each answer is word for word the one for an object that
    does not exist, and no byte of B's secret is in any answer to A."""
    from starlette.routing import Match, Route

    from sandfleet.client.sync import Sandbox
    from sandfleet.cluster.config import GatewayConfig
    from sandfleet.cluster.gateway import Gateway, create_gateway_app

    secret = "b-secret-" + secrets.token_hex(8)
    tag = secrets.token_hex(4)
    with cluster.client(1, TEAM_B) as b:
        sb = b.create(image="busybox", env={"B_SECRET": secret}, labels={"job": f"b-{tag}", "note": secret})
        sb.files.write("/tmp/secret", secret)
        proc = sb.start(f"sleep 300 # {secret}")
        session = sb.session(env={"S": secret})
        assert session.run("echo $S").stdout == secret + "\n"
        snap = sb.snapshot(labels={"note": secret})
        checkpoint = sb.checkpoint(labels={"note": secret})
        traj = b.trajectory(f"b-traj-{tag}", SandboxSpec(image="busybox"), metadata={"note": secret})
        assert traj.exec(f"echo {secret}").stdout == secret + "\n"
    key = node_of(sb.id)
    theirs = {"sandbox_id": sb.id, "snapshot_id": snap.id, "trajectory_id": traj.id, "job": f"b-{tag}"}
    theirs["checkpoint_id"] = checkpoint.id
    missing = {
        "sandbox_id": f"sb-{key}{secrets.token_hex(5)}",
        "snapshot_id": f"snap-{key}{secrets.token_hex(5)}",
        "trajectory_id": f"b-traj-{secrets.token_hex(4)}",
        "job": f"b-{secrets.token_hex(4)}",
        "checkpoint_id": f"cp-{key}{secrets.token_hex(5)}",
    }
    both = {"process_id": proc.id, "session_id": session.id, "port": "8080", "path": "x", "ref": "busybox", "key": key}

    def same(text: str, ids: dict[str, str]) -> str:
        for name, value in ids.items():
            text = text.replace(value, f"<{name}>")
        return text

    calls = [(m.upper(), p) for p, ops in json.loads(SPEC.read_text())["paths"].items() for m in ops]
    calls += GATEWAY_ONLY  # node-only ones too: a gateway answers them `unsupported`, whoever asks
    calls.sort(key=lambda c: c == ("POST", "/v1/trajectories"))  # A's opens last: the missing id stays missing
    app = create_gateway_app(
        Gateway(GatewayConfig(nodes=[{"key": key, "url": "http://127.0.0.1:9"}], node_token="x", token="x"))
    )
    routes = [r for r in app.routes if isinstance(r, Route) and not r.path.startswith("/console")]
    covered: set[int] = set()
    compared = found_missing = 0
    auth = {"authorization": f"Bearer {TEAM_A}"}
    with httpx.Client(base_url=cluster.gateway_urls[0], headers=auth, timeout=120) as a:
        for method, template in calls:
            answers = []
            for ids in (theirs, missing):
                path = template.format(**(both | ids))
                scope = {
                    "type": "http",
                    "method": method,
                    "path": path,
                    "root_path": "",
                    "headers": [],
                    "query_string": b"",
                }
                matched = [r for r in routes if r.matches(scope)[0] == Match.FULL]
                assert matched, f"{method} {path}: no gateway route"
                covered.add(id(matched[0]))
                kwargs = _fill(BODIES.get((method, template), {}), both | ids)
                assert isinstance(kwargs, dict)
                if "/files" in template:
                    kwargs.setdefault("params", FILE_PARAMS)
                r = a.request(method, path, **kwargs)
                assert secret not in r.text and secret not in str(r.headers), (method, path, r.text[:500])
                answers.append((r.status_code, same(r.text, ids) if r.status_code >= 400 else ""))
            named = template + repr(BODIES.get((method, template), {}))
            # A's open of a trajectory under B's id is A's own trajectory once ids are per project on
            # the nodes (their test): here only that nothing of B's comes back.
            if any("{" + name + "}" in named for name in theirs) and (method, template) != ("POST", "/v1/trajectories"):
                assert answers[0] == answers[1], (method, template, answers)
                compared += 1
                found_missing += answers[0][0] == 404
        uncovered = [f"{sorted(r.methods or ())} {r.path}" for r in routes if id(r) not in covered]
        assert not uncovered, uncovered
        # The terminal (a WebSocket): the same refusal for B's sandbox as for one that does not exist.
        with Client(cluster.gateway_urls[0], token=TEAM_A) as a_sdk:
            refusals = []
            for sandbox_id in (sb.id, missing["sandbox_id"]):
                probe = sb.info.model_copy(update={"id": sandbox_id, "spec": SandboxSpec()})
                with pytest.raises(SandboxError) as err:
                    Sandbox(a_sdk, probe).terminal("sh")
                refusals.append((err.value.code, err.value.message.replace(sandbox_id, "<id>")))
            assert refusals[0] == refusals[1] and refusals[0][0] == "not_found", refusals
            for t in a_sdk.trajectories():
                a_sdk.get_trajectory(t.id).delete()
    assert compared >= 60 and found_missing >= 0.8 * compared, (compared, found_missing)
    with cluster.client(1, TEAM_B) as b:  # B's own objects are untouched by all of that
        assert b.get(sb.id).exec("cat /tmp/secret").stdout == secret
        assert [c.id for c in b.get(sb.id).checkpoints()] == [checkpoint.id]
        b.get_trajectory(traj.id).delete()
        b.delete_snapshot(snap.id)
        b.get(sb.id).stop()


def test_the_gateway_remembers_idempotency_keys_per_project(cluster: Cluster) -> None:
    """A key project A used is simply unused for project B: the gateway does not send B's create to
    A's node for it (where it was refused), and A's create with its key gets A's sandbox again."""
    key = "shared-" + secrets.token_hex(6)
    with cluster.client(0, TEAM_A) as a, cluster.client(0, TEAM_B) as b:
        mine = a.create(image="busybox", idempotency_key=key, node_selector={"pool": "gpu"})
        assert node_of(mine.id) == KEYS[1]
        r = httpx.post(  # A's node takes no new creates: B's must not be sent there for A's key
            f"{cluster.gateway_urls[0]}/v1/cluster/nodes/{KEYS[1]}/drain",
            json={"draining": True},
            headers={"authorization": f"Bearer {ADMIN}"},
        )
        assert r.status_code == 200
        try:
            assert wait_until(lambda: cluster.nodes(0)[KEYS[1]] == "draining", timeout=10)
            theirs = b.create(image="busybox", idempotency_key=key)
            assert node_of(theirs.id) != KEYS[1] and theirs.info.spec.project == "team-b"
            assert a.create(image="busybox", idempotency_key=key, node_selector={"pool": "gpu"}).id == mine.id
        finally:
            with Client(cluster.daemons[KEYS[1]].socket) as direct:
                direct.drain(False)
        mine.stop()
        theirs.stop()


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


def test_job_level_writes_name_the_node_they_could_not_reach(cluster: Cluster) -> None:
    """A node's daemon SIGKILLed: every write to every node (stop, pause, resume, lifetimes, network
    by label, image deletes) does its part on the others and says which node it missed, before and
    after the gateway stopped reading its load; once the daemon is back, the retry finishes."""
    victim = KEYS[0]
    small = {"cpu": 0.1, "memory": 64 * 1024**2}
    with cluster.client(0) as g:
        made = []
        while victim not in {node_of(sb.id) for sb in made} or len(made) < 6:
            made.append(g.create(image="busybox", labels={"job": "reach"}, resources=small))
        on_victim = {sb.id for sb in made if node_of(sb.id) == victim}
        cluster.daemons[victim].kill()
        writes = [
            lambda: g.set_lifetimes({"job": "reach"}, idle_ttl=3600),
            lambda: g.set_network({"job": "reach"}, "none"),
            lambda: g.pause_many(labels={"job": "reach"}),
            lambda: g.resume_many(labels={"job": "reach"}),
            lambda: g.delete_image("no-such-image:0"),
            lambda: g.stop_many(labels={"job": "reach"}),
        ]
        for write in writes[:2]:  # the gateway still reads it as alive
            with pytest.raises(UnavailableError, match=f"not on {victim}"):
                write()
        assert wait_until(lambda: cluster.nodes(0)[victim] == "unreachable", timeout=20)
        for write in writes:  # taken out of placement and reads: still not forgotten by writes
            with pytest.raises(UnavailableError, match=f"not on {victim}"):
                write()
        assert not [x for x in g.list(labels={"job": "reach"}) if x.id not in on_victim]  # the others stopped
        cluster.daemons[victim].start()  # it adopts what it held: the stop is not done until it stops them
        cluster.wait_alive(0)
        assert set(g.stop_many(labels={"job": "reach"})) == on_victim
        assert not g.list(labels={"job": "reach"})


def test_a_node_whose_daemon_died_is_lost_and_new_trajectories_open_again(cluster: Cluster) -> None:
    """A node's daemon dies while its Ray node lives on. While the node may hold a trajectory id, a
    new trajectory of that id is `unavailable` (never opened a second time), answered at once; after
    LOST_AFTER the cluster gives the node up as a dead one (lost mark first): its sandboxes answer
    `sandbox_lost`, the trajectory opens elsewhere, and the daemon, back, is fenced by `cluster up`."""
    victim = KEYS[0]
    tid = f"orphaned-{secrets.token_hex(4)}"
    with cluster.client(0) as g, httpx.Client(base_url=cluster.gateway_urls[1], timeout=60) as http:
        made = []
        while victim not in {node_of(sb.id) for sb in made}:
            made.append(g.create(image="busybox", labels={"job": "orphaned"}))
        on_victim = [sb.id for sb in made if node_of(sb.id) == victim]
        cluster.daemons[victim].kill()
        t0 = time.monotonic()
        r = http.post("/v1/trajectories", json={"id": tid, "spec": {"image": "busybox"}}, headers=AUTH)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "unavailable") and time.monotonic() - t0 < 10
        for i in range(2):
            assert wait_until(lambda i=i: cluster.nodes(i)[victim] == "lost", timeout=LOST_AFTER + 30, interval=0.5)
        with pytest.raises(SandboxLostError):
            g.get(on_victim[0]).exec("true")
        t = g.trajectory(tid, SandboxSpec(image="busybox"))
        assert t.sandbox is not None and node_of(t.sandbox.id) != victim
        t.delete()
        assert set(g.stop_many(labels={"job": "orphaned"})) >= {sb.id for sb in made} - set(on_victim)
    cluster.daemons[victim].start()  # it adopts what it held; callers were told it is lost
    with Client(cluster.daemons[victim].socket) as direct:
        assert {x.id for x in direct.list(labels={"job": "orphaned"})} == set(on_victim)
        before = direct.node_load().generation
        assert cluster.cluster_up(victim)["generation"] == before + 1
        assert not direct.list(labels={"job": "orphaned"})
    for i in range(2):
        cluster.wait_alive(i)


def test_a_create_retried_through_another_gateway_gets_what_its_key_made(cluster: Cluster) -> None:
    """The node decides by key: a create (and a batch) whose answer was lost at one gateway, sent
    again through another marked as a retry, lands on the node that holds its key and gets the
    sandbox the first attempt made, whatever placement would have chosen."""
    spec = {"image": "busybox", "labels": {"job": "rekey"}}
    keys = [f"rekey-{secrets.token_hex(6)}" for _ in range(6)]
    with httpx.Client(headers={"authorization": f"Bearer {ADMIN}"}, timeout=60) as http:
        gw0, gw1 = cluster.gateway_urls
        first = [http.post(f"{gw0}/v1/sandboxes", json=spec, headers={"idempotency-key": k}).json()["id"] for k in keys]
        again = [
            http.post(f"{gw1}/v1/sandboxes", json=spec, headers={"idempotency-key": k, "x-sandfleet-retry": "1"})
            for k in keys
        ]
        assert [r.json()["id"] for r in again] == first
        batch = {"specs": [spec] * 6, "idempotency_keys": [f"{k}-b" for k in keys]}
        made = [i["sandbox"]["id"] for i in http.post(f"{gw0}/v1/sandboxes/batch", json=batch).json()["results"]]
        retry = http.post(f"{gw1}/v1/sandboxes/batch", json=batch, headers={"x-sandfleet-retry": "1"}).json()
        assert [i["sandbox"]["id"] for i in retry["results"]] == made
    with cluster.client(1) as g:
        assert sorted(g.stop_many(labels={"job": "rekey"})) == sorted(first + made)


def test_a_gateway_killed_mid_burst_loses_nothing_and_duplicates_nothing(cluster: Cluster) -> None:
    """A trainer's 200 creates through both gateways (the SDK knows both); the one it uses is
    SIGKILLed a second in, with creates in flight there. Every caller gets an id or a typed error,
    no two callers one sandbox, and within the nodes' claim window no sandbox is left that no
    caller holds."""
    n, small = 200, {"cpu": 0.1, "memory": 64 * 1024**2}
    errors: list[SandboxError] = []
    retried: list[str] = []  # creates the SDK sent again, marked, after an answer the dead gateway lost
    # Creates whose request was all sent and whose answer has not come, per gateway: the first gateway
    # with three of them a second in is killed there and then, so they surely reached it and lose their
    # answer. (Counting creates merely begun could count ones still connecting: under load a connect
    # timeout may have moved the SDK on, and a kill then loses no answer.)
    awaiting: collections.Counter[str] = collections.Counter()
    target: list[int] = []  # the index of the gateway killed

    class Counting(httpx.AsyncHTTPTransport):
        """The SDK's transport, counting creates sent and not answered, and retries marked."""

        def __init__(self, killed: asyncio.Event) -> None:
            super().__init__(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
            self.killed = killed

        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.headers.get("x-sandfleet-retry"):
                retried.append(request.headers.get("idempotency-key", ""))
            if request.method != "POST" or request.url.path != "/v1/sandboxes":
                return await super().handle_async_request(request)
            at = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
            sent = False

            async def trace(event: str, info: dict[str, object]) -> None:
                nonlocal sent
                if event != "http11.send_request_body.complete":
                    return
                sent = True
                awaiting[at] += 1
                if awaiting[at] >= 3 and time.monotonic() - t0 > 1.0 and not self.killed.is_set():
                    target.append(cluster.gateway_urls.index(at))
                    os.killpg(cluster.gateways[target[0]].pid, signal.SIGKILL)  # it and its watcher
                    self.killed.set()

            request.extensions["trace"] = trace
            try:
                return await super().handle_async_request(request)
            finally:
                awaiting[at] -= sent

    async def burst() -> dict[int, str]:
        got: dict[int, str] = {}
        killed = asyncio.Event()
        async with AsyncClient(url=cluster.gateway_urls, token=ADMIN, timeout=120, transport=Counting(killed)) as fleet:
            limit = asyncio.Semaphore(24)

            async def one(i: int) -> None:
                async with limit:
                    try:
                        sb = await fleet.create(image="busybox", labels={"job": "burst", "n": str(i)}, resources=small)
                        await fleet.get(sb.id)  # the rollout uses it (a gateway's ack may have died with it)
                    except SandboxError as exc:
                        errors.append(exc)
                        return
                    got[i] = sb.id

            calls = asyncio.gather(*(one(i) for i in range(n)))
            await asyncio.wait_for(killed.wait(), 30)
            await asyncio.to_thread(_killpg, cluster.gateways[target[0]])  # reaped
            await calls
        return got

    t0 = time.monotonic()
    try:
        got = asyncio.run(burst())
        took = time.monotonic() - t0
        other = 1 - target[0]
        assert len(got) + len(errors) == n  # every caller: an id or a typed error (anything else raised)
        assert len(set(got.values())) == len(got)
        assert len(errors) <= n // 20, [e.message for e in errors[:5]]
        assert retried  # creates were in flight at the gateway when it died
        with cluster.client(other) as g:
            live = {x.id: x.spec.labels["n"] for x in g.list(labels={"job": "burst"})}
            orphans = set(live) - set(got.values())
            # Each caller holds exactly its own; what a lost answer made and nobody claimed is reaped.
            assert all(live.get(sandbox_id) == str(i) for i, sandbox_id in got.items())
            gone = wait_until(
                lambda: set(x.id for x in g.list(labels={"job": "burst"})) == set(got.values()),
                timeout=CLAIM_WINDOW + 10,
                interval=0.5,
            )
            assert gone, "sandboxes no caller holds outlived the claim window"
            summary = {"ids": len(got), "errors": len(errors), "retried": len(retried), "orphans": len(orphans)}
            (cluster.root / "burst.json").write_text(json.dumps(summary | {"seconds": round(took, 1)}))
            # A create whose answer went through a gateway is acknowledged by it: untouched, it lives on.
            # One a gateway passed on and died before answering (nobody acknowledges it) is stopped.
            idle = g.create(image="busybox", labels={"job": "burst"}, resources=small)
            lost = httpx.post(
                f"{cluster.urls[KEYS[1]]}/v1/sandboxes",
                json={"image": "busybox", "labels": {"job": "burst"}},
                headers={"authorization": f"Bearer {ADMIN}", "x-sandfleet-forwarded": "1"},
            ).json()["id"]
            time.sleep(CLAIM_WINDOW + 2)
            assert g.get(idle.id).info.state == "running"
            with pytest.raises(NotFoundError):
                g.get(lost)
            assert len(g.stop_many(labels={"job": "burst"})) == len(got) + 1
    finally:
        killed = target[0] if target else 0
        if cluster.gateways[killed].poll() is not None:
            cluster.start_gateway(killed)
        cluster.wait_alive(killed)


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
    # The machine comes back: its daemon, started again, adopts what it held (callers were told it is
    # lost); rejoining the cluster fences it: none of that is served again, and it takes creates.
    cluster.daemons[victim].start()
    with Client(cluster.daemons[victim].socket) as direct:
        assert {x.id for x in direct.list(labels={"job": "kill"})} == {sb.id for sb in on_victim}
        before = direct.node_load().generation
        cluster.start_worker(victim)
        assert cluster.cluster_up(victim)["generation"] == before + 1
        assert not direct.list(labels={"job": "kill"})
    for i in range(2):
        cluster.wait_alive(i)


def test_gateways_keep_serving_when_rays_head_dies(cluster: Cluster) -> None:
    with cluster.client(0) as g0, cluster.client(1) as g1:
        made = [g0.create(image="busybox", labels={"job": "headless"}) for _ in range(4)]
        _killpg(cluster.head)
        time.sleep(3)  # the watchers lose Ray
        for sb in made:
            for g in (g0, g1):
                assert g.get(sb.id).exec("echo alive").stdout == "alive\n"
        late = g1.create(image="busybox", labels={"job": "headless"})  # placement on the membership known
        assert node_of(late.id) in KEYS
        assert len(g0.stop_many(labels={"job": "headless"})) == 5
