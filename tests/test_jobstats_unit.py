"""A job's figures as the node counts them (`JobBook`, with a clock of the test's), and as a gateway
adds nodes' answers up (`cluster/job_figures.py`): buckets, windows, rewards, projects, bounds."""

from __future__ import annotations

import json

import pytest

from sandfleet.cluster.job_figures import merge_alerts, merge_groups, merge_stats
from sandfleet.daemon.node import jobstats, jobstore
from sandfleet.daemon.node.alerts import Alerts, AlertsConfig
from sandfleet.daemon.node.jobstats import BUCKET, JobBook, reward_bin, within_step
from sandfleet.daemon.node.lifecycle import FAILED, RUNNING, Sandbox, SandboxTable
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.errors import ResourceExhaustedError
from sandfleet.models import (
    REWARD_EDGES,
    ErrorBody,
    ExecResult,
    JobGroup,
    QuotaUse,
    SandboxSpec,
    StepResult,
    VerifyResult,
)

pytestmark = pytest.mark.unit
ALL = lambda _p: True  # noqa: E731 (the root sees every project)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _book() -> tuple[JobBook, SandboxTable, Clock]:
    table, clock = SandboxTable(), Clock()
    return JobBook(table, "job", clock), table, clock


def _sandbox(table: SandboxTable, sid: str, job: str | None, project: str | None = None, at: float = 0.0) -> Sandbox:
    labels = {"job": job} if job is not None else {}
    sb = Sandbox(sid, SandboxSpec(image="busybox", labels=labels, project=project), RUNNING, at, at)
    table.add(sb)
    return sb


def _exec(code: int, cause: str | None = None, timed_out: bool = False) -> ExecResult:
    return ExecResult(exit_code=code, stdout="", stderr="", duration=0.01, cause=cause, timed_out=timed_out)


def _verdict(cause: str | None, reward: float) -> VerifyResult:
    return VerifyResult(passed=cause is None, reward=reward, cause=cause, changed=[], duration=1.0)


def test_counts_land_in_buckets_and_add_up_to_the_totals() -> None:
    book, table, clock = _book()
    sb = _sandbox(table, "sb-1", "j", at=clock.now)
    book.event("sb-1", "created", {})
    book.executed(sb, _exec(0), "true")
    clock.now += BUCKET * 3  # two quiet buckets
    book.executed(sb, _exec(1, "agent"), "false")
    clock.now += 1
    with within_step("t-1", 4):
        book.executed(sb, _exec(124, "timeout", timed_out=True), "sleep 9")
    book.sample()
    stats = book.stats("j", ALL, 600, lambda _: [])
    assert stats is not None
    assert (stats.created, stats.execs, stats.failures) == (1, 3, {"agent": 1, "timeout": 1})
    assert [p.execs for p in stats.series] == [1, 0, 0, 2]  # a point per bucket, none missing
    assert stats.series[-1].states == {"running": 1}
    timeout = next(e for e in stats.examples if e.cause == "timeout")
    assert (timeout.kind, timeout.trajectory_id, timeout.step, timeout.message) == (
        "step",
        "t-1",
        4,
        "sleep 9: timed out",
    )
    assert stats.examples[0].cause == "timeout"  # newest first


def test_a_verifiers_failing_checks_are_its_verdict_not_a_failure() -> None:
    book, table, _ = _book()
    agent = _sandbox(table, "sb-a", "j")
    verifier = Sandbox(
        "sb-v", SandboxSpec(image="busybox", labels={"job": "j", "sandfleet.verify": "sb-a"}), RUNNING, 0, 0
    )
    table.add(verifier)
    book.executed(verifier, _exec(1, "agent"), "pytest")
    book.verified(agent, _verdict("agent", 0.0))
    book.verified(agent, _verdict(None, 1.0))
    book.verified(agent, _verdict(None, 0.55))
    book.verified(agent, _verdict("timeout", 0.0))
    stats = book.stats("j", ALL, 600, lambda _: [])
    assert stats is not None
    assert stats.failures == {"timeout": 1}  # the checks that could not judge; never the agent's fails
    assert stats.verifications == {"agent": 1, "passed": 2, "timeout": 1} and stats.pass_rate == 0.5
    assert (stats.rewards.count, stats.rewards.min, stats.rewards.max) == (3, 0.0, 1.0)
    assert {(b.lo, b.hi): b.count for b in stats.rewards.bins if b.count} == {
        (0.0, 0.1): 1,
        (0.5, 0.6): 1,
        (1.0, 1.0): 1,
    }


def test_reward_bins_cover_the_line() -> None:
    last = len(REWARD_EDGES)
    assert [reward_bin(r) for r in (-0.5, 0.0, 0.05, 0.99, 1.0, 1.5)] == [0, 1, 1, last - 1, last, last + 1]


