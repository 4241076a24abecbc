"""Trajectories' own logic, without root: what identifies a logged request across versions (the
literal JSON an older daemon hashed), which log a caller's id names after an upgrade, and calls that
meet on one trajectory in an order a real daemon only gives by chance (a step arriving while its
trajectory's close is being written with fsync; while it is being deleted), on the in-process node."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandfleet import SandboxSpec
from sandfleet.daemon.rl.steplog import earlier_identities, identity
from sandfleet.daemon.rl.trajectories import Trajectories
from sandfleet.daemon.rl.trajlogs import LogFolder
from sandfleet.errors import NotFoundError, WrongStateError
from sandfleet.models import (
    ExecAction,
    ExecRequest,
    ReadAction,
    StepRequest,
    TrajectoryClose,
    TrajectoryOpen,
    VerifyRequest,
)
from sandfleet.testing import InProcessNode

pytestmark = pytest.mark.unit

COMMAND = "echo ran >> /ran; wc -l < /ran"
# As sandfleet before per-default digests dumped them (its models then; from that version, verbatim).
OLD_EXEC = (
    '{"kind":"exec","exec":{"stdin":null,"stdin_b64":null,"keep_stdin_open":false,"command":"echo ran >> /ran; '
    'wc -l < /ran","env":{},"cwd":null,"user":null,"timeout":60.0,"output_limit":1048576,"merge_stderr":false,'
    '"encoding":"utf-8","background":false,"pty":null}}'
)
OLD_VERIFY = (
    '{"command":"true","layers":[],"protect":[],"cwd":null,"env":{},"timeout":600.0,"resources":null,'
    '"reward_file":null,"agent_exit_codes":[%s],"output_limit":262144,"keep":false}'
)


def _old(dumped: str) -> str:
    return hashlib.sha256(dumped.encode()).hexdigest()[:32]


def test_requests_logged_by_an_older_daemon_are_still_the_same_requests() -> None:
    step = ExecAction(exec=ExecRequest(command=COMMAND))
    assert _old(OLD_EXEC) in earlier_identities(step)
    assert _old(OLD_EXEC) not in earlier_identities(ExecAction(exec=ExecRequest(command="echo other")))
    assert not earlier_identities(ExecAction(exec=ExecRequest(command=COMMAND, cpu_time=5)))  # not from then
    read = ReadAction(path="/a")
    assert _old(read.model_dump_json()) in earlier_identities(read)

    # agent_exit_codes was [1] by default then, [1, 2] now: unset (or sent as today's default), either
    # meaning; sent as [1], what the default meant then.
    unset, then_default = _old(OLD_VERIFY % "1"), _old(OLD_VERIFY % "1,2")
    assert {unset, then_default} <= earlier_identities(VerifyRequest(command="true"))
    assert {unset, then_default} <= earlier_identities(VerifyRequest(command="true", agent_exit_codes=[1, 2]))
    assert earlier_identities(VerifyRequest(command="true", agent_exit_codes=[1])) == {unset}
    assert not earlier_identities(VerifyRequest(command="true", allow=["/repo"]))
    assert not earlier_identities(VerifyRequest(command="true", queue_timeout=5))

    # Today's digest leaves defaults out: a field added later at its default changes nothing, and
    # a request that sends every default is the one that sends none.
    sent_all = ExecAction.model_validate_json(OLD_EXEC.replace('"pty":null', '"pty":null,"cpu_time":null'))
    assert identity(sent_all) == identity(step) == _old('{"exec":{"command":"echo ran >> /ran; wc -l < /ran"}}')
    assert identity(VerifyRequest(command="true", agent_exit_codes=[1, 2])) == identity(VerifyRequest(command="true"))


def test_a_caller_reaches_what_it_reached_before_ids_were_per_project(tmp_path: Path) -> None:
    """A log moved to its sandbox's project (`team-a`) answers to the root and to projects above it,
    as then; another project's same id stays its own."""
    logs = LogFolder(tmp_path)
    logs.moved = {"old": "org/team-a"}
    assert logs.key(None, "old") == ("org/team-a", "old")
    assert logs.key("org", "old") == ("org/team-a", "old")
    assert logs.key("org/team-a", "old") == ("org/team-a", "old")
    assert logs.key("org/team-b", "old") == ("org/team-b", "old")
    assert logs.key("org/team-a/sub", "old") == ("org/team-a/sub", "old")
    assert logs.key(None, "new") == (None, "new")
    assert logs.reached(None) == logs.reached("org") == {"old"} and not logs.reached("org/team-a")
    assert logs.forget(("org/team-a", "old")) and logs.key(None, "old") == (None, "old")


