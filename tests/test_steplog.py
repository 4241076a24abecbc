"""A trajectory's log file (daemon/rl/steplog.py) on its own: checksummed records, a torn tail told
from damage, replay that refuses a record out of place, and appends that a short write never
leaves a fragment of (a real short write: the kernel's file size limit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandfleet.daemon.rl.steplog import StepLog, decode, encode, mend_tail, replay, rewrite, scan
from sandfleet.models import SandboxSpec, TrajectoryOpen

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src"


def _open_record() -> dict[str, object]:
    req = TrajectoryOpen(id="t", spec=SandboxSpec(image="busybox"))
    return {"k": "open", "t": 1.0, "request": req.model_dump(mode="json")}


def _sandbox_record() -> dict[str, object]:
    sandbox = {"id": "sb-1", "state": "running", "spec": {"image": "busybox"}, "created_at": 1.0, "last_active_at": 1.0}
    return {"k": "sandbox", "sandbox": sandbox}


def _step(k: int, out: str) -> list[dict[str, object]]:
    action = {"kind": "exec", "exec": {"command": f"echo {out}"}}
    result = {"trajectory_id": "t", "step": k, "kind": "exec", "replayed": False, "started_at": 1.0, "duration": 0.1}
    return [
        {"k": "begin", "step": k, "digest": f"d{k}", "t": 1.0, "action": action},
        {"k": "done", "step": k, "digest": f"d{k}", "result": {**result, "content": out}},
    ]


def _log(*records: dict[str, object]) -> bytes:
    return b"".join(encode(r) for r in records)


def test_a_changed_byte_is_caught_and_old_lines_still_read() -> None:
    line = encode({"k": "done", "out": "out-1"})
    assert line.endswith(b"\n") and decode(line[:-1]) == {"k": "done", "out": "out-1"}
    flipped = line.replace(b"out-1", b"oux-1")  # still valid JSON: only the checksum tells
    assert json.loads(flipped.split(b"\t")[0]) == {"k": "done", "out": "oux-1"}
    assert decode(flipped[:-1]) is None
    assert decode(b'{"k":"done","step":1}') == {"k": "done", "step": 1}  # written before checksums
    for bad in (b"", b"[1]", b'{"k":"done"', line[:-5]):
        assert decode(bad) is None, bad


async def test_torn_tail_whole_tail_and_damage() -> None:
    good = _log(_open_record(), _sandbox_record(), *_step(0, "a"), *_step(1, "b"))
    assert (s := scan(good)).end == s.size == len(good) and len(s.lines) == 6

    torn = good + encode(_step(2, "c")[0])[:40]  # a write that never finished
    s = scan(torn)
    assert (s.end, s.size, s.whole_tail, len(s.lines)) == (len(good), len(torn), False, 6)

    begun = good + encode(_step(2, "c")[0])[:-1]  # whole but for its newline: it may have happened
    s = scan(begun)
    assert s.whole_tail and len(s.lines) == 7
    t, damage = replay((None, "t"), Path("/nonexistent"), s, False)
    assert t is not None and damage is None and t.running is not None and t.running[0] == 2

    # A changed byte in step 1's result: step 1 and all after it are lost, step 0 stands.
    lines = good.splitlines(keepends=True)
    lines[5] = lines[5].replace(b'"b"', b'"x"')
    t, damage = replay((None, "t"), Path("/nonexistent"), scan(b"".join(lines)), False)
    assert t is not None and damage == 5 and t.lost_from == 1 and len(t.steps) == 1 and t.running is None
    assert t.info().lost_from == 1


async def test_a_record_out_of_place_is_damage() -> None:
    head = [_open_record(), _sandbox_record(), *_step(0, "a")]
    cases = {
        "skips a step": [*head, *_step(2, "c")],
        "done of another step": [*head, _step(1, "b")[0], _step(2, "c")[1]],
        "begin while one runs": [*head, _step(1, "b")[0], _step(2, "c")[0]],  # an old daemon's lost done
        "a second open": [*head, _open_record()],
        "unknown kind": [*head, {"k": "nonsense"}],
    }
    for name, records in cases.items():
        t, damage = replay((None, "t"), Path("/nonexistent"), scan(_log(*records)), False)
        assert t is not None and damage is not None and t.lost_from == 1, name
    lost = [*head, _step(1, "b")[0], {"k": "lost", "step": 1, "t": 2.0}, {"k": "close", "t": 3.0, "reward": None}]
    t, damage = replay((None, "t"), Path("/nonexistent"), scan(_log(*lost)), False)
    assert t is not None and damage is None and t.lost_from == 1 and t.closed_at == 3.0 and t.running is None


def test_mend_and_rewrite_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = _log(_open_record(), *_step(0, "a"))
    path.write_bytes(good + b'{"k":"beg')
    assert mend_tail(path, scan(path.read_bytes()), False) == len(good) and path.read_bytes() == good
    whole = encode(_step(1, "b")[0])
    path.write_bytes(good + whole[:-1])
    assert mend_tail(path, scan(path.read_bytes()), True) == len(good) + len(whole)
    assert path.read_bytes() == good + whole
    rewrite(path, good)
    assert path.read_bytes() == good
    (aside,) = tmp_path.glob("t.jsonl.damaged-*")
    assert aside.read_bytes() == good + whole and not (tmp_path / "t.jsonl.tmp").exists()


# A child process with a file size limit: its writes past the limit are short, then EFBIG, as on a
# full disk (SIGXFSZ ignored, as the daemon would not die of it either).
_SHORT_WRITE = """
import asyncio, resource, signal, sys
from pathlib import Path
from sandfleet.daemon.rl.steplog import StepLog
path, limit, sync = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

