"""The daemon dies (SIGKILL) and comes back: live sandboxes are adopted, half-made ones cleaned up."""

from __future__ import annotations

import gc
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from sandfleet.errors import SandboxError, SandboxNotFoundError

from conftest import Daemon, agent_pid, wait_until
from leakcheck import residue


def _agent_pids(d: Daemon) -> dict[str, int]:
    """Sandbox id -> agent pid, found through the sandboxes' cgroups."""
    return {sandbox_id: agent_pid(d, sandbox_id) for sandbox_id in residue(d).sandbox_ids}


@pytest.mark.slow
def test_sigkill_and_restart_adopts_live_sandboxes(own_daemon: Daemon) -> None:
    d = own_daemon
    d.start()
    with d.client() as fleet:
        a = fleet.create(image="busybox", labels={"job": "restart"}, idle_ttl=600)
        b = fleet.create(image="busybox", labels={"job": "restart"}, idle_ttl=600)
        short = fleet.create(image="busybox", idle_ttl=2)
        b.set_labels({"job": "moved", "phase": "verify"})  # labels changed later are kept, too
        a.files.write("/task/state.txt", b"before the crash")
        counter = a.start(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.05; done"
        )
        assert counter.info.running
    pids = _agent_pids(d)
    assert set(pids) == {a.id, b.id, short.id}

    d.kill()
    # The sandboxes outlive the daemon.
    for pid in pids.values():
        assert Path(f"/proc/{pid}").exists()
    time.sleep(0.3)

    d.start()
    with d.client() as fleet:
        a2 = fleet.get(a.id)
        assert a2.info.state == "running"
        assert a2.exec("cat /task/state.txt").stdout == "before the crash"
        # The background loop kept running through the restart.
        first = int(a2.exec("cat /tmp/count").stdout)
        assert wait_until(lambda: int(a2.exec("cat /tmp/count").stdout) > first)
        assert fleet.get(b.id).exec("echo still here").stdout == "still here\n"
        assert "adopted" in [e.kind for e in a2.events()]
        # Sessions work again on an adopted sandbox.
        s = a2.session()
        assert s.run("cd /task && pwd").stdout == "/task\n"
        assert s.run("pwd").stdout == "/task\n"
        # The idle TTL is enforced across the restart.
        assert wait_until(lambda: short.id not in {x.id for x in fleet.list()}, timeout=20)
        assert not Path(f"/proc/{pids[short.id]}").exists() or wait_until(
            lambda: not Path(f"/proc/{pids[short.id]}").exists()
        )
        assert fleet.get(b.id).info.spec.labels == {"job": "moved", "phase": "verify"}
        assert fleet.stop_many({"job": "restart"}) == [a.id]
        assert fleet.stop_many({"job": "moved"}) == [b.id] and fleet.list() == []
    assert wait_until(lambda: not any(Path(f"/proc/{p}").exists() for p in pids.values()))


@pytest.mark.slow
def test_restart_cleans_half_created_and_orphaned_residue(own_daemon: Daemon) -> None:
    d = own_daemon
    d.start()
    with d.client() as fleet:
        fleet.build_image("busybox")
    # Creates in flight when the daemon dies: each must end up either running or fully gone.
    errors: list[str] = []

    def create() -> None:
        try:
            # The SDK retries a create whose answer was lost (same idempotency key) until its
            # deadline: a short one, so every retry has ended before the daemon comes back.
            with d.client(timeout=3) as c:
                c.create(image="busybox")
        except (SandboxError, OSError) as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=create) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.08)
    d.kill()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    gc.collect()

    # Residue with no state row at all: a sandbox dir and a cgroup from a crash before the insert.
    orphan = "sb-0000000000orphan"
    (d.run_dir / "sandboxes" / orphan).mkdir(parents=True)
    cg = Path("/sys/fs/cgroup/memory") / d.cgroup_parent / orphan
    cg.mkdir(parents=True)

    d.start()
    with d.client() as fleet:
        running = fleet.list(state="running")
        for s in running:
            assert fleet.get(s.id).exec("echo ok").stdout == "ok\n"
        r = residue(d)
        live = {s.id for s in running}
        assert set(r.sandbox_ids) == live, r  # a cgroup left only for a running sandbox
        assert r.sandbox_dirs == (), r  # launcher creates make none, and the orphan's is gone
        assert not cg.exists()
        for s in running:
            fleet.get(s.id).stop()
        with pytest.raises(SandboxNotFoundError):
            fleet.get(orphan)
    r = residue(d)
    assert r.sandbox_dirs == () and r.cgroups == () and r.state_rows == 0, r


def test_a_running_sandbox_no_row_names_is_taken_down_at_restart(own_daemon: Daemon) -> None:
    """A create writes its row while its sandbox starts: a crash before the row lands leaves a
    running sandbox (agent, mounts, cgroups, network namespace) that no row names. The next daemon
    takes all of it down and keeps the others."""
    d = own_daemon
    d.start()
    with d.client() as fleet:
        fleet.build_image("busybox")
        netns_before = residue(d).netns
        lost = fleet.create(image="busybox", labels={"row": "lost"})
        kept = fleet.create(image="busybox", labels={"row": "kept"})
        pid = agent_pid(d, lost.id)
    d.kill()
    con = sqlite3.connect(d.state_dir / "state.db")
    try:
        assert con.execute("DELETE FROM sandboxes WHERE id=?", (lost.id,)).rowcount == 1
        con.commit()
    finally:
        con.close()
    d.start()
    with d.client() as fleet:
        assert wait_until(lambda: not Path(f"/proc/{pid}").exists(), 15), "its agent outlived the restart"
        with pytest.raises(SandboxNotFoundError):
            fleet.get(lost.id)
        r = residue(d)
        assert r.sandbox_ids == (kept.id,) and r.sandbox_dirs == (), r
        assert not any(lost.id in m for m in r.mounts), r
        assert fleet.get(kept.id).exec("echo ok").stdout == "ok\n"
        fleet.get(kept.id).stop()
        assert wait_until(lambda: residue(d).netns <= netns_before, 15), "a network namespace outlived it"
    r = residue(d)
    assert r.cgroups == () and r.mounts == () and r.processes == 0 and r.state_rows == 0, r


def test_daemon_restart_is_clean_when_nothing_runs(own_daemon: Daemon) -> None:
    d = own_daemon
    d.start()
    d.stop()  # graceful
    d.start()
    with d.client() as fleet:
        assert fleet.health()["status"] == "ok"
    assert os.stat(d.socket).st_mode & 0o777 == 0o600
