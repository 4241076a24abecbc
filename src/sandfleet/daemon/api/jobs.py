"""Jobs (the sandboxes of one label's value): their counts by state, the node's figures of each, and
the node's alerts; what the console's jobs, job and alerts pages show."""

from __future__ import annotations

import collections
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query

from sandfleet.daemon.api.common import Api, CheckedRoute, parse_labels
from sandfleet.errors import InvalidArgumentError, NotFoundError
from sandfleet.models import (
    LABEL_KEY,
    MAX_LABEL_VALUE,
    AlertList,
    JobGroup,
    JobList,
    JobStats,
    QuotaUse,
    SandboxInfo,
    SandboxState,
    shown,
)


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node, tenancy = api.node, api.tenancy

    @api.route(r, "jobs")
    async def jobs(
        key: Annotated[str, Query(max_length=63, description="the label whose values group sandboxes")] = "job",
        label: Annotated[list[str], Query(max_length=64)] = [],  # noqa: B006
        state: Annotated[
            SandboxState | Literal["live", "all"] | None,
            Query(description="one state, `live` (the default) or `all`"),
        ] = None,
    ) -> JobList:
        """Sandboxes grouped by the value of label `key`, counted by state (the console's jobs page:
        counts of thousands of sandboxes without sending them); for the node's job label, each
        group's figures too."""
        if not LABEL_KEY.match(key):
            raise InvalidArgumentError(f"key: {shown(key)} is not a label key")
        grouped = group_by_label(await tenancy.list(parse_labels(label), state), key)
        if key != node.core.jobs.label or label:  # (the figures are whole jobs': not of a selection)
            return grouped
        counted = node.core.jobs.counted(grouped.jobs, tenancy.sees())
        return grouped.model_copy(update={"jobs": counted, "counted": True})

    @api.route(r, "job_stats")
    async def job_stats(
        job: Annotated[str, Path(max_length=MAX_LABEL_VALUE, description="a value of the node's job label")],
        stuck_after: Annotated[
            float, Query(gt=0, le=86400 * 7, description="seconds a running sandbox goes without a request: stuck")
        ] = 600.0,
    ) -> JobStats:
        """A job's figures over time (creates, stops, commands, steps, failures by cause, OOM kills,
        verifications, rewards, findings), its CPU and memory against its projects' quotas, and its
        stuck and slowest sandboxes."""
        sees = tenancy.sees()

        def quotas(projects: set[str | None]) -> list[QuotaUse]:
            # An ancestor's quota counts its whole subtree: other projects' use (not shown).
            return [q for q in tenancy.quota_uses(projects) if sees(q.project)]

        got = node.core.jobs.stats(job, sees, stuck_after, quotas)
        if got is None:
            raise NotFoundError(f"job {shown(job)}: no sandbox of it here, nor any figure counted")
        return got

    @api.route(r, "alerts")
    async def alerts() -> AlertList:
        """The alerts firing on this node (evaluated every 10 s): those of the caller's projects."""
        a = node.alerts
        return AlertList(alerts=a.visible(tenancy.sees(), tenancy.is_root()), at=a.evaluated_at)

    return r


def group_by_label(infos: list[SandboxInfo], key: str) -> JobList:
    groups: dict[str | None, collections.Counter[str]] = {}
    for info in infos:
        groups.setdefault(info.spec.labels.get(key), collections.Counter())[info.state] += 1
    jobs = [
        JobGroup(value=value, count=sum(states.values()), states=dict(states))
        for value, states in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
    ]
    return JobList(key=key, jobs=jobs, total=len(infos))
