"""Calls on sandboxes and snapshots as a fleet: creates (their idempotency keys and retries),
forks, restores, snapshots, selectors, lifetimes, network policies, exposed ports, pack."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from sandfleet.client._base.transport import request_sent, transport_cause
from sandfleet.client._base.wire import Call, Unset, _sb, _validated, sandbox_path, snapshot_path
from sandfleet.errors import InvalidArgumentError, ResourceExhaustedError, SandboxError, error_from_wire
from sandfleet.models import (
    MAX_LABEL_VALUE,
    PROJECT_LABEL,
    CreateBatchItem,
    CreateBatchRequest,
    ExposedPort,
    ExposeRequest,
    ForkRequest,
    LifetimeManyRequest,
    LifetimeUpdate,
    NetworkPolicy,
    SandboxSpec,
    SnapshotRequest,
    check_idempotency_key,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

# On a create retried after an attempt whose answer was lost (or whose key the caller says another
# process may have used): the gateway that gets it asks the nodes which holds the key first (another
# gateway may have placed it).
RETRIED = "x-sandfleet-retry"


def new_idempotency_key() -> str:
    return uuid.uuid4().hex


def idempotency_key(key: str | None) -> str:
    """The caller's key (checked), or a fresh one."""
    if key is None:
        return new_idempotency_key()
    try:
        return check_idempotency_key(key)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(str(exc)) from exc


@dataclass
class CreateAttempts:
    """The retry state of one create (or one spec of a batch, a fork, a restore): its idempotency
    key, and whether an earlier attempt may have made the sandbox (the request reached the daemon
    and its answer was lost), in which case only an answer for the same key settles it."""

    key: str
    in_doubt: bool = False
    reused: bool = False  # the caller says another process (a trainer before its restart) may have used the key

    @property
    def retried(self) -> bool:
        """Whether a gateway should look for what the key made before placing this attempt (a node
        answers a key it holds anyway: this is for a cluster, where another node may hold it)."""
        return self.in_doubt or self.reused

    def retry_reason(self, exc: SandboxError) -> Literal["refused", "lost"] | None:
        """Why `exc` calls for another attempt with the same key, or None if it does not."""
        cause = transport_cause(exc)
        if cause is None:  # the daemon answered: whatever an earlier attempt did is settled
            self.in_doubt = False
            return "refused" if isinstance(exc, ResourceExhaustedError) else None
        if request_sent(cause):
            self.in_doubt = True
        # A refused connection before anything was sent is a missing daemon: fail fast, unless an
        # earlier attempt's outcome is still unknown (a restarting daemon answers again shortly).
        return "lost" if self.in_doubt else None

    def final(self, exc: SandboxError) -> SandboxError:
        """The error to give up with: `exc`, or (outcome unknown) one saying which key settles it."""
        if not self.in_doubt:
            return exc
        err = type(exc)(
            f"{exc.message} (the daemon may have acted on it: repeat the call with "
            f"idempotency_key={self.key!r} to get what it made, if anything)"
        )
        err.__cause__ = exc
        return err


def selector(labels: Mapping[str, str] | None, project: str | None) -> dict[str, str]:
    """A label selector, with `project` as the label the daemon matches against each sandbox's
    project and everything under it (`PROJECT_LABEL`)."""
    out = dict(labels or {})
    if project is not None:
        out[PROJECT_LABEL] = project
    return out


def in_project(specs: Iterable[SandboxSpec], project: str | None) -> list[SandboxSpec]:
    """The specs, those naming no project put in `project`."""
    if project is None:
        return list(specs)
    return [s if s.project is not None else spec_from(s, {"project": project}) for s in specs]


def spec_from(spec: SandboxSpec | None, kwargs: dict[str, Any]) -> SandboxSpec:
    if spec is not None and not kwargs:
        return spec
    merged = {**spec.model_dump(exclude_unset=True), **kwargs} if spec is not None else kwargs
    return _validated(SandboxSpec, "sandbox spec", merged)


