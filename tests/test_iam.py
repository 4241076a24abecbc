"""Projects, tokens and quotas (daemon/security/iam.py, daemon/security/tenancy.py): the IAM core on its own, the routes
over a scoped node service on the fake tier (no root), and a real daemon with `[iam]` over TCP."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from sandfleet import Client, SandboxSpec
from sandfleet.client import AsyncClient
from sandfleet.client.aio import AsyncSandbox
from sandfleet.client.sync import Sandbox
from sandfleet.daemon.api import create_app
from sandfleet.daemon.config import DaemonConfig
from sandfleet.daemon.security.iam import CURRENT, LEGACY, ROOT, Iam, IamConfig, Principal
from sandfleet.daemon.security.tenancy import Tenancy
from sandfleet.errors import (
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxNotFoundError,
    UnauthenticatedError,
)
from sandfleet.models import AuditQuery
from sandfleet.testing import InProcessNode

from conftest import Daemon, destroy_daemon, make_daemon

GiB = 1024**3
TOKENS = {
    "root-admin": "root-admin-secret-0001",
    "root-ro": "root-read-only-secret-0002",
    "a": "team-a-user-secret-00003",
    "a-job": "team-a-job-user-secret-04",
    "b": "team-b-user-secret-000005",
    "a-ro": "team-a-read-only-secret-6",
}
IAM_TOML = f"""
[[iam.projects]]
path = "acme"
quota = {{ sandboxes = 4, cpu = 8, memory = "64GiB" }}

[[iam.projects]]
path = "acme/team-a"
quota = {{ sandboxes = 3 }}

[[iam.projects]]
path = "acme/team-a/job-1"
quota = {{ sandboxes = 3, cpu = 4 }}

[[iam.projects]]
path = "acme/team-b"

[[iam.projects]]
path = "burst"
quota = {{ creates_per_second = 1 }}

[[iam.tokens]]
name = "root-admin"
token = "{TOKENS["root-admin"]}"
role = "admin"

[[iam.tokens]]
name = "root-ro"
token_sha256 = "{hashlib.sha256(TOKENS["root-ro"].encode()).hexdigest()}"
role = "read-only"

[[iam.tokens]]
name = "a"
token = "{TOKENS["a"]}"
project = "acme/team-a"

[[iam.tokens]]
name = "a-job"
token = "{TOKENS["a-job"]}"
project = "acme/team-a/job-1"

[[iam.tokens]]
name = "b"
token = "{TOKENS["b"]}"
project = "acme/team-b"

[[iam.tokens]]
name = "a-ro"
token = "{TOKENS["a-ro"]}"
project = "acme/team-a"
role = "read-only"

