"""The OpenEnv adapter served by uvicorn and driven by OpenEnv's own clients (its typed EnvClient
base through our subclass, its GenericEnvClient, its sync wrapper) and its runtime validator, against
a real daemon: commands run in real sandboxes, and every session's sandbox goes with the session."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if importlib.util.find_spec("openenv") is None:  # found, not imported: openenv.core takes seconds to import
    pytest.skip("openenv is not installed", allow_module_level=True)
uvicorn = pytest.importorskip("uvicorn")

from sandfleet import Client, SandboxSpec  # noqa: E402

from conftest import Daemon, wait_until  # noqa: E402

if TYPE_CHECKING:
    from sandfleet.adapters.openenv import ShellTask

JOB = {"job": "openenv-test"}
BUMP = "echo $(( $(cat /task/count) + 1 )) > /task/count; cat /task/count"


def counter() -> ShellTask:
    from sandfleet.adapters.openenv import ShellTask

    return ShellTask(
        spec=SandboxSpec(image="busybox", labels=JOB),
        setup=["mkdir -p /task", "echo 0 > /task/count"],
        instructions="bump /task/count to 3",
        check='[ "$(cat /task/count)" = 3 ]',
        max_steps=10,
    )


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Run `app` under uvicorn in a thread on a free loopback port; its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=30), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture
def no_leaks(fleet: Client) -> Iterator[None]:
    yield
    # Sessions end asynchronously (the server closes their env after the socket closes).
    wait_until(lambda: not fleet.list(labels=JOB), timeout=15)
    left = fleet.list(labels=JOB)
    for info in left:
        fleet.get(info.id).stop()
    assert not left, f"sandboxes left running: {[s.id for s in left]}"


def test_typed_client_episode(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    from sandfleet.adapters.openenv import CommandAction, SandboxState, SandfleetEnvClient, create_sandfleet_app

    app = create_sandfleet_app(counter(), daemon.socket)
    with serving(app) as url, SandfleetEnvClient(base_url=url).sync() as env:
        result = env.reset(seed=3)
        assert (result.observation.output, result.done, result.reward) == ("bump /task/count to 3", False, None)
        state = env.state()
        assert isinstance(state, SandboxState) and state.step_count == 0 and state.seed == 3
        sandbox_id = state.sandbox_id
        assert [s.id for s in fleet.list(labels=JOB)] == [sandbox_id]
        for n in (1, 2):
            result = env.step(CommandAction(command=BUMP))
            assert (result.observation.output, result.observation.exit_code, result.done, result.reward) == (
                f"{n}\n",
                0,
                False,
                0.0,
            )
        # The commands really ran in that sandbox.
        assert fleet.get(sandbox_id).files.read_text("/task/count") == "2\n"
        result = env.step(CommandAction(command="echo $SANDFLEET_SEED; echo err >&2; exit 5"))
        assert (result.observation.output, result.observation.exit_code) == ("3\nerr\n", 5)
        result = env.step(CommandAction(command=BUMP))
        assert (result.observation.output, result.done, result.reward) == ("3\n", True, 1.0)
        state = env.state()
        assert (state.step_count, state.sandbox_id) == (4, sandbox_id)
        with pytest.raises(RuntimeError, match="reset first"):
            env.step(CommandAction(command="true"))  # the episode is over
        # A new episode: a fresh sandbox, the old one stopped.
        env.reset()
        assert env.state().sandbox_id != sandbox_id
        assert sandbox_id not in {s.id for s in fleet.list(labels=JOB)}
        assert env.step(CommandAction(command="cat /task/count")).observation.output == "0\n"
    # Disconnecting ended the session, which stops its sandbox (no_leaks waits for it).


def test_generic_client_submit_and_truncation(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    """OpenEnv's schema-less client: plain dicts on the wire."""
    from openenv.core import GenericEnvClient

    from sandfleet.adapters.openenv import ShellTask, create_sandfleet_app

    scored: list[str] = []

    def reward_fn(sandbox: Any) -> float:
        text: str = sandbox.files.read_text("/tmp/score")
        scored.append(text)
        return float(text)

    task = ShellTask(spec=SandboxSpec(image="busybox", labels=JOB), reward_fn=reward_fn, max_steps=2)

    async def drive(url: str) -> None:
        async with GenericEnvClient(base_url=url) as env:
            await env.reset(seed=1)
            result = await env.step({"command": "echo 0.75 > /tmp/score"})
            assert (result.done, result.reward) == (False, 0.0)
            result = await env.step({"command": "submit"})
            assert (result.done, result.reward, result.observation["truncated"]) == (True, 0.75, False)
            await env.reset()
            await env.step({"command": "echo 0.5 > /tmp/score"})
            result = await env.step({"command": "true"})
            assert (result.done, result.reward, result.observation["truncated"]) == (True, 0.5, True)
            state = await env.state()
            assert state["step_count"] == 2
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR|validation"):
                await env.step({"command": ""})  # refused by the action model: min length 1

    with serving(create_sandfleet_app(task, daemon.socket)) as url:
        asyncio.run(drive(url))
    assert scored == ["0.75\n", "0.5\n"]


