"""Snapshot, restore and fork (criu): state carried over, isolation after, errors, cleanup.

How long a fork of 16 takes is measured in bench/ (`fork`), not asserted here.
"""

from __future__ import annotations

import functools
import json
import os
import random
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from sandfleet import Client, Mount, Sandbox, SandboxError
from sandfleet.errors import InvalidArgumentError, SnapshotNotFoundError, WrongStateError
from sandfleet.images import LayerStore

from conftest import IMAGES, Daemon, agent_pid, wait_until
from leakcheck import residue

COUNTER = (
    "echo $$ > /tmp/counter.pid; "
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.02; done"
)


def _count(sb: Sandbox) -> int:
    out = sb.exec("cat /tmp/count").stdout.strip()
    return int(out) if out else 0


def _counts_past(sb: Sandbox, n: int) -> bool:
    return _count(sb) > n


def _ok(results: list[Sandbox | SandboxError]) -> list[Sandbox]:
    errors = [r for r in results if isinstance(r, SandboxError)]
    assert not errors, errors
    return [r for r in results if isinstance(r, Sandbox)]


def test_fork_children_continue_from_the_parent_state_and_are_isolated(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", labels={"job": "fork-test"}) as parent:
        parent.files.write("/task/input.txt", b"task 7")
        parent.exec("echo 'from the parent' > /tmp/note && mkdir -p /work && echo 1 > /work/step")
        parent.start(COUNTER)
        assert wait_until(lambda: _count(parent) > 20)
        before = _count(parent)

        children = _ok(parent.fork(3, labels={"sample": "x"}))
        try:
            assert len(children) == 3 and len({c.id for c in children} | {parent.id}) == 4
            at_fork = _count(parent)
            pid_namespaces = set()
            for child in children:
                assert child.info.state == "running"
                assert child.info.spec.labels == {"job": "fork-test", "sample": "x"}
                # files of the writable layer, written before the fork
                assert child.files.read("/task/input.txt") == b"task 7"
                assert child.exec("cat /tmp/note /work/step").stdout == "from the parent\n1\n"
                # process state: the counter kept its value and keeps counting
                first = _count(child)
                assert before <= first <= at_fork + 50
                assert wait_until(functools.partial(_counts_past, child, first + 5))
                assert "while true" in child.exec("ps").stdout
                pid_namespaces.add(child.exec("readlink /proc/self/ns/pid").stdout.strip())
            pid_namespaces.add(parent.exec("readlink /proc/self/ns/pid").stdout.strip())
            assert len(pid_namespaces) == 4  # each child a pid namespace of its own

            # isolated afterwards: a write in one child is seen by no sibling and not by the parent
            children[0].exec("echo mine > /tmp/note && touch /tmp/only-child-0")
            for other in [*children[1:], parent]:
                assert other.exec("cat /tmp/note").stdout == "from the parent\n"
                assert other.exec("test -e /tmp/only-child-0").exit_code == 1
            assert children[1].exec("kill $(cat /tmp/counter.pid)").exit_code == 0  # same pid in every child
            assert _count(children[2]) > 0 and wait_until(lambda: _count(children[2]) > _count(children[1]) + 5)
            # the parent is unaffected and its channel still works (exec, files, new sessions)
            assert _count(parent) > at_fork
            with parent.session() as s:
                assert s.run("echo $((6*7))").stdout == "42\n"
        finally:
            for child in children:
                child.stop()


def test_snapshot_restore_later_and_outlives_its_owner(daemon: Daemon, fleet: Client) -> None:
    sb = fleet.create(image="busybox")
    sb.exec("echo before > /root/state")
    snap = sb.snapshot()
    assert snap.sandbox_id == sb.id and snap.size_bytes > 0
    sb.exec("echo after > /root/state")  # the snapshot is of the moment it was taken
    assert [s.id for s in fleet.snapshots(sandbox_id=sb.id)] == [snap.id]

    (child,) = _ok(fleet.restore(snap.id))
    try:
        assert child.exec("cat /root/state").stdout == "before\n"
        assert sb.exec("cat /root/state").stdout == "after\n"
        (again,) = _ok(fleet.restore(snap.id))  # a snapshot restores any number of times
        again.stop()
    finally:
        child.stop()

    sb.stop()  # the snapshot stays until it is deleted (or its ttl runs out)
    assert [s.id for s in fleet.snapshots(sandbox_id=sb.id)] == [snap.id]
    (later,) = _ok(fleet.restore(snap.id))
    assert later.exec("cat /root/state").stdout == "before\n"
    later.stop()
    fleet.delete_snapshot(snap.id)
    assert not (daemon.state_dir / "snapshots" / snap.id).exists()
    assert fleet.snapshots(sandbox_id=sb.id) == []
    with pytest.raises(SnapshotNotFoundError):
        fleet.restore(snap.id)


def test_delete_snapshot(fleet: Client, daemon: Daemon) -> None:
    with fleet.create(image="busybox") as sb:
        snap = sb.snapshot()
        fleet.delete_snapshot(snap.id)
        assert not (daemon.state_dir / "snapshots" / snap.id).exists()
        with pytest.raises(SnapshotNotFoundError):
            fleet.delete_snapshot(snap.id)
        assert sb.exec("echo alive").stdout == "alive\n"


def test_fork_a_paused_sandbox(fleet: Client) -> None:
    with fleet.create(image="busybox") as parent:
        parent.start(COUNTER)
        assert wait_until(lambda: _count(parent) > 5)
        parent.pause()
        children = _ok(parent.fork(2))
        try:
            assert fleet.get(parent.id).info.state == "paused"  # paused again after its snapshot
            for child in children:
                assert child.info.state == "running"
                first = _count(child)
                assert first > 5 and wait_until(functools.partial(_counts_past, child, first))
        finally:
            for child in children:
                child.stop()


def test_running_exec_and_session_survive_a_snapshot(fleet: Client) -> None:
    """The agent moves to a new channel for the dump; commands in flight carry on over it."""
    with fleet.create(image="busybox") as sb:
        session = sb.session()
        session.run("cd /tmp && export MARK=7")
        slow = sb.start("sleep 0.5; echo done-after-snapshot")
        sb.snapshot()
        done = slow.wait(timeout=10)
        assert done.result is not None and done.result.exit_code == 0
        assert done.result.stdout == "done-after-snapshot\n"  # output sent while the channel moved
        assert session.run("echo $MARK $(pwd)").stdout == "7 /tmp\n"


def test_snapshot_refused_for_bind_mounts(daemon: Daemon, fleet: Client) -> None:
    shared = daemon.root / "shared"
    with fleet.create(image="busybox", mounts=[Mount(source=str(shared), target="/data")]) as sb:
        with pytest.raises(InvalidArgumentError, match="cannot be snapshotted"):
            sb.snapshot()
        assert sb.exec("echo fine").stdout == "fine\n"  # the refusal left it working


def test_scratch_of_a_sandbox_and_of_a_fork_is_out_of_reach(fleet: Client) -> None:
    """/dev/.sandfleet is the writable layer's tmpfs, for the daemon only: root inside cannot enter it."""
    with fleet.create(image="busybox") as sb:
        (child,) = _ok(sb.fork(1))
        try:
            for box in (sb, child):
                r = box.exec("ls /dev/.sandfleet; cat /dev/.sandfleet/upper/etc/passwd")
                assert r.exit_code != 0 and "Permission denied" in r.stderr
                assert box.exec("umount /dev/.sandfleet").exit_code != 0
                # the child cannot see its siblings' or its parent's processes
                assert box.exec("ps -o args | grep -c '^{sandfleet-agent}'").stdout == "1\n"
        finally:
            child.stop()


def test_no_residue_after_snapshots_and_forks(own_daemon: Daemon) -> None:
    own_daemon.start()
    baseline = residue(own_daemon)
    with own_daemon.client() as c:
        parent = c.create(image="busybox")
        parent.start(COUNTER)
        kids = _ok(parent.fork(4))
        snap = parent.snapshot()
        kids += _ok(c.restore(snap.id, count=2))
        for k in kids:
            k.stop()
        parent.stop()
        c.delete_snapshot(snap.id)  # snapshots outlive their sandbox
    deadline = time.time() + 20
    while time.time() < deadline and residue(own_daemon) != baseline:
        time.sleep(0.2)
    assert residue(own_daemon) == baseline
    assert not any((own_daemon.state_dir / "snapshots").iterdir())


def test_no_window_on_the_scratch_during_restore_and_children_are_not_reforked(daemon: Daemon, fleet: Client) -> None:
    """While criu restores a child, its code never reaches the scratch; a restored child has its own
    uid map and cgroup namespace."""
    probe = "while true; do ls /dev/.sandfleet/upper >/dev/null 2>&1 && echo WIN >> /tmp/win; done"
    with fleet.create(image="busybox") as parent:
        parent.start(probe)
        time.sleep(0.3)
        children = _ok(parent.fork(3))
        try:
            time.sleep(0.3)
            for box in (parent, *children):
                assert box.exec("cat /tmp/win").exit_code == 1  # never opened, not even during restore
            child = children[0]
            assert child.exec("cat /proc/self/uid_map").stdout.split() == ["0", "100000", "65536"]
            # its own cgroup namespace, rooted at its own cgroups: no host cgroup path shows
            assert all(line.endswith(":/") for line in child.exec("cat /proc/self/cgroup").stdout.split())
        finally:
            for c in children:
                c.stop()
    snapshots = daemon.state_dir / "snapshots"
    assert snapshots.stat().st_mode & 0o777 == 0o700  # sandboxes' files and memory: root only


def test_a_restored_sandbox_snapshots_and_forks_again(fleet: Client) -> None:
    """A fork child is forked again, and that grandchild snapshotted and restored: each generation has
    the files, sessions and processes of the one it came from (checkpoint, act, checkpoint again)."""
    with fleet.create(image="busybox") as parent:
        parent.files.write("/task/input.txt", b"task 7")
        session = parent.session()
        session.run("cd /tmp && export LEVEL=1")
        parent.start(COUNTER)
        assert wait_until(lambda: _count(parent) > 5)
        (child,) = _ok(parent.fork(1))
        grandchildren: list[Sandbox] = []
        try:
            child.exec("echo from-the-child > /task/child.txt")
            child.attach_session(session.id).run("mkdir -p /tmp/sub && cd /tmp/sub && export LEVEL=2")
            (grandchild,) = _ok(child.fork(1))
            grandchildren.append(grandchild)
            snap = grandchild.snapshot()
            grandchild.exec("echo after-the-snapshot > /task/child.txt")
            (again,) = _ok(fleet.restore(snap.id))
            grandchildren.append(again)
            for box, note in ((grandchild, "after-the-snapshot"), (again, "from-the-child")):
                assert box.exec("cat /task/input.txt /task/child.txt").stdout == f"task 7{note}\n"
                assert [s.id for s in box.sessions()] == [session.id]
                assert box.attach_session(session.id).run('pwd; echo "$LEVEL"').stdout == "/tmp/sub\n2\n"
                first = _count(box)  # the parent's counter, carried through two restores, still counts
                assert first > 5 and wait_until(functools.partial(_counts_past, box, first + 5))
            # each generation goes on by itself: the child's and the parent's sessions are untouched
            assert child.attach_session(session.id).run('pwd; echo "$LEVEL"').stdout == "/tmp/sub\n2\n"
            assert session.run('pwd; echo "$LEVEL"').stdout == "/tmp\n1\n"
            assert parent.exec("test -e /task/child.txt").exit_code == 1
        finally:
            for box in (*grandchildren, child):
                box.stop()


PEEKS = ("readlink /proc/1/fd/0", "readlink /proc/1/fd/3", "cat /proc/1/environ", "head -c 1 /proc/1/mem",
         "ls /proc/1/root/", "cat /proc/1/fd/0")  # fmt: skip


def _out_of_reach(box: Sandbox, pid: int | str) -> None:
    """No process of the sandbox, root or not, reads the fds, environment or memory of `pid`."""
    for cmd in PEEKS:
        cmd = cmd.replace("/proc/1/", f"/proc/{pid}/")
        for user in ("root", "65534"):
            r = box.exec(cmd, user=user)
            assert r.exit_code != 0 and r.stdout == "", (box.id, cmd, user, r.stdout)
            if not cmd.startswith("readlink"):  # readlink fails silently
                assert "denied" in r.stderr or "not permitted" in r.stderr, (box.id, cmd, user, r.stderr)
    r = box.exec(f"ls -l /proc/{pid}/fd")
    assert "Permission denied" in r.stderr and "socket:" not in r.stdout, (box.id, r.stdout, r.stderr)
    # the calls that need no path: refused by the kernel, or by seccomp before it (those aimed at pid 1)
    r = box.exec(["python3", "-c", GRAB, str(pid)])
    lines = r.stdout.splitlines()
    assert r.exit_code == 0 and len(lines) == 3, (box.id, pid, r)
    assert all(ln.endswith(("not permitted", "not implemented")) for ln in lines), (box.id, pid, lines)


GRAB = r"""
import ctypes, os, sys
pid, libc, out = int(sys.argv[1]), ctypes.CDLL(None, use_errno=True), []
try:
    pidfd = os.pidfd_open(pid)
    fd = libc.syscall(438, pidfd, 0, 0)  # pidfd_getfd
    out.append("pidfd_getfd: " + ("got it" if fd >= 0 else os.strerror(ctypes.get_errno())))
except OSError as exc:
    out.append("pidfd_open: " + exc.strerror)
buf = ctypes.create_string_buffer(8)
local = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 8)
remote = (ctypes.c_void_p * 2)(0x400000, 8)
n = libc.process_vm_readv(pid, local, 1, remote, 1, 0)
out.append("process_vm_readv: " + ("got it" if n >= 0 else os.strerror(ctypes.get_errno())))
out.append("ptrace: " + ("attached" if libc.ptrace(16, pid, 0, 0) == 0 else os.strerror(ctypes.get_errno())))
print("\n".join(out))
"""


def test_the_agent_and_shells_of_restored_sandboxes_stay_out_of_reach(daemon: Daemon, fleet: Client) -> None:
    """Snapshotting a restored sandbox leaves its agent non-dumpable: root inside a child, in its own
    child, and in the child after it was snapshotted cannot read the agent's (or an inherited bash
    session's shell's) fds, environment or memory; the agent ignores signals from inside."""
    with fleet.create(image="python:3.11", idle_ttl=300) as parent:
        session = parent.session()
        shell = session.run("echo $$").stdout.strip()
        assert session.run('echo "$BASH_VERSION"').stdout.strip()  # bash: a shielded (non-dumpable) shell
        (child,) = _ok(parent.fork(1))
        try:
            (grandchild,) = _ok(child.fork(1))
            try:
                for box in (parent, child, grandchild):
                    _out_of_reach(box, 1)
                    _out_of_reach(box, shell)
                    assert box.attach_session(session.id).run("echo $$").stdout.strip() == shell
                    box.exec("kill -TERM 1; kill -KILL 1; kill -INT 1")
                    assert box.exec("echo alive").stdout == "alive\n"
                    # control: an ordinary process's fds are readable by root inside
                    assert box.exec("sleep 5 & readlink /proc/$!/fd/1; kill $!").stdout.startswith("pipe:")
                for box in (child, grandchild):
                    # still non-dumpable, and its memory criu's (the host's user namespace): /proc/<agent> is
                    # host root's (a fresh agent's is the sandbox root's, its memory in the sandbox's namespace)
                    assert os.stat(f"/proc/{agent_pid(daemon, box.id)}/fd").st_uid == 0
            finally:
                grandchild.stop()
        finally:
            child.stop()


@pytest.mark.slow
def test_snapshot_survives_a_daemon_restart_and_a_stuck_agent_loses_nothing(own_daemon: Daemon) -> None:
    own_daemon.config.write_text(
        own_daemon.config.read_text().replace("[container]\n", "[container]\nstart_timeout = 2\n")
    )
    own_daemon.start()
    with own_daemon.client() as c:
        sb = c.create(image="busybox")
        sb.exec("echo kept > /root/state")
        snap = sb.snapshot()
    own_daemon.kill()
    own_daemon.start()
    with own_daemon.client() as c:
        sb = c.get(sb.id)
        assert [s.id for s in c.snapshots()] == [snap.id]
        (child,) = _ok(c.restore(snap.id))
        assert child.exec("cat /root/state").stdout == "kept\n"
        child.stop()

        # An agent that cannot answer REOPEN in time (frozen from outside): the snapshot fails, the
        # sandbox stays, and once the agent moves its channel the daemon carries on over it.
        freezer = Path("/sys/fs/cgroup/freezer") / own_daemon.cgroup_parent / sb.id / "freezer.state"
        freezer.write_text("FROZEN")
        timer = threading.Timer(3.0, lambda: freezer.write_text("THAWED"))
        timer.start()
        with pytest.raises(SandboxError):
            sb.snapshot()
        timer.join()
        assert wait_until(lambda: sb.exec("cat /root/state").stdout == "kept\n", timeout=15)
        assert c.get(sb.id).info.state == "running"
        sb.stop()


def test_pack_a_live_sandbox_into_an_image(daemon: Daemon, fleet: Client) -> None:
    """pack-diff: the sandbox's changes become one new layer over its own; excluded paths are scrubbed."""
    with fleet.create(image="busybox") as sb:
        sb.exec(
            "mkdir -p /opt/env/bin && echo 'echo tool v1' > /opt/env/bin/tool && chmod +x /opt/env/bin/tool"
            " && rm /etc/hostname && mkdir -p /root/.cache && echo junk > /root/.cache/pip"
            " && echo secret > /root/answer.txt && echo 'history' > /root/.ash_history"
        )
        info = sb.pack("packed-env:v1", exclude=["/root/.cache", "/root/answer.txt", "/root/.ash_history"])
        base = [i for i in fleet.images() if (i.name, i.tag) == ("busybox", "latest")][0]
        assert info.layers[:-1] == base.layers and len(info.layers) == len(base.layers) + 1
        assert sb.exec("cat /root/answer.txt").stdout == "secret\n"  # the source keeps running as it was
    with fleet.create(image="packed-env:v1") as child:
        assert child.exec("/opt/env/bin/tool").stdout == "tool v1\n"
        assert child.exec("test -e /etc/hostname").exit_code == 1  # deleted in the source: a whiteout
        for scrubbed in ("/root/.cache", "/root/answer.txt", "/root/.ash_history"):
            assert child.exec(f"test -e {scrubbed}").exit_code == 1
        assert child.exec("ls -ld /opt/env/bin/tool").stdout.split()[2] == "root"  # ownership kept
    with fleet.create(image="busybox") as plain:
        assert plain.exec("test -e /etc/hostname").exit_code == 0  # the base image is untouched
    LayerStore(IMAGES).remove_image("packed-env:v1")
    with fleet.create(image="busybox") as other, pytest.raises(InvalidArgumentError):
        other.pack("bad ref!")


def test_external_mounts_are_classified_from_mountinfo(fleet: Client, daemon: Daemon) -> None:
    """Everything a launcher sandbox mounts from outside is named for criu; a host bind is refused."""
    from sandfleet.runtime.criu import Criu

    with fleet.create(image="busybox") as sb:
        pid = agent_pid(daemon, sb.id)
        mountinfo = Path(f"/proc/{pid}/mountinfo").read_text()
    ext = Criu.external_mounts(mountinfo)
    assert ext["/dev"] == {"key": "ext_dev", "kind": "scratch", "root": "/dev"}
    assert ext["/dev/.sandfleet"]["kind"] == "scratch" and ext["/dev/.sandfleet"]["root"] == "/"
    assert ext["/dev/null"]["kind"] == "device" and ext["/proc/kmsg"]["root"] == "/null"
    assert ext["/sys"]["kind"] == "sysfs" and ext["/sys/firmware"]["kind"] == "empty"
    assert "/proc" not in ext and "/" not in ext and "/dev/pts" not in ext
    host_bind = "99 66 8:1 /srv/data /data rw,relatime - ext4 /dev/sda1 rw"
    with pytest.raises(ValueError, match="/data"):
        Criu.external_mounts(mountinfo + host_bind + "\n")


def test_image_gc_never_deletes_a_layer_in_use(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        sb.exec("echo v1 > /root/version")
        packed = sb.pack("gc-test:v1")
    layer = packed.layers[-1]
    layer_file = IMAGES / "layers" / ("sha256-" + layer.removeprefix("sha256:") + ".erofs")
    user = fleet.create(image="gc-test:v1")
    try:
        fleet.delete_image("gc-test:v1")
        assert layer not in fleet.gc_images(min_age=0).removed  # a running sandbox uses it
        assert layer_file.exists()
        snap = user.snapshot()  # the snapshot keeps the layer too, even once its sandbox is gone
        assert layer not in fleet.gc_images(min_age=0).removed
        assert user.exec("cat /root/version").stdout == "v1\n"
    finally:
        user.stop()
    assert layer not in fleet.gc_images(min_age=0).removed
    fleet.delete_snapshot(snap.id)
    res = fleet.gc_images(min_age=0)
    assert layer in res.removed and res.bytes > 0 and not layer_file.exists()
    assert all(d not in res.removed for i in fleet.images() for d in i.layers)  # named images keep theirs
    with fleet.create(image="busybox") as still:
        assert still.exec("echo ok").stdout == "ok\n"


def test_restore_refuses_a_snapshot_taken_before_its_paths_were_checked(own_daemon: Daemon) -> None:
    """A snapshot records that every path its restore creates by name was checked against the
    sandbox (`paths_checked`); one without that mark (from before the check existed) is refused."""
    own_daemon.start()
    with own_daemon.client() as c:
        sb = c.create(image="busybox")
        snap = sb.snapshot()
    checked = own_daemon.state_dir / "snapshots" / snap.id / "snapshot.json"
    record = json.loads(checked.read_text())
    assert record["meta"]["paths_checked"] == 1
    own_daemon.kill()
    del record["meta"]["paths_checked"]
    checked.write_text(json.dumps(record))
    own_daemon.start()
    with own_daemon.client() as c:
        (refused,) = c.restore(snap.id)
        assert isinstance(refused, WrongStateError) and "take a new snapshot" in refused.message
        (child,) = _ok(c.restore(c.get(sb.id).snapshot().id))  # control: a new one restores
        child.stop()
        c.get(sb.id).stop()


def test_restore_refuses_a_symlink_where_the_scratch_is_bound_from(
    daemon: Daemon, fleet: Client, tmp_path: Path
) -> None:
    """criu binds the restored sandbox's /dev and /dev/shm from the new scratch by path, as host
    root, and what is there was copied from the snapshot: a symlink there (which a sandbox cannot
    make: both are mount points in it; here the snapshot is edited on the host) is refused, and no
    host directory is bound into the child."""
    (tmp_path / "host-only").write_text("host\n")
    with fleet.create(image="busybox") as sb:
        snap = sb.snapshot()
        try:
            shm = daemon.state_dir / "snapshots" / snap.id / "fs" / "dev" / "shm"
            shm.rmdir()
            shm.symlink_to(tmp_path)
            (result,) = fleet.restore(snap.id)
            if not isinstance(result, SandboxError):
                leaked = result.exec("ls /dev/shm").stdout
                result.stop()
                raise AssertionError(f"restored with /dev/shm bound from {tmp_path}: {leaked!r}")
            assert "not a directory of the writable layer" in result.message, result
        finally:
            fleet.delete_snapshot(snap.id)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["host-only"]


# -- criu images, read without criu ---------------------------------------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _msg(*fields: tuple[int, int | bytes]) -> bytes:
    out = b""
    for number, value in fields:
        if isinstance(value, bytes):
            out += _varint(number << 3 | 2) + _varint(len(value)) + value
        else:
            out += _varint(number << 3) + _varint(value)
    return out


def _image(path: Path, magic: int, *messages: bytes) -> None:
    path.write_bytes(struct.pack("<II", 0x54564319, magic) + b"".join(struct.pack("<I", len(m)) + m for m in messages))


def test_restore_paths_are_read_from_the_images_and_checked(tmp_path: Path) -> None:
    """The image reader and the check behind the snapshot refusal, on hand-made images: each ghost's
    path is walked in the tree, and only real directories (or missing ones) on its own mount pass."""
    from sandfleet.runtime import criu

    tree, img = tmp_path / "tree", tmp_path / "img"
    (tree / "tmp" / "ok").mkdir(parents=True)
    (tree / "tmp" / "link").symlink_to("/etc")
    img.mkdir()
    root = os.open(tree, os.O_PATH | os.O_DIRECTORY)
    try:
        with open(f"/proc/self/fdinfo/{root}") as f:
            mnt = int(next(line for line in f if line.startswith("mnt_id:")).split()[1])
        ghosts = {  # file id -> (name, mode)
            1: (b"/tmp/ok/F", 0o100644),  # fine: a real directory
            2: (b"/tmp/gone/sub/F", 0o100644),  # fine: criu goes up to /tmp
            3: (b"/tmp/link/F", 0o100644),  # through a symlink
            4: (b"/tmp/dir", 0o40755),  # a directory ghost: made under its own name
            5: (b"/tmp/dir/F", 0o10644),  # a FIFO inside that one
            6: (b"/tmp/ok/L", 0o120777),  # a symlink
            7: (b"/tmp/ok/D", 0o20644),  # a device node
        }
        files = [_msg((1, 1), (2, fid), (3, _msg((6, name), (7, mnt * 2)))) for fid, (name, _) in ghosts.items()]
        files.append(_msg((1, 1), (2, 8), (3, _msg((6, b"/tmp/ok/link_remap.8"), (7, mnt * 2)))))
        _image(img / "files.img", 0x56303138, *files)
        remaps = [_msg((1, fid), (2, fid), (3, 1)) for fid in ghosts]
        remaps.append(_msg((1, 1), (2, 8), (3, 0)))  # a link remap
        _image(img / "remap-fpath.img", 0x59133954, *remaps)
        for fid, (_, mode) in ghosts.items():
            _image(img / f"ghost-file-{fid:x}.img", 0x52583605, _msg((1, 0), (2, 0), (3, mode)))
        _image(img / "mountpoints-1.img", 0x55563928, _msg((2, mnt), (7, b"/")))

        assert [r.path for r in criu.restore_remaps(img)][:5] == [
            b"/tmp/ok/F.cr.1.ghost", b"/tmp/gone/sub/F.cr.2.ghost", b"/tmp/link/F.cr.3.ghost", b"/tmp/dir",
            b"/tmp/dir/F.cr.5.ghost",
        ]  # fmt: skip
        problems = criu.unsafe_restore_paths(img, root)
        assert len(problems) == 5, problems
        assert "/tmp/link/F" in problems[0] and "/tmp/link, which is now a symlink" in problems[0]
        assert "/tmp/dir/F" in problems[1] and "inside /tmp/dir" in problems[1]
        assert "deleted symlink /tmp/ok/L" in problems[2] and "device node /tmp/ok/D" in problems[3]
        assert "link remap" in problems[4]
        # on another mount than the one the image names
        _image(img / "mountpoints-1.img", 0x55563928, _msg((2, mnt + 1), (7, b"/")))
        for fid in (1, 2):
            _image(img / "remap-fpath.img", 0x59133954, _msg((1, fid), (2, fid), (3, 1)))
            assert "mount the snapshot does not know" in criu.unsafe_restore_paths(img, root)[0]
        _image(img / "remap-fpath.img", 0x59133954)
        assert criu.unsafe_restore_paths(img, root) == []
        (img / "files.img").write_bytes(b"\0" * 12)
        _image(img / "remap-fpath.img", 0x59133954, remaps[0])
        with pytest.raises(criu.ImageError):
            criu.unsafe_restore_paths(img, root)
    finally:
        os.close(root)


def _abandon_execs(d: Daemon, sandbox_id: str, stop: threading.Event) -> None:
    """Start streamed execs over the raw socket and hang up at once: the daemon starts each and
    then kills it (the client is gone), often while a snapshot of the sandbox is being taken."""
    body = json.dumps({"command": "sleep 600"}).encode()
    head = f"POST /v1/sandboxes/{sandbox_id}/exec/stream HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    request = f"{head}content-length: {len(body)}\r\n\r\n".encode() + body
    rng = random.Random(sandbox_id)
    while not stop.is_set():
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(d.socket))
            s.sendall(request)
            time.sleep(rng.uniform(0, 0.05))
        time.sleep(rng.uniform(0, 0.2))


@pytest.mark.slow
def test_execs_abandoned_while_a_sandbox_forks_are_killed_and_it_lives(daemon: Daemon, fleet: Client) -> None:
    """A kill of an abandoned exec sent between the agent's REOPEN and the new channel used to be
    written to the old channel, which the agent no longer reads: closing it unread reset it
    (ECONNRESET, not EOF) and the daemon took the sandbox for lost ("sandbox init exited")."""
    sb = fleet.create(image="busybox", idle_ttl=300)
    stop = threading.Event()
    forks: list[int] = []
    errors: list[BaseException] = []

    def fork_loop() -> None:
        while not stop.is_set():
            try:
                for child in sb.fork(1):
                    child.stop()
                forks.append(1)
            except SandboxError as exc:
                errors.append(exc)
                stop.set()

    threads = [threading.Thread(target=fork_loop)]
    threads += [threading.Thread(target=_abandon_execs, args=(daemon, sb.id, stop)) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 40 and not stop.is_set():
            assert sb.exec("echo back").stdout == "back\n"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors
    assert len(forks) >= 5
    # every abandoned `sleep 600` was killed, those whose kill waited for the new channel too
    assert wait_until(lambda: "sleep 600" not in sb.exec("ps -o args").stdout, timeout=15)
    sb.stop()
