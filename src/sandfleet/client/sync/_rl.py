# Generated from client/aio/_rl.py by scripts/gen_sync_client.py: do not edit.
"""Trajectories: the client's calls that open, attach and list them, and `Trajectory`, a rollout
driven step by step, each step taken exactly once."""

from __future__ import annotations

import base64
import builtins
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

from sandfleet.client import _base as b
from sandfleet.client.sync._http import _Calls
from sandfleet.client.sync._sandbox import Sandbox
from sandfleet.errors import SandboxNotFoundError
from sandfleet.models import (
    CheckpointAction,
    ExecAction,
    ExecResult,
    FileInfo,
    Ok,
    ReadAction,
    ReproRecord,
    RollbackAction,
    SandboxSpec,
    SnapshotAction,
    StepAction,
    StepList,
    StepResult,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryList,
    TrajectoryOpen,
    VerifyRequest,
    VerifyResult,
    WriteAction,
)

if TYPE_CHECKING:
    from sandfleet.client.sync._client import Client


class _Trajectories(_Calls):
    def trajectory(
        self,
        trajectory_id: str,
        spec: SandboxSpec | None = None,
        *,
        snapshot_id: str | None = None,
        sandbox_id: str | None = None,
        seed: int | None = None,
        labels: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_for: float = b.STEP_RETRY,
    ) -> Trajectory:
        """Open the trajectory of rollout `trajectory_id`, or open it again after a restart (the same
        arguments give back the same trajectory and sandbox). Its sandbox is made from `spec`,
        restored from `snapshot_id` (a set-up state many rollouts share), or is `sandbox_id`.
        `seed` reaches every command as SANDFLEET_SEED and is recorded. Calls on it are retried
        through lost answers and daemon restarts for `retry_for` seconds: each step runs once."""
        fields: dict[str, Any] = {
            "id": trajectory_id,
            "spec": spec,
            "snapshot_id": snapshot_id,
            "sandbox_id": sandbox_id,
        }
        fields |= {"seed": seed, "labels": dict(labels or {}), "metadata": dict(metadata or {})}
        req = b.validated(TrajectoryOpen, "trajectory", fields)
        body = req.model_dump(mode="json", exclude_defaults=True)
        info = self._idempotent(TrajectoryInfo, b.Call("POST", "/v1/trajectories", json=body), retry_for)
        return self._trajectory(info, retry_for)

    def get_trajectory(self, trajectory_id: str, *, retry_for: float = b.STEP_RETRY) -> Trajectory:
        """Attach to an open or closed trajectory by id alone; its steps replay from 0 as after `trajectory`."""
        info = self._model(TrajectoryInfo, b.Call("GET", b.trajectory_path(trajectory_id)))
        return self._trajectory(info, retry_for)

    def _trajectory(self, info: TrajectoryInfo, retry_for: float) -> Trajectory:
        sandbox = None
        if info.sandbox_id is not None:
            try:
                sandbox = self._client.get(info.sandbox_id)
            except SandboxNotFoundError:
                pass  # gone since (stopped, its retention over): the log still answers its steps
        return Trajectory(self._client, info, sandbox, retry_for)

    def trajectories(
        self,
        labels: Mapping[str, str] | None = None,
        state: Literal["open", "closed"] | None = None,
        *,
        limit: int | None = None,
    ) -> builtins.list[TrajectoryInfo]:
        """The trajectories with these labels (and state); `limit`: the newest this many only."""
        call = b.call_list(labels, state)
        params = [*(call.params or []), *([("limit", limit)] if limit is not None else [])]
        reply = self._model(TrajectoryList, b.Call("GET", "/v1/trajectories", params=params))
        return reply.trajectories


