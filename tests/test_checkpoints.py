"""Checkpoints and rollback in place: the same sandbox goes back to an earlier state (files, process
memory, sessions with their cwd and env, background processes), keeps its isolation, and leaves
nothing behind.

How long a checkpoint and a rollback take is measured in bench/ (`checkpoint`), not asserted here.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from pathlib import Path

import pytest

from sandfleet import Client, Sandbox, SandboxError, SandboxSpec
from sandfleet.errors import DataLossError, InvalidArgumentError, NotFoundError, UnavailableError, WrongStateError

from conftest import Daemon, serve_http, wait_until
from leakcheck import residue

JOB = {"job": "checkpoint-test"}
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.02; done"
# A value only the process's memory holds (never in a file until asked), written out on demand.
HOLDER = """
import os, time
v = "kept-" + "7" * 3
while True:
    if os.path.exists("/tmp/ask"):
        open("/tmp/v", "w").write(v)
        os.remove("/tmp/ask")
    time.sleep(0.02)
"""


def _count(sb: Sandbox) -> int:
    out = sb.exec("cat /tmp/count").stdout.strip()
    return int(out) if out else 0


def test_a_rollback_brings_the_same_sandbox_back_to_its_checkpoint(fleet: Client) -> None:
    with fleet.create(image="busybox", labels=JOB) as sb:
        sb.files.write("/work/a.txt", "one")
        shell = sb.session()
        shell.run("cd /tmp && export MARK=before && HIDDEN=in-memory")  # HIDDEN lives in the shell only
        counter = sb.start(COUNTER)
        assert wait_until(lambda: _count(sb) > 5)
        cp = sb.checkpoint(labels={"step": "1"})
        assert cp.sandbox_id == sb.id and cp.labels == {"step": "1"} and cp.size_bytes > 0
        at_checkpoint = _count(sb)

        # The branch that is thrown away.
        sb.files.write("/work/a.txt", "two")
        sb.files.write("/work/b.txt", "new")
        shell.run("cd / && export MARK=after && HIDDEN=changed")
        late_shell = sb.session()
        late = sb.start("sleep 1000")

        result = sb.rollback(cp)
        assert result.sandbox_id == sb.id and result.checkpoint_id == cp.id
        assert result.dropped_sessions == [late_shell.id] and result.dropped_processes == [late.id]
        assert sb.refresh().state == "running" and sb.info.id == result.sandbox_id
        assert sb.files.read("/work/a.txt") == b"one"
        assert not sb.files.exists("/work/b.txt")
        assert shell.run('pwd; echo "$MARK $HIDDEN"').stdout == "/tmp\nbefore in-memory\n"
        # The counter goes on from where it was, under the same handle (read after the checkpoint
        # returned: the checkpoint's own count may be a tick or two lower, and a swap is quick).
        assert at_checkpoint - 5 <= _count(sb) < at_checkpoint + 40
        assert wait_until(lambda: _count(sb) > at_checkpoint + 5)
        assert {p.id for p in sb.processes() if p.running} == {counter.id}
        assert [s.id for s in sb.sessions()] == [shell.id]
        with pytest.raises(NotFoundError):
            late_shell.run("true")

        # Back again, as often as a search needs.
        sb.files.write("/work/a.txt", "three")
        sb.rollback(cp.id)
        assert sb.files.read("/work/a.txt") == b"one"
        assert sb.exec("echo fine").stdout == "fine\n"
        assert [c.id for c in sb.checkpoints()] == [cp.id]
        events = [e.kind for e in sb.events()]
        assert events.count("rolled_back") == 2 and "checkpoint" in events
        sb.delete_checkpoint(cp)
        assert sb.checkpoints() == []
        with pytest.raises(NotFoundError):
            sb.rollback(cp)
    assert fleet.list(labels=JOB) == []


def test_a_rolled_back_sandbox_keeps_its_isolation(fleet: Client) -> None:
    """The restore that puts it back makes its namespaces anew: as unprivileged, and as closed off,
    as they were."""
    probe = (
        "cat /proc/self/uid_map /proc/self/gid_map /proc/self/cgroup; ls /sys/class/net; ls /proc | grep -c '^[0-9]'"
    )
    with fleet.create(image="busybox", labels=JOB) as sb:
        before = sb.exec(probe).stdout
        sb.rollback(sb.checkpoint())
        assert sb.exec(probe).stdout.split() == before.split()
        assert sb.exec("cat /proc/self/uid_map").stdout.split() == ["0", "100000", "65536"]
        assert all(line.endswith(":/") for line in sb.exec("cat /proc/self/cgroup").stdout.split())
        scratch = sb.exec("ls /dev/.sandfleet 2>&1").stdout  # closed again before any of its code ran
        assert "Permission denied" in scratch and "upper" not in scratch, scratch


def _standby_ready(d: Daemon, sb: Sandbox) -> bool:
    """Whether the sandbox's latest checkpoint is restored ahead (a standby: frozen, under a name of
    its own), so a rollback to it swaps instead of restoring."""
    for name in os.listdir(d.run_dir / "sandboxes"):
        state = Path("/sys/fs/cgroup/freezer") / d.cgroup_parent / name / "freezer.state"
        if name.startswith(f"{sb.id}.standby-") and state.exists() and state.read_text().strip() == "FROZEN":
            return True
    return False


def _standbys(d: Daemon) -> list[str]:
    """Standbys and old parts set aside (a promoted standby's directory says whose live part it is)."""
    root = d.run_dir / "sandboxes"
    return [n for n in os.listdir(root) if ".standby-" in n and not (root / n / "promoted").exists()]


def _parts(d: Daemon, sb: Sandbox) -> list[str]:
    """The sandbox's cgroups: its live part's (its id, or the name of the standby a rollback
    promoted), its standby's and old parts' not destroyed yet."""
    root = Path("/sys/fs/cgroup/freezer") / d.cgroup_parent
    return sorted(n for n in os.listdir(root) if n == sb.id or n.startswith(f"{sb.id}.standby-"))


def _live_part(d: Daemon, sb: Sandbox) -> str:
    """Once its old parts are gone and its standby is made: the one that is not frozen."""
    root = Path("/sys/fs/cgroup/freezer") / d.cgroup_parent
    [live] = [n for n in _parts(d, sb) if (root / n / "freezer.state").read_text().strip() == "THAWED"]
    return live


def test_a_rollback_to_a_standby_is_a_swap_with_the_same_state(daemon: Daemon, fleet: Client) -> None:
    """The latest checkpoint is restored ahead and kept frozen; a rollback to it thaws that restore in
    the sandbox's place (under its own name): the same state as a restore gives (files, memory, sessions, processes),
    the same isolation, again after each rollback, and nothing left once the sandbox stops."""
    probe = "cat /proc/self/uid_map /proc/self/gid_map /proc/self/cgroup; ls /sys/class/net; ls -a /dev/.sandfleet 2>&1"
    with fleet.create(image="python", labels=JOB) as sb:
        before = sb.exec(probe).stdout
        sb.files.write("/work/a.txt", "one")
        shell = sb.session()
        shell.run("cd /tmp && export MARK=before && HIDDEN=in-memory")
        # Process memory: a value only the process holds, printed on demand.
        holder = sb.start(["python3", "-c", HOLDER])
        counter = sb.start(COUNTER)
        assert wait_until(lambda: _count(sb) > 5)
        cp = sb.checkpoint()
        at_checkpoint = _count(sb)
        # Made on CPU no one else wants (and two at a time on the node): on a busy node it may take a
        # while. (A rollback before its restore began restores instead; one while it runs waits.)
        assert wait_until(lambda: _standby_ready(daemon, sb), 60)
        for round_ in range(2):
            sb.files.write("/work/a.txt", f"two-{round_}")
            sb.files.write("/work/b.txt", "new")
            shell.run("cd / && export MARK=after && HIDDEN=changed")
            late = sb.start("sleep 1000")
            result = sb.rollback(cp)
            assert result.dropped_processes == [late.id]
            [event] = [e for e in sb.events() if e.kind == "rolled_back"][-1:]
            assert event.data["standby"] is True, event.data
            assert sb.files.read("/work/a.txt") == b"one" and not sb.files.exists("/work/b.txt")
            assert shell.run('pwd; echo "$MARK $HIDDEN"').stdout == "/tmp\nbefore in-memory\n"
            # (read after the checkpoint returned: the checkpoint's own count may be a tick or two lower)
            assert at_checkpoint - 5 <= _count(sb) < at_checkpoint + 60
            sb.exec("rm -f /tmp/v && touch /tmp/ask")
            assert wait_until(lambda: sb.exec("cat /tmp/v 2>/dev/null").stdout == "kept-777", 10)
            assert {p.id for p in sb.processes() if p.running} == {counter.id, holder.id}
            assert sb.exec(probe).stdout.split() == before.split()  # as closed off as it was
            assert wait_until(lambda: _standby_ready(daemon, sb), 60)  # made again for the next rollback
            assert wait_until(lambda: len(_parts(daemon, sb)) == 2, 10)  # the old part is gone
            live_part = _live_part(daemon, sb)
            assert live_part.startswith(f"{sb.id}.standby-")  # the promoted standby, under its own name
            # (made on idle CPU, it runs with the sandbox's own weight again)
            shares = Path("/sys/fs/cgroup/cpu") / daemon.cgroup_parent / live_part / "cpu.shares"
            assert shares.read_text() == "1024\n"
        sb.delete_checkpoint(cp)
        assert wait_until(lambda: _standbys(daemon) == [], 10)
        sb.rollback(sb.checkpoint())  # at once: restored (the standby's restore had not begun: never made)
        assert [e for e in sb.events() if e.kind == "rolled_back"][-1].data["standby"] is False
    assert wait_until(lambda: _standbys(daemon) == [], 10)
    assert fleet.list(labels=JOB) == []


def _get(path: str) -> str:
    """GET /index.html through an exposed port's unix socket on the node."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(b"GET /index.html HTTP/1.0\r\nHost: x\r\n\r\n")
        return b"".join(iter(lambda: s.recv(65536), b"")).decode(errors="replace")


def test_a_server_and_its_exposed_port_come_back_with_the_rollback(fleet: Client) -> None:
    """A listening TCP socket is in the checkpoint (criu 4.1 on kernels >= 6.16 needs the shim's
    help for it); the port stays exposed across the rollback, to the restored server."""
    with fleet.create(image="python", labels=JOB) as sb:
        serve_http(sb, 8000, "before")
        [port] = sb.ports()
        cp = sb.checkpoint()
        sb.files.write("/srv/index.html", b"after")
        assert _get(port.socket).endswith("after")
        sb.rollback(cp)
        assert [p.port for p in sb.ports()] == [8000]
        assert wait_until(lambda: _get(port.socket).endswith("before"), 10)


def test_bad_checkpoint_calls_are_typed(fleet: Client) -> None:
    with fleet.create(image="busybox", labels=JOB) as sb:
        with pytest.raises(NotFoundError):
            sb.rollback("cp-nope")
        with pytest.raises(NotFoundError):
            sb.delete_checkpoint("cp-nope")
        with pytest.raises(InvalidArgumentError):
            sb.rollback("x" * 5000)
        term = sb.terminal("sh")
        try:
            with pytest.raises(WrongStateError, match="terminal"):
                sb.checkpoint()
        finally:
            term.close()
    with fleet.create(image="busybox", labels=JOB) as other, fleet.create(image="busybox", labels=JOB) as sb:
        cp = other.checkpoint()
        with pytest.raises(NotFoundError):  # another sandbox's checkpoint is no state of this one
            sb.rollback(cp)
    assert fleet.list(labels=JOB) == []


def test_checkpoints_go_with_their_sandbox_and_leave_nothing(own_daemon: Daemon) -> None:
    """Checkpoints outlive a daemon SIGKILL with their sandbox; a damaged one fails its rollback with
    a typed error and the sandbox it could not put back is stopped; nothing is left either way."""
    d = own_daemon
    d.start()
    folder = d.state_dir / "checkpoints"
    with d.client() as fleet:
        baseline = residue(d)
        sb = fleet.create(image="busybox", labels=JOB)
        sb.start("sleep 1000")
        cp = sb.checkpoint()
        sb.exec("echo x > /tmp/x")
        sb.rollback(cp)
        second = sb.checkpoint()
        assert len(list((folder / sb.id).iterdir())) == 2
        assert folder.stat().st_mode & 0o777 == 0o700  # memory and files: root only
        d.kill()
        time.sleep(0.3)
        d.start()
        assert [c.id for c in sb.checkpoints()] == [cp.id, second.id]
        sb.rollback(cp)
        assert sb.exec("test -e /tmp/x").exit_code == 1
        sb.stop()
        assert wait_until(lambda: not (folder / sb.id).exists(), 10)

        damaged = fleet.create(image="busybox", labels=JOB)
        bad = damaged.checkpoint()
        damaged.checkpoint()  # the standby (restored ahead) is the newest one's: `bad` is restored from its images
        damaged.exec("echo kept > /tmp/kept")
        # Emptied images (a full disk, a partial copy): refused before the sandbox is taken down
        # (criu would hang on them rather than fail).
        images = folder / damaged.id / bad.id / "img"
        pages = sorted(images.glob("pages-*.img"))
        for p in pages:
            p.write_bytes(b"")
        with pytest.raises(DataLossError, match="damaged"):
            damaged.rollback(bad)
        assert damaged.exec("cat /tmp/kept").stdout == "kept\n"  # untouched, still running
        # Images damaged in place, sizes kept: criu fails, and the sandbox it could not put back is stopped.
        worse = damaged.checkpoint()
        damaged.checkpoint()
        inventory = folder / damaged.id / worse.id / "img" / "inventory.img"
        inventory.write_bytes(b"\xff" * inventory.stat().st_size)
        t0 = time.monotonic()
        with pytest.raises(UnavailableError, match="could not be rolled back"):
            damaged.rollback(worse)
        assert time.monotonic() - t0 < 20
        with pytest.raises(NotFoundError, match="rollback failed"):
            damaged.refresh()
        assert wait_until(lambda: not (folder / damaged.id).exists(), 10)
        deadline = time.time() + 30
        while time.time() < deadline and residue(d) != baseline:
            time.sleep(0.2)
        assert residue(d) == baseline


def test_checkpoint_and_rollback_steps_are_taken_once_across_a_daemon_sigkill(own_daemon: Daemon) -> None:
    """A trajectory's checkpoint and rollback are steps: replayed by a restarted trainer after the
    daemon was SIGKILLed, they answer what was recorded and roll nothing back a second time; the
    checkpoint outlives the daemon with its sandbox and is still good to go back to."""
    d = own_daemon
    d.start()
    spec = SandboxSpec(image="busybox", idle_ttl=300, labels=JOB)
    with d.client(timeout=60) as fleet:
        traj = fleet.trajectory("cp-steps", spec)
        traj.exec("echo 1 > /state")
        cp = traj.checkpoint(labels={"node": "root"})
        traj.exec("echo 2 > /state")
        assert traj.rollback(cp).checkpoint_id == cp
        traj.exec("echo 3 >> /state")
        d.kill()
        time.sleep(0.3)
        d.start()

        again = fleet.trajectory("cp-steps", spec)  # the trainer, restarted, replays its rollout
        again.exec("echo 1 > /state")
        assert again.checkpoint(labels={"node": "root"}) == cp and again.last is not None and again.last.replayed
        again.exec("echo 2 > /state")
        assert again.rollback(cp).replayed
        again.exec("echo 3 >> /state")
        assert again.exec("cat /state").stdout == "1\n3\n"  # a new step: nothing ran twice
        assert [s.kind for s in again.steps()] == ["exec", "checkpoint", "exec", "rollback", "exec", "exec"]
        assert again.sandbox is not None
        assert [c.id for c in again.sandbox.checkpoints()] == [cp]
        again.rollback(cp)
        assert again.exec("cat /state").stdout == "1\n"
        again.close()
        again.delete()
    assert wait_until(lambda: not any((d.state_dir / "checkpoints").iterdir()), 10)


def _start(d: Daemon, failpoint: str | None = None) -> None:
    """Start the daemon, to SIGKILL itself at `failpoint` if given."""
    if failpoint:
        os.environ["SANDFLEET_FAILPOINTS"] = failpoint
    try:
        d.start()
    finally:
        os.environ.pop("SANDFLEET_FAILPOINTS", None)


@pytest.mark.parametrize(
    ("through", "failpoint"),
    [
        ("standby", "rollback_before_record"),
        ("standby", "rollback_before_retire"),
        ("restore", "rollback_before_record"),
    ],
)
def test_a_daemon_killed_mid_rollback_leaves_nothing_behind(own_daemon: Daemon, through: str, failpoint: str) -> None:
    """SIGKILL in a rollback (a failpoint): the restarted daemon adopts the sandbox as its record has
    it and removes the rest. A restore in its place before its record: a half-made sandbox, stopped.
    A standby thawed before its record: the old part (the rollback did not happen; the standby
    goes). A standby recorded before the old part is destroyed: the standby (the old part goes)."""
    d = own_daemon
    _start(d, failpoint)
    with d.client(timeout=30) as fleet:
        baseline = residue(d)
        sb = fleet.create(image="busybox", labels=JOB)
        sb.start("sleep 1000")
        cp = sb.checkpoint()
        sb.exec("touch /after")
        if through == "restore":
            sb.checkpoint()  # the standby is the newest one's
        else:
            assert wait_until(lambda: _standby_ready(d, sb), 30)  # (else the rollback restores)
        with pytest.raises(SandboxError):
            sb.rollback(cp)
        assert wait_until(lambda: not d.process.alive(), 10)
    _start(d)
    with d.client(timeout=30) as fleet:
        if through == "restore":
            with pytest.raises(NotFoundError, match="lost in daemon restart"):
                fleet.get(sb.id)
        else:
            again = fleet.get(sb.id)
            rolled_back = failpoint == "rollback_before_retire"
            assert again.exec("test -e /after").exit_code == (1 if rolled_back else 0)
            assert wait_until(lambda: len(_parts(d, sb)) == 1, 10)  # nothing else of it
            assert _live_part(d, sb).startswith(f"{sb.id}.standby-") is rolled_back
            assert not _standbys(d)
            again.stop()
        assert fleet.list(labels=JOB) == []
        assert wait_until(lambda: not (d.state_dir / "checkpoints" / sb.id).exists(), 10)
        deadline = time.time() + 30
        while time.time() < deadline and residue(d) != baseline:
            time.sleep(0.2)
        assert residue(d) == baseline


@pytest.mark.parametrize("killed", [None, "rollback_before_retire"])
def test_a_rolled_back_sandbox_is_taken_back_when_the_state_database_is_lost(
    own_daemon: Daemon, killed: str | None
) -> None:
    """Its live part is a promoted standby (under the standby's name) and its next standby is made,
    or (`killed`: the daemon SIGKILLed once the standby was recorded as the sandbox's) the old part
    it replaced is still there, frozen: a daemon whose state database was damaged takes back the
    newest promoted part as the sandbox (its directory says whose it is, and since when), never the
    standby or the old part, and leaves nothing once it stops."""
    d = own_daemon
    _start(d, killed)
    with d.client(timeout=30) as fleet:
        baseline = residue(d)
        sb = fleet.create(image="busybox", labels=JOB, idle_ttl=300)
        sb.exec("echo before > /mark")
        cp = sb.checkpoint()
        assert wait_until(lambda: _standby_ready(d, sb), 30)
        sb.exec("echo after > /mark")
        if killed:
            with pytest.raises(SandboxError):
                sb.rollback(cp)
            assert wait_until(lambda: not d.process.alive(), 10)
            assert len(_parts(d, sb)) == 2  # the old part and the promoted standby
        else:
            sb.rollback(cp)
            assert [e for e in sb.events() if e.kind == "rolled_back"][-1].data["standby"] is True
            assert wait_until(lambda: _standby_ready(d, sb) and len(_parts(d, sb)) == 2, 30)
    root = Path("/sys/fs/cgroup/freezer") / d.cgroup_parent
    [live_part] = [n for n in _parts(d, sb) if (d.run_dir / "sandboxes" / n / "promoted").exists()]
    if d.process.alive():
        d.kill()
    (d.state_dir / "state.db").write_bytes(b"this is not a database" * 100)
    for extra in ("state.db-wal", "state.db-shm"):
        (d.state_dir / extra).unlink(missing_ok=True)
    d.start()
    with d.client(timeout=30) as fleet:
        again = fleet.get(sb.id)
        assert again.exec("cat /mark").stdout == "before\n"
        assert any(e.kind == "recovered" for e in again.events())
        assert wait_until(lambda: _parts(d, sb) == [live_part], 10)  # the rest went as residue
        assert (root / live_part / "freezer.state").read_text().strip() == "THAWED"
        again.stop()
        deadline = time.time() + 30
        while time.time() < deadline and residue(d) != baseline:
            time.sleep(0.2)
        assert residue(d) == baseline


def test_a_sandbox_stopped_during_its_checkpoint_says_so(fleet: Client) -> None:
    """Stop does not wait for a checkpoint: the checkpoint then fails as a wrong state (or a sandbox
    not found), never as an internal error (the race a fuzzed stateful run found)."""
    for delay in (0.05, 0.15, 0.3):
        sb = fleet.create(image="busybox", labels=JOB)
        sb.start("dd if=/dev/zero bs=150M count=1 | sleep 1000")  # 150 MB held: a dump of some length
        time.sleep(0.5)
        stopper = threading.Timer(delay, sb.stop)
        stopper.start()
        try:
            sb.checkpoint()
        except (WrongStateError, NotFoundError):
            pass
        finally:
            stopper.join()
    assert fleet.list(labels=JOB) == []


def test_a_sandbox_stopped_during_its_rollback_leaves_nothing(daemon: Daemon, fleet: Client) -> None:
    """A stop racing a rollback (one that restores, one waiting for its standby's restore, one
    swapping a made standby): the rollback fails as a wrong state or unavailable, never a 500; the
    stop returns; nothing of the sandbox, its old part or its standby stays on the node."""
    for after_checkpoint, stop_after in ((0.0, 0.03), (0.3, 0.02), (0.3, 0.1), (1.5, 0.0), (1.5, 0.005)):
        sb = fleet.create(image="busybox", labels=JOB)
        sb.start("sleep 1000")
        cp = sb.checkpoint()
        time.sleep(after_checkpoint)
        stopper = threading.Timer(stop_after, sb.stop)
        stopper.start()
        try:
            sb.rollback(cp)
        except (WrongStateError, NotFoundError, UnavailableError):
            pass
        finally:
            stopper.join()
        with contextlib.suppress(NotFoundError):
            sb.stop()
        assert wait_until(
            lambda sb=sb: not any(n.startswith(sb.id) for n in os.listdir(daemon.run_dir / "sandboxes")), 10
        )
    assert fleet.list(labels=JOB) == []
