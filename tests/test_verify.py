"""Verification apart from the agent: a fresh sandbox of the pre-agent state + the agent's changes +
hidden layers no agent sandbox mounts; what the agent changed; whose fault a failure is."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.errors import InvalidArgumentError, WrongStateError
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
        assert sb.verify("exit 3").cause == "verifier"  # pytest's internal error
        assert sb.verify("exit 4").cause == "verifier"  # pytest's usage error
        assert sb.verify("exit 2", agent_exit_codes=[1]).cause == "verifier"  # a task whose 2 means broken
        assert sb.verify("no-such-checker").cause == "verifier"
        assert sb.verify("kill -TERM $$").cause == "verifier"  # a signal that is no crash
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


def _pause_unless_busy(sb: object) -> None:
    try:
        sb.pause()  # type: ignore[attr-defined]
    except WrongStateError:
        pass  # a check or the snapshot was in flight: pause does not interrupt them


def test_checks_a_snapshot_and_a_pause_of_one_agent_at_once_leave_it_running(
    fleet: Client, task: tuple[str, str]
) -> None:
    """Each check freezes the agent to copy what it changed, as a snapshot and a pause freeze it: at
    once, they take turns at its freezer. None times out on a freeze another one's thaw undid, and
    none leaves the agent frozen under a "running" state (a check once did both, on a busy node)."""
    image, hidden = task
    with _agent(fleet, image) as sb:  # type: ignore[attr-defined]
        sb.exec("sed -i 's/- \\$2/+ $2/' /task/solution.sh")
        for _ in range(4):
            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                checks = [pool.submit(_verify, sb, hidden) for _ in range(4)]
                snap = pool.submit(sb.snapshot, labels=JOB)
                paused = pool.submit(_pause_unless_busy, sb)
                verdicts = [c.result() for c in checks]
                fleet.delete_snapshot(snap.result().id)
                paused.result()
            assert all(v.passed and v.cause is None for v in verdicts), verdicts  # type: ignore[attr-defined]
            assert sb.exec("echo awake", timeout=10).stdout == "awake\n"  # resumed, not left frozen
            assert sb.refresh().state == "running"
    assert fleet.list(labels=JOB) == []


# -- a Python task graded by pytest: whose fault a failure is, and what reaches the checks ------------

REPO = "/work/repo"
BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
PYTEST = f"cd {REPO} && python3 -m pytest -q -p no:cacheprovider tests"
PY_JOB = {"job": "verify-pytest"}


@pytest.fixture(scope="module")
def pytask(daemon: object, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(a python:3.11 + pytest image holding /work/repo: the package `pkg` with a bug and its visible
    tests; the digest of a layer with the hidden test)."""
    root = tmp_path_factory.mktemp("pytask")
    (root / "repo" / "pkg").mkdir(parents=True)
    (root / "repo" / "tests").mkdir()
    (root / "repo" / "pkg" / "__init__.py").write_text("")
    (root / "repo" / "pkg" / "mod.py").write_text(BUGGY)
    (root / "repo" / "tests" / "test_visible.py").write_text(
        "from pkg.mod import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
    )
    recipe = (
        f'ref = "verify-pytask:1"\nbase = "python:3.11"\nworkdir = "{REPO}"\n'
        f'[[step]]\npip = ["pytest==8.3.4"]\n[[step]]\ncopy = {{ src = "repo", dest = "{REPO}" }}\n'
    )
    with daemon.client(timeout=600) as fleet:  # type: ignore[attr-defined]
        image = fleet.build_recipe(recipe, base_dir=root)
        with fleet.create(image="busybox", idle_ttl=120, labels=PY_JOB) as sb:
            sb.files.write(
                f"{REPO}/tests/test_hidden.py",
                "from pkg.mod import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n",
            )
            hidden = sb.pack("verify-pytask-hidden:1").layers[-1]
        yield f"{image.name}:{image.tag}", hidden
        fleet.delete_image("verify-pytask:1")
        fleet.delete_image("verify-pytask-hidden:1")


def _py_agent(fleet: Client, image: str, mod: str | None = None, **resources: object) -> object:
    sb = fleet.create(SandboxSpec(image=image, idle_ttl=120, labels=PY_JOB, resources=resources or {}))
    if mod is not None:
        sb.files.write(f"{REPO}/pkg/mod.py", mod)
    return sb


