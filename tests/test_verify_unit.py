"""The pure parts of verification and of judging a command on a busy node: the CPU queue, whose fault
a checks' result is, what `allow` keeps of a writable layer, when a timeout was the node's doing."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from sandfleet.daemon.node.admission import CpuQueue
from sandfleet.daemon.node.cpuwatch import CommandWatch, Look
from sandfleet.daemon.rl.verify import _cause, keep_only
from sandfleet.models import ExecRequest, ExecResult, VerifyRequest
from sandfleet.runtime.schedstat import TreeStats, boot_ticks

pytestmark = pytest.mark.unit


def test_the_cpu_queue_serves_in_order_and_survives_cancellation() -> None:
    async def go() -> list[str]:
        q = CpuQueue(2.0)
        order: list[str] = []
        assert await q.acquire(1.0) == 1.0 and await q.acquire(1.0) == 1.0 and q.held == 2.0

        async def one(name: str, cpus: float) -> None:
            got = await q.acquire(cpus)
            order.append(name)
            await asyncio.sleep(0)
            q.release(got)

        big = asyncio.create_task(one("big", 8.0))  # more than the capacity: waits for all of it
        await asyncio.sleep(0)
        small = asyncio.create_task(one("small", 0.5))  # fits, but comes after big: waits its turn
        gone = asyncio.create_task(one("gone", 1.0))
        await asyncio.sleep(0)
        assert q.waiting == 3 and order == []
        gone.cancel()  # a waiter cancelled leaves no hole, takes nothing
        await asyncio.sleep(0)
        assert q.waiting == 2
        q.release(1.0)
        await asyncio.sleep(0)
        assert order == []  # big still needs the other CPU
        q.release(1.0)
        await asyncio.gather(big, small)
        assert q.held == 0.0 and q.waiting == 0
        return order

    assert asyncio.run(go()) == ["big", "small"]


def _result(**kw: object) -> ExecResult:
    return ExecResult.model_validate({"exit_code": 0, "stdout": "", "stderr": "", "duration": 1.0, **kw})


@pytest.mark.parametrize(
    ("result", "cause"),
    [
        ({}, None),
        ({"exit_code": 1}, "agent"),  # tests failed
        ({"exit_code": 2}, "agent"),  # pytest: a collection error (the agent's code does not import)
        ({"exit_code": 3}, "verifier"),  # pytest: internal error
        ({"exit_code": 4}, "verifier"),
        ({"exit_code": 5}, "verifier"),  # no tests collected
        ({"exit_code": 126}, "verifier"),
        ({"exit_code": 127}, "verifier"),
        ({"exit_code": 137, "signal": 9, "oom_killed": True}, "agent"),
        ({"exit_code": 137, "oom_killed": True}, "agent"),  # under a shell
        ({"exit_code": 139}, "agent"),  # a shell's child crashed (SIGSEGV)
        ({"exit_code": 128 + signal.SIGABRT, "signal": signal.SIGABRT}, "agent"),
        ({"exit_code": 143, "signal": 15}, "verifier"),
        ({"exit_code": 137, "signal": 9}, "verifier"),  # killed, not for memory, not by a timeout
        ({"exit_code": 137, "timed_out": True}, "timeout"),
        ({"exit_code": 137, "timed_out": True, "starved": True}, "infra"),
        ({"exit_code": 137, "timed_out": True, "cpu_time_exceeded": True}, "timeout"),
    ],
)
def test_whose_fault_a_checks_result_is(result: dict[str, object], cause: str | None) -> None:
    assert _cause(_result(**result), VerifyRequest(command="pytest")) == cause


def test_a_task_chooses_which_exit_codes_are_the_agents() -> None:
    req = VerifyRequest(command="./check.sh", agent_exit_codes=[1, 7])
    assert _cause(_result(exit_code=7), req) == "agent"
    assert _cause(_result(exit_code=2), req) == "verifier"


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_allow_keeps_only_what_is_under_the_named_paths(tmp_path: Path) -> None:
    upper, lower = tmp_path / "upper", tmp_path / "lower"
    _tree(upper, {"work/repo/pkg/mod.py": "fixed", "work/repo/conftest.py": "cheat", "etc/profile": "x"})
    _tree(lower, {"work/repo/pkg/mod.py": "bug", "work/repo/tests/t.py": "t"})
    (upper / "usr/local/bin").mkdir(parents=True)
    os.symlink("/work/repo/pkg", upper / "usr/local/bin/python3")
    os.symlink("/tmp", upper / "work/repo/pkgs")  # a sibling whose name starts like an allowed one
    os.chmod(upper / "work/repo", 0o700)
    os.chmod(lower / "work/repo", 0o755)
    keep_only(upper, ["work/repo/pkg"], [lower])
    kept = sorted(str(p.relative_to(upper)) for p in upper.rglob("*"))
    assert kept == ["work", "work/repo", "work/repo/pkg", "work/repo/pkg/mod.py"]
    assert (upper / "work/repo").stat().st_mode & 0o777 == 0o755  # as the layers below have it


def _watch(req: ExecRequest) -> CommandWatch:
    async def make() -> CommandWatch:
        w = CommandWatch(req, init=0, pid=2, since=0, cpu_limit=1.0, node_cpus=2.0, kill=lambda: None)
        w.stop()
        return w

    return asyncio.run(make())


@pytest.mark.parametrize(
    ("ran", "waited", "starved"),
    [
        (0.2, 2.6, True),  # wanted a CPU the whole time, got a fifteenth of it
        (1.5, 1.5, False),  # got half: slow, not starved
        (0.01, 0.02, False),  # asleep: wanted nothing
        (0.05, 0.9, True),  # runnable a third of the time, and then mostly waiting
        (0.3, 0.0, False),  # a tenth-of-a-core command that got what it asked
    ],
)
def test_a_timeout_is_the_nodes_doing_when_the_command_wanted_cpu_and_got_little(
    ran: float, waited: float, starved: bool
) -> None:
    w = _watch(ExecRequest(command="x", timeout=3))
    w.last = Look(at=w.started + 3.0, cpu=ran, ran=ran, waited=waited)
    assert w.starved() is starved
    assert not CommandWatch.wanted(ExecRequest(command="x", timeout=0.2))
    assert CommandWatch.wanted(ExecRequest(command="x", timeout=None, cpu_time=1))


def test_a_long_watch_keeps_the_readings_of_live_tasks_only() -> None:
    """A command that runs one short-lived process after another, watched for a while: a look keeps
    the last reading of each task alive; what the dead ones ran stays in the totals."""
    since = boot_ticks()
    loop = subprocess.Popen(["sh", "-c", "while :; do sleep 0.01; done"])
    try:
        tree = TreeStats(loop.pid, since)
        ran = []
        for _ in range(40):
            tree.sample()
            ran.append(tree.ran)
            time.sleep(0.02)
        assert len(tree._tasks) <= 3, len(tree._tasks)  # the shell, a sleep, perhaps one exiting
        assert ran == sorted(ran) and ran[-1] > 0
    finally:
        loop.kill()
        loop.wait()
