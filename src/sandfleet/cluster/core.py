"""What every kind of gateway call uses: the gateway's state (membership, placement, quotas, acks,
the keys and trajectories it placed), its metrics, asking one node or all of them, and reading
request bodies. The calls themselves: creates.py, fan_out.py, trajectory_routing.py, gateway.py."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pydantic
from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response

from sandfleet.cluster.acks import Acks
from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.forward import json_response
from sandfleet.cluster.job_figures import Refusals
from sandfleet.cluster.json_codec import finite, loads
from sandfleet.cluster.membership import Membership, Node
from sandfleet.cluster.placement import Placer
from sandfleet.cluster.quotas import GatewayQuotas
from sandfleet.daemon.security.iam import Iam
from sandfleet.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxError,
    UnavailableError,
)
from sandfleet.models import Refusal, SandboxSpec, validation_message

log = logging.getLogger("sandfleet.cluster")

DELEGATED = "x-sandfleet-delegated"  # a create another gateway passed on: not passed on again
MAX_BODY = 8 * 1024**2  # a create batch of 256 specs fits many times over
Scoped = tuple[str | None, str]  # (a project, an id or key of that project's): what nodes key by
REFUSALS = ("resource_exhausted", "unavailable")  # a node's "not here": placed again elsewhere
LABEL_CALLS = {  # job-level calls: path -> the list field of each node's answer to merge
    "/v1/sandboxes/stop": "stopped",
    "/v1/sandboxes/pause": "sandboxes",
    "/v1/sandboxes/resume": "sandboxes",
    "/v1/sandboxes/lifetimes": "sandboxes",
    "/v1/sandboxes/network": "sandboxes",
}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.placements = Counter("sandfleet_gateway_placements_total", "creates placed, by node", ["node"], registry=r)
        self.replaced = Counter(
            "sandfleet_gateway_replacements_total", "creates a node refused, placed again elsewhere", registry=r
        )
        self.errors = Counter("sandfleet_gateway_errors_total", "error answers, by wire code", ["code"], registry=r)
        self.quota_refusals = Counter(
            "sandfleet_gateway_quota_refusals_total",
            "creates refused by a project's quota, by project",
            ["project"],
            registry=r,
        )
        self.nodes = Gauge("sandfleet_gateway_nodes", "nodes known, by status", ["status"], registry=r)


def spec_json(spec: SandboxSpec) -> dict[str, Any]:
    """A spec as the caller gave it (and the project the gateway put it in: `model_copy` marks it set)."""
    return spec.model_dump(mode="json", exclude_unset=True)


async def json_object(request: Request) -> dict[str, Any]:
    """A JSON object body (or none: {}), or `invalid_argument`."""
    body = await read_body(request)
    if not body:
        return {}
    try:
        data = loads(body)
    except ValueError as exc:
        raise InvalidArgumentError("request body is not valid JSON") from exc
    if not isinstance(data, dict):
        raise InvalidArgumentError("request body must be a JSON object")
    if not finite(data):  # (passed on, it could only be written as null: a limit lifted)
        raise InvalidArgumentError("request body holds a number beyond a float's range")
    return data


async def read_body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise InvalidArgumentError(f"request body larger than {MAX_BODY} bytes")
    return body


def parse_body(model: type[pydantic.BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"{}")
    except pydantic.ValidationError as exc:
        raise InvalidArgumentError(validation_message(exc.errors())) from exc


def stamp(info: dict[str, Any]) -> tuple[float, str]:
    return float(info.get("created_at") or 0), str(info.get("id", ""))


def error_answer(exc: SandboxError) -> Response:
    return json_response({"error": exc.to_wire()}, exc.http_status)


class GatewayCore:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        rng: random.Random | None = None,
        transport: Callable[[str], httpx.AsyncBaseTransport] | None = None,
    ) -> None:
        """`transport`: how to reach a node's URL (tests: in-process nodes); None: HTTP."""
        self.config = config
        self.membership = Membership(
            config.node_token.get_secret_value(),
            load_interval=config.load_interval,
            unreachable_after=config.unreachable_after,
            connections=config.node_connections,
            transport=transport,
        )
        self.placer = Placer(choices=config.choices, groups=config.groups, rng=rng)
        self.iam = Iam(config.iam, config.token.get_secret_value() if config.token else None)
        self.quotas = GatewayQuotas(self.iam, self.membership, config.url)
        self.metrics = GatewayMetrics()
        self.refusals = Refusals()  # creates this gateway refused, per job
        self.quotas.refused = self._refused
        self.quota_since: dict[tuple[str, str], float] = {}  # (project, dim) at its quota: since when
        self._rng = rng or random.Random()
        self.acks = Acks(self.membership)
        # (project, idempotency key) -> node: a retried create goes where the first attempt went
        self._keyed: collections.OrderedDict[Scoped, str] = collections.OrderedDict()
        # (caller's project, trajectory id) -> node key, found once: ids are per project on the nodes
        self._trajectories: collections.OrderedDict[Scoped, str] = collections.OrderedDict()
        self._gateways: dict[str, httpx.AsyncClient] = {}  # other gateways (quota delegation)

    # -- membership ------------------------------------------------------------------------------
    def _refused(self, project: str, spec: SandboxSpec, why: Refusal, error: ResourceExhaustedError) -> None:
        self.metrics.quota_refusals.labels(project=project).inc()
        self.refusals.add(project, spec, why, error)

    def refresh_placement(self) -> None:
        self.placer.update(self.membership.placement_view())
        counts = collections.Counter(n.status for n in self.membership.nodes.values())
        for status in ("alive", "draining", "unreachable", "lost"):
            self.metrics.nodes.labels(status=status).set(counts.get(status, 0))

    async def run_placement_updates(self) -> None:
        while True:
            await self.membership.changed.wait()
            self.membership.changed.clear()
            self.refresh_placement()

    # -- helpers ---------------------------------------------------------------------------------
    def _node(self, key: str) -> Node:
        node = self.membership.nodes.get(key)
        if node is None:
            raise UnavailableError(f"node {key} is not in the cluster")
        return node

    def _acked(self, request: Request, ids: list[str]) -> BackgroundTask | None:
        """The background task of an answer handing these sandboxes to the caller: acknowledged to
        their nodes once it went out (a delegated create's by the gateway that delegated it)."""
        if not ids or request.headers.get(DELEGATED):
            return None
        return BackgroundTask(self.acks.add, ids)

    def _usable(self, key: str) -> bool:
        node = self.membership.nodes.get(key)
        return node is not None and not node.lost

    def _remember(self, table: collections.OrderedDict[Scoped, str], key: Scoped, node: str) -> None:
        table[key] = node
        table.move_to_end(key)
        while len(table) > 100_000:
            table.popitem(last=False)

    async def _ask(
        self, nodes: list[Node], call: Callable[[Node], Awaitable[Any]], *, strict: bool = True
    ) -> tuple[list[tuple[Node, Any]], list[tuple[Node, Exception]]]:
        """`call` on `nodes` at once: the answers, and the nodes that gave none (unreachable, or an
        error of theirs). `strict`: an error that is the caller's (a bad label, no permission: the
        same on every node) is raised."""
        results = await asyncio.gather(*(call(n) for n in nodes), return_exceptions=True)
        answers, failed = [], []
        for node, res in zip(nodes, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res
                caller = isinstance(res, SandboxError) and res.code not in ("unavailable", "sandbox_lost", "internal")
                if caller and strict:
                    raise res
                log.warning("node %s gave no answer to a call on every node: %s", node.key, res)
                failed.append((node, res))
            else:
                answers.append((node, res))
        return answers, failed

    async def _fan_out(self, call: Callable[[Node], Awaitable[Any]], *, every: bool = False) -> list[Any]:
        """`call` on every node at once. Reads: the reachable nodes; one that fails is left out (and
        logged) unless every node failed, so a list keeps working while a node dies. `every` (writes:
        stop, pause, image deletes): every node not lost, also one that stopped answering load reads
        (what it holds still runs): the others do their part, then `unavailable` names the nodes
        that could not, so the caller retries (these calls are idempotent) instead of believing
        it done."""
        nodes = self.membership.live() if every else self.membership.reachable()
        if not nodes:
            raise UnavailableError("no node of the cluster is reachable")
        answers, failed = await self._ask(nodes, call)
        if failed and (every or not answers):
            if not answers:
                raise failed[0][1]
            missed = ", ".join(n.key for n, _ in failed)
            raise UnavailableError(f"done on {len(answers)} of {len(nodes)} nodes; not on {missed}: retry")
        return [res for _, res in answers]
