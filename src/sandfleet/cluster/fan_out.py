"""The gateway's calls over every node: lists and counts merged, job-level writes (by label) whose
answer names the nodes they could not reach, image store calls made everywhere, and the calls any
one node can serve."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response

from sandfleet.cluster.core import LABEL_CALLS, GatewayCore, json_object, read_body, stamp
from sandfleet.cluster.forward import call_json, forward, json_response
from sandfleet.cluster.job_figures import merge_alerts, merge_groups, merge_stats
from sandfleet.cluster.membership import Node
from sandfleet.cluster.placement import NoCapacity, PlacementRequest
from sandfleet.daemon.security.iam import Principal, exhausted, quota_alert
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    UnavailableError,
)
from sandfleet.models import QuotaUse, list_page


class FanOut(GatewayCore):
    # -- fan-outs --------------------------------------------------------------------------------
    async def list_sandboxes(self, request: Request) -> Response:
        # Pages are cut from the merged list (each node's own pages would interleave wrongly).
        params = [(k, v) for k, v in request.query_params.multi_items() if k not in ("limit", "after")]
        limit, after = request.query_params.get("limit"), request.query_params.get("after")
        if limit is not None and not (limit.isdecimal() and limit.isascii() and 1 <= int(limit) <= 10000):
            raise InvalidArgumentError("limit: an integer from 1 to 10000")

        async def one(n: Node) -> list[Any]:
            data = await call_json(n, "GET", "/v1/sandboxes", request=request, params=params)
            return list(data["sandboxes"])

        merged = [sb for part in await self._fan_out(one) for sb in part]
        if limit is None and after is None:
            merged.sort(key=lambda sb: sb.get("created_at", 0))
            return json_response({"sandboxes": merged})
        try:
            page, cursor, total = list_page(merged, int(limit or 1000), after, stamp)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        return json_response({"sandboxes": page, "next": cursor, "total": total})

    async def list_snapshots(self, request: Request) -> Response:
        params = list(request.query_params.multi_items())
        sandbox_id = request.query_params.get("sandbox_id")
        if sandbox_id:  # one sandbox's snapshots live on its node
            node = self.membership.holder(sandbox_id)
            return json_response(await call_json(node, "GET", "/v1/snapshots", request=request, params=params))

        async def one(n: Node) -> list[Any]:
            return list((await call_json(n, "GET", "/v1/snapshots", request=request, params=params))["snapshots"])

        merged = [s for part in await self._fan_out(one) for s in part]
        merged.sort(key=lambda s: s.get("created_at", 0))
        return json_response({"snapshots": merged})

    async def by_label(self, request: Request) -> Response:
        field = LABEL_CALLS[request.url.path]
        body = await json_object(request)

        async def one(n: Node) -> list[Any]:
            return list((await call_json(n, "POST", request.url.path, request=request, json_body=body))[field])

        return json_response({field: [i for part in await self._fan_out(one, every=True) for i in part]})

    async def list_images(self, request: Request) -> Response:
        async def one(n: Node) -> list[Any]:
            return list((await call_json(n, "GET", "/v1/images", request=request))["images"])

        seen: dict[str, Any] = {}
        for part in await self._fan_out(one):
            for img in part:
                seen.setdefault(f"{img['name']}:{img['tag']}", img)
        return json_response({"images": [seen[k] for k in sorted(seen)]})

    async def images_everywhere(self, request: Request) -> Response:
        """Build, push, import, delete, gc: on every node (each has its own layer store); the first
        node's answer stands for all."""
        payload = await json_object(request) if request.method != "DELETE" else None
        params = list(request.query_params.multi_items())

        async def one(n: Node) -> Any:
            path = request.url.path
            try:
                return await call_json(n, request.method, path, request=request, json_body=payload, params=params)
            except NotFoundError:
                if request.method != "DELETE":
                    raise
                return NotFoundError  # not on this node: what a delete wants

        answers = await self._fan_out(one, every=True)
        if request.method == "DELETE":
            if all(a is NotFoundError for a in answers):
                raise NotFoundError(f"image {request.url.path.rsplit('/', 1)[-1][:200]} not found")
            return Response(status_code=204)
        return json_response(answers[0]) if answers[0] is not None else Response(status_code=204)

    async def one_node(self, request: Request) -> Response:
        """Stateless calls (fncall's run_code, a recipe build): any one node, the least loaded of two."""
        tier = "fncall" if "run" in request.url.path else "container"
        try:
            key = self.placer.place(PlacementRequest(tier=tier), time.monotonic())
        except NoCapacity as exc:
            raise UnavailableError(f"no node runs the {tier} tier with room: {exc}") from exc
        self.placer.release(key)  # nothing stays placed there
        return await forward(self._node(key), request, body=await read_body(request))

    async def audit(self, request: Request) -> Response:
        """One sandbox's records from its node; otherwise every node's, merged by time (each node
        numbers its own records: `last_seq` is the highest, so paging by `since` is per node)."""
        sandbox_id = request.query_params.get("sandbox_id")
        if sandbox_id:
            return await forward(self.membership.holder(sandbox_id), request)
        params = list(request.query_params.multi_items())

        async def one(n: Node) -> Any:
            return await call_json(n, "GET", "/v1/audit", request=request, params=params)

        parts = await self._fan_out(one)
        merged = sorted((r for part in parts for r in part["records"]), key=lambda r: r.get("ts", 0))
        if request.query_params.get("newest") in ("true", "1") and (limit := request.query_params.get("limit")):
            merged = merged[-int(limit) :] if limit.isdecimal() and limit.isascii() else merged  # newest of all
        return json_response({"records": merged, "last_seq": max(p["last_seq"] for p in parts)})

    async def jobs(self, request: Request) -> Response:
        """Every node's groups, added up."""
        params = list(request.query_params.multi_items())

        async def one(n: Node) -> Any:
            return await call_json(n, "GET", "/v1/jobs", request=request, params=params)

        parts = await self._fan_out(one)
        key = parts[0]["key"] if parts else request.query_params.get("key", "job")
        counted = bool(parts) and all(p.get("counted") for p in parts)
        total = sum(p["total"] for p in parts)
        return json_response({"key": key, "jobs": merge_groups(parts), "total": total, "counted": counted})

    async def job_stats(self, request: Request) -> Response:
        """The nodes that know the job, added up (`job_figures`)."""
        params = list(request.query_params.multi_items())
        job_path = "/v1/jobs/" + quote(request.path_params["job"], safe="")  # (the path is decoded: again as sent)

        async def one(n: Node) -> tuple[str, Any] | None:
            try:
                return n.key, await call_json(n, "GET", job_path, request=request, params=params)
            except NotFoundError:
                return None  # not a job of this node's

        parts = [p for p in await self._fan_out(one) if p is not None]
        if not parts:
            raise NotFoundError(f"job {request.path_params['job'][:200]}: no sandbox of it, nor any figure counted")
        principal: Principal = request.state.principal
        sees = (lambda _p: True) if principal.project is None else (lambda p: principal.sees(p or None))
        merged = self.refusals.into(merge_stats(parts), sees)
        # Each node's use of a quota is its own: the cluster's is what the gateway reads of them all.
        named = {q["project"] for q in merged["quotas"]}
        merged["quotas"] = [q.model_dump() for q in self._quota_uses(request) if q.project in named]
        return json_response(merged)

    def _quota_uses(self, request: Request) -> list[QuotaUse]:
        """Every listed project's quota with what the cluster holds of it, those the caller sees."""
        principal: Principal = request.state.principal
        uses = self.iam.uses(self.membership.project_usage())
        return [q for q in uses if principal.project is None or principal.sees(q.project)]

    async def alerts(self, request: Request) -> Response:
        """Every node's alerts (labelled with their node), and the nodes the cluster lost."""

        async def one(n: Node) -> tuple[str, Any]:
            return n.key, await call_json(n, "GET", "/v1/alerts", request=request)

        alerts = merge_alerts(await self._fan_out(one)) if self.membership.reachable() else []
        # A quota is the cluster's: each node sees only its part of what a project holds.
        alerts = [a for a in alerts if a["name"] != "quota_exhausted"]
        now = time.time()
        began: dict[tuple[str, str], float] = {}
        for q in self._quota_uses(request):
            for dim, used, cap in exhausted(q):
                ident = (q.project, dim)
                began[ident] = self.quota_since.get(ident, now)
                alerts.append(quota_alert(q, dim, used, cap, began[ident]).model_dump())
        if request.state.principal.project is None:  # (a scoped caller's view: not the gateway's memory)
            self.quota_since = began
        for n in self.membership.nodes.values():
            if n.lost:
                what = f"node {n.key} is lost: its sandboxes are gone"
                since = n.lost_at or time.time()
                labels = {"node": n.key, "group": n.group}
                alerts.append(
                    {"name": "node_lost", "severity": "critical", "summary": what, "labels": labels}
                    | {"value": 1, "threshold": 1, "since": since}
                )
        return json_response({"alerts": alerts, "at": time.time()})

    async def list_trajectories(self, request: Request) -> Response:
        params = list(request.query_params.multi_items())
        limit = request.query_params.get("limit")
        if limit is not None and not (limit.isdecimal() and limit.isascii() and 1 <= int(limit) <= 10000):
            raise InvalidArgumentError("limit: an integer from 1 to 10000")

        async def one(n: Node) -> Any:
            return await call_json(n, "GET", "/v1/trajectories", request=request, params=params)

        parts = await self._fan_out(one)
        merged = [t for part in parts for t in part["trajectories"]]
        if limit is None:
            return json_response({"trajectories": merged})
        merged.sort(key=lambda t: (-t["created_at"], t["id"]))  # each node's newest `limit`: the cluster's among them
        total = sum(part.get("total", len(part["trajectories"])) for part in parts)
        return json_response({"trajectories": merged[: int(limit)], "total": total})
