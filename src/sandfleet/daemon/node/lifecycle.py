"""The bottom of the node service: the sandbox table, its state machine, and the event journal.

Every other part of the service (create, exec, sessions, files, pause, snapshots, the reaper) reads
sandboxes from the table and changes their state only through `SandboxTable.move`, which checks the
transition against `TRANSITIONS`: a call that finds a sandbox in the wrong state gets a typed
`WrongStateError`, never a silently corrupted state. The per-state counts live in the table (one per
service instance): admission reads them on every create, and counting 5,000 entries each time shows.

Parts of the service that keep per-sandbox resources register a stop hook (`on_stopped`) instead of
the stop path calling up into them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

from sandfleet.backends.base import LiveSandbox
from sandfleet.daemon.node.state import StateStore
from sandfleet.errors import Cause, SandboxNotFoundError, WrongStateError
from sandfleet.ids import new_id
from sandfleet.models import PROJECT_LABEL, ExecResult, SandboxEvent, SandboxInfo, SandboxSpec, SandboxState
from sandfleet.runtime.agent_exec import ExecProcess
from sandfleet.runtime.agent_wire import SESSION_FDS, CommandExit, OutputChunk

log = logging.getLogger("sandfleet.daemon")

CREATING: Final = "creating"
RUNNING: Final = "running"
PAUSED: Final = "paused"
STOPPING: Final = "stopping"
STOPPED: Final = "stopped"
FAILED: Final = "failed"

# Which state may follow which. A sandbox enters the table in the state it starts in: `creating`
# (a create or restore), `running` (a warm pool member handed out, one adopted after a restart), or
# a terminal one (a row a restart found dead).
TRANSITIONS: Final[Mapping[str, frozenset[str]]] = {
    CREATING: frozenset({RUNNING, FAILED}),
    RUNNING: frozenset({PAUSED, STOPPING}),
    PAUSED: frozenset({RUNNING, STOPPING}),
    STOPPING: frozenset({STOPPED, FAILED}),
    FAILED: frozenset({STOPPING}),  # a stop that failed is retried
    STOPPED: frozenset(),
}
LIVE_STATES: Final = frozenset({CREATING, RUNNING, PAUSED, STOPPING})
HOLDING_STATES: Final = frozenset({RUNNING, PAUSED})  # hold node resources and can take requests


def new_sandbox_id(node_key: str) -> str:
    return new_id("sb", node_key)


@dataclass
class User:
    uid: int
    gid: int
    home: str


@dataclass
class BackgroundProcess:
    id: str
    command: str | list[str]
    started_at: float
    process: ExecProcess
    encoding: str = "utf-8"
    limit: int = 1024**2
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    result: ExecResult | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    lost: str | None = None  # why it will never finish (its sandbox stopped, the agent went away)
    finished_at: float = 0.0  # time.monotonic() when it finished (the finished are kept newest first)
    # Who follows its output as it comes (process_output.py): each chunk kept, then None at its end.
    followers: list[asyncio.Queue[tuple[str, bytes] | None]] = field(default_factory=list)

    def output(self, stream: str, data: bytes) -> None:
        """A chunk of its output: kept up to its limit (the agent caps it too), and passed on."""
        buf = self.stdout if stream == "stdout" else self.stderr
        kept = data[: max(0, self.limit - len(buf))]
        buf.extend(kept)
        if kept:
            for q in self.followers:
                q.put_nowait((stream, kept))

    def ended(self) -> None:
        """It finished, or will never report (its sandbox stopped): once, whoever says it first."""
        if self.done.is_set():
            return
        self.finished_at = time.monotonic()
        self.done.set()
        for q in self.followers:
            q.put_nowait(None)


# Finished background processes a sandbox keeps (the latest to finish), by count and by their output's bytes:
# a loop of starts must not make the daemon hold everything each one printed. Running ones are kept.
MAX_FINISHED_PROCESSES = 1024
MAX_FINISHED_OUTPUT = 64 * 1024**2


def forget_finished(sb: Sandbox) -> None:
    """Drop the background processes of the sandbox that finished longest ago past
    MAX_FINISHED_PROCESSES or MAX_FINISHED_OUTPUT (asked for later, they are `not_found`)."""
    finished = [bp for bp in sb.processes.values() if bp.done.is_set()]
    count, size = len(finished), sum(_output_held(bp) for bp in finished)
    if count <= MAX_FINISHED_PROCESSES and size <= MAX_FINISHED_OUTPUT:
        return
    for bp in sorted(finished, key=lambda bp: bp.finished_at):
        if count <= MAX_FINISHED_PROCESSES and size <= MAX_FINISHED_OUTPUT:
            break
        del sb.processes[bp.id]
        count, size = count - 1, size - _output_held(bp)


def _output_held(bp: BackgroundProcess) -> int:
    r = bp.result
    return len(bp.stdout) + len(bp.stderr) + (len(r.stdout) + len(r.stderr) if r is not None else 0)


@dataclass
class CommandRun:
    """One command of a session, while it runs: its output (the agent caps it) and its end."""

    limit: int
    encoding: str
    out: bytearray = field(default_factory=bytearray)
    err: bytearray = field(default_factory=bytearray)
    ended: asyncio.Future[CommandExit] | None = None
    stream: asyncio.Queue[OutputChunk | CommandExit | None] | None = None
    stdin_open: bool = False
    seq: int = 0  # echoed by the agent's SEXIT: a late report of an abandoned command is not ours


@dataclass
class Session:
    """A shell whose commands the agent frames: the shell reports each status through a socket
    only it can write (checked by the kernel's credentials), never through its output streams."""

    id: str
    shell: str
    created_at: float
    process: ExecProcess
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    current: CommandRun | None = None
    dead: bool = False
    next_seq: int = 0
    pty: bool = False  # the shell's stdout, stderr and its commands' stdin are a pseudo-terminal
    fds: tuple[int, int] = SESSION_FDS  # (status, command stdin) in the shell: SESSION_LOW_FDS for dash


# Why a sandbox stopped -> whose fault a call on it is. A stop asked for is the caller's; a TTL is a
# timeout; anything else (its init gone: nothing in the sandbox can kill it; a lost daemon, a failed
# create, an eviction) is the infrastructure's. A command the OOM killer ended is the agent's: its
# result says so (`oom_killed`, cause agent).
GONE_KEPT = 10_000  # stop reasons remembered of sandboxes no longer listed

_STOP_CAUSES: dict[str, Cause] = {
    "user": "caller",
    "idle_ttl": "timeout",
    "max_lifetime": "timeout",
    "never claimed": "caller",
    "invalid user": "caller",
}


def stop_cause(reason: str | None) -> Cause:
    """Whose fault it is that a sandbox stopped for `reason` (its `stop_reason`)."""
    return _STOP_CAUSES.get(reason or "", "infra")


@dataclass(eq=False)
class Sandbox:
    """One sandbox as the service tracks it. Its state is read-only here: `SandboxTable.move`
    changes it."""

    id: str
    spec: SandboxSpec
    _state: str
    created_at: float
    last_active_at: float
    live: LiveSandbox | None = None
    stopped_at: float | None = None
    stop_reason: str | None = None
    users: dict[str, User] = field(default_factory=lambda: {"root": User(0, 0, "/root")})
    sessions: dict[str, Session] = field(default_factory=dict)
    processes: dict[str, BackgroundProcess] = field(default_factory=dict)
    inflight: int = 0
    terminals: int = 0  # commands on a pseudo-terminal now (criu cannot dump them: no snapshot meanwhile)
    busy_until: float = 0.0  # the latest deadline (wall clock) of the requests in flight
    unresponsive: bool = False  # its agent stopped answering (reported once)
    stop_task: asyncio.Task[None] | None = None
    stop_failed: bool = False
    created: asyncio.Event = field(default_factory=asyncio.Event)
    oom_kills: int = 0
    oom_noted_at: float = 0.0  # (monotonic) when new OOM kills were last noted, by an exec or the monitor
    pids_hits: int = 0
    # What the monitor saw at its last sweep (a job's CPU and memory in use, its slowest sandboxes).
    cpu_rate: float | None = None  # cores used between its last two reads
    memory_seen: int | None = None  # bytes held at its last full read (or as it was paused)
    tasks_seen: int | None = None  # tasks at its last full read
    # Held by whatever freezes the sandbox's cgroup (pause, resume, a snapshot, an export of its
    # writable layer): two of them at once would thaw it under the other, or never thaw it.
    freeze_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Paused on request (not by the idle policy): kept past its idle TTL, e.g. while its trainer is
    # preempted; max_lifetime still applies.
    held: bool = False
    idempotency_key: str | None = None
    acked: bool = True  # False until the create's answer went out (or someone named it)
    claim_by: float = math.inf  # an unacked sandbox is stopped past this (wall clock)

    @property
    def state(self) -> str:
        return self._state

    def labelled(self, labels: Mapping[str, str]) -> bool:
        for k, v in labels.items():
            if k == PROJECT_LABEL:  # a project selects itself and everything under it
                p = self.spec.project
                if p is None or not (p == v or p.startswith(v + "/")):
                    return False
            elif self.spec.labels.get(k) != v:
                return False
        return True

    def info(self) -> SandboxInfo:
        # Built from values already checked (the spec is a validated model): no validation again,
        # which was most of listing 5,000 sandboxes.
        return SandboxInfo.model_construct(
            id=self.id,
            state=cast(SandboxState, self._state),
            spec=self.spec,
            created_at=self.created_at,
            last_active_at=self.last_active_at,
            stopped_at=self.stopped_at,
            stop_reason=self.stop_reason,
        )


class SandboxTable:
    """The sandboxes a service instance knows, by id, with how many are in each state."""

    def __init__(self) -> None:
        self._by_id: dict[str, Sandbox] = {}
        self._counts: collections.Counter[str] = collections.Counter()
        self._stopped_hooks: list[Callable[[Sandbox], None]] = []
        # Why recently dropped sandboxes stopped: a call naming one is told whose fault it is gone.
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()
        # What each project's live sandboxes hold: [sandboxes, cpu, memory], kept as states change
        # (quotas are checked on every create; summing 10,000 specs each time shows).
        self._projects: dict[str, list[float]] = {}

    def _count_project(self, sb: Sandbox, sign: int) -> None:
        spec = sb.spec
        key = spec.project or ""
        row = self._projects.setdefault(key, [0, 0.0, 0])
        row[0] += sign
        row[1] += sign * spec.resources.cpu
        row[2] += sign * spec.resources.memory
        if row[0] <= 0:
            del self._projects[key]

    def project_usage(self) -> dict[str, tuple[int, float, int]]:
        """Per project ('' for none): live sandboxes, their CPU limits, their memory limits."""
        return {k: (int(v[0]), round(v[1], 6), int(v[2])) for k, v in self._projects.items()}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Sandbox]:
        """A snapshot of the table: callers may add and drop while iterating."""
        return iter(list(self._by_id.values()))

    def find(self, sandbox_id: str) -> Sandbox | None:
        return self._by_id.get(sandbox_id)

    def get(self, sandbox_id: str) -> Sandbox:
        sb = self._by_id.get(sandbox_id)
        if sb is None:
            reason = self._gone.get(sandbox_id)
            if reason is not None:
                raise SandboxNotFoundError(
                    f"sandbox {sandbox_id} not found: it stopped ({reason})", cause=stop_cause(reason)
                )
            raise SandboxNotFoundError(f"sandbox {sandbox_id[:80]} not found")
        return sb

    def add(self, sb: Sandbox) -> None:
        if sb.id in self._by_id:
            raise ValueError(f"sandbox {sb.id} is already in the table")
        if sb.state not in TRANSITIONS:
            raise ValueError(f"sandbox {sb.id}: unknown state {sb.state!r}")
        self._by_id[sb.id] = sb
        self._counts[sb.state] += 1
        if sb.state in LIVE_STATES:
            self._count_project(sb, 1)

    def discard(self, sb: Sandbox) -> bool:
        """Out of the table (and the counts); whether it was there."""
        if self._by_id.get(sb.id) is not sb:
            return False
        del self._by_id[sb.id]
        self._counts[sb.state] -= 1
        if sb.state in LIVE_STATES:
            self._count_project(sb, -1)
        if sb.stop_reason is not None:
            self._gone[sb.id] = sb.stop_reason[:200]
            if len(self._gone) > GONE_KEPT:
                self._gone.popitem(last=False)
        return True

    def count(self, *states: str) -> int:
        return sum(self._counts[s] for s in states)

    def move(self, sb: Sandbox, new: str) -> None:
        """Change a sandbox's state along `TRANSITIONS`; anything else is a `WrongStateError`
        (another request changed it first: a stop during a pause, say)."""
        old = sb.state
        if new not in TRANSITIONS[old]:
            raise WrongStateError(f"sandbox {sb.id} is {old}: it cannot become {new}")
        sb._state = new
        if self._by_id.get(sb.id) is sb:
            self._counts[old] -= 1
            self._counts[new] += 1
            if (old in LIVE_STATES) != (new in LIVE_STATES):
                self._count_project(sb, 1 if new in LIVE_STATES else -1)
        if new == STOPPED:
            for hook in self._stopped_hooks:
                hook(sb)

    @staticmethod
    def require(sb: Sandbox, states: Iterable[str], doing: str) -> None:
        """A call that needs the sandbox in one of `states`, or a `WrongStateError` naming them
        (for a sandbox that is gone, with whose fault that was: `stop_cause`)."""
        wanted = tuple(states)
        if sb.state not in wanted:
            gone = sb.state in (STOPPED, FAILED)
            raise WrongStateError(
                f"sandbox {sb.id} is {sb.state}"
                + (f" ({sb.stop_reason})" if gone and sb.stop_reason else "")
                + f": {doing} needs it {' or '.join(wanted)}",
                cause=stop_cause(sb.stop_reason) if gone else None,
            )

    def on_stopped(self, hook: Callable[[Sandbox], None]) -> None:
        """Call `hook(sandbox)` whenever a sandbox has stopped (its backend released it)."""
        self._stopped_hooks.append(hook)

    def matching(self, labels: Mapping[str, str], states: Iterable[str]) -> list[Sandbox]:
        wanted = frozenset(states)
        return [sb for sb in self._by_id.values() if sb.state in wanted and sb.labelled(labels)]


