"""Stateless calls (the fncall tier): `run_code` on a worker sandbox, or on one of the node's pools.

A worker is a sandbox of the fncall tier with a warm interpreter (backends/fncall/zygote.py) started in
it through the agent on its first call; each call is one request to it (a framed JSON document) and two
JSON lines back (`taken`, then the result: an interpreter that died before `taken` never started the
call, which runs once on its successor), and runs in a fresh process forked from it (see zygote.py for
what is wiped between calls). A worker serves one call at a time, so the sandbox's limits (memory, pids)
are the call's. Pools of workers are kept per (project, image, resources): the project is the trust
domain, so workers are never shared between projects (a worker carries its project like any sandbox: its
tokens see it, a restarted daemon adopts it back into that project's pool). A call takes an idle worker,
or creates one while under `max_workers` (workers being made count), or waits for one (no longer than
its own timeout: then `resource_exhausted`); idle workers above `workers` stop after `worker_idle`
seconds (their idle TTL).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import itertools
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandfleet.backends.config import FncallBackendConfig
from sandfleet.backends.fncall import forking, residue, zygote
from sandfleet.backends.fncall.zygote import HEADER, MAGIC
from sandfleet.daemon.errormap import to_wire_error
from sandfleet.daemon.node.core import EventStream, NodeCore, wire_text
from sandfleet.daemon.node.creation import Creation
from sandfleet.daemon.node.lifecycle import Sandbox
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.errors import InvalidArgumentError, ResourceExhaustedError, SandboxError, UnavailableError
from sandfleet.models import ErrorBody, ExecResult, Resources, RunCodeBatchItem, RunCodeRequest, SandboxSpec
from sandfleet.runtime.agent_errors import AgentError, ExecStartError
from sandfleet.runtime.agent_exec import ExecProcess
from sandfleet.runtime.agent_wire import ExitInfo, OutputChunk


def _bundle() -> str:
    """zygote.py as one `python3 -I -c` program: residue.py and forking.py, which it imports, are
    made modules of those names from their text first (the worker's image has no sandfleet)."""
    text = "import sys, types\n"
    for module in (residue, forking):  # in the order they import each other
        path = Path(str(module.__file__))
        text += (
            f"m = types.ModuleType({module.__name__!r})\n"
            f"exec(compile({path.read_text()!r}, {path.name!r}, 'exec'), m.__dict__)\n"
            "sys.modules[m.__name__] = m\n"
        )
    main = Path(zygote.__file__).read_text()
    return text + f"exec(compile({main!r}, 'zygote.py', 'exec'), {{'__name__': '__main__'}})\n"


ZYGOTE_SOURCE = _bundle()  # run in a worker as `python3 -I -c`
DEFAULT_IMAGE = "python"
POOL_LABEL = "sandfleet.fncall-pool"
START_TIMEOUT = 30.0  # the interpreter's start (and its preloads) in a fresh worker
GRACE = 5.0  # past a call's own timeout: how long the zygote may take to answer
SETTLE_TIMEOUT = 60.0  # how long a worker may take to remove what its last call left (answered already)
CAPACITY_WAIT = 10.0  # how long a pooled call waits for a full node to take a new worker


@dataclass(eq=False)
class _Zygote:
    """The warm interpreter of one worker sandbox and the call it is running."""

    sandbox_id: str
    proc: ExecProcess
    ready: asyncio.Future[None]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    buf: bytearray = field(default_factory=bytearray)
    waiting: asyncio.Future[dict[str, Any]] | None = None
    dead: bool = False
    ids: itertools.count[int] = field(default_factory=itertools.count)
    taken: int | None = None  # the last call the supervisor said it read
    # Nothing of the last call is left (the supervisor answers first, then cleans): set by the
    # line `settled`, a fresh start (`ready`) or the interpreter's end.
    settled: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.settled.set()

    def feed(self, data: bytes) -> None:
        self.buf += data
        while (nl := self.buf.find(b"\n")) >= 0:
            line, self.buf = bytes(self.buf[:nl]), self.buf[nl + 1 :]
            msg = json.loads(line)
            if msg.get("ready"):
                self.settled.set()
                if not self.ready.done():
                    self.ready.set_result(None)
            elif "settled" in msg:
                self.settled.set()
            elif "taken" in msg:
                self.taken = msg["taken"]
            elif self.waiting is not None and not self.waiting.done():
                self.waiting.set_result(msg)

    def fail(self, exc: BaseException) -> None:
        self.dead = True
        self.settled.set()  # whoever waits sees it dead
        for fut in (self.ready, self.waiting):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: nobody may be waiting any more


class _NotTaken(UnavailableError):
    """The worker's interpreter died before it read the call: nothing of the call ran."""


@dataclass(eq=False)
class _Pool:
    spec: SandboxSpec
    idle: list[str] = field(default_factory=list)
    members: set[str] = field(default_factory=set)
    creating: int = 0  # workers being made for calls: they count toward max_workers
    # Calls waiting for a worker of this pool, longest first: woken one at a time, as one is freed.
    waiting: collections.deque[asyncio.Future[None]] = field(default_factory=collections.deque)

    def notify(self) -> None:
        """A worker was freed, or there is room for a new one (a member gone, a call that was to make
        one gave up): wake the longest waiting."""
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_result(None)
                return

    async def freed(self, timeout: float) -> None:
        """Until `notify` (TimeoutError after `timeout` seconds)."""
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        try:
            async with asyncio.timeout(timeout):
                await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.notify()  # woken as it gave up: the next in line has it
            else:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(fut)
            raise


def _request(req: RunCodeRequest, call_id: int) -> bytes:
    files = {name: base64.b64encode(text.encode()).decode() for name, text in req.files.items()}
    files.update(req.files_b64)
    stdin = req.stdin_bytes()
    msg = {
        "id": call_id,
        "language": req.language,
        "code": req.code,
        "stdin": base64.b64encode(stdin).decode() if stdin else None,
        "files": files,
        "env": req.env,
        "timeout": req.timeout,
        "cap": req.output_limit,
    }
    body = json.dumps(msg).encode()
    return HEADER.pack(MAGIC, len(body)) + body  # read to the byte by the call's supervisor


def _result(msg: dict[str, Any], req: RunCodeRequest) -> ExecResult:
    if "error" in msg:
        raise UnavailableError(f"the worker could not run the call: {msg['error']}"[:500])
    ex = ExitInfo.from_raw(int(msg["status"]), 0, 0, 0, 0)
    out, err = base64.b64decode(msg["out"]), base64.b64decode(msg["err"])
    return ExecResult(
        exit_code=ex.exit_code,
        signal=ex.signal,
        stdout=wire_text(out, req.encoding),
        stderr=wire_text(err, req.encoding),
        duration=float(msg["duration"]),
        timed_out=bool(msg["timed_out"]),
        stdout_truncated=int(msg["out_n"]) > len(out),
        stderr_truncated=int(msg["err_n"]) > len(err),
        encoding=req.encoding,
    )


def _pool_spec(spec: SandboxSpec) -> SandboxSpec:
    """What identifies a pool: the fields a pooled call can choose (the stored spec of a worker also
    carries its image's defaults)."""
    return SandboxSpec(
        backend="fncall",
        image=spec.image,
        resources=spec.resources,
        idle_ttl=spec.idle_ttl,
        labels={POOL_LABEL: "1"},
        project=spec.project,
    )


class Calls:
    def __init__(self, core: NodeCore, pauser: Pauser, creation: Creation) -> None:
        self.core = core
        self.pauser = pauser
        self.creation = creation
        self._zygotes: dict[str, _Zygote] = {}
        self._pools: dict[str, _Pool] = {}
        # (project, image, resources) as called
        self._by_choice: dict[tuple[str | None, str | None, str | None], _Pool] = {}
        self._starting: dict[str, asyncio.Future[_Zygote]] = {}
        core.table.on_stopped(self._forget)

    @property
    def config(self) -> FncallBackendConfig:
        tier = self.core.tier_for("fncall")
        config = getattr(tier, "fncall_config", None)
        return config if isinstance(config, FncallBackendConfig) else FncallBackendConfig()

    def _forget(self, sb: Sandbox) -> None:
        z = self._zygotes.pop(sb.id, None)
        if z is not None:
            z.fail(UnavailableError(f"worker {sb.id} stopped"))
        for pool in self._pools.values():
            if sb.id in pool.members:
                pool.members.discard(sb.id)
                pool.notify()  # room for a new worker
            with contextlib.suppress(ValueError):
                pool.idle.remove(sb.id)

    # -- one worker -----------------------------------------------------------------------------

    async def run_in(self, sandbox_id: str, req: RunCodeRequest) -> ExecResult:
        """A call on the worker sandbox `sandbox_id` (of the fncall tier)."""
        sb = self.core.sandbox(sandbox_id)
        if sb.spec.backend != "fncall":
            raise InvalidArgumentError(
                f"sandbox {sandbox_id} is of the {sb.spec.backend} tier: run_code needs a sandbox of the fncall tier"
            )
        if req.image is not None or req.resources is not None or req.project is not None:
            raise InvalidArgumentError("image, resources and project are the pool's: a worker sandbox has its own")
        # A worker of the caller's own, which it may look into: clean when the call returns.
        return await self._run_on(sandbox_id, req, settled=True)

    async def _run_on(self, sandbox_id: str, req: RunCodeRequest, *, settled: bool = False) -> ExecResult:
        sb, _live = await self.pauser.ready(sandbox_id)
        self.core.touch(sb)
        z = await self._zygote(sb)
        try:
            async with z.lock:
                result = await self._call(sb, z, req, settled)
        except _NotTaken:
            # The interpreter died (killed from inside the worker, say) before it read the call: the
            # call never started, so it runs once on the successor.
            z = await self._zygote(sb)
            async with z.lock:
                result = await self._call(sb, z, req, settled)
        self.core.touch(sb)
        self.core.journal.record(sb.id, "call", {"language": req.language, "exit_code": result.exit_code})
        return result

    async def _zygote(self, sb: Sandbox) -> _Zygote:
        z = self._zygotes.get(sb.id)
        if z is not None and not z.dead:
            return z
        starting = self._starting.get(sb.id)
        if starting is None:
            starting = asyncio.ensure_future(self._start_zygote(sb))
            self._starting[sb.id] = starting
            starting.add_done_callback(lambda _f: self._starting.pop(sb.id, None))
        return await asyncio.shield(starting)

    async def _start_zygote(self, sb: Sandbox) -> _Zygote:
        live = sb.live
        if live is None:
            raise UnavailableError(f"sandbox {sb.id} is not running")
        argv = ["python3", "-I", "-c", ZYGOTE_SOURCE, *self.config.preload]
        try:
            proc = await live.channel.start(argv, cwd="/", stdin=True, out_cap=None, nondump=False)
        except ExecStartError as exc:
            raise InvalidArgumentError(
                f"sandbox {sb.id} cannot run calls: its image has no python3 ({exc})"[:500]
            ) from exc
        except AgentError as exc:
            raise UnavailableError(f"sandbox {sb.id}: {exc}") from exc
        z = _Zygote(sb.id, proc, asyncio.get_running_loop().create_future())
        self.core.spawn(self._read(z), name=f"zygote-{sb.id}")
        try:
            await asyncio.wait_for(asyncio.shield(z.ready), START_TIMEOUT)
        except (TimeoutError, SandboxError) as exc:
            with contextlib.suppress(AgentError):
                await proc.signal(9)
            raise UnavailableError(f"the warm interpreter of {sb.id} did not start") from exc
        self._zygotes[sb.id] = z
        return z

    async def _read(self, z: _Zygote) -> None:
        err = bytearray()
        try:
            async for ev in z.proc.events():
                if isinstance(ev, OutputChunk):
                    if ev.stream == "stdout":
                        z.feed(ev.data)
                    elif len(err) < 4096:
                        err += ev.data
            reason = f"the worker's interpreter exited: {bytes(err).decode(errors='replace')[-300:]}".strip()
        except (AgentError, ValueError) as exc:
            reason = f"the worker's interpreter is gone: {exc}"
        z.fail(UnavailableError(reason))
        if self._zygotes.get(z.sandbox_id) is z:
            del self._zygotes[z.sandbox_id]

    async def _call(self, sb: Sandbox, z: _Zygote, req: RunCodeRequest, settled: bool = False) -> ExecResult:
        """The call on `z`, once the last one is settled (its cleanup is not this call's time);
        `settled`: also this one's before returning."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        call_id = next(z.ids)
        try:
            await self._settled(sb, z)
            if z.dead:
                raise _NotTaken("the worker's interpreter exited before the call")
            z.waiting = fut
            z.settled.clear()
            await z.proc.write_stdin(_request(req, call_id))
            try:
                try:
                    async with asyncio.timeout(req.timeout + GRACE):
                        msg = await fut
                except TimeoutError:
                    if not fut.done() or fut.cancelled():
                        raise
                    msg = fut.result()  # it came in the turn the timeout fired (its error too)
            except UnavailableError as exc:
                if z.dead and z.taken != call_id:
                    raise _NotTaken(str(exc)) from exc
                raise
        except TimeoutError as exc:
            # A worker that does not answer is not trusted with another call.
            z.fail(UnavailableError(f"worker {sb.id} did not answer its call"))
            self.core.spawn(self._stop_quietly(sb.id), name=f"stop-{sb.id}")
            raise UnavailableError(f"worker {sb.id} did not answer its call") from exc
        except AgentError as exc:
            raise UnavailableError(f"worker {sb.id} is gone: {exc}") from exc
        finally:
            z.waiting = None
        result = _result(msg, req)
        if settled:
            with contextlib.suppress(UnavailableError):  # answered: a worker lost now fails the next call
                await self._settled(sb, z)
        return result

    async def _settled(self, sb: Sandbox, z: _Zygote) -> None:
        """Wait until nothing of the worker's last call is left; one that never gets there is stopped."""
        if z.settled.is_set():
            return
        try:
            await asyncio.wait_for(z.settled.wait(), SETTLE_TIMEOUT)
        except TimeoutError:
            z.fail(UnavailableError(f"worker {sb.id} did not clean up after its last call"))
            self.core.spawn(self._stop_quietly(sb.id), name=f"stop-{sb.id}")
            raise UnavailableError(f"worker {sb.id} did not clean up after its last call") from None

    # -- pools ----------------------------------------------------------------------------------

    async def run(self, req: RunCodeRequest) -> ExecResult:
        """A call on a pooled worker of (project, image, resources)."""
        self.core.tier_for("fncall")
        # The pool by what the call chose, looked up before any model is built (the one-call path).
        fast = (req.project, req.image, None if req.resources is None else req.resources.model_dump_json())
        pool = self._by_choice.get(fast)
        if pool is None:
            spec = _pool_spec(
                SandboxSpec(
                    backend="fncall",
                    image=req.image or DEFAULT_IMAGE,
                    resources=req.resources or Resources(),
                    idle_ttl=self.config.worker_idle,
                    project=req.project,
                )
            )
            key = spec.model_dump_json()
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = self._adopt_pool(spec, key)
            self._by_choice[fast] = pool
        sid = await self._take(pool, time.monotonic() + req.timeout)
        try:
            result = await self._run_on(sid, req)
        except BaseException:
            self._give_back(pool, sid, broken=True)
            raise
        self._give_back(pool, sid)
        return result

    def _adopt_pool(self, spec: SandboxSpec, key: str) -> _Pool:
        """A new pool, with the workers of this spec a previous daemon left running (their warm
        interpreters start again on their next call)."""
        pool = _Pool(spec)
        for sb in self.core.matching({POOL_LABEL: "1"}, ("running", "paused")):
            if _pool_spec(sb.spec).model_dump_json() == key:
                pool.members.add(sb.id)
                pool.idle.append(sb.id)
        return pool

    async def run_many(self, reqs: list[RunCodeRequest]) -> EventStream[RunCodeBatchItem]:
        """Every call at once (each waits for a worker of its pool); outcomes in completion order.
        Closing the stream early cancels the calls still running."""

        async def one(i: int, req: RunCodeRequest) -> RunCodeBatchItem:
            try:
                return RunCodeBatchItem(index=i, result=await self.run(req))
            except Exception as exc:  # noqa: BLE001 (one call's failure is its own, typed)
                return RunCodeBatchItem(index=i, error=ErrorBody.model_validate(to_wire_error(exc).to_wire()))

        tasks = [asyncio.ensure_future(one(i, req)) for i, req in enumerate(reqs)]

        async def items() -> AsyncGenerator[RunCodeBatchItem, None]:
            try:
                for next_done in asyncio.as_completed(tasks):
                    yield await next_done
            finally:
                for t in tasks:
                    t.cancel()

        async def release() -> None:
            for t in tasks:
                t.cancel()

        return EventStream(items(), release)

    async def _take(self, pool: _Pool, deadline: float) -> str:
        """An idle worker of the pool, or a new one while under `max_workers`, or the next freed.
        A create the node refuses for now (a full node: retryable) is tried again, or a freed
        worker taken, until the call's own deadline (monotonic)."""
        backoff = 0.05
        started = time.monotonic()
        evicted = False
        try:
            while True:
                while True:
                    while pool.idle:
                        sid = self._pick(pool.idle)
                        sb = self.core.table.find(sid)
                        if sb is not None and sb.state in ("running", "paused"):
                            return sid
                        pool.members.discard(sid)
                    if len(pool.members) + pool.creating < self.config.max_workers:
                        break
                    try:  # every worker busy: the next freed, within the call's own timeout
                        await pool.freed(max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        raise ResourceExhaustedError(
                            f"all {self.config.max_workers} workers of this pool stayed busy for the call's timeout"
                        ) from None
                pool.creating += 1
                try:
                    info = await self.creation.create(pool.spec)
                except BaseException as exc:
                    pool.creating -= 1
                    if not isinstance(exc, ResourceExhaustedError):
                        raise
                    if not evicted and await self._evict_idle(pool):
                        evicted = True  # once: a node full of CPU load is not relieved by stopping idle workers
                        continue  # an idle worker of another pool made room
                    left = min(deadline, started + CAPACITY_WAIT) - time.monotonic()
                    if left <= 0:
                        raise
                    with contextlib.suppress(TimeoutError):  # a worker of this pool freed meanwhile serves as well
                        await pool.freed(min(backoff, left))
                    backoff = min(backoff * 2, 1.0)
                    continue
                pool.creating -= 1
                pool.members.add(info.id)
                return info.id
        except BaseException:
            if len(pool.members) + pool.creating < self.config.max_workers:
                pool.notify()  # room this call leaves unused: a waiting call's to try for itself
            raise

    async def _evict_idle(self, keep: _Pool) -> bool:
        """Stop one idle worker of another pool (the node is full: pools must not starve each other)."""
        for pool in self._pools.values():
            if pool is not keep and pool.idle:
                sid = pool.idle.pop(0)  # the longest idle
                pool.members.discard(sid)
                await self._stop_quietly(sid, reason="evicted")
                return True
        return False

    def _pick(self, idle: list[str]) -> str:
        """The most recently freed idle worker whose last call is settled, else the most recent."""
        for i in range(len(idle) - 1, -1, -1):
            z = self._zygotes.get(idle[i])
            if z is None or z.settled.is_set():
                return idle.pop(i)
        return idle.pop()

    def _give_back(self, pool: _Pool, sid: str, *, broken: bool = False) -> None:
        z = self._zygotes.get(sid)
        if broken and (z is None or z.dead):
            pool.members.discard(sid)
            if self.core.table.find(sid) is not None:
                self.core.spawn(self._stop_quietly(sid), name=f"stop-{sid}")
        elif sid in pool.members:
            pool.idle.append(sid)
        pool.notify()

    async def _stop_quietly(self, sid: str, reason: str = "error") -> None:
        with contextlib.suppress(SandboxError):
            await self.core.stop(sid, reason=reason)

    def stats(self) -> dict[str, int]:
        return {"workers": sum(len(p.members) for p in self._pools.values()), "zygotes": len(self._zygotes)}
