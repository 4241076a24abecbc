"""A trajectory's log damaged on disk (a torn tail, a changed record, a disk that filled mid-record)
never makes a logged step run twice, and every step past damage the node cannot read answers
`data_loss`. A real daemon whose state directory is a small tmpfs of the test's own, killed
(SIGKILL) and started again; each step's command leaves a mark in its sandbox, counted."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.errors import DataLossError, NotFoundError, ResourceExhaustedError, SandboxError
from sandfleet.models import ExecAction, ExecRequest

from conftest import Daemon, agent_pid, destroy_daemon, make_daemon, wait_until

SPEC = SandboxSpec(image="busybox", idle_ttl=300)


@pytest.fixture(scope="module")
def d() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    daemon = make_daemon("trajlog")
    daemon.state_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m,mode=0755", "tmpfs", str(daemon.state_dir)], check=True)
    try:
        daemon.start()
        yield daemon
    finally:
        destroy_daemon(daemon)
        subprocess.run(["umount", "-l", str(daemon.state_dir)], check=False)
        daemon.state_dir.rmdir()
        daemon.root.rmdir()


def _log(d: Daemon, tid: str) -> Path:
    (path,) = (d.state_dir / "trajectories").glob(f"**/{tid}.jsonl")  # the root's ("_/"): no [iam] here
    return path


# Step 1 of the full-disk test waits for the test's signal, then prints 20,000 bytes: a result far
# larger than what the log's last page still holds once the disk is full.
_WAIT_THEN_BIG = "while [ ! -e /go ]; do sleep 0.05; done; head -c 20000 /dev/zero | tr '\\0' x; "


def _mark(k: int, extra: str = "") -> str:
    return f"echo S{k} >> /marks; {extra}echo out-{k}"


def _full_disk_step(k: int) -> str:
    return _mark(k, _WAIT_THEN_BIG if k == 1 else "")


def _marks(fleet: Client, tid: str) -> list[str]:
    traj = fleet.get_trajectory(tid)
    assert traj.sandbox is not None
    return traj.sandbox.exec("cat /marks").stdout.split()


def _restart(d: Daemon) -> None:
    d.kill()
    time.sleep(0.2)
    d.start()


def _whole_lines(path: Path) -> None:
    """Each line of the log is a whole record (no fragment anywhere, none glued onto one)."""
    data = path.read_bytes()
    assert data.endswith(b"\n")
    for line in data[:-1].split(b"\n"):
        assert isinstance(json.loads(line.rsplit(b"\t", 1)[0]), dict), line  # its checksum aside


@pytest.mark.slow
def test_a_torn_tail_is_cut_on_disk_and_nothing_runs_twice(d: Daemon) -> None:
    with d.client(timeout=60) as fleet:
        traj = fleet.trajectory("torn", SPEC)
        answers = [traj.exec(_mark(k)).stdout for k in range(2)]
    _restart(d)
    path = _log(d, "torn")
    with path.open("ab") as f:  # what a write cut short leaves: the start of a record, no newline
        f.write(path.read_bytes().splitlines(keepends=True)[-1][:60])
    _restart(d)
    with d.client(timeout=60) as fleet:
        again = fleet.trajectory("torn", SPEC)
        assert [again.exec(_mark(k)).stdout for k in range(2)] == answers and again.last is not None
        assert again.last.replayed
        answers.append(again.exec(_mark(2)).stdout)  # the first new step: appended after the cut
        assert not again.last.replayed
        _whole_lines(path)
    _restart(d)
    with d.client(timeout=60) as fleet:
        again = fleet.trajectory("torn", SPEC)
        assert [again.exec(_mark(k)).stdout for k in range(3)] == answers and again.last.replayed
        again.exec(_mark(3))
        assert _marks(fleet, "torn") == ["S0", "S1", "S2", "S3"]  # each step ran once
        again.close()
        again.delete()


def _corrupt(path: Path, step: int, old: bytes, new: bytes) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    (i,) = [i for i, line in enumerate(lines) if b'"k":"done","step":%d,' % step in line]
    assert old in lines[i]
    lines[i] = lines[i].replace(old, new, 1)
    path.write_bytes(b"".join(lines))


def test_a_corrupt_record_makes_every_later_step_data_loss(d: Daemon) -> None:
    """Two logs damaged in step 1's result: one so its JSON breaks (what an old daemon's reader
    skipped silently), one only in content (the JSON still parses: the checksum tells). A third
    damaged in its first record: nothing of it can be read, but it can be deleted."""
    tids = {"broken-json": (b'"result":{', b'"result":#'), "changed-byte": (b"out-1", b"oux-1")}
    with d.client(timeout=60) as fleet:
        for tid in [*tids, "broken-open"]:
            traj = fleet.trajectory(tid, SPEC)
            for k in range(4):
                traj.exec(_mark(k))
    d.kill()
    for tid, (old, new) in tids.items():
        _corrupt(_log(d, tid), 1, old, new)
    _log(d, "broken-open").write_bytes(_log(d, "broken-open").read_bytes().replace(b'"k":"open"', b'"k":"opem"', 1))
    d.start()
    with d.client(timeout=60) as fleet:
        for call in (lambda: fleet.get_trajectory("broken-open"), lambda: fleet.trajectory("broken-open", SPEC)):
            with pytest.raises(DataLossError, match="unreadable from its start"):
                call()
        assert fleet._http.delete("/v1/trajectories/broken-open").status_code == 200  # type: ignore[attr-defined]
        with pytest.raises(NotFoundError):
            fleet.get_trajectory("broken-open")
        (orphan,) = fleet.list(labels={"sandfleet.trajectory": "broken-open"})  # its sandbox: unknown to it now
        fleet.get(orphan.id).stop()
        for tid in tids:
            again = fleet.trajectory(tid, SPEC)
            assert again.exec(_mark(0)).stdout == "out-0\n" and again.last is not None and again.last.replayed
            for k in (1, 2, 3, 4):  # the damaged one, the logged ones after it, a new one: none runs
                with pytest.raises(DataLossError, match=f"damaged from step 1 on: step {k} may have been done"):
                    again.step(ExecAction(exec=ExecRequest(command=_mark(k))), step=k)
            with pytest.raises(DataLossError, match="its verification"):
                again.verify("true")
            info = again.refresh()
            assert info.lost_from == 1 and info.steps == 1 and info.state == "open"
            assert _marks(fleet, tid) == ["S0", "S1", "S2", "S3"], tid
            (aside,) = _log(d, tid).parent.glob(f"{tid}.jsonl.damaged-*")  # kept for whoever looks
            assert tids[tid][1] in aside.read_bytes()
            assert again.close(stop_sandbox=False).state == "closed"
    _restart(d)  # the log was rewritten whole: it reads the same, closed, still lost from step 1
    with d.client(timeout=60) as fleet:
        for tid in tids:
            again = fleet.get_trajectory(tid)
            assert again.info.lost_from == 1 and again.info.state == "closed"
            assert [s.step for s in again.steps()] == [0]
            with pytest.raises(DataLossError):
                again.step(ExecAction(exec=ExecRequest(command=_mark(2))), step=2)
            assert _marks(fleet, tid) == ["S0", "S1", "S2", "S3"]
            again.delete()


def _fill(path: Path) -> None:
    """Fill the filesystem of `path` to its last byte."""
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    assert os.statvfs(path).f_bavail == 0


def test_a_disk_full_mid_record_never_makes_a_step_run_twice(d: Daemon) -> None:
    """The state disk fills while step 1 runs, so its result's record fits only in part; space
    comes back and step 2 runs; the daemon is killed. Every step ran once, every answer stands."""
    filler = d.state_dir / "filler"
    with d.client(timeout=60) as fleet:
        traj = fleet.trajectory("full-disk", SPEC)
        answers = [traj.exec(_mark(0)).stdout]
        assert traj.sandbox is not None
        sandbox_root = Path(f"/proc/{agent_pid(d, traj.sandbox.id)}/root")
        got: dict[str, Any] = {}

        def step_1() -> None:
            try:
                got["stdout"] = traj.exec(_full_disk_step(1))
            except SandboxError as exc:
                got["error"] = exc

        runner = threading.Thread(target=step_1)
        runner.start()
        assert wait_until(lambda: (sandbox_root / "marks").read_text().split() == ["S0", "S1"], timeout=30)
        try:
            _fill(filler)
            (sandbox_root / "go").touch()  # the sandbox's own disk is not the state disk
            runner.join(timeout=60)
            assert "stdout" in got, got  # answered from memory; its record is held for later
            assert "step 1's result could not be logged" in d.log()
            answers.append(got["stdout"].stdout)
            assert answers[1].endswith("x" * 20000 + "out-1\n")
            _whole_lines(_log(d, "full-disk"))  # the part that went in was cut back at once
            traj.retry_for = 0
            with pytest.raises(ResourceExhaustedError, match="disk is full"):  # no room for its begin: not run
                traj.exec(_mark(2))
            traj.retry_for = 300
        finally:
            filler.unlink(missing_ok=True)
        answers.append(traj.exec(_mark(2)).stdout)
    _restart(d)
    with d.client(timeout=60) as fleet:
        again = fleet.trajectory("full-disk", SPEC)
        replayed = [again.exec(_full_disk_step(k)).stdout for k in range(3)]
        assert replayed == answers and again.last is not None and again.last.replayed
        again.exec(_mark(3))
        assert _marks(fleet, "full-disk") == ["S0", "S1", "S2", "S3"]
        _whole_lines(_log(d, "full-disk"))
        again.close()
        again.delete()
