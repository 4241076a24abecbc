"""Commands, steps and verifications on a saturated node: verifications wait their turn for CPUs
(and that wait is not their timeout), a CPU budget cuts a command by the CPU it used and not by the
time it waited, and a timeout the node caused by starving the command is `infra`, not `timeout`."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator

import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.models import Resources, VerifyResult

from conftest import wait_until

JOB = {"job": "contention-test"}
SPIN = "while :; do :; done"


def _spec(cpu: float = 1.0) -> SandboxSpec:
    return SandboxSpec(image="busybox", idle_ttl=300, labels=JOB, resources=Resources(cpu=cpu, memory="64MiB"))


@pytest.fixture
def hogs(fleet: Client) -> Iterator[Callable[[], None]]:
    """Six sandboxes to spin a CPU each, once the test calls `hogs()`: a sandbox of this node then
    gets about 2/7 of a core (less if the host is busy with anything else). A test makes its own
    sandboxes first: a node that busy refuses new ones (its CPU is saturated), but for verifiers."""
    made = [fleet.create(_spec()) for _ in range(6)]

    def spin() -> None:
        for sb in made:
            sb.start(SPIN)
        time.sleep(1)

    yield spin
    for sb in made:
        sb.stop()


def _work(fleet: Client) -> tuple[str, float]:
    """A shell loop worth about a second here, and the seconds it takes alone."""
    with fleet.create(_spec()) as sb:
        n = 100_000
        while True:
            script = f"i=0; while [ $i -lt {n} ]; do i=$((i+1)); done"
            took = sb.exec(script, timeout=120).duration
            if took >= 0.7:
                return script, took
            n = int(n * 1.0 / max(took, 0.05)) + 1


@pytest.mark.slow
def test_verifications_wait_their_turn_and_the_wait_is_not_their_timeout(fleet: Client) -> None:
    """Six CPU-bound checks ending together on 2 cores, each with a timeout 2.5x what it needs
    alone: run all at once they would take ~3x; queued (by default half the CPU load the node
    admits: one at a time here), none times out."""
    work, alone = _work(fleet)
    check = f"cat /proc/uptime; {work}; cat /proc/uptime"
    with fleet.create(_spec()) as sb, concurrent.futures.ThreadPoolExecutor(6) as pool:
        results: list[VerifyResult] = list(
            pool.map(lambda _: sb.verify(check, timeout=max(2.5 * alone, 2.0)), range(6))
        )
    causes = [r.cause for r in results]
    assert "timeout" not in causes and set(causes) <= {None, "infra"}, [(r.cause, r.result) for r in results]
    spans = [tuple(float(line.split()[0]) for line in r.result.stdout.split("\n")[:2]) for r in results if r.result]
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most <= 2, spans  # never more checks at once than the node has CPUs
    assert sum(r.queued > 0.5 * alone for r in results) >= 3, [r.queued for r in results]
    assert fleet.list(labels=JOB) == []


def test_a_cpu_budget_cuts_by_cpu_used_not_by_time_waited(fleet: Client) -> None:
    with fleet.create(_spec()) as sb:
        r = sb.exec(SPIN, timeout=60, cpu_time=1)
        assert (r.timed_out, r.cpu_time_exceeded, r.cause) == (True, True, "timeout"), r
        assert r.cpu_seconds is not None and 1.0 <= r.cpu_seconds < 2.5, r
        ok = sb.exec("echo done", cpu_time=5)
        assert (ok.exit_code, ok.cpu_time_exceeded, ok.cause) == (0, False, None)
        bg = sb.start(SPIN, cpu_time=0.5).wait(timeout=30)  # a background process too
        assert bg.result is not None and bg.result.cpu_time_exceeded and bg.result.cause == "timeout", bg
    traj = fleet.trajectory("contention-budget", _spec())
    step = traj.exec(SPIN, timeout=60, cpu_time=0.5)
    assert step.cpu_time_exceeded and traj.last is not None and traj.last.cause == "timeout"
    v = traj.verify(SPIN, timeout=60, cpu_time=0.5)
    assert (v.passed, v.cause) == (False, "timeout") and v.result is not None and v.result.cpu_time_exceeded
    traj.close()
    traj.delete()
    assert fleet.list(labels=JOB) == []


@pytest.mark.slow
def test_a_timeout_the_node_caused_is_infra(fleet: Client, hogs: Callable[[], None]) -> None:
    """Under six spinning neighbours a command that wants a CPU gets ~2/7 of one: when its timeout
    fires it was starved (infra, masked); a command that sleeps until its timeout is its own fault."""
    traj = fleet.trajectory("contention-starved", _spec())
    with fleet.create(_spec()) as sb:
        hogs()
        r = sb.exec(SPIN, timeout=3)
        assert (r.timed_out, r.starved, r.cause) == (True, True, "infra"), r
        slept = sb.exec("sleep 30", timeout=2)
        assert (slept.timed_out, slept.starved, slept.cause) == (True, False, "timeout"), slept
        v = sb.verify(SPIN, timeout=3)
        assert (v.cause, v.result is not None and v.result.starved) == ("infra", True), v
    step = traj.exec(SPIN, timeout=3)
    assert step.starved and traj.last is not None and traj.last.cause == "infra"
    assert traj.refresh().failures == {"infra": 1}
    traj.close()
    traj.delete()


def test_a_timeout_with_the_cpu_it_was_due_is_a_timeout(fleet: Client) -> None:
    """The same spin with nobody else spinning (a tenth of a core as its limit, so whatever else the
    host runs does not starve it): it got what it could use, so its timeout is its own."""
    with fleet.create(_spec(cpu=0.1)) as sb:
        r = sb.exec(SPIN, timeout=3)
        assert (r.timed_out, r.starved, r.cause) == (True, False, "timeout"), r


def test_a_cpu_budget_counts_the_commands_own_processes(fleet: Client) -> None:
    """What another command of the sandbox spins (a background process, a concurrent exec) spends
    none of this command's budget; what the command's own children spin does."""
    with fleet.create(_spec()) as sb, concurrent.futures.ThreadPoolExecutor(1) as pool:
        bg = sb.start(SPIN)
        other = pool.submit(sb.exec, SPIN, timeout=4)
        r = sb.exec("sleep 2", timeout=30, cpu_time=0.3)
        assert (r.exit_code, r.timed_out, r.cpu_time_exceeded, r.cause) == (0, False, False, None), r
        assert r.cpu_seconds is not None and r.cpu_seconds < 0.2, r
        assert other.result().timed_out
        kids = sb.exec(f"({SPIN}) & ({SPIN}) & wait", timeout=60, cpu_time=1)
        assert (kids.timed_out, kids.cpu_time_exceeded, kids.cause) == (True, True, "timeout"), kids
        assert kids.cpu_seconds is not None and 1.0 <= kids.cpu_seconds < 2.5, kids
        bg.kill()


def test_a_command_is_judged_by_its_own_processes(fleet: Client, hogs: Callable[[], None]) -> None:
    """Starvation is read from the command's own process tree: a sleep that runs out of time while a
    later command of its sandbox is starved ran out of its own time; a starved spin is starved even
    when its sandbox holds more (older) tasks than a look reads."""
    with fleet.create(_spec()) as a, fleet.create(_spec()) as b:
        hogs()
        # b: 300 sleeps whose shell exits once the spin started: they become its init's newest children.
        b.start("for i in $(seq 300); do sleep 60 & done; touch /tmp/forked; until [ -f /tmp/go ]; do sleep 0.05; done")
        assert wait_until(lambda: b.files.exists("/tmp/forked"), 60)
        spin = b.start(SPIN, timeout=3)
        b.exec("touch /tmp/go")
        asleep = a.start("sleep 30", timeout=3)
        a.start(SPIN, timeout=20)  # later than the sleep, and starved
        slept, starved = asleep.wait(timeout=60).result, spin.wait(timeout=60).result
        assert slept is not None and (slept.timed_out, slept.starved, slept.cause) == (True, False, "timeout"), slept
        assert starved is not None and (starved.timed_out, starved.starved, starved.cause) == (True, True, "infra"), (
            starved
        )