def test_a_scoped_caller_sees_only_its_projects() -> None:
    book, table, _ = _book()
    a = _sandbox(table, "sb-a", "shared", "org/a")
    b = _sandbox(table, "sb-b", "shared", "org/b")
    book.executed(a, _exec(1, "agent"), "a")
    book.executed(b, _exec(1, "infra"), "b")
    sees_a = lambda p: p == "org/a"  # noqa: E731
    stats = book.stats(
        "shared", sees_a, 600, lambda projects: [QuotaUse(project=p, sandboxes=1, cpu=1, memory=1) for p in projects]
    )
    assert stats is not None and stats.failures == {"agent": 1} and [s.id for s in stats.slowest] == ["sb-a"]
    assert [q.project for q in stats.quotas] == ["org/a"]
    assert book.stats("shared", lambda p: p == "org/c", 600, lambda _: []) is None
    groups = book.counted([JobGroup(value="shared", count=2, states={"running": 2})], sees_a)
    assert groups[0].failures == 1


def test_stuck_sandboxes_say_why() -> None:
    book, table, clock = _book()
    quiet = _sandbox(table, "sb-quiet", "j", at=clock.now - 700)
    busy = _sandbox(table, "sb-busy", "j", at=clock.now - 10)
    lost = _sandbox(table, "sb-lost", "j", at=clock.now)
    lost.unresponsive = True
    book.event("sb-busy", "finding", {"detector": "fork_bomb"})
    quiet.inflight = 1
    stats = book.stats("j", ALL, 600, lambda _: [])
    assert stats is not None
    why = {s.id: s.why for s in stats.stuck}
    assert why == {
        "sb-quiet": ["a request running for 12 min"],
        "sb-busy": ["1 detector finding, the last 0 s ago"],
        "sb-lost": ["its agent is not answering"],
    }
    assert [s.id for s in stats.stuck] == ["sb-quiet", "sb-busy", "sb-lost"]  # the longest quiet first
    assert book.stuck_by_job(600) == {("", "j"): 3}
    del busy


def test_memory_is_bounded_by_jobs_and_idle_ones_go_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jobstats, "MAX_JOBS", 3)
    book, table, clock = _book()
    live = _sandbox(table, "sb-live", "live")
    book.event("sb-live", "created", {})
    book.sample()  # which jobs have live sandboxes: never forgotten for another
    for i in range(5):
        clock.now += 1
        sb = _sandbox(table, f"sb-{i}", f"old-{i}")
        book.event(sb.id, "created", {})
        table.move(sb, "stopping")
        table.move(sb, "stopped")
    assert len(book.jobs) == 3 and ("", "live") in book.jobs  # a job with live sandboxes stays
    assert {k[1] for k in book.jobs} == {"live", "old-3", "old-4"}
    # a book full of jobs with live sandboxes counts no new one (and says how much it left out)
    for i in (5, 6, 7):
        _sandbox(table, f"sb-{i}", f"busy-{i}")
    book.sample()
    assert {k[1] for k in book.jobs} == {"live", "busy-5", "busy-6"} and book.unbooked == 1
    book.event("sb-7", "created", {})
    assert book.unbooked > 1 and book.stats("busy-7", ALL, 600, lambda _: []) is not None  # its sandbox still
    del live


def test_a_step_that_failed_without_a_command_is_counted_once() -> None:
    book, table, _ = _book()
    sb = _sandbox(table, "sb-1", "j")
    error = ErrorBody(code="not_found", message="no such checkpoint", retryable=False, cause="caller")
    result = StepResult(
        trajectory_id="t",
        step=3,
        kind="rollback",
        replayed=False,
        error=error,
        cause="caller",
        started_at=0,
        duration=0,
    )
    book.stepped("sb-1", "t", result)
    ran = StepResult(
        trajectory_id="t",
        step=4,
        kind="exec",
        replayed=False,
        exec=_exec(1, "agent"),
        cause="agent",
        started_at=0,
        duration=0,
    )
    book.stepped("sb-1", "t", ran)  # its command's failure was counted as it ended (`executed`)
    book.replayed("sb-1")
    stats = book.stats("j", ALL, 600, lambda _: [])
    assert stats is not None and (stats.steps, stats.replays, stats.failures) == (2, 1, {"caller": 1})
    assert stats.examples[0].message == "rollback: no such checkpoint"
    del sb


def test_alerts_fire_from_the_window_and_keep_their_start() -> None:
    book, table, clock = _book()
    sb = _sandbox(table, "sb-1", "j", "org/a", at=clock.now)
    config = AlertsConfig(window=60, min_runs=4, failure_ratio={"infra": 0.2}, verifier_timeouts=1)
    alerts = Alerts(book, Metrics(), config, lambda: None, clock)
    for _ in range(3):
        book.executed(sb, _exec(255, "infra"), "x")
    assert alerts.evaluate() == []  # 3 runs: below min_runs
    book.executed(sb, _exec(0), "y")
    book.verified(sb, _verdict("timeout", 0))
    fired = {a.name: a for a in alerts.evaluate()}
    assert set(fired) == {"failure_rate", "verifier_timeouts"}
    assert fired["failure_rate"].value == 3 / 5 and fired["failure_rate"].labels["cause"] == "infra"
    began = fired["failure_rate"].since
    clock.now += 30
    assert {a.name: a.since for a in alerts.evaluate()}["failure_rate"] == began
    clock.now += 120  # out of the window
    assert alerts.evaluate() == []
    assert alerts.visible(lambda p: p == "org/b", root=False) == []


