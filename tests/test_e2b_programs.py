"""Third-party programs written for E2B, installed from PyPI, run unchanged against sandfleet's E2B
layer (`sandfleet e2b`), pointed at it only by E2B's environment variables: smolagents' `E2BExecutor`
(its remote Python executor) and its `CodeAgent` with `executor_type="e2b"`, driven by a scripted model
(no LLM, no internet)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest

smolagents = pytest.importorskip("smolagents")
pytest.importorskip("e2b_code_interpreter")

from e2b import Sandbox  # noqa: E402
from smolagents import AgentError, CodeAgent, LogLevel, Tool  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402
from smolagents.monitoring import AgentLogger  # noqa: E402
from smolagents.remote_executors import E2BExecutor  # noqa: E402

import test_e2b  # noqa: E402

KEYS = test_e2b.KEYS
Node = test_e2b.Node
node = test_e2b.node  # the same module-scoped fixture: a daemon of its own, E2B's base template, the layer


@pytest.fixture
def e2b_env(node: Node, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    """Only E2B's own environment points the programs at the layer."""
    monkeypatch.setenv("E2B_API_KEY", KEYS["a"])
    monkeypatch.setenv("E2B_API_URL", node.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", node.url)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    monkeypatch.delenv("E2B_DOMAIN", raising=False)
    yield node
    # Whatever a program left: nothing live, for E2B's list and for sandfleet's root alike.
    assert not Sandbox.list(**node.opts()).next_items()
    with node.daemon.client() as root:
        assert not root.list()


class SandboxHostTool(Tool):
    """A tool as smolagents users write them: its source is sent to the sandbox and runs there."""

    name = "sandbox_host"
    description = "The hostname of the machine this tool runs on, then a suffix."
    inputs = {"suffix": {"type": "string", "description": "appended after the hostname"}}
    output_type = "string"

    def forward(self, suffix: str) -> str:
        import socket

        return socket.gethostname() + suffix


def _text(message: ChatMessage) -> str:
    content = message.content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


class ScriptedModel(Model):
    """A model that answers with the next code action of its script and keeps what it was shown
    (the agent's memory: the observations of the earlier actions, run in the sandbox)."""

    def __init__(self, actions: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.actions = list(actions)
        self.seen: list[str] = []

    def generate(self, messages: list[ChatMessage], stop_sequences: list[str] | None = None,
                 response_format: dict[str, str] | None = None, tools_to_call_from: Any = None,
                 **kwargs: Any) -> ChatMessage:  # fmt: skip
        self.seen.append("\n".join(_text(m) for m in messages))
        action = self.actions.pop(0)
        return ChatMessage(role=MessageRole.ASSISTANT, content=f"Thought: next step.\n<code>\n{action}\n</code>")


def test_smolagents_e2b_executor_runs_code_tools_and_variables(e2b_env: Node) -> None:
    """smolagents' E2BExecutor as its remote agents use it: it creates the sandbox (E2B's code
    interpreter template), sends variables and a tool's source, runs code with state kept between
    calls (results, printed logs), raises AgentError with the sandbox's traceback, kills the sandbox
    in cleanup."""
    seed = secrets.token_hex(8)
    executor = E2BExecutor(additional_imports=[], logger=AgentLogger(level=LogLevel.OFF))
    try:
        sandbox_id = executor.sandbox.sandbox_id
        # What only the sandbox knows, read beside the program through E2B's SDK.
        probe = Sandbox.connect(sandbox_id)
        host = probe.commands.run("hostname").stdout.strip()
        assert host and Sandbox.get_info(sandbox_id).template_id == "code-interpreter-v1"
        executor.send_variables({"seed": seed, "shape": {"n": (6, 7)}})
        executor.send_tools({"sandbox_host": SandboxHostTool()})
        first = executor(
            "import os, pathlib\nnote = sandbox_host(suffix='@' + seed)\n"
            "pathlib.Path('/home/user/note.txt').write_text(note)\nprint('pid', os.getpid())\n"
            "shape['n'][0] * shape['n'][1]"
        )
        assert first.output == "42" and first.logs.startswith("pid ") and not first.is_final_answer
        assert probe.files.read("/home/user/note.txt") == f"{host}@{seed}"
        pid = int(first.logs.split()[1])
        again = executor("print(note.upper())\nos.getpid()")  # the same kernel: its names and process
        assert again.logs == f"{host.upper()}@{seed.upper()}\n" and again.output == str(pid)
        assert executor("y = pathlib.Path('/home/user/note.txt').read_text()").output is None
        assert executor("y").output == f"{host}@{seed}"  # a string's text without its quotes, as E2B gives it
        with pytest.raises(AgentError) as failed:
            executor("print('before')\ndef f():\n    raise KeyError('missing-key')\nf()")
        message = str(failed.value)
        assert message.startswith("before\n") and "KeyError" in message and "missing-key" in message
        assert "raise KeyError('missing-key')" in message  # the cell's line, in the sandbox's traceback
    finally:
        executor.cleanup()
    assert not hasattr(executor, "sandbox") and not probe.is_running()


def test_smolagents_code_agent_runs_its_actions_in_a_sandbox(e2b_env: Node) -> None:
    """smolagents' CodeAgent with `executor_type="e2b"`: its executor creates the sandbox, defines its
    tools there (the final_answer tool, patched to raise), sends the run's variables, runs each action
    with state kept between them, turns a failed action into an observation the model sees, ends on
    final_answer, and kills the sandbox on leaving. (Since 1.25 every run first sends `!pip install
    pillow numpy`, an IPython shell escape: the layer's kernel runs it, and pip, with no network in
    the sandbox, prints its failure and the run goes on, as on E2B without those packages.)"""
    seed = secrets.token_hex(8)
    model = ScriptedModel(
        [
            # 1: a tool run in the sandbox, a file written there, printed output.
            "import pathlib\nnote = sandbox_host(suffix='@' + seed)\n"
            "pathlib.Path('/home/user/note.txt').write_text(note)\nprint('note is', note)",
            # 2: an error: the agent goes on, the model is shown it.
            "print('about to fail')\n1 / 0",
            # 3: the earlier action's names and file, back through final_answer.
            "final_answer({'note': pathlib.Path('/home/user/note.txt').read_text(), 'n': 6 * 7})",
        ]
    )
    with CodeAgent(tools=[SandboxHostTool()], model=model, executor_type="e2b", max_steps=5,
                   verbosity_level=LogLevel.OFF) as agent:  # fmt: skip
        executor = agent.python_executor
        assert isinstance(executor, E2BExecutor)
        probe = Sandbox.connect(executor.sandbox.sandbox_id)
        host = probe.commands.run("hostname").stdout.strip()
        assert host
        answer = agent.run("Write a note and return it.", additional_args={"seed": seed})
        assert answer == {"note": f"{host}@{seed}", "n": 42}
        assert probe.files.read("/home/user/note.txt") == f"{host}@{seed}"
        # What the model was shown: each action's observation, computed in the sandbox.
        assert len(model.seen) == 3 and not model.actions
        assert f"note is {host}@{seed}" in model.seen[1]
        assert "about to fail" in model.seen[2] and "ZeroDivisionError" in model.seen[2]
        steps = [s for s in agent.memory.steps if getattr(s, "code_action", None)]
        assert [s.is_final_answer for s in steps] == [False, False, True]
        assert steps[1].error is not None and "ZeroDivisionError" in str(steps[1].error)
    assert not probe.is_running()