@pytest.mark.parametrize("saved", [b"[1]", b'"x"', b'{"old": 1, "../x": "org"}', b"\xff{", b""])
def test_a_damaged_list_of_moved_logs_stops_nothing(tmp_path: Path, saved: bytes) -> None:
    """`moved.json` unreadable or wrong: the daemon starts, and a log moved now is listed again."""
    (tmp_path / "moved.json").write_bytes(saved)
    (tmp_path / "old.jsonl").write_bytes(b"{}\n")
    logs = LogFolder(tmp_path)
    logs.sweep(0.0, 1.0, (), lambda _found: "org/team-a")
    assert logs.moved == {"old": "org/team-a"} and (tmp_path / "org+team-a" / "old.jsonl").exists()
    again = LogFolder(tmp_path)
    again.sweep(0.0, 1.0, (), lambda _found: None)
    assert again.moved == {"old": "org/team-a"}


@pytest.fixture
async def trajectories(tmp_path: Path) -> AsyncIterator[Trajectories]:
    async with InProcessNode(tmp_path) as node:
        node.service.trajectories.config.fsync = True  # each record is written in a thread
        yield node.service.trajectories


def _step(k: int) -> StepRequest:
    return StepRequest(step=k, action=ExecAction(exec=ExecRequest(command=f"echo {k}")))


async def test_no_step_begins_on_a_trajectory_being_closed(trajectories: Trajectories) -> None:
    """The close's record is being written (in a thread: fsync) when step 0 comes: the step is
    refused as on a closed trajectory, not begun after the close (which no replay could read)."""
    tr = trajectories
    await tr.open(TrajectoryOpen(id="closing", spec=SandboxSpec(image="busybox")), project=None)
    closed, stepped = await asyncio.gather(
        tr.close("closing", TrajectoryClose(), project=None),
        tr.step("closing", _step(0), project=None),
        return_exceptions=True,
    )
    assert not isinstance(closed, BaseException) and closed.state == "closed", closed
    assert isinstance(stepped, WrongStateError) and "closed" in stepped.message, stepped
    again = await tr.get("closing", project=None)  # read from the log again
    assert again.state == "closed" and again.lost_from is None and again.steps == 0
    assert not list(tr.logs.folder(None).glob("closing.jsonl.*"))  # nothing set aside as damaged
    assert not tr.loaded


async def test_no_step_begins_on_a_trajectory_being_deleted(trajectories: Trajectories) -> None:
    """A step arriving while the trajectory is deleted is not found (or refused), never begun on a
    log going away: the id is free afterwards, no fragment of a log is left under it."""
    tr = trajectories
    await tr.open(TrajectoryOpen(id="deleting", spec=SandboxSpec(image="busybox")), project=None)
    await tr.step("deleting", _step(0), project=None)
    deleted, stepped = await asyncio.gather(
        tr.delete("deleting", project=None),
        tr.step("deleting", _step(1), project=None),
        return_exceptions=True,
    )
    assert deleted is None, deleted
    assert isinstance(stepped, NotFoundError | WrongStateError), stepped
    await asyncio.sleep(0.2)  # a step's run, had one begun, would be done
    assert not list(tr.logs.folder(None).glob("deleting*"))
    with pytest.raises(NotFoundError):
        await tr.get("deleting", project=None)
    info = await tr.open(TrajectoryOpen(id="deleting", spec=SandboxSpec(image="busybox")), project=None)
    assert info.steps == 0 and info.state == "open"
    await tr.delete("deleting", project=None)


def test_closed_trajectories_infos_are_kept_within_their_bounds() -> None:
    """The infos a list reads instead of logs: the least recently used go past the count or the bytes,
    a verdict with a large output is not kept, a forgotten one is gone."""
    from sandfleet.daemon.rl.trajlogs import Infos
    from sandfleet.models import ExecResult, TrajectoryInfo, VerifyResult

    def info(tid: str, out: int = 0) -> TrajectoryInfo:
        result = ExecResult(exit_code=0, stdout="x" * out, stderr="", duration=0.1)
        verdict = VerifyResult(passed=True, reward=1.0, cause=None, result=result, changed=[], duration=1.0)
        return TrajectoryInfo(id=tid, sandbox_id=None, state="closed", steps=1, created_at=0, verification=verdict)

    infos = Infos()
    infos.MAX, infos.MAX_BYTES = 3, 64 * 3000  # an info over 3000 bytes is not kept
    for i in range(4):
        infos.remember((None, f"t{i}"), info(f"t{i}"))
    assert infos.get((None, "t0")) is None and infos.get((None, "t1")) is not None  # t1 now the most recent
    infos.remember((None, "t4"), info("t4"))
    assert [k[1] for k in infos._infos] == ["t3", "t1", "t4"]
    infos.remember((None, "big"), info("big", out=5000))
    assert infos.get((None, "big")) is None
    infos.MAX = 1000
    for i in range(100):  # 2 KiB each: the bytes bound keeps 93 of them
        infos.remember((None, f"many{i}"), info(f"many{i}"))
    assert 90 <= len(infos._infos) < 100 and infos._bytes <= infos.MAX_BYTES
    assert infos.get((None, "many99")) is not None and infos.get((None, "many0")) is None
    infos.forget((None, "many99"))
    assert infos.get((None, "many99")) is None and infos._bytes == sum(size for _, size in infos._infos.values())
