"""The verification queue and the node's admission: a burst of checks leaves room for the node's
other work (rollouts' creates, fncall calls), the node's load does not hold checks up in turn, and a
check the node cannot admit yet steps aside instead of holding up the checks behind it."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.daemon.rl.verify import VERIFY_LABEL
from sandfleet.errors import ResourceExhaustedError
from sandfleet.models import Resources

from conftest import Daemon, destroy_daemon, make_daemon, wait_until

JOB = {"job": "verify-queue"}
SPIN = "while :; do :; done"


def _spec() -> SandboxSpec:
    return SandboxSpec(image="busybox", idle_ttl=300, labels=JOB, resources=Resources(memory="64MiB"))


def _verifiers(fleet: Client, agent_id: str) -> list[str]:
    return [s.id for s in fleet.list() if s.spec.labels.get(VERIFY_LABEL) == agent_id]


@pytest.fixture(scope="module")
def busy_node() -> Iterator[Daemon]:
    """A node that refuses creates once latency-sensitive sandboxes use half a CPU (a quarter of its
    two): what two spinning checks of a CPU each would do to a node's 0.95 at full use, but
    reachable whatever else the host runs."""
    d = make_daemon("verify-load", "max_cpu_load = 0.25\n")
    d.start()
    yield d
    destroy_daemon(d)


def test_checks_filling_their_queue_leave_room_for_creates_and_calls(busy_node: Daemon) -> None:
    fleet = busy_node.client(timeout=60)
    with fleet.create(_spec()) as agent, concurrent.futures.ThreadPoolExecutor(2) as pool:
        checks = [pool.submit(agent.verify, SPIN, timeout=120) for _ in range(2)]
        assert wait_until(lambda: _verifiers(fleet, agent.id), 60)
        time.sleep(2)  # their CPU is in the node's observed load by now
        refused: list[ResourceExhaustedError] = []
        try:
            assert fleet.run_code("print(6 * 7)").stdout == "42\n"  # a new fncall worker
        except ResourceExhaustedError as exc:
            refused.append(exc)
        try:
            with fleet.create(_spec(), timeout=3) as sb:
                assert sb.exec("echo ok").stdout == "ok\n"
        except ResourceExhaustedError as exc:
            refused.append(exc)
        while not all(c.done() for c in checks):  # done: stop the checks (each answers infra)
            for vid in _verifiers(fleet, agent.id):
                fleet.get(vid).stop()
            time.sleep(0.2)
        assert refused == [], refused
        assert all(c.result().cause == "infra" for c in checks)
    assert fleet.list(labels=JOB) == []
    fleet.close()


def test_checks_run_on_a_node_another_sandbox_saturates(busy_node: Daemon) -> None:
    """A sandbox spinning puts the node's load past max_cpu_load: new sandboxes are refused, but not
    a verifier's (its CPUs are the queue's, carved out of that load): checks do not wait for the
    spinning to stop."""
    fleet = busy_node.client(timeout=60)
    with fleet.create(_spec()) as agent, fleet.create(_spec()) as hog:
        hog.start(SPIN)
        time.sleep(2)  # its CPU is in the node's observed load
        with pytest.raises(ResourceExhaustedError, match="saturated"):
            fleet.create(_spec(), timeout=1)
        v = agent.verify("true", queue_timeout=20)
        assert v.passed and v.queued < 10, v
    assert fleet.list(labels=JOB) == []
    fleet.close()


@pytest.mark.slow
def test_a_check_the_node_cannot_admit_yet_does_not_hold_up_the_queue(fleet: Client) -> None:
    """A check whose sandbox the node cannot admit (more memory than it may commit) waits for
    admission without holding the queue's CPUs: the check behind it runs at once."""
    with fleet.create(_spec()) as agent, concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(agent.verify, "true", resources=Resources(cpu=2, memory="1TiB"), queue_timeout=8)
        time.sleep(1)  # it is waiting for admission
        small = agent.verify("true", timeout=30, queue_timeout=60)
        assert small.passed and small.queued < 4, small
        late = big.result()
        assert (late.passed, late.cause) == (False, "infra"), late
        assert late.error is not None and late.error.code == "resource_exhausted", late
    assert fleet.list(labels=JOB) == []
