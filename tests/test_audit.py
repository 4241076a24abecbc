"""The node's audit stream (daemon/security/audit.py): seqs across restarts, torn lines, rotation and
retention, filters, followers (live, heartbeats, lagging behind the in-memory tail), a failing disk."""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import json
import os
import stat
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet.daemon.security import audit, audit_lines
from sandfleet.daemon.security.audit import AuditLog

pytestmark = pytest.mark.unit

KEYS = ["seq", "ts", "kind", "sandbox_id", "labels", "actor", "data"]


async def opened(directory: Path, **kw: Any) -> AuditLog:
    log = AuditLog(directory, **kw)
    await log.start()
    return log


def segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("audit-*.jsonl"))


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def seqs(records: list[dict[str, Any]]) -> list[int]:
    return [r["seq"] for r in records]


def file_seqs(directory: Path) -> list[int]:
    return [json.loads(line)["seq"] for p in segments(directory) for line in p.read_text().splitlines()]


async def take(it: AsyncIterator[dict[str, Any] | None], n: int, timeout: float = 10.0) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    async with asyncio.timeout(timeout):
        while len(out) < n:
            out.append(await anext(it))
    return out


async def test_seqs_go_on_across_a_close_and_reopen_and_lines_are_compact_json(tmp_path: Path) -> None:
    d = tmp_path / "audit"
    log = await opened(d)
    first = log.record("api", actor="token:a", method="GET", path="/v1/health")
    log.record("oom_kill", sandbox_id="sb1", labels={"team": "x"}, pid=7)
    assert first["seq"] == 1 and log.last_seq == 2
    await log.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    [seg] = segments(d)
    assert seg.name == "audit-000000000001.jsonl"
    assert stat.S_IMODE(seg.stat().st_mode) == 0o600
    lines = seg.read_text().splitlines()
    rec = json.loads(lines[1])
    assert list(rec) == KEYS
    assert rec == {**rec, "seq": 2, "kind": "oom_kill", "sandbox_id": "sb1", "labels": {"team": "x"}, "actor": None}
    assert rec["data"] == {"pid": 7}
    assert lines[1] == json.dumps(rec, separators=(",", ":"))

    log = await opened(d)
    assert log.last_seq == 2
    assert log.record("api")["seq"] == 3
    await log.close()
    log = await opened(d)
    assert log.last_seq == 3
    assert [r["seq"] for r in await log.read()] == [1, 2, 3]
    await log.close()


