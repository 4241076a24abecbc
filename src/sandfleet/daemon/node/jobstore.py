"""The jobs' figures across a daemon restart: the `JobBook` written to a file of the state directory
(each minute its figures changed, and as the daemon stops) and read back as it starts, before
recovery, so an upgrade or a crash does not empty an operator's charts in the middle of a run (a
crash loses at most the last minute's counts).

The file is JSON: each job's totals, latest failures and refusals, reward range, and its series (the
ring's arrays as base64 of their bytes: the bucket numbers say which hour they belong to, so a file
hours old just brings back its totals). One that cannot be used (damaged, of another version, or
counted under another job label) is moved aside as `jobs.json.corrupt-<unix time>` and the book
starts empty: a job's figures are never worth a daemon that does not start.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import contextlib
import logging
import math
import os
import time
from array import array
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, ValidationError

from sandfleet.daemon.node.jobstats import KEEP, JobBook, JobTally, Series
from sandfleet.models import EXAMPLES, FailureExample

log = logging.getLogger(__name__)

SAVE_EVERY = 60.0  # seconds between saves while something is counted


class _Job(BaseModel):
    model_config = ConfigDict(extra="forbid")

    project: str
    value: str | None
    since: float
    active: float
    counts: dict[str, int]
    reward: tuple[float | None, float | None, float]  # min, max (None: none yet), sum
    examples: dict[str, list[FailureExample]]
    refusals: list[FailureExample]
    stamp: str  # the ring's bucket numbers
    counted: dict[str, str]  # per name, the ring of its counts
    states: dict[str, str]  # per state, the ring of the sandboxes in it


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: Literal[1]
    label: str
    saved_at: float
    jobs: list[_Job]


def _ring(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unring(text: str) -> array[int]:
    a = array("i")
    a.frombytes(base64.b64decode(text, validate=True))
    if len(a) != KEEP:
        raise ValueError(f"a ring of {len(a)} buckets, not {KEEP}")
    return a


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _Copy(NamedTuple):
    """What the loop copies of a job (dicts, lists and the rings' bytes), for a thread to encode."""

    key: tuple[str, str | None]
    since: float
    active: float
    reward: tuple[float, float, float]
    counts: dict[str, int]
    examples: dict[str, list[FailureExample]]
    refusals: list[FailureExample]
    stamp: bytes
    counted: dict[str, bytes]
    states: dict[str, bytes]


def snapshot(book: JobBook) -> tuple[str, list[_Copy]]:
    """The book at one moment (on the loop, which counts into it: 32 ms for 2,000 jobs with full series)."""
    return book.label, [
        _Copy(
            key,
            job.since,
            job.active,
            (job.reward_min, job.reward_max, job.reward_sum),
            {k: n for k, n in job.counts.items() if n},
            {cause: list(ex) for cause, ex in job.examples.items()},
            list(job.refusals),
            job.series.stamp.tobytes(),
            {name: a.tobytes() for name, a in job.series.counts.items()},
            {name: a.tobytes() for name, a in job.series.states.items()},
        )
        for key, job in book.jobs.items()
    ]


def encode(snap: tuple[str, list[_Copy]]) -> bytes:
    """A snapshot as the file holds it (in a thread: ~300 ms and 59 MB for those 2,000)."""
    label, copies = snap
    jobs = [
        _Job(
            project=c.key[0],
            value=c.key[1],
            since=c.since,
            active=c.active,
            counts=c.counts,
            reward=(_finite(c.reward[0]), _finite(c.reward[1]), c.reward[2]),
            examples=c.examples,
            refusals=c.refusals,
            stamp=_ring(c.stamp),
            counted={name: _ring(raw) for name, raw in c.counted.items()},
            states={name: _ring(raw) for name, raw in c.states.items()},
        )
        for c in copies
    ]
    return _File(version=1, label=label, saved_at=time.time(), jobs=jobs).model_dump_json().encode()


def dump(book: JobBook) -> bytes:
    """The book as the file holds it."""
    return encode(snapshot(book))


def load(book: JobBook, data: bytes) -> int:
    """Put the file's jobs in `book` (which counted nothing yet); how many. ValueError (nothing put)
    for a file that cannot be used."""
    try:
        saved = _File.model_validate_json(data)
    except ValidationError as exc:
        raise ValueError(f"not a file of jobs' figures: {exc.errors()[0]['msg']}") from None
    if saved.label != book.label:
        raise ValueError(f"counted under job label {saved.label!r}, not {book.label!r}")
    jobs: dict[tuple[str, str | None], JobTally] = {}
    try:
        for j in saved.jobs:
            series = Series()
            series.stamp = _unring(j.stamp)
            series.counts = {name: _unring(text) for name, text in j.counted.items()}
            series.states = {name: _unring(text) for name, text in j.states.items()}
            rmin, rmax, rsum = j.reward
            jobs[(j.project, j.value)] = JobTally(
                since=j.since,
                active=j.active,
                counts=collections.Counter(j.counts),
                series=series,
                examples={c: collections.deque(ex, maxlen=EXAMPLES) for c, ex in j.examples.items()},
                refusals=collections.deque(j.refusals, maxlen=EXAMPLES),
                reward_min=math.inf if rmin is None else rmin,
                reward_max=-math.inf if rmax is None else rmax,
                reward_sum=rsum,
            )
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"a job's series cannot be read: {exc}") from None
    book.jobs.update(jobs)
    return len(jobs)


class JobStore:
    """The book's file: read back once at start, written each minute and at the stop."""

    def __init__(self, book: JobBook, path: Path) -> None:
        self.book = book
        self.path = path
        self._saved = -1  # the book's count of changes at the last save
        self._saving = asyncio.Lock()  # the minute's save and the stop's: one at a time (one temp file)

    async def restore(self) -> None:
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("the jobs' figures of the last run cannot be read (%s): counting anew", exc)
            return
        try:
            n = load(self.book, data)
        except ValueError as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.warning("the jobs' figures of the last run are not usable (%s): moved to %s", exc, aside)
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            return
        self._saved = self.book.changes
        log.info("the figures of %d jobs counted before this start are back", n)

    async def save(self) -> None:
        """Write the book: copied on the loop (what it holds at one moment), encoded and written in a
        thread. Never raises: the figures are not worth a stop that does not finish."""
        async with self._saving:
            changes = self.book.changes
            snap = snapshot(self.book)
            try:
                await asyncio.to_thread(_write, self.path, snap)
            except OSError as exc:  # a full state disk: the figures wait for the next save
                log.warning("the jobs' figures could not be saved: %s", exc)
                return
            except Exception:  # (a bug here must not take the node down)
                log.exception("saving the jobs' figures failed")
                return
            self._saved = changes

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SAVE_EVERY)
            if self.book.changes != self._saved:
                await self.save()


def _write(path: Path, snap: tuple[str, list[_Copy]]) -> None:
    data = encode(snap)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
