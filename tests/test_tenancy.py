"""Two projects against each other on one node (issue 26: "correct under many tenants", the node's
side): a real daemon with `[iam]` over TCP, project A's token against project B's objects.

- Every route of docs/openapi.json (iterated: a route added later is probed too, or the test says
  which one it cannot probe) is called by A with B's ids (sandbox, snapshot, trajectory, session,
  process, exposed port) and with ids that do not exist: the answers must be the same (status and
  body, the ids aside), so that nothing tells A what B holds; label-wide calls are made with B's
  labels and with labels nobody has, query parameters naming B's objects likewise.
- No byte of B's secrets (its env, files, outputs, labels, snapshot and trajectory metadata) and
  none of B's ids appear in any answer to A (bodies and headers), unless A sent them itself.
- Idempotency keys are per project: A's create with B's key (a trajectory's predictable
  `trajectory:<id>` too), batch item, fork or restore makes A's own sandboxes, before and after a
  daemon restart, and within a project a key still refuses another request after the restart.
- What a sandbox serves on an exposed port cannot act on the daemon's origin (the console's): the
  headers that would are dropped, the daemon's own credentials and cookies never reach the sandbox.
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import socket
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.client.sync import Sandbox
from sandfleet.errors import PermissionDeniedError, SandboxError, SandboxNotFoundError
from sandfleet.models import Mount, SandboxInfo

from conftest import Daemon, destroy_daemon, make_daemon, serve_http

OPENAPI = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
TOKENS = {"a": "tenant-a-user-secret-0001", "b": "tenant-b-user-secret-0002", "root": "tenant-root-secret-00003"}
IAM_TOML = f"""
[[iam.projects]]
path = "ta"

[[iam.projects]]
path = "tb"

[[iam.tokens]]
name = "root"
token = "{TOKENS["root"]}"
role = "admin"

[[iam.tokens]]
name = "a"
token = "{TOKENS["a"]}"
project = "ta"

[[iam.tokens]]
name = "b"
token = "{TOKENS["b"]}"
project = "tb"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start(name: str) -> tuple[Daemon, str]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    port = _free_port()
    d = make_daemon(name, f'tcp = "127.0.0.1:{port}"\n' + IAM_TOML)
    d.start()
    return d, f"http://127.0.0.1:{port}"


