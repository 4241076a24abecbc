"""The gateway's creates: one sandbox, a batch, and the copies of a fork or restore. A create is placed
(placement.py), checked against the caller's project quotas (quotas.py) and sent to the chosen node,
which has the last word (a node that refuses is left out and the create placed again); a retried
create goes where its idempotency key went, asked of the nodes when this gateway does not know."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from sandfleet.client._base import RETRIED
from sandfleet.cluster.acks import FORWARDED
from sandfleet.cluster.core import (
    DELEGATED,
    REFUSALS,
    GatewayCore,
    Scoped,
    json_object,
    parse_body,
    read_body,
    spec_json,
)
from sandfleet.cluster.forward import LOOKUP_TIMEOUT, call_json, forward, json_response
from sandfleet.cluster.json_codec import dumps, loads
from sandfleet.cluster.membership import Node
from sandfleet.cluster.placement import NoCapacity, PlacementRequest
from sandfleet.cluster.quotas import ShareSpent
from sandfleet.daemon.security.iam import Principal
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    UnavailableError,
)
from sandfleet.ids import node_of
from sandfleet.images.models import canonical_ref
from sandfleet.models import CreateBatchRequest, SandboxSpec

# What one placement of a batch's creates serves: (tier, image, the node labels asked for).
Need = tuple[str, str | None, tuple[tuple[str, str], ...]]


class Creates(GatewayCore):
    async def _holders(self, request: Request, wanted: list[Scoped]) -> list[str | None]:
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

    async def _key_holders(self, request: Request, scoped: dict[int, Scoped], ask: bool) -> dict[int, str]:
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
        spec = self._in_project(principal, parse_body(SandboxSpec, await read_body(request)))
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
                    return await self._delegate(exc.owner, request, spec_json(spec), scoped.get(0))
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
                json_body=spec_json(spec),
                headers=headers,
            )
        except SandboxError as exc:
            if not hasattr(exc, "sent"):  # the node answered: it does not hold the key
                self._keyed.pop((spec.project, key), None)
            raise

    async def _place_one(self, request: Request, spec: SandboxSpec, key: str | None) -> Any:
        """Place a create and send it; a node's refusal places it again elsewhere."""
        self._check_selector(spec)
        body = spec_json(spec)
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
                if exc.code not in REFUSALS or getattr(exc, "sent", False):
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
        self, gateway_url: str, request: Request, spec: dict[str, Any], scoped: Scoped | None = None
    ) -> Response:
        """A create this gateway's quota share cannot take, passed to the gateway that holds a share."""
        client = self._gateways.get(gateway_url)
        if client is None:
            client = self._gateways[gateway_url] = httpx.AsyncClient(base_url=gateway_url, timeout=120)
        headers = {DELEGATED: "1", "authorization": request.headers.get("authorization", "")}
        headers["content-type"] = "application/json"
        for name in ("idempotency-key", RETRIED):
            if value := request.headers.get(name):
                headers[name] = value
        try:
            r = await client.post("/v1/sandboxes", content=dumps(spec), headers=headers)
        except httpx.HTTPError as exc:
            raise UnavailableError(f"gateway {gateway_url} holding the project's quota share is unreachable") from exc
        made = []  # the other gateway left the ack to this one: its caller is here
        if r.status_code < 300:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                made = [str(loads(r.content)["id"])]
        if scoped and made and (node := node_of(made[0])):
            self._remember(self._keyed, scoped, node)  # its key's next create goes there from here too
        background = self._acked(request, made)
        return Response(r.content, status_code=r.status_code, media_type="application/json", background=background)

    async def create_batch(self, request: Request) -> Response:
        principal: Principal = request.state.principal
        batch = parse_body(CreateBatchRequest, await read_body(request))
        specs = [self._in_project(principal, s) for s in batch.specs]
        keys = batch.idempotency_keys or [None] * len(specs)
        results: list[dict[str, Any] | None] = [None] * len(specs)
        scoped = {i: (specs[i].project, key) for i, key in enumerate(keys) if key}
        retried = bool(request.headers.get(RETRIED))
        # A keyed item whose key went to a node goes there, taking no new share (see `_to_holder`).
        went = await self._key_holders(request, scoped, retried)
        admitted: list[int] = []
        refused: dict[int, Scoped] = {}
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
            by_need: dict[Need, list[int]] = collections.defaultdict(list)
            needs: dict[Need, PlacementRequest] = {}
            by_node: dict[str, list[int]] = collections.defaultdict(list)
            for i in pending:
                if i in pinned:
                    by_node[went[i]].append(i)
                    continue
                need = self._placement(specs[i])
                need_key = (need.tier, need.image, tuple(sorted(need.node_labels.items())))
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
                    "specs": [spec_json(specs[i]) for i in idx],
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
                    if not err or err.get("code") not in REFUSALS:
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

    # -- by id -----------------------------------------------------------------------------------
    async def copies(self, request: Request) -> Response:
        """A fork of a sandbox or a restore of a snapshot: on the node holding it, counted against the
        source's project quotas here first (as a create is), `count` times."""
        fork = "sandbox_id" in request.path_params
        object_id = request.path_params["sandbox_id" if fork else "snapshot_id"]
        node = self.membership.holder(object_id, "sandbox" if fork else "snapshot")
        body = await json_object(request)
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
            resp = await forward(node, request, body=dumps(body), headers={FORWARDED: "1"}, whole=True)
        except BaseException:
            for a in admitted:
                self.quotas.forget(a)
            raise
        if resp.status_code >= 300:
            for a in admitted:
                self.quotas.forget(a)
        else:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                items = loads(bytes(resp.body))["results"]
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
