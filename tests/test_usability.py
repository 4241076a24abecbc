"""What users hit first when they used sandfleet for RL work: loopback, capacity waits, forks that
keep their sessions, snapshots that outlive their sandbox, OOM results, process handles after a
stop, bytes, relative paths, stdin, lifetimes, file watches, listings of live sandboxes. Each test
failed before its fix; both clients are exercised where the call exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandfleet import AsyncClient, AsyncSandbox, Client, Sandbox
from sandfleet.client.sync import Process
from sandfleet.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxNotFoundError,
    SnapshotNotFoundError,
    WrongStateError,
)

from conftest import Daemon, destroy_daemon, make_daemon, wait_until


@pytest.fixture
async def afleet(daemon: Daemon) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as c:
        yield c


@pytest.fixture
def python_sb(fleet: Client) -> Iterator[Sandbox]:
    with fleet.create(image="python:3.11", idle_ttl=300) as sb:
        yield sb


# 1 -------------------------------------------------------------------------------------------------


def test_loopback_is_up(python_sb: Sandbox) -> None:
    python_sb.start("python3 -m http.server --bind 127.0.0.1 8000")
    probe = "import socket; socket.create_connection(('127.0.0.1', 8000), timeout=2).close(); print('ok')"
    assert wait_until(lambda: python_sb.exec(["python3", "-c", probe]).stdout == "ok\n", 15)
    # and still nothing beyond it
    out = python_sb.exec(["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)"])
    assert out.exit_code != 0


# 2 -------------------------------------------------------------------------------------------------


@pytest.fixture
def one_slot() -> Iterator[Daemon]:
    d = make_daemon("oneslot", "max_sandboxes = 1\n")
    d.start()
    yield d
    destroy_daemon(d)


def test_create_waits_for_capacity(one_slot: Daemon) -> None:
    with one_slot.client(timeout=30) as c:
        first = c.create(image="busybox")
        with pytest.raises(ResourceExhaustedError):
            c.create(image="busybox", timeout=1.5)  # bounded by its timeout
        threading.Timer(2.0, first.stop).start()
        t0 = time.monotonic()
        second = c.create(image="busybox", timeout=20)  # waits for the slot instead of giving up
        assert 1.5 < time.monotonic() - t0 < 15
        assert second.info.state == "running"
        second.stop()


async def test_async_create_waits_for_capacity(one_slot: Daemon) -> None:
    async with AsyncClient(one_slot.socket, timeout=30) as c:
        first = await c.create(image="busybox")
        asyncio.get_running_loop().call_later(2.0, lambda: asyncio.ensure_future(first.stop()))
        second = await c.create(image="busybox", timeout=20)
        assert second.info.state == "running"
        await second.stop()


# 3, 4 ----------------------------------------------------------------------------------------------


def test_fork_children_keep_sessions_and_processes(fleet: Client, sandbox: Sandbox) -> None:
    s = sandbox.session()
    s.run("cd /tmp && export LEVEL=7")
    bg = sandbox.start(
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.2; done"
    )
    (child,) = sandbox.fork(1)
    assert isinstance(child, Sandbox)
    try:
        assert [x.id for x in child.sessions()] == [s.id]
        again = child.attach_session(s.id)
        assert again.run('pwd; echo "$LEVEL"').stdout == "/tmp\n7\n"
        procs = child.processes()
        assert [p.id for p in procs] == [bg.id] and procs[0].running
        killed = Process(child, procs[0]).kill()
        assert not killed.running
        # the parent's are untouched
        assert s.run("echo $LEVEL").stdout == "7\n" and sandbox.processes()[0].running
    finally:
        child.stop()
        bg.kill()
        s.close()


def test_a_restarted_client_finds_and_drives_its_shells(daemon: Daemon, sandbox: Sandbox) -> None:
    s = sandbox.session()
    s.run("export KEPT=yes")
    with daemon.client() as other:  # another trainer process
        sb = other.get(sandbox.id)
        (info,) = sb.sessions()
        assert sb.attach_session(info.id).run("echo $KEPT").stdout == "yes\n"
    s.close()


async def test_snapshots_outlive_their_sandbox(afleet: AsyncClient) -> None:
    async with await afleet.create(image="busybox", idle_ttl=300) as sb:
        await sb.exec("echo saved > /root/state")
        snap = await sb.snapshot(labels={"bank": "task-1"})
    assert any(x.id == snap.id for x in await afleet.snapshots())
    (child,) = await afleet.restore(snap.id)
    assert isinstance(child, AsyncSandbox)
    try:
        assert (await child.exec("cat /root/state")).stdout == "saved\n"
    finally:
        await child.stop()
        await afleet.delete_snapshot(snap.id)
    with pytest.raises(SnapshotNotFoundError):
        await afleet.restore(snap.id)


def test_snapshot_ttl_expires(fleet: Client, sandbox: Sandbox) -> None:
    snap = sandbox.snapshot(ttl=1)
    assert snap.expires_at is not None and snap.expires_at <= snap.created_at + 1.01
    assert wait_until(lambda: all(x.id != snap.id for x in fleet.snapshots()), 10)


# 6, 7 ----------------------------------------------------------------------------------------------


def test_oom_kill_is_said_on_the_result(fleet: Client) -> None:
    with fleet.create(image="busybox", resources={"memory": "32MiB"}, idle_ttl=60) as sb:
        r = sb.exec("x=$(head -c 120000000 /dev/zero | tr '\\0' a); echo ${#x}", timeout=60)
        assert r.exit_code == 137 and r.oom_killed, r
        assert any(e.kind == "exec" and e.data.get("oom_killed") for e in sb.events())
        ok = sb.exec("true")
        assert not ok.oom_killed
        t = sb.exec("sleep 5", timeout=0.5)
        assert t.timed_out and not t.oom_killed


def test_process_handles_after_the_sandbox_stopped(fleet: Client) -> None:
    sb = fleet.create(image="busybox", idle_ttl=60)
    p = sb.start("sleep 1000")
    q = sb.start("sleep 1000")
    killed = q.kill()
    assert not killed.running and killed.result is not None and killed.result.exit_code == 137
    sb.stop()
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        p.wait(1)
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        p.kill()


# 8, 9, 10 ------------------------------------------------------------------------------------------


def test_bytes_in_and_out(sandbox: Sandbox) -> None:
    r = sandbox.exec("printf '\\000\\377\\376'; printf '\\001' >&2", binary=True)
    assert r.stdout_bytes == b"\x00\xff\xfe" and r.stderr_bytes == b"\x01"
    assert sandbox.exec("printf '\\000\\377\\376'").stdout == "\x00\ufffd\ufffd"  # text stays the default
    r = sandbox.exec("od -An -tx1", stdin=b"\x00\xff", binary=True)
    assert r.stdout_bytes.split() == [b"00", b"ff"]
    with sandbox.session() as s:
        assert s.run("printf '\\377'", binary=True).stdout_bytes == b"\xff"
    events = list(sandbox.exec_stream("printf '\\377\\000'", binary=True))
    assert events[-1].result is not None and events[-1].result.stdout_bytes == b"\xff\x00"


async def test_async_bytes(afleet: AsyncClient) -> None:
    async with await afleet.create(image="busybox") as sb:
        assert (await sb.exec("printf '\\377'", binary=True)).stdout_bytes == b"\xff"


def test_relative_paths_resolve_against_the_workdir(fleet: Client) -> None:
    with fleet.create(image="busybox", workdir="/srv", idle_ttl=60) as sb:
        sb.exec("mkdir -p /srv/work")
        sb.files.write("work/a.txt", b"hello")
        assert sb.files.read("/srv/work/a.txt") == b"hello"
        assert sb.files.read("work/a.txt") == b"hello"
        assert [f.name for f in sb.files.list("work")] == ["a.txt"]
        assert sb.exec("cat a.txt", cwd="work").stdout == "hello"
        sb.files.remove("work/a.txt")
        assert not sb.files.exists("/srv/work/a.txt")


def test_stdin_to_running_commands_and_merged_stderr(sandbox: Sandbox) -> None:
    p = sandbox.start("cat; echo end", keep_stdin_open=True)
    p.write_stdin("line 1\n")
    p.write_stdin(b"line 2\n")
    p.close_stdin()
    done = p.wait(10)
    assert done.result is not None and done.result.stdout == "line 1\nline 2\nend\n"
    with sandbox.session() as s:
        result: list[object] = []
        t = threading.Thread(target=lambda: result.append(s.run("cat; echo after", keep_stdin_open=True)))
        t.start()
        assert wait_until(lambda: s.refresh().busy, 5)
        s.write_stdin("to the session\n")
        s.close_stdin()
        t.join(10)
        assert result and result[0].stdout == "to the session\nafter\n"  # type: ignore[attr-defined]
        assert s.run("cat", stdin="given\n").stdout == "given\n"
        assert s.run("echo out; echo err >&2", merge_stderr=True).stdout == "out\nerr\n"
    r = sandbox.exec("echo out; echo err >&2; echo out2", merge_stderr=True)
    assert (r.stdout, r.stderr) == ("out\nerr\nout2\n", "")


# 11, 12, 15 ----------------------------------------------------------------------------------------


def test_lifetimes_can_change(fleet: Client) -> None:
    sb = fleet.create(image="busybox", idle_ttl=600, labels={"lt": str(time.time_ns())})
    assert sb.set_lifetime(idle_ttl=2).spec.idle_ttl == 2
    assert sb.info.spec.max_lifetime is None
    assert wait_until(lambda: _gone(fleet, sb.id), 15)
    job = {"lt": str(time.time_ns())}
    a = fleet.create(image="busybox", idle_ttl=600, labels=job)
    b = fleet.create(image="busybox", idle_ttl=600, labels=job)
    assert sorted(fleet.set_lifetimes(job, max_lifetime=3600)) == sorted([a.id, b.id])
    assert a.refresh().spec.max_lifetime == 3600 and a.refresh().spec.idle_ttl == 600
    a.set_lifetime(max_lifetime=None)
    assert a.refresh().spec.max_lifetime is None
    with pytest.raises(InvalidArgumentError):
        a.set_lifetime(idle_ttl=-1)
    fleet.stop_many(job)


def _gone(c: Client, sandbox_id: str) -> bool:
    try:
        return c.get(sandbox_id).info.state in ("stopped", "failed")
    except SandboxNotFoundError:
        return True


def test_watching_files(sandbox: Sandbox) -> None:
    sandbox.exec("mkdir -p /work")
    seen: list[tuple[str, str]] = []

    def watch() -> None:
        with sandbox.files.watch("/work") as events:  # the stream is closed however this ends
            for ev in events:
                seen.append((ev.type, ev.path))
                if ev.path == "/work/end" or len(seen) > 50:
                    return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    time.sleep(0.5)
    sandbox.exec("echo a > /work/a.txt; mkdir /work/sub; echo b > /work/sub/b.txt; mv /work/a.txt /work/c.txt; "
                 "rm /work/c.txt")  # fmt: skip
    assert wait_until(lambda: ("delete", "/work/c.txt") in seen, 10), seen
    sandbox.exec("touch /work/end")
    t.join(10)
    assert not t.is_alive()
    wanted = [
        ("create", "/work/a.txt"),
        ("modify", "/work/a.txt"),
        ("create", "/work/sub"),
        ("create", "/work/sub/b.txt"),
        ("rename_from", "/work/a.txt"),
        ("rename_to", "/work/c.txt"),
    ]
    for event in wanted:
        assert event in seen, (event, seen)
    with pytest.raises(InvalidArgumentError):
        next(iter(sandbox.files.watch("/no/such/dir")))


def test_list_shows_live_sandboxes_unless_asked(own_daemon: Daemon) -> None:
    own_daemon.config.write_text(
        own_daemon.config.read_text().replace("stopped_retention = 0", "stopped_retention = 300")
    )
    own_daemon.start()
    with own_daemon.client() as c:
        job = {"job": "listing"}
        live = c.create(image="busybox", labels=job)
        dead = c.create(image="busybox", labels=job)
        dead.stop()
        assert [s.id for s in c.list(labels=job)] == [live.id]
        assert {s.id for s in c.list(labels=job, state="all")} == {live.id, dead.id}
        assert [s.id for s in c.list(labels=job, state="stopped")] == [dead.id]
        live.stop()


# 5 -------------------------------------------------------------------------------------------------


def _merging_pages(d: Daemon, sandbox_id: str) -> int:
    """Pages of the sandbox's processes that the kernel's same-page merging has shared."""
    procs = Path("/sys/fs/cgroup/pids") / d.cgroup_parent / sandbox_id / "cgroup.procs"
    total = 0
    for pid in procs.read_text().split():
        with contextlib.suppress(OSError, ValueError):
            total += int(Path(f"/proc/{pid}/ksm_merging_pages").read_text())
    return total


def test_fork_children_share_their_unchanged_memory(daemon: Daemon, fleet: Client) -> None:
    mib = 48
    with fleet.create(image="python:3.11", resources={"memory": "256MiB"}, idle_ttl=120) as parent:
        parent.start(["python3", "-c", f"import os, time; d = os.urandom({mib} << 20); time.sleep(10**6)"])
        assert wait_until(lambda: parent.usage().memory_bytes > mib << 20, 30)
        kids = parent.fork(2)
        try:
            assert all(isinstance(k, Sandbox) for k in kids), kids
            pages = (mib << 20) // 4096
            # each child's copy of the parent's random bytes is merged with the others' (and stays so)
            assert wait_until(lambda: all(_merging_pages(daemon, k.id) > pages // 2 for k in kids), 90, 1.0)
        finally:
            for k in kids:
                if isinstance(k, Sandbox):
                    k.stop()
