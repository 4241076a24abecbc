"""`Client`: the blocking SDK. Generated from aio.py by scripts/gen_sync_client.py: do not edit."""

from __future__ import annotations

import base64
import builtins
import contextlib
import functools
import os
import queue
import re
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import httpx
import wsproto.events
from httpx_ws import (
    WebSocketDisconnect,
    WebSocketNetworkError,
    WebSocketSession,
    WebSocketUpgradeError,
    connect_ws,
)
from pydantic import BaseModel
from wsproto.utilities import LocalProtocolError

from sandfleet.client import _base as b
from sandfleet.client._base import UNSET, Unset
from sandfleet.errors import SandboxError, SandboxNotFoundError, SandboxTimeoutError, WrongStateError
from sandfleet.models import (
    AuditList,
    AuditRecord,
    BuildEvent,
    CreateBatchResult,
    DrainRequest,
    EventList,
    ExecAction,
    ExecEvent,
    ExecResult,
    ExposedPort,
    ExposedPortList,
    FenceRequest,
    FileEvent,
    FileInfo,
    FileList,
    GcResult,
    IdList,
    ImageInfo,
    ImageList,
    ImportRequest,
    JobList,
    NetworkPolicy,
    NodeLoad,
    Ok,
    ProcessInfo,
    ProcessList,
    ReadAction,
    RecipeBuildRequest,
    ReproRecord,
    Resources,
    SandboxEvent,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
    SessionInfo,
    SessionList,
    SnapshotAction,
    SnapshotInfo,
    SnapshotList,
    StepList,
    StepResult,
    StopManyResult,
    TerminalSize,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryList,
    TrajectoryOpen,
    Usage,
    VerifyRequest,
    VerifyResult,
    WriteAction,
)

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Client:
    """Talks to a sandfleet daemon. `with Client() as fleet: sb = fleet.create(...)`.

    `timeout` (seconds) is the deadline of every call that has none of its own: a daemon that stops
    answering raises `SandboxTimeoutError` after it, streams included (there it bounds silence, never
    below `b.MIN_SILENCE`: the daemon sends heartbeats while a command is quiet). `transport`
    replaces the HTTP transport (tests pass an `httpx.MockTransport`); `socket`/`url` then only name
    the daemon in errors. Several URLs (a list, or comma-separated): a cluster's gateways, calls move
    to the next one when one fails (see `b.fail_over`).
    """

    def __init__(
        self,
        socket: str | os.PathLike[str] | Sequence[str] | None = None,
        *,
        url: str | Sequence[str] | None = None,
        token: str | None = None,
        timeout: float = b.DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.endpoint = b.Endpoint.resolve(socket, url, token)
        self.timeout = b.check_timeout(timeout, b.DEFAULT_TIMEOUT)
        if transport is None and self.endpoint.socket:
            transport = httpx.HTTPTransport(uds=self.endpoint.socket)
        elif transport is None:  # TCP: a request's headers and body leave at once (no Nagle wait)
            transport = httpx.HTTPTransport(socket_options=b.TCP_OPTIONS)
        self._http = httpx.Client(
            base_url=self.endpoint.url, transport=transport, timeout=self.timeout, headers=self.endpoint.headers()
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plumbing

    def _send(self, call: b.Call) -> bytes:
        route = b.Route(self._http, self.endpoint, call)  # several gateways: on to the next where safe
        while True:
            route.sending()
            try:
                resp = self._http.request(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.json,
                    content=call.content,
                    headers=dict(call.headers),
                    timeout=self.endpoint.timeout(b.request_timeout(call, self.timeout)),
                )
                break
            except (httpx.HTTPError, OSError) as exc:
                if (err := route.failed(exc)) is not None:
                    raise err from exc
        b.raise_for(resp.status_code, resp.content, self.endpoint)
        return resp.content

    def _model(self, model: type[M], call: b.Call) -> M:
        return b.decode(model, self._send(call))

    def _stream(self, call: b.Call, decode: Callable[[bytes], T | None]) -> Generator[T | None, None]:
        """None once the daemon answered (the stream is open), then the items of its ndjson stream,
        `decode`d (None: a heartbeat, swallowed). Silence longer than the client's timeout (see
        `b.silence_limit`) or a stream outlasting `call.timeout` raises SandboxTimeoutError; leaving
        (an error, a timeout, the generator closed or dropped) closes the connection, and the daemon
        ends what the stream was for."""
        silence = b.silence_limit(self.timeout)
        deadline = b.stream_deadline(call, time.monotonic())
        route = b.Route(self._http, self.endpoint, call)
        opened = False  # once the daemon answered, a failure ends the stream (items were given)
        while True:
            route.sending()
            try:
                with self._http.stream(
                    call.method,
                    call.path,
                    params=call.params,
                    json=call.json,
                    content=call.content,
                    headers=dict(call.headers),
                    timeout=self.endpoint.timeout(b.stream_timeouts(self.timeout)),
                ) as resp:
                    opened = True
                    if resp.status_code >= 400:
                        b.raise_for(resp.status_code, resp.read(), self.endpoint)
                    yield None
                    lines = resp.iter_lines()
                    while (line := b.next_line_sync(lines, silence, deadline)) is not None:
                        if line and (item := decode(line.encode())) is not None:
                            yield item
                return
            except (httpx.HTTPError, OSError) as exc:
                if (err := route.failed(exc, again=not opened)) is not None:
                    raise err from exc

    def _events(self, call: b.Call, decode: Callable[[bytes], T | None]) -> EventStream[T]:
        return EventStream(self._stream(call, decode))

    def _streamed_result(self, call: b.Call) -> ExecResult:
        """Run a command through its streaming endpoint and return its result (the `exit` event's)."""
        result: ExecResult | None = None
        with self._events(call, b.exec_event) as events:
            for event in events:
                if event.type == "exit":
                    result = b.exit_result(event)
        if result is None:
            raise b.no_exit()
        return result

    def _retrying(
        self,
        make: Callable[[str, float], b.Call],
        model: type[M],
        attempts: b.CreateAttempts,
        deadline: b.Deadline,
        refusals: bool,
    ) -> M:
        """Send `make(key, attempt_timeout)` until an answer settles it: a lost answer (timeout, broken
        connection) is retried with the same idempotency key, a full node's refusal too when
        `refusals`, each while the deadline leaves room; then the last error is raised."""
        while True:
            try:
                call = b.retried(make(attempts.key, deadline.attempt_timeout(self.timeout)), attempts.retried)
                return self._model(model, call)
            except SandboxError as exc:
                reason = attempts.retry_reason(exc)
                if reason is None or (reason == "refused" and not refusals) or not deadline.allows(reason == "refused"):
                    final = attempts.final(exc)
                    if final is exc:
                        raise
                    raise final from exc
                time.sleep(deadline.backoff(reason == "refused"))

    def _idempotent(self, model: type[M], call: b.Call, retry_for: float) -> M:
        """Send a call that is safe to repeat (a trajectory's open, step, verify, close) until it is
        answered: a lost answer, a daemon restarting or a full node is retried with backoff for up to
        `retry_for` seconds; then the last error is raised."""
        deadline = b.Deadline(retry_for)
        while True:
            try:
                return self._model(model, call)
            except SandboxError as exc:
                if not exc.retryable or not deadline.allows(refused=False):
                    raise
            time.sleep(deadline.backoff())

    # -- node

    def health(self) -> dict[str, Any]:
        import json

        result: dict[str, Any] = json.loads(self._send(b.Call("GET", "/v1/health")))
        return result

    def node_load(self) -> NodeLoad:
        """What cluster placement and quotas read of the node: its load, per-project usage, drain state."""
        return NodeLoad.model_validate_json(self._send(b.Call("GET", "/v1/node/load")))

    def drain(self, draining: bool = True) -> NodeLoad:
        """Take no new creates on this node (False: take them again); what it holds keeps running."""
        body = DrainRequest(draining=draining).model_dump()
        return NodeLoad.model_validate_json(self._send(b.Call("POST", "/v1/node/drain", json=body)))

    def fence(self, generation: int, *, timeout: float = 600.0) -> NodeLoad:
        """Cluster mode (`sandfleet cluster up` calls it): serve under `generation`; one above the
        node's own first stops every sandbox the node holds (the cluster declared the node lost)."""
        body = b.validated(FenceRequest, "fence request", {"generation": generation}).model_dump()
        call = b.Call("POST", "/v1/node/fence", json=body, timeout=b.check_timeout(timeout, 0))
        return NodeLoad.model_validate_json(self._send(call))

    def tiers(self) -> dict[str, builtins.list[str]]:
        """The isolation tiers the node runs, each with its capabilities (`pause`, `snapshot`, ...)."""
        tiers: dict[str, builtins.list[str]] = (self.health()).get("tiers", {})
        return tiers

    def run_code(
        self,
        code: str,
        *,
        language: Literal["python", "bash"] = "python",
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        output_limit: int | None = None,
        binary: bool = False,
        image: str | None = None,
        resources: Resources | None = None,
    ) -> ExecResult:
        """Run `code` as one stateless call on a pooled worker of the fncall tier: a fresh process
        forked from a warm interpreter (`image`, default the node's python image; `resources`: each
        worker's limits), in a scratch directory of its own holding `files` (relative paths), as an
        unprivileged user, with no network. Nothing it writes, leaves running or changes in memory
        is seen by the next call. Returns the same `ExecResult` as `exec`."""
        body = b.run_code_body(
            code,
            b.CommandOptions(stdin=stdin, env=env, timeout=timeout, output_limit=output_limit, binary=binary),
            language=language,
            files=files,
            image=image,
            resources=resources,
        )
        return self._run_one(body)

    def _run_one(self, body: dict[str, Any]) -> ExecResult:
        return self._model(ExecResult, b.call_run_code(None, body, self.timeout))

    def images(self) -> builtins.list[ImageInfo]:
        """The node's images."""
        return (self._model(ImageList, b.Call("GET", "/v1/images"))).images

    def delete_image(self, ref: str) -> None:
        """Delete an image's manifest (its layers go at the next `gc_images` once nothing uses them)."""
        self._send(b.Call("DELETE", "/v1/images/" + quote(ref, safe="")))

    def gc_images(self, min_age: float = 600.0) -> GcResult:
        """Delete layer files no image, sandbox or snapshot uses (and older than `min_age` seconds)."""
        return self._model(GcResult, b.Call("POST", "/v1/images/gc", params={"min_age": min_age}))

    def build_image(self, ref: str, timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Build a built-in image (`busybox`, `debian:bookworm`, `python:3.11`); waits up to `timeout`
        seconds (default 30 minutes, whatever the client's timeout)."""
        call = b.Call("POST", "/v1/images/build", params={"ref": ref}, timeout=b.check_timeout(timeout, 0))
        return self._model(ImageInfo, call)

    def build_recipe(
        self,
        recipe: str | os.PathLike[str],
        *,
        base_dir: str | os.PathLike[str] | None = None,
        on_event: Callable[[BuildEvent], None] | None = None,
        timeout: float = b.BUILD_TIMEOUT,
    ) -> ImageInfo:
        """Build a recipe into the daemon's layer store: a path to a recipe file (its directory is
        where `copy` and `git` sources are read from, on the daemon's host), or its TOML text with
        `base_dir`. `on_event` gets each progress, step and output event as it comes; waits up to
        `timeout` seconds (default 30 minutes). Leaving early (an error in `on_event`) cancels it."""
        text, where = b.recipe_source(recipe, base_dir)
        body = RecipeBuildRequest(recipe=text, base_dir=where).model_dump(mode="json")
        call = b.Call("POST", "/v1/images/recipes", json=body, timeout=b.check_timeout(timeout, 0))
        image: ImageInfo | None = None
        with self._events(call, b.build_event) as events:
            for event in events:
                if event.type == "done":
                    image = event.image
                elif on_event is not None:
                    on_event(event)
        return b.built(image)

    def push_image(self, ref: str, timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Publish a local image to the daemon's shared store as on-demand layers (other nodes
        then use it without copying its file data); waits up to `timeout` seconds (default 30 minutes)."""
        call = b.Call("POST", "/v1/images/push", params={"ref": ref}, timeout=b.check_timeout(timeout, 0))
        return self._model(ImageInfo, call)

    def import_image(self, path: str, ref: str | None = None, timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Import a `docker save` tarball or an OCI image layout (a path on the daemon's host); waits up
        to `timeout` seconds (default 30 minutes)."""
        body = ImportRequest(path=path, ref=ref).model_dump(mode="json")
        call = b.Call("POST", "/v1/images/import", json=body, timeout=b.check_timeout(timeout, 0))
        return self._model(ImageInfo, call)

    # -- sandboxes

    def create(
        self,
        spec: SandboxSpec | None = None,
        *,
        timeout: float | None = None,
        idempotency_key: str | None = None,
        key_reused: bool = False,
        **fields: Any,
    ) -> Sandbox:
        """Create a sandbox from a spec or from SandboxSpec fields (`image=..., resources=...`).

        Waits for capacity: a full node's refusal (`ResourceExhaustedError`) is retried with backoff
        until `timeout` (default: the client's) runs out, then the last refusal is raised (each
        attempt waits at most the client's timeout, and only starts with `b.MIN_ATTEMPT` s left). Every
        attempt carries one Idempotency-Key (`idempotency_key`, or a fresh one), so an attempt whose
        answer was lost (timeout, broken connection, a daemon restart) is retried without ever making
        a second sandbox. An error raised while the outcome is unknown names the key: repeat the
        create with it to get the sandbox if it was made. `key_reused`: `idempotency_key` may have
        been used by another process (a trainer before its restart): in a cluster, the gateway asks
        every node which holds it before placing the create (one small request per node); without
        it, a first attempt is placed as new.
        """
        full = b.spec_from(spec, fields)
        attempts = b.CreateAttempts(b.idempotency_key(idempotency_key), reused=key_reused and bool(idempotency_key))
        deadline = b.Deadline(b.check_timeout(timeout, self.timeout))
        info = self._retrying(
            lambda key, t: b.call_create(full, key, t), SandboxInfo, attempts, deadline, refusals=True
        )
        return Sandbox(self, info)

    def create_many(
        self,
        specs: Sequence[SandboxSpec],
        *,
        concurrency: int = 16,
        batch_size: int = 64,
        timeout: float | None = None,
        retry_for: float | None = None,
        project: str | None = None,
    ) -> builtins.list[Sandbox | SandboxError]:
        """Create one sandbox per spec; one result per spec, in order: the sandbox or its SandboxError.
        `project`: the project of the specs that name none.

        Specs travel `batch_size` to a request (one round trip per batch, not per sandbox), two
        requests in flight, and the daemon runs `concurrency` creates of each batch at once. Each
        item succeeds or fails on its own. Everything is over within `timeout` (default: the client's).
        Refusals of a full node (`ResourceExhaustedError`) are retried with backoff for up to
        `retry_for` seconds (default: until the timeout). Each spec has its own idempotency key, sent
        again on its retries, so a batch whose answer was lost is retried without duplicates.
        """
        specs = b.in_project(specs, project)
        attempts = [b.CreateAttempts(b.new_idempotency_key()) for _ in specs]
        deadline = b.Deadline(b.check_timeout(timeout, self.timeout), retry_refusals_for=retry_for)
        results: dict[int, Sandbox | SandboxError] = {}
        pending = builtins.list(range(len(specs)))
        while pending:
            per_request = deadline.attempt_timeout(self.timeout)
            chunks = [pending[i : i + batch_size] for i in range(0, len(pending), batch_size)]
            calls = [
                functools.partial(
                    self._create_batch,
                    [(i, specs[i], attempts[i].key) for i in chunk],
                    concurrency,
                    per_request,
                    any(attempts[i].retried for i in chunk),
                )
                for chunk in chunks
            ]
            pending = []
            only_refused = True
            for chunk_results in b.gather_bounded_sync(2, calls):
                for index, outcome in chunk_results:
                    if isinstance(outcome, SandboxError):
                        reason = attempts[index].retry_reason(outcome)
                        if reason is not None and deadline.allows(reason == "refused"):
                            pending.append(index)
                            only_refused = only_refused and reason == "refused"
                            continue
                        outcome = attempts[index].final(outcome)
                    results[index] = outcome
            if pending:
                time.sleep(deadline.backoff(only_refused))
        return [results[i] for i in range(len(specs))]

    def _create_batch(
        self, chunk: Sequence[tuple[int, SandboxSpec, str]], concurrency: int, timeout: float, retried: bool = False
    ) -> builtins.list[tuple[int, Sandbox | SandboxError]]:
        call = b.call_create_batch([spec for _, spec, _ in chunk], [key for *_, key in chunk], concurrency, timeout)
        call = b.retried(call, retried)
        try:
            reply = self._model(CreateBatchResult, call)
        except SandboxError as exc:
            return [(index, exc) for index, _, _ in chunk]
        return [
            (index, Sandbox(self, item.sandbox) if item.sandbox else b.item_error(item))
            for (index, _, _), item in zip(chunk, reply.results, strict=True)
        ]

    def get(self, sandbox_id: str) -> Sandbox:
        """Attach to an existing sandbox by id (e.g. from another process, after a trainer restart)."""
        return Sandbox(self, self._model(SandboxInfo, b.Call("GET", b.sandbox_path(sandbox_id))))

    def list(
        self, labels: Mapping[str, str] | None = None, state: str | None = None, *, project: str | None = None
    ) -> list[SandboxInfo]:
        """Sandboxes carrying all of `labels` (and in `project` or under it), in `state`: creating,
        running, paused, stopping, stopped, failed, `live` (the first four) or `all`; None (the
        default) lists live ones only."""
        return (self._model(SandboxList, b.call_list(b.selector(labels, project), state))).sandboxes

    def jobs(
        self,
        key: str = "job",
        labels: Mapping[str, str] | None = None,
        state: str | None = None,
        *,
        project: str | None = None,
    ) -> JobList:
        """Sandboxes (live ones by default; `state` as in `list`) grouped by the value of label `key`
        (a job, a team, ...), counted by state: `fleet.jobs().jobs[0].states` -> {"running": 98, ...}."""
        return self._model(JobList, b.call_jobs(key, b.selector(labels, project), state))

    def stop_many(
        self, labels: Mapping[str, str] | None = None, reason: str = "user", *, project: str | None = None
    ) -> builtins.list[str]:
        """Stop every live sandbox with these labels (and in `project` or under it); the ids stopped."""
        selected = b.selector(labels, project)
        call = b.Call("POST", "/v1/sandboxes/stop", json={"labels": selected, "reason": reason})
        return (self._model(StopManyResult, call)).stopped

    def pause_many(
        self, labels: Mapping[str, str] | None = None, *, project: str | None = None, timeout: float | None = None
    ) -> builtins.list[str]:
        """Pause every running sandbox with these labels (and in `project` or under it: a preempted
        trainer's whole job); the ids paused. Waits up to `timeout` seconds (default: the client's)."""
        call = b.call_labels("pause", b.selector(labels, project), b.check_timeout(timeout, self.timeout))
        return (self._model(IdList, call)).sandboxes

    def resume_many(
        self, labels: Mapping[str, str] | None = None, *, project: str | None = None, timeout: float | None = None
    ) -> builtins.list[str]:
        """Resume every paused sandbox with these labels (and in `project`); the ids resumed (`timeout`
        as `pause_many`)."""
        call = b.call_labels("resume", b.selector(labels, project), b.check_timeout(timeout, self.timeout))
        return (self._model(IdList, call)).sandboxes

    def set_network(
        self,
        labels: Mapping[str, str],
        network: NetworkPolicy | str | Sequence[str] | Mapping[str, bool],
        *,
        timeout: float | None = None,
    ) -> builtins.list[str]:
        """Give every running or paused sandbox with these labels the egress policy `network` (a
        job's next stage: open for setup, closed while the agent works); the ids changed."""
        call = b.call_set_network_many(labels, b.network_policy(network), b.check_timeout(timeout, self.timeout))
        return (self._model(IdList, call)).sandboxes

    def audit(
        self,
        *,
        since: int = 0,
        since_time: float | None = None,
        kinds: Sequence[str] | None = None,
        sandbox_id: str | None = None,
        limit: int = 1000,
        newest: bool = False,
    ) -> AuditList:
        """The node's audit records after seq `since` (API calls, connections allowed and refused,
        limits hit, detector findings), oldest first; `last_seq` is where to go on from. `newest`:
        the last `limit` of them (still oldest first) instead of the first."""
        query = b.audit_query(since, since_time, kinds, sandbox_id, limit, newest)
        return self._model(AuditList, b.call_audit(query, follow=False))

    def follow_audit(
        self,
        *,
        since: int = 0,
        since_time: float | None = None,
        kinds: Sequence[str] | None = None,
        sandbox_id: str | None = None,
    ) -> EventStream[AuditRecord]:
        """The records `audit()` gives, then each new one as it is recorded, until closed."""
        query = b.audit_query(since, since_time, kinds, sandbox_id, 1000)
        return self._events(b.call_audit(query, follow=True), b.audit_record)

    def set_lifetimes(
        self,
        labels: Mapping[str, str],
        *,
        idle_ttl: float | None | Unset = UNSET,
        max_lifetime: float | None | Unset = UNSET,
    ) -> builtins.list[str]:
        """Change the idle TTL and/or max lifetime (seconds after creation) of every live sandbox with
        these labels; only the limits given change, None removes one. The ids changed."""
        return (self._model(IdList, b.call_set_lifetimes(labels, idle_ttl, max_lifetime))).sandboxes

    def trajectory(
        self,
        trajectory_id: str,
        spec: SandboxSpec | None = None,
        *,
        snapshot_id: str | None = None,
        sandbox_id: str | None = None,
        seed: int | None = None,
        labels: Mapping[str, str] | None = None,
        metadata: Mapping[str, str] | None = None,
        retry_for: float = b.STEP_RETRY,
    ) -> Trajectory:
        """Open the trajectory of rollout `trajectory_id`, or open it again after a restart (the same
        arguments give back the same trajectory and sandbox). Its sandbox is made from `spec`,
        restored from `snapshot_id` (a set-up state many rollouts share), or is `sandbox_id`.
        `seed` reaches every command as SANDFLEET_SEED and is recorded. Calls on it are retried
        through lost answers and daemon restarts for `retry_for` seconds: each step runs once."""
        fields: dict[str, Any] = {
            "id": trajectory_id,
            "spec": spec,
            "snapshot_id": snapshot_id,
            "sandbox_id": sandbox_id,
        }
        fields |= {"seed": seed, "labels": dict(labels or {}), "metadata": dict(metadata or {})}
        req = b.validated(TrajectoryOpen, "trajectory", fields)
        body = req.model_dump(mode="json", exclude_defaults=True)
        info = self._idempotent(TrajectoryInfo, b.Call("POST", "/v1/trajectories", json=body), retry_for)
        return self._trajectory(info, retry_for)

    def get_trajectory(self, trajectory_id: str, *, retry_for: float = b.STEP_RETRY) -> Trajectory:
        """Attach to an open or closed trajectory by id alone; its steps replay from 0 as after `trajectory`."""
        info = self._model(TrajectoryInfo, b.Call("GET", b.trajectory_path(trajectory_id)))
        return self._trajectory(info, retry_for)

    def _trajectory(self, info: TrajectoryInfo, retry_for: float) -> Trajectory:
        sandbox = None
        if info.sandbox_id is not None:
            try:
                sandbox = self.get(info.sandbox_id)
            except SandboxNotFoundError:
                pass  # gone since (stopped, its retention over): the log still answers its steps
        return Trajectory(self, info, sandbox, retry_for)

    def trajectories(
        self, labels: Mapping[str, str] | None = None, state: Literal["open", "closed"] | None = None
    ) -> builtins.list[TrajectoryInfo]:
        call = b.call_list(labels, state)
        reply = self._model(TrajectoryList, b.Call("GET", "/v1/trajectories", params=call.params))
        return reply.trajectories

    def restore(
        self,
        snapshot_id: str,
        count: int = 1,
        labels: Mapping[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> builtins.list[Sandbox | SandboxError]:
        """`count` new sandboxes from a snapshot (processes, memory, files); one result per child, in
        order. Works after the snapshot's sandbox stopped. A lost answer is retried with the same
        idempotency key (given, or a fresh one) within `timeout` (default: the client's)."""
        attempts = b.CreateAttempts(b.idempotency_key(idempotency_key))
        deadline = b.Deadline(b.check_timeout(timeout, self.timeout))
        reply = self._retrying(
            lambda key, t: b.call_restore(snapshot_id, count, labels, key, t),
            CreateBatchResult,
            attempts,
            deadline,
            refusals=False,
        )
        return self._batch(reply)

    def snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        """The node's snapshots (of one sandbox, live or stopped, when `sandbox_id` is given)."""
        return (self._model(SnapshotList, b.call_snapshots(sandbox_id))).snapshots

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._send(b.Call("DELETE", b.snapshot_path(snapshot_id)))

    def _batch(self, reply: CreateBatchResult) -> builtins.list[Sandbox | SandboxError]:
        return [Sandbox(self, item.sandbox) if item.sandbox else b.item_error(item) for item in reply.results]


class EventStream(Generic[T]):
    """A stream of the daemon's (a command's output, a directory's changes): an `Iterator` of
    its events, heartbeats swallowed. It opens at `with` (or the first iteration) and closes
    when the `with` is left, on `close()`, at its end or on an error; closing it ends what
    it was for on the daemon (a streamed command is killed, a watch removed)."""

    def __init__(self, items: Generator[T | None, None]) -> None:
        self._items = items  # None first, once the daemon answered; then the events
        self._opened = False

    def open(self) -> EventStream[T]:
        """Send the request and wait for the daemon's answer (a watch is in place once this returns)."""
        if not self._opened:
            self._opened = True
            next(self._items, None)
        return self

    def __iter__(self) -> EventStream[T]:
        return self

    def __next__(self) -> T:
        self.open()
        while (item := next(self._items)) is None:
            pass
        return item

    def close(self) -> None:
        self._items.close()

    def __enter__(self) -> EventStream[T]:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sandbox:
    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._c = client
        self.info = info
        self.id = info.id
        self.files = Files(self)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop()
        except SandboxError:
            if et is None:
                raise

    def refresh(self) -> SandboxInfo:
        self.info = self._c._model(SandboxInfo, b.Call("GET", b.sandbox_path(self.id)))
        return self.info

    def usage(self) -> Usage:
        """Current and peak memory, CPU seconds, tasks and limit hits (does not resume a paused sandbox)."""
        return self._c._model(Usage, b.Call("GET", b.sandbox_path(self.id) + "/usage"))

    def pause(self) -> SandboxInfo:
        """Freeze the sandbox and push its memory out; any later request resumes it transparently."""
        self.info = self._c._model(SandboxInfo, b.Call("POST", b.sandbox_path(self.id) + "/pause"))
        return self.info

    def resume(self) -> SandboxInfo:
        self.info = self._c._model(SandboxInfo, b.Call("POST", b.sandbox_path(self.id) + "/resume"))
        return self.info

    def set_network(self, network: NetworkPolicy | str | Sequence[str] | Mapping[str, bool]) -> SandboxInfo:
        """Make `network` the sandbox's egress policy, at once: "none", or the services and
        host[:port] patterns it may reach (`["pypi"]`, `{"pypi": True}`); connections the new policy
        does not allow are closed."""
        self.info = self._c._model(SandboxInfo, b.call_set_network(self.id, b.network_policy(network)))
        return self.info

    def expose(self, port: int) -> ExposedPort:
        """Reach a server listening on 127.0.0.1:`port` inside the sandbox: over HTTP at `url` (the
        daemon's API, its token required), or as a byte stream at `socket` (a unix socket on the
        node, root's). Closed with the sandbox, or by `unexpose`."""
        return b.exposed(self._c._http.base_url, self._c._model(ExposedPort, b.call_expose(self.id, port)))

    def unexpose(self, port: int) -> None:
        self._c._send(b.Call("DELETE", b.sandbox_path(self.id) + f"/ports/{int(port)}"))

    def ports(self) -> builtins.list[ExposedPort]:
        """The ports this sandbox exposes."""
        found = self._c._model(ExposedPortList, b.Call("GET", b.sandbox_path(self.id) + "/ports"))
        return [b.exposed(self._c._http.base_url, p) for p in found.ports]

    def set_lifetime(
        self, *, idle_ttl: float | None | Unset = UNSET, max_lifetime: float | None | Unset = UNSET
    ) -> SandboxInfo:
        """Change this sandbox's idle TTL and/or max lifetime (seconds after creation, not after this
        call). Only the limits given change; None removes that limit."""
        self.info = self._c._model(SandboxInfo, b.call_set_lifetime(self.id, idle_ttl, max_lifetime))
        return self.info

    def snapshot(
        self, *, ttl: float | None = None, labels: Mapping[str, str] | None = None, timeout: float | None = None
    ) -> SnapshotInfo:
        """Checkpoint processes, memory and files; the sandbox keeps running (a paused one stays paused).
        The snapshot outlives the sandbox: kept `ttl` seconds (default: the node's retention) or until
        deleted; `labels` are its own. Waits up to `timeout` seconds (default: the client's)."""
        call = b.call_snapshot(self.id, ttl, labels, b.check_timeout(timeout, self._c.timeout))
        return self._c._model(SnapshotInfo, call)

    def pack(self, image: str, *, exclude: Sequence[str] = (), timeout: float = b.BUILD_TIMEOUT) -> ImageInfo:
        """Save this sandbox's changes as image `name:tag` (its layers + one new layer); `exclude`d paths
        keep their base content. Create sandboxes from it with `fleet.create(image=...)`. A build:
        waits up to `timeout` seconds (default 30 minutes, whatever the client's timeout)."""
        return self._c._model(ImageInfo, b.call_pack(self.id, image, exclude, b.check_timeout(timeout, 0)))

    def fork(
        self,
        count: int = 1,
        labels: Mapping[str, str] | None = None,
        *,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> builtins.list[Sandbox | SandboxError]:
        """`count` copies of this sandbox as it is now, each isolated from it and from each other (with
        its sessions and background processes, under the same ids). A lost answer is retried with
        the same idempotency key (given, or a fresh one) within `timeout` (default: the client's)."""
        attempts = b.CreateAttempts(b.idempotency_key(idempotency_key))
        deadline = b.Deadline(b.check_timeout(timeout, self._c.timeout))
        reply = self._c._retrying(
            lambda key, t: b.call_fork(self.id, count, labels, key, t),
            CreateBatchResult,
            attempts,
            deadline,
            refusals=False,
        )
        return self._c._batch(reply)

    def verify(self, command: str | builtins.list[str] | VerifyRequest, **options: Any) -> VerifyResult:
        """Run a task's checks in a fresh sandbox: this one's pre-agent state (its image and layers),
        plus what was changed in it, plus verifier-only `layers` (hidden tests) that this sandbox
        never sees; changes under `protect` paths are dropped first. Options: VerifyRequest's fields.
        The result says whether they passed, the reward, whose fault a failure was, what changed."""
        req = b.verify_request(command, options)
        call = b.Call(
            "POST",
            b.sandbox_path(self.id) + "/verify",
            json=req.model_dump(mode="json", exclude_defaults=True),
            timeout=b.verify_timeout(req),
        )
        return self._c._model(VerifyResult, call)

    def stop(self, reason: str = "user") -> SandboxInfo:
        """Stop the sandbox; stopping one that is already gone (TTL, stop_many) is not an error."""
        try:
            self.info = self._c._model(SandboxInfo, b.Call("DELETE", b.sandbox_path(self.id), json={"reason": reason}))
        except SandboxNotFoundError:
            self.info = self.info.model_copy(update={"state": "stopped"})
        return self.info

    def exec(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        pty: bool | TerminalSize = False,
        cpu_time: float | None = None,
    ) -> ExecResult:
        """Run a command to completion. A string runs under /bin/sh -c; a list is an argv.

        `cwd` may be relative (to the sandbox's working directory). `stdin` is text, or bytes.
        `merge_stderr` sends standard error into stdout (one stream, in order). `binary` returns
        output as base64 of the raw bytes: read `result.stdout_bytes` / `stderr_bytes`. `pty` (True,
        or a `TerminalSize`; default 24x80) runs it on a new pseudo-terminal: one output stream
        (`stdout`, with the terminal's CR LF line ends), `stdin` typed into it, TERM=xterm-256color.
        `timeout` (seconds, None: none) kills the command's process tree. A command whose timeout is
        None or longer than the client's is streamed, so a daemon that stops answering raises
        `SandboxTimeoutError` after the client's timeout of silence rather than hanging. `cpu_time`
        (CPU seconds) kills it once it has used that much CPU, however long a busy node made it wait.
        """
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                pty=pty,
                cpu_time=cpu_time,
            ),
        )
        if b.one_response(timeout, self._c.timeout):
            return self._c._model(ExecResult, b.call_exec(self.id, body, self._c.timeout))
        return self._c._streamed_result(b.call_exec(self.id, body, self._c.timeout, stream=True))

    def run_code(
        self,
        code: str,
        *,
        language: Literal["python", "bash"] = "python",
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        output_limit: int | None = None,
        binary: bool = False,
    ) -> ExecResult:
        """A stateless call on this worker (a sandbox of the fncall tier): like `Client.run_code`,
        against the state this worker was set up with (its files and installed packages, read-only
        to the call)."""
        body = b.run_code_body(
            code,
            b.CommandOptions(stdin=stdin, env=env, timeout=timeout, output_limit=output_limit, binary=binary),
            language=language,
            files=files,
        )
        return self._c._model(ExecResult, b.call_run_code(self.id, body, self._c.timeout))

    def exec_stream(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        pty: bool | TerminalSize = False,
    ) -> EventStream[ExecEvent]:
        """Stream the command's stdout/stderr chunks as they arrive, then one `exit` event with the
        result (options as `exec`; with `binary`, each chunk's `data` is base64): `for ev in
        sb.exec_stream(cmd)`. The command starts at the first iteration (or `with`); heartbeats
        are swallowed; a daemon silent for the client's timeout raises `SandboxTimeoutError`. Leaving
        early (`with`, `close()`) closes the stream and the daemon kills the command."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                pty=pty,
            ),
        )
        return self._c._events(b.call_exec(self.id, body, self._c.timeout, stream=True), b.exec_event)

    def terminal(
        self,
        command: str | builtins.list[str] | None = None,
        *,
        rows: int = 24,
        cols: int = 80,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
    ) -> Terminal:
        """An interactive terminal: `command` (default: the user's login shell) on a new
        pseudo-terminal of `rows` x `cols`, over a WebSocket. `with sb.terminal() as t:
        t.send("ls\\r"); print(t.expect(b"$ "))`. Keystrokes are bytes as a keyboard sends
        them ("\\x03" is Ctrl-C: the foreground job gets SIGINT); `resize()` changes the window
        (SIGWINCH). `timeout` (seconds; None: while connected) kills it as in `exec`; `output_limit`
        (bytes forwarded in all) is none by default: output not read holds the command back, as a
        terminal does. Closing the terminal kills what still runs on it."""
        options = b.CommandOptions(env=env, cwd=cwd, user=user, timeout=timeout, output_limit=output_limit)
        start = b.terminal_start(command, options, rows=rows, cols=cols)
        term = Terminal(self)
        term._open(start)
        return term

    def start(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        timeout: float | None = None,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        cpu_time: float | None = None,
    ) -> Process:
        """Start a background process (its own session); returns a handle to wait on, kill or feed.
        `stdin` is written first; with `keep_stdin_open` its standard input then stays open for
        `process.write_stdin(...)` until `process.close_stdin()`. `timeout` and `cpu_time` as in exec."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                cpu_time=cpu_time,
            ),
        )
        return Process(self, self._c._model(ProcessInfo, b.call_start(self.id, body)))

    def processes(self) -> builtins.list[ProcessInfo]:
        """The sandbox's background processes (running and finished)."""
        return (self._c._model(ProcessList, b.Call("GET", b.sandbox_path(self.id) + "/processes"))).processes

    def session(
        self,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        pty: bool | TerminalSize = False,
    ) -> Session:
        """Open a persistent shell: commands share cwd, environment and shell variables. With `pty`
        (True, or a `TerminalSize`) the shell runs on a pseudo-terminal: each command's output is one
        stream (`stdout`, CRLF line ends), its stdin is the terminal (`write_stdin` types into it:
        "\\x03" is ^C) and programs see a terminal (pagers, REPLs); `run` still returns each command's
        own output and exit code."""
        info = self._c._model(
            SessionInfo, b.call_session_create(self.id, b.CommandOptions(env=env, cwd=cwd, user=user, pty=pty))
        )
        return Session(self, info)

    def sessions(self) -> builtins.list[SessionInfo]:
        """The sandbox's open sessions (a fork or restore child has its parent's, under the same ids)."""
        return (self._c._model(SessionList, b.Call("GET", b.sandbox_path(self.id) + "/sessions"))).sessions

    def attach_session(self, session_id: str) -> Session:
        """A handle on an existing session (opened by another process, or inherited by a fork child)."""
        info = self._c._model(SessionInfo, b.Call("GET", b.session_path(self.id, session_id)))
        return Session(self, info)

    def events(self, after: int = 0) -> builtins.list[SandboxEvent]:
        """The sandbox's event log after sequence number `after`."""
        call = b.Call("GET", b.sandbox_path(self.id) + "/events", params={"after": after})
        return (self._c._model(EventList, call)).events


class Process:
    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self._sb = sandbox
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"<Process {self.id} in {self._sb.id}>"

    def wait(self, timeout: float = 60.0) -> ProcessInfo:
        """Wait up to `timeout` seconds for the process to exit: its info, with `result` once it has
        (`running` stays True if it is still running then). Raises `WrongStateError` if its sandbox
        stopped before it finished."""
        self.info = b.finished(self._sb._c._model(ProcessInfo, b.call_wait(self._sb.id, self.id, timeout)))
        return self.info

    def kill(self, signal: int = 9) -> ProcessInfo:
        """Send `signal` to the process's tree; its state once the signal took effect."""
        self.info = self._sb._c._model(ProcessInfo, b.call_kill(self._sb.id, self.id, signal))
        return self.info

    def write_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        """Write to the process's standard input (started with `keep_stdin_open=True`); `close`
        then closes it."""
        self._sb._c._model(Ok, b.call_stdin(b.process_path(self._sb.id, self.id), b.as_bytes(data), close))

    def close_stdin(self) -> None:
        """Close the process's standard input (it reads end-of-file)."""
        self.write_stdin(b"", close=True)


class Session:
    def __init__(self, sandbox: Sandbox, info: SessionInfo) -> None:
        self._sb = sandbox
        self.info = info
        self.id = info.id

    def __repr__(self) -> str:
        return f"<Session {self.id} in {self._sb.id}>"

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def refresh(self) -> SessionInfo:
        """The session's current info (`busy` while a command runs in it)."""
        self.info = self._sb._c._model(SessionInfo, b.Call("GET", b.session_path(self._sb.id, self.id)))
        return self.info

    def run(
        self,
        command: str,
        *,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        merge_stderr: bool = False,
        binary: bool = False,
    ) -> ExecResult:
        """Run a command in the session's shell (its cwd, environment and variables carry over).

        `stdin` (text or bytes) is fed to the command; with `keep_stdin_open` its standard input stays
        open for `session.write_stdin(...)` until `session.close_stdin()`. `merge_stderr` and `binary`
        as `exec`. A timed-out command is killed, the shell lives on. A command whose timeout is None
        or longer than the client's is streamed (heartbeats prove the daemon alive), so a daemon that
        stops answering raises `SandboxTimeoutError` after the client's timeout of silence.
        """
        body = b.session_run_body(
            command,
            b.CommandOptions(
                timeout=timeout,
                output_limit=output_limit,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                merge_stderr=merge_stderr,
                binary=binary,
            ),
        )
        c = self._sb._c
        if b.one_response(timeout, c.timeout):
            return c._model(ExecResult, b.call_session_run(self._sb.id, self.id, body, c.timeout))
        return c._streamed_result(b.call_session_run(self._sb.id, self.id, body, c.timeout, stream=True))

    def run_stream(
        self,
        command: str,
        *,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        stdin: str | bytes | None = None,
        keep_stdin_open: bool = False,
        merge_stderr: bool = False,
        binary: bool = False,
    ) -> EventStream[ExecEvent]:
        """`run`, streaming stdout/stderr chunks as they arrive, then one `exit` event with the result
        (heartbeats swallowed; see `exec_stream`)."""
        body = b.session_run_body(
            command,
            b.CommandOptions(
                timeout=timeout,
                output_limit=output_limit,
                stdin=stdin,
                keep_stdin_open=keep_stdin_open,
                merge_stderr=merge_stderr,
                binary=binary,
            ),
        )
        c = self._sb._c
        return c._events(b.call_session_run(self._sb.id, self.id, body, c.timeout, stream=True), b.exec_event)

    def write_stdin(self, data: bytes | str, *, close: bool = False) -> None:
        """Write to the standard input of the command running in the session (started with `stdin`
        or `keep_stdin_open`); `close` then closes it."""
        call = b.call_stdin(b.session_path(self._sb.id, self.id), b.as_bytes(data), close)
        self._sb._c._model(Ok, call)

    def close_stdin(self) -> None:
        """Close the running command's standard input (it reads end-of-file)."""
        self.write_stdin(b"", close=True)

    def close(self) -> None:
        self._sb._c._send(b.Call("DELETE", b.session_path(self._sb.id, self.id)))


class Files:
    """File operations inside the sandbox; paths are absolute, or relative to the sandbox's working
    directory."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        return self._sb._c._send(b.call_read(self._sb.id, path, offset, length))

    def read_text(self, path: str) -> str:
        return (self.read(path)).decode()

    def write(
        self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | None = None, append: bool = False
    ) -> FileInfo:
        call = b.call_write(self._sb.id, path, b.as_bytes(data), mode, user, append)
        return self._sb._c._model(FileInfo, call)

    def list(self, path: str = "/") -> builtins.list[FileInfo]:
        """The entries of directory `path`."""
        return (self._sb._c._model(FileList, b.call_list_files(self._sb.id, path))).files

    def stat(self, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        return self._sb._c._model(FileInfo, b.call_stat(self._sb.id, path, follow_symlinks))

    def exists(self, path: str) -> bool:
        from sandfleet.errors import NotFoundError

        try:
            self.stat(path)
        except NotFoundError:
            return False
        return True

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755, user: str | None = None) -> FileInfo:
        return self._sb._c._model(FileInfo, b.call_mkdir(self._sb.id, path, parents, mode, user))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sb._c._send(b.call_remove(self._sb.id, path, recursive))

    def upload(self, local: str | os.PathLike[str], path: str, *, user: str | None = None) -> None:
        """Copy a local file or directory's contents into the sandbox directory `path` (as a tar)."""
        data = b.local_tar(Path(local))
        self._sb._c._send(b.call_upload(self._sb.id, path, data, user))

    def download(self, path: str, local: str | os.PathLike[str]) -> None:
        """Copy a sandbox file or directory into the local directory `local`."""
        data = self.download_tar(path)
        b.extract_tar(data, Path(local))

    def download_tar(self, path: str) -> bytes:
        return self._sb._c._send(b.call_download(self._sb.id, path))

    def watch(self, path: str = ".", *, recursive: bool = True) -> EventStream[FileEvent]:
        """Changes under directory `path` as they happen: create, modify, delete, rename_from /
        rename_to, chmod, and `overflow` when the kernel dropped events (re-scan then). The watch is
        in place once `with sb.files.watch(path) as changes:` is entered (or at the first
        iteration), and lasts until it is left (or `close()`), which closes the stream. Heartbeats
        are swallowed; a daemon silent for the client's timeout raises `SandboxTimeoutError`."""
        return self._sb._c._events(b.call_watch(self._sb.id, path, recursive), b.file_event)


class Trajectory:
    """A rollout driven step by step, each step taken exactly once (`fleet.trajectory(...)`).

    Steps are numbered from 0 in the order this object takes them; a trainer restarted after a
    preemption opens the trajectory again and replays its rollout from the start: the steps the
    node already logged come back at once (`StepResult.replayed`), without running again, and the
    first new one runs. `sandbox` is the sandbox itself (calls on it directly are not logged)."""

    def __init__(
        self,
        client: Client,
        info: TrajectoryInfo,
        sandbox: Sandbox | None = None,
        retry_for: float = b.STEP_RETRY,
    ) -> None:
        self._c = client
        self.info = info
        self.id = info.id
        self.sandbox = sandbox
        self.retry_for = retry_for
        self.next_step = 0
        self.last: StepResult | None = None

    def __repr__(self) -> str:
        return f"<Trajectory {self.id} step={self.next_step}>"

    def __enter__(self) -> Trajectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(
        self, action: ExecAction | WriteAction | ReadAction | SnapshotAction, *, step: int | None = None
    ) -> StepResult:
        """Take the next step (or step `step`); its result, errors included (`StepResult.error`)."""
        timeout: float | Literal["default"] = "default"
        if isinstance(action, ExecAction):
            timeout = b.step_timeout(action.exec.timeout, self._c.timeout)
        return self._step(action.model_dump(mode="json"), timeout, step)

    def _step(self, action: dict[str, Any], timeout: float | Literal["default"], step: int | None) -> StepResult:
        """Send a step whose action is already validated (as JSON: the hot path builds no more models)."""
        k = self.next_step if step is None else step
        body = {"step": k, "action": action}
        call = b.Call("POST", b.trajectory_path(self.id, "/steps"), json=body, timeout=timeout)
        result = self._c._idempotent(StepResult, call, self.retry_for)
        self.last = result
        self.next_step = k + 1
        return result

    def _checked(self, action: WriteAction | ReadAction | SnapshotAction) -> StepResult:
        result = self.step(action)
        error = b.step_error(result)
        if error is not None:
            raise error
        return result

    def exec(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
        merge_stderr: bool = False,
        binary: bool = False,
        cpu_time: float | None = None,
    ) -> ExecResult:
        """Run a command as the next step (see `Sandbox.exec`); its result, recorded."""
        body = b.exec_body(
            command,
            b.CommandOptions(
                env=env,
                cwd=cwd,
                user=user,
                stdin=stdin,
                timeout=timeout,
                output_limit=output_limit,
                merge_stderr=merge_stderr,
                binary=binary,
                cpu_time=cpu_time,
            ),
        )
        result = self._step({"kind": "exec", "exec": body}, b.step_timeout(timeout, self._c.timeout), None)
        error = b.step_error(result)
        if error is not None:
            raise error
        assert result.exec is not None
        return result.exec

    def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> FileInfo:
        """Write a file as the next step."""
        raw = data.encode() if isinstance(data, str) else data
        content = base64.b64encode(raw).decode()
        action = b.validated(
            WriteAction, "write", {"path": path, "content": content, "encoding": "base64", "mode": mode}
        )
        result = self._checked(action)
        assert result.file is not None
        return result.file

    def read(self, path: str) -> bytes:
        """Read a file as the next step (its bytes, recorded)."""
        result = self._checked(b.validated(ReadAction, "read", {"path": path, "encoding": "base64"}))
        return base64.b64decode(result.content or "")

    def snapshot(self, *, ttl: float | None = None, labels: Mapping[str, str] | None = None) -> str:
        """Snapshot the sandbox as the next step; the snapshot's id (recorded: a replay gives the same)."""
        result = self._checked(b.validated(SnapshotAction, "snapshot", {"ttl": ttl, "labels": dict(labels or {})}))
        assert result.snapshot_id is not None
        return result.snapshot_id

    def verify(self, command: str | builtins.list[str] | VerifyRequest, **options: Any) -> VerifyResult:
        """Verify the rollout apart from its sandbox (see `Sandbox.verify`); recorded: asked again
        (a restarted trainer), the same verdict, not a second run."""
        req = b.verify_request(command, options)
        call = b.Call(
            "POST",
            b.trajectory_path(self.id, "/verify"),
            json=req.model_dump(mode="json", exclude_defaults=True),
            timeout=b.verify_timeout(req),
        )
        return self._c._idempotent(VerifyResult, call, self.retry_for)

    def close(self, reward: float | None = None, *, stop_sandbox: bool = True) -> TrajectoryInfo:
        """Record the end (and `reward`, default: the verification's); stops the sandbox unless told not to."""
        body = b.validated(TrajectoryClose, "close", {"reward": reward, "stop_sandbox": stop_sandbox}).model_dump()
        call = b.Call("POST", b.trajectory_path(self.id, "/close"), json=body)
        self.info = self._c._idempotent(TrajectoryInfo, call, self.retry_for)
        return self.info

    def refresh(self) -> TrajectoryInfo:
        self.info = self._c._model(TrajectoryInfo, b.Call("GET", b.trajectory_path(self.id)))
        return self.info

    def steps(self) -> builtins.list[StepResult]:
        """Every step logged so far, in order."""
        return (self._c._model(StepList, b.Call("GET", b.trajectory_path(self.id, "/steps")))).steps

    def record(self) -> ReproRecord:
        """What it takes to run this trajectory again: layers, spec, seed, snapshots, actions, versions."""
        return self._c._model(ReproRecord, b.Call("GET", b.trajectory_path(self.id, "/record")))

    def delete(self) -> None:
        """Forget the trajectory (its log), stopping its sandbox."""
        self._c._model(Ok, b.Call("DELETE", b.trajectory_path(self.id)))


class Terminal:
    """A command on a pseudo-terminal in a sandbox (`Sandbox.terminal`). Output is read with
    `read()` / `expect()`; `result` is set once the command exited (`wait()`)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.pid = -1
        self.result: ExecResult | None = None
        self._stack = contextlib.ExitStack()
        self._ws: WebSocketSession | None = None
        self._pending = bytearray()  # read but not yet returned by expect()

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, start: str) -> None:
        c = self.sandbox._c
        base = c._http.base_url
        try:
            ws: WebSocketSession = self._stack.enter_context(
                connect_ws(
                    b.terminal_path(self.sandbox.id),
                    c._http,
                    subprotocols=[b.TERMINAL_PROTOCOL],
                    max_message_size_bytes=b.TERMINAL_FRAME,
                    queue_size=64,  # frames read ahead; past them the daemon holds the command back
                    keepalive_ping_interval_seconds=None,
                )
            )
            self._ws = ws
            with contextlib.suppress(LocalProtocolError):  # refused at once: its error message is read next
                ws.send_text(start)
            first = self._next(b.TERMINAL_OPEN_TIMEOUT)
            if not isinstance(first, dict) or first.get("type") != "started":
                raise b.terminal_closed(None, "no `started` message")
            self.pid = int(first.get("pid", -1))
        except WebSocketUpgradeError as exc:
            self.close()
            b.raise_for(exc.response.status_code, exc.response.content, c.endpoint)
            raise b.terminal_closed(exc.response.status_code, "not upgraded") from exc
        except (httpx.HTTPError, OSError) as exc:
            self.close()
            b.fail_over(c._http, c.endpoint, base, exc, b.Call("GET", b.terminal_path(self.sandbox.id)))  # later calls
            raise b.map_transport_error(exc, c.endpoint) from exc
        except BaseException:
            self.close()
            raise

    def _next(self, timeout: float | None) -> bytes | dict[str, Any] | None:
        """The next frame: bytes of output, a message (dict), None after the exit or on timeout."""
        if self._ws is None:
            return None
        try:
            event = self._ws.receive(timeout)
        except (TimeoutError, queue.Empty):
            return None
        except WebSocketDisconnect as exc:
            self._ws = None
            if self.result is None:
                raise b.terminal_closed(exc.code, exc.reason) from None
            return None
        except WebSocketNetworkError as exc:
            self._ws = None
            raise b.map_transport_error(exc, self.sandbox._c.endpoint) from exc
        if isinstance(event, wsproto.events.BytesMessage):
            return bytes(event.data)
        if isinstance(event, wsproto.events.TextMessage):
            msg = b.terminal_message(event.data)
            if msg.get("type") == "exit":
                self.result = b.terminal_result(msg)
            return msg
        return self._next(timeout)

    def send(self, data: str | bytes) -> None:
        """Keystrokes: text (UTF-8) or bytes, as a terminal sends them ("\\r" is Enter)."""
        if self._ws is None:
            raise WrongStateError("the terminal is closed")
        raw = b.as_bytes(data)
        for off in range(0, len(raw), 32 * 1024):
            self._ws.send_bytes(raw[off : off + 32 * 1024])

    def resize(self, rows: int, cols: int) -> None:
        if self._ws is None:
            raise WrongStateError("the terminal is closed")
        self._ws.send_text(b.terminal_resize(rows, cols))

    def read(self, timeout: float | None = None) -> bytes:
        """Output that has arrived (waiting up to `timeout` for some; None: until some comes);
        b"" once the command exited, or when nothing came in time."""
        if self._pending:
            out = bytes(self._pending)
            self._pending.clear()
            return out
        while self._ws is not None:
            item = self._next(timeout)
            if item is None:
                return b""
            if isinstance(item, bytes):
                return item
            if self.result is not None:
                return b""
        return b""

    def expect(self, pattern: str | bytes | re.Pattern[bytes], timeout: float = 10.0) -> bytes:
        """Output up to and including the first match of `pattern` (a substring, or a compiled bytes
        regex matching at most 4 KiB); the rest stays for the next read. Of a flood before the match
        only the last MiB is kept. SandboxTimeoutError when it does not come in time."""
        regex = pattern if isinstance(pattern, re.Pattern) else re.compile(re.escape(b.as_bytes(pattern)))
        deadline = time.monotonic() + timeout
        seen = bytearray(self._pending)
        self._pending.clear()
        start = 0  # where a match may still begin: each chunk is searched once (with some overlap)
        while (m := regex.search(seen, start)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self._ws is None:
                self._pending[:] = seen
                raise SandboxTimeoutError(f"{regex.pattern!r} did not appear in {timeout}s: {bytes(seen[-300:])!r}")
            item = self._next(left)
            if isinstance(item, bytes):
                if len(seen) > b.EXPECT_KEEP:  # a flood before the match: keep its end only
                    del seen[: len(seen) - b.EXPECT_KEEP // 2]
                start = max(0, len(seen) - b.EXPECT_OVERLAP)
                seen += item
        self._pending[:] = seen[m.end() :]
        return bytes(seen[: m.end()])

    def wait(self, timeout: float | None = None) -> ExecResult:
        """Read (and drop) output until the command exits; its result."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.result is None:
            left = None if deadline is None else deadline - time.monotonic()
            if (left is not None and left <= 0) or self._ws is None:
                raise SandboxTimeoutError(f"the terminal's command did not exit within {timeout}s")
            self._next(left)
        return self.result

    def close(self) -> None:
        """Disconnect: the daemon kills what still runs on the terminal."""
        ws, self._ws = self._ws, None
        try:
            if ws is not None:
                with contextlib.suppress(Exception):
                    ws.close()
        finally:
            with contextlib.suppress(Exception):
                self._stack.close()
