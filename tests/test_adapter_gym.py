"""The Gymnasium adapter against a real daemon: Gymnasium's own checker, episodes, rewards, seeds,
snapshots, and that no sandbox outlives its env."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

gymnasium = pytest.importorskip("gymnasium")

from gymnasium.utils.env_checker import check_env  # noqa: E402

from sandfleet import Client, SandboxSpec  # noqa: E402
from sandfleet.adapters.gym import SandboxEnv, SetupError, clean_text, prepare_snapshot, register_env  # noqa: E402

from conftest import Daemon  # noqa: E402

JOB = {"job": "gym-test"}

# What check_env may say about an env it cannot fully exercise: made without gymnasium.make (no spec
# to re-make it with), or checked through make's wrappers. Anything else it warns about is a failure.
EXPECTED_WARNINGS = ("Not able to test alternative render modes", "is different from the unwrapped version")


@pytest.fixture
def no_leaks(fleet: Client) -> Iterator[None]:
    yield
    left = fleet.list(labels=JOB)
    for info in left:
        fleet.get(info.id).stop()
    assert not left, f"sandboxes left running: {[s.id for s in left]}"


def checked(env: gymnasium.Env[object, object]) -> list[str]:
    """Run check_env; the warnings it raised that are not expected."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env)
    return [str(w.message) for w in caught if not any(e in str(w.message) for e in EXPECTED_WARNINGS)]


def test_check_env_direct(fleet: Client, no_leaks: None) -> None:
    env = SandboxEnv(fleet, "busybox", labels=JOB, instructions="make /tmp/x", check="test -f /tmp/x", max_steps=5)
    try:
        assert checked(env) == []
        assert checked(env.unwrapped) == []
        assert len(fleet.list(labels=JOB)) == 1  # one episode's sandbox at a time
    finally:
        env.close()
    assert env.sandbox is None
    assert fleet.list(labels=JOB) == []
    env.close()  # again: harmless


