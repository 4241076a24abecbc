"""The cluster gateway: the node's HTTP API over many nodes, holding no state of its own.

Any number of gateways serve the same API (docs/openapi.json) a node does, so the SDK and every
client work unchanged. What a gateway does per call:
- a call naming a sandbox or snapshot goes to the node in its id (`sandfleet.ids`), passed on as it
  came (forward.py); a dead node's ids answer `sandbox_lost`;
- a create is placed (placement.py: filter, spill over node groups, power of two choices over loads
  about a second old plus this gateway's own recent placements), checked against the caller's
  project quotas (quotas.py: this gateway's share of each quota's headroom, no central call), and
  sent to the chosen node, which has the last word: a node that refuses (full, draining) is left
  out and the create placed again;
- a batch is placed at once (2m sampled nodes for m sandboxes) and sent as one batch per node;
- list and job-level calls (stop, pause, resume, lifetimes, network by label) go to every node
  with the caller's own credentials, and the answers are merged; a write that could not reach a
  node says which;
- trajectories go to the node of their sandbox, found once and remembered (per caller's project);
- a create's sandbox is acknowledged to its node once the caller has the answer (acks.py), so one
  whose answer was lost (this gateway died) is reaped by its node; a retried create (the SDK marks
  it) asks the nodes which holds its idempotency key and goes there, whichever gateway it reaches.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

import httpx
import pydantic
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket

from sandfleet import __version__, console
from sandfleet.client._base import RETRIED
from sandfleet.cluster.acks import FORWARDED, Acks
from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.forward import LOOKUP_TIMEOUT, call_json, forward, json_response
from sandfleet.cluster.membership import Membership, Node
from sandfleet.cluster.placement import NoCapacity, PlacementRequest, Placer
from sandfleet.cluster.quotas import GatewayQuotas, ShareSpent
from sandfleet.cluster.terminal import relay as relay_terminal
from sandfleet.daemon.iam import Iam, Principal
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxLostError,
    UnavailableError,
    UnsupportedError,
)
from sandfleet.ids import node_of
from sandfleet.images.models import canonical_ref
from sandfleet.models import CreateBatchRequest, SandboxSpec, TrajectoryOpen, list_page, validation_message
from sandfleet.operations import OPERATIONS

log = logging.getLogger("sandfleet.cluster")

DELEGATED = "x-sandfleet-delegated"  # a create another gateway passed on: not passed on again
MAX_BODY = 8 * 1024**2  # a create batch of 256 specs fits many times over
_Scoped = tuple[str | None, str]  # (a project, an id or key of that project's): what nodes key by
_REFUSALS = ("resource_exhausted", "unavailable")  # a node's "not here": placed again elsewhere
_LABEL_CALLS = {  # job-level calls: path -> the list field of each node's answer to merge
    "/v1/sandboxes/stop": "stopped",
    "/v1/sandboxes/pause": "sandboxes",
    "/v1/sandboxes/resume": "sandboxes",
    "/v1/sandboxes/lifetimes": "sandboxes",
    "/v1/sandboxes/network": "sandboxes",
}


# Operations of the node API a gateway does not pass on, and why (sandfleet/operations.py): each answers
# `unsupported` with its reason.
NODE_ONLY = {(method, op.path): op.why for op in OPERATIONS if op.gateway == "node_only" for method in op.methods}


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.placements = Counter("sandfleet_gateway_placements_total", "creates placed, by node", ["node"], registry=r)
        self.replaced = Counter(
            "sandfleet_gateway_replacements_total", "creates a node refused, placed again elsewhere", registry=r
        )
        self.errors = Counter("sandfleet_gateway_errors_total", "error answers, by wire code", ["code"], registry=r)
        self.nodes = Gauge("sandfleet_gateway_nodes", "nodes known, by status", ["status"], registry=r)


class Gateway:
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
        self._rng = rng or random.Random()
        self.acks = Acks(self.membership)
        # (project, idempotency key) -> node: a retried create goes where the first attempt went
        self._keyed: collections.OrderedDict[_Scoped, str] = collections.OrderedDict()
        # (caller's project, trajectory id) -> node key, found once: ids are per project on the nodes
        self._trajectories: collections.OrderedDict[_Scoped, str] = collections.OrderedDict()
        self._gateways: dict[str, httpx.AsyncClient] = {}  # other gateways (quota delegation)

    # -- membership ------------------------------------------------------------------------------
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

    def _remember(self, table: collections.OrderedDict[_Scoped, str], key: _Scoped, node: str) -> None:
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

    async def _holders(self, request: Request, wanted: list[_Scoped]) -> list[str | None]:
        """Per (project, idempotency key): the node that made (or is making) a sandbox with it, asked
        of every live node with the caller's credentials (a create retried through another gateway:
        the node decides by key), each given LOOKUP_TIMEOUT to answer. A node that does not answer,
        or whose load reads already fail (not asked), is taken to hold none: the create is placed
        afresh, and if that node did make one, nobody acknowledges it and it is reaped after the
        node's claim window."""
        body = {"keys": [{"project": project, "key": key} for project, key in wanted]}

        async def one(n: Node) -> list[bool]:
            data = await call_json(
                n, "POST", "/v1/sandboxes/keys", request=request, json_body=body, timeout=LOOKUP_TIMEOUT
            )
            return list(data["held"])

        asked, _silent = self.membership.askable()
        answers, _ = await self._ask(asked, one, strict=False)
        out: list[str | None] = [None] * len(wanted)
        for node, held in answers:
            for i, h in enumerate(held[: len(wanted)]):
                if h and out[i] is None:
                    out[i] = node.key
        return out

    async def _key_holders(self, request: Request, scoped: dict[int, _Scoped], ask: bool) -> dict[int, str]:
        """Of these keyed creates (index -> (project, key)), the node each key went to: remembered
        (this gateway sent it there), or, with `ask`, the node that says it holds it. Only live
        nodes: a lost one's sandboxes are gone, and the create is a new one."""
        found = {i: node for i, k in scoped.items() if (node := self._keyed.get(k)) is not None}
        unknown = [i for i in scoped if i not in found]
        if ask and unknown:
            held = await self._holders(request, [scoped[i] for i in unknown])
            found |= {i: node for i, node in zip(unknown, held, strict=True) if node is not None}
        return {i: node for i, node in found.items() if self._usable(node)}

    # -- creates ---------------------------------------------------------------------------------
    def _placement(self, spec: SandboxSpec) -> PlacementRequest:
        image = None
        if spec.image is not None and not spec.layers:
            try:
                image = canonical_ref(spec.image)
            except ValueError:
                image = spec.image
        return PlacementRequest(tier=spec.backend, image=image, node_labels=spec.node_selector, project=spec.project)

    def _check_selector(self, spec: SandboxSpec) -> None:
        """A create asking for node labels no node of the cluster carries is the caller's mistake,
        not a wait for capacity."""
        wanted = spec.node_selector.items()
        if wanted and not any(
            n.load is not None and wanted <= n.load.labels.items() for n in self.membership.nodes.values()
        ):
            shown = ", ".join(f"{k}={v}" for k, v in sorted(spec.node_selector.items()))[:300]
            raise InvalidArgumentError(f"no node of the cluster carries the labels {shown}")

    def _in_project(self, principal: Principal, spec: SandboxSpec) -> SandboxSpec:
        project = spec.project if spec.project is not None else principal.project
        if project is not None and not principal.sees(project):
            raise PermissionDeniedError(f"token {principal.name} cannot create in project {project}")
        if not principal.can_write:
            raise PermissionDeniedError(f"token {principal.name} is read-only")
        return spec if project == spec.project else spec.model_copy(update={"project": project})

    async def create(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        spec = self._in_project(principal, _parse(SandboxSpec, await _body(request)))
        key = request.headers.get("idempotency-key")
        scoped = {0: (spec.project, key)} if key else {}
        retried = bool(request.headers.get(RETRIED))
        holder = (await self._key_holders(request, scoped, retried)).get(0)
        if holder is None:
            try:
                self.quotas.admit(spec, time.monotonic())
            except ResourceExhaustedError as exc:
                # At the quota, a key a node already holds is a retry: it gets what it made, no new share.
                if scoped and not retried:
                    holder = (await self._key_holders(request, scoped, True)).get(0)
                if holder is None:
                    if not isinstance(exc, ShareSpent):
                        raise
                    if request.headers.get(DELEGATED) or exc.owner == self.config.url:
                        raise ResourceExhaustedError(exc.message) from exc
                    return await self._delegate(exc.owner, request, _spec_json(spec), scoped.get(0))
        if holder is not None and key is not None:
            data = await self._to_holder(request, spec, key, holder)
        else:
            try:
                data = await self._place_one(request, spec, key)
            except ResourceExhaustedError:
                self.quotas.forget(spec)  # no sandbox came of it: the share is free again
                # No node to place it on: a key a node already holds (sent there by another gateway,
                # or before this one restarted) is a retry, and gets what it made.
                holder = (await self._key_holders(request, scoped, True)).get(0) if scoped and not retried else None
                if holder is None or key is None:
                    raise
                data = await self._to_holder(request, spec, key, holder)
            except BaseException:
                self.quotas.forget(spec)
                raise
        return json_response(data, 201, background=self._acked(request, [data["id"]]))

    async def _to_holder(self, request: Request, spec: SandboxSpec, key: str, node_key: str) -> Any:
        """A create sent where its idempotency key went (the node holds it, or may: an earlier attempt
        went there), taking no new quota share: the node answers what the key made. Never placed
        elsewhere from here: a node that could not be reached may hold the key's sandbox (a second
        one would be made); one that answered a refusal holds none (a node answers a key it holds
        with its sandbox), and the next attempt is placed afresh."""
        headers = {FORWARDED: "1", "idempotency-key": key}
        try:
            return await call_json(
                self._node(node_key),
                "POST",
                "/v1/sandboxes",
                request=request,
                json_body=_spec_json(spec),
                headers=headers,
            )
        except SandboxError as exc:
            if not hasattr(exc, "sent"):  # the node answered: it does not hold the key
                self._keyed.pop((spec.project, key), None)
            raise

    async def _place_one(self, request: Request, spec: SandboxSpec, key: str | None) -> Any:
        """Place a create and send it; a node's refusal places it again elsewhere."""
        self._check_selector(spec)
        body = _spec_json(spec)
        req = self._placement(spec)
        scoped = (spec.project, key) if key else None
        headers = {FORWARDED: "1"} | ({"idempotency-key": key} if key else {})
        exclude: set[str] = set()
        last: SandboxError | None = None
        for _attempt in range(self.config.create_attempts):
            try:
                node_key = self.placer.place(req, time.monotonic(), exclude)
            except NoCapacity as exc:
                raise (last or exc) from None
            if scoped:
                self._remember(self._keyed, scoped, node_key)
            node = self._node(node_key)
            self.metrics.placements.labels(node=node_key).inc()
            try:
                return await call_json(node, "POST", "/v1/sandboxes", request=request, json_body=body, headers=headers)
            except SandboxError as exc:
                if exc.code not in _REFUSALS or getattr(exc, "sent", False):
                    raise  # a node that may have made it: placing it again could make two
                self.placer.release(node_key, full=exc.code == "resource_exhausted")
                exclude.add(node_key)
                self.metrics.replaced.inc()
                last = exc
                if scoped:
                    self._keyed.pop(scoped, None)
        assert last is not None
        raise last

    async def _delegate(
        self, gateway_url: str, request: Request, spec: dict[str, Any], scoped: _Scoped | None = None
    ) -> Response:
        """A create this gateway's quota share cannot take, passed to the gateway that holds a share."""
        client = self._gateways.get(gateway_url)
        if client is None:
            client = self._gateways[gateway_url] = httpx.AsyncClient(base_url=gateway_url, timeout=120)
        headers = {DELEGATED: "1", "authorization": request.headers.get("authorization", "")}
        for name in ("idempotency-key", RETRIED):
            if value := request.headers.get(name):
                headers[name] = value
        try:
            r = await client.post("/v1/sandboxes", json=spec, headers=headers)
        except httpx.HTTPError as exc:
            raise UnavailableError(f"gateway {gateway_url} holding the project's quota share is unreachable") from exc
        made = []  # the other gateway left the ack to this one: its caller is here
        if r.status_code < 300:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                made = [str(json.loads(r.content)["id"])]
        if scoped and made and (node := node_of(made[0])):
            self._remember(self._keyed, scoped, node)  # its key's next create goes there from here too
        background = self._acked(request, made)
        return Response(r.content, status_code=r.status_code, media_type="application/json", background=background)

    async def create_batch(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        batch = _parse(CreateBatchRequest, await _body(request))
        specs = [self._in_project(principal, s) for s in batch.specs]
        keys = batch.idempotency_keys or [None] * len(specs)
        results: list[dict[str, Any] | None] = [None] * len(specs)
        scoped = {i: (specs[i].project, key) for i, key in enumerate(keys) if key}
        retried = bool(request.headers.get(RETRIED))
        # A keyed item whose key went to a node goes there, taking no new share (see `_to_holder`).
        went = await self._key_holders(request, scoped, retried)
        admitted: list[int] = []
        refused: dict[int, _Scoped] = {}
        now = time.monotonic()
        for i, spec in enumerate(specs):
            if i in went:
                continue
            try:
                self.quotas.admit(spec, now)
                admitted.append(i)
            except SandboxError as exc:
                results[i] = {"error": exc.to_wire()}
                if i in scoped:
                    refused[i] = scoped[i]
        if refused and not retried:  # at the quota, a key a node holds is a retry: no new share
            held = await self._key_holders(request, refused, True)
            for i in held:
                results[i] = None
            went |= held
        pinned = set(went)
        pending = sorted(pinned) + admitted
        exclude: set[str] = set()
        for _attempt in range(self.config.create_attempts):
            if not pending:
                break
            # One placement per distinct need (tier, image) in the batch, each placed as a batch.
            by_need: dict[tuple[str, str | None, str], list[int]] = collections.defaultdict(list)
            needs: dict[tuple[str, str | None, str], PlacementRequest] = {}
            by_node: dict[str, list[int]] = collections.defaultdict(list)
            for i in pending:
                if i in pinned:
                    by_node[went[i]].append(i)
                    continue
                need = self._placement(specs[i])
                need_key = (need.tier, need.image, json.dumps(sorted(need.node_labels.items())))
                by_need[need_key].append(i)
                needs[need_key] = need
            for need_key, idx in by_need.items():
                try:
                    nodes = self.placer.place_many(needs[need_key], len(idx), time.monotonic(), exclude)
                except NoCapacity as exc:
                    for i in idx:
                        results[i] = {
                            "error": ResourceExhaustedError(f"no node can take this sandbox: {exc}").to_wire()
                        }
                    continue
                for i, node_key in zip(idx, nodes, strict=True):
                    by_node[node_key].append(i)
                    self.metrics.placements.labels(node=node_key).inc()
                    if i in scoped:
                        self._remember(self._keyed, scoped[i], node_key)
            retry: list[int] = []

            async def one_node(node_key: str, idx: list[int], retry: list[int] = retry) -> None:
                body = {
                    "specs": [_spec_json(specs[i]) for i in idx],
                    "concurrency": batch.concurrency,
                    "idempotency_keys": [keys[i] for i in idx],
                }
                answered = True
                try:
                    node = self._node(node_key)
                    data = await call_json(
                        node, "POST", "/v1/sandboxes/batch", request=request, json_body=body, headers={FORWARDED: "1"}
                    )
                    items = data["results"]
                except SandboxError as exc:  # this node's part failed whole; the others' stand
                    exclude.add(node_key)
                    answered = not hasattr(exc, "sent")
                    if getattr(exc, "sent", False):  # it may have made them: not placed again
                        for i in idx:
                            results[i] = {"error": exc.to_wire()}
                        return
                    items = [{"error": exc.to_wire()}] * len(idx)
                refusals = 0
                for i, item in zip(idx, items, strict=True):
                    err = item.get("error")
                    results[i] = item
                    if not err or err.get("code") not in _REFUSALS:
                        continue
                    if i in pinned:  # never placed elsewhere (see `_to_holder`)
                        if answered:
                            self._keyed.pop(scoped[i], None)
                        continue
                    refusals += 1
                    retry.append(i)
                    if i in scoped:
                        self._keyed.pop(scoped[i], None)
                if refusals:
                    self.placer.release(node_key, refusals, full=True)
                    exclude.add(node_key)
                    self.metrics.replaced.inc(refusals)

            await asyncio.gather(*(one_node(k, idx) for k, idx in by_node.items()))
            pending = retry
        for i, item in enumerate(results):
            if item is None:  # never sent: every node it could go to refused
                results[i] = {"error": ResourceExhaustedError("no node could take this sandbox").to_wire()}
        for i in admitted:  # no sandbox came of these: their shares are free again
            item = results[i]
            if item is None or item.get("error"):
                self.quotas.forget(specs[i])
        made = [str(item["sandbox"]["id"]) for item in results if item is not None and item.get("sandbox")]
        return json_response({"results": results}, background=self._acked(request, made))

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
            page, cursor, total = list_page(merged, int(limit or 1000), after, _stamp)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc)) from None
        return json_response({"sandboxes": page, "next": cursor, "total": total})

    async def whoami(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        return json_response({"name": principal.name, "can_write": principal.can_write, "project": principal.project})

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
        field = _LABEL_CALLS[request.url.path]
        body = await _json_object(request)

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
        payload = await _json_object(request) if request.method != "DELETE" else None
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
        return await forward(self._node(key), request, body=await _body(request))

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
        groups: dict[str | None, collections.Counter[str]] = {}
        for part in parts:
            for job in part["jobs"]:
                groups.setdefault(job["value"], collections.Counter()).update(job["states"])
        jobs = [
            {"value": value, "count": sum(states.values()), "states": dict(states)}
            for value, states in sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or ""))
        ]
        key = parts[0]["key"] if parts else request.query_params.get("key", "job")
        return json_response({"key": key, "jobs": jobs, "total": sum(p["total"] for p in parts)})

    # -- trajectories ----------------------------------------------------------------------------
    async def open_trajectory(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        req = _parse(TrajectoryOpen, await _body(request))
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
        body = await _body(request)  # small JSON: kept, to send again if the remembered node was wrong
        node = await self._trajectory_node(request, principal, trajectory_id)
        resp = await forward(node, request, body=body)
        if resp.status_code == 404 and cached:  # deleted since, or remembered wrongly: asked again
            self._trajectories.pop(scoped, None)
            node = await self._trajectory_node(request, principal, trajectory_id)
            resp = await forward(node, request, body=body)
        if request.method == "DELETE" and resp.status_code < 300:
            self._trajectories.pop(scoped, None)
        return resp

    async def list_trajectories(self, request: Request) -> Response:
        params = list(request.query_params.multi_items())

        async def one(n: Node) -> list[Any]:
            data = await call_json(n, "GET", "/v1/trajectories", request=request, params=params)
            return list(data["trajectories"])

        return json_response({"trajectories": [t for part in await self._fan_out(one) for t in part]})

    # -- by id -----------------------------------------------------------------------------------
    async def copies(self, request: Request) -> Response:
        """A fork of a sandbox or a restore of a snapshot: on the node holding it, counted against the
        source's project quotas here first (as a create is), `count` times."""
        fork = "sandbox_id" in request.path_params
        object_id = request.path_params["sandbox_id" if fork else "snapshot_id"]
        node = self.membership.holder(object_id, "sandbox" if fork else "snapshot")
        body = await _json_object(request)
        count = body.get("count", 1)
        if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 64:
            raise InvalidArgumentError("count must be an integer from 1 to 64")
        spec = await self._source_spec(request, node, object_id, fork)
        key = body.get("idempotency_key")
        admitted: list[SandboxSpec] = []
        try:
            if spec is not None and spec.project is not None:
                now = time.monotonic()
                try:
                    for _ in range(count):
                        self.quotas.admit(spec, now)
                        admitted.append(spec)
                except ResourceExhaustedError:
                    # At the quota, a retry whose key already made its children gets them, no new share.
                    if not (isinstance(key, str) and await self._holds_copies(request, node, spec.project, key)):
                        raise
                    for a in admitted:
                        self.quotas.forget(a)
                    admitted = []
            # Read whole (its size is bounded by `count`): the children are acknowledged from it.
            resp = await forward(node, request, body=json.dumps(body).encode(), headers={FORWARDED: "1"}, whole=True)
        except BaseException:
            for a in admitted:
                self.quotas.forget(a)
            raise
        if resp.status_code >= 300:
            for a in admitted:
                self.quotas.forget(a)
        else:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                items = json.loads(bytes(resp.body))["results"]
                resp.background = self._acked(request, [str(i["sandbox"]["id"]) for i in items if i.get("sandbox")])
        return resp

    async def _holds_copies(self, request: Request, node: Node, project: str, key: str) -> bool:
        """Whether `node` made (or is making) a fork's or restore's children under idempotency key
        `key` (as the node remembers the batch's key: since its last restart)."""
        body = {"keys": [{"project": project, "key": key}]}
        try:
            data = await call_json(
                node, "POST", "/v1/sandboxes/keys", request=request, json_body=body, timeout=LOOKUP_TIMEOUT
            )
        except SandboxError:
            return False
        return bool(data["held"][0])

    async def _source_spec(self, request: Request, node: Node, object_id: str, fork: bool) -> SandboxSpec | None:
        """The spec copies of a sandbox or snapshot are made from (its project and resources), as the
        caller may see it (a caller that may not gets the node's not_found from here)."""
        sandbox_id = object_id
        if not fork:
            snap = await call_json(node, "GET", f"/v1/snapshots/{object_id}", request=request)
            sandbox_id = str(snap.get("sandbox_id", ""))
            project = snap.get("project")
        try:
            info = await call_json(node, "GET", f"/v1/sandboxes/{sandbox_id}", request=request)
        except NotFoundError:
            if fork:
                raise
            return SandboxSpec(project=project) if project else None  # its sandbox is gone
        return SandboxSpec.model_validate(info["spec"])

    async def sandbox_call(self, request: Request) -> Response:
        return await forward(self.membership.holder(request.path_params["sandbox_id"]), request)

    async def snapshot_call(self, request: Request) -> Response:
        return await forward(self.membership.holder(request.path_params["snapshot_id"], "snapshot"), request)

    # -- the cluster itself ----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """The cluster's tiers and live sandboxes: all of them for a root token, the caller's
        projects' for a scoped one (what other projects run is theirs)."""
        principal: Principal = request.state.principal
        tiers: dict[str, list[str]] = {}
        running = 0
        for n in self.membership.nodes.values():
            if n.load is not None and not n.lost:
                if principal.project is None:
                    running += n.load.sandboxes
                else:
                    running += sum(u.sandboxes for p, u in n.load.projects.items() if principal.sees(p or None))
                for t in n.load.tiers:
                    tiers.setdefault(t, [])
        reachable = self.membership.reachable()
        if reachable:  # capabilities as a node reports them (every node runs the same build)
            try:
                h = await call_json(reachable[0], "GET", "/v1/health")
                tiers = {**tiers, **h.get("tiers", {})}
            except SandboxError:
                pass
        return json_response(
            {
                "status": "ok" if reachable else "degraded",
                "version": __version__,
                "sandboxes_running": running,
                "backends": sorted(tiers),
                "pools": {},
                "tiers": tiers,
            }
        )

    async def nodes(self, request: Request) -> Response:
        """Every node: for a root token, all the gateway knows (URL, generation, load); for a token
        scoped to a project, what it may use (status, group, labels, tiers, draining) and its own
        projects' usage: no node URL, no count of other projects' sandboxes, no node's image list."""
        principal: Principal = request.state.principal
        root = principal.project is None

        def entry(n: Node) -> dict[str, Any]:
            load = n.load.model_dump() if n.load is not None else None
            if load is not None:
                load["projects"] = {p: u for p, u in load["projects"].items() if root or principal.sees(p or None)}
            out = {"key": n.key, "group": n.group, "status": n.status}
            if root:
                age = round(time.monotonic() - n.load_at, 3) if n.load else None
                return out | {"url": n.url, "generation": n.generation, "load": load, "load_age": age}
            shown = ("labels", "draining", "tiers", "projects")
            return out | {"load": {k: load[k] for k in shown} if load is not None else None}

        nodes = [entry(n) for n in sorted(self.membership.nodes.values(), key=lambda n: n.key)]
        return json_response({"nodes": nodes, "gateways": self.membership.gateways})

    async def drain(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        if principal.project is not None or principal.role != "admin":
            raise PermissionDeniedError("draining a node takes a root admin token")
        node = self.membership.nodes.get(request.path_params["key"])
        if node is None or node.lost:
            raise NotFoundError(f"node {request.path_params['key'][:16]} not in the cluster")
        body = await _json_object(request)
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            raise InvalidArgumentError("draining must be true or false")
        data = await call_json(node, "POST", "/v1/node/drain", json_body={"draining": draining}, control=True)
        await self.membership.refresh()
        return json_response(data)

    async def node_only(self, request: Request) -> Response:
        why = NODE_ONLY.get((request.method, request.url.path), "")
        raise UnsupportedError(f"{request.method} {request.url.path} is not served by a gateway: {why}")

    async def prometheus(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        if principal.project is not None:
            raise PermissionDeniedError(f"token {principal.name} is scoped to a project: metrics need the root")
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _spec_json(spec: SandboxSpec) -> dict[str, Any]:
    """A spec as the caller gave it (and the project the gateway put it in: `model_copy` marks it set)."""
    return spec.model_dump(mode="json", exclude_unset=True)


async def _json_object(request: Request) -> dict[str, Any]:
    """A JSON object body (or none: {}), or `invalid_argument`."""
    body = await _body(request)
    if not body:
        return {}
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise InvalidArgumentError("request body is not valid JSON") from exc
    if not isinstance(data, dict):
        raise InvalidArgumentError("request body must be a JSON object")
    return data


async def _body(request: Request) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise InvalidArgumentError(f"request body larger than {MAX_BODY} bytes")
    return body


def _parse(model: type[pydantic.BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body or b"{}")
    except pydantic.ValidationError as exc:
        raise InvalidArgumentError(validation_message(exc.errors())) from exc


def create_gateway_app(gw: Gateway) -> Starlette:
    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                request.state.principal = gw.iam.authenticate(request.headers.get("authorization", ""))
                return await handler(request)
            except SandboxError as exc:
                gw.metrics.errors.labels(code=exc.code).inc()
                return _error(exc)
            except Exception as exc:
                log.exception("unexpected error serving %s %s", request.method, request.url.path)
                gw.metrics.errors.labels(code="internal").inc()
                return _error(SandboxError(f"gateway error: {type(exc).__name__}"))

        return run

    # One route per declared operation, to the handler its declaration names (by default its scope's:
    # a call naming a sandbox goes to the node holding it); then the gateway's own.
    routes: list[BaseRoute] = []
    for op in OPERATIONS:
        handler = getattr(gw, op.gateway_handler, None) if op.gateway_handler else None
        if handler is None:
            raise RuntimeError(f"operation {op.name} has no gateway rule (sandfleet/operations.py: `gateway`)")
        routes.append(Route(op.path, guarded(handler), methods=list(op.methods)))
    routes += [
        Route("/v1/cluster/nodes", guarded(gw.nodes), methods=["GET"]),
        Route("/v1/cluster/nodes/{key:str}/drain", guarded(gw.drain), methods=["POST"]),
    ]

    async def terminal(ws: WebSocket) -> None:
        await relay_terminal(ws, gw.iam, gw.membership)

    routes += [
        WebSocketRoute("/v1/sandboxes/{sandbox_id:str}/terminal", terminal),
        *console.routes(),
    ]

    async def not_found(request: Request, exc: Exception) -> Response:
        return _error(NotFoundError("no such endpoint"))

    async def bad_method(request: Request, exc: Exception) -> Response:
        return _error(InvalidArgumentError("method not allowed on this endpoint"))

    app = Starlette(routes=routes, exception_handlers={404: not_found, 405: bad_method})
    app.state.gateway = gw
    return app


def _stamp(info: dict[str, Any]) -> tuple[float, str]:
    return float(info.get("created_at") or 0), str(info.get("id", ""))


def _error(exc: SandboxError) -> Response:
    return json_response({"error": exc.to_wire()}, exc.http_status)
