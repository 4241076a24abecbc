"""A Gymnasium `Env` whose episodes run shell commands in a sandfleet sandbox.

Each episode gets a sandbox of its own: `reset()` stops the previous one and creates a fresh one from
a spec (running the task's setup), or restores one from a snapshot, so many environments can start
from one prepared state without repeating the setup (`prepare_snapshot`). An action is a shell
command; the observation is its output (stdout and stderr merged, in order) and exit code. The reward
comes at the end of the episode, from the task's check command (1.0 if it exits 0) or a `reward_fn`.

The env is synchronous over the blocking `Client`: Gymnasium's API is synchronous, and vectorised
envs run each copy in a process or thread of its own anyway.

    env = SandboxEnv("/run/sandfleet/sandfleet.sock", SandboxSpec(image="busybox"),
                     setup=["mkdir -p /task"], check="test -f /task/done", max_steps=10)
    obs, info = env.reset(seed=1)
    obs, reward, terminated, truncated, info = env.step("touch /task/done")   # terminated, reward 1.0
"""

from __future__ import annotations

import os
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any, SupportsFloat

import gymnasium
from gymnasium import spaces

from sandfleet.adapters._episode import (
    TRUNCATED,
    SetupError,
    connect,
    run_step,
    setup_sandbox,
    start_sandbox,
    stop_quietly,
)
from sandfleet.client import Client, Sandbox
from sandfleet.models import ExecResult, SandboxSpec

__all__ = ["SandboxEnv", "SetupError", "clean_text", "connect", "prepare_snapshot", "register_env"]

# Printable ASCII and its whitespace: what a shell command is made of, and what an observation may
# hold (other characters of the output are replaced, so every observation is in the space).
CHARSET = string.printable
REPLACEMENT = "?"
EXIT_CODES = spaces.Discrete(512, start=-256)  # exit statuses, 128+signal, and negative signal numbers
ENV_ID = "sandfleet/Shell-v0"

RewardFn = Callable[[Sandbox], float]


def prepare_snapshot(
    fleet: Client,
    spec: SandboxSpec | str,
    *,
    setup: Sequence[str] = (),
    files: Mapping[str, bytes | str] | None = None,
    setup_timeout: float | None = 600.0,
    ttl: float | None = None,
) -> str:
    """Create a sandbox, set it up, snapshot it and stop it; the snapshot's id. Pass it as
    `SandboxEnv(snapshot_id=...)` so every env's episodes start from that state without repeating the
    setup. Delete it with `fleet.delete_snapshot(id)` when done (or give it a `ttl`)."""
    sandbox = fleet.create(spec if isinstance(spec, SandboxSpec) else SandboxSpec(image=spec))
    with sandbox:
        setup_sandbox(sandbox, setup, files or {}, setup_timeout)
        return sandbox.snapshot(ttl=ttl).id


def clean_text(text: str, max_length: int) -> str:
    """`text` made a member of Text(max_length, charset=CHARSET): foreign characters replaced, and cut
    (with a marker) when too long."""
    cleaned = "".join(c if c in CHARSET else REPLACEMENT for c in text)
    if len(cleaned) <= max_length:
        return cleaned
    if max_length <= len(TRUNCATED):
        return cleaned[:max_length]
    return cleaned[: max_length - len(TRUNCATED)] + TRUNCATED


