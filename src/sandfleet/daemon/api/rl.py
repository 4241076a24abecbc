"""RL: trajectories (a rollout's steps, each taken exactly once) and verification apart from the agent."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Path, Query, Response

from sandfleet.daemon.api.common import CheckedRoute, parse_labels
from sandfleet.daemon.protocol import SandboxService
from sandfleet.models import (
    TRAJECTORY_ID,
    Ok,
    ReproRecord,
    StepList,
    StepRequest,
    StepResult,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryList,
    TrajectoryOpen,
    VerifyRequest,
    VerifyResult,
)

TrajectoryIdParam = Annotated[str, Path(pattern=TRAJECTORY_ID, description="the rollout's id")]


def router(service: SandboxService) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)

    @r.post("/v1/trajectories", response_model=TrajectoryInfo)
    async def open_trajectory(req: TrajectoryOpen) -> TrajectoryInfo:
        """Open a trajectory (and make its sandbox), or give back the one open under that id."""
        return await service.open_trajectory(req)

    @r.get("/v1/trajectories", response_model=TrajectoryList)
    async def list_trajectories(
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
        state: Literal["open", "closed"] | None = None,
    ) -> TrajectoryList:
        return TrajectoryList(trajectories=await service.list_trajectories(parse_labels(label), state))

    @r.get("/v1/trajectories/{trajectory_id}", response_model=TrajectoryInfo)
    async def get_trajectory(trajectory_id: TrajectoryIdParam) -> TrajectoryInfo:
        return await service.get_trajectory(trajectory_id)

    @r.delete("/v1/trajectories/{trajectory_id}", response_model=Ok)
    async def delete_trajectory(trajectory_id: TrajectoryIdParam) -> Ok:
        await service.delete_trajectory(trajectory_id)
        return Ok()

    @r.post("/v1/trajectories/{trajectory_id}/steps", response_model=StepResult)
    async def step(trajectory_id: TrajectoryIdParam, req: StepRequest) -> Response:
        """Take a step once; asked again (a restarted trainer), its logged result (`replayed`)."""
        result = await service.trajectory_step(trajectory_id, req)
        # Every step of every rollout comes through here: the model is serialized once, not
        # validated again on the way out.
        return Response(result.model_dump_json(), media_type="application/json")

    @r.get("/v1/trajectories/{trajectory_id}/steps", response_model=StepList)
    async def steps(trajectory_id: TrajectoryIdParam) -> StepList:
        return StepList(steps=await service.trajectory_steps(trajectory_id))

    @r.post("/v1/trajectories/{trajectory_id}/verify", response_model=VerifyResult)
    async def verify_trajectory(trajectory_id: TrajectoryIdParam, req: VerifyRequest) -> VerifyResult:
        return await service.verify_trajectory(trajectory_id, req)

    @r.post("/v1/trajectories/{trajectory_id}/close", response_model=TrajectoryInfo)
    async def close_trajectory(
        trajectory_id: TrajectoryIdParam, req: Annotated[TrajectoryClose | None, Body()] = None
    ) -> TrajectoryInfo:
        return await service.close_trajectory(trajectory_id, req or TrajectoryClose())

    @r.get("/v1/trajectories/{trajectory_id}/record", response_model=ReproRecord)
    async def record(trajectory_id: TrajectoryIdParam) -> ReproRecord:
        """What the trajectory's sandbox was made of, what was done in it, with which seed and software."""
        return await service.trajectory_record(trajectory_id)

    @r.post("/v1/sandboxes/{sandbox_id}/verify", response_model=VerifyResult)
    async def verify(sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        """Run checks in a fresh sandbox made of this one's pre-agent state, its changes and hidden layers."""
        return await service.verify(sandbox_id, req)

    return r
