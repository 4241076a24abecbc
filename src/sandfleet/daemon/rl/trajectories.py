"""Trajectories: a rollout's steps, each taken exactly once, its result logged before it is answered.

Step k of a trajectory is (id, k). Asked for step k again (a preempted trainer replays its rollout,
from this machine or another), the node answers the logged result and runs nothing; while step k
runs, a second ask waits for the first's result. The sandbox holds the state the steps made: kept
alive (paused while no trainer drives it: `pause_after`), adopted after a daemon restart. The log is
one file per trajectory (daemon/rl/steplog.py: checksummed JSON lines) under
`<state_dir>/trajectories/<project>/`, one write(2) per record, so a record outlives any process
that dies after writing it; `fsync = true` also makes it outlive the machine (which takes the
sandbox with it, so the default is not to pay for that).

Ids are a project's own: everything keyed by a trajectory id (the loaded table, the locks, the log's
path, the sandbox's create key) is keyed by (project, id), the project being the caller's (None for
root and nodes without `[iam]`; daemon/rl/trajlogs.py: logs from before that stay reachable as then).

One object per trajectory: `loaded` holds the open ones, and a closed one while work on it goes on
(a verification, a record held for the disk); only then is a closed one read from its log again. So
what the log says begun and unfinished at a read died with an earlier daemon.

Not exactly once: a step the daemon was killed in the middle of may have run (its output is gone),
so it is never run again: it answers `unavailable` with cause `infra`, which a trainer masks. A
stopping daemon (SIGTERM) waits `drain_timeout` for running steps first. A log damaged past some
point (a changed byte, a fragment appended onto) is cut there with a `lost` record: every step from
there on answers `data_loss` and never runs (steps before it replay).

A trajectory's verification (daemon/rl/verify.py) is logged too, the start of its checks first: one a
daemon was killed in the middle of answers `infra` (never a second run's verdict); one still queued
had not started, and runs when asked again.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.node.checkpoints import Checkpoints
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.creation import Creation
from sandfleet.daemon.node.execs import Execs
from sandfleet.daemon.node.jobstats import within_step
from sandfleet.daemon.node.lifecycle import HOLDING_STATES
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.daemon.node.snapshots import Snapshots
from sandfleet.daemon.rl.steplog import (
    Key,
    Scan,
    StepLog,
    Trajectory,
    earlier_identities,
    encode,
    identity,
    mend_tail,
    replay,
    rewrite,
    scan,
)
from sandfleet.daemon.rl.trajlogs import Infos, KeyLocks, LogFolder
from sandfleet.daemon.rl.trajsteps import TRAJECTORY_LABEL, act, agent_fault, error_result, reproduction, seed_env
from sandfleet.daemon.rl.verify import Verifier, interrupted
from sandfleet.errors import (
    DataLossError,
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.models import (
    ExecAction,
    ReproRecord,
    SandboxInfo,
    SandboxSpec,
    StepAction,
    StepRequest,
    StepResult,
    TrajectoryClose,
    TrajectoryInfo,
    TrajectoryOpen,
    VerifyRequest,
    VerifyResult,
)


class TrajectoryConfig(BaseModel):
    """`[trajectories]` in the node's config."""

    model_config = ConfigDict(extra="forbid")
    fsync: bool = Field(False, description="fsync each record: the log outlives a power loss (costs a disk flush)")
    pause_after: float = Field(60.0, gt=0, description="a trajectory's sandbox is paused after this many idle seconds")
    retention: float = Field(
        7 * 86400.0, gt=0, description="a trajectory's log is kept this long after its last record"
    )
    drain_timeout: float = Field(30.0, ge=0, description="a stopping daemon waits this long for running steps")


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
        checkpoints: Checkpoints,
        verifier: Verifier,
        root: Path,
        config: TrajectoryConfig | None = None,
    ) -> None:
        self.core = core
        self.creation = creation
        self.execs = execs
        self.files = files
        self.snapshots = snapshots
        self.checkpoints = checkpoints
        self.verifier = verifier
        self.logs = LogFolder(root)
        self.config = config or TrajectoryConfig()
        self.loaded: dict[Key, Trajectory] = {}  # one object per trajectory (the module's doc)
        self._opening = KeyLocks()
        self._loading = KeyLocks()
        self.infos = Infos()  # closed trajectories' infos, as they left memory: a list reads no log again
        # Keys `exists` found without a log, for the open that follows (it reads no second time).
        # Only `_open` makes a log, and it drops the key as it does: one here still has none.

    # -- the log ---------------------------------------------------------------------------------

    async def _append(self, t: Trajectory, record: dict[str, Any] | str, *, hold: bool = False) -> None:
        """One record on `t`'s log, after any held there (steplog.StepLog.append); OSError if the disk
        refused it. A log that could not be cut back after a failed write is damaged from here on."""
        t.touched = time.time()
        try:
            await t.log.append(encode(record), hold=hold)
        except OSError:
            if t.log.broken and t.lost_from is None:
                t.lost_from = len(t.steps)
            raise

    async def start(self) -> None:
        """Make the log directory, move logs of the layout before projects; drop logs past their retention."""
        await asyncio.to_thread(self.logs.sweep, time.time(), self.config.retention, self.loaded, self._legacy_project)

    def _legacy_project(self, found: Scan) -> str | None:
        """Whose a log of the layout before projects is: its sandbox's project (None, also when the
        log does not say: the root's)."""
        records = {r.get("k"): r for r in (line.record for line in found.lines) if r is not None}
        spec: SandboxSpec | None = None
        try:
            if "sandbox" in records:
                spec = SandboxInfo.model_validate(records["sandbox"]["sandbox"]).spec
            elif "open" in records:
                req = TrajectoryOpen.model_validate(records["open"]["request"])
                snap = self.snapshots.records.get(req.snapshot_id or "")
                sb = self.core.table.find(req.sandbox_id or "")
                spec = req.spec or (snap.spec if snap is not None else sb.spec if sb is not None else None)
        except (ValueError, KeyError, TypeError):
            return None
        return spec.project if spec is not None else None

    async def _get(self, key: Key) -> Trajectory:
        """The trajectory, in `loaded` as this returns (a closed one: `_release` it when done)."""
        t = self.loaded.get(key) or await self._load(key)
        if t is None:
            raise NotFoundError(f"trajectory {key[1][:80]} not found")
        return t

    def _release(self, t: Trajectory) -> None:
        """A closed trajectory leaves memory once no work on it goes on (read again when asked)."""
        if t.closed_at is None or t.running is not None or t.verifying is not None or t.log.held:
            return
        t.log.close()
        if self.loaded.get(t.key) is t:
            del self.loaded[t.key]
            self.infos.remember(t.key, t.info())

    async def exists(self, tid: str, *, project: str | None) -> bool:
        """Whether the project has a trajectory of this id (DataLossError: one whose log is unreadable)."""
        key = self.logs.key(project, tid)
        if key in self.loaded:
            return True
        t = await self._load(key)
        if t is None:
            return False
        self._release(t)
        return True

    async def _load(self, key: Key) -> Trajectory | None:
        """Read the trajectory's log into `loaded`. Work it shows begun and unfinished died with an
        earlier daemon (work going on here keeps its trajectory loaded): it gets its `infra` result."""
        async with self._loading.hold(key):  # one reader (which may mend the file) at a time
            if key in self.loaded:  # loaded by another request meanwhile
                return self.loaded[key]
            path = self.logs.path(key)
            try:
                data = await asyncio.to_thread(path.read_bytes)
            except FileNotFoundError:
                return self.loaded.get(key)  # opened meanwhile, or none
            if key in self.loaded:  # opened meanwhile (its log may be half written yet)
                return self.loaded[key]
            found = scan(data)
            t, damage = replay(key, path, found, self.config.fsync)
            if t is None:  # only a torn open record: the open never finished, nothing was made
                await asyncio.to_thread(path.unlink, True)
                return None
            if damage is not None:
                keep = data[: found.lines[damage].start] + encode({"k": "lost", "step": t.lost_from, "t": time.time()})
                await asyncio.to_thread(rewrite, path, keep)
                t.log.size = len(keep)
            else:
                t.log.size = await asyncio.to_thread(mend_tail, path, found, self.config.fsync)
            try:
                await self._repair(t)
            except BaseException:
                t.log.close()
                raise
            self.loaded[key] = t
            return t

    async def _repair(self, t: Trajectory) -> None:
        if t.running is not None:  # begun by a daemon that died before its result: never run again
            step, dig, _ = t.running
            t.running = None
            exc = UnavailableError(
                f"the daemon restarted while step {step} of trajectory {t.id} ran: it may have run, "
                "so it is not run again",
                cause="infra",
            )
            kind = json.loads(t.actions[step])["kind"]
            await self._finish(t, step, dig, error_result(t, step, kind, exc, time.time(), 0.0))
        if t.verify_begun is not None and t.verification is None:  # its verifier is gone with that daemon
            why = f"the daemon restarted while trajectory {t.id} was being verified: the verification was lost"
            result = interrupted(why)
            self.core.metrics.verifications.labels(outcome="infra").inc()
            if (sb := self.core.table.find(t.sandbox.id if t.sandbox else "")) is not None:
                self.core.jobs.verified(sb, result)
            await self._append(t, {"k": "verify", "digest": t.verify_begun, "result": result.model_dump(mode="json")})
            t.verification, t.verify_digest = result, t.verify_begun

    # -- open, list, close -----------------------------------------------------------------------

    async def open(self, req: TrajectoryOpen, *, project: str | None) -> TrajectoryInfo:
        """Open the project's trajectory `req.id`, or give back the one already open under it (same
        arguments)."""
        key = self.logs.key(project, req.id)
        self.logs.path(key)
        async with self._opening.hold(key):
            t = await self._open(key, req)
        self._release(t)
        return t.info()

    async def _open(self, key: Key, req: TrajectoryOpen) -> Trajectory:
        t = self.loaded.get(key) or await self._load(key)
        if t is not None and _fingerprint(t.opened) != _fingerprint(req):
            self._release(t)
            raise InvalidArgumentError(f"trajectory {req.id} exists, opened with other arguments")
        new = t is None
        if t is None:
            t = Trajectory(req.id, key[0], req, time.time(), StepLog(self.logs.path(key), 0, self.config.fsync))
            await asyncio.to_thread(t.log.path.parent.mkdir, exist_ok=True, mode=0o700)
            self.loaded[key] = t  # before its log has a byte: a reader meanwhile must not take it for torn
            try:
                await self._append(t, {"k": "open", "t": t.created_at, "request": req.model_dump(mode="json")})
            except BaseException:
                await self._forget(t)
                raise
        if t.sandbox is None and t.closed_at is None:  # new, or its create was interrupted: its key claims it
            try:
                t.sandbox = await self._sandbox(key, req)
            except SandboxError:
                if new:  # refused (no such image, snapshot, sandbox; a full node): no trajectory either
                    await self._forget(t)
                raise
            try:  # a full disk: held, it goes out before the first step's begin (no step without it)
                await self._append(t, {"k": "sandbox", "sandbox": t.sandbox.model_dump(mode="json")}, hold=True)
            except OSError as exc:
                log.error("trajectory %s: its sandbox could not be logged yet: %s", t.id, exc)
            await self.core.ack([t.sandbox.id])  # held by the trajectory: never reaped as unheard of
        return t

    async def _forget(self, t: Trajectory, *, idle: bool = False) -> Trajectory:
        """Drop a trajectory and its log (`idle`: unless work on it goes on); the one dropped. Under
        its key's loading lock: no reader meanwhile finds the file going away and loads it."""
        async with self._loading.hold(t.key):
            t = self.loaded.get(t.key, t)
            if idle and (t.running is not None or t.verifying is not None):
                raise WrongStateError(f"trajectory {t.id} has a step running")
            await t.log.retire("deleted")  # whatever still holds it logs nothing more
            self.infos.forget(t.key)
            if self.loaded.get(t.key) is t:
                del self.loaded[t.key]
            await asyncio.to_thread(t.log.path.unlink, True)
        if self.logs.forget(t.key):
            await asyncio.to_thread(self.logs.save)
        return t

    async def _sandbox(self, key: Key, req: TrajectoryOpen) -> SandboxInfo:
        project, tid = key  # the create key is the trajectory's: (project, id), as everything keyed by it
        idempotency_key = f"trajectory:{project}:{tid}" if project else f"trajectory:{tid}"
        labels = {**req.labels, TRAJECTORY_LABEL: req.id}
        if req.sandbox_id is not None:
            return await self.core.get(req.sandbox_id)
        if req.spec is not None:
            spec = req.spec.model_copy(
                update={
                    "labels": {**req.spec.labels, **labels},
                    "env": {**req.spec.env, **seed_env(req.seed)},
                    "pause_after": req.spec.pause_after or self.config.pause_after,
                }
            )
            self.creation.check_draining([spec], idempotency_key)
            return await self.creation.create(spec, idempotency_key=idempotency_key)
        assert req.snapshot_id is not None
        results = await self.snapshots.restore(req.snapshot_id, 1, labels, idempotency_key=idempotency_key)
        if isinstance(results[0], SandboxError):
            raise results[0]
        return results[0]

    async def get(self, tid: str, *, project: str | None) -> TrajectoryInfo:
        t = await self._get(self.logs.key(project, tid))
        self._release(t)
        return t.info()

    async def list(
        self, labels: dict[str, str], state: str | None, *, project: str | None
    ) -> builtins.list[TrajectoryInfo]:
        """Those with these labels and state. A closed one's info is the one it left memory with (its
        log does not change while this daemon runs), read from its log the first time only."""
        names = await asyncio.to_thread(self.logs.own, project) | self.logs.reached(project)
        out = []
        for tid in sorted(names):
            key = self.logs.key(project, tid)
            t = self.loaded.get(key)
            info = t.info() if t is not None else self.infos.get(key)
            if info is None:
                with contextlib.suppress(SandboxError, OSError):  # one unreadable log hides no other
                    info = await self.get(tid, project=project)
            if info is not None and state in (None, info.state) and labels.items() <= info.labels.items():
                out.append(info)
        return out

    async def close(self, tid: str, req: TrajectoryClose, *, project: str | None) -> TrajectoryInfo:
        """Record the end (and the reward); stop the sandbox unless asked not to. Closing again is a
        no-op; closing while a step or the verification runs is refused (the reward may be its)."""
        t = await self._get(self.logs.key(project, tid))
        try:
            async with t.lock:  # a step begins under it: none begins on a trajectory being closed
                if t.log.retired is not None:
                    raise NotFoundError(f"trajectory {tid[:80]} not found")
                if t.closed_at is None:
                    if t.running is not None:
                        raise WrongStateError(f"step {t.running[0]} of trajectory {tid} is still running")
                    if t.verifying is not None:
                        raise WrongStateError(f"trajectory {tid} is being verified")
                    verdict = t.verification
                    reward = req.reward if req.reward is not None else (verdict.reward if verdict else None)
                    now = time.time()
                    await self._append(t, {"k": "close", "t": now, "reward": reward})
                    t.closed_at, t.reward = now, reward
            if req.stop_sandbox and t.sandbox is not None:
                await self._stop_sandbox(t)
            return t.info()
        finally:
            self._release(t)  # done with: its descriptor and memory go; a replay reads the log again

    async def delete(self, tid: str, *, project: str | None) -> None:
        key = self.logs.key(project, tid)
        try:
            t = await self._get(key)
        except DataLossError:  # a log unreadable from its start: it goes (its sandbox is unknown)
            await asyncio.to_thread(self.logs.path(key).unlink, True)
            if self.logs.forget(key):
                await asyncio.to_thread(self.logs.save)
            return
        t = await self._forget(t, idle=True)  # first: nothing begins on it while its sandbox stops
        await self._stop_sandbox(t)

    async def _stop_sandbox(self, t: Trajectory) -> None:
        if t.sandbox is None or t.opened.sandbox_id is not None:  # a sandbox it did not make is the caller's
            return
        sb = self.core.table.find(t.sandbox.id)
        if sb is not None and sb.state in HOLDING_STATES:
            with contextlib.suppress(SandboxError):
                await self.core.stop(t.sandbox.id, reason="user")

    # -- steps -----------------------------------------------------------------------------------

    async def step(self, tid: str, req: StepRequest, *, project: str | None) -> StepResult:
        t = await self._get(self.logs.key(project, tid))
        try:
            got = await self._begin(t, req)
        finally:
            self._release(t)
        if not isinstance(got, StepResult):  # else the logged result: a replay
            fut, began = got
            got = await asyncio.shield(fut)
            if began:
                return got
        self.core.jobs.replayed(t.sandbox.id if t.sandbox else None)
        return got.model_copy(update={"replayed": True})

    async def _begin(self, t: Trajectory, req: StepRequest) -> StepResult | tuple[asyncio.Future[StepResult], bool]:
        """The logged result of step `req.step`, or the future of its run and whether it began now."""
        action = req.action.model_dump_json()  # logged as dumped: the record says what ran, defaults too
        dig = identity(req.action)
        k = req.step
        if k < len(t.steps):
            if t.digests[k] != dig and t.digests[k] not in earlier_identities(req.action):
                raise InvalidArgumentError(f"step {k} of trajectory {t.id} was taken with another action")
            return t.steps[k].model_copy(update={"replayed": True})
        if t.running is not None and t.running[0] == k:
            if t.running[1] != dig:
                raise InvalidArgumentError(f"step {k} of trajectory {t.id} is running another action")
            return t.running[2], False
        fut: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        async with t.lock:  # close logs its record under it: no step begins on a trajectory being closed
            if t.log.retired is not None:
                raise NotFoundError(f"trajectory {t.id[:80]} not found")
            if t.lost_from is not None:  # past the damage: it may have run, or not; it never runs
                raise t.lost(f"step {k}")
            if t.closed_at is not None:
                raise WrongStateError(f"trajectory {t.id} is closed")
            if k != len(t.steps) or t.running is not None or t.sandbox is None:
                at = len(t.steps) if t.running is None else t.running[0]
                raise WrongStateError(f"trajectory {t.id} is at step {at}: step {k} cannot be taken now")
            budget = isinstance(req.action, ExecAction) and req.action.exec.cpu_time is not None
            if budget and (sb := self.core.table.find(t.sandbox.id)) is not None:
                self.execs.check_budget(sb)  # the caller's error (a 400, not logged), never the agent's step's
            t.running = (k, dig, fut)
            try:  # built by hand: the action is JSON already
                begin = f'{{"k":"begin","step":{k},"digest":"{dig}","t":{time.time()},"action":{action}}}'
                await self._append(t, begin)
            except BaseException as exc:
                t.running = None
                if t.log.retired is not None:  # deleted (or fenced) meanwhile
                    raise NotFoundError(f"trajectory {t.id[:80]} not found") from exc
                raise
            t.actions.append(action)
        # In the service's task group: a trainer that goes away mid-step does not cancel it.
        self.core.spawn(self._run(t, k, dig, req.action, fut), name=f"step-{t.id}-{k}")
        return fut, True

    async def _run(self, t: Trajectory, k: int, dig: str, action: StepAction, fut: asyncio.Future[StepResult]) -> None:
        t0, wall = time.perf_counter(), time.time()
        try:
            try:
                with within_step(t.id, k):
                    result = await act(self.execs, self.files, self.snapshots, self.checkpoints, t, k, action, t0, wall)
            except Exception as exc:  # noqa: BLE001 (every outcome is the step's recorded result)
                result = error_result(t, k, action.kind, agent_fault(to_wire_error(exc)), wall, t0)
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
        leaves the result here: asked again, this daemon answers it, and the record is held to go
        out before the next one (the next step's `begin`, which waits for room on the disk); a
        restarted daemon that never wrote it finds the step begun and unfinished and answers
        `infra`. None runs it a second time."""
        done = f'{{"k":"done","step":{k},"digest":"{dig}","result":{result.model_dump_json()}}}'
        try:
            await self._append(t, done, hold=True)
        except OSError as exc:
            log.error("trajectory %s: step %d's result could not be logged yet: %s", t.id, k, exc)
        t.steps.append(result)
        t.digests.append(dig)
        t.running = None
        if result.cause is not None:
            self.core.metrics.failures.labels(cause=result.cause).inc()
        self.core.jobs.stepped(t.sandbox.id if t.sandbox else None, t.id, result)

    async def steps(self, tid: str, *, project: str | None) -> builtins.list[StepResult]:
        t = await self._get(self.logs.key(project, tid))
        self._release(t)
        return list(t.steps)

    async def fence(self, why: str) -> None:
        """Set every log aside (`why`): the cluster told callers that all this node held is lost, so
        none of its trajectories answers again (an id opened again is a new one). Work still going
        on here logs nothing more."""
        self.infos.clear()
        for key in await asyncio.to_thread(self.logs.keys):
            async with self._loading.hold(key):  # no reader meanwhile loads what goes
                t = self.loaded.pop(key, None)
                if t is not None:
                    await t.log.retire(why)
                await asyncio.to_thread(self.logs.set_aside, key, why)
            self.logs.forget(key)
        await asyncio.to_thread(self.logs.save)

    async def drain(self) -> None:
        """Wait (up to `drain_timeout`) for the steps and verifications running now to be logged."""
        pending: builtins.list[asyncio.Future[Any]] = [t.running[2] for t in self.loaded.values() if t.running]
        pending += [t.verifying for t in self.loaded.values() if t.verifying is not None]
        if pending and self.config.drain_timeout > 0:
            log.info("waiting for %d trajectory step(s) to finish", len(pending))
            await asyncio.wait(pending, timeout=self.config.drain_timeout)
        for t in list(self.loaded.values()):  # results answered but not logged yet: a last try
            if t.log.held:
                with contextlib.suppress(OSError):
                    await t.log.append(None)

    # -- verification and the reproducibility record ---------------------------------------------

    async def verify(self, tid: str, req: VerifyRequest, *, project: str | None) -> VerifyResult:
        """Verify the trajectory's sandbox apart from it; logged, so asked again it is the same verdict."""
        t = await self._get(self.logs.key(project, tid))
        try:
            fut = self._verification(t, req)
        finally:
            self._release(t)  # a verification begun keeps it (closed or not) until it ends
        if isinstance(fut, VerifyResult):
            return fut
        return (await asyncio.shield(fut[0])).model_copy(update={"replayed": not fut[1]})

    def _verification(
        self, t: Trajectory, req: VerifyRequest
    ) -> VerifyResult | tuple[asyncio.Future[VerifyResult], bool]:
        """The logged verdict, or the future of the verification and whether it began now (on the
        object `_get` gave, with no await in between: the one in `loaded`)."""
        tid = t.id
        dig = identity(req)
        if t.verification is not None:
            if t.verify_digest != dig and t.verify_digest not in earlier_identities(req):
                raise InvalidArgumentError(f"trajectory {tid} was verified with other checks")
            return t.verification.model_copy(update={"replayed": True})
        if t.verifying is not None:
            return t.verifying, False
        if t.lost_from is not None:  # its verdict may be in the damaged part
            raise t.lost("its verification")
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
                try:  # a full disk: held, as a step's result (answered; a restart without it says infra)
                    record = {"k": "verify", "digest": dig, "result": result.model_dump(mode="json")}
                    await self._append(t, record, hold=True)
                except OSError as exc:
                    log.error("trajectory %s: its verdict could not be logged yet: %s", tid, exc)
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
                self._release(t)

        try:
            self.core.spawn(run(), name=f"verify-{tid}")
        except BaseException:
            t.verifying = None
            raise
        return fut, True

    async def record(self, tid: str, *, project: str | None) -> ReproRecord:
        t = await self._get(self.logs.key(project, tid))
        self._release(t)
        return reproduction(t, self.core.table)
