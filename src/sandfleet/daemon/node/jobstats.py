"""A node's figures per job, counted as things happen: what an operator of a run watches.

A job is the sandboxes carrying one value of the node's job label (`label`, "job" by default), per
project. Its figures are counters (creates, stops, commands, steps, replays, OOM kills, failures by
cause, verifications by outcome, rewards in fixed bins, detector findings), in total and per bucket
of `BUCKET` seconds over the last `KEEP` buckets, with the job's sandboxes by state sampled at
each bucket; plus a few recent failures per cause to look into. Memory is bounded by the number of
jobs, never by the number of sandboxes: some 30 KiB a job (`Series`), at most `MAX_JOBS` of them
(60 MiB), the idle one quiet longest forgotten for a new one; a book full of jobs with live sandboxes
counts no new job (`unbooked`, logged). No per-sandbox series anywhere.

Inputs: the event journal's tap (created, create_failed, stopped, oom_kill, agent_unresponsive,
agent_lost, finding) and the calls of the concerns that know the rest (`executed` from the execs,
`stepped` and `replayed` from trajectories, `verified` from verification). What is asked of a job
on top (stuck and slowest sandboxes, CPU and memory in use) is read from the sandbox table then.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import contextvars
import logging
import math
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from sandfleet.daemon.node.lifecycle import (
    FAILED,
    HOLDING_STATES,
    LIVE_STATES,
    PAUSED,
    RUNNING,
    Sandbox,
    SandboxTable,
)
from sandfleet.errors import CAUSES, SandboxError
from sandfleet.models import (
    BRIEF,
    EXAMPLES,
    REWARD_EDGES,
    VERIFY_LABEL,
    ExecResult,
    FailureExample,
    JobGroup,
    JobPoint,
    JobStats,
    QuotaUse,
    Refusal,
    RewardBin,
    Rewards,
    SandboxBrief,
    SandboxSpec,
    StepResult,
    VerifyResult,
)

log = logging.getLogger(__name__)

BUCKET = 10.0  # seconds a point of a job's series covers
KEEP = 360  # points kept: the last hour
MAX_JOBS = 2000  # jobs counted at once; past it the one idle longest is forgotten

JobKey = tuple[str, str | None]  # (project or "", the job label's value or None)
Counts = collections.Counter[str]

# The step a command runs for (trajectories set it around a step's action): its failure is the step's.
_step: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar("step", default=None)


@contextlib.contextmanager
def within_step(trajectory_id: str, step: int) -> Iterator[None]:
    token = _step.set((trajectory_id, step))
    try:
        yield
    finally:
        _step.reset(token)


def bucket_of(t: float) -> int:
    """The number of the bucket holding time `t` (the same boundaries on every node)."""
    return int(t // BUCKET)


class Series:
    """A job's counts per bucket over the last KEEP buckets, and its sandboxes by state at each: an
    array of KEEP per name, used as a ring indexed by the bucket's number (`stamp` says which bucket
    a slot holds). About 1.4 KiB a name: some 30 KiB for a job's usual dozen and a half."""

    __slots__ = ("counts", "stamp", "states")

    def __init__(self) -> None:
        self.stamp = array("i", [-1]) * KEEP
        self.counts: dict[str, array[int]] = {}
        self.states: dict[str, array[int]] = {}

    def _slot(self, b: int) -> int:
        i = b % KEEP
        if self.stamp[i] != b:  # a bucket of an hour ago: cleared for this one
            self.stamp[i] = b
            for a in (*self.counts.values(), *self.states.values()):
                a[i] = 0
        return i

    @staticmethod
    def _row(rows: dict[str, array[int]], name: str) -> array[int]:
        a = rows.get(name)
        if a is None:
            a = rows[sys.intern(name)] = array("i", bytes(4 * KEEP))
        return a

    def add(self, b: int, name: str, n: int) -> None:
        self._row(self.counts, name)[self._slot(b)] += n

    def set_states(self, b: int, states: Mapping[str, int]) -> None:
        i = self._slot(b)
        for a in self.states.values():
            a[i] = 0
        for state, n in states.items():
            self._row(self.states, state)[i] = n

    def buckets(self, first: int, last: int) -> Iterator[tuple[int, int]]:
        """(bucket number, slot) of the buckets from `first` to `last` that hold anything."""
        for b in range(max(first, last - KEEP + 1), last + 1):
            i = b % KEEP
            if self.stamp[i] == b:
                yield b, i