def test_failures_are_blamed_on_who_caused_them(fleet: Client, pytask: tuple[str, str]) -> None:
    """The agent's code that does not import (pytest exits 2), runs out of memory or crashes failed
    the checks: `agent`, scored. A checker that collects no tests broke: `verifier`, masked."""
    image, hidden = pytask
    cases = {
        "syntax error": ("def add(a, b) return a + b\n", {}),
        "out of memory": ("def add(a, b):\n    x = b'1' * (400 << 20)\n    return a + b + len(x) * 0\n", {}),
        "crash": ("import ctypes\n\n\ndef add(a, b):\n    return ctypes.string_at(0)\n", {}),
    }
    for what, (mod, _) in cases.items():
        with _py_agent(fleet, image, mod) as sb:  # type: ignore[attr-defined]
            v = sb.verify(PYTEST, layers=[hidden], resources={"memory": "128MiB"})
            assert (v.passed, v.reward, v.cause) == (False, 0.0, "agent"), (what, v)
            if what == "out of memory":
                assert v.result.oom_killed, v.result
            if what == "syntax error":
                assert v.result.exit_code == 2 and "SyntaxError" in v.result.stdout, v.result
    with _py_agent(fleet, image, FIXED) as sb:  # type: ignore[attr-defined]
        assert sb.verify(PYTEST, layers=[hidden]).passed
        none = sb.verify(PYTEST + " -k no_such_test", layers=[hidden])  # pytest: no tests ran (5)
        assert (none.result.exit_code, none.cause) == (5, "verifier"), none.result
    assert fleet.list(labels=PY_JOB) == []


# Each plants something outside the code it was asked to fix, so that a check run by `python3 -m
# pytest` passes without the fix.
CHEATS = {
    "root conftest.py": (
        f"{REPO}/conftest.py",
        "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
        "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n",
    ),
    ".pth file": ("/usr/local/lib/python3.11/dist-packages/zz.pth", "import os; os._exit(0)\n"),
    "sitecustomize": ("/etc/python3.11/sitecustomize.py", "import os\nos._exit(0)\n"),
    "binary on PATH": ("/usr/local/bin/python3", "#!/bin/sh\nexit 0\n"),
}


def test_allow_keeps_only_the_agents_changes_under_named_paths(fleet: Client, pytask: tuple[str, str]) -> None:
    image, hidden = pytask
    for what, (path, content) in CHEATS.items():
        with _py_agent(fleet, image) as sb:  # type: ignore[attr-defined]
            sb.files.write(path, content, mode=0o755)
            assert sb.exec(PYTEST).exit_code == 0, what  # in its own sandbox the cheat works
            # `protect` alone keeps it: the tests are as they were, but the cheat sits outside them.
            leaky = sb.verify(PYTEST, layers=[hidden], protect=[f"{REPO}/tests"])
            assert leaky.reward == 1.0, (what, leaky)
            v = sb.verify(PYTEST, layers=[hidden], allow=[f"{REPO}/pkg"], protect=[f"{REPO}/tests"])
            assert (v.passed, v.reward, v.cause) == (False, 0.0, "agent"), (what, v)
            assert path in v.dropped and path in {c.path for c in v.changed}, (what, v.dropped)
    # An honest fix under `allow` passes, even by a repository deleted and made again: the directory
    # on the way keeps what the layers below hold beside the allowed path (the visible tests here).
    with _py_agent(fleet, image) as sb:  # type: ignore[attr-defined]
        sb.exec(f"rm -rf {REPO} && mkdir -p {REPO}/pkg && touch {REPO}/pkg/__init__.py {REPO}/junk")
        sb.files.write(f"{REPO}/pkg/mod.py", FIXED)
        v = sb.verify(PYTEST, layers=[hidden], allow=[f"{REPO}/pkg"], protect=[f"{REPO}/tests"])
        assert v.passed and v.reward == 1.0, v
        assert "2 passed" in v.result.stdout, v.result.stdout  # the visible test and the hidden one
        assert f"{REPO}/junk" in v.dropped and f"{REPO}/pkg/mod.py" not in v.dropped
    assert fleet.list(labels=PY_JOB) == []


def test_bad_verify_requests_are_typed(daemon: object, fleet: Client, task: tuple[str, str]) -> None:
    image, _ = task
    bad = [{"allow": ["/"]}, {"protect": ["/.."]}, {"allow": []}, {"allow": ["relative"]}, {"cpu_time": 0},
           {"queue_timeout": -1}, {"agent_exit_codes": [256]}]  # fmt: skip
    with _agent(fleet, image) as sb:  # type: ignore[attr-defined]
        transport = httpx.HTTPTransport(uds=str(daemon.socket))  # type: ignore[attr-defined]
        with httpx.Client(transport=transport, base_url="http://sandfleet", timeout=30) as http:
            for fields in bad:
                r = http.post(f"/v1/sandboxes/{sb.id}/verify", json={"command": "true", **fields})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument", (fields, r.text)
            with pytest.raises(InvalidArgumentError, match="allow"):
                sb.verify("true", allow=["/"])
    assert fleet.list(labels=JOB) == []
