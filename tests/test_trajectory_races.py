"""Work on a trajectory going on while other calls come: a verification in flight while the
trajectory is closed, read, listed or verified again (one verification, one verdict, a log that
replays clean, no descriptor left open); a verdict the disk refuses is still the verdict; a fenced
node answers for none of its trajectories or idempotency keys. A real daemon of the module's own
(it is restarted and fenced), its logs on a small tmpfs of their own (filled by one test); each
verification's checks wait for the test's signal, so the calls meet it in flight."""

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
from sandfleet.errors import NotFoundError, SandboxError, WrongStateError

from conftest import Daemon, agent_pid, destroy_daemon, make_daemon, wait_until

SPEC = SandboxSpec(image="busybox", idle_ttl=300)
CHECKS = "while [ ! -e /go ]; do sleep 0.05; done; echo checked"  # passes once the test says so
VERIFY_LABEL = "sandfleet.verify"


@pytest.fixture(scope="module")
def d() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    daemon = make_daemon("trajrace")
    logs = daemon.state_dir / "trajectories"
    logs.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(logs)], check=True)
    try:
        daemon.start()
        yield daemon
    finally:
        destroy_daemon(daemon)
        subprocess.run(["umount", "-l", str(logs)], check=False)
        subprocess.run(["rm", "-rf", str(daemon.root)], check=False)


def _verifier(d: Daemon, fleet: Client, sandbox_id: str) -> str:
    """The verifier of `sandbox_id` once its checks run (so its verification is logged as begun)."""
    found: list[str] = []

    def running() -> bool:
        found[:] = [s.id for s in fleet.list(labels={VERIFY_LABEL: sandbox_id}) if s.state == "running"]
        return len(found) == 1 and _root(d, found[0]) is not None

    assert wait_until(running, timeout=60), found
    return found[0]


def _root(d: Daemon, sandbox_id: str) -> Path | None:
    try:
        return Path(f"/proc/{agent_pid(d, sandbox_id)}/root")
    except (OSError, LookupError):
        return None


def _read(d: Daemon, sandbox_id: str, name: str) -> str:
    root = _root(d, sandbox_id)
    try:
        return "" if root is None else (root / name).read_text()
    except OSError:
        return ""


def _go(d: Daemon, verifier_id: str) -> None:
    root = _root(d, verifier_id)
    assert root is not None
    (root / "go").touch()


def _in_thread(got: dict[str, Any], name: str, call: Any) -> threading.Thread:
    def run() -> None:
        try:
            got[name] = call()
        except SandboxError as exc:
            got[name] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _log(d: Daemon, tid: str) -> Path:
    return d.state_dir / "trajectories" / "_" / f"{tid}.jsonl"


def _records(d: Daemon, tid: str) -> list[dict[str, Any]]:
    return [json.loads(line.rsplit(b"\t", 1)[0]) for line in _log(d, tid).read_bytes().splitlines()]


def _open_fds(d: Daemon, name: str) -> list[str]:
    """The daemon's descriptors open on a file whose name starts with `name`."""
    out = []
    for fd in os.listdir(f"/proc/{d.pid}/fd"):
        try:
            target = os.readlink(f"/proc/{d.pid}/fd/{fd}")
        except OSError:
            continue
        if os.path.basename(target).startswith(name):
            out.append(target)
    return out


