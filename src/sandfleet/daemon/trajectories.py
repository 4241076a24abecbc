"""Trajectories: a rollout's steps, each taken exactly once, its result logged before it is answered.

A trainer drives a rollout through a trajectory keyed by its rollout id; step k is (id, k). Asked
for step k again (the trainer was preempted and replays its rollout from the start, from this
machine or another), the node answers the logged result and runs nothing; while step k runs, a
second ask waits for the first's result. The sandbox holds the state those steps made: it is
kept alive (paused while no trainer drives it: `pause_after`), and survives a daemon restart like
every sandbox (adopted). The log is one JSON-lines file per trajectory under
`<state_dir>/trajectories`, appended with one write(2) per record, so a record outlives any
process that dies after writing it; `fsync = true` also makes it outlive the machine (a machine
that dies takes the sandbox with it, so the default is not to pay for that).

What cannot be exactly once: a step the daemon was killed in the middle of. The command may have
run (the agent keeps running an orphaned command, but its output is gone), so it is never run
again: its result becomes a typed `unavailable` error with cause `infra`, which a trainer masks.
A daemon that is stopped (SIGTERM) waits `drain_timeout` for running steps first.

Verification (daemon/verify.py) of a trajectory is logged too: asked again, the recorded verdict.
The start of its checks is logged first, so one a daemon was killed in the middle of is answered
`infra` (never the verdict of a second run on a node that just lost the first), like a step; one
still waiting its turn in the verification queue had not started, and runs when asked again.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import contextlib
import errno
import hashlib
import json
import os
import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandfleet import __version__
from sandfleet.daemon.core import NodeCore, log, wire_text
from sandfleet.daemon.creation import Creation
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.execs import Execs
from sandfleet.daemon.files import Files
from sandfleet.daemon.lifecycle import HOLDING_STATES
from sandfleet.daemon.snapshots import Snapshots
from sandfleet.daemon.verify import Verifier, interrupted
from sandfleet.errors import (
    Cause,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    SandboxNotFoundError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.models import (
    TRAJECTORY_ID,
    ErrorBody,
    ExecAction,
    NodeVersions,
    ReadAction,
    ReproRecord,
    SandboxInfo,
    SnapshotAction,
    StepAction,
    StepRequest,
    StepResult,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryOpen,
    VerifyRequest,
    VerifyResult,
    WriteAction,
)
from sandfleet.runtime.agent import AGENT_VERSION

TRAJECTORY_LABEL = "sandfleet.trajectory"  # on a trajectory's sandbox: the trajectory's id
_ID = re.compile(TRAJECTORY_ID)


class TrajectoryConfig(BaseModel):
    """`[trajectories]` in the node's config."""

    model_config = ConfigDict(extra="forbid")
    fsync: bool = Field(False, description="fsync each record: the log outlives a power loss (costs a disk flush)")
    pause_after: float = Field(60.0, gt=0, description="a trajectory's sandbox is paused after this many idle seconds")
    retention: float = Field(
        7 * 86400.0, gt=0, description="a trajectory's log is kept this long after its last record"
    )
    drain_timeout: float = Field(30.0, ge=0, description="a stopping daemon waits this long for running steps")


def digest(dumped: str) -> str:
    """What identifies a step's action (or a verification's request): its JSON as dumped."""
    return hashlib.sha256(dumped.encode()).hexdigest()[:32]


@dataclass
class Trajectory:
    id: str
    opened: TrajectoryOpen
    created_at: float
    path: Path
    sandbox: SandboxInfo | None = None
    steps: list[StepResult] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # each step's action, as the JSON logged
    running: tuple[int, str, asyncio.Future[StepResult]] | None = None
    verification: VerifyResult | None = None
    verify_digest: str | None = None
    verifying: asyncio.Future[VerifyResult] | None = None
    verify_begun: str | None = None  # the digest of a verification begun (logged), verdict or not
    closed_at: float | None = None
    reward: float | None = None
    touched: float = 0.0
    fd: int | None = None  # the log, open for appending while the trajectory is loaded
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def info(self) -> TrajectoryInfo:
        failures: dict[str, int] = {}
        for s in self.steps:
            if s.cause is not None:
                failures[s.cause] = failures.get(s.cause, 0) + 1
        return TrajectoryInfo(
            id=self.id,
            sandbox_id=self.sandbox.id if self.sandbox else None,
            state="closed" if self.closed_at is not None else "open",
            steps=len(self.steps),
            seed=self.opened.seed,
            labels=self.opened.labels,
            metadata=self.opened.metadata,
            source_snapshot=self.opened.snapshot_id,
            created_at=self.created_at,
            closed_at=self.closed_at,
            reward=self.reward,
            verification=self.verification,
            failures=failures,
        )


