"""Trajectories and verification: their paths, deadlines and retries, a step's error."""

from __future__ import annotations

import re
from typing import Any

from sandfleet.client._base.wire import _validated
from sandfleet.errors import InvalidArgumentError, SandboxError, error_from_wire
from sandfleet.models import TRAJECTORY_ID, StepResult, VerifyRequest

_TRAJECTORY_RE = re.compile(TRAJECTORY_ID)


def trajectory_path(trajectory_id: str, suffix: str = "") -> str:
    if not isinstance(trajectory_id, str) or not _TRAJECTORY_RE.match(trajectory_id):
        raise InvalidArgumentError(f"invalid trajectory id {trajectory_id!r}: 1-117 characters of [A-Za-z0-9._:-]")
    return "/v1/trajectories/" + trajectory_id + suffix


STEP_RETRY = 300.0  # seconds a trajectory call is retried through lost answers and a daemon restart
STEP_GRACE = 30.0  # a step's call waits this much longer than its command may run


def verify_timeout(req: VerifyRequest) -> float:
    """A verification's call waits for its turn on the node (`queue_timeout`), then for its checks."""
    return req.queue_timeout + req.timeout + STEP_GRACE + 60


def step_timeout(command_timeout: float | None, client_timeout: float) -> float:
    """A step's call waits for its command (a step is one answer, never a stream: it may be a replay)."""
    return max(client_timeout, (command_timeout or 86400.0) + STEP_GRACE)


def step_error(result: StepResult) -> SandboxError | None:
    """The error a step recorded, as the exception the SDK raises for it (cause included)."""
    return None if result.error is None else error_from_wire({"error": result.error.model_dump()})


def verify_request(command: str | list[str] | VerifyRequest, options: dict[str, Any]) -> VerifyRequest:
    if isinstance(command, VerifyRequest):
        return command
    return _validated(VerifyRequest, "verify request", {"command": command, **options})
