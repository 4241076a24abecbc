"""A job's figures and the alerts, on a real daemon (TCP, two projects and a root token): what
happened to real sandboxes, commands, trajectories and verifications is counted by cause, over time,
each project seeing only its own; alerts fire from those figures and from quotas, and clear."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError, SandboxError, UnavailableError
from sandfleet.models import ExecAction, ExecRequest, Resources

from conftest import Daemon, destroy_daemon, make_daemon, wait_until

ROOT = "jobs-root-secret-000000001"
TOKENS = {"a": "jobs-team-a-secret-000001", "b": "jobs-team-b-secret-000002", "full": "jobs-full-secret-000003"}
CONFIG = f"""
[jobs.alerts]
window = 10
min_runs = 3
failure_ratio = {{ timeout = 0.2, infra = 0.05 }}

[[iam.projects]]
path = "org/team-a"

[[iam.projects]]
path = "org/team-b"

[[iam.projects]]
path = "org/full"
quota = {{ sandboxes = 1 }}

[[iam.tokens]]
name = "root"
token = "{ROOT}"
role = "admin"

[[iam.tokens]]
name = "a"
token = "{TOKENS["a"]}"
project = "org/team-a"

[[iam.tokens]]
name = "b"
token = "{TOKENS["b"]}"
project = "org/team-b"