async def test_a_torn_last_line_is_cut_off_and_its_seq_given_again(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    for i in range(3):
        log.record("api", i=i)
    await log.close()
    [seg] = segments(tmp_path)
    whole = seg.read_bytes()
    append(seg, b'{"seq":4,"ts":17000')  # the crash came mid-line
    log = await opened(tmp_path)
    assert log.last_seq == 3
    assert seg.read_bytes() == whole
    log.record("api", i=3)
    await log.close()
    assert file_seqs(tmp_path) == [1, 2, 3, 4]


async def test_recovery_reads_back_past_damaged_lines_and_an_empty_newest_segment(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    for _ in range(5):
        log.record("api")
    await log.close()
    [seg] = segments(tmp_path)
    append(seg, b"\0\0\0garbage\n" + b"x" * 200_000)  # a damaged complete line, then a long torn one
    log = await opened(tmp_path)
    assert log.last_seq == 5
    assert [r["seq"] for r in await log.read()] == [1, 2, 3, 4, 5]  # the damaged line is skipped
    await log.close()
    # A newest segment with nothing readable: its name says where the seqs were.
    (tmp_path / "audit-000000000042.jsonl").write_bytes(b'{"seq":42,"ts"')
    log = await opened(tmp_path)
    assert log.last_seq == 41
    assert (tmp_path / "audit-000000000042.jsonl").read_bytes() == b""
    assert log.record("api")["seq"] == 42
    await log.close()


async def test_rotation_keeps_the_total_bounded_and_deletes_the_oldest_first(tmp_path: Path) -> None:
    log = await opened(tmp_path, max_bytes=8000, segment_bytes=2000)
    line_len = len(json.dumps(log.record("api", pad="x" * 100), separators=(",", ":"))) + 1
    for i in range(400):
        log.record("api", pad="x" * 100, i=i)
        if i % 7 == 0:
            await log.flush()
            total = sum(p.stat().st_size for p in segments(tmp_path))
            assert total <= 8000 + 2000 + line_len
    await log.flush()
    segs = segments(tmp_path)
    assert len(segs) >= 4
    assert all(p.stat().st_size <= 2000 + line_len for p in segs)
    firsts = [int(p.name[6:18]) for p in segs]
    assert firsts[-1] > 300  # the newest are kept, the oldest went
    seqs = file_seqs(tmp_path)
    assert seqs == list(range(seqs[0], 402)) and seqs[0] == firsts[0]  # each name is its first line's seq
    # since older than what is kept: from the oldest kept; since inside: right after it
    assert [r["seq"] for r in await log.read(since=0, limit=5)] == list(range(seqs[0], seqs[0] + 5))
    mid = firsts[2] + 3
    assert [r["seq"] for r in await log.read(since=mid, limit=10_000)] == list(range(mid + 1, 402))
    assert [r["seq"] for r in await log.read(since=firsts[1] - 1, limit=3)] == [firsts[1], firsts[1] + 1, firsts[1] + 2]
    assert await log.read(since=401) == []
    await log.close()
    log = await opened(tmp_path, max_bytes=8000, segment_bytes=2000)
    assert log.last_seq == 401
    await log.close()


async def test_filters_and_limit(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    log.record("api", sandbox_id="a")
    log.record("oom_kill", sandbox_id="a")
    log.record("finding", sandbox_id="b")
    await log.flush()
    await asyncio.sleep(0.01)  # a clear gap in ts
    cut = time.time()
    log.record("oom_kill", sandbox_id="b", labels={"k": "v"})
    log.record("network_policy", sandbox_id="a")
    assert seqs(await log.read(kinds={"oom_kill"})) == [2, 4]
    assert seqs(await log.read(kinds=["oom_kill", "finding"], sandbox_id="b")) == [3, 4]
    assert seqs(await log.read(sandbox_id="a", since=1)) == [2, 5]
    assert seqs(await log.read(since_time=cut)) == [4, 5]
    assert seqs(await log.read(limit=2, since=1)) == [2, 3]
    assert await log.read(limit=0) == []
    assert (await log.read(since=3, limit=1))[0]["labels"] == {"k": "v"}
    await log.close()


async def test_since_time_skips_whole_old_segments(tmp_path: Path) -> None:
    log = await opened(tmp_path, max_bytes=10**6, segment_bytes=500)
    for _ in range(30):
        log.record("api", pad="y" * 50)
    await log.flush()
    await asyncio.sleep(0.01)
    cut = time.time()
    for _ in range(3):
        log.record("api")
    opened_paths: list[str] = []
    real_open = builtins.open

    def spy(file: Any, *args: Any, **kw: Any) -> Any:
        opened_paths.append(str(file))
        return real_open(file, *args, **kw)

    await log.flush()
    builtins.open = spy
    try:
        got = await log.read(since_time=cut)
    finally:
        builtins.open = real_open
    assert [r["seq"] for r in got] == [31, 32, 33]
    assert len(segments(tmp_path)) > 5
    full_reads = [p for p in opened_paths if opened_paths.count(p) > 1]
    assert len(set(full_reads)) <= 2  # old segments: only their first line looked at
    await log.close()


async def test_follow_gives_the_backlog_then_live_records_in_order_once(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    writer = asyncio.create_task(log.run())
    for i in range(5):
        log.record("api", i=i)
    async with contextlib.aclosing(log.follow(since=2, heartbeat=0.05)) as it:
        backlog = await take(it, 3)
        assert [r["seq"] for r in backlog if r] == [3, 4, 5]
        nxt = await take(it, 1)
        assert nxt == [None]  # silence: a heartbeat
        log.record("finding", sandbox_id="s")

        async def later() -> None:
            await asyncio.sleep(0.02)
            log.record("api")
            log.record("api")

        task = asyncio.create_task(later())
        got: list[dict[str, Any]] = []
        while len(got) < 3:  # maybe a heartbeat in between
            got += [r for r in await take(it, 1) if r is not None]
        await task
        assert [r["seq"] for r in got] == [6, 7, 8]
        assert got[0]["kind"] == "finding"
    writer.cancel()
    await log.close()


async def test_follow_with_filters_and_without_heartbeat(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    log.record("api", sandbox_id="a")
    log.record("oom_kill", sandbox_id="a")
    async with contextlib.aclosing(log.follow(kinds={"oom_kill", "pids_limit"}, sandbox_id="a")) as it:
        assert [r["seq"] for r in await take(it, 1) if r] == [2]
        for kind, sb in [("api", "a"), ("pids_limit", "b"), ("pids_limit", "a"), ("oom_kill", "a")]:
            log.record(kind, sandbox_id=sb)
        got = await take(it, 2)
        assert [r["seq"] for r in got if r] == [5, 6]
        with pytest.raises(TimeoutError):
            await take(it, 1, timeout=0.1)  # nothing: no heartbeat asked for
    await log.close()


async def test_a_follower_behind_the_in_memory_tail_still_gets_every_record(tmp_path: Path) -> None:
    log = await opened(tmp_path, max_bytes=10**8, segment_bytes=64 * 1024)
    writer = asyncio.create_task(log.run())
    for _ in range(10):
        log.record("api")
    seen: list[int] = []
    async with contextlib.aclosing(log.follow(since=0)) as it:
        seen += [r["seq"] for r in await take(it, 10) if r]
        n = 3 * audit.TAIL_RECORDS
        for round_ in range(3):  # the consumer stalls while many records come, three times
            for _ in range(n):
                log.record("connection", peer="x")
            if round_ == 1:
                await asyncio.sleep(0.3)  # some of them written by the writer meanwhile
            seen += [r["seq"] for r in await take(it, n, timeout=30) if r]
        log.record("api")
        seen += [r["seq"] for r in await take(it, 1) if r]
    assert seen == list(range(1, 10 + 3 * n + 2))
    assert len(segments(tmp_path)) > 1
    writer.cancel()
    await log.close()


async def test_a_follower_from_before_the_oldest_kept_starts_at_the_oldest_kept(tmp_path: Path) -> None:
    log = await opened(tmp_path, max_bytes=3000, segment_bytes=1000)
    for _ in range(200):
        log.record("api", pad="z" * 40)
    await log.flush()
    oldest = file_seqs(tmp_path)[0]
    assert oldest > 1
    async with contextlib.aclosing(log.follow(since=0)) as it:
        got = [r["seq"] for r in await take(it, 201 - oldest) if r]
        assert got == list(range(oldest, 201))
        log.record("api")
        assert [r["seq"] for r in await take(it, 1) if r] == [201]
    await log.close()


async def test_record_does_no_file_io(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = await opened(tmp_path)
    loop_thread = threading.get_ident()

    def guard(real: Any) -> Any:
        def call(*args: Any, **kw: Any) -> Any:
            if threading.get_ident() == loop_thread:
                raise AssertionError(f"file I/O on the event loop: {real.__name__}{args[:1]}")
            return real(*args, **kw)

        return call

    for mod, name in [(os, "write"), (os, "open"), (os, "fsync"), (os, "ftruncate"), (builtins, "open")]:
        monkeypatch.setattr(mod, name, guard(getattr(mod, name)))
    t0 = time.perf_counter()
    for i in range(2000):
        log.record("api", i=i, path="/v1/sandboxes")
    elapsed = time.perf_counter() - t0
    monkeypatch.undo()
    assert elapsed < 1.0  # ~10 µs each
    assert segments(tmp_path) == []  # nothing written yet
    await log.close()
    assert file_seqs(tmp_path) == list(range(1, 2001))


async def test_the_writer_writes_on_its_own_soon_and_sooner_when_many_wait(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    writer = asyncio.create_task(log.run())
    log.record("api")
    await asyncio.sleep(0.3)
    assert file_seqs(tmp_path) == [1]
    writer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await writer
    writer = asyncio.create_task(log.run())
    await asyncio.sleep(0)
    for _ in range(audit.WRITE_SOON + 1):
        log.record("api")
    await asyncio.sleep(0.05)  # well under the interval: the wake-up did it
    assert len(file_seqs(tmp_path)) == audit.WRITE_SOON + 2
    writer.cancel()
    await log.close()


async def test_a_full_disk_keeps_records_pending_and_drops_the_oldest_beyond_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    log = await opened(tmp_path)
    log.record("api")
    await log.flush()
    real_write = os.write
    full = True

    def write(fd: int, data: Any) -> int:
        if full and threading.current_thread().name.startswith("sandfleet-audit"):
            n = real_write(fd, bytes(data[:10]))  # a part gets in, then the disk is full
            assert n
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    monkeypatch.setattr(audit, "MAX_PENDING", 50)
    writer = asyncio.create_task(log.run())
    for _ in range(30):
        log.record("api")
    await log.flush()
    await asyncio.sleep(0.25)
    for _ in range(40):
        log.record("api")
    await log.flush()  # does not raise
    assert not writer.done()
    assert file_seqs(tmp_path) == [1]  # the fragments were cut off again
    assert log.dropped == 20
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1
    full = False
    log.record("api")
    await log.flush()
    assert file_seqs(tmp_path) == [1, *range(22, 73)]
    assert [r["seq"] for r in await log.read(since=20, limit=3)] == [22, 23, 24]
    writer.cancel()
    await log.close()


async def test_odd_data_is_written_as_text(tmp_path: Path) -> None:
    log = await opened(tmp_path)
    rec = log.record("finding", path=tmp_path, when=(1, 2))
    assert rec["data"] == {"path": str(tmp_path), "when": [1, 2]}
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    rec = log.record("finding", value=cyclic)
    assert "unserializable" in rec["data"]
    assert [r["data"] for r in await log.read()] == [{"path": str(tmp_path), "when": [1, 2]}, rec["data"]]
    await log.close()


async def test_newest_gives_the_last_matching_records_oldest_first_across_segments(tmp_path: Path) -> None:
    log = await opened(tmp_path, max_bytes=10**6, segment_bytes=600)
    for i in range(60):
        log.record("finding" if i % 10 == 0 else "api", sandbox_id="a" if i % 2 else "b", i=i)
    await log.flush()
    assert len(segments(tmp_path)) > 5
    assert seqs(await log.read(newest=True, limit=3)) == [58, 59, 60]
    assert seqs(await log.read(newest=True, limit=4, kinds={"finding"})) == [21, 31, 41, 51]  # from older segments
    assert seqs(await log.read(newest=True, limit=2, sandbox_id="a", since=55)) == [58, 60]
    assert seqs(await log.read(newest=True, limit=1000)) == list(range(1, 61))
    assert await log.read(newest=True, since=60) == []
    await log.close()


@pytest.mark.parametrize("block", [1, 3, 7, 64, 1 << 18])
def test_a_segment_read_from_its_end_gives_its_lines_newest_first(tmp_path: Path, block: int) -> None:
    """The newest records are read from a segment's end (a page's `newest=true` reads no more of a
    large segment than it shows): every complete line, last first, whatever the block size, a line
    longer than a block whole, and a line still being written left out."""
    lines = [b'{"seq":1}\n', b"\n", b'{"seq":2,"data":"' + b"x" * 40 + b'"}\n', b'{"seq":3}\n']
    for torn in (b"", b'{"seq":4,"da'):
        path = tmp_path / f"s-{len(torn)}.jsonl"
        path.write_bytes(b"".join(lines) + torn)
        assert list(audit_lines.lines_backwards(path, block)) == lines[::-1]
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert list(audit_lines.lines_backwards(tmp_path / "empty.jsonl", block)) == []
    assert list(audit_lines.lines_backwards(tmp_path / "gone.jsonl", block)) == []
