"""An OpenEnv environment server whose episodes run shell commands in sandfleet sandboxes.

OpenEnv (openenv-core) serves an `Environment` over FastAPI: each WebSocket session (`/ws`, what
its `EnvClient` speaks) gets an environment instance of its own, made by a factory and closed when
the session ends. Here an instance holds one sandbox per episode: `reset` creates it (or restores it
from a snapshot), each `step` runs one command in it, and `close` stops it, so a disconnected client
leaves nothing running. OpenEnv's plain HTTP `/reset` and `/step` make a fresh instance per request
and close it at once (its server defines them so): `/reset` answers an episode's first observation,
and `/step` runs its action as an episode of one step (a sandbox of its own: reset with the
request's `seed`, the command, the score, stop). An episode of several steps needs the WebSocket
session.

    app = create_sandfleet_app(ShellTask(spec=SandboxSpec(image="busybox"), check="test -f /done"),
                               fleet="/run/sandfleet/sandfleet.sock", max_concurrent_envs=16)
    # uvicorn.run(app, port=8000); then, from anywhere:
    with SandfleetEnvClient(base_url="http://localhost:8000").sync() as env:
        env.reset(seed=1)
        result = env.step(CommandAction(command="touch /done"))   # result.done, result.reward == 1.0
"""

from __future__ import annotations

import functools
import os
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from openenv.core.client_types import StepResult  # type: ignore[import-untyped]
from openenv.core.env_client import EnvClient  # type: ignore[import-untyped]
from openenv.core.env_server.http_server import create_app  # type: ignore[import-untyped]
from openenv.core.env_server.interfaces import Environment  # type: ignore[import-untyped]
from openenv.core.env_server.types import (  # type: ignore[import-untyped]
    Action,
    EnvironmentMetadata,
    Observation,
    State,
)
from pydantic import Field

from sandfleet.adapters._episode import connect, cut, run_step, start_sandbox, stop_quietly
from sandfleet.client import Sandbox
from sandfleet.models import ExecResult, SandboxSpec


class CommandAction(Action):  # type: ignore[misc]
    """One shell command, run under /bin/sh -c in the episode's sandbox."""

    command: str = Field(..., min_length=1, description="shell command to run in the sandbox")


class CommandObservation(Observation):  # type: ignore[misc]
    """What a command did: its merged stdout/stderr (cut to the task's `max_output` characters), its
    exit status, whether its timeout killed it; `done` and `reward` as OpenEnv defines them."""

    output: str = Field("", description="stdout and stderr, merged in order (the task's instructions at reset)")
    exit_code: int = Field(0, description="the command's exit status (137 when its timeout killed it)")
    timed_out: bool = Field(False, description="the step's timeout killed the command")
    truncated: bool = Field(False, description="the episode ended because it reached max_steps")


class SandboxState(State):  # type: ignore[misc]
    """OpenEnv's state (episode id, step count) plus the sandbox the episode runs in."""

    sandbox_id: str | None = Field(None, description="the episode's sandbox (None before the first reset)")
    seed: int | None = Field(None, description="the reset's seed, also the sandbox's SANDFLEET_SEED")


@dataclass(frozen=True)
class ShellTask:
    """What an episode is: the sandbox to start (`spec`, or `snapshot_id` to restore a prepared
    state instead of creating and running `setup`/`files`), the `instructions` observed at reset,
    the `check` command that passes (exit 0) when the task is solved, or a `reward_fn(sandbox)`
    scoring it, the action that submits, and the limits of an episode."""

    spec: SandboxSpec = field(default_factory=lambda: SandboxSpec(image="busybox"))
    setup: Sequence[str] = ()
    files: Mapping[str, bytes | str] = field(default_factory=dict)
    snapshot_id: str | None = None
    instructions: str = ""
    check: str | None = None
    check_each_step: bool = True
    reward_fn: Callable[[Sandbox], float] | None = None
    submit_action: str = "submit"
    max_steps: int = 20
    step_timeout: float = 30.0
    setup_timeout: float | None = 600.0
    max_output: int = 16384


