"""The mini-swe-agent environment adapter against a real daemon: a real DefaultAgent driven by
mini-swe-agent's own DeterministicModel edits a file in a sandbox and submits; execute() keeps the
contract of mini-swe-agent's DockerEnvironment (cwd, env, timeouts, exit codes, the error dict).

mini-swe-agent ships no environment-interface tests in its sdist (its tests/environments/ exist only
in the git repository, and test concrete classes), so these are ours.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
minisweagent = pytest.importorskip("minisweagent")

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.exceptions import Submitted  # noqa: E402
from minisweagent.models.test_models import DeterministicModel, make_output  # noqa: E402

from sandfleet import Client  # noqa: E402
from sandfleet.adapters.minisweagent import SandfleetEnvironment  # noqa: E402

LABELS = {"job": "minisweagent-test"}
IMAGE = "python:3.11"


@pytest.fixture
def envs(fleet: Client) -> Iterator[list[SandfleetEnvironment]]:
    """Environments a test makes: all cleaned up after it, and none of their sandboxes left."""
    made: list[SandfleetEnvironment] = []
    yield made
    for env in made:
        env.cleanup()
    assert fleet.list(labels=LABELS) == []


@pytest.fixture
def env(fleet: Client, envs: list[SandfleetEnvironment]) -> SandfleetEnvironment:
    e = SandfleetEnvironment(client=fleet, image=IMAGE, labels=LABELS, timeout=20)
    envs.append(e)
    return e


def packaged_config() -> dict:
    """mini-swe-agent's own default.yaml: its prompts render the environment's template vars."""
    return yaml.safe_load((Path(minisweagent.package_dir) / "config" / "default.yaml").read_text())


def test_default_agent_edits_a_file_and_submits(fleet: Client, envs: list[SandfleetEnvironment]) -> None:
    cfg = packaged_config()
    env = SandfleetEnvironment(client=fleet, image=IMAGE, labels=LABELS, cwd="/repo", **cfg["environment"])
    envs.append(env)
    assert env.sandbox is not None
    env.sandbox.files.write("/repo/greet.py", "print('hello wrold')\n")
    model = DeterministicModel(
        observation_template=cfg["model"]["observation_template"],
        outputs=[
            make_output("Look first.\n", [{"command": "cat greet.py && echo $PAGER"}]),
            make_output("Fix the typo.\n", [{"command": "sed -i 's/wrold/world/' greet.py && python3 greet.py"}]),
            make_output("Done.\n", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat greet.py"}]),
        ],
    )
    agent = DefaultAgent(model, env, **cfg["agent"])
    result = agent.run("Fix the typo in greet.py")

    assert result["exit_status"] == "Submitted"
    assert result["submission"].endswith("print('hello world')\n")
    assert env.sandbox.files.read("/repo/greet.py") == b"print('hello world')\n"
    observations = [m["content"] for m in agent.messages if m["role"] == "user"][1:]
    assert "hello wrold" in observations[0] and "cat" in observations[0]  # cwd and env applied
    assert "<returncode>0</returncode>" in observations[1] and "hello world" in observations[1]
    # The task prompt rendered the sandbox's uname (get_template_vars).
    assert env.get_template_vars()["release"] in agent.messages[1]["content"]
    data = agent.serialize()
    assert data["info"]["config"]["environment_type"] == "sandfleet.adapters.minisweagent.SandfleetEnvironment"
    assert data["info"]["config"]["environment"]["image"] == IMAGE


def test_loadable_by_class_path(daemon: object, fleet: Client, envs: list[SandfleetEnvironment]) -> None:
    config = {
        "environment_class": "sandfleet.adapters.minisweagent.SandfleetEnvironment",
        "image": "busybox",
        "interpreter": ["sh", "-c"],
        "socket": str(daemon.socket),  # type: ignore[attr-defined]
        "labels": LABELS,
        "sandbox": {"idle_ttl": 120, "resources": {"memory": "256MiB"}},
    }
    env = get_environment(config)
    assert isinstance(env, SandfleetEnvironment)
    envs.append(env)
    r = env.execute({"command": "echo hi; cat /sys/fs/cgroup/memory.max 2>/dev/null || true"})
    assert r["returncode"] == 0 and r["output"].startswith("hi\n")
    [info] = fleet.list(labels=LABELS)
    assert info.spec.image == "busybox" and info.spec.idle_ttl == 120


def test_execute_cwd_env_and_exit_codes(monkeypatch: pytest.MonkeyPatch, fleet: Client, envs: list) -> None:
    monkeypatch.setenv("SANDFLEET_FWD", "from-host")
    env = SandfleetEnvironment(
        client=fleet,
        image=IMAGE,
        labels=LABELS,
        cwd="/tmp",
        env={"A": "1", "SANDFLEET_FWD": "overridden"},
        forward_env=["SANDFLEET_FWD", "SANDFLEET_UNSET_VAR"],
    )
    envs.append(env)
    assert env.execute({"command": "pwd"})["output"] == "/tmp\n"
    assert env.execute({"command": "pwd"}, cwd="/usr")["output"] == "/usr\n"
    r = env.execute({"command": 'echo "$A $SANDFLEET_FWD ${SANDFLEET_UNSET_VAR-unset}"'})
    assert r == {"output": "1 overridden unset\n", "returncode": 0, "exception_info": ""}
    r = env.execute({"command": "echo out; echo err >&2; exit 3"})
    assert r["returncode"] == 3 and r["output"] == "out\nerr\n" and r["exception_info"] == ""
    r = env.execute({"command": "no_such_command_xyz"})
    assert r["returncode"] == 127 and "no_such_command_xyz" in r["output"]
    # No shell state carries over between actions (as with docker exec).
    env.execute({"command": "cd /etc; export X=1"})
    assert env.execute({"command": "pwd; echo ${X-none}"})["output"] == "/tmp\nnone\n"


def test_forwarded_env_is_passed(monkeypatch: pytest.MonkeyPatch, fleet: Client, envs: list) -> None:
    monkeypatch.setenv("SANDFLEET_FWD", "from-host")
    env = SandfleetEnvironment(client=fleet, image="busybox", interpreter=["sh", "-c"], labels=LABELS,
                               forward_env=["SANDFLEET_FWD"])  # fmt: skip
    envs.append(env)
    assert env.execute({"command": "echo $SANDFLEET_FWD"})["output"] == "from-host\n"


def test_execute_timeout_returns_the_error_dict(env: SandfleetEnvironment) -> None:
    r = env.execute({"command": "echo started; sleep 30"}, timeout=1)
    assert r["returncode"] == -1
    assert r["output"].startswith("started\n")  # what ran before the deadline
    assert r["extra"]["exception_type"] == "TimeoutExpired"
    assert "timed out after 1 seconds" in r["exception_info"]
    # The config's timeout applies when execute gives none; the sandbox lives on.
    env.config.timeout = 1
    assert env.execute({"command": "sleep 5"})["returncode"] == -1
    assert env.execute({"command": "echo alive"})["output"] == "alive\n"


def test_submit_marker(env: SandfleetEnvironment) -> None:
    with pytest.raises(Submitted) as exc:
        env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; echo the patch"})
    [msg] = exc.value.messages
    assert msg["extra"] == {"exit_status": "Submitted", "submission": "the patch\n"}
    # Only a successful command submits.
    r = env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false"})
    assert r["returncode"] == 1


def test_sandbox_errors_become_the_error_dict(fleet: Client, env: SandfleetEnvironment) -> None:
    assert env.sandbox is not None
    fleet.get(env.sandbox.id).stop()  # gone behind the environment's back (TTL, stop_many, ...)
    r = env.execute({"command": "echo hi"})
    assert r["returncode"] == -1 and r["output"] == ""
    assert r["extra"]["exception_type"] in ("SandboxNotFoundError", "WrongStateError")


def test_template_vars_and_cleanup(fleet: Client, env: SandfleetEnvironment) -> None:
    tv = env.get_template_vars(extra="x")
    assert tv["image"] == IMAGE and tv["system"] == "Linux" and tv["extra"] == "x"
    assert {"node", "release", "version", "machine"} <= set(tv)
    assert len(fleet.list(labels=LABELS)) == 1
    env.cleanup()
    env.cleanup()  # idempotent
    assert fleet.list(labels=LABELS) == []