class EventJournal:
    """Sandbox events, buffered in memory and written to the state store in batches (every 0.2 s,
    and before anything reads them)."""

    FLUSH_INTERVAL = 0.2

    def __init__(self, state: StateStore) -> None:
        self._state = state
        self._pending: list[tuple[str, float, str, dict[str, Any]]] = []
        # See every event as it is recorded (the monitor: audit stream and detectors; the jobs'
        # figures); must not block.
        self.taps: list[Callable[[str, str, dict[str, Any]], None]] = []

    def record(self, sandbox_id: str, kind: str, data: dict[str, Any] | None = None) -> None:
        data = data or {}
        self._pending.append((sandbox_id, time.time(), kind, data))
        for tap in self.taps:
            try:
                tap(sandbox_id, kind, data)
            except Exception:
                log.exception("an event tap failed on a %s event of sandbox %s", kind, sandbox_id)

    async def flush(self) -> None:
        batch, self._pending = self._pending, []
        try:
            await self._state.add_events(batch)
        except BaseException:
            self._pending[:0] = batch  # keep them for the next flush
            raise

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.FLUSH_INTERVAL)
            try:
                await self.flush()
            except Exception:
                log.exception("writing events failed; they stay queued for the next flush")

    async def read(self, sandbox_id: str, after: int, limit: int) -> list[SandboxEvent]:
        await self.flush()
        rows = await self._state.events(sandbox_id, after, limit)
        return [SandboxEvent.model_validate(r) for r in rows]


@contextlib.contextmanager
def stopped_meanwhile(sb: Sandbox, what: str) -> Iterator[None]:
    """What fails in the block once `sb` is being stopped (a stop does not wait for a pause hold nor
    a freeze, and takes its processes, cgroup and files away) fails as that: a WrongStateError, not
    the error the vanishing sandbox caused (a 500)."""
    try:
        yield
    except Exception as exc:
        if sb.state in (CREATING, RUNNING, PAUSED) or isinstance(exc, WrongStateError):
            raise
        raise WrongStateError(f"sandbox {sb.id} stopped while {what}") from exc