def test_check_env_through_make(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    """Registered and made by Gymnasium (a spec: check_env also re-makes it, renders it, closes it twice)."""
    env_id = register_env()
    env = gymnasium.make(env_id, fleet=str(daemon.socket), spec="busybox", labels=JOB, max_steps=3, render_mode="ansi")
    try:
        assert checked(env) == []
        assert checked(env.unwrapped) == []
    finally:
        env.close()
    assert fleet.list(labels=JOB) == []


def test_episode_check_terminates_with_reward(fleet: Client, no_leaks: None) -> None:
    env = SandboxEnv(
        fleet,
        SandboxSpec(image="busybox", labels={"extra": "1"}),
        labels=JOB,
        setup=["mkdir -p /task", "echo 0 > /task/count"],
        files={"/task/README": "count to 3\n"},
        instructions="count to 3 in /task/count",
        check='[ "$(cat /task/count)" = 3 ]',
        max_steps=10,
    )
    try:
        obs, info = env.reset(seed=7)
        assert obs == {"output": "count to 3 in /task/count", "exit_code": 0}
        sandbox_id = info["sandbox_id"]
        assert [s.id for s in fleet.list(labels={**JOB, "extra": "1"})] == [sandbox_id]
        bump = "echo $(( $(cat /task/count) + 1 )) > /task/count; cat /task/count"
        for n in (1, 2):
            obs, reward, terminated, truncated, info = env.step(bump)
            assert (obs, reward, terminated, truncated) == ({"output": f"{n}\n", "exit_code": 0}, 0.0, False, False)
        obs, reward, terminated, truncated, info = env.step(bump)
        assert (obs["output"], reward, terminated, truncated, info["score"]) == ("3\n", 1.0, True, False, 1.0)
        with pytest.raises(gymnasium.error.ResetNeeded):
            env.step("true")
        # Output is merged stdout+stderr, exit codes observed; the next episode starts afresh.
        obs, info = env.reset()
        assert info["sandbox_id"] != sandbox_id
        assert sandbox_id not in {s.id for s in fleet.list(labels=JOB)}
        obs, *_ = env.step("cat /task/count /task/README; echo oops >&2; exit 3")
        assert obs == {"output": "0\ncount to 3\noops\n", "exit_code": 3}
    finally:
        env.close()


def test_submit_truncation_and_reward_fn(fleet: Client, no_leaks: None) -> None:
    scores: list[str] = []

    def reward_fn(sandbox: object) -> float:
        from sandfleet.client import Sandbox

        assert isinstance(sandbox, Sandbox)
        text = sandbox.files.read_text("/tmp/score") if sandbox.files.exists("/tmp/score") else "0"
        scores.append(text.strip())
        return float(text)

    env = SandboxEnv(fleet, "busybox", labels=JOB, reward_fn=reward_fn, submit_action="DONE", max_steps=2)
    try:
        env.reset(seed=1)
        obs, reward, terminated, truncated, info = env.step("echo 0.25 > /tmp/score")
        assert (reward, terminated, truncated) == (0.0, False, False)
        obs, reward, terminated, truncated, info = env.step("  DONE\n")  # the submit action is not run
        assert (obs, reward, terminated, truncated, info["submitted"]) == (
            {"output": "", "exit_code": 0},
            0.25,
            True,
            False,
            True,
        )
        env.reset(seed=1)
        env.step("true")
        obs, reward, terminated, truncated, info = env.step("echo 0.5 > /tmp/score")
        assert (reward, terminated, truncated) == (0.5, False, True)  # scored at truncation too
        assert scores == ["0.25", "0.5"]
    finally:
        env.close()


def test_seed_reaches_sandbox(fleet: Client, no_leaks: None) -> None:
    env = SandboxEnv(fleet, "busybox", labels=JOB)
    try:
        env.reset(seed=1234)
        assert env.step("echo $SANDFLEET_SEED")[0]["output"] == "1234\n"
        assert env.sandbox is not None
        assert env.sandbox.exec("sh -c 'echo $SANDFLEET_SEED'").stdout == "1234\n"  # the sandbox's own env too
        # Unseeded resets draw their seed from the seeded generator: reproducible sequences.
        env.reset(seed=99)
        drawn = [env.reset()[1]["seed"] for _ in range(2)]
        env.reset(seed=99)
        assert [env.reset()[1]["seed"] for _ in range(2)] == drawn
        assert env.step("echo $SANDFLEET_SEED")[0]["output"] == f"{drawn[1]}\n"
    finally:
        env.close()


def test_output_cleaned_truncated_and_timeouts(fleet: Client, no_leaks: None) -> None:
    env = SandboxEnv(fleet, "busybox", labels=JOB, max_output=64, step_timeout=1)
    try:
        env.reset()
        obs, *_ = env.step("printf 'caf\\303\\251 \\001x'")
        assert obs["output"] == "caf? ?x" and obs in env.observation_space
        obs, *_ = env.step("seq 1 1000")
        assert len(obs["output"]) == 64 and obs["output"].endswith("[output truncated]")
        assert obs in env.observation_space
        obs, _, terminated, _, info = env.step("sleep 30")
        assert info["timed_out"] and obs["exit_code"] == 137 and not terminated
    finally:
        env.close()
    assert clean_text("abc", 2) == "ab"


def test_snapshot_episodes(fleet: Client, no_leaks: None) -> None:
    """Envs restored from one prepared snapshot: set up once, each episode isolated from the others."""
    snapshot_id = prepare_snapshot(
        fleet,
        SandboxSpec(image="busybox", labels=JOB),
        setup=["mkdir -p /task", "echo prepared > /task/state"],
        files={"/task/input": "41\n"},
    )
    envs = [SandboxEnv(fleet, snapshot_id=snapshot_id, labels=JOB, check="grep -q 42 /task/input") for _ in range(2)]
    try:
        assert fleet.list(labels=JOB) == []  # the preparing sandbox is gone
        for env in envs:
            env.reset(seed=5)
        assert len(fleet.list(labels=JOB)) == 2
        obs, *_ = envs[0].step("cat /task/state /task/input; echo $SANDFLEET_SEED")
        assert obs["output"] == "prepared\n41\n5\n"
        obs, reward, terminated, *_ = envs[0].step("echo 42 > /task/input")
        assert (reward, terminated) == (1.0, True)
        obs, reward, terminated, *_ = envs[1].step("cat /task/input")
        assert (obs["output"], reward, terminated) == ("41\n", 0.0, False)
        envs[0].reset()
        assert envs[0].step("cat /task/input")[0]["output"] == "41\n"
    finally:
        for env in envs:
            env.close()
        fleet.delete_snapshot(snapshot_id)


def test_setup_failure_stops_sandbox(fleet: Client, no_leaks: None) -> None:
    env = SandboxEnv(fleet, "busybox", labels=JOB, setup=["true", "echo broken; exit 4"])
    try:
        with pytest.raises(SetupError, match="exited 4: broken"):
            env.reset()
        assert fleet.list(labels=JOB) == []
        with pytest.raises(gymnasium.error.ResetNeeded):
            env.step("true")
    finally:
        env.close()


def test_constructor_refusals(fleet: Client) -> None:
    with pytest.raises(ValueError, match="max_steps"):
        SandboxEnv(fleet, max_steps=0)
    with pytest.raises(ValueError, match="submit_action"):
        SandboxEnv(fleet, submit_action="é")
    with pytest.raises(ValueError, match="render_mode"):
        SandboxEnv(fleet, render_mode="human")