class Trajectory:
    """A rollout driven step by step, each step taken exactly once (`fleet.trajectory(...)`).

    Steps are numbered from 0 in the order this object takes them; a trainer restarted after a
    preemption opens the trajectory again and replays its rollout from the start: the steps the
    node already logged come back at once (`StepResult.replayed`), without running again, and the
    first new one runs. `sandbox` is the sandbox itself (calls on it directly are not logged)."""

    def __init__(
        self,
        client: Client,
        info: TrajectoryInfo,
        sandbox: Sandbox | None = None,
        retry_for: float = b.STEP_RETRY,
    ) -> None:
        self._c = client
        self.info = info
        self.id = info.id
        self.sandbox = sandbox
        self.retry_for = retry_for
        self.next_step = 0
        self.last: StepResult | None = None

    def __repr__(self) -> str:
        return f"<Trajectory {self.id} step={self.next_step}>"

    def __enter__(self) -> Trajectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, action: StepAction, *, step: int | None = None) -> StepResult:
        """Take the next step (or step `step`); its result, errors included (`StepResult.error`)."""
        timeout: float | Literal["default"] = "default"
        if isinstance(action, ExecAction):
            timeout = b.step_timeout(action.exec.timeout, self._c.timeout)
        return self._step(action.model_dump(mode="json"), timeout, step)

    def _step(self, action: dict[str, Any], timeout: float | Literal["default"], step: int | None) -> StepResult:
        """Send a step whose action is already validated (as JSON: the hot path builds no more models)."""
        k = self.next_step if step is None else step
        body = {"step": k, "action": action}
        call = b.Call("POST", b.trajectory_path(self.id, "/steps"), json=body, timeout=timeout)
        result = self._c._idempotent(StepResult, call, self.retry_for)
        self.last = result
        self.next_step = k + 1
        return result

    def _checked(self, action: StepAction) -> StepResult:
        result = self.step(action)
        error = b.step_error(result)
        if error is not None:
            raise error
        return result

    def exec(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        cpu_time: float | None = None,
    ) -> ExecResult:
        """Run a command as the next step (see `Sandbox.exec`); its result, recorded."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                cpu_time=cpu_time,
            ),
        )
        result = self._step({"kind": "exec", "exec": body}, b.step_timeout(timeout, self._c.timeout), None)
        error = b.step_error(result)
        if error is not None:
            raise error
        assert result.exec is not None
        return result.exec

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileInfo:
        """Write a file as the next step."""
        raw = data.encode() if isinstance(data, str) else data
        content = base64.b64encode(raw).decode()
        action = b.validated(
            WriteAction, "write", {"path": path, "content": content, "encoding": "base64", "mode": mode}
        )
        result = self._checked(action)
        assert result.file is not None
        return result.file

    def read(self, path: str) -> bytes:
        """Read a file as the next step (its bytes, recorded)."""
        result = self._checked(b.validated(ReadAction, "read", {"path": path, "encoding": "base64"}))
        return base64.b64decode(result.content or "")

    def snapshot(self, *, ttl: float | None = None, labels: Mapping[str, str] | None = None) -> str:
        """Snapshot the sandbox as the next step; the snapshot's id (recorded: a replay gives the same)."""
        result = self._checked(b.validated(SnapshotAction, "snapshot", {"ttl": ttl, "labels": dict(labels or {})}))
        assert result.snapshot_id is not None
        return result.snapshot_id

    def checkpoint(self, *, labels: Mapping[str, str] | None = None) -> str:
        """Checkpoint the sandbox as the next step (see `Sandbox.checkpoint`); the checkpoint's id
        (recorded: a replay gives the same, and takes none)."""
        result = self._checked(b.validated(CheckpointAction, "checkpoint", {"labels": dict(labels or {})}))
        assert result.checkpoint_id is not None
        return result.checkpoint_id

    def rollback(self, checkpoint_id: str) -> StepResult:
        """Roll the sandbox back to a checkpoint as the next step (see `Sandbox.rollback`);
        recorded: a replay does not roll back a second time."""
        return self._checked(b.validated(RollbackAction, "rollback", {"checkpoint_id": checkpoint_id}))

    def verify(self, command: str | builtins.list[str] | VerifyRequest, **options: Any) -> VerifyResult:
        """Verify the rollout apart from its sandbox (see `Sandbox.verify`); recorded: asked again
        (a restarted trainer), the same verdict, not a second run."""
        req = b.verify_request(command, options)
        call = b.Call(
            "POST",
            b.trajectory_path(self.id, "/verify"),
            json=req.model_dump(mode="json", exclude_defaults=True),
            timeout=b.verify_timeout(req),
        )
        return self._c._idempotent(VerifyResult, call, self.retry_for)

    def close(self, reward: float | None = None, *, stop_sandbox: bool = True) -> TrajectoryInfo:
        """Record the end (and `reward`, default: the verification's); stops the sandbox unless told not to."""
        body = b.validated(TrajectoryClose, "close", {"reward": reward, "stop_sandbox": stop_sandbox}).model_dump()
        call = b.Call("POST", b.trajectory_path(self.id, "/close"), json=body)
        self.info = self._c._idempotent(TrajectoryInfo, call, self.retry_for)
        return self.info

    def refresh(self) -> TrajectoryInfo:
        self.info = self._c._model(TrajectoryInfo, b.Call("GET", b.trajectory_path(self.id)))
        return self.info

    def steps(self) -> builtins.list[StepResult]:
        """Every step logged so far, in order."""
        return (self._c._model(StepList, b.Call("GET", b.trajectory_path(self.id, "/steps")))).steps

    def record(self) -> ReproRecord:
        """What it takes to run this trajectory again: layers, spec, seed, snapshots, actions, versions."""
        return self._c._model(ReproRecord, b.Call("GET", b.trajectory_path(self.id, "/record")))

    def delete(self) -> None:
        """Forget the trajectory (its log), stopping its sandbox."""
        self._c._model(Ok, b.Call("DELETE", b.trajectory_path(self.id)))