class SandboxEnv(gymnasium.Env[dict[str, Any], str]):
    """An episode is a sandbox; a step is one shell command in it.

    Observation: `{"output": Text, "exit_code": Discrete(512, start=-256)}`: the command's merged
    stdout/stderr (printable ASCII; other characters become "?", cut to `max_output` characters) and
    its exit status (137 when `step_timeout` killed it). `reset` observes the task's `instructions`.

    Episode end: `terminated` when the agent sends `submit_action`, or when `check` (a shell command,
    run after each step unless `check_each_step=False`) exits 0; `truncated` after `max_steps`. The
    reward of every step before the end is 0.0; the last step's is the score: `reward_fn(sandbox)` if
    given, else 1.0 if `check` exits 0 (0.0 without a check).

    Sandboxes: `spec` (or an image name) is created afresh on each `reset`, with `files` written and
    `setup` commands run; with `snapshot_id` each episode is restored from that snapshot instead (its
    state is the set-up one: `files`/`setup` are not applied again). Every sandbox gets `labels`
    (merged into the spec's) and every command the environment variable `SANDFLEET_SEED`: the
    `reset` seed, or one drawn from the env's seeded generator when none is given.

    `fleet` is a `Client` (left open by `close`), a daemon URL, a socket path, or None for the
    default socket (a client the env makes is closed by `close`). SandboxErrors of the daemon
    (sandbox gone, node unavailable) propagate from `reset`/`step`.
    """

    # ansi frames are text; an fps is declared only because recording wrappers expect one
    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(
        self,
        fleet: Client | str | os.PathLike[str] | None = None,
        spec: SandboxSpec | str = "busybox",
        *,
        setup: Sequence[str] = (),
        files: Mapping[str, bytes | str] | None = None,
        snapshot_id: str | None = None,
        instructions: str = "",
        check: str | None = None,
        check_each_step: bool = True,
        reward_fn: RewardFn | None = None,
        submit_action: str = "submit",
        max_steps: int = 20,
        step_timeout: float = 30.0,
        setup_timeout: float | None = 600.0,
        max_output: int = 4096,
        max_action: int = 4096,
        labels: Mapping[str, str] | None = None,
        render_mode: str | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, not {max_steps}")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}, not {render_mode!r}")
        if not submit_action or any(c not in CHARSET for c in submit_action) or len(submit_action) > max_action:
            raise ValueError(f"submit_action {submit_action!r} is not an action of the action space")
        self.fleet, self._owns_fleet = connect(fleet)
        base = spec if isinstance(spec, SandboxSpec) else SandboxSpec(image=spec)
        self.spec_template = base.model_copy(update={"labels": {**base.labels, **(labels or {})}})
        self.setup = list(setup)
        self.files = dict(files or {})
        self.snapshot_id = snapshot_id
        self.instructions = instructions
        self.check = check
        self.check_each_step = check_each_step
        self.reward_fn = reward_fn
        self.submit_action = submit_action
        self.max_steps = max_steps
        self.step_timeout = step_timeout
        self.setup_timeout = setup_timeout
        self.render_mode = render_mode
        self.max_output = max_output
        self.action_space = spaces.Text(max_action, min_length=1, charset=CHARSET)
        self.observation_space = spaces.Dict(
            {"output": spaces.Text(max_output, min_length=0, charset=CHARSET), "exit_code": EXIT_CODES}
        )
        self.sandbox: Sandbox | None = None
        self.seed_value: int | None = None
        self._steps = 0
        self._done = False
        self._last = ""

    # -- the episode's sandbox

    def _start_sandbox(self) -> Sandbox:
        assert self.seed_value is not None
        return start_sandbox(
            self.fleet,
            self.spec_template,
            self.seed_value,
            snapshot_id=self.snapshot_id,
            setup=self.setup,
            files=self.files,
            setup_timeout=self.setup_timeout,
        )

    def _stop_sandbox(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        stop_quietly(sandbox)

    def _exec(self, command: str, timeout: float | None) -> ExecResult:
        assert self.sandbox is not None
        return run_step(self.sandbox, command, self.seed_value, timeout, self.max_output)

    def _check_passes(self) -> bool:
        if self.check is None:
            return False
        result = self._exec(self.check, self.step_timeout)
        return result.exit_code == 0 and not result.timed_out

    def _score(self, passed: bool | None) -> float:
        """The episode's reward; `passed` is the check's verdict when this step already ran it."""
        assert self.sandbox is not None
        if self.reward_fn is not None:
            return float(self.reward_fn(self.sandbox))
        if passed is None:
            passed = self._check_passes()
        return 1.0 if passed else 0.0

    def _observe(self, output: str, exit_code: int) -> dict[str, Any]:
        low, high = int(EXIT_CODES.start), int(EXIT_CODES.start) + int(EXIT_CODES.n) - 1
        text = clean_text(output, self.max_output)
        return {"output": text, "exit_code": min(max(exit_code, low), high)}

    # -- gymnasium.Env

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode in a new sandbox (the previous one is stopped first). `seed` seeds the
        env's generator and becomes the sandbox's `SANDFLEET_SEED`; `options` is unused."""
        super().reset(seed=seed)
        self._stop_sandbox()
        self.seed_value = seed if seed is not None else int(self.np_random.integers(2**31))
        self.sandbox = self._start_sandbox()
        self._steps = 0
        self._done = False
        self._last = self.instructions
        info = {"sandbox_id": self.sandbox.id, "seed": self.seed_value}
        return self._observe(self.instructions, 0), info

    def step(self, action: str) -> tuple[dict[str, Any], SupportsFloat, bool, bool, dict[str, Any]]:
        if self.sandbox is None or self._done:
            raise gymnasium.error.ResetNeeded("call reset() before step() (and after an episode ended)")
        if not isinstance(action, str):
            raise gymnasium.error.InvalidAction(f"an action is a shell command (str), not {type(action).__name__}")
        self._steps += 1
        info: dict[str, Any] = {"step": self._steps}
        passed: bool | None = None
        if action.strip() == self.submit_action:
            obs = self._observe("", 0)
            terminated = True
            info.update(submitted=True, timed_out=False)
        else:
            result = self._exec(action, self.step_timeout)
            obs = self._observe(result.stdout, result.exit_code)
            info.update(submitted=False, timed_out=result.timed_out)
            passed = self._check_passes() if self.check is not None and self.check_each_step else None
            terminated = bool(passed)
        truncated = not terminated and self._steps >= self.max_steps
        reward = 0.0
        if terminated or truncated:
            self._done = True
            reward = self._score(passed)
            info["score"] = reward
        self._last = f"$ {action}\n{obs['output']}"
        return obs, reward, terminated, truncated, info

    def render(self) -> str | None:
        """`ansi`: the last command and its output (or the instructions after a reset)."""
        return self._last if self.render_mode == "ansi" else None

    def close(self) -> None:
        """Stop the episode's sandbox, and close the client if the env made it; safe to repeat."""
        self._stop_sandbox()
        if self._owns_fleet:
            self.fleet.close()
            self._owns_fleet = False
        super().close()


def register_env(env_id: str = ENV_ID) -> str:
    """Register `SandboxEnv` with Gymnasium under `env_id` (once), so `gymnasium.make(env_id,
    fleet="/path/to.sock", spec="busybox", ...)` builds it, with Gymnasium's checking wrappers; the id."""
    if env_id not in gymnasium.registry:
        gymnasium.register(id=env_id, entry_point=f"{__name__}:SandboxEnv")
    return env_id
