"""RL: trajectories (a rollout's steps, each taken exactly once) and verification apart from the agent."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Body, Path, Query, Response

from sandfleet.daemon.api.common import Api, CheckedRoute, parse_labels
from sandfleet.models import (
    TRAJECTORY_ID,
    Ok,
    ReproRecord,
    StepList,
    StepRequest,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryList,
    TrajectoryOpen,
    VerifyRequest,
    VerifyResult,
)

TrajectoryIdParam = Annotated[str, Path(pattern=TRAJECTORY_ID, description="the rollout's id")]


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "open_trajectory")
    async def open_trajectory(req: TrajectoryOpen) -> TrajectoryInfo:
        """Open a trajectory (and make its sandbox), or give back the one open under that id."""
        return await tenancy.open_trajectory(req)

    @api.route(r, "list_trajectories")
    async def list_trajectories(
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
        state: Literal["open", "closed"] | None = None,
        limit: Annotated[int | None, Query(ge=1, le=10000, description="the newest this many (and `total`)")] = None,
    ) -> TrajectoryList:
        found = await tenancy.list_trajectories(parse_labels(label), state)
        if limit is None:
            return TrajectoryList(trajectories=found)
        found.sort(key=lambda t: (-t.created_at, t.id))
        return TrajectoryList(trajectories=found[:limit], total=len(found))

    @api.route(r, "get_trajectory")
    async def get_trajectory(trajectory_id: TrajectoryIdParam) -> TrajectoryInfo:
        return await node.trajectories.get(trajectory_id, project=tenancy.project())

    @api.route(r, "delete_trajectory")
    async def delete_trajectory(trajectory_id: TrajectoryIdParam) -> Ok:
        await node.trajectories.delete(trajectory_id, project=tenancy.project())
        return Ok()

    @api.route(r, "step")
    async def step(trajectory_id: TrajectoryIdParam, req: StepRequest) -> Response:
        """Take a step once; asked again (a restarted trainer), its logged result (`replayed`)."""
        result = await node.trajectories.step(trajectory_id, req, project=tenancy.project())
        # Every step of every rollout comes through here: the model is serialized once, not
        # validated again on the way out.
        return Response(result.model_dump_json(), media_type="application/json")

    @api.route(r, "steps")
    async def steps(trajectory_id: TrajectoryIdParam) -> StepList:
        return StepList(steps=await node.trajectories.steps(trajectory_id, project=tenancy.project()))

    @api.route(r, "verify_trajectory")
    async def verify_trajectory(trajectory_id: TrajectoryIdParam, req: VerifyRequest) -> VerifyResult:
        return await node.trajectories.verify(trajectory_id, req, project=tenancy.project())

    @api.route(r, "close_trajectory")
    async def close_trajectory(
        trajectory_id: TrajectoryIdParam, req: Annotated[TrajectoryClose | None, Body()] = None
    ) -> TrajectoryInfo:
        return await node.trajectories.close(trajectory_id, req or TrajectoryClose(), project=tenancy.project())

    @api.route(r, "record")
    async def record(trajectory_id: TrajectoryIdParam) -> ReproRecord:
        """What the trajectory's sandbox was made of, what was done in it, with which seed and software."""
        return await node.trajectories.record(trajectory_id, project=tenancy.project())

    @api.route(r, "verify")
    async def verify(sandbox_id: str, req: VerifyRequest) -> VerifyResult:
        """Run checks in a fresh sandbox made of this one's pre-agent state, its changes and hidden layers."""
        return await node.verifier.verify(sandbox_id, req)

    return r