def _http(url: str, who: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {TOKENS[who]}"}, timeout=120)


def _made(results: list[Sandbox | SandboxError]) -> list[Sandbox]:
    """A fork's or restore's children, every one of which must have been made."""
    assert all(isinstance(r, Sandbox) for r in results), results
    return [r for r in results if isinstance(r, Sandbox)]


def _secret(name: str) -> str:
    return f"{name}-{secrets.token_hex(12)}"


# -- item 3: idempotency keys per project ------------------------------------------------------------


def test_a_key_of_another_project_is_simply_unused() -> None:
    """A create of A carrying B's key (B's trajectory's `trajectory:<id>`, B's plain create key) makes
    A a sandbox of its own, before and after a restart; B's retry still gets B's; within a project the
    key still refuses another request after the restart (its fingerprint was kept)."""
    d, url = _start("keys")
    try:
        env_secret, traj_secret = _secret("keyed-env"), _secret("traj-env")
        with _http(url, "a") as a, _http(url, "b") as b, Client(url=url, token=TOKENS["b"], timeout=60) as sdk_b:
            traj = sdk_b.trajectory(f"t-{secrets.token_hex(4)}", SandboxSpec(image="busybox", env={"T": traj_secret}))
            assert traj.info.sandbox_id is not None
            b_spec = {"image": "busybox", "env": {"S": env_secret}}
            made = b.post("/v1/sandboxes", json=b_spec, headers={"Idempotency-Key": "shared-key"})
            assert made.status_code == 201, made.text
            b_ids = {traj.info.sandbox_id, made.json()["id"]}

            def a_creates(key: str, spec: dict[str, Any]) -> str:
                r = a.post("/v1/sandboxes", json=spec, headers={"Idempotency-Key": key})
                assert r.status_code == 201, r.text  # never "used for another request": no oracle
                info = r.json()
                assert info["id"] not in b_ids and info["spec"]["project"] == "ta", info
                assert env_secret not in r.text and traj_secret not in r.text
                return str(info["id"])

            # Before a restart: B's trajectory key and B's plain key are unused keys for A.
            a_traj = a_creates(f"trajectory:{traj.id}", {"image": "busybox"})
            a_shared = a_creates("shared-key", {"image": "busybox", "labels": {"who": "a"}})
            assert a_creates(f"trajectory:{traj.id}", {"image": "busybox"}) == a_traj  # A's own retry: A's
            with_other = a.post("/v1/sandboxes", json={"image": "busybox", "env": {"X": "1"}},
                                headers={"Idempotency-Key": "shared-key"})  # fmt: skip
            assert with_other.status_code == 400 and "used for another request" in with_other.text

            d.kill()  # a crash: keys come back from the state store
            d.start()
            # After it: still A's own, fingerprints kept (another request of A with A's key: refused).
            assert a_creates(f"trajectory:{traj.id}", {"image": "busybox"}) == a_traj
            assert a_creates("shared-key", {"image": "busybox", "labels": {"who": "a"}}) == a_shared
            again = a.post("/v1/sandboxes", json={"image": "busybox", "env": {"X": "1"}},
                           headers={"Idempotency-Key": "shared-key"})  # fmt: skip
            assert again.status_code == 400 and "used for another request" in again.text
            # A key of B that A never used, first tried after the restart: unused for A as well.
            b2 = b.post("/v1/sandboxes", json=b_spec, headers={"Idempotency-Key": "b-only-key"})
            assert b2.status_code == 201
            b_ids.add(b2.json()["id"])
            a_creates("b-only-key", {"image": "busybox"})
            # B's retries get B's sandboxes; B's own other request with B's key is refused.
            retry = b.post("/v1/sandboxes", json=b_spec, headers={"Idempotency-Key": "shared-key"})
            assert retry.status_code == 201 and retry.json()["id"] == made.json()["id"]
            assert sdk_b.trajectory(traj.id, SandboxSpec(image="busybox", env={"T": traj_secret})).info.sandbox_id == (
                traj.info.sandbox_id
            )
            other = b.post("/v1/sandboxes", json={"image": "busybox"}, headers={"Idempotency-Key": "shared-key"})
            assert other.status_code == 400
            # A batch item with B's key: A's own sandbox too.
            batch = a.post("/v1/sandboxes/batch",
                           json={"specs": [{"image": "busybox"}], "idempotency_keys": ["b-only-key-2"]})  # fmt: skip
            b.post("/v1/sandboxes", json=b_spec, headers={"Idempotency-Key": "b-only-key-2"})
            assert batch.status_code == 200 and batch.json()["results"][0]["sandbox"]["spec"]["project"] == "ta"
    finally:
        destroy_daemon(d)


def test_a_fork_or_restore_key_of_another_project_is_simply_unused() -> None:
    """Fork and restore keys (their children's `key#i`) are per project too, and keep the request's
    fingerprint across a restart."""
    d, url = _start("batchkeys")
    try:
        with Client(url=url, token=TOKENS["a"], timeout=60) as a, Client(url=url, token=TOKENS["b"], timeout=60) as b:
            secret = _secret("fork-env")
            sb_b = b.create(SandboxSpec(image="busybox", env={"S": secret}), idle_ttl=300)
            sb_a = a.create(image="busybox", idle_ttl=300)
            b_children = {c.id for c in _made(sb_b.fork(2, idempotency_key="fork-key"))}
            snap_b = sb_b.snapshot().id
            b_restored = {c.id for c in _made(b.restore(snap_b, 1, idempotency_key="restore-key"))}
            a_children = _made(sb_a.fork(2, idempotency_key="fork-key"))
            assert not {c.id for c in a_children} & b_children
            assert all(c.info.spec.project == "ta" and "S" not in c.info.spec.env for c in a_children)
            snap_a = sb_a.snapshot().id
            a_restored = _made(a.restore(snap_a, 1, idempotency_key="restore-key"))
            assert not {c.id for c in a_restored} & b_restored and a_restored[0].info.spec.project == "ta"
            d.kill()
            d.start()
            # Retries after the restart: each project's own children; another request with the key: refused.
            assert {c.id for c in _made(sb_a.fork(2, idempotency_key="fork-key"))} == {c.id for c in a_children}
            assert {c.id for c in _made(sb_b.fork(2, idempotency_key="fork-key"))} == b_children
            assert {c.id for c in _made(a.restore(snap_a, 1, idempotency_key="restore-key"))} == {a_restored[0].id}
            with pytest.raises(SandboxError, match="used for another request"):
                sb_a.fork(2, labels={"other": "request"}, idempotency_key="fork-key")
            with pytest.raises(SandboxError, match="used for another request"):
                a.restore(snap_a, 2, idempotency_key="restore-key")
        # The root retries a fork of B's sandbox, stopped since: the children it made, in B's project.
        with Client(url=url, token=TOKENS["root"], timeout=60) as root:
            parent = root.get(sb_b.id)
            made = {c.id for c in _made(parent.fork(1, idempotency_key="root-fork"))}
            parent.stop()
            assert {c.id for c in _made(parent.fork(1, idempotency_key="root-fork"))} == made
    finally:
        destroy_daemon(d)


# -- every route: A against B's objects --------------------------------------------------------------


@dataclass
class B:
    """What project B holds on the node, and the secrets in it."""

    sandbox: str  # running: env, labels, a file, a background process, a session, an exposed port
    snapshot: str
    trajectory: str
    session: str
    process: str
    checkpoint: str  # of `sandbox`
    label: str  # the value of B's label "b-secret"
    ids: set[str] = field(default_factory=set)  # every id of B's
    secrets: dict[str, str] = field(default_factory=dict)


@dataclass
class Fake:
    """Ids of the same shapes that name nothing."""

    sandbox: str
    snapshot: str
    trajectory: str
    session: str
    process: str
    checkpoint: str
    label: str


@pytest.fixture(scope="module")
def tenants() -> Iterator[tuple[Daemon, str]]:
    d, url = _start("tenancy")
    try:
        yield d, url
    finally:
        destroy_daemon(d)


@pytest.fixture(scope="module")
def b_objects(tenants: tuple[Daemon, str]) -> Iterator[B]:
    _, url = tenants
    s = {k: _secret(k) for k in ("env", "label", "file", "out", "session", "served", "snap", "traj", "meta", "step")}
    with Client(url=url, token=TOKENS["b"], timeout=120) as b:
        sb = b.create(
            SandboxSpec(image="python", env={"B_SECRET": s["env"]}, labels={"b-secret": s["label"], "job": "b-job"}),
            idle_ttl=900,
        )
        sb.files.write("/home/secret.txt", s["file"].encode())
        assert sb.exec("echo $B_SECRET").stdout.strip() == s["env"]
        proc = sb.start(f"echo {s['out']}; exec sleep 900")
        session = sb.session()
        assert session.run(f"echo {s['session']}").stdout.strip() == s["session"]
        serve_http(sb, 8000, s["served"])
        checkpoint = sb.checkpoint(labels={"cp-secret": s["snap"]}).id  # with a server listening, a port exposed
        small = b.create(SandboxSpec(image="busybox", env={"B_SECRET": s["env"]}), idle_ttl=900)
        snap = small.snapshot(labels={"snap-secret": s["snap"]}).id
        tid = f"b-{secrets.token_hex(6)}"
        traj = b.trajectory(
            tid,
            SandboxSpec(image="busybox", env={"T": s["traj"]}),
            labels={"t-secret": s["label"]},
            metadata={"m": s["meta"]},
        )
        traj.exec(f"echo {s['step']}")
        keyed = b.create(SandboxSpec(image="busybox", env={"B_SECRET": s["env"]}), idempotency_key="b-create-key")
        restored = _made(b.restore(snap, 1, idempotency_key="b-restore-key"))
        ids = {
            sb.id,
            small.id,
            snap,
            tid,
            traj.info.sandbox_id or "",
            keyed.id,
            restored[0].id,
            session.id,
            proc.id,
            checkpoint,
        }
        yield B(sb.id, snap, tid, session.id, proc.id, checkpoint, s["label"], ids, s)


@pytest.fixture(scope="module")
def a_sandbox(tenants: tuple[Daemon, str]) -> Iterator[str]:
    with Client(url=tenants[1], token=TOKENS["a"], timeout=120) as a:
        sb = a.create(image="busybox", idle_ttl=900)
        yield sb.id


def _fake(b: B) -> Fake:
    node = b.sandbox[3:9]
    return Fake(
        sandbox=f"sb-{node}{secrets.token_hex(5)}",
        snapshot=f"snap-{node}{secrets.token_hex(5)}",
        trajectory=f"b-{secrets.token_hex(6)}",
        session=f"s-{secrets.token_hex(6)}",
        process=f"p-{secrets.token_hex(6)}",
        checkpoint=f"cp-{node}{secrets.token_hex(5)}",
        label=_secret("nobodys-label"),
    )


def _tar(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _body(method: str, path: str, label: str) -> dict[str, Any]:
    """A valid request body (and query) for the route, so that a refusal is the scoping's and not
    the validation's; `label`: the value of label "b-secret" in label-wide calls."""
    labels = {"b-secret": label}
    exec_ = {"command": ["cat", "/home/secret.txt"]}
    json_bodies: dict[tuple[str, str], Any] = {
        ("POST", "/run_code"): {"code": "print(1)", "language": "python"},
        ("POST", "/v1/fusion/run_code"): {"code": "print(1)", "language": "python"},
        ("POST", "/v1/images/import"): {"path": "/nonexistent.tar"},
        ("POST", "/v1/images/recipes"): {"recipe": 'name = "x"\nbase = "busybox"\n', "base_dir": "/tmp"},
        ("POST", "/v1/node/drain"): {"draining": False},
        ("POST", "/v1/run"): {"code": "print(1)"},
        ("POST", "/v1/run/batch"): {"calls": [{"code": "print(1)"}]},
        ("POST", "/v1/sandboxes/lifetimes"): {"labels": labels, "idle_ttl": 5},
        ("POST", "/v1/sandboxes/network"): {"labels": labels, "network": {"allow": ["pypi"]}},
        ("POST", "/v1/sandboxes/pause"): {"labels": labels},
        ("POST", "/v1/sandboxes/resume"): {"labels": labels},
        ("POST", "/v1/sandboxes/stop"): {"labels": labels},
        ("DELETE", "/v1/sandboxes/{sandbox_id}"): {"reason": "probe"},
        ("PATCH", "/v1/sandboxes/{sandbox_id}"): {"idle_ttl": 5},
        ("POST", "/v1/sandboxes/{sandbox_id}/exec"): exec_,
        ("POST", "/v1/sandboxes/{sandbox_id}/exec/stream"): exec_,
        ("POST", "/v1/sandboxes/{sandbox_id}/fork"): {"count": 1},
        ("PUT", "/v1/sandboxes/{sandbox_id}/network"): {"network": {"allow": ["pypi"]}},
        ("PUT", "/v1/sandboxes/{sandbox_id}/labels"): {"labels": {"a-took": "it"}},
        ("POST", "/v1/sandboxes/{sandbox_id}/pack"): {"image": "stolen:latest"},
        ("POST", "/v1/sandboxes/{sandbox_id}/ports"): {"port": 8000},
        ("POST", "/v1/sandboxes/{sandbox_id}/processes"): exec_,
        ("POST", "/v1/sandboxes/{sandbox_id}/run"): {"code": "print(open('/home/secret.txt').read())"},
        ("POST", "/v1/sandboxes/{sandbox_id}/sessions"): {},
        ("POST", "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run"): {"command": "cat /home/secret.txt"},
        ("POST", "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/run/stream"): {"command": "cat /home/secret.txt"},
        ("POST", "/v1/sandboxes/{sandbox_id}/snapshots"): {},
        ("POST", "/v1/sandboxes/{sandbox_id}/checkpoints"): {},
        ("POST", "/v1/sandboxes/{sandbox_id}/rollback"): {"checkpoint_id": "cp-probe"},
        ("POST", "/v1/sandboxes/{sandbox_id}/verify"): {"command": "true"},
        ("POST", "/v1/snapshots/{snapshot_id}/restore"): {"count": 1},
        ("POST", "/v1/trajectories/{trajectory_id}/close"): {"stop_sandbox": True},
        ("POST", "/v1/trajectories/{trajectory_id}/steps"): {
            "step": 1,
            "action": {"kind": "exec", "exec": {"command": ["cat", "/home/secret.txt"]}},
        },
        ("POST", "/v1/trajectories/{trajectory_id}/verify"): {"command": "true"},
    }
    raw: dict[tuple[str, str], bytes] = {
        ("PUT", "/v1/sandboxes/{sandbox_id}/files/content"): b"overwritten",
        ("PUT", "/v1/sandboxes/{sandbox_id}/files/tar"): _tar("planted.txt", b"planted"),
        ("POST", "/v1/sandboxes/{sandbox_id}/processes/{process_id}/stdin"): b"typed\n",
        ("POST", "/v1/sandboxes/{sandbox_id}/sessions/{session_id}/stdin"): b"cat /home/secret.txt\n",
    }
    queries: dict[str, dict[str, Any]] = {
        "/v1/sandboxes/{sandbox_id}/files": {"path": "/home/secret.txt"},
        "/v1/sandboxes/{sandbox_id}/files/content": {"path": "/home/secret.txt"},
        "/v1/sandboxes/{sandbox_id}/files/list": {"path": "/home"},
        "/v1/sandboxes/{sandbox_id}/files/mkdir": {"path": "/home/x"},
        "/v1/sandboxes/{sandbox_id}/files/stat": {"path": "/home/secret.txt"},
        "/v1/sandboxes/{sandbox_id}/files/tar": {"path": "/home"},
        "/v1/sandboxes/{sandbox_id}/files/watch": {"path": "/home"},
        "/v1/images/build": {"ref": "busybox:latest"},
        "/v1/images/push": {"ref": "busybox:latest"},
        "/v1/sandboxes": {"label": f"b-secret={label}"},
        "/v1/jobs": {"key": "b-secret", "label": f"b-secret={label}"},
        "/v1/snapshots": {"label": f"b-secret={label}"},
        "/v1/trajectories": {"label": f"t-secret={label}"},
        "/v1/audit": {"kind": "api"},
        "/v1/sandboxes/{sandbox_id}/processes/{process_id}": {"wait": 1},
    }
    out: dict[str, Any] = {"params": queries.get(path, {})}
    if (method, path) in json_bodies:
        out["json"] = json_bodies[(method, path)]
    elif (method, path) in raw:
        out["content"] = raw[(method, path)]
    return out


# Routes whose probe is elsewhere, and why (each must still exist in the document).
ELSEWHERE = {
    ("POST", "/v1/sandboxes"): "test_a_key_of_another_project_is_simply_unused",
    ("POST", "/v1/sandboxes/batch"): "test_a_key_of_another_project_is_simply_unused",
    ("POST", "/v1/trajectories"): "test_a_trajectory_naming_b_objects_* below",
}
PARAMS = (
    "job",
    "sandbox_id",
    "snapshot_id",
    "trajectory_id",
    "session_id",
    "process_id",
    "checkpoint_id",
    "port",
    "path",
    "ref",
)


def _routes() -> list[tuple[str, str, dict[str, Any]]]:
    doc = json.loads(OPENAPI.read_text())
    return [(m.upper(), p, op) for p, ops in doc["paths"].items() for m, op in ops.items()]


def _fill(path: str, values: dict[str, Any]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: str(values[m.group(1)]), path)


def _normal(text: str, names: dict[str, str]) -> str:
    for value, placeholder in names.items():
        text = text.replace(value, placeholder)
    return text


def _leaks(resp: httpx.Response, sent: str, b: B) -> list[str]:
    """B's secrets and ids in an answer to A (body and headers), unless A's request carried them."""
    seen = resp.content.decode("utf-8", "replace") + "\n" + "\n".join(f"{k}: {v}" for k, v in resp.headers.items())
    found = [f"secret {k}" for k, v in b.secrets.items() if v in seen and v not in sent]
    return found + [f"id {i}" for i in b.ids if i and i in seen and i not in sent]


def test_every_route_answers_a_for_b_as_for_nothing(tenants: tuple[Daemon, str], b_objects: B, a_sandbox: str) -> None:
    _, url = tenants
    b, fake = b_objects, _fake(b_objects)
    b_values = {
        "job": "b-job",  # the value of B's sandbox's label "job": its job's figures
        "sandbox_id": b.sandbox,
        "snapshot_id": b.snapshot,
        "trajectory_id": b.trajectory,
        "session_id": b.session,
        "process_id": b.process,
        "checkpoint_id": b.checkpoint,
        "port": 8000,
        "path": "index.html",
        "ref": "busybox:latest",
    }
    fake_values = {**b_values, "job": "nobodys-job", "sandbox_id": fake.sandbox, "snapshot_id": fake.snapshot}
    fake_values |= {"trajectory_id": fake.trajectory, "session_id": fake.session, "process_id": fake.process}
    fake_values |= {"checkpoint_id": fake.checkpoint}
    names = {
        b.sandbox: "<sandbox>",
        fake.sandbox: "<sandbox>",
        b.snapshot: "<snapshot>",
        fake.snapshot: "<snapshot>",
        b.trajectory: "<trajectory>",
        fake.trajectory: "<trajectory>",
        b.session: "<session>",
        fake.session: "<session>",
        b.process: "<process>",
        fake.process: "<process>",
        b.checkpoint: "<checkpoint>",
        fake.checkpoint: "<checkpoint>",
        b.label: "<label>",
        fake.label: "<label>",
        "b-job": "<job>",
        "nobodys-job": "<job>",
    }
    problems: list[str] = []
    probed = 0
    with _http(url, "a") as a:

        def call(method: str, path: str, values: dict[str, Any], label: str) -> tuple[httpx.Response, str]:
            req = _body(method, path, label)
            target = _fill(path, values)
            try:
                r = a.request(method, target, params=req["params"], json=req.get("json"), content=req.get("content"))
            except httpx.HTTPError as exc:
                raise AssertionError(f"{method} {target}: {exc!r}") from exc
            sent = target + json.dumps(req["params"]) + json.dumps(req.get("json")) + str(req.get("content"))
            return r, sent

        for method, path, _op in _routes():
            if (method, path) in ELSEWHERE:
                continue
            params = set(re.findall(r"\{(\w+)\}", path))
            assert params <= set(PARAMS), f"{method} {path}: a path parameter this test does not know: {params}"
            variants = [(b_values, fake_values)]
            if not params and "<label>" not in _normal(json.dumps(_body(method, path, b.label)), names):
                # Names nothing of B's (the node's stateless calls, images, whoami ...): B's data
                # must not be in its answer; there is nothing of B's to compare with.
                probed += 1
                r, sent = call(method, path, b_values, b.label)
                if leaks := _leaks(r, sent, b):
                    problems.append(f"{method} {path}: B's {leaks} in the answer ({r.status_code})")
                continue
            if params & {
                "session_id",
                "process_id",
                "checkpoint_id",
            }:  # A's own sandbox with B's session, process or checkpoint id
                variants.append(({**b_values, "sandbox_id": a_sandbox}, {**fake_values, "sandbox_id": a_sandbox}))
            for mine, nothing in variants:
                probed += 1
                got_b, sent_b = call(method, path, mine, b.label)
                got_none, sent_none = call(method, path, nothing, fake.label)
                where = f"{method} {_fill(path, mine)}"
                for resp, sent in ((got_b, sent_b), (got_none, sent_none)):
                    if leaks := _leaks(resp, sent, b):
                        problems.append(f"{where}: B's {leaks} in the answer ({resp.status_code})")
                one = (got_b.status_code, _normal(got_b.text, names))
                other = (got_none.status_code, _normal(got_none.text, names))
                if one != other:
                    problems.append(f"{where}: B's objects answer {one}, nothing answers {other}")
    assert probed > 60, probed  # every route of the document, not a few
    assert set(ELSEWHERE) <= {(m, p) for m, p, _ in _routes()}, "a route probed elsewhere is gone: update ELSEWHERE"
    assert not problems, "\n".join(problems)
    # And B's objects are as B left them.
    with Client(url=url, token=TOKENS["b"], timeout=60) as bc:
        sb = bc.get(b.sandbox)
        assert sb.info.state == "running" and sb.files.read("/home/secret.txt") == b.secrets["file"].encode()
        assert [p.port for p in sb.ports()] == [8000] and {s.id for s in sb.sessions()} == {b.session}
        assert [c.id for c in sb.checkpoints()] == [b.checkpoint]
    with _http(url, "b") as bh:
        assert bh.get(f"/v1/snapshots/{b.snapshot}").status_code == 200
        assert bh.get(f"/v1/trajectories/{b.trajectory}").json()["state"] == "open"


def _stub(sandbox_id: str) -> SandboxInfo:
    """What a client of A would hold to name a sandbox: an id (here one A was never given)."""
    return SandboxInfo.model_validate(
        {"id": sandbox_id, "state": "running", "spec": {"image": "busybox"}, "created_at": 0, "last_active_at": 0}
    )


def test_a_terminal_on_another_projects_sandbox_is_refused_as_for_none(
    tenants: tuple[Daemon, str], b_objects: B
) -> None:
    _, url = tenants
    fake = _fake(b_objects)
    answers = []
    with Client(url=url, token=TOKENS["a"], timeout=30) as a:
        for sandbox_id in (b_objects.sandbox, fake.sandbox):
            with pytest.raises(SandboxError) as err:
                Sandbox(a, _stub(sandbox_id)).terminal("cat /home/secret.txt")
            answers.append((err.value.code, str(err.value).replace(sandbox_id, "<sandbox>")))
    assert answers[0] == answers[1] and answers[0][0] == "not_found", answers


def test_a_trajectory_naming_b_objects_is_refused_as_for_none(tenants: tuple[Daemon, str], b_objects: B) -> None:
    """A new trajectory of A on B's sandbox or from B's snapshot: not_found, as for ones that do not exist."""
    _, url = tenants
    fake = _fake(b_objects)
    with _http(url, "a") as a:
        for field_, mine, nothing in (
            ("sandbox_id", b_objects.sandbox, fake.sandbox),
            ("snapshot_id", b_objects.snapshot, fake.snapshot),
        ):
            tid = f"a-{secrets.token_hex(6)}"
            one = a.post("/v1/trajectories", json={"id": tid, field_: mine})
            other = a.post("/v1/trajectories", json={"id": tid, field_: nothing})
            assert one.status_code == other.status_code == 404, (one.text, other.text)
            assert one.text.replace(mine, "<id>") == other.text.replace(nothing, "<id>")
            assert not _leaks(one, mine, b_objects)


def test_a_project_token_opens_its_trajectory_again(tenants: tuple[Daemon, str]) -> None:
    """A trainer of a project opens its trajectory again (a restart, a lost answer) with the same
    arguments: the same trajectory, not "opened with other arguments" (the spec's project is placed
    before the arguments are compared)."""
    _, url = tenants
    with Client(url=url, token=TOKENS["a"], timeout=60) as a:
        tid = f"again-{secrets.token_hex(4)}"
        first = a.trajectory(tid, SandboxSpec(image="busybox"), labels={"k": "v"})
        again = a.trajectory(tid, SandboxSpec(image="busybox"), labels={"k": "v"})
        assert again.info.sandbox_id == first.info.sandbox_id and again.info.created_at == first.info.created_at


def test_a_trajectory_id_of_another_project_is_unused(tenants: tuple[Daemon, str], b_objects: B) -> None:
    """A's trajectory with the id B's has: A's own (as with any unused id), never B's, never an error
    that tells A the id is taken."""
    _, url = tenants
    with _http(url, "a") as a:
        r = a.post("/v1/trajectories", json={"id": b_objects.trajectory, "spec": {"image": "busybox"}})
        fresh = a.post("/v1/trajectories", json={"id": f"b-{secrets.token_hex(6)}", "spec": {"image": "busybox"}})
        assert r.status_code == fresh.status_code and r.status_code < 300, r.text
        assert not _leaks(r, b_objects.trajectory, b_objects) and r.json()["sandbox_id"] not in b_objects.ids


def test_the_nodes_health_counts_only_what_a_project_sees(
    tenants: tuple[Daemon, str], b_objects: B, a_sandbox: str
) -> None:
    """How many sandboxes B runs is B's to know: A's /v1/health counts A's."""
    _, url = tenants
    with _http(url, "a") as a, _http(url, "root") as root:
        mine = [s["id"] for s in a.get("/v1/sandboxes", params={"state": "running"}).json()["sandboxes"]]
        assert a_sandbox in mine
        assert a.get("/v1/health").json()["sandboxes_running"] == len(mine)
        assert root.get("/v1/health").json()["sandboxes_running"] > len(mine)  # B's are running too


def test_a_verifier_belongs_to_its_agents_project(tenants: tuple[Daemon, str], b_objects: B) -> None:
    """A verifier kept (`keep=True`) is the project's sandbox like the agent's: its project sees it and
    counts it, another project does not (it held the agent's changes and B's env)."""
    _, url = tenants
    with Client(url=url, token=TOKENS["a"], timeout=120) as a, Client(url=url, token=TOKENS["b"], timeout=120) as b:
        agent = a.create(image="busybox", idle_ttl=300)
        try:
            v = agent.verify("true", keep=True)
            assert v.passed and v.verifier_sandbox_id is not None
            kept = a.get(v.verifier_sandbox_id)
            assert kept.refresh().spec.project == "ta"
            with pytest.raises(SandboxNotFoundError):
                b.get(v.verifier_sandbox_id)
            kept.stop()
        finally:
            agent.stop()


def test_a_project_mounts_host_paths_read_only(tenants: tuple[Daemon, str]) -> None:
    """A host directory is the same for every project: one a project could write and another mount
    would carry B's data to A. A project's token mounts read-only; a writable mount is the root's."""
    d, url = tenants
    shared = str(d.root / "shared")  # in the daemon's mount_allowlist
    writable = SandboxSpec(image="busybox", mounts=[Mount(source=shared, target="/mnt", read_only=False)])
    with Client(url=url, token=TOKENS["b"], timeout=60) as b, _http(url, "b") as bh:
        with pytest.raises(PermissionDeniedError, match="read-only only"):
            b.create(writable)
        batch = bh.post("/v1/sandboxes/batch", json={"specs": [writable.model_dump(mode="json", exclude_unset=True)]})
        assert batch.json()["results"][0]["error"]["code"] == "permission_denied"
        opened = bh.post("/v1/trajectories", json={"id": f"m-{secrets.token_hex(4)}", "spec": writable.model_dump(
            mode="json", exclude_unset=True)})  # fmt: skip
        assert opened.status_code == 403
        with b.create(SandboxSpec(image="busybox", mounts=[Mount(source=shared, target="/mnt")])) as ro:
            assert " /mnt " in ro.exec("cat /proc/mounts").stdout
            assert ro.exec("grep ' /mnt ' /proc/mounts").stdout.split()[3].split(",")[0] == "ro"
    with Client(url=url, token=TOKENS["root"], timeout=60) as root, root.create(writable) as rw:
        assert rw.exec("grep ' /mnt ' /proc/mounts").stdout.split()[3].split(",")[0] == "rw"


# -- item 5: what a sandbox serves cannot act on the daemon's origin --------------------------------

# Headers that would act on the daemon's origin (the console's) beyond the answer they come with.
ORIGIN_WIDE = {
    "Set-Cookie": "sandfleet.token=planted; Path=/",
    "Clear-Site-Data": '"*"',
    "Service-Worker-Allowed": "/",
    "Strict-Transport-Security": "max-age=31536000; includeSubDomains",
    "Alt-Svc": 'h2="evil.example:443"; ma=86400',
    "Origin-Agent-Cluster": "?1",
    "Access-Control-Allow-Origin": "https://evil.example",
    "Access-Control-Allow-Credentials": "true",
    "WWW-Authenticate": 'Basic realm="sandfleet"',
    "Link": "</console/>; rel=preload; as=document",
    "Refresh": "0; url=https://evil.example/",
    "NEL": '{"report_to": "x", "max_age": 86400}',
    "Report-To": '{"group": "x", "max_age": 86400, "endpoints": [{"url": "https://evil.example/r"}]}',
    "Accept-CH": "Sec-CH-UA-Model",
    "Timing-Allow-Origin": "*",
}
# What binds the answer alone: passed on.
ANSWER_ONLY = {
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Content-Security-Policy": "img-src 'self'",
    "X-App": "kept",
}


def test_an_exposed_port_cannot_act_on_the_daemons_origin(tenants: tuple[Daemon, str], b_objects: B) -> None:
    _, url = tenants
    headers = "".join(f"{k}: {v}\n" for k, v in {**ORIGIN_WIDE, **ANSWER_ONLY}.items())
    port = f"/v1/sandboxes/{b_objects.sandbox}/ports/8000"
    with Client(url=url, token=TOKENS["b"], timeout=60) as bc, _http(url, "b") as b:
        bc.get(b_objects.sandbox).files.write("/srv/headers.txt", headers.encode())
        for method in ("GET", "POST", "OPTIONS"):
            r = b.request(method, f"{port}/index.html", content=b"x" if method == "POST" else None)
            assert r.status_code in (200, 501), (method, r.status_code)
            passed = {k.lower() for k in r.headers}
            assert not passed & {k.lower() for k in ORIGIN_WIDE}, (method, passed & {k.lower() for k in ORIGIN_WIDE})
            assert all(r.headers.get(k) is not None for k in ("X-Frame-Options", "Cross-Origin-Opener-Policy", "X-App"))
            # The daemon's own policy: an opaque origin (no allow-same-origin), whatever the server said.
            policies = r.headers.get_list("content-security-policy")
            assert "img-src 'self'" in policies and any(p.startswith("sandbox ") for p in policies), policies
            assert all("allow-same-origin" not in p for p in policies)
        # The caller's credentials for the daemon (its token, the origin's cookies) never reach the server.
        echo = b.post(f"{port}/echo", headers={"Cookie": "console-session=daemon-cookie"}, content=b"body")
        assert echo.status_code == 200 and echo.content.endswith(b"body")
        seen = echo.content.decode().lower()
        assert "daemon-cookie" not in seen and TOKENS["b"] not in echo.text and "authorization" not in seen