def test_a_gateway_adds_nodes_up() -> None:
    books = []
    for node in ("n1", "n2"):
        book, table, clock = _book()
        sb = _sandbox(table, f"sb-{node}", "j", at=clock.now - (1 if node == "n1" else 2))
        book.event(sb.id, "created", {})
        book.executed(sb, _exec(1, "agent"), "x")
        book.verified(sb, _verdict(None, 1.0 if node == "n1" else 0.0))
        book.sample()
        stats = book.stats(
            "j", ALL, 600, lambda _: [QuotaUse(project="org/a", sandboxes=1, cpu=1.0, memory=5, quota_sandboxes=4)]
        )
        assert stats is not None
        books.append((node, stats.model_dump(mode="json")))
    merged = merge_stats(books)
    assert (merged["created"], merged["failures"], merged["states"]) == (2, {"agent": 2}, {"running": 2})
    assert merged["rewards"]["count"] == 2 and merged["rewards"]["mean"] == 0.5 and merged["pass_rate"] == 1.0
    assert merged["quotas"] == [
        {
            "project": "org/a",
            "sandboxes": 2,
            "cpu": 2.0,
            "memory": 10,
            "quota_sandboxes": 4,
            "quota_cpu": None,
            "quota_memory": None,
        }
    ]
    assert [s["node"] for s in merged["slowest"]] == ["n2", "n1"]  # the oldest first, each with its node
    assert sum(p["execs"] for p in merged["series"]) == 2 and merged["series"][-1]["states"] == {"running": 2}
    groups = merge_groups(
        [
            {"jobs": [{"value": "j", "count": 1, "states": {"running": 1}, "failures": 1, "steps": 0}]},
            {
                "jobs": [
                    {"value": "j", "count": 2, "states": {"paused": 2}, "failures": 2, "steps": 3},
                    {"value": None, "count": 1, "states": {"running": 1}},
                ]
            },
        ]
    )
    assert groups == [
        {"value": "j", "count": 3, "states": {"running": 1, "paused": 2}, "failures": 3, "steps": 3},
        {"value": None, "count": 1, "states": {"running": 1}},
    ]
    alerts = merge_alerts([("n1", {"alerts": [{"name": "pool_empty", "labels": {"pool": "p"}}]})])
    assert alerts == [{"name": "pool_empty", "labels": {"pool": "p", "node": "n1"}}]


def test_a_book_written_and_read_back_answers_the_same() -> None:
    """What a restarted daemon reads back (`jobstore`): every figure, point and example the same; a
    file of another job label, damaged, or with a cut ring is refused whole."""
    book, table, clock = _book()
    sb = _sandbox(table, "sb-1", "j", project="p", at=clock.now)
    book.event("sb-1", "created", {})
    book.executed(sb, _exec(1, "agent"), "exit 1")
    book.verified(sb, _verdict(None, 1.0))
    book.refused([sb.spec], "quota", ResourceExhaustedError("project p: quota of 1 sandboxes reached"))
    book.sample()
    clock.now += 3 * BUCKET
    book.executed(sb, _exec(124, "timeout", timed_out=True), "sleep 9")
    before = book.stats("j", ALL, 60, lambda _p: [])
    data = jobstore.dump(book)

    again, table2, _ = _book()
    again.clock = clock
    _sandbox(table2, "sb-1", "j", project="p", at=1_000_000.0)
    assert jobstore.load(again, data) == 1
    assert again.stats("j", ALL, 60, lambda _p: []) == before
    assert before is not None and before.refused == {"quota": 1} and before.failures == {"agent": 1, "timeout": 1}

    other = JobBook(SandboxTable(), "team", clock)
    with pytest.raises(ValueError, match="job label 'job'"):
        jobstore.load(other, data)
    for bad in (data[: len(data) // 2], b"\x00garbage", data.replace(b'"version":1', b'"version":2')):
        with pytest.raises(ValueError):
            jobstore.load(_book()[0], bad)
    saved = json.loads(data)
    saved["jobs"][0]["stamp"] = saved["jobs"][0]["stamp"][:40]  # a ring cut short
    fresh = _book()[0]
    with pytest.raises(ValueError, match="series cannot be read"):
        jobstore.load(fresh, json.dumps(saved).encode())
    assert fresh.jobs == {}


def test_a_create_a_restart_never_answered_is_a_failed_create_not_a_stop() -> None:
    """Recovery finds a row still `creating`: the sandbox is failed and journalled `stopped`; its job
    counts a failed create of the node's fault (never a stop of a sandbox it never counted made)."""
    book, table, clock = _book()
    sb = Sandbox("sb-9", SandboxSpec(image="busybox", labels={"job": "j"}), FAILED, clock.now, clock.now)
    table.add(sb)
    book.event("sb-9", "stopped", {"reason": "its create was never answered"})
    stats = book.stats("j", ALL, 60, lambda _p: [])
    assert stats is not None and (stats.stopped, stats.failures) == (0, {"infra": 1})
    assert [(e.kind, e.message) for e in stats.examples] == [("create", "its create was never answered")]