[[iam.tokens]]
name = "burst"
token = "burst-user-secret-0000007"
project = "burst"
"""


def _config(extra: str = "") -> IamConfig:
    import tomllib

    return IamConfig.model_validate(tomllib.loads(IAM_TOML + extra)["iam"])


def _bearer(name: str) -> str:
    return f"Bearer {TOKENS[name]}"


# -- the IAM core ----------------------------------------------------------------------------------


@pytest.mark.unit
def test_authenticate_bearer_basic_and_legacy() -> None:
    iam = Iam(_config(), legacy_token="the-old-single-token")
    assert iam.authenticate(_bearer("a")) == Principal("a", "acme/team-a", "user")
    basic = base64.b64encode(f"anyone:{TOKENS['b']}".encode()).decode()
    assert iam.authenticate(f"Basic {basic}").name == "b"
    assert iam.authenticate(_bearer("root-ro")).role == "read-only"  # configured by its hash
    assert iam.authenticate("Bearer the-old-single-token") is LEGACY
    for bad in ("", TOKENS["a"], f"Bearer {TOKENS['a']}x", "Basic !!!", f"Basic {TOKENS['a']}", "Bearer "):
        with pytest.raises(UnauthenticatedError):
            iam.authenticate(bad)
    token = CURRENT.set(None)
    try:
        assert iam.enter("", anonymous=ROOT) is ROOT and CURRENT.get() is ROOT
        with pytest.raises(UnauthenticatedError):
            iam.enter("")
        assert iam.enter(_bearer("a"), anonymous=ROOT).name == "a"
    finally:
        CURRENT.reset(token)


@pytest.mark.unit
def test_principals_see_their_subtree() -> None:
    a = Principal("a", "acme/team-a", "user")
    assert a.sees("acme/team-a") and a.sees("acme/team-a/job-1")
    assert not a.sees("acme/team-ab") and not a.sees("acme") and not a.sees(None)
    assert ROOT.sees(None) and ROOT.sees("anything/at/all")
    assert a.place(None) == "acme/team-a" and a.place("acme/team-a/x") == "acme/team-a/x"
    with pytest.raises(PermissionDeniedError, match="may not create in project acme/team-b"):
        a.place("acme/team-b")
    ro = Principal("ro", None, "read-only")
    assert not ro.can_write and a.can_write
    with pytest.raises(PermissionDeniedError, match="token ro is read-only"):
        ro.require_write()
    assert a.actor("10.0.0.1") == "token:a@10.0.0.1" and a.actor(None) == "token:a@unix"
    assert ROOT.actor(None) == "unix" and LEGACY.actor("10.0.0.1") == "token@10.0.0.1"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('[[iam.projects]]\npath = "acme/team-c"\nquota = { sandboxes = 5 }\n', "exceeds what its ancestor acme holds"),
        ('[[iam.projects]]\npath = "acme/team-a/job-1/x"\nquota = { cpu = 5 }\n', "ancestor acme/team-a/job-1"),
        ('[[iam.projects]]\npath = "burst/x"\nquota = { creates_per_second = 2 }\n', "ancestor burst holds"),
        ('[[iam.projects]]\npath = "acme"\n', "project acme is listed twice"),
        ('[[iam.tokens]]\nname = "a"\ntoken = "another-secret-00000001"\n', "token name a is used twice"),
        (f'[[iam.tokens]]\nname = "a2"\ntoken = "{TOKENS["a"]}"\n', "its secret is another token's too"),
        ('[[iam.tokens]]\nname = "c"\ntoken = "another-secret-00000001"\nproject = "other"\n', "not listed"),
        ('[[iam.tokens]]\nname = "c"\ntoken = "short"\n', "at least 16 characters"),
        ('[[iam.tokens]]\nname = "c"\n', "exactly one of token and token_sha256"),
        ('[[iam.tokens]]\nname = "c"\ntoken = "another-secret-00000001"\nrole = "root"\n', "role"),
    ],
)
def test_bad_configs_are_refused(extra: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        _config(extra)


@pytest.mark.unit
def test_a_token_under_a_listed_project_and_tcp_with_iam_tokens_only() -> None:
    _config('[[iam.tokens]]\nname = "c"\ntoken = "another-secret-00000001"\nproject = "acme/team-b/job-9"\n')
    cfg = DaemonConfig.model_validate({"tcp": "127.0.0.1:1", "iam": {"tokens": [{"name": "x", "token": "x" * 16}]}})
    assert cfg.token is None
    with pytest.raises(ValidationError, match="requires a bearer token"):
        DaemonConfig.model_validate({"tcp": "127.0.0.1:1", "iam": {"projects": [{"path": "p"}]}})
    with pytest.raises(ValidationError, match="daemon's `token` too"):
        DaemonConfig.model_validate({"token": "x" * 16, "iam": {"tokens": [{"name": "x", "token": "x" * 16}]}})


@pytest.mark.unit
def test_quotas_on_every_level_name_the_project() -> None:
    iam = Iam(_config())
    usage = {"acme/team-a/job-1": (2, 2.0, 2 * GiB)}
    iam.check_create("acme/team-a/job-1", 1.0, GiB, usage)  # 3 of job-1's 3, team-a's 3, acme's 4
    with pytest.raises(ResourceExhaustedError, match=r"^project acme/team-a/job-1: quota of 4 CPUs reached"):
        iam.check_create("acme/team-a/job-1", 3.0, GiB, usage)
    # Fits the job (3 sandboxes) but not the team (3, one held by another job of the team).
    usage = {"acme/team-a/job-1": (1, 1.0, GiB), "acme/team-a/job-2": (1, 1.0, GiB), "acme/team-a": (1, 1.0, GiB)}
    with pytest.raises(ResourceExhaustedError) as err:
        iam.check_create("acme/team-a/job-1", 1.0, GiB, usage)
    assert str(err.value) == "project acme/team-a: quota of 3 sandboxes reached (3 in use)"
    # Fits the team but not the org (team-b's and unlisted projects under acme count too).
    usage = {"acme/team-b": (2, 2.0, GiB), "acme/x/y": (2, 1.0, GiB), "other": (50, 50.0, GiB), "": (9, 9.0, 0)}
    with pytest.raises(ResourceExhaustedError, match="^project acme: quota of 4 sandboxes reached"):
        iam.check_create("acme/team-a", 1.0, GiB, usage)
    with pytest.raises(ResourceExhaustedError, match=r"^project acme: quota of 64GiB memory reached \(2GiB in use"):
        iam.check_create("acme/team-b", 1.0, 63 * GiB, {"acme/team-b": (1, 1.0, 2 * GiB)})
    with pytest.raises(ResourceExhaustedError, match="project acme/team-a/job-1: quota of 3 sandboxes"):
        iam.check_create("acme/team-a/job-1", 1.0, GiB, {}, count=4)
    iam.check_create("other", 100.0, 1000 * GiB, usage)  # not listed, nothing above it listed: no quota
    iam.check_create(None, 100.0, 1000 * GiB, usage)


@pytest.mark.unit
def test_a_gateways_share_of_the_headroom() -> None:
    iam = Iam(_config())
    # acme: 4 sandboxes. Two gateways at share 0.5 saw 2 in use: each may add 1 on top of it.
    seen = {"acme/team-b": (2, 2.0, GiB)}
    mine = {"acme/team-b": (3, 3.0, GiB)}  # what this gateway counts: the snapshot plus its own one create
    iam.check_create("acme/team-b", 1.0, GiB, seen, share=0.5, baseline=seen)
    with pytest.raises(ResourceExhaustedError, match=r"quota of 4 sandboxes reached \(3 in use, this gateway's share"):
        iam.check_create("acme/team-b", 1.0, GiB, mine, share=0.5, baseline=seen)
    # Without a baseline, a share is a fixed part of the quota: 0.5 of 4 is 2.
    iam.check_create("acme/team-b", 1.0, GiB, {"acme/team-b": (1, 1.0, GiB)}, share=0.5)
    with pytest.raises(ResourceExhaustedError):
        iam.check_create("acme/team-b", 1.0, GiB, {"acme/team-b": (2, 1.0, GiB)}, share=0.5)


@pytest.mark.unit
def test_creates_per_second_per_project_and_ancestors() -> None:
    iam = Iam(_config('[[iam.projects]]\npath = "burst/job"\nquota = { creates_per_second = 1 }\n'))
    iam.take_create("burst/job", now=100.0)
    with pytest.raises(ResourceExhaustedError, match="^project burst/job: quota of 1 creates per second reached"):
        iam.take_create("burst/job", now=100.5)
    with pytest.raises(ResourceExhaustedError, match="^project burst: quota of 1 creates per second"):
        iam.take_create("burst/other", now=100.5)  # the parent's bucket was taken from too
    iam.take_create("burst/other", now=101.0)
    iam.take_create("burst/job", count=5, now=102.0)  # a fork of 5: let through, into debt ...
    with pytest.raises(ResourceExhaustedError):
        iam.take_create("burst/job", now=105.0)  # ... waited out
    iam.take_create("burst/job", now=107.0)
    # A gateway's share of the rate: half of 1/s refills in 2 s.
    iam2 = Iam(_config())
    iam2.take_create("burst", share=0.5, now=0.0)
    with pytest.raises(ResourceExhaustedError, match="this gateway's share 0.5"):
        iam2.take_create("burst", share=0.5, now=1.5)
    iam2.take_create("burst", share=0.5, now=2.0)
    iam2.take_create("acme", now=0.0)  # no rate on acme: nothing taken
    iam2.take_create(None)


@pytest.mark.unit
def test_quota_checks_stay_fast() -> None:
    projects = [{"path": f"org/t{i}", "quota": {"sandboxes": 1000}} for i in range(100)]
    iam = Iam(IamConfig.model_validate({"projects": [{"path": "org", "quota": {"sandboxes": 100000}}, *projects]}))
    usage = {f"org/t{i}/job-{j}": (10, 10.0, GiB) for i in range(100) for j in range(10)}
    t0 = time.perf_counter()
    for _ in range(100):
        iam.check_create("org/t7/job-3", 1.0, GiB, usage)
    per_call = (time.perf_counter() - t0) / 100
    assert per_call < 0.005, per_call  # 1,000 projects of 10 sandboxes each: well under a millisecond here


# -- the routes over a scoped service, on the fake tier ------------------------------------------


@pytest.fixture
async def scoped(tmp_path: Path) -> AsyncIterator[tuple[InProcessNode, Tenancy]]:
    async with InProcessNode(tmp_path, max_sandboxes=64) as node:
        iam = Iam(_config(), legacy_token="legacy-token-0000000001")
        tenancy = Tenancy(node.service, iam)
        node.app = create_app(node.service, tenancy, node.metrics, auth=iam.enter)
        yield node, tenancy


def _client(node: InProcessNode, name: str | None) -> AsyncClient:
    token = TOKENS[name] if name else None
    return AsyncClient(url="http://in-process", token=token, transport=httpx.ASGITransport(app=node.app), timeout=5)


@pytest.mark.unit
async def test_projects_are_walled_off(scoped: tuple[InProcessNode, Tenancy]) -> None:
    node, _ = scoped
    async with _client(node, "a") as a, _client(node, "b") as b, _client(node, "root-admin") as root:
        sa = await a.create(image="busybox")
        assert sa.info.spec.project == "acme/team-a"  # the token's project by default
        sb = await b.create(image="busybox", labels={"k": "v"})
        none = await root.create(image="busybox", labels={"k": "v"})
        assert none.info.spec.project is None
        assert [s.id for s in await a.list()] == [sa.id]
        assert {s.id for s in await root.list()} == {sa.id, sb.id, none.id}
        for other in (sb.id, none.id):
            with pytest.raises(SandboxNotFoundError) as err:
                await a.get(other)
            assert str(err.value) == f"sandbox {other} not found"
            with pytest.raises(SandboxNotFoundError):
                await AsyncSandbox(a, (await root.get(other)).info).exec("true")
        with pytest.raises(PermissionDeniedError, match="may not create in project acme/team-b"):
            await a.create(SandboxSpec(image="busybox", project="acme/team-b"))
        sub = await a.create(SandboxSpec(image="busybox", project="acme/team-a/job-1"))
        # Label-wide calls touch only what the caller sees.
        assert await a.stop_many({"k": "v"}) == []
        assert (await root.get(sb.id)).info.state == "running"
        assert await b.stop_many({"k": "v"}) == [sb.id]
        assert (await root.get(none.id)).info.state == "running"
        # Snapshots and trajectories are scoped the same way.
        with pytest.raises(SandboxNotFoundError):
            await AsyncSandbox(b, sa.info).snapshot()
        await sub.stop()
        await sa.stop()
        await none.stop()


@pytest.mark.unit
async def test_read_only_and_node_wide_calls(scoped: tuple[InProcessNode, Tenancy]) -> None:
    node, _ = scoped
    async with _client(node, "a") as a, _client(node, "a-ro") as ro, _client(node, "root-ro") as rro:
        sa = await a.create(image="busybox")
        assert [s.id for s in await ro.list()] == [sa.id]
        assert (await ro.get(sa.id)).info.state == "running"
        with pytest.raises(PermissionDeniedError, match="token a-ro is read-only"):
            await ro.create(image="busybox")
        with pytest.raises(PermissionDeniedError, match="token a-ro is read-only"):
            await AsyncSandbox(ro, sa.info).stop()
        with pytest.raises(PermissionDeniedError, match="token root-ro is read-only"):
            await rro.create(image="busybox")
        assert sa.id in {s.id for s in await rro.list()}
        with pytest.raises(PermissionDeniedError, match="needs the root"):
            await a.audit()
        assert (await rro.audit(kinds=["api"])).records
        with pytest.raises(PermissionDeniedError, match="needs an admin token of the root"):
            await a.delete_image("busybox:latest")
        await sa.stop()
    # The audit stream names the token.
    actors = {r.actor for r in await node.service.read_audit(AuditQuery(limit=10000)) if r.kind == "api"}
    assert {"token:a@127.0.0.1", "token:a-ro@127.0.0.1", "token:root-ro@127.0.0.1"} <= actors, actors


@pytest.mark.unit
async def test_quotas_through_the_api(scoped: tuple[InProcessNode, Tenancy]) -> None:
    node, _ = scoped
    async with _client(node, "a-job") as job, _client(node, "a") as a, _client(node, "b") as b:
        made = [await job.create(image="busybox") for _ in range(2)]
        await a.create(image="busybox")  # team-a: 3 of 3
        with pytest.raises(ResourceExhaustedError) as err:
            await job.create(image="busybox", timeout=0.5)  # fits job-1 (2 of 3), not team-a
        assert "project acme/team-a: quota of 3 sandboxes reached (3 in use)" in str(err.value)
        await b.create(image="busybox")  # acme: 4 of 4
        with pytest.raises(ResourceExhaustedError, match="project acme: quota of 4 sandboxes"):
            await b.create(image="busybox", timeout=0.5)
        # A batch takes what fits, item by item; a fork of the job's sandbox is counted too.
        await made[0].stop()
        results = await job.create_many([SandboxSpec(image="busybox")] * 2, retry_for=0)
        assert sum(isinstance(r, Exception) for r in results) == 1
        # Concurrent creates never overshoot.
        for s in await a.list():
            await AsyncSandbox(a, s).stop()
        got = await asyncio.gather(*(a.create(image="busybox", timeout=0.5) for _ in range(6)), return_exceptions=True)
        assert sum(not isinstance(r, BaseException) for r in got) == 3, got
        assert node.service.core.table.project_usage().get("acme/team-a", (0,))[0] == 3


@pytest.mark.unit
async def test_creates_per_second_through_the_api(scoped: tuple[InProcessNode, Tenancy]) -> None:
    node, _ = scoped
    transport = httpx.ASGITransport(app=node.app)
    async with AsyncClient(url="http://x", token="burst-user-secret-0000007", transport=transport, timeout=5) as c:
        await c.create(image="busybox")
        with pytest.raises(ResourceExhaustedError, match="project burst: quota of 1 creates per second reached"):
            await c.create(image="busybox", timeout=0.2)


# -- a real daemon ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def iam_daemon() -> Iterator[tuple[Daemon, str]]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    port = _free_port()
    d = make_daemon("iam", f'tcp = "127.0.0.1:{port}"\n' + IAM_TOML)
    try:
        d.start()
        yield d, f"http://127.0.0.1:{port}"
    finally:
        destroy_daemon(d)


def test_a_daemon_with_projects(iam_daemon: tuple[Daemon, str]) -> None:
    d, url = iam_daemon
    with (
        Client(url=url, token=TOKENS["a"], timeout=60) as a,
        Client(url=url, token=TOKENS["b"], timeout=60) as b,
        Client(url=url, token=TOKENS["a-ro"], timeout=60) as ro,
        d.client() as unix,
    ):
        sa = a.create(image="busybox", idle_ttl=120)
        assert sa.info.spec.project == "acme/team-a"
        assert sa.exec("echo hi").stdout == "hi\n"
        # B neither sees nor touches A's sandbox: not_found, as for one that does not exist.
        assert [s.id for s in b.list()] == []
        for call in (
            lambda: b.get(sa.id),
            lambda: Sandbox(b, sa.info).exec("true"),
            lambda: Sandbox(b, sa.info).files.read("/etc/hostname"),
            lambda: Sandbox(b, sa.info).snapshot(),
        ):
            with pytest.raises(NotFoundError) as err:
                call()
            assert err.value.code == "not_found" and str(err.value) == f"sandbox {sa.id} not found"
        Sandbox(b, sa.info).stop()  # the SDK takes a not_found stop for "already gone" ...
        assert a.get(sa.id).info.state == "running"  # ... and it is A's, still running
        with pytest.raises(PermissionDeniedError):
            b.create(SandboxSpec(image="busybox", project="acme/team-a"))
        # Read-only: looks, never acts.
        assert [s.id for s in ro.list()] == [sa.id]
        with pytest.raises(PermissionDeniedError, match="read-only"):
            ro.create(image="busybox")
        with pytest.raises(PermissionDeniedError, match="read-only"):
            Sandbox(ro, sa.info).stop()
        # Quotas: team-a holds 3 sandboxes.
        more = [a.create(image="busybox", idle_ttl=120)]
        more.append(a.create(image="busybox", idle_ttl=120, idempotency_key="the-third"))  # 3 of 3
        with pytest.raises(ResourceExhaustedError) as quota:
            a.create(image="busybox", timeout=1)
        assert quota.value.code == "resource_exhausted" and "project acme/team-a: quota of 3" in str(quota.value)
        # A retry of a create that made its sandbox (its answer lost) gets it, at the quota as below it.
        assert a.create(image="busybox", idle_ttl=120, idempotency_key="the-third", timeout=1).id == more[-1].id
        # Root's socket: everything, as always.
        assert {s.id for s in unix.list()} >= {sa.id, *(m.id for m in more)}
        for s in (sa, *more):
            s.stop()
        # Without a token, or with a wrong one: unauthenticated.
        assert httpx.get(f"{url}/v1/sandboxes").status_code == 401
        assert httpx.get(f"{url}/v1/sandboxes", headers={"authorization": "Bearer nope"}).status_code == 401


def test_child_quota_above_parent_stops_the_daemon_config(tmp_path: Path) -> None:
    bad = IAM_TOML + '[[iam.projects]]\npath = "acme/team-c"\nquota = { cpu = 9 }\n'
    (tmp_path / "c.toml").write_text(bad)
    with pytest.raises(ValidationError, match="a child is never granted more than its parent"):
        DaemonConfig.load(tmp_path / "c.toml")
