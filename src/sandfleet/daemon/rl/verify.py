"""Verification apart from the agent: a task's checks run in a fresh sandbox, never in the agent's.

The verifier's sandbox is the agent sandbox's pre-agent state (its image and layers), plus what the
agent changed (its writable layer, exported as one layer of the store), plus verifier-only layers
(hidden tests) on top, which no agent sandbox ever mounts. Changes under `protect` (the visible
tests, a grader script) are dropped before the layer is made; with `allow`, only changes under the
named paths are kept at all (a conftest.py, a .pth file or a binary on PATH planted elsewhere never
reach the checks). The hidden layers sit above the agent's anyway: an agent that edits the tests, or
writes files where the hidden tests will be, is graded on the real ones. The agent's sandbox keeps
running, untouched.

Right on a busy node: the agent's changes are taken at once, then the checks wait their turn in a
`CpuQueue` (each holds its sandbox's CPU limit while it runs, at most the queue's capacity), so a
burst of rollouts ending together does not run 64 test suites on 2 cores; that wait (`queued`) is
not part of the checks' `timeout`. The capacity defaults to half the CPU load admission allows
latency-sensitive sandboxes: checks, which count in that load, never use the room the node's other
work (rollouts' creates, fncall calls) needs; and since their CPUs are the queue's, the load does not
refuse their sandboxes (another tenant saturating the node does not hold verifications up). A
check takes its CPUs only once its sandbox is admitted: one the node cannot admit yet (its memory,
say) gives them back to the checks behind it and queues again. The checks may have a CPU budget
(`cpu_time`) besides the wall-clock one, and a timeout that fired while the node starved them is
`infra` (execs.CommandWatch).

The verifier's sandbox belongs to its verification: stopped when it ends, however it ends (an
answer, an error, cancellation); one left by a daemon that died mid-verification is stopped when
the next one starts (recovery.py), never adopted (unless the caller asked to `keep` it).

Whose fault a failed verification is, by who caused it:
- the checks ran the agent's code and it failed them: an exit code in `agent_exit_codes` (pytest's 1,
  tests failed, and 2, a collection error: the agent's code does not even import), the OOM killer,
  or a crash (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) -> `agent`;
- they ran out of time (`timeout`, `cpu_time`) with the CPU they were due -> `timeout`;
- the checker itself broke: any other exit code (126/127: not runnable or not found; pytest's 3-5:
  internal error, usage error, no tests), another signal, a promised reward file not written, a
  verifier layer not found -> `verifier`;
- the node: its sandbox could not be made, was lost, starved the checks, the daemon restarted -> `infra`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from sandfleet.backends.base import LayerView
from sandfleet.daemon.node.admission import CpuQueue
from sandfleet.daemon.node.core import NodeCore, log
from sandfleet.daemon.node.creation import Creation
from sandfleet.daemon.node.execs import Execs
from sandfleet.daemon.node.lifecycle import Sandbox
from sandfleet.daemon.node.sandbox_files import Files
from sandfleet.daemon.node.snapshots import Snapshots, inside_path
from sandfleet.errors import Cause, InvalidArgumentError, ResourceExhaustedError, SandboxError, UnavailableError
from sandfleet.models import (
    KEPT_LABEL,
    VERIFY_LABEL,
    ChangedFile,
    ErrorBody,
    ExecRequest,
    ExecResult,
    NetworkPolicy,
    SandboxInfo,
    SandboxSpec,
    VerifyRequest,
    VerifyResult,
)

MAX_CHANGED = 10_000  # files listed in a result at most
MAX_LAYERS = 32  # SandboxSpec.layers' bound
# The default capacity of the checks' queue: this share of the CPU load admission allows.
QUEUE_SHARE = 0.5
# How the checks' process ended that is the agent's code crashing (directly, or 128+n from a shell).
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})


class VerifyConfig(BaseModel):
    """`[verify]` in the node's config."""

    model_config = ConfigDict(extra="forbid")
    cpus: float | None = Field(
        None,
        gt=0,
        description="CPUs the checks of verifications may hold at once (each holds its sandbox's CPU limit, at most "
        "this; the rest wait their turn); default: half of max_cpu_load x the node's CPUs, so that checks leave "
        "room for the node's other sandboxes",
    )


def _kind(st: os.stat_result) -> str:
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    return "file" if stat.S_ISREG(st.st_mode) else "other"


def _same(a: os.stat_result, b: os.stat_result) -> bool:
    """The same entry as a baseline's copy (`cp -a` keeps type, mode, size and mtime)."""
    return (a.st_mode, a.st_size, a.st_mtime_ns) == (b.st_mode, b.st_size, b.st_mtime_ns)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return path.lstat()
    except OSError:
        return None