class SandfleetEnvironment(Environment):  # type: ignore[misc]
    """An OpenEnv `Environment` over sandfleet: an episode is a sandbox, a step one command.

    `done` when the agent sends the task's submit action, when its check passes (after each step,
    unless `check_each_step=False`), or after `max_steps`; each step's reward is 0.0 but the last
    one's, which is the score (`reward_fn(sandbox)`, else 1.0 if the check exits 0). The reset's
    seed reaches every command as `SANDFLEET_SEED`. Made by the server's factory (one per session,
    and one per plain-HTTP request), so construction is cheap: the sandbox comes with `reset`.
    SandboxErrors propagate: the server answers them as errors of the step or reset.
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # each session holds a sandbox, and a client, of its own

    def __init__(self, task: ShellTask, fleet: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.task = task
        self.fleet, _ = connect(fleet)
        self.sandbox: Sandbox | None = None
        self._state = SandboxState()
        self._done = False
        self._fresh = True  # never reset: a step is then an episode of its own (OpenEnv's HTTP /step)

    # -- the episode's sandbox

    def _start_sandbox(self, seed: int) -> Sandbox:
        task = self.task
        return start_sandbox(
            self.fleet,
            task.spec,
            seed,
            snapshot_id=task.snapshot_id,
            setup=task.setup,
            files=task.files,
            setup_timeout=task.setup_timeout,
        )

    def _stop_sandbox(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        stop_quietly(sandbox)

    def _exec(self, command: str, timeout: float | None) -> ExecResult:
        assert self.sandbox is not None
        return run_step(self.sandbox, command, self._state.seed, timeout, self.task.max_output)

    def _check_passes(self) -> bool:
        if self.task.check is None:
            return False
        result = self._exec(self.task.check, self.task.step_timeout)
        return result.exit_code == 0 and not result.timed_out

    def _score(self, passed: bool | None) -> float:
        assert self.sandbox is not None
        if self.task.reward_fn is not None:
            return float(self.task.reward_fn(self.sandbox))
        return 1.0 if (self._check_passes() if passed is None else passed) else 0.0

    # -- openenv Environment

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> CommandObservation:
        """A new episode in a new sandbox (the previous one is stopped first). Without a seed one is
        drawn, so the state always says which `SANDFLEET_SEED` the episode ran with."""
        self._stop_sandbox()
        seed = secrets.randbelow(2**31) if seed is None else seed
        self._done, self._fresh = False, False
        self._state = SandboxState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, seed=seed)
        self.sandbox = self._start_sandbox(seed)
        self._state.sandbox_id = self.sandbox.id
        return CommandObservation(output=cut(self.task.instructions, self.task.max_output), reward=None, done=False)

    def step(self, action: CommandAction, timeout_s: float | None = None, **kwargs: Any) -> CommandObservation:
        """Run the command (its timeout: `timeout_s`, else the task's `step_timeout`). On an
        environment never reset (OpenEnv's plain HTTP /step makes one per request), the step is an
        episode of its own: a reset (with the request's `seed`), the command, done, scored."""
        alone = self._fresh
        if alone:
            seed = kwargs.get("seed")
            self.reset(seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None)
        if self.sandbox is None or self._done:
            raise RuntimeError("no episode is running: reset first (an episode of several steps needs /ws)")
        self._state.step_count += 1
        passed: bool | None = None
        if action.command.strip() == self.task.submit_action:
            obs = CommandObservation(output="", exit_code=0, done=True, metadata={"submitted": True})
        else:
            result = self._exec(action.command, timeout_s or self.task.step_timeout)
            if self.task.check is not None and self.task.check_each_step:
                passed = self._check_passes()
            obs = CommandObservation(
                output=cut(result.stdout, self.task.max_output),
                exit_code=result.exit_code,
                timed_out=result.timed_out,
                done=bool(passed),
            )
        if not obs.done and (alone or self._state.step_count >= self.task.max_steps):
            obs.done = obs.truncated = True
        obs.reward = 0.0
        if obs.done:
            self._done = True
            obs.reward = self._score(passed)
        return obs

    @property
    def state(self) -> SandboxState:
        state: SandboxState = self._state.model_copy()  # a copy: the server serialises it later
        return state

    def get_metadata(self) -> EnvironmentMetadata:
        return EnvironmentMetadata(
            name="sandfleet-shell",
            description="Shell commands in an isolated sandfleet sandbox, one sandbox per episode.",
            version="1.0.0",
        )

    def close(self) -> None:
        """Stop the episode's sandbox and close the client; safe to repeat."""
        self._stop_sandbox()
        self.fleet.close()


def create_sandfleet_app(
    task: ShellTask | None = None,
    fleet: str | os.PathLike[str] | None = None,
    *,
    max_concurrent_envs: int = 1,
) -> Any:
    """The ASGI app (FastAPI, OpenEnv's routes: /ws, /reset, /step, /state, /schema, /health, ...)
    serving `task` on the daemon at `fleet` (URL, socket path, or None: the default socket), with up
    to `max_concurrent_envs` WebSocket sessions (and so sandboxes) at once."""
    factory = functools.partial(SandfleetEnvironment, task or ShellTask(), fleet)
    return create_app(
        factory, CommandAction, CommandObservation, env_name="sandfleet", max_concurrent_envs=max_concurrent_envs
    )


class SandfleetEnvClient(EnvClient):  # type: ignore[misc]
    """OpenEnv's WebSocket client, typed for this environment: `CommandAction` in, `CommandObservation`
    and `SandboxState` out. Async; `.sync()` gives OpenEnv's blocking wrapper."""

    def _step_payload(self, action: CommandAction) -> dict[str, Any]:
        return {"command": action.command}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult:
        obs = CommandObservation(
            **payload.get("observation", {}), done=payload.get("done", False), reward=payload.get("reward")
        )
        return StepResult(observation=obs, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> SandboxState:
        return SandboxState(**payload)