@dataclass(slots=True)
class JobTally:
    since: float
    active: float  # the last thing counted or seen (for forgetting idle jobs first)
    counts: Counts = field(default_factory=collections.Counter)
    series: Series = field(default_factory=Series)
    examples: dict[str, collections.deque[FailureExample]] = field(default_factory=dict)
    refusals: collections.deque[FailureExample] = field(default_factory=lambda: collections.deque(maxlen=EXAMPLES))
    reward_min: float = math.inf
    reward_max: float = -math.inf
    reward_sum: float = 0.0


def reward_bin(reward: float) -> int:
    """The bin of REWARD_EDGES a reward falls in: 0 below 0, then [0, 0.1), ..., [0.9, 1), then 1 exactly,
    then above 1."""
    if reward == 1.0:
        return len(REWARD_EDGES)
    if reward > 1.0:
        return len(REWARD_EDGES) + 1
    return bisect.bisect_right(REWARD_EDGES, reward)


def reward_bins(counts: Counts) -> list[RewardBin]:
    edges: list[float | None] = [None, *REWARD_EDGES]
    bins = [RewardBin(lo=edges[i], hi=edges[i + 1], count=counts[f"reward:{i}"]) for i in range(len(REWARD_EDGES))]
    bins.append(RewardBin(lo=1.0, hi=1.0, count=counts[f"reward:{len(REWARD_EDGES)}"]))
    bins.append(RewardBin(lo=1.0, hi=None, count=counts[f"reward:{len(REWARD_EDGES) + 1}"]))
    return bins