def _fingerprint(req: TrajectoryOpen) -> str:
    return req.model_dump_json(exclude_defaults=True)


class Trajectories:
    def __init__(
        self,
        core: NodeCore,
        creation: Creation,
        execs: Execs,
        files: Files,
        snapshots: Snapshots,
        verifier: Verifier,
        root: Path,
        config: TrajectoryConfig | None = None,
    ) -> None:
        self.core = core
        self.creation = creation
        self.execs = execs
        self.files = files
        self.snapshots = snapshots
        self.verifier = verifier
        self.root = root
        self.config = config or TrajectoryConfig()
        self.loaded: dict[str, Trajectory] = {}
        self._opening: dict[str, list[Any]] = {}  # id -> [lock, how many open it now]

    # -- the log ---------------------------------------------------------------------------------

    def _path(self, tid: str) -> Path:
        if not _ID.match(tid):
            raise InvalidArgumentError(f"invalid trajectory id {tid[:80]!r}: 1-117 characters of [A-Za-z0-9._:-]")
        return self.root / f"{tid}.jsonl"

    async def _append(self, t: Trajectory, record: dict[str, Any] | str) -> None:
        """One record, one write(2) on the log's O_APPEND descriptor: whole, or (a torn last line, cut
        at load) not at all. Without fsync the write only reaches the page cache, which takes
        microseconds: it is made on the loop, as a thread hop would cost more than the write
        (the step log is on the hot path of every step); an fsync'ing one goes to a thread."""
        line = (record if isinstance(record, str) else json.dumps(record, separators=(",", ":"))).encode() + b"\n"
        t.touched = time.time()
        if t.fd is None:
            t.fd = os.open(t.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if self.config.fsync:
            await asyncio.to_thread(_write, t.fd, line, True)
        else:
            _write(t.fd, line, False)

    async def start(self) -> None:
        """Make the log directory; drop logs past their retention."""
        await asyncio.to_thread(self._sweep, time.time())

    def _sweep(self, now: float) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for path in self.root.glob("*.jsonl"):
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < now - self.config.retention and path.stem not in self.loaded:
                    path.unlink()

    async def _get(self, tid: str) -> Trajectory:
        t = self.loaded.get(tid)
        if t is None:
            t = await self._load(tid)
            if t is None:
                raise NotFoundError(f"trajectory {tid[:80]} not found")
        return t

    async def _load(self, tid: str) -> Trajectory | None:
        path = self._path(tid)
        try:
            text = await asyncio.to_thread(path.read_bytes)
        except FileNotFoundError:
            return None
        if tid in self.loaded:  # loaded by another request meanwhile
            return self.loaded[tid]
        t = self._replay_log(tid, path, text)
        if t.closed_at is None:  # a closed one is read again when asked (listing thousands pins none)
            self.loaded[tid] = t
        if t.running is not None:  # begun by a daemon that died before its result: never run again
            step, dig, _ = t.running
            t.running = None
            exc = UnavailableError(
                f"the daemon restarted while step {step} of trajectory {tid} ran: it may have run, "
                "so it is not run again",
                cause="infra",
            )
            kind = json.loads(t.actions[step])["kind"]
            await self._finish(t, step, dig, _error_result(t, step, kind, exc, time.time(), 0.0))
        if t.verify_begun is not None and t.verification is None:  # its verifier is gone with that daemon
            why = f"the daemon restarted while trajectory {tid} was being verified: the verification was lost"
            result = interrupted(why)
            self.core.metrics.verifications.labels(outcome="infra").inc()
            await self._append(t, {"k": "verify", "digest": t.verify_begun, "result": result.model_dump(mode="json")})
            t.verification, t.verify_digest = result, t.verify_begun
        return t

    def _replay_log(self, tid: str, path: Path, text: bytes) -> Trajectory:
        lines = text.split(b"\n")
        if lines and lines[-1]:  # a torn last record: the write that never finished
            lines = lines[:-1]
        t: Trajectory | None = None
        for raw in lines:
            if not raw:
                continue
            try:
                rec = json.loads(raw)
                kind = rec["k"]
                if kind == "open":
                    t = Trajectory(tid, TrajectoryOpen.model_validate(rec["request"]), rec["t"], path)
                elif t is None:
                    break
                elif kind == "sandbox":
                    t.sandbox = SandboxInfo.model_validate(rec["sandbox"])
                elif kind == "begin":
                    t.actions.append(json.dumps(rec["action"]))
                    t.running = (rec["step"], rec["digest"], asyncio.get_running_loop().create_future())
                elif kind == "done":
                    t.steps.append(StepResult.model_validate(rec["result"]))
                    t.digests.append(rec["digest"])
                    t.running = None
                elif kind == "verifying":
                    t.verify_begun = rec["digest"]
                elif kind == "verify":
                    t.verification = VerifyResult.model_validate(rec["result"])
                    t.verify_digest = rec["digest"]
                elif kind == "close":
                    t.closed_at, t.reward = rec["t"], rec.get("reward")
            except (ValueError, KeyError, TypeError, ValidationError) as exc:
                log.error("trajectory %s: a bad record in its log (%s): the rest is ignored", tid, exc)
                break
        if t is None:
            raise WrongStateError(f"trajectory {tid} has no readable log", cause="infra")
        t.touched = time.time()
        return t

    # -- open, list, close -----------------------------------------------------------------------

    async def open(self, req: TrajectoryOpen) -> TrajectoryInfo:
        """Open the trajectory `req.id`, or give back the one already open under it (same arguments)."""
        self._path(req.id)
        entry = self._opening.setdefault(req.id, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                return await self._open(req)
        finally:
            entry[1] -= 1
            if not entry[1]:  # nobody else opening it: the lock goes (one per rollout would pile up)
                self._opening.pop(req.id, None)

    async def _open(self, req: TrajectoryOpen) -> TrajectoryInfo:
        t = self.loaded.get(req.id) or await self._load(req.id)
        if t is not None and _fingerprint(t.opened) != _fingerprint(req):
            raise InvalidArgumentError(f"trajectory {req.id} exists, opened with other arguments")
        new = t is None
        if t is None:
            t = Trajectory(req.id, req, time.time(), self._path(req.id))
            await self._append(t, {"k": "open", "t": t.created_at, "request": req.model_dump(mode="json")})
            self.loaded[req.id] = t
        if t.sandbox is None:  # new, or its sandbox's create was interrupted: the same key claims it
            try:
                t.sandbox = await self._sandbox(req)
            except SandboxError:
                if new:  # refused (no such image, snapshot, sandbox; a full node): no trajectory either
                    self.loaded.pop(req.id, None)
                    _close(t)
                    await asyncio.to_thread(t.path.unlink, True)
                raise
            await self._append(t, {"k": "sandbox", "sandbox": t.sandbox.model_dump(mode="json")})
        return t.info()

    async def _sandbox(self, req: TrajectoryOpen) -> SandboxInfo:
        key = f"trajectory:{req.id}"
        labels = {**req.labels, TRAJECTORY_LABEL: req.id}
        if req.sandbox_id is not None:
            return await self.core.get(req.sandbox_id)
        if req.spec is not None:
            spec = req.spec.model_copy(
                update={
                    "labels": {**req.spec.labels, **labels},
                    "env": {**req.spec.env, **_seed_env(req.seed)},
                    "pause_after": req.spec.pause_after or self.config.pause_after,
                }
            )
            self.creation.check_draining(key)
            return await self.creation.create(spec, idempotency_key=key)
        assert req.snapshot_id is not None
        results = await self.snapshots.restore(req.snapshot_id, 1, labels, idempotency_key=key)
        if isinstance(results[0], SandboxError):
            raise results[0]
        return results[0]

    async def get(self, tid: str) -> TrajectoryInfo:
        return (await self._get(tid)).info()

    async def list(self, labels: dict[str, str], state: str | None) -> builtins.list[TrajectoryInfo]:
        names = await asyncio.to_thread(lambda: sorted(p.stem for p in self.root.glob("*.jsonl")))
        out = []
        for tid in names:
            with contextlib.suppress(SandboxError):
                info = (await self._get(tid)).info()
                if all(info.labels.get(k) == v for k, v in labels.items()) and state in (None, info.state):
                    out.append(info)
        return out

    async def close(self, tid: str, req: TrajectoryClose) -> TrajectoryInfo:
        """Record the end (and the reward); stop the sandbox unless asked not to. Closing again is a no-op."""
        t = await self._get(tid)
        async with t.lock:
            if t.closed_at is None:
                if t.running is not None:
                    raise WrongStateError(f"step {t.running[0]} of trajectory {tid} is still running")
                reward = req.reward if req.reward is not None else (t.verification.reward if t.verification else None)
                now = time.time()
                await self._append(t, {"k": "close", "t": now, "reward": reward})
                t.closed_at, t.reward = now, reward
                # Done with: its descriptor and memory go; a replay reads the log again.
                _close(t)
                if self.loaded.get(tid) is t:
                    del self.loaded[tid]
        if req.stop_sandbox and t.sandbox is not None:
            await self._stop_sandbox(t)
        return t.info()

    async def delete(self, tid: str) -> None:
        t = await self._get(tid)
        if t.running is not None or t.verifying is not None:
            raise WrongStateError(f"trajectory {tid} has a step running")
        await self._stop_sandbox(t)
        self.loaded.pop(tid, None)
        _close(t)
        await asyncio.to_thread(t.path.unlink, True)

    async def _stop_sandbox(self, t: Trajectory) -> None:
        if t.sandbox is None or t.opened.sandbox_id is not None:  # a sandbox it did not make is the caller's
            return
        sb = self.core.table.find(t.sandbox.id)
        if sb is not None and sb.state in HOLDING_STATES:
            with contextlib.suppress(SandboxError):
                await self.core.stop(t.sandbox.id, reason="user")

    # -- steps -----------------------------------------------------------------------------------

    async def step(self, tid: str, req: StepRequest) -> StepResult:
        t = await self._get(tid)
        action = req.action.model_dump_json()
        dig = digest(action)
        k = req.step
        if k < len(t.steps):
            if t.digests[k] != dig:
                raise InvalidArgumentError(f"step {k} of trajectory {tid} was taken with another action")
            return t.steps[k].model_copy(update={"replayed": True})
        if t.running is not None and t.running[0] == k:
            if t.running[1] != dig:
                raise InvalidArgumentError(f"step {k} of trajectory {tid} is running another action")
            done = await asyncio.shield(t.running[2])
            return done.model_copy(update={"replayed": True})
        if t.closed_at is not None:
            raise WrongStateError(f"trajectory {tid} is closed")
        if k != len(t.steps) or t.running is not None or t.sandbox is None:
            at = len(t.steps) if t.running is None else t.running[0]
            raise WrongStateError(f"trajectory {tid} is at step {at}: step {k} cannot be taken now")
        fut: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        t.running = (k, dig, fut)
        try:  # built by hand: the action is JSON already (the hot path dumps each model once)
            begin = f'{{"k":"begin","step":{k},"digest":"{dig}","t":{time.time()},"action":{action}}}'
            await self._append(t, begin)
        except BaseException:
            t.running = None
            raise
        t.actions.append(action)
        # In the service's task group: a trainer that goes away mid-step does not cancel it.
        self.core.spawn(self._run(t, k, dig, req.action, fut), name=f"step-{tid}-{k}")
        return await asyncio.shield(fut)

    async def _run(self, t: Trajectory, k: int, dig: str, action: StepAction, fut: asyncio.Future[StepResult]) -> None:
        t0, wall = time.perf_counter(), time.time()
        try:
            try:
                result = await self._act(t, k, action, t0, wall)
            except Exception as exc:  # noqa: BLE001 (every outcome is the step's recorded result)
                result = _error_result(t, k, action.kind, _agent_fault(to_wire_error(exc)), wall, t0)
            await self._finish(t, k, dig, result)
        except BaseException as exc:
            t.running = None
            if not fut.done():
                fut.set_exception(exc if isinstance(exc, Exception) else UnavailableError("the daemon is stopping"))
                fut.exception()  # retrieved: waiters get it
            raise
        fut.set_result(result)

    async def _finish(self, t: Trajectory, k: int, dig: str, result: StepResult) -> None:
        """Log the result, then make it the step's. A log that refuses the record (a full disk) still
        leaves the result here: asked again, this daemon answers it; a restarted one finds the step
        begun and unfinished and answers `infra`; neither runs it a second time."""
        try:
            await self._append(t, f'{{"k":"done","step":{k},"digest":"{dig}","result":{result.model_dump_json()}}}')
        except OSError as exc:
            log.error("trajectory %s: step %d's result could not be logged: %s", t.id, k, exc)
        t.steps.append(result)
        t.digests.append(dig)
        t.running = None
        if result.cause is not None:
            self.core.metrics.failures.labels(cause=result.cause).inc()

    async def _act(self, t: Trajectory, k: int, action: StepAction, t0: float, wall: float) -> StepResult:
        assert t.sandbox is not None
        sid = t.sandbox.id
        base = {"trajectory_id": t.id, "step": k, "kind": action.kind, "replayed": False, "started_at": wall}
        if isinstance(action, ExecAction):
            req = action.exec
            if t.opened.seed is not None and "SANDFLEET_SEED" not in req.env:
                req = req.model_copy(update={"env": {**req.env, **_seed_env(t.opened.seed)}})
            r = await self.execs.exec(sid, req)
            return StepResult(**base, exec=r, cause=r.cause, duration=time.perf_counter() - t0)
        if isinstance(action, WriteAction):
            data = base64.b64decode(action.content) if action.encoding == "base64" else action.content.encode()
            info = await self.files.write_file(sid, action.path, data, mode=action.mode, user=None, append=False)
            return StepResult(**base, file=info, duration=time.perf_counter() - t0)
        if isinstance(action, ReadAction):
            data = await self.files.read_file(sid, action.path, length=action.limit)
            return StepResult(
                **base,
                content=wire_text(data, action.encoding),
                encoding=action.encoding,
                duration=time.perf_counter() - t0,
            )
        assert isinstance(action, SnapshotAction)
        snap = await self.snapshots.snapshot(sid, ttl=action.ttl, labels={**action.labels, TRAJECTORY_LABEL: t.id})
        return StepResult(**base, snapshot_id=snap.id, duration=time.perf_counter() - t0)

    async def steps(self, tid: str) -> builtins.list[StepResult]:
        return list((await self._get(tid)).steps)

    async def drain(self) -> None:
        """Wait (up to `drain_timeout`) for the steps and verifications running now to be logged."""
        pending: builtins.list[asyncio.Future[Any]] = [t.running[2] for t in self.loaded.values() if t.running]
        pending += [t.verifying for t in self.loaded.values() if t.verifying is not None]
        if pending and self.config.drain_timeout > 0:
            log.info("waiting for %d trajectory step(s) to finish", len(pending))
            await asyncio.wait(pending, timeout=self.config.drain_timeout)

    # -- verification and the reproducibility record ---------------------------------------------

    async def verify(self, tid: str, req: VerifyRequest) -> VerifyResult:
        """Verify the trajectory's sandbox apart from it; logged, so asked again it is the same verdict."""
        t = await self._get(tid)
        dig = digest(req.model_dump_json())
        if t.verification is not None:
            if t.verify_digest != dig:
                raise InvalidArgumentError(f"trajectory {tid} was verified with other checks")
            return t.verification.model_copy(update={"replayed": True})
        if t.verifying is not None:
            return (await asyncio.shield(t.verifying)).model_copy(update={"replayed": True})
        if t.sandbox is None or t.running is not None:
            raise WrongStateError(f"trajectory {tid} has a step running")
        fut: asyncio.Future[VerifyResult] = asyncio.get_running_loop().create_future()
        t.verifying = fut

        async def begun() -> None:
            """Logged as its checks start (not while it waits its turn): a daemon killed from then on
            leaves its verdict `infra`; one killed before, nothing, and asked again it runs."""
            await self._append(t, {"k": "verifying", "digest": dig, "t": time.time()})
            t.verify_begun = dig

        async def run() -> None:
            try:
                assert t.sandbox is not None
                result = await self.verifier.verify(t.sandbox.id, req, since_snapshot=t.opened.snapshot_id, begun=begun)
                await self._append(t, {"k": "verify", "digest": dig, "result": result.model_dump(mode="json")})
                t.verification, t.verify_digest = result, dig
                fut.set_result(result)
            except BaseException as exc:
                if isinstance(exc, Exception) and t.verify_begun is not None:  # no verdict: a restart must not make one
                    with contextlib.suppress(OSError):
                        await self._append(t, {"k": "verifying", "digest": None})
                    t.verify_begun = None
                fut.set_exception(exc if isinstance(exc, Exception) else UnavailableError("the daemon is stopping"))
                fut.exception()
                if not isinstance(exc, Exception):
                    raise
            finally:
                t.verifying = None

        self.core.spawn(run(), name=f"verify-{tid}")
        return await asyncio.shield(fut)

    async def record(self, tid: str) -> ReproRecord:
        t = await self._get(tid)
        sb = t.sandbox
        taken = [s.snapshot_id for s in t.steps if s.snapshot_id]
        layers: builtins.list[str] = []
        found = self.core.table.find(sb.id) if sb else None
        if found is not None and found.live is not None:
            layers = [str(d) for d in found.live.runtime.get("layers", [])]
        return ReproRecord(
            trajectory=t.info(),
            spec=sb.spec if sb else None,
            image=sb.spec.environment() if sb else None,
            layers=layers,
            source_snapshot=t.opened.snapshot_id,
            snapshots=taken,
            actions=[json.loads(a) for a in t.actions[: len(t.steps)]],
            node=NodeVersions(
                sandfleet=__version__,
                agent=AGENT_VERSION,
                kernel=platform.release(),
                backend=sb.spec.backend if sb else "",
            ),
        )


def _write(fd: int, line: bytes, sync: bool) -> None:
    written = os.write(fd, line)
    if written != len(line):  # a full disk: the record is torn (cut at load); say so
        raise OSError(errno.ENOSPC, "the trajectory log could not be written whole")
    if sync:
        os.fsync(fd)


def _close(t: Trajectory) -> None:
    if t.fd is not None:
        os.close(t.fd)
        t.fd = None


def _seed_env(seed: int | None) -> dict[str, str]:
    return {} if seed is None else {"SANDFLEET_SEED": str(seed)}


def _agent_fault(exc: SandboxError) -> SandboxError:
    """An action refused for what it asked (a missing file, a bad path) is the agent's failure, not
    the trainer's: the action is the agent's. Errors about the sandbox itself keep their cause."""
    if exc.cause == "caller" and not isinstance(exc, SandboxNotFoundError | WrongStateError):
        exc.cause = "agent"
    return exc


def _error_result(t: Trajectory, k: int, kind: Any, exc: SandboxError, wall: float, t0: float) -> StepResult:
    cause: Cause = exc.cause
    return StepResult(
        trajectory_id=t.id,
        step=k,
        kind=kind,
        replayed=False,
        error=ErrorBody.model_validate(exc.to_wire()),
        cause=cause,
        started_at=wall,
        duration=time.perf_counter() - t0 if t0 else 0.0,
    )