async def main():
    log = StepLog(path, 0, sync)
    await log.append(b"A" * 100 + b"\\n")
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        await log.append(b"B" * 200 + b"\\n", hold=True)
    except OSError as exc:
        print("refused", exc.errno, path.stat().st_size, len(log.held))
    try:
        await log.append(b"C" * 10 + b"\\n")
    except OSError as exc:
        print("refused", exc.errno, path.stat().st_size, len(log.held))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    await log.append(b"D" * 10 + b"\\n")
    print("size", log.size, path.stat().st_size, len(log.held), log.broken)

asyncio.run(main())
"""


@pytest.mark.parametrize("sync", [False, True])
def test_a_short_write_is_cut_back_and_held_records_go_first(tmp_path: Path, sync: bool) -> None:
    path = tmp_path / "t.jsonl"
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", _SHORT_WRITE, str(path), "150", "1" if sync else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("\n")
    # B went in part (up to the limit): cut back to A; held. C is refused too (B goes first).
    assert out[0] == "refused 28 101 1" and out[1] == "refused 28 101 1", out
    assert out[2] == f"size {101 + 201 + 11} {101 + 201 + 11} 0 False", out
    assert path.read_bytes() == b"A" * 100 + b"\n" + b"B" * 200 + b"\n" + b"D" * 10 + b"\n"


def test_a_log_that_cannot_be_cut_back_takes_nothing_more(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"A\n")
    log = StepLog(path, 2, False)
    log.fd = os.open(path, os.O_RDONLY)  # its writes fail, and so does cutting back
    with pytest.raises(OSError):
        log._append(b"B\n", True)
    assert log.broken
    with pytest.raises(OSError, match="could not be cut back"):
        log._append(None, False)
    log.close()
    assert path.read_bytes() == b"A\n"


async def test_a_cancelled_append_keeps_the_log_until_its_write_is_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With fsync the write runs on a thread that a cancellation cannot stop: the caller's append is
    cancelled, but the log stays locked until that write is done, so the next append never runs
    beside it (both records whole, in order, the size counting both)."""
    import asyncio
    import threading

    log = StepLog(tmp_path / "t.jsonl", 0, True)
    started, release = threading.Event(), threading.Event()
    write = log._append

    def slow(line: bytes | None, hold: bool) -> None:
        if line == b"first\n":
            started.set()
            release.wait(5)
        write(line, hold)

    monkeypatch.setattr(log, "_append", slow)
    first = asyncio.ensure_future(log.append(b"first\n"))
    await asyncio.to_thread(started.wait, 5)
    first.cancel()
    second = asyncio.ensure_future(log.append(b"second\n"))
    await asyncio.sleep(0.05)
    assert not second.done()  # waits for the first write, cancelled or not
    release.set()
    await second
    with pytest.raises(asyncio.CancelledError):
        await first
    assert (tmp_path / "t.jsonl").read_bytes() == b"first\nsecond\n" and log.size == 13
