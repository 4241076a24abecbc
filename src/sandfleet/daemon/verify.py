"""Verification apart from the agent: a task's checks run in a fresh sandbox, never in the agent's.

The verifier's sandbox is the agent sandbox's pre-agent state (its image and layers), plus what the
agent changed (its writable layer, exported as one layer of the store), plus verifier-only layers
(hidden tests) on top, which no agent sandbox ever mounts. Changes under `protect` (the visible
tests, a grader script) are dropped before the layer is made, and the hidden layers sit above the
agent's anyway: an agent that edits the tests, or writes files where the hidden tests will be, is
graded on the real ones. The agent's sandbox keeps running, untouched.

Whose fault a failed verification is: the checks ran and failed with one of `agent_exit_codes`
-> `agent`; they ran out of time -> `timeout`; anything else they did (another exit code, a signal,
the OOM killer, a command not found) -> `verifier`; the node could not make the verifier's sandbox
-> `infra` (or the error's own cause).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandfleet.backends.base import LayerView
from sandfleet.daemon.core import NodeCore
from sandfleet.daemon.creation import Creation
from sandfleet.daemon.execs import Execs
from sandfleet.daemon.files import Files
from sandfleet.daemon.snapshots import Snapshots, inside_path
from sandfleet.errors import Cause, InvalidArgumentError, SandboxError
from sandfleet.models import (
    ChangedFile,
    ErrorBody,
    ExecRequest,
    ExecResult,
    NetworkPolicy,
    SandboxSpec,
    VerifyRequest,
    VerifyResult,
)

CAPACITY_WAIT = 300.0  # seconds a verification waits for the node to admit its sandbox
MAX_CHANGED = 10_000
MAX_LAYERS = 32  # SandboxSpec.layers' bound  # files listed in a result at most
VERIFY_LABEL = "sandfleet.verify"  # on a verifier's sandbox: the id of the sandbox it verifies


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


def _cause(result: ExecResult, req: VerifyRequest) -> Cause | None:
    if result.exit_code == 0 and not result.timed_out:
        return None
    if result.timed_out:
        return "timeout"
    if result.signal is None and not result.oom_killed and result.exit_code in req.agent_exit_codes:
        return "agent"
    return "verifier"


class Verifier:
    def __init__(self, core: NodeCore, creation: Creation, execs: Execs, files: Files, snapshots: Snapshots) -> None:
        self.core = core
        self.creation = creation
        self.execs = execs
        self.files = files
        self.snapshots = snapshots

    async def verify(self, sandbox_id: str, req: VerifyRequest, *, since_snapshot: str | None = None) -> VerifyResult:
        """Grade the agent sandbox `sandbox_id` (see the module's docstring). `since_snapshot`: the
        set-up snapshot it was restored from, so `changed` lists only what the agent did."""
        t0 = time.perf_counter()
        protect = [inside_path(p) for p in req.protect]
        sb = self.core.sandbox(sandbox_id)
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
        agent_sb, layer, _, changed = await self.snapshots.changes_layer(
            sandbox_id, protect, lambda upper: list_changes(upper, lowers, baseline)
        )
        dropped = [c.path for c in changed if _under(c.path.lstrip("/"), protect)]
        base = agent_sb.spec
        try:
            spec = self._verifier_spec(base, layer.digest, req, sandbox_id)
        except ValidationError as exc:  # the agent's spec and the request were each valid; together not
            raise InvalidArgumentError(
                f"the verifier's sandbox cannot be made: {exc.errors()[0]['msg']}"[:300]
            ) from exc
        common = {"changed": changed, "dropped": dropped, "changes_layer": layer.digest}
        try:
            info = await self.creation.create_when_admitted(spec, CAPACITY_WAIT)
        except SandboxError as exc:
            return self._failed(exc, None, t0, common)
        try:
            return await self._check(info.id, req, t0, common)
        finally:
            if not req.keep:
                await self.core.stop(info.id, reason="user")

    @staticmethod
    def _verifier_spec(base: SandboxSpec, changes: str, req: VerifyRequest, sandbox_id: str) -> SandboxSpec:
        return SandboxSpec(
            backend=base.backend,
            image=base.image,
            layers=[*base.layers, changes, *req.layers],
            resources=req.resources or base.resources,
            env=base.env,
            workdir=base.workdir,
            user=base.user,
            labels={**base.labels, VERIFY_LABEL: sandbox_id},
            idle_ttl=req.timeout + 120,
            network=NetworkPolicy(),  # checks never reach out
            options=base.options,
        )

    def _failed(self, exc: SandboxError, vid: str | None, t0: float, common: dict[str, Any]) -> VerifyResult:
        """A verification whose checks could not run, or not to their end."""
        # A request error here is the task's (a verifier layer not found, a checker that cannot start).
        cause: Cause = "verifier" if exc.cause == "caller" else exc.cause
        self.core.metrics.verifications.labels(outcome=cause).inc()
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
                    command=req.command, cwd=req.cwd, env=req.env, timeout=req.timeout, output_limit=req.output_limit
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
        self.core.metrics.verifications.labels(outcome=verdict or "passed").inc()
        return VerifyResult(
            passed=passed,
            reward=reward,
            cause=verdict,
            result=result.model_copy(update={"cause": verdict}),
            verifier_sandbox_id=vid,
            duration=time.perf_counter() - t0,
            **common,
        )
