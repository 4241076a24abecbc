"""The node's audit stream: every API call and every security-relevant sandbox event, node-wide.

One append-only record per line (JSON lines), so `tail -f` and `jq` work on the files as they are:

    {"seq":1,"ts":1718000000.5,"kind":"api","sandbox_id":null,"labels":null,"actor":"token:ci","data":{...}}

`seq` counts 1, 2, 3, ... across restarts and rotations (`start()` takes the last one from the
newest file); `kind` is the caller's ("api", "connection", "oom_kill", "finding", ...: not checked).

Files are segments, ``audit-<first seq, 12 digits>.jsonl``: retention is deleting the oldest file
while the total is over `max_bytes` (never the one being written), and a reader skips whole segments
by their names. A crash can leave the last line torn; `start()` cuts it off.

`record()` never blocks: it assigns seq and time, keeps the line pending and in an in-memory tail
(the last `TAIL_RECORDS` records) and wakes the followers. `run()` (in the daemon's task group)
writes what is pending every 0.1 s on one dedicated thread (all file writes, rotations and deletes
happen there, in order). A failing disk never raises: the lines stay pending (at most
`MAX_PENDING`, the oldest beyond are dropped and counted in `dropped`) and are written when the disk
takes them again; it is logged once. Records still pending when the process dies are lost; their
seqs are given again by the next daemon.

`read()` and `follow()` read the files on a worker thread (after writing what is pending); `follow()`
then serves new records from the in-memory tail, and goes back to the files when its consumer fell
behind the tail, so it yields every seq still kept, in order, once.

`record()` and the readers are for the daemon's event loop (one loop, one thread).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.daemon.security.audit_lines import Record, complete_lines, line_seq, lines_backwards, matches, parse

log = logging.getLogger(__name__)

TAIL_RECORDS = 2000  # records kept in memory for followers
MAX_PENDING = 100_000  # unwritten records kept while the disk refuses them; the oldest beyond are dropped
WRITE_INTERVAL = 0.1  # seconds between writes
WRITE_SOON = 500  # pending records that trigger a write before the interval is over
RETRY_INTERVAL = 1.0  # seconds between writes while the disk refuses them
READ_PAGE = 1000  # records per file read of a follower catching up

_SEGMENT = re.compile(r"audit-(\d+)\.jsonl")


def _segment_name(first_seq: int) -> str:
    return f"audit-{first_seq:012d}.jsonl"


@dataclass
class _Segment:
    first: int  # the seq its name gives: no line of it is below, every line of the next one is above
    path: Path
    size: int


class AuditLog:
    """The audit stream of one node, in `directory`; see the module docstring."""

    def __init__(self, directory: Path, *, max_bytes: int = 64 * 2**20, segment_bytes: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes if segment_bytes is not None else max(max_bytes // 8, 64 * 1024)
        if self.segment_bytes <= 0:
            raise ValueError("segment_bytes must be positive")
        # event loop side
        self._seq = 0
        self._started = False
        self._closed = False
        self._pending: deque[tuple[int, bytes]] = deque()
        self._pending_dropped = 0
        self._tail: deque[Record] = deque(maxlen=TAIL_RECORDS)
        self._new = asyncio.Event()  # set (and replaced) on a record when a follower waits for one
        self._watched = False
        self._wake = asyncio.Event()  # many records pending: write now
        self._last_write: asyncio.Future[None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        # writer thread side (only touched on the executor's one thread)
        self._fd: int | None = None
        self._segments: list[_Segment] = []  # oldest first; the last is the current one
        self._torn = False  # the current segment ends in a fragment of a failed write
        self._carry: list[tuple[int, bytes]] = []  # lines a failed write left, written before the next
        self._carry_dropped = 0
        self._failing = False
        self._delete_failing = False

    # -- properties ---------------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The seq of the last record (recorded, maybe not yet written); 0 before any."""
        return self._seq

    @property
    def dropped(self) -> int:
        """Records lost because the disk refused them for longer than `MAX_PENDING` records."""
        return self._pending_dropped + self._carry_dropped

    # -- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create the directory, find the segments, recover the last seq (cutting off a torn last
        line), open the newest segment for appending."""
        if self._started:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandfleet-audit")
        self._seq = await asyncio.get_running_loop().run_in_executor(self._executor, self._open)
        self._started = True

    async def run(self) -> None:
        """The writer: writes what is pending every `WRITE_INTERVAL` (sooner when `WRITE_SOON` records
        wait), rotates and deletes old segments. Runs until cancelled or closed; never raises."""
        failed_once = False
        while not self._closed:
            interval = RETRY_INTERVAL if self._failing else WRITE_INTERVAL
            try:
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            try:
                await self.flush()
            except Exception:  # a bug here must not take the daemon down; the records stay pending
                if not failed_once:
                    log.exception("audit: writing failed")
                    failed_once = True

    async def flush(self) -> None:
        """Write what is pending now (returns when it is in the files, or the disk refused it)."""
        if not self._started or self._closed:
            return
        if self._pending or self._carry:
            batch = list(self._pending)
            self._pending.clear()
            assert self._executor is not None
            fut = asyncio.get_running_loop().run_in_executor(self._executor, self._write, batch)
            self._last_write = fut
        elif self._last_write is None or self._last_write.done():
            return
        # The single thread runs the writes in order: waiting for the last one is waiting for all.
        # Shielded: a cancelled caller must not cancel a batch still queued (it would be lost).
        await asyncio.shield(self._last_write)

    async def close(self) -> None:
        """Write what is pending and close the file. Records made afterwards are not written."""
        if not self._started or self._closed:
            return
        await self.flush()
        self._closed = True
        self._wake.set()
        assert self._executor is not None
        await asyncio.get_running_loop().run_in_executor(self._executor, self._close_file)
        self._executor.shutdown(wait=False)

    # -- recording ----------------------------------------------------------------------------------

    def record(
        self,
        kind: str,
        *,
        sandbox_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        actor: str | None = None,
        **data: Any,
    ) -> Record:
        """Append a record (no I/O: it is written by `run()`); returns it as readers will see it."""
        if not self._started:
            raise RuntimeError("AuditLog.record() before start()")
        self._seq += 1
        rec: Record = {
            "seq": self._seq,
            "ts": time.time(),
            "kind": kind,
            "sandbox_id": sandbox_id,
            "labels": dict(labels) if labels is not None else None,
            "actor": actor,
            "data": data,
        }
        try:
            line = json.dumps(rec, separators=(",", ":"))
        except (TypeError, ValueError):  # a value JSON lacks: its str(); a cycle: its repr
            try:
                line = json.dumps(rec, separators=(",", ":"), default=str)
            except (TypeError, ValueError):
                rec["data"] = {"unserializable": repr(data)[:4096]}
                line = json.dumps(rec, separators=(",", ":"), default=str)
        # What followers get from memory is exactly what readers get from the files.
        rec = json.loads(line)
        self._pending.append((self._seq, line.encode() + b"\n"))
        if len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self._pending_dropped += 1
        if len(self._pending) > WRITE_SOON:
            self._wake.set()
        self._tail.append(rec)
        if self._watched:
            self._watched = False
            event, self._new = self._new, asyncio.Event()
            event.set()
        return rec

    # -- reading ------------------------------------------------------------------------------------

    async def read(
        self,
        *,
        since: int = 0,
        since_time: float | None = None,
        limit: int = 1000,
        kinds: Collection[str] | None = None,
        sandbox_id: str | None = None,
        newest: bool = False,
    ) -> list[Record]:
        """Records with seq > `since` (and ts >= `since_time`), oldest first, of `kinds` and
        `sandbox_id` when given, at most `limit`: the first such, or with `newest` the last. Writes
        what is pending first. A `since` older than the oldest kept record gives from the oldest kept."""
        if limit <= 0:
            return []
        await self.flush()
        kind_set = frozenset(kinds) if kinds is not None else None
        if newest:
            return await asyncio.to_thread(self._scan_newest, since, since_time, limit, kind_set, sandbox_id)
        records, _ = await asyncio.to_thread(self._scan, since, since_time, limit, kind_set, sandbox_id)
        return records

    async def follow(
        self,
        *,
        since: int = 0,
        since_time: float | None = None,
        kinds: Collection[str] | None = None,
        sandbox_id: str | None = None,
        heartbeat: float | None = None,
    ) -> AsyncGenerator[Record | None, None]:
        """What `read()` gives, then every new record as it is recorded; None after `heartbeat`
        seconds without a record yielded. Every kept seq once, in order, however slow the consumer."""
        loop = asyncio.get_running_loop()
        kind_set = frozenset(kinds) if kinds is not None else None

        def wanted(rec: Record) -> bool:
            return (
                (kind_set is None or rec["kind"] in kind_set)
                and (sandbox_id is None or rec["sandbox_id"] == sandbox_id)
                and (since_time is None or rec["ts"] >= since_time)
            )

        cursor = since  # every seq <= cursor has been considered
        last_yield = loop.time()
        backlog = True  # what read() gives first, even when the tail still has older records
        while True:
            tail_start = self._tail[0]["seq"] if self._tail else self._seq + 1
            if backlog or cursor + 1 < tail_start:
                # The backlog, or behind the in-memory tail (a slow consumer): from the files.
                await self.flush()
                records, scanned = await asyncio.to_thread(
                    self._scan, cursor, since_time, READ_PAGE, kind_set, sandbox_id
                )
                backlog = backlog and len(records) == READ_PAGE
                for rec in records:
                    yield rec
                    last_yield = loop.time()
                if scanned > cursor:
                    cursor = scanned
                else:  # not in the files: deleted meanwhile, or never written (dropped); go on from memory
                    cursor = max(cursor, (self._tail[0]["seq"] if self._tail else self._seq + 1) - 1)
                continue
            event = self._new
            self._watched = True
            if self._tail and self._tail[-1]["seq"] > cursor:
                batch = list(itertools.islice(self._tail, max(0, cursor + 1 - tail_start), None))
                for rec in batch:
                    if rec["seq"] <= cursor:
                        continue
                    cursor = rec["seq"]
                    if wanted(rec):
                        yield rec
                        last_yield = loop.time()
                continue
            if heartbeat is None:
                await event.wait()
                continue
            remaining = heartbeat - (loop.time() - last_yield)
            if remaining > 0:
                try:
                    async with asyncio.timeout(remaining):
                        await event.wait()
                    continue
                except TimeoutError:
                    pass
            yield None
            last_yield = loop.time()

    # -- the writer thread --------------------------------------------------------------------------

    def _open(self) -> int:
        """Find the segments, recover the newest, open it; the last seq."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for first, path in self._list_segments():
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            self._segments.append(_Segment(first, path, size))
        if not self._segments:
            return 0
        current = self._segments[-1]
        last, current.size = self._recover(current.path)
        self._fd = os.open(current.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
        return max(last, current.first - 1)

    @staticmethod
    def _recover(path: Path) -> tuple[int, int]:
        """Cut a torn last line off `path`; (the seq of its last readable line or 0, its size)."""
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            pos = size
            good_end: int | None = None
            buf = b""
            last = 0
            while pos > 0:
                n = min(64 * 1024, pos)
                pos -= n
                f.seek(pos)
                buf = f.read(n) + buf
                if good_end is None:
                    newline = buf.rfind(b"\n")
                    if newline < 0:
                        continue
                    good_end = pos + newline + 1
                    buf = buf[: newline + 1]
                lines = buf.split(b"\n")[:-1]
                head = lines.pop(0) if pos > 0 and lines else None  # may start before this block
                for line in reversed(lines):
                    rec = parse(line)
                    if rec is not None:
                        last = rec["seq"]
                        break
                if last:
                    break
                buf = head + b"\n" if head is not None else b""
            good_end = good_end or 0
            if good_end != size:
                log.warning("audit: %s ended in a torn line (%d bytes), cut off", path, size - good_end)
                f.truncate(good_end)
        return last, good_end

    def _list_segments(self) -> list[tuple[int, Path]]:
        found = []
        for name in os.listdir(self.directory):
            m = _SEGMENT.fullmatch(name)
            if m:
                found.append((int(m.group(1)), self.directory / name))
        found.sort()
        return found

    def _write(self, batch: list[tuple[int, bytes]]) -> None:
        lines = self._carry + batch if self._carry else batch
        self._carry = []
        i = 0
        try:
            while i < len(lines):
                if self._fd is None or self._segments[-1].size >= self.segment_bytes:
                    self._rotate(lines[i][0])
                size = self._segments[-1].size
                j = i
                while j < len(lines) and size < self.segment_bytes:
                    size += len(lines[j][1])
                    j += 1
                self._append(b"".join(line for _, line in lines[i:j]))
                i = j
        except Exception as e:  # OSError (disk full, ...) or a bug: keep the lines either way
            keep = lines[i:]
            if len(keep) > MAX_PENDING:
                self._carry_dropped += len(keep) - MAX_PENDING
                keep = keep[-MAX_PENDING:]
            self._carry = keep
            if not self._failing:
                self._failing = True
                log.error("audit: cannot write to %s (%s); keeping records in memory", self.directory, e)
            return
        if self._failing:
            self._failing = False
            log.warning("audit: writing to %s again (%d records dropped so far)", self.directory, self.dropped)
        self._retain()

    def _rotate(self, first_seq: int) -> None:
        """Close the current segment, start one whose first line is seq `first_seq`."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        path = self.directory / _segment_name(first_seq)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        size = os.fstat(fd).st_size
        self._fd = fd
        self._torn = False
        if self._segments and self._segments[-1].path == path:
            self._segments[-1].size = size
        else:
            self._segments.append(_Segment(first_seq, path, size))

    def _append(self, data: bytes) -> None:
        """Write `data` to the current segment; on failure leave the segment as it was (or, when
        even that fails, end the fragment with a newline before the next write)."""
        assert self._fd is not None
        seg = self._segments[-1]
        start = seg.size
        if self._torn:
            data = b"\n" + data
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
                seg.size += n
        except OSError:
            try:  # always: a failed write(2) may still have left bytes
                os.ftruncate(self._fd, start)
                seg.size = start
            except OSError:
                self._torn = True
            raise
        self._torn = False

    def _retain(self) -> None:
        """Delete the oldest segments while the total is over `max_bytes` (never the current one)."""
        total = sum(seg.size for seg in self._segments)
        while total > self.max_bytes and len(self._segments) > 1:
            oldest = self._segments[0]
            try:
                oldest.path.unlink(missing_ok=True)
            except OSError as e:
                if not self._delete_failing:
                    self._delete_failing = True
                    log.error("audit: cannot delete %s (%s)", oldest.path, e)
                return
            self._segments.pop(0)
            total -= oldest.size
        self._delete_failing = False

    def _close_file(self) -> None:
        if self._carry:
            log.error("audit: closing with %d records the disk refused; they are lost", len(self._carry))
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- reading (worker threads) -------------------------------------------------------------------

    def _scan(
        self,
        since: int,
        since_time: float | None,
        limit: int,
        kinds: frozenset[str] | None,
        sandbox_id: str | None,
    ) -> tuple[list[Record], int]:
        """Matching records after `since`, at most `limit`; and the last seq looked at (`since` when
        none: the files have nothing after it)."""
        segments = self._list_segments()
        # Segment k holds seqs in [its first, the next one's first): skip those wholly <= since.
        start = 0
        for k in range(len(segments) - 1):
            if segments[k + 1][0] <= since + 1:
                start = k + 1
        if since_time is not None:
            # ...and those wholly older than since_time: the next segment's first record is older.
            while start < len(segments) - 1:
                ts = self._first_ts(segments[start + 1][1])
                if ts is None or ts >= since_time:
                    break
                start += 1
        out: list[Record] = []
        scanned = since
        for _, path in segments[start:]:
            for line in complete_lines(path):
                seq = line_seq(line)
                rec: Record | None = None
                if seq is None:
                    rec = parse(line)
                    if rec is None:
                        continue  # damaged
                    seq = rec["seq"]
                if seq <= scanned:
                    continue
                scanned = seq
                if rec is None:
                    rec = parse(line)
                    if rec is None:
                        continue
                if matches(rec, kinds, sandbox_id, since_time):
                    out.append(rec)
                    if len(out) >= limit:
                        return out, scanned
        return out, scanned

    def _scan_newest(
        self,
        since: int,
        since_time: float | None,
        limit: int,
        kinds: frozenset[str] | None,
        sandbox_id: str | None,
    ) -> list[Record]:
        """The last `limit` records `_scan` would match, oldest first: segments read newest first, each
        from its end (lines in a segment are in seq order), until enough are found or older ones
        cannot match."""
        found: list[list[Record]] = []
        count = 0
        for first, path in reversed(self._list_segments()):
            part: list[Record] = []  # newest first
            for line in lines_backwards(path):
                seq = line_seq(line)
                if seq is not None and seq <= since:
                    break
                rec = parse(line)
                if rec is not None and rec.get("seq", 0) > since and matches(rec, kinds, sandbox_id, since_time):
                    part.append(rec)
                    if count + len(part) >= limit:
                        break
            found.append(part[::-1])
            count += len(part)
            older = since_time is not None and (ts := self._first_ts(path)) is not None and ts < since_time
            if count >= limit or first <= since + 1 or older:
                break
        out = [rec for part in reversed(found) for rec in part]
        return out[-limit:]

    @staticmethod
    def _first_ts(path: Path) -> float | None:
        try:
            with open(path, "rb") as f:
                line = f.readline()
        except FileNotFoundError:
            return None
        rec = parse(line) if line.endswith(b"\n") else None
        ts = rec.get("ts") if rec is not None else None
        return float(ts) if isinstance(ts, int | float) else None