def list_changes(upper: Path, lowers: list[Path], baseline: Path | None) -> list[ChangedFile]:
    """What an overlay writable layer `upper` changed over the read-only `lowers`: each file, link or
    new directory added or modified, each whiteout as deleted. An entry identical to its copy in
    `baseline` (the writable layer of the snapshot the sandbox was restored from) was there before
    the agent, and is left out."""
    out: list[ChangedFile] = []

    def below(rel: str) -> os.stat_result | None:
        for root in ([baseline] if baseline else []) + lowers:
            st = _lstat(root / rel)
            if st is not None:
                return st
        return None

    for dirpath, dirnames, filenames in os.walk(upper):
        for name in sorted(dirnames) + sorted(filenames):
            full = Path(dirpath) / name
            rel = str(full.relative_to(upper))
            st = _lstat(full)
            if st is None:
                continue
            if baseline is not None and (old := _lstat(baseline / rel)) is not None and _same(st, old):
                continue
            before = below(rel)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:  # an overlay whiteout: deleted
                if before is not None:
                    out.append(ChangedFile(path="/" + rel, change="deleted", type=_kind(before)))
            elif stat.S_ISDIR(st.st_mode):
                if before is None:
                    out.append(ChangedFile(path="/" + rel, change="added", type="dir"))
            else:
                change = "added" if before is None else "modified"
                out.append(ChangedFile(path="/" + rel, change=change, type=_kind(st)))
            if len(out) >= MAX_CHANGED:
                return out
    return out


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _above(path: str, roots: list[str]) -> bool:
    """Whether `path` is a directory on the way to one of `roots` (all relative)."""
    return any(r.startswith(path + "/") for r in roots)


def keep_only(root: Path, allow: list[str], lowers: list[Path]) -> None:
    """Drop from a copied writable layer `root` everything outside `allow` (relative paths): what is
    left is the agent's changes under them, and the directories on the way to them as plain
    directories (never opaque, which would hide what the layers below hold beside them; with the
    mode the layers below give them), never following a symlink the sandbox made."""

    def walk(d: Path, rel: str) -> None:
        for entry in list(os.scandir(d)):
            sub = f"{rel}/{entry.name}" if rel else entry.name
            if _under(sub, allow):
                continue
            if entry.is_dir(follow_symlinks=False) and _above(sub, allow):
                _plain_dir(Path(entry.path), sub, lowers)
                walk(Path(entry.path), sub)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)

    walk(root, "")


def _plain_dir(path: Path, rel: str, lowers: list[Path]) -> None:
    for name in os.listxattr(path, follow_symlinks=False):
        if name.endswith("overlay.opaque"):
            os.removexattr(path, name, follow_symlinks=False)
    for lower in lowers:
        st = _lstat(lower / rel)
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                os.chmod(path, stat.S_IMODE(st.st_mode), follow_symlinks=False)
            return


def _cause(result: ExecResult, req: VerifyRequest) -> Cause | None:
    """Whose fault the checks' result is (see the module's docstring); None when they passed."""
    if result.exit_code == 0 and not result.timed_out:
        return None
    if result.timed_out:
        return "infra" if result.starved else "timeout"
    if result.oom_killed:
        return "agent"
    signo = result.signal if result.signal is not None else result.exit_code - 128
    if signo in CRASH_SIGNALS:
        return "agent"
    if result.signal is None and result.exit_code in req.agent_exit_codes:
        return "agent"
    return "verifier"