async def gather_bounded(limit: int, factories: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the coroutine factories with at most `limit` in flight; results in order."""
    sem = asyncio.Semaphore(max(1, limit))

    async def run(factory: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await factory()

    return list(await asyncio.gather(*(run(f) for f in factories)))


def gather_bounded_sync(limit: int, factories: Sequence[Callable[[], T]]) -> list[T]:
    """The blocking client's counterpart: a thread pool of `limit` workers."""
    with ThreadPoolExecutor(max(1, limit)) as pool:
        return list(pool.map(lambda f: f(), factories))


def retried(call: Call, retried: bool) -> Call:
    """`call`, marked RETRIED if `retried` (see `CreateAttempts.retried`)."""
    return dataclasses.replace(call, headers={**call.headers, RETRIED: "1"}) if retried else call


# Fields the caller left unset are not sent: the daemon fills them from the image's defaults
# (an OCI image's WorkingDir and User) before its own.
def call_create(spec: SandboxSpec, key: str, timeout: float) -> Call:
    return Call(
        "POST",
        "/v1/sandboxes",
        json=spec.model_dump(mode="json", exclude_unset=True),
        headers={"idempotency-key": key},
        timeout=timeout,
    )


def call_create_batch(specs: Sequence[SandboxSpec], keys: Sequence[str], concurrency: int, timeout: float) -> Call:
    body = CreateBatchRequest(specs=list(specs), concurrency=concurrency, idempotency_keys=list(keys))
    return Call("POST", "/v1/sandboxes/batch", json=body.model_dump(mode="json", exclude_unset=True), timeout=timeout)


def _fork_body(count: int, labels: Mapping[str, str] | None, key: str) -> dict[str, Any]:
    body = _validated(
        ForkRequest, "fork request", {"count": count, "labels": dict(labels or {}), "idempotency_key": key}
    )
    return body.model_dump(mode="json")


def call_fork(sandbox_id: str, count: int, labels: Mapping[str, str] | None, key: str, timeout: float) -> Call:
    return Call("POST", _sb(sandbox_id, "/fork"), json=_fork_body(count, labels, key), timeout=timeout)


def call_restore(snapshot_id: str, count: int, labels: Mapping[str, str] | None, key: str, timeout: float) -> Call:
    return Call("POST", snapshot_path(snapshot_id) + "/restore", json=_fork_body(count, labels, key), timeout=timeout)


def call_snapshot(sandbox_id: str, ttl: float | None, labels: Mapping[str, str] | None, timeout: float) -> Call:
    """No body unless a ttl or labels are given (the node's retention applies)."""
    fields: dict[str, Any] = {}
    if ttl is not None:
        fields["ttl"] = ttl
    if labels:
        fields["labels"] = dict(labels)
    body = _validated(SnapshotRequest, "snapshot request", fields).model_dump(mode="json") if fields else None
    return Call("POST", _sb(sandbox_id, "/snapshots"), json=body, timeout=timeout)


def call_snapshots(sandbox_id: str | None) -> Call:
    return Call("GET", "/v1/snapshots", params={"sandbox_id": sandbox_id} if sandbox_id else None)


def item_error(item: CreateBatchItem) -> SandboxError:
    """The error of one failed item of a batch create, as the exception the daemon meant."""
    assert item.error is not None
    return error_from_wire({"error": item.error.model_dump()}, status=200)


def call_list(labels: Mapping[str, str] | None, state: str | None) -> Call:
    """`state` None: the daemon's default, live sandboxes (creating, running, paused, stopping)."""
    params: list[tuple[str, Any]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if state is not None:
        params.append(("state", state))
    return Call("GET", "/v1/sandboxes", params=params)


def call_jobs(key: str, labels: Mapping[str, str] | None, state: str | None) -> Call:
    call = call_list(labels, state)
    return Call("GET", "/v1/jobs", params=[("key", key), *(call.params or [])])


def call_job(value: str, stuck_after: float) -> Call:
    """A job's figures: its value is the rest of the path, one segment however many slashes it holds
    ("." and "..": a URL's dot segments, which clients take away, name none)."""
    if not value or len(value) > MAX_LABEL_VALUE or value in (".", ".."):
        raise InvalidArgumentError(f"a job is a label value of 1-{MAX_LABEL_VALUE} characters, not . or ..")
    return Call("GET", "/v1/jobs/" + quote(value, safe=""), params=[("stuck_after", stuck_after)])


Limit = float | None | Unset  # a lifetime limit to set: seconds, None (removed), or UNSET (kept)


def _lifetimes(idle_ttl: Limit, max_lifetime: Limit, pause_after: Limit) -> dict[str, Any]:
    given = (("idle_ttl", idle_ttl), ("max_lifetime", max_lifetime), ("pause_after", pause_after))
    fields = {name: value for name, value in given if not isinstance(value, Unset)}
    if not fields:
        raise InvalidArgumentError("give idle_ttl, max_lifetime or pause_after (None removes that limit)")
    return fields


def call_set_lifetime(sandbox_id: str, idle_ttl: Limit, max_lifetime: Limit, pause_after: Limit) -> Call:
    """Only the limits given are sent (an explicit None as null: remove that limit)."""
    body = _validated(LifetimeUpdate, "lifetime update", _lifetimes(idle_ttl, max_lifetime, pause_after))
    return Call("PATCH", sandbox_path(sandbox_id), json=body.model_dump(mode="json", exclude_unset=True))


def call_set_lifetimes(labels: Mapping[str, str], idle_ttl: Limit, max_lifetime: Limit, pause_after: Limit) -> Call:
    fields = {"labels": dict(labels), **_lifetimes(idle_ttl, max_lifetime, pause_after)}
    body = _validated(LifetimeManyRequest, "lifetime update", fields)
    return Call("POST", "/v1/sandboxes/lifetimes", json=body.model_dump(mode="json", exclude_unset=True))


def call_labels(action: Literal["pause", "resume"], labels: Mapping[str, str], timeout: float) -> Call:
    return Call("POST", f"/v1/sandboxes/{action}", json={"labels": dict(labels)}, timeout=timeout)


def network_policy(network: NetworkPolicy | str | Sequence[str] | Mapping[str, bool]) -> NetworkPolicy:
    """A policy from any of its forms: "none", ["pypi", "example.com:443"], {"pypi": True}."""
    if isinstance(network, NetworkPolicy):
        return network
    try:
        return NetworkPolicy.model_validate(network)
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid network policy: {exc}") from exc


def call_set_network(sandbox_id: str, network: NetworkPolicy) -> Call:
    return Call("PUT", _sb(sandbox_id, "/network"), json={"network": network.model_dump(mode="json")})


def call_set_network_many(labels: Mapping[str, str], network: NetworkPolicy, timeout: float) -> Call:
    body = {"labels": dict(labels), "network": network.model_dump(mode="json")}
    return Call("POST", "/v1/sandboxes/network", json=body, timeout=timeout)


def call_expose(sandbox_id: str, port: int) -> Call:
    return Call(
        "POST", _sb(sandbox_id, "/ports"), json={"port": _validated(ExposeRequest, "port", {"port": port}).port}
    )


def exposed(base: httpx.URL, port: ExposedPort) -> ExposedPort:
    """The daemon's answer with the full URL this client reaches the port at (through the gateway
    it uses now, when there are several)."""
    return port.model_copy(update={"url": str(base).rstrip("/") + port.path})


def call_pack(sandbox_id: str, image: str, exclude: Sequence[str], timeout: float) -> Call:
    return Call("POST", _sb(sandbox_id, "/pack"), json={"image": image, "exclude": list(exclude)}, timeout=timeout)
