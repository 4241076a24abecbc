"""Trajectories through a gateway: opened on a placed node, then each call goes to the node holding
the trajectory (found once by asking the nodes, remembered per caller's project)."""

from __future__ import annotations

import asyncio
import time
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import Response

from sandfleet.cluster.core import parse_body, read_body
from sandfleet.cluster.creates import Creates
from sandfleet.cluster.forward import LOOKUP_TIMEOUT, call_json, forward
from sandfleet.cluster.membership import Node
from sandfleet.daemon.security.iam import Principal
from sandfleet.errors import (
    NotFoundError,
    SandboxLostError,
    UnavailableError,
)
from sandfleet.models import SandboxSpec, TrajectoryOpen


class TrajectoryRouting(Creates):
    # -- trajectories ----------------------------------------------------------------------------
    async def open_trajectory(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        req = parse_body(TrajectoryOpen, await read_body(request))
        admitted: SandboxSpec | None = None  # counted against its project here: forgotten if not made
        if req.snapshot_id or req.sandbox_id:
            what = "snapshot" if req.snapshot_id else "sandbox"
            node = self.membership.holder(req.snapshot_id or req.sandbox_id or "", what)
        else:
            try:  # opened before (through any gateway): the same trajectory, on its node
                node = await self._trajectory_node(request, principal, req.id)
            except NotFoundError:  # on no node, every node having answered
                spec = self._in_project(principal, req.spec or SandboxSpec())
                self.quotas.admit(spec, time.monotonic())
                admitted = spec
                try:
                    node = self._node(self.placer.place(self._placement(spec), time.monotonic()))
                except BaseException:
                    self.quotas.forget(spec)
                    raise
                req = req.model_copy(update={"spec": spec})
        resp = await forward(node, request, body=req.model_dump_json(exclude_unset=True).encode())
        if resp.status_code < 300:
            self._remember(self._trajectories, (principal.project, req.id), node.key)
        elif admitted is not None:
            self.quotas.forget(admitted)
        return resp

    async def _trajectory_node(self, request: Request, principal: Principal, trajectory_id: str) -> Node:
        """The node holding the caller's trajectory `trajectory_id` (ids are per project on the nodes,
        so what is remembered is per caller's project): remembered, or asked of every live node (each
        given LOOKUP_TIMEOUT). `not_found` only when every one answered so. A node that did not
        answer (or whose load reads already fail) may hold it: `unavailable`, never a second
        trajectory of that id opened elsewhere, until it answers or the cluster declares it lost
        (what a lost node held is lost). Found on several nodes (a copy on a node fenced since, say):
        the one whose sandbox lives; which copy is its own cannot be told otherwise (`sandbox_lost`)."""
        scoped = (principal.project, trajectory_id)
        key = self._trajectories.get(scoped)
        if key is not None and key in self.membership.nodes:
            node = self.membership.nodes[key]
            if node.lost:
                raise SandboxLostError(f"trajectory {trajectory_id} is lost: its node {key} died")
            return node
        path = "/v1/trajectories/" + quote(trajectory_id, safe="")

        async def one(n: Node) -> dict[str, Any] | bool:
            """The trajectory's info; False: not here; True: here, lost (a fenced node's copy)."""
            try:
                info: dict[str, Any] = await call_json(n, "GET", path, request=request, timeout=LOOKUP_TIMEOUT)
            except NotFoundError:
                return False
            except SandboxLostError:
                return True
            return info

        asked, silent = self.membership.askable()
        answers, failed = await self._ask(asked, one)
        held = [(n, info) for n, info in answers if isinstance(info, dict)]
        missed = [*silent, *(n for n, _ in failed)]
        if len(held) > 1:
            node = await self._live_holder(request, trajectory_id, held)
        elif held:
            node = held[0][0]
        elif missed:
            names = ", ".join(n.key for n in missed)
            raise UnavailableError(
                f"trajectory {trajectory_id[:80]}: nodes {names} did not answer whether they hold it"
            )
        elif any(info is True for _, info in answers):
            raise SandboxLostError(f"trajectory {trajectory_id[:80]} is lost: its node was declared lost")
        else:
            raise NotFoundError(f"trajectory {trajectory_id[:80]} not found")
        self._remember(self._trajectories, scoped, node.key)
        return node

    async def _live_holder(self, request: Request, trajectory_id: str, held: list[tuple[Node, dict[str, Any]]]) -> Node:
        """Of several nodes answering for one trajectory id, the only one whose sandbox lives (the
        others' copies are stale: a node fenced since, its sandboxes stopped); none or several:
        `sandbox_lost` (picking one could serve steps the caller never saw, or run them twice)."""

        async def live(n: Node, info: dict[str, Any]) -> bool:
            sandbox_id = info.get("sandbox_id")
            if not isinstance(sandbox_id, str):
                return False
            try:
                sb = await call_json(n, "GET", f"/v1/sandboxes/{quote(sandbox_id, safe='')}", request=request)
            except NotFoundError:
                return False
            return sb.get("state") in ("creating", "running", "paused")

        alive = await asyncio.gather(*(live(n, info) for n, info in held))
        nodes = [n for (n, _), ok in zip(held, alive, strict=True) if ok]
        if len(nodes) == 1:
            return nodes[0]
        names = ", ".join(n.key for n, _ in held)
        raise SandboxLostError(
            f"trajectory {trajectory_id[:80]} is held by nodes {names}, {len(nodes)} of them with a live sandbox: "
            "which copy is its own cannot be told"
        )

    async def trajectory_call(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        trajectory_id = request.path_params["trajectory_id"]
        scoped = (principal.project, trajectory_id)
        cached = scoped in self._trajectories
        body = await read_body(request)  # small JSON: kept, to send again if the remembered node was wrong
        node = await self._trajectory_node(request, principal, trajectory_id)
        resp = await forward(node, request, body=body)
        if resp.status_code == 404 and cached:  # deleted since, or remembered wrongly: asked again
            self._trajectories.pop(scoped, None)
            node = await self._trajectory_node(request, principal, trajectory_id)
            resp = await forward(node, request, body=body)
        if request.method == "DELETE" and resp.status_code < 300:
            self._trajectories.pop(scoped, None)
        return resp