def test_a_trajectory_is_not_closed_under_its_verification(d: Daemon) -> None:
    """Closing while its verification runs is refused (its reward would be the verdict's); reads
    meanwhile see no verdict; the one verdict is logged once and replays after a restart."""
    with d.client(timeout=60) as fleet:
        traj = fleet.trajectory("verify-then-close", SPEC)
        traj.exec("echo work > /work.txt")
        assert traj.sandbox is not None
        got: dict[str, Any] = {}
        thread = _in_thread(got, "verdict", lambda: traj.verify(CHECKS))
        verifier = _verifier(d, fleet, traj.sandbox.id)
        with pytest.raises(WrongStateError, match="being verified"):
            traj.close()
        listed = [t for t in fleet.trajectories() if t.id == "verify-then-close"]
        for info in (fleet.get_trajectory("verify-then-close").info, *listed):
            assert info.state == "open" and info.verification is None, info
        _go(d, verifier)
        thread.join(timeout=60)
        verdict = got["verdict"]
        assert not isinstance(verdict, SandboxError) and verdict.passed and verdict.cause is None, verdict
        assert traj.close().reward == 1.0
    assert [r["k"] for r in _records(d, "verify-then-close")].count("verify") == 1
    d.stop()
    d.start()
    with d.client(timeout=60) as fleet:
        again = fleet.get_trajectory("verify-then-close")
        assert again.info.lost_from is None and again.info.verification == verdict
        assert not list(_log(d, "verify-then-close").parent.glob("verify-then-close.jsonl.*"))  # nothing damaged
        again.delete()


def test_a_closed_trajectory_is_verified_once_however_it_is_asked(d: Daemon) -> None:
    """Closed (its sandbox kept), then verified by two callers at once while others read it: one
    verifier, one verdict for both, no `infra` verdict made up by a read, one record, a log that
    replays clean, and no descriptor of it left open once it is done."""
    with d.client(timeout=60) as fleet, d.client(timeout=60) as other:
        traj = fleet.trajectory("closed-then-verified", SPEC)
        traj.exec("echo work > /work.txt")
        assert traj.sandbox is not None
        traj.close(stop_sandbox=False)
        got: dict[str, Any] = {}
        first = _in_thread(got, "first", lambda: traj.verify(CHECKS))
        verifier = _verifier(d, fleet, traj.sandbox.id)
        second = _in_thread(got, "second", lambda: other.get_trajectory("closed-then-verified").verify(CHECKS))
        for _ in range(3):  # reads while it runs: none takes it for a verification a restart cut short
            info = fleet.get_trajectory("closed-then-verified").info
            assert info.state == "closed" and info.verification is None, info.verification
            assert [t.verification for t in fleet.trajectories(state="closed") if t.id == info.id] == [None]
            time.sleep(0.2)
        assert [s.id for s in fleet.list(labels={VERIFY_LABEL: traj.sandbox.id})] == [verifier]  # one verifier
        _go(d, verifier)
        first.join(timeout=60)
        second.join(timeout=60)
        assert not isinstance(got["first"], SandboxError) and got["first"].passed, got
        assert got["second"].model_copy(update={"replayed": False}) == got["first"], got
        assert got["first"].verifier_sandbox_id == verifier
        info = fleet.get_trajectory("closed-then-verified").info
        assert info.verification == got["first"] and info.lost_from is None
    assert [r["k"] for r in _records(d, "closed-then-verified")] == ["open", "sandbox", "begin", "done"] + [
        "close",
        "verifying",
        "verify",
    ]
    assert wait_until(lambda: not _open_fds(d, "closed-then-verified"), timeout=5), _open_fds(d, "closed-then-verified")
    with d.client(timeout=60) as fleet:
        again = fleet.get_trajectory("closed-then-verified")
        assert again.verify(CHECKS).replayed
        assert again.sandbox is not None
        again.sandbox.stop()
        again.delete()
    assert not _open_fds(d, "closed-then-verified")


def _fill(path: Path) -> None:
    """Fill the filesystem of `path` to its last byte."""
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC


