"""What a trajectory's step does in its sandbox, and what is recorded of it: an action run through
the node's execs, files, snapshots and checkpoints; its result, an error included (whose fault it was); the
reproducibility record of the steps taken. The log and the exactly-once are daemon/rl/trajectories.py's.
"""

from __future__ import annotations

import base64
import json
import platform
import time
from typing import Any

from sandfleet import __version__
from sandfleet.daemon.node.checkpoints import Checkpoints
from sandfleet.daemon.node.core import wire_text
from sandfleet.daemon.node.execs import Execs
from sandfleet.daemon.node.lifecycle import SandboxTable
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.daemon.node.snapshots import Snapshots
from sandfleet.daemon.rl.steplog import Trajectory
from sandfleet.errors import Cause, SandboxError, SandboxNotFoundError, WrongStateError
from sandfleet.models import (
    CheckpointAction,
    ErrorBody,
    ExecAction,
    NodeVersions,
    ReadAction,
    ReproRecord,
    RollbackAction,
    SnapshotAction,
    StepAction,
    StepResult,
    WriteAction,
)
from sandfleet.runtime.agent_wire import AGENT_VERSION

TRAJECTORY_LABEL = "sandfleet.trajectory"  # on a trajectory's sandbox: the trajectory's id


async def act(
    execs: Execs,
    files: Files,
    snapshots: Snapshots,
    checkpoints: Checkpoints,
    t: Trajectory,
    k: int,
    action: StepAction,
    t0: float,
    wall: float,
) -> StepResult:
    """Run step `k`'s action in the trajectory's sandbox; its result (an error raised: the caller's)."""
    assert t.sandbox is not None
    sid = t.sandbox.id
    base = {"trajectory_id": t.id, "step": k, "kind": action.kind, "replayed": False, "started_at": wall}
    if isinstance(action, ExecAction):
        req = action.exec
        if t.opened.seed is not None and "SANDFLEET_SEED" not in req.env:
            req = req.model_copy(update={"env": {**req.env, **seed_env(t.opened.seed)}})
        r = await execs.exec(sid, req)
        return StepResult(**base, exec=r, cause=r.cause, duration=time.perf_counter() - t0)
    if isinstance(action, WriteAction):
        data = base64.b64decode(action.content) if action.encoding == "base64" else action.content.encode()
        info = await files.write_file(sid, action.path, data, mode=action.mode, user=None, append=False)
        return StepResult(**base, file=info, duration=time.perf_counter() - t0)
    if isinstance(action, ReadAction):
        data = await files.read_file(sid, action.path, length=action.limit)
        return StepResult(
            **base,
            content=wire_text(data, action.encoding),
            encoding=action.encoding,
            duration=time.perf_counter() - t0,
        )
    if isinstance(action, CheckpointAction):
        cp = await checkpoints.checkpoint(sid, {**action.labels, TRAJECTORY_LABEL: t.id})
        return StepResult(**base, checkpoint_id=cp.id, duration=time.perf_counter() - t0)
    if isinstance(action, RollbackAction):
        done = await checkpoints.rollback(sid, action.checkpoint_id)
        return StepResult(**base, checkpoint_id=done.checkpoint_id, duration=time.perf_counter() - t0)
    assert isinstance(action, SnapshotAction)
    snap = await snapshots.snapshot(sid, ttl=action.ttl, labels={**action.labels, TRAJECTORY_LABEL: t.id})
    return StepResult(**base, snapshot_id=snap.id, duration=time.perf_counter() - t0)


def seed_env(seed: int | None) -> dict[str, str]:
    return {} if seed is None else {"SANDFLEET_SEED": str(seed)}


def agent_fault(exc: SandboxError) -> SandboxError:
    """An action refused for what it asked (a missing file, a bad path) is the agent's failure, not
    the trainer's: the action is the agent's. Errors about the sandbox itself keep their cause."""
    if exc.cause == "caller" and not isinstance(exc, SandboxNotFoundError | WrongStateError):
        exc.cause = "agent"
    return exc


def error_result(t: Trajectory, k: int, kind: Any, exc: SandboxError, wall: float, t0: float) -> StepResult:
    cause: Cause = exc.cause
    return StepResult(
        trajectory_id=t.id,
        step=k,
        kind=kind,
        replayed=False,
        error=ErrorBody.model_validate(exc.to_wire()),
        cause=cause,
        started_at=wall,
        duration=time.perf_counter() - t0 if t0 else 0.0,
    )


def reproduction(t: Trajectory, table: SandboxTable) -> ReproRecord:
    """What re-running the trajectory takes: its sandbox's spec and layers, its actions, the node."""
    sb = t.sandbox
    layers: list[str] = []
    found = table.find(sb.id) if sb else None
    if found is not None and found.live is not None:
        layers = [str(d) for d in found.live.runtime.get("layers", [])]
    return ReproRecord(
        trajectory=t.info(),
        spec=sb.spec if sb else None,
        image=sb.spec.environment() if sb else None,
        layers=layers,
        source_snapshot=t.opened.snapshot_id,
        snapshots=[s.snapshot_id for s in t.steps if s.snapshot_id],
        actions=[json.loads(a) for a in t.actions[: len(t.steps)]],
        node=NodeVersions(
            sandfleet=__version__,
            agent=AGENT_VERSION,
            kernel=platform.release(),
            backend=sb.spec.backend if sb else "",
        ),
    )