def test_concurrent_sessions_are_isolated(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    from sandfleet.adapters.openenv import CommandAction, SandfleetEnvClient, create_sandfleet_app

    app = create_sandfleet_app(counter(), daemon.socket, max_concurrent_envs=2)
    with serving(app) as url:
        a, b = SandfleetEnvClient(base_url=url).sync(), SandfleetEnvClient(base_url=url).sync()
        with a, b:
            a.reset(seed=1)
            b.reset(seed=2)
            assert a.state().sandbox_id != b.state().sandbox_id
            assert len(fleet.list(labels=JOB)) == 2
            a.step(CommandAction(command=BUMP))
            a.step(CommandAction(command=BUMP))
            assert b.step(CommandAction(command=BUMP)).observation.output == "1\n"
            assert a.step(CommandAction(command="echo $SANDFLEET_SEED")).observation.output == "1\n"
            assert b.step(CommandAction(command="echo $SANDFLEET_SEED")).observation.output == "2\n"
            a.close()  # one session ends: its sandbox goes, the other's stays
            assert wait_until(lambda: len(fleet.list(labels=JOB)) == 1, timeout=15)
            assert b.step(CommandAction(command="cat /task/count")).observation.output == "1\n"


def test_snapshot_task_and_step_timeout(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    from sandfleet.adapters.openenv import CommandAction, SandfleetEnvClient, ShellTask, create_sandfleet_app

    with fleet.create(image="busybox", labels=JOB) as prep:
        prep.exec("mkdir -p /task && echo prepared > /task/state")
        snapshot_id = prep.snapshot().id
    task = ShellTask(spec=SandboxSpec(labels=JOB), snapshot_id=snapshot_id, step_timeout=1, check="false")
    try:
        with serving(create_sandfleet_app(task, daemon.socket)) as url, SandfleetEnvClient(base_url=url).sync() as env:
            env.reset(seed=4)
            assert len(fleet.list(labels=JOB)) == 1
            result = env.step(CommandAction(command="cat /task/state; echo $SANDFLEET_SEED"))
            assert result.observation.output == "prepared\n4\n"
            result = env.step(CommandAction(command="sleep 30"))
            assert (result.observation.timed_out, result.observation.exit_code, result.done) == (True, 137, False)
    finally:
        fleet.delete_snapshot(snapshot_id)


def test_http_endpoints_and_validator(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    """OpenEnv's runtime validator passes; its stateless HTTP routes work and leave nothing behind:
    /reset answers an episode's first observation, /step runs its action as an episode of one step."""
    from openenv.cli._validation import validate_running_environment

    from sandfleet.adapters.openenv import create_sandfleet_app

    with serving(create_sandfleet_app(counter(), daemon.socket)) as url:
        report = validate_running_environment(url, timeout_s=30)
        assert report["passed"], report
        with httpx.Client(base_url=url, timeout=60) as http:
            reset = http.post("/reset", json={"seed": 9})
            assert reset.status_code == 200
            assert reset.json()["observation"]["output"] == "bump /task/count to 3"
            assert fleet.list(labels=JOB) == []  # the request's env (and sandbox) closed with it
            schema = http.get("/schema").json()
            assert "command" in schema["action"]["properties"]
            assert {"output", "exit_code"} <= set(schema["observation"]["properties"])
            assert http.get("/metadata").json()["name"] == "sandfleet-shell"
            assert http.post("/step", json={"action": {"command": 1}}).status_code == 422
            # A step of its own: a fresh sandbox (set up, seeded), the command, done, scored, stopped.
            step = http.post("/step", json={"action": {"command": BUMP + "; echo $SANDFLEET_SEED"}, "seed": 7})
            assert step.status_code == 200, step.text
            body = step.json()
            assert (body["observation"]["output"], body["done"], body["reward"]) == ("1\n7\n", True, 0.0)
            solved = http.post("/step", json={"action": {"command": "echo 3 > /task/count"}}).json()
            assert (solved["done"], solved["reward"]) == (True, 1.0)
            assert fleet.list(labels=JOB) == []


def test_setup_failure_reported_and_cleaned(daemon: Daemon, fleet: Client, no_leaks: None) -> None:
    from sandfleet.adapters.openenv import CommandAction, SandfleetEnvClient, ShellTask, create_sandfleet_app

    task = ShellTask(spec=SandboxSpec(image="busybox", labels=JOB), setup=["echo nope; exit 2"])
    with serving(create_sandfleet_app(task, daemon.socket)) as url, SandfleetEnvClient(base_url=url).sync() as env:
        with pytest.raises(RuntimeError, match="exited 2"):
            env.reset()
        assert fleet.list(labels=JOB) == []
        with pytest.raises(RuntimeError, match="reset first"):
            env.step(CommandAction(command="true"))
