"""What the episode-shaped adapters (Gymnasium, OpenEnv) share: a client for a daemon, an episode's
sandbox made (or restored from a set-up snapshot) and stopped, one command run as a step. Only the
SDK: each framework's module adds its own interface on top."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence

from sandfleet.client import Client, Sandbox
from sandfleet.errors import SandboxError
from sandfleet.models import ExecResult, SandboxSpec

TRUNCATED = "\n[output truncated]"


class SetupError(RuntimeError):
    """A setup command of the task exited non-zero: the episode cannot start as the task intends."""

    def __init__(self, command: str, result: ExecResult) -> None:
        super().__init__(
            f"setup command {command!r} exited {result.exit_code}: {(result.stdout + result.stderr)[-500:]}"
        )
        self.command = command
        self.result = result


def connect(fleet: Client | str | os.PathLike[str] | None) -> tuple[Client, bool]:
    """A client for `fleet` (a Client, a daemon URL, a socket path, or None: the default socket) and
    whether the caller owns it (and must close it). A path or URL keeps an env picklable and lets
    `gymnasium.make` copy its arguments."""
    if isinstance(fleet, Client):
        return fleet, False
    text = None if fleet is None else os.fspath(fleet)
    if text is not None and text.startswith(("http://", "https://")):
        return Client(url=text), True
    return Client(text), True


def setup_sandbox(
    sandbox: Sandbox, commands: Sequence[str], files: Mapping[str, bytes | str], timeout: float | None
) -> None:
    """Write the task's files, then run its setup commands in order; a failing command raises."""
    for path, data in files.items():
        sandbox.files.write(path, data)
    for command in commands:
        result = sandbox.exec(command, timeout=timeout, merge_stderr=True)
        if result.exit_code != 0 or result.timed_out:
            raise SetupError(command, result)


def start_sandbox(
    fleet: Client,
    spec: SandboxSpec,
    seed: int,
    *,
    snapshot_id: str | None,
    setup: Sequence[str],
    files: Mapping[str, bytes | str],
    setup_timeout: float | None,
) -> Sandbox:
    """An episode's sandbox: restored from `snapshot_id` (its state is the set-up one), or created
    from `spec` with `SANDFLEET_SEED` in its environment and then set up; a failed setup stops it."""
    if snapshot_id is not None:
        child = fleet.restore(snapshot_id, labels=spec.labels)[0]
        if isinstance(child, SandboxError):
            raise child
        return child
    sandbox = fleet.create(spec.model_copy(update={"env": {**spec.env, "SANDFLEET_SEED": str(seed)}}))
    try:
        setup_sandbox(sandbox, setup, files, setup_timeout)
    except BaseException:
        stop_quietly(sandbox)  # the setup's own error is the one to report
        raise
    return sandbox


def stop_quietly(sandbox: Sandbox | None) -> None:
    """Stop it; the node may have stopped it already (a TTL) or be unreachable: nothing to keep."""
    if sandbox is not None:
        with contextlib.suppress(SandboxError):
            sandbox.stop()


def run_step(sandbox: Sandbox, command: str, seed: int | None, timeout: float | None, max_chars: int) -> ExecResult:
    """One action: stdout and stderr merged in order, enough bytes kept to fill `max_chars` of text."""
    return sandbox.exec(
        command,
        env={} if seed is None else {"SANDFLEET_SEED": str(seed)},
        timeout=timeout,
        output_limit=max_chars * 4 + 1024,
        merge_stderr=True,
    )


def cut(text: str, limit: int) -> str:
    """`text`, cut to `limit` characters with a marker saying so."""
    if len(text) <= limit:
        return text
    return text[:limit] if limit <= len(TRUNCATED) else text[: limit - len(TRUNCATED)] + TRUNCATED