class Verifier:
    def __init__(
        self,
        core: NodeCore,
        creation: Creation,
        execs: Execs,
        files: Files,
        snapshots: Snapshots,
        config: VerifyConfig | None = None,
    ) -> None:
        self.core = core
        self.creation = creation
        self.execs = execs
        self.files = files
        self.snapshots = snapshots
        self.config = config or VerifyConfig()
        load = (core.admission.policy.max_cpu_load or 1.0) * core.admission.cpus
        self.queue = CpuQueue(self.config.cpus or QUEUE_SHARE * load)
        if self.queue.capacity >= load:
            log.warning("[verify] cpus = %g: checks alone can load the node past max_cpu_load", self.queue.capacity)
        self._creating: set[asyncio.Task[SandboxInfo]] = set()

    async def verify(
        self,
        sandbox_id: str,
        req: VerifyRequest,
        *,
        since_snapshot: str | None = None,
        begun: Callable[[], Awaitable[None]] | None = None,
    ) -> VerifyResult:
        """Grade the agent sandbox `sandbox_id` (see the module's docstring). `since_snapshot`: the
        set-up snapshot it was restored from, so `changed` lists only what the agent did; `begun`:
        called once its turn has come, before its sandbox is made (a trajectory logs it)."""
        t0 = time.perf_counter()
        protect = _inside(req.protect, "protect")
        allow = None if req.allow is None else _inside(req.allow, "allow")
        sb = self.core.sandbox(sandbox_id)
        if req.cpu_time is not None:
            self.execs.check_budget(sb)  # the verifier's tier is the agent's
        if len(sb.spec.layers) + 1 + len(req.layers) > MAX_LAYERS:
            raise InvalidArgumentError(
                f"the sandbox's {len(sb.spec.layers)} layers, its changes and {len(req.layers)} verifier layers "
                f"make more than {MAX_LAYERS}"
            )
        tier = self.core.tier(sb)
        lowers: list[Path] = []
        if isinstance(tier, LayerView) and sb.live is not None:
            lowers = tier.layer_paths(sb.live)[1]
        baseline = self.snapshots.baseline(since_snapshot) if since_snapshot else None

        def inspect(staging: Path) -> list[ChangedFile]:
            changed = list_changes(staging, lowers, baseline)
            if allow is not None:
                keep_only(staging, allow, lowers)
            return changed

        agent_sb, layer, _, changed = await self.snapshots.changes_layer(sandbox_id, protect, inspect)
        dropped = [c.path for c in changed if not _kept(c, protect, allow)]
        base = agent_sb.spec
        try:
            spec = self._verifier_spec(base, layer.digest, req, sandbox_id, self.queue.capacity)
        except ValidationError as exc:  # the agent's spec and the request were each valid; together not
            raise InvalidArgumentError(
                f"the verifier's sandbox cannot be made: {exc.errors()[0]['msg']}"[:300]
            ) from exc
        common: dict[str, Any] = {"changed": changed, "dropped": dropped, "changes_layer": layer.digest}
        # The checks wait for CPUs and for the node to admit their sandbox (not counted in their
        # timeout), `queue_timeout` in all.
        waited = time.monotonic()
        try:
            async with asyncio.timeout(req.queue_timeout):
                held, made = await self._turn(spec, begun, waited + req.queue_timeout)
        except TimeoutError:
            made = ResourceExhaustedError(
                f"the verification waited {req.queue_timeout:g}s for room on the node ({self.queue.waiting} waiting)"
            )
        common["queued"] = time.monotonic() - waited
        if isinstance(made, SandboxError):
            return self._counted(agent_sb, self._failed(made, None, t0, common))
        try:
            return self._counted(agent_sb, await self._check(made.id, req, t0, common))
        finally:
            try:
                if not req.keep:
                    await self._stop(made.id)
            finally:
                self.queue.release(held)

    async def _turn(
        self, spec: SandboxSpec, begun: Callable[[], Awaitable[None]] | None, deadline: float
    ) -> tuple[float, SandboxInfo | SandboxError]:
        """The checks' CPUs (first come, first served), then their sandbox: (the CPUs held, the
        sandbox), or (0, why it could not be made). A node that cannot admit it yet gets the CPUs
        back for the checks behind, while this one backs off and queues again, until `deadline`
        (monotonic). `begun` is called at the first turn."""
        delay = 0.1
        while True:
            held = await self.queue.acquire(spec.resources.cpu)
            made: SandboxInfo | SandboxError
            try:
                if begun is not None:
                    await begun()
                    begun = None
                try:
                    made = await self._create(spec)
                except SandboxError as exc:
                    made = exc
            except BaseException:
                self.queue.release(held)
                raise
            if isinstance(made, SandboxInfo):
                return held, made
            self.queue.release(held)
            if not isinstance(made, ResourceExhaustedError) or time.monotonic() + delay > deadline:
                return 0.0, made
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def _create(self, spec: SandboxSpec) -> SandboxInfo:
        """The verifier's sandbox. The create runs in a task of its own: a verification cancelled
        meanwhile still stops the sandbox once made."""
        task = asyncio.ensure_future(self.creation.create(spec, cpu_held=True))
        self._creating.add(task)
        task.add_done_callback(self._creating.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._stop_made)
            raise

    def _stop_made(self, task: asyncio.Task[SandboxInfo]) -> None:
        if not task.cancelled() and task.exception() is None:
            with contextlib.suppress(SandboxError):
                self.core.spawn(self._stop(task.result().id), name=f"stop-verifier-{task.result().id}")

    async def _stop(self, vid: str) -> None:
        try:
            await self.core.stop(vid, reason="user")
        except SandboxError as exc:  # it is gone already, or the reaper retries the stop
            log.warning("verifier sandbox %s: %s", vid, exc)

    @staticmethod
    def _verifier_spec(
        base: SandboxSpec, changes: str, req: VerifyRequest, sandbox_id: str, cpus: float
    ) -> SandboxSpec:
        """`cpus`: the most CPU the checks may use (the queue's capacity)."""
        resources = req.resources or base.resources
        cpu = min(resources.cpu, cpus)
        labels = {**base.labels, VERIFY_LABEL: sandbox_id, **({KEPT_LABEL: "true"} if req.keep else {})}
        return SandboxSpec(
            backend=base.backend,
            image=base.image,
            layers=[*base.layers, changes, *req.layers],
            # The checks are CPU-bound: admission counts all of their limit, not an idle agent's request.
            resources=resources.model_copy(update={"cpu": cpu, "cpu_request": cpu}),
            env=base.env,
            workdir=base.workdir,
            user=base.user,
            labels=labels,
            project=base.project,  # the agent's: it sees (and keeps) its verifiers, others do not
            idle_ttl=req.timeout + 120,
            network=NetworkPolicy(),  # checks never reach out
            options=base.options,
        )

    def _counted(self, agent_sb: Sandbox, result: VerifyResult) -> VerifyResult:
        self.core.metrics.verifications.labels(outcome=result.cause or "passed").inc()
        self.core.jobs.verified(agent_sb, result)
        return result

    def _failed(self, exc: SandboxError, vid: str | None, t0: float, common: dict[str, Any]) -> VerifyResult:
        """A verification whose checks could not run, or not to their end."""
        # A request error here is the task's (a verifier layer not found, a checker that cannot start).
        cause: Cause = "verifier" if exc.cause == "caller" else exc.cause
        return VerifyResult(
            passed=False,
            reward=0.0,
            cause=cause,
            error=ErrorBody.model_validate({**exc.to_wire(), "cause": cause}),
            verifier_sandbox_id=vid,
            duration=time.perf_counter() - t0,
            **common,
        )

    async def _check(self, vid: str, req: VerifyRequest, t0: float, common: dict[str, Any]) -> VerifyResult:
        try:
            result = await self.execs.exec(
                vid,
                ExecRequest(
                    command=req.command,
                    cwd=req.cwd,
                    env=req.env,
                    timeout=req.timeout,
                    cpu_time=req.cpu_time,
                    output_limit=req.output_limit,
                ),
            )
        except SandboxError as exc:
            return self._failed(exc, vid, t0, common)
        verdict = _cause(result, req)
        passed = verdict is None
        reward = 1.0 if passed else 0.0
        if req.reward_file is not None and verdict in (None, "agent"):
            try:
                text = (await self.files.read_file(vid, req.reward_file, length=64)).decode(errors="replace")
                reward = float(text.strip())
            except (SandboxError, ValueError):
                verdict, passed, reward = "verifier", False, 0.0  # the checks promised a reward and wrote none
        return VerifyResult(
            passed=passed,
            reward=reward,
            cause=verdict,
            result=result.model_copy(update={"cause": verdict}),
            verifier_sandbox_id=vid,
            duration=time.perf_counter() - t0,
            **common,
        )


def _inside(paths: list[str], what: str) -> list[str]:
    """Absolute paths of the sandbox as relative ones of its root (each below /)."""
    out = []
    for path in paths:
        try:
            out.append(inside_path(path))
        except InvalidArgumentError:
            raise InvalidArgumentError(f"{what}: {path[:200]!r} must name something below /") from None
    return out


def interrupted(why: str) -> VerifyResult:
    """The verdict of a verification the node lost (the daemon was killed while it ran): `infra`."""
    exc = UnavailableError(why, cause="infra")
    return VerifyResult(
        passed=False, reward=0.0, cause="infra", error=ErrorBody.model_validate(exc.to_wire()), changed=[], duration=0.0
    )


def _kept(change: ChangedFile, protect: list[str], allow: list[str] | None) -> bool:
    """Whether the agent's change reaches the checks: not protected, and under `allow` if given (a
    directory on the way to an allowed path is kept as a plain directory)."""
    rel = change.path.lstrip("/")
    if _under(rel, protect):
        return False
    if allow is None or _under(rel, allow):
        return True
    return change.type == "dir" and change.change != "deleted" and _above(rel, allow)