def test_a_verdict_the_disk_refuses_is_still_the_verdict(d: Daemon) -> None:
    """The logs' disk fills while the checks run: the verdict is answered (not `resource_exhausted`
    for a verification that was done), held, and logged before the next record once there is room;
    a restart then replays it, not an `infra` verdict."""
    filler = d.state_dir / "trajectories" / "filler"
    with d.client(timeout=60) as fleet:
        traj = fleet.trajectory("verdict-on-full-disk", SPEC)
        traj.exec("echo work > /work.txt")
        assert traj.sandbox is not None
        traj.retry_for = 0  # the node's own answer, not a retry's
        got: dict[str, Any] = {}
        # Its output makes a record larger than what the log's last page still holds on a full disk.
        thread = _in_thread(got, "verdict", lambda: traj.verify(CHECKS + "; head -c 20000 /dev/zero | tr '\\0' x"))
        verifier = _verifier(d, fleet, traj.sandbox.id)
        try:
            _fill(filler)
            _go(d, verifier)
            thread.join(timeout=60)
            verdict = got["verdict"]
            assert not isinstance(verdict, SandboxError), verdict
            assert verdict.passed and "its verdict could not be logged yet" in d.log()
            assert fleet.get_trajectory("verdict-on-full-disk").info.verification == verdict
        finally:
            filler.unlink(missing_ok=True)
        assert traj.close().reward == 1.0  # the held verdict goes out first
    d.stop()
    d.start()
    with d.client(timeout=60) as fleet:
        again = fleet.get_trajectory("verdict-on-full-disk")
        assert again.info.verification == verdict and again.info.reward == 1.0
        assert [r["k"] for r in _records(d, "verdict-on-full-disk")][-3:] == ["verifying", "verify", "close"]
        again.delete()


# Last in the module: a fence stops every sandbox of the node.
def test_a_fenced_node_answers_for_none_of_its_trajectories_or_keys(d: Daemon) -> None:
    """Fenced (the cluster told callers all it held is lost): its trajectories (open, closed, one in
    mid-step) answer `not_found`, its idempotency keys are not held (also after a restart), and an
    id or key used again makes something new; nothing the fence set aside is written again."""
    ids = ("fenced-open", "fenced-closed", "fenced-mid-step")
    with d.client(timeout=60) as fleet:
        trajectories = {tid: fleet.trajectory(tid, SPEC) for tid in ids}
        for traj in trajectories.values():
            traj.exec("echo step-0 >> /ran")
        trajectories["fenced-closed"].close()
        keyed = fleet.create(SPEC, idempotency_key="fence-key-1")
        mid = trajectories["fenced-mid-step"]
        got: dict[str, Any] = {}
        thread = _in_thread(got, "step", lambda: mid.exec("echo step-1 >> /ran; sleep 30", timeout=60))
        assert mid.sandbox is not None
        assert wait_until(lambda: "step-1" in _read(d, mid.sandbox.id, "ran"), timeout=30)  # type: ignore[union-attr]
        held = [{"key": "fence-key-1"}, {"key": "trajectory:fenced-open"}]
        assert fleet._http.post("/v1/sandboxes/keys", json={"keys": held}).json() == {"held": [True, True]}  # type: ignore[attr-defined]

        fleet.fence(1)
        thread.join(timeout=60)
        for tid in ids:
            with pytest.raises(NotFoundError):
                fleet.get_trajectory(tid)
        assert not [t for t in fleet.trajectories() if t.id in ids]
        assert fleet._http.post("/v1/sandboxes/keys", json={"keys": held}).json() == {"held": [False, False]}  # type: ignore[attr-defined]
        folder = _log(d, "x").parent
        assert not [p.name for p in folder.glob("fenced-*.jsonl")]
        assert sorted(p.name.split(".jsonl.")[0] for p in folder.glob("fenced-*.jsonl.fenced-*")) == sorted(ids)
        assert not _open_fds(d, "fenced-")
    d.stop()
    d.start()
    with d.client(timeout=60) as fleet:
        assert fleet._http.post("/v1/sandboxes/keys", json={"keys": held}).json() == {"held": [False, False]}  # type: ignore[attr-defined]
        for tid in ids:
            with pytest.raises(NotFoundError):
                fleet.get_trajectory(tid)
        fresh = fleet.create(SPEC, idempotency_key="fence-key-1")
        assert fresh.id != keyed.id and fresh.info.state == "running"
        again = fleet.trajectory("fenced-open", SPEC)  # a new trajectory, in a new sandbox
        assert again.sandbox is not None and again.sandbox.id != trajectories["fenced-open"].sandbox.id  # type: ignore[union-attr]
        assert again.exec("cat /ran 2>/dev/null; echo new").stdout == "new\n" and again.last is not None
        assert not again.last.replayed
        again.close()
        again.delete()
        fresh.stop()