class JobBook:
    """The node's figures per job (see the module's docstring)."""

    def __init__(self, table: SandboxTable, label: str = "job", clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.label = label
        self.clock = clock
        self.jobs: dict[JobKey, JobTally] = {}
        self.live: set[JobKey] = set()  # the jobs with live sandboxes, as `sample` last counted them
        self.unbooked = 0  # counts left out: the book was full of jobs with live sandboxes (MAX_JOBS)
        self.findings: dict[str, tuple[int, float]] = {}  # per live sandbox: detector findings, the last when
        self.started = clock()
        self.changes = 0  # how many times a job's figures changed (what a save of the book looks at)

    # -- what happened -----------------------------------------------------------------------

    def key_of(self, sb: Sandbox) -> JobKey:
        return (sb.spec.project or "", sb.spec.labels.get(self.label))

    def _job(self, key: JobKey, now: float) -> JobTally | None:
        """The job's book; a new one in place of the idle job (no live sandbox) quiet longest when the
        book is full; None when every job in it has live sandboxes (counted in `unbooked`)."""
        job = self.jobs.get(key)
        if job is None:
            if len(self.jobs) >= MAX_JOBS:
                # (from the table, not `live`: a book read back at start has no sample yet)
                live = {self.key_of(sb) for sb in self.table if sb.state in LIVE_STATES}
                idle = [k for k in self.jobs if k not in live]
                if not idle:
                    if not self.unbooked:
                        log.warning("%d jobs have live sandboxes: the figures of more are not counted", MAX_JOBS)
                    self.unbooked += 1
                    return None
                del self.jobs[min(idle, key=lambda k: self.jobs[k].active)]
            job = self.jobs[key] = JobTally(since=now, active=now)
        job.active = now
        self.changes += 1
        return job

    def _count(self, sb: Sandbox, name: str, n: int = 1) -> JobTally | None:
        now = self.clock()
        job = self._job(self.key_of(sb), now)
        if job is not None:
            job.counts[name] += n
            job.series.add(bucket_of(now), name, n)
        return job

    def _failure(
        self, sb: Sandbox, cause: str, kind: str, message: str, *, step: tuple[str, int] | None = None
    ) -> None:
        job = self._count(sb, f"failure:{cause}")
        if job is None:
            return
        example = FailureExample(
            at=self.clock(),
            cause=cause,
            kind=kind,
            sandbox_id=sb.id,
            trajectory_id=step[0] if step else None,
            step=step[1] if step else None,
            message=message[:300],
        )
        job.examples.setdefault(cause, collections.deque(maxlen=EXAMPLES)).appendleft(example)

    def refused(self, specs: Iterable[SandboxSpec], why: Refusal, error: SandboxError) -> None:
        """Creates of these specs (in their projects) refused before a sandbox existed, each attempt.
        Not failures: the caller is told and may retry (a retrying SDK would inflate a rate); what
        holds a job back all the same. Counted only in a job the book already holds: a refusal costs
        its caller nothing, so it never makes room for itself by forgetting another project's job.
        A verifier's is its verification's verdict; a spec without the job label is no job's."""
        now = self.clock()
        for spec in specs:
            value = spec.labels.get(self.label)
            job = self.jobs.get((spec.project or "", value))
            if job is None or value is None or VERIFY_LABEL in spec.labels:
                continue
            self.changes += 1
            job.active = now
            job.counts[f"refused:{why}"] += 1
            job.series.add(bucket_of(now), f"refused:{why}", 1)
            last = job.refusals[0] if job.refusals else None
            if last is None or last.at < now - 1 or not last.message.startswith(why):  # (a burst: one example)
                job.refusals.appendleft(
                    FailureExample(at=now, cause=error.cause, kind="create", message=f"{why}: {error.message}"[:300])
                )

    def event(self, sandbox_id: str, kind: str, data: dict[str, Any]) -> None:
        """The journal's tap: the events that are a job's figures. A verifier's sandbox counts as the
        job's (creates, stops) but its failures are the verification's verdict; an agent that stopped
        answering a step's command is that step's failure (counted as the step ends)."""
        sb = self.table.find(sandbox_id)
        if sb is None:
            return
        verifier = VERIFY_LABEL in sb.spec.labels
        if kind == "created":
            self._count(sb, "created")
            if not verifier:
                self._count(sb, "runs")
        elif kind == "stopped" and sb.state == FAILED:  # a create a daemon restart never answered
            self._count(sb, "runs")
            self._failure(sb, "infra", "create", str(data.get("reason") or "create lost"))
        elif kind == "stopped":
            self._count(sb, "stopped")
            self.findings.pop(sandbox_id, None)
        elif kind == "create_failed" and not verifier:
            self._count(sb, "runs")
            self._failure(sb, str(data.get("cause") or "infra"), "create", str(data.get("error", "")))
        elif kind == "oom_kill":  # (the command it ended, if one did, is a failure of its own)
            self._count(sb, "oom_kills", int(data.get("count") or 1))
        elif kind in ("agent_unresponsive", "agent_lost") and not verifier and _step.get() is None:
            why = data.get("reason") or data.get("error") or ""
            self._failure(sb, "infra", "agent", f"{kind.replace('_', ' ')}: {why}")
        elif kind == "finding":
            self._count(sb, f"finding:{data.get('detector', '?')}")
            self.findings[sandbox_id] = (self.findings.get(sandbox_id, (0, 0.0))[0] + 1, self.clock())

    def executed(self, sb: Sandbox, result: ExecResult, command: str) -> None:
        """A command ran to its end (its own, or a step's): counted, and its failure by cause. A
        verifier's checks failing is the verification's outcome, not a failure of the job's."""
        self._count(sb, "execs")
        if VERIFY_LABEL in sb.spec.labels:
            return
        self._count(sb, "runs")
        if result.cause is None:
            return
        step = _step.get()
        what = "timed out" if result.timed_out else f"exit {result.exit_code}"
        if result.oom_killed:
            what += ", OOM-killed"
        self._failure(sb, result.cause, "step" if step else "exec", f"{command[:200]}: {what}", step=step)

    def stepped(self, sandbox_id: str | None, trajectory_id: str, result: StepResult) -> None:
        """A trajectory's step was taken. A failed command was counted as it ended (`executed`);
        here the steps that failed otherwise (a file not written, a rollback refused, a restart)."""
        sb = self.table.find(sandbox_id) if sandbox_id else None
        if sb is None:
            return
        self._count(sb, "steps")
        if result.exec is None:
            self._count(sb, "runs")  # (a command is counted as it ends)
        if result.cause is not None and result.exec is None:
            message = f"{result.kind}: {result.error.message if result.error else 'failed'}"
            self._failure(sb, result.cause, "step", message, step=(trajectory_id, result.step))

    def replayed(self, sandbox_id: str | None) -> None:
        sb = self.table.find(sandbox_id) if sandbox_id else None
        if sb is not None:
            self._count(sb, "replays")

    def verified(self, sb: Sandbox, result: VerifyResult) -> None:
        """A verification of the job's sandbox `sb` ended: its outcome, its reward."""
        job = self._count(sb, f"verify:{result.cause or 'passed'}")
        if job is None:
            return
        self._count(sb, "runs")
        if result.cause is not None and result.cause != "agent":  # the checks could not judge the work
            why = result.error.message if result.error else f"exit {result.result.exit_code if result.result else '?'}"
            self._failure(sb, result.cause, "verify", f"verification: {why}")
        if result.cause in (None, "agent") and math.isfinite(result.reward):
            self._count(sb, f"reward:{reward_bin(result.reward)}")
            job.reward_sum += result.reward
            job.reward_min = min(job.reward_min, result.reward)
            job.reward_max = max(job.reward_max, result.reward)

    # -- over time -------------------------------------------------------------------------------

    def sample(self) -> None:
        """Count each job's sandboxes by state into its current bucket; forget what is past."""
        now = self.clock()
        states: dict[JobKey, Counts] = {}
        for sb in self.table:
            if sb.state in LIVE_STATES:
                states.setdefault(self.key_of(sb), collections.Counter())[sb.state] += 1
        self.live = set(states)
        for key, counted in states.items():
            job = self._job(key, now)
            if job is not None:
                job.series.set_states(bucket_of(now), counted)
        for sid in list(self.findings):
            found = self.table.find(sid)
            if found is None or found.state not in LIVE_STATES:
                del self.findings[sid]

    async def run(self) -> None:
        while True:
            await asyncio.sleep(BUCKET - self.clock() % BUCKET + 0.05)  # just past each bucket's start
            try:
                self.sample()
            except Exception:
                log.exception("counting the jobs' sandboxes failed")

    # -- what is asked -------------------------------------------------------------------------

    def recent(self, window: float) -> dict[JobKey, Counts]:
        """What each job counted over the last `window` seconds (the buckets that overlap them)."""
        now = self.clock()
        first, last = bucket_of(now - window), bucket_of(now)
        out: dict[JobKey, Counts] = {}
        for key, job in self.jobs.items():
            slots = [i for _, i in job.series.buckets(first, last)]
            if slots:
                c: Counts = collections.Counter(
                    {name: sum(a[i] for i in slots) for name, a in job.series.counts.items()}
                )
                out[key] = +c  # (the zeros out)
        return out

    def stuck_by_job(self, after: float) -> dict[JobKey, int]:
        """How many of each job's sandboxes are stuck (see `stats`), for the alerts."""
        now = self.clock()
        out: dict[JobKey, int] = {}
        for sb in self.table:
            if sb.state in HOLDING_STATES and self._why_stuck(sb, after, now):
                key = self.key_of(sb)
                out[key] = out.get(key, 0) + 1
        return out

    def counted(self, groups: list[JobGroup], sees: Callable[[str | None], bool]) -> list[JobGroup]:
        """The groups of the job label with their figures (of the projects the caller sees)."""
        totals: dict[str | None, Counts] = {}
        for (project, value), job in self.jobs.items():
            if sees(project or None):
                totals.setdefault(value, collections.Counter()).update(job.counts)
        out = []
        for g in groups:
            c = totals.get(g.value, collections.Counter())
            verified = sum(n for k, n in c.items() if k.startswith("verify:"))
            failures = sum(n for k, n in c.items() if k.startswith("failure:"))
            out.append(
                g.model_copy(
                    update={
                        "failures": failures,
                        "verified": verified,
                        "passed": c["verify:passed"],
                        "steps": c["steps"],
                    }
                )
            )
        return out

    def stats(
        self,
        value: str,
        sees: Callable[[str | None], bool],
        stuck_after: float,
        quotas: Callable[[set[str | None]], list[QuotaUse]],
    ) -> JobStats | None:
        """Job `value` over the projects the caller sees (`quotas`: the quotas of a set of projects, with
        their use); None if it has neither figures nor sandboxes."""
        now = self.clock()
        keys = [k for k in self.jobs if k[1] == value and sees(k[0] or None)]
        sandboxes = [
            sb
            for sb in self.table
            if sb.spec.labels.get(self.label) == value and sb.state in HOLDING_STATES and sees(sb.spec.project)
        ]
        if not keys and not sandboxes:
            return None
        counts: Counts = collections.Counter()
        last = bucket_of(now)
        series: dict[int, tuple[Counts, Counts]] = {}  # bucket number -> (counts, states), the keys added up
        examples: list[FailureExample] = []
        refusals: list[FailureExample] = []
        since, rmin, rmax, rsum = now, math.inf, -math.inf, 0.0
        for k in keys:
            job = self.jobs[k]
            counts.update(job.counts)
            since = min(since, job.since)
            rmin, rmax, rsum = min(rmin, job.reward_min), max(rmax, job.reward_max), rsum + job.reward_sum
            for ex in job.examples.values():
                examples.extend(ex)
            refusals.extend(job.refusals)
            rows = job.series
            for b, i in rows.buckets(last - KEEP + 1, last):
                into, in_states = series.setdefault(b, (collections.Counter(), collections.Counter()))
                into.update({name: a[i] for name, a in rows.counts.items() if a[i]})
                in_states.update({state: a[i] for state, a in rows.states.items() if a[i]})
        examples.sort(key=lambda e: -e.at)
        refusals.sort(key=lambda e: -e.at)
        states = collections.Counter(sb.state for sb in sandboxes)
        rewards = sum(n for k, n in counts.items() if k.startswith("reward:"))
        verifications = {k.split(":", 1)[1]: n for k, n in counts.items() if k.startswith("verify:") and n}
        verified = sum(verifications.values())
        running = [sb for sb in sandboxes if sb.state == RUNNING]
        return JobStats(
            key=self.label,
            value=value,
            since=since,
            bucket=BUCKET,
            states=dict(states),
            created=counts["created"],
            stopped=counts["stopped"],
            execs=counts["execs"],
            steps=counts["steps"],
            replays=counts["replays"],
            oom_kills=counts["oom_kills"],
            failures={c: counts[f"failure:{c}"] for c in CAUSES if counts[f"failure:{c}"]},
            examples=examples[: EXAMPLES * len(CAUSES)],
            refused={k.split(":", 1)[1]: n for k, n in counts.items() if k.startswith("refused:") and n},
            refusals=refusals[:EXAMPLES],
            verifications=verifications,
            pass_rate=verifications.get("passed", 0) / verified if verified else None,
            rewards=Rewards(
                count=rewards,
                mean=rsum / rewards if rewards else None,
                min=rmin if rewards else None,
                max=rmax if rewards else None,
                bins=reward_bins(counts),
            ),
            findings={k.split(":", 1)[1]: n for k, n in counts.items() if k.startswith("finding:") and n},
            cpu=round(sum(sb.spec.resources.cpu for sb in sandboxes), 6),
            memory=sum(sb.spec.resources.memory for sb in sandboxes),
            cpu_used=round(sum(sb.cpu_rate or 0.0 for sb in running), 6),
            memory_used=sum(sb.memory_seen or 0 for sb in running),
            quotas=quotas({k[0] or None for k in keys} | {sb.spec.project for sb in sandboxes}),
            series=self._points(series, last),
            stuck=self._stuck(sandboxes, stuck_after, now),
            slowest=[self._brief(sb, []) for sb in sorted(sandboxes, key=lambda s: s.created_at)[:BRIEF]],
        )

    @staticmethod
    def _points(series: dict[int, tuple[Counts, Counts]], last: int) -> list[JobPoint]:
        """A point per bucket from the first kept one to the last (none missing: a quiet one is zeros)."""
        if not series:
            return []
        points = []
        empty: Counts = collections.Counter()
        for b in range(min(series), last + 1):
            c, states = series.get(b, (empty, empty))
            points.append(
                JobPoint(
                    t=b * BUCKET,
                    created=c["created"],
                    refused=sum(n for k, n in c.items() if k.startswith("refused:")),
                    stopped=c["stopped"],
                    failures={cause: c[f"failure:{cause}"] for cause in CAUSES if c[f"failure:{cause}"]},
                    oom_kills=c["oom_kills"],
                    verified=sum(n for k, n in c.items() if k.startswith("verify:")),
                    passed=c["verify:passed"],
                    steps=c["steps"],
                    replays=c["replays"],
                    execs=c["execs"],
                    states=dict(states),
                )
            )
        return points

    def _stuck(self, sandboxes: list[Sandbox], after: float, now: float) -> list[SandboxBrief]:
        out = [(sb, why) for sb in sandboxes if (why := self._why_stuck(sb, after, now))]
        out.sort(key=lambda p: p[0].last_active_at)
        return [self._brief(sb, why) for sb, why in out[:BRIEF]]

    def _why_stuck(self, sb: Sandbox, after: float, now: float) -> list[str]:
        """What makes a sandbox stuck: running with no request for `after` seconds (or one request
        running that long), an agent not answering, detector findings (while not paused)."""
        why = []
        quiet = now - sb.last_active_at
        if sb.state == RUNNING and quiet >= after:
            doing = "a request running" if sb.inflight else "no request"
            why.append(f"{doing} for {_duration(quiet)}")
        if sb.unresponsive:
            why.append("its agent is not answering")
        n, at = self.findings.get(sb.id, (0, 0.0))
        if n and sb.state != PAUSED and now - at < after:
            why.append(f"{n} detector finding{'s' if n > 1 else ''}, the last {_duration(now - at)} ago")
        return why

    @staticmethod
    def _brief(sb: Sandbox, why: list[str]) -> SandboxBrief:
        return SandboxBrief(
            id=sb.id,
            state=sb.state,
            created_at=sb.created_at,
            last_active_at=sb.last_active_at,
            why=why,
            cpu=sb.cpu_rate,
            memory=sb.memory_seen,
        )


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
