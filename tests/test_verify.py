"""Verification apart from the agent: a fresh sandbox of the pre-agent state + the agent's changes +
hidden layers no agent sandbox mounts; what the agent changed; whose fault a failure is."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.models import VerifyRequest

JOB = {"job": "verify-test"}
SOLUTION = "echo $(( $1 - $2 ))\n"  # the bug: add subtracts
VISIBLE = '[ "$(sh /task/solution.sh 2 2)" -eq 4 ] || { echo "visible test failed"; exit 1; }\n'
HIDDEN = '[ "$(sh /task/solution.sh 2 3)" -eq 5 ] || { echo "hidden test failed"; exit 1; }\necho hidden passed\n'
CHECKS = "sh /task/tests/visible.sh && sh /task/hidden/hidden.sh"


@pytest.fixture(scope="module")
def task(daemon: object) -> Iterator[tuple[str, str]]:
    """(the task image, the digest of its hidden-tests layer), both made by packing sandboxes."""
    with daemon.client() as fleet:  # type: ignore[attr-defined]
        with fleet.create(image="busybox", idle_ttl=120, labels=JOB) as sb:
            sb.files.write("/task/solution.sh", SOLUTION)
            sb.files.write("/task/tests/visible.sh", VISIBLE)
            image = sb.pack("verify-task:1")
        with fleet.create(image="busybox", idle_ttl=120, labels=JOB) as sb:
            sb.files.write("/task/hidden/hidden.sh", HIDDEN)
            hidden = sb.pack("verify-hidden:1").layers[-1]
        yield f"{image.name}:{image.tag}", hidden
        fleet.delete_image("verify-task:1")
        fleet.delete_image("verify-hidden:1")


def _agent(fleet: Client, image: str) -> object:
    return fleet.create(SandboxSpec(image=image, idle_ttl=120, labels=JOB))


def _verify(sb: object, hidden: str, **kw: object) -> object:
    return sb.verify(CHECKS, layers=[hidden], protect=["/task/tests"], **kw)  # type: ignore[attr-defined]


def test_an_honest_fix_passes_and_its_changes_are_listed(fleet: Client, task: tuple[str, str]) -> None:
    image, hidden = task
    with _agent(fleet, image) as sb:  # type: ignore[attr-defined]
        assert not sb.files.exists("/task/hidden")  # the hidden tests are never where the agent runs
        sb.exec("sed -i 's/- \\$2/+ $2/' /task/solution.sh && echo note > /task/NOTES && rm /task/tests/visible.sh")
        v = _verify(sb, hidden)
        assert v.passed and v.reward == 1.0 and v.cause is None, v  # type: ignore[attr-defined]
        assert "hidden passed" in v.result.stdout  # type: ignore[attr-defined]
        changed = {(c.path, c.change) for c in v.changed if c.path.startswith("/task")}  # type: ignore[attr-defined]
        assert changed == {
            ("/task/solution.sh", "modified"),
            ("/task/NOTES", "added"),
            ("/task/tests/visible.sh", "deleted"),
        }
        assert v.dropped == ["/task/tests/visible.sh"]  # type: ignore[attr-defined]  # protected: the checks see it
        # The agent's sandbox is untouched, and the verifier's is gone.
        assert sb.exec("cat /task/NOTES; ls /task/tests").stdout == "note\n"
        assert v.verifier_sandbox_id not in {s.id for s in fleet.list()}  # type: ignore[attr-defined]
    assert fleet.list(labels=JOB) == []


def test_an_agent_that_edits_the_tests_gets_no_reward(fleet: Client, task: tuple[str, str]) -> None:
    image, hidden = task
    with _agent(fleet, image) as sb:  # type: ignore[attr-defined]
        # No fix; instead, neuter the visible test and plant a "hidden" test that always passes.
        sb.exec(
            "echo 'exit 0' > /task/tests/visible.sh && mkdir -p /task/hidden && echo 'exit 0' > /task/hidden/hidden.sh"
        )
        assert sb.exec(CHECKS).exit_code == 0  # in its own sandbox the cheat "works"
        v = _verify(sb, hidden)
        assert not v.passed and v.reward == 0.0 and v.cause == "agent", v  # type: ignore[attr-defined]
        assert "failed" in v.result.stdout  # type: ignore[attr-defined]
        paths = {c.path for c in v.changed}  # type: ignore[attr-defined]
        assert {"/task/tests/visible.sh", "/task/hidden/hidden.sh"} <= paths
        assert v.dropped == ["/task/tests/visible.sh"]  # type: ignore[attr-defined]


def test_a_broken_verifier_or_a_slow_one_is_not_the_agents_fault(fleet: Client, task: tuple[str, str]) -> None:
    image, hidden = task
    with _agent(fleet, image) as sb:  # type: ignore[attr-defined]
        assert sb.verify("exit 2").cause == "verifier"  # pytest's "the run itself broke"
        assert sb.verify("no-such-checker").cause == "verifier"
        assert sb.verify("sleep 30", timeout=1).cause == "timeout"
        missing = sb.verify("true", layers=["sha256:" + "0" * 64])
        assert missing.cause == "verifier" and missing.error is not None and missing.error.code == "not_found"
        r = sb.verify(VerifyRequest(command="echo 0.25 > /tmp/reward", reward_file="/tmp/reward"))
        assert r.passed and r.reward == 0.25
        assert sb.verify("true", reward_file="/tmp/none").cause == "verifier"  # promised a reward, wrote none


def test_a_trajectory_verifies_once_against_its_set_up_state(fleet: Client, task: tuple[str, str]) -> None:
    """Rollouts restored from one set-up snapshot: `changed` lists the agent's changes only, and the
    verdict is logged (asked again: the same, not a second run)."""
    image, hidden = task
    with _agent(fleet, image) as setup:  # type: ignore[attr-defined]
        setup.exec("echo configured > /task/setup.cfg")
        snap = setup.snapshot(labels=JOB)
    try:
        traj = fleet.trajectory("verify-traj", snapshot_id=snap.id, labels=JOB)
        traj.exec("sed -i 's/- \\$2/+ $2/' /task/solution.sh")
        v = traj.verify(CHECKS, layers=[hidden], protect=["/task/tests"])
        assert v.passed and not v.replayed
        assert {c.path for c in v.changed if c.path.startswith("/task")} == {"/task/solution.sh"}
        again = fleet.get_trajectory("verify-traj").verify(CHECKS, layers=[hidden], protect=["/task/tests"])
        assert again.replayed and again.model_copy(update={"replayed": False}) == v
        info = traj.close()
        assert info.reward == 1.0 and info.verification == v
        traj.delete()
    finally:
        fleet.delete_snapshot(snap.id)
    assert fleet.list(labels=JOB) == []
