"""The jobs' figures across a daemon restart: the `JobBook` written to a file of the state directory
(each minute something was counted, and as the daemon stops) and read back as it starts, before
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
from typing import Literal

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


def _ring(a: array[int]) -> str:
    return base64.b64encode(a.tobytes()).decode()


def _unring(text: str) -> array[int]:
    a = array("i")
    a.frombytes(base64.b64decode(text, validate=True))
    if len(a) != KEEP:
        raise ValueError(f"a ring of {len(a)} buckets, not {KEEP}")
    return a


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def dump(book: JobBook) -> bytes:
    """The book as the file holds it."""
    jobs = [
        _Job(
            project=project,
            value=value,
            since=job.since,
            active=job.active,
            counts={k: n for k, n in job.counts.items() if n},
            reward=(_finite(job.reward_min), _finite(job.reward_max), job.reward_sum),
            examples={cause: list(ex) for cause, ex in job.examples.items()},
            refusals=list(job.refusals),
            stamp=_ring(job.series.stamp),
            counted={name: _ring(a) for name, a in job.series.counts.items()},
            states={name: _ring(a) for name, a in job.series.states.items()},
        )
        for (project, value), job in book.jobs.items()
    ]
    return _File(version=1, label=book.label, saved_at=time.time(), jobs=jobs).model_dump_json().encode()


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
        """Write the book (built here, on the loop: what it holds at one moment; written in a thread)."""
        changes = self.book.changes
        data = dump(self.book)
        try:
            await asyncio.to_thread(_write, self.path, data)
        except OSError as exc:  # a full state disk: the figures wait for the next save
            log.warning("the jobs' figures could not be saved: %s", exc)
            return
        self._saved = changes

    async def run(self) -> None:
        while True:
            await asyncio.sleep(SAVE_EVERY)
            if self.book.changes != self._saved:
                try:
                    await self.save()
                except Exception:  # (a bug here must not take the node down)
                    log.exception("saving the jobs' figures failed")


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