[[iam.tokens]]
name = "full"
token = "{TOKENS["full"]}"
project = "org/full"
"""


@pytest.fixture(scope="module")
def node() -> Iterator[tuple[Daemon, str]]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = make_daemon("jobs", f'tcp = "127.0.0.1:{port}"\n' + CONFIG)
    try:
        d.start()
        yield d, f"http://127.0.0.1:{port}"
    finally:
        destroy_daemon(d)


def _client(url: str, name: str) -> Client:
    return Client(url=url, token=ROOT if name == "root" else TOKENS[name], timeout=60)


def test_a_job_counts_what_happened_to_it_by_cause(node: tuple[Daemon, str]) -> None:
    _, url = node
    job = f"grpo-{uuid.uuid4().hex[:6]}"
    with _client(url, "a") as fleet:
        sb = fleet.create(image="busybox", labels={"job": job}, resources=Resources(memory="64MiB"), idle_ttl=300)
        assert sb.exec("true").exit_code == 0
        assert sb.exec("exit 1").exit_code == 1  # agent
        assert sb.exec("sleep 5", timeout=0.5).timed_out  # timeout
        oom = sb.exec("head -c 200m /dev/zero | tail", timeout=60)  # the memory limit ends it
        assert oom.exit_code == 137 and oom.oom_killed, oom
        assert sb.verify("true").passed  # passed, reward 1.0
        broken = sb.verify("exit 3")  # the checker itself broke: the verifier's fault
        assert broken.cause == "verifier", broken

        traj = fleet.trajectory(f"{job}-t0", SandboxSpec(image="busybox", idle_ttl=300), labels={"job": job})
        first = traj.step(ExecAction(exec=ExecRequest(command="echo one")), step=0)
        again = traj.step(ExecAction(exec=ExecRequest(command="echo one")), step=0)  # a restarted trainer
        assert again.replayed and not first.replayed
        failed = traj.step(ExecAction(exec=ExecRequest(command="exit 2")), step=1)
        assert failed.cause == "agent"

        stats = fleet.job(job)
        assert stats.key == "job" and stats.value == job
        assert stats.states == {"running": 2}
        assert stats.created == 2 + 2  # the agent's, the trajectory's, and the two verifiers'
        assert stats.stopped == 2  # the verifiers
        assert stats.steps == 2 and stats.replays == 1
        assert stats.oom_kills == 1
        assert stats.failures == {"agent": 3, "timeout": 1, "verifier": 1}, stats.failures
        assert stats.verifications == {"passed": 1, "verifier": 1} and stats.pass_rate == 0.5
        assert stats.rewards.count == 1 and stats.rewards.mean == 1.0
        assert [b.count for b in stats.rewards.bins if b.lo == 1.0 and b.hi == 1.0] == [1]
        by_kind = {(e.cause, e.kind) for e in stats.examples}
        assert {("agent", "exec"), ("agent", "step"), ("timeout", "exec"), ("verifier", "verify")} <= by_kind
        step_example = next(e for e in stats.examples if e.kind == "step")
        assert step_example.trajectory_id == f"{job}-t0" and step_example.step == 1
        assert step_example.sandbox_id == traj.sandbox.id and "exit 2" in step_example.message
        assert [e.at for e in stats.examples] == sorted((e.at for e in stats.examples), reverse=True)
        assert stats.cpu == 2 * 1.0 and stats.memory > 0
        # the series adds up to the totals, a point per bucket
        assert sum(p.created for p in stats.series) == stats.created
        assert sum(p.steps for p in stats.series) == 2 and sum(p.failures.get("agent", 0) for p in stats.series) == 3
        ts = [p.t for p in stats.series]
        assert all(b - a == stats.bucket for a, b in zip(ts, ts[1:], strict=False))

        # the jobs list carries the same figures
        groups = {g.value: g for g in fleet.jobs().jobs}
        assert fleet.jobs().counted and groups[job].failures == 5 and groups[job].steps == 2
        assert groups[job].verified == 2 and groups[job].passed == 1
        assert not fleet.jobs(key="team").counted

        # stuck: no request for a second; slowest: the oldest first
        time.sleep(1.5)
        stuck = fleet.job(job, stuck_after=1).stuck
        assert {s.id for s in stuck} == {sb.id, traj.sandbox.id}
        assert all(s.why and s.why[0].startswith("no request for") for s in stuck), stuck
        assert fleet.job(job, stuck_after=600).stuck == []
        assert [s.id for s in fleet.job(job).slowest] == [sb.id, traj.sandbox.id]
        sb.stop()
        traj.close()
        assert wait_until(lambda: fleet.job(job).states == {}, 30)


def test_each_project_sees_its_own_figures_and_alerts(node: tuple[Daemon, str]) -> None:
    _, url = node
    job = f"shared-{uuid.uuid4().hex[:6]}"
    with _client(url, "a") as a, _client(url, "b") as b, _client(url, "root") as root:
        sa = a.create(image="busybox", labels={"job": job}, idle_ttl=300)
        sb = b.create(image="busybox", labels={"job": job}, idle_ttl=300)
        for _ in range(3):
            assert sa.exec("sleep 5", timeout=0.2).timed_out
        assert sb.exec("exit 1").exit_code == 1
        assert a.job(job).failures == {"timeout": 3}
        assert b.job(job).failures == {"agent": 1}
        assert root.job(job).failures == {"timeout": 3, "agent": 1}
        assert [s.id for s in a.job(job).slowest] == [sa.id]  # never the other project's sandboxes
        only_a = f"only-a-{uuid.uuid4().hex[:6]}"
        with a.create(image="busybox", labels={"job": only_a}, idle_ttl=300), pytest.raises(NotFoundError):
            b.job(only_a)  # as a job that does not exist
        with pytest.raises(NotFoundError):
            a.job("never-a-job")

        # 3 timeouts of 3 runs in the window: project a's failure_rate fires; b's figures have none
        def firing(c: Client) -> list[object]:
            return [x for x in c.alerts() if x.name == "failure_rate" and x.labels.get("job") == job]

        assert wait_until(lambda: firing(a), 25), root.alerts()
        alert = firing(a)[0]
        assert alert.labels == {"job": job, "label": "job", "project": "org/team-a", "cause": "timeout"}, alert
        assert alert.severity == "critical" and alert.threshold == 0.2
        assert 0.75 <= alert.value <= 1.0  # 3 timeouts of 3 commands and (if still in the window) a create
        assert firing(b) == [] and firing(root) == firing(a)
        metrics = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {ROOT}"}).text
        assert 'sandfleet_alerts_firing{name="failure_rate",severity="critical"} 1.0' in metrics
        # the window (10 s) passes with nothing failing: it clears
        assert wait_until(lambda: not firing(root), 40)
        sa.stop()
        sb.stop()


def test_a_project_at_its_quota_fires_quota_exhausted(node: tuple[Daemon, str]) -> None:
    _, url = node
    with _client(url, "full") as full, _client(url, "a") as a, _client(url, "root") as root:

        def exhausted(c: Client) -> list[object]:
            return [x for x in c.alerts() if x.name == "quota_exhausted"]

        with full.create(image="busybox", idle_ttl=300):
            assert wait_until(lambda: exhausted(full), 25)
            got = exhausted(full)[0]
            assert got.labels == {"project": "org/full", "dim": "sandboxes"} and got.value == got.threshold == 1
            assert exhausted(a) == [] and exhausted(root) == exhausted(full)
        assert wait_until(lambda: not exhausted(root), 25)


def test_a_job_path_takes_any_label_value(node: tuple[Daemon, str]) -> None:
    _, url = node
    with _client(url, "root") as root:
        job = f"team/x y?{uuid.uuid4().hex[:4]}"
        with root.create(image="busybox", labels={"job": job}, idle_ttl=300) as sb:
            got = root.job(job)
            assert got.value == job and [s.id for s in got.slowest] == [sb.id]
        with pytest.raises(InvalidArgumentError):
            root.job("")
        answer = httpx.get(f"{url}/v1/jobs/x", params={"stuck_after": "0"}, headers={"Authorization": f"Bearer {ROOT}"})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_argument"


def test_a_list_of_trajectories_gives_the_newest_and_how_many_match(node: tuple[Daemon, str]) -> None:
    """Closed trajectories are listed from what they left memory with (a list of a job's thousands reads
    no log again): their state, reward and verdict as closed; a deleted one is gone; `limit` gives the
    newest and `total`."""
    _, url = node
    job = f"list-{uuid.uuid4().hex[:6]}"
    spec = SandboxSpec(image="busybox", idle_ttl=300)
    with _client(url, "a") as fleet:
        trajs = [fleet.trajectory(f"{job}-{i}", spec, labels={"job": job}) for i in range(3)]
        for t in trajs:
            t.exec("echo hi")
        assert trajs[0].verify("true").passed
        trajs[0].close(reward=0.5)
        trajs[1].close()
        for _ in range(2):  # the second time from memory
            listed = {t.id: t for t in fleet.trajectories({"job": job})}
            assert set(listed) == {t.id for t in trajs}
            assert listed[trajs[0].id].state == "closed" and listed[trajs[0].id].reward == 0.5
            assert listed[trajs[0].id].verification is not None and listed[trajs[0].id].verification.passed
            assert listed[trajs[2].id].state == "open" and listed[trajs[2].id].steps == 1
        newest = fleet.trajectories({"job": job}, limit=2)
        assert [t.id for t in newest] == [trajs[2].id, trajs[1].id]
        raw = httpx.get(
            f"{url}/v1/trajectories",
            params={"label": f"job={job}", "limit": 1},
            headers={"Authorization": f"Bearer {TOKENS['a']}"},
        ).json()
        assert raw["total"] == 3 and [t["id"] for t in raw["trajectories"]] == [trajs[2].id]
        assert [t.id for t in fleet.trajectories({"job": job}, "closed")] == [trajs[0].id, trajs[1].id]
        trajs[1].delete()
        assert {t.id for t in fleet.trajectories({"job": job})} == {trajs[0].id, trajs[2].id}
        with _client(url, "b") as b:
            assert b.trajectories({"job": job}) == []  # another project's, never listed
        trajs[2].close()


def test_a_create_that_failed_once_its_sandbox_ran_is_the_jobs_failure(node: tuple[Daemon, str]) -> None:
    """A user the image does not have is found only once the sandbox runs: the create fails (the
    caller's fault), its sandbox stops, and the job counts one failed create, never a created one."""
    _, url = node
    job = f"baduser-{uuid.uuid4().hex[:6]}"
    with _client(url, "a") as fleet:
        with pytest.raises(SandboxError) as err:
            fleet.create(image="busybox", user="nosuchuser", labels={"job": job}, idle_ttl=300, timeout=60)
        assert err.value.cause == "caller", err.value
        stats = fleet.job(job)
        assert (stats.created, stats.failures) == (0, {"caller": 1}), stats
        assert [(e.kind, e.cause) for e in stats.examples] == [("create", "caller")]
        assert "nosuchuser" in stats.examples[0].message
        assert wait_until(lambda: fleet.job(job).stopped == 1, 30)


def test_creates_refused_by_a_quota_or_a_draining_node_are_the_jobs_refusals(node: tuple[Daemon, str]) -> None:
    """A create refused before any sandbox existed (the project's quota, the node draining) is counted
    in its job as refused, by why, with the refusal to read; never as a failure, and only in the
    figures of the project that asked."""
    _, url = node
    job = f"refused-{uuid.uuid4().hex[:6]}"
    with _client(url, "full") as full, _client(url, "root") as root, _client(url, "a") as a:
        with full.create(image="busybox", labels={"job": job}, idle_ttl=300) as sb:
            with pytest.raises(ResourceExhaustedError):  # (the SDK tries again until its timeout)
                full.create(image="busybox", labels={"job": job}, idle_ttl=300, timeout=2)
            batch = full.create_many([SandboxSpec(image="busybox", labels={"job": job})] * 2, retry_for=0)
            assert all(isinstance(r, ResourceExhaustedError) for r in batch), batch
            stats = full.job(job)
            assert stats.created == 1 and stats.failures == {}, stats
            quota = stats.refused.get("quota", 0)
            assert quota >= 3 and set(stats.refused) == {"quota"}, stats.refused
            assert stats.refusals and stats.refusals[0].message.startswith("quota: project org/full"), stats.refusals
            assert sum(p.refused for p in stats.series) == quota
            assert not _has_job(a, job)  # another project's: not even its refusals
            # A trajectory's sandbox and a fork's children: in the job of the labels they would get.
            with pytest.raises(ResourceExhaustedError):
                full.trajectory(f"{job}-t", SandboxSpec(image="busybox"), labels={"job": job}, retry_for=2)
            with pytest.raises(ResourceExhaustedError):
                sb.fork(2, labels={"job": job})
            assert full.job(job).refused["quota"] >= quota + 3
            # A refusal never makes a job of its own (it costs nothing: it would push real jobs out).
            with pytest.raises(ResourceExhaustedError):
                full.create(image="busybox", labels={"job": f"{job}-new"}, timeout=1)
            assert not _has_job(full, f"{job}-new")
        root.drain(True)
        try:
            with pytest.raises(UnavailableError):
                full.create(image="busybox", labels={"job": job}, idle_ttl=300, timeout=2)
        finally:
            root.drain(False)
        stats = full.job(job)
        assert stats.refused["draining"] >= 1 and stats.failures == {}, stats
        assert stats.refusals[0].message.startswith("draining: node"), stats.refusals


def _has_job(fleet: Client, job: str) -> bool:
    try:
        fleet.job(job)
    except NotFoundError:
        return False
    return True


def test_a_jobs_figures_come_back_after_a_restart_and_a_damaged_file_is_set_aside(node: tuple[Daemon, str]) -> None:
    """A daemon stopped and started again (an upgrade) reads its jobs' figures back: the totals, the
    series and the failures as they were. A file of figures it cannot use is moved aside and the
    daemon starts anyway, counting anew."""
    d, url = node
    job = f"restart-{uuid.uuid4().hex[:6]}"
    with _client(url, "a") as a:
        sb = a.create(image="busybox", labels={"job": job}, idle_ttl=300)
        assert sb.exec("exit 1").exit_code == 1
        before = a.job(job)
    d.stop()
    saved = d.state_dir / "jobs.json"
    assert saved.is_file()
    d.start()
    with _client(url, "a") as a:
        after = a.job(job)
        assert (after.created, after.execs, after.failures) == (1, 1, {"agent": 1}), after
        assert (after.since, after.examples) == (before.since, before.examples)
        assert sum(p.created for p in after.series) == 1 and after.states == {"running": 1}
        assert a.get(sb.id).exec("exit 2").exit_code == 2  # the sandbox carried on, and so does the count
        assert a.job(job).failures == {"agent": 2}
    d.stop()
    saved.write_bytes(b'{"version": 1, "label": "job", "jobs": [{"project": ')  # cut short
    d.start()
    assert len(list(d.state_dir.glob("jobs.json.corrupt-*"))) == 1
    with _client(url, "a") as a:
        anew = a.job(job)  # known by its live sandbox, its counts from this start
        assert (anew.created, anew.failures, anew.states) == (0, {}, {"running": 1}), anew
        a.get(sb.id).stop()
