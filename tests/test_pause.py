"""Pause and resume: freeze + memory pushed out, transparent resume, idle policy, job-level control.

How fast pausing and resuming are is measured in bench/ (`pause`), not asserted here.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sandfleet import Client, Resources, Sandbox, SandboxSpec
from sandfleet.errors import SandboxNotFoundError, WrongStateError

from conftest import Daemon, agent_pid, wait_until
from leakcheck import residue

MiB = 1024**2


def _cgroup_file(d: Daemon, controller: str, sandbox_id: str, name: str) -> Path:
    return Path("/sys/fs/cgroup") / controller / d.cgroup_parent / sandbox_id / name


def _memory(d: Daemon, sandbox_id: str) -> int:
    return int(_cgroup_file(d, "memory", sandbox_id, "memory.usage_in_bytes").read_text())


def _steady_memory(d: Daemon, sandbox_id: str, settle: float = 0.3, timeout: float = 20.0) -> int:
    """The cgroup's memory once two readings `settle` seconds apart agree within 1 %."""
    last = _memory(d, sandbox_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = _memory(d, sandbox_id)
        if abs(now - last) <= 0.01 * last:
            return now
        last = now
    return last


def _frozen(d: Daemon, sandbox_id: str) -> bool:
    return _cgroup_file(d, "freezer", sandbox_id, "freezer.state").read_text().strip() == "FROZEN"


def _inside(d: Daemon, sb: Sandbox, path: str) -> str:
    """Read a sandbox file from the host, through its init's root: no request, so no resume."""
    pid = agent_pid(d, sb.id)
    try:
        return Path(f"/proc/{pid}/root{path}").read_text()
    except FileNotFoundError:
        return ""


def _has_swap() -> bool:
    return len(Path("/proc/swaps").read_text().splitlines()) > 1


def test_pause_freezes_and_resume_keeps_processes_files_and_sessions(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        sb.files.write("/task/state.txt", b"kept")
        session = sb.session()
        session.run("cd /tmp && export MARK=42")
        counter = sb.start(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.02; done"
        )
        assert wait_until(lambda: _inside(daemon, sb, "/tmp/count").strip() not in ("", "1"))

        info = sb.pause()
        assert info.state == "paused" and _frozen(daemon, sb.id)
        assert fleet.get(sb.id).info.state == "paused"
        frozen_at = _inside(daemon, sb, "/tmp/count").strip()
        time.sleep(0.3)
        assert _inside(daemon, sb, "/tmp/count").strip() == frozen_at  # nothing runs while paused
        assert sb.pause().state == "paused"  # idempotent

        assert sb.resume().state == "running" and not _frozen(daemon, sb.id)
        assert wait_until(lambda: int(_inside(daemon, sb, "/tmp/count") or 0) > int(frozen_at))  # counts on from there
        assert counter.info.running
        assert session.run("pwd; echo $MARK").stdout == "/tmp\n42\n"
        assert sb.files.read("/task/state.txt") == b"kept"
        kinds = [e.kind for e in sb.events()]
        assert "paused" in kinds and "resumed" in kinds
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        sb.pause()  # stopped (and, with no retention, forgotten)


def test_any_request_resumes_transparently(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        sb.pause()
        assert sb.exec("echo back").stdout == "back\n"
        assert fleet.get(sb.id).info.state == "running" and not _frozen(daemon, sb.id)
        resumed = [e for e in sb.events() if e.kind == "resumed"]
        assert resumed and resumed[-1].data["transparent"] is True
        sb.pause()
        assert sb.files.read("/etc/hostname") is not None  # the files API resumes too
        assert fleet.get(sb.id).info.state == "running"


def test_pause_pushes_memory_out_within_a_second(daemon: Daemon, fleet: Client) -> None:
    if not _has_swap():
        pytest.skip("no swap on this host and the daemon could not set up zram")
    with fleet.create(image="busybox", resources=Resources(memory="512MiB")) as sb:
        # 200 MiB of anonymous memory, every page touched, held by a process that then sleeps
        sb.start('awk \'BEGIN { s = sprintf("%209715200s", ""); system("sleep 1000") }\'')
        assert wait_until(lambda: _memory(daemon, sb.id) > 200 * MiB, timeout=30)
        before = _steady_memory(daemon, sb.id)  # awk's buffers settle after the string is built
        sb.pause()
        after = _memory(daemon, sb.id)
        assert after < 0.1 * before, (before, after)  # >= 90 % went out
        paused = [e for e in sb.events() if e.kind == "paused"][-1]
        assert paused.data["memory_before"] >= 0.9 * before and paused.data["memory_after"] < 0.1 * before
        assert sb.exec("echo back").stdout == "back\n"  # resumes; the sleeper's pages stay out until touched
        assert sb.exec("pidof awk | wc -w").stdout.strip() == "1"  # the process is still there


def test_idle_policy_pauses_and_a_request_resumes(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(SandboxSpec(image="busybox", pause_after=1)) as sb:
        assert wait_until(lambda: fleet.get(sb.id).info.state == "paused", timeout=10)
        assert _frozen(daemon, sb.id)
        assert sb.exec("echo awake").stdout == "awake\n"
        assert fleet.get(sb.id).info.state == "running"
    # The policy of a live sandbox, changed: set (from none), then removed.
    with fleet.create(SandboxSpec(image="busybox")) as sb:
        assert sb.set_lifetime(pause_after=1).spec.pause_after == 1
        assert wait_until(lambda: fleet.get(sb.id).info.state == "paused", timeout=10)
        assert sb.set_lifetime(pause_after=None).spec.pause_after is None
        assert sb.exec("echo awake").stdout == "awake\n"  # resumed, and no policy pauses it again
        time.sleep(2.5)
        assert fleet.get(sb.id).info.state == "running"


def test_a_paused_sandbox_outlives_its_idle_ttl_unless_the_policy_paused_it(daemon: Daemon, fleet: Client) -> None:
    """A preempted trainer pauses its sandboxes and may be gone longer than their idle TTL: they wait.
    One the idle policy paused is idle in the ordinary sense and still expires."""
    held = fleet.create(SandboxSpec(image="busybox", idle_ttl=1))
    idle = fleet.create(SandboxSpec(image="busybox", idle_ttl=3, pause_after=1))
    try:
        held.pause()
        assert wait_until(lambda: fleet.get(idle.id).info.state == "paused", timeout=10)
        assert wait_until(lambda: idle.id not in {s.id for s in fleet.list(state="paused")}, timeout=15)
        assert fleet.get(held.id).info.state == "paused"  # > 3 s past its 1 s idle TTL, still here
        assert held.exec("echo here").stdout == "here\n"
        assert wait_until(lambda: held.id not in {s.id for s in fleet.list(state="running")}, timeout=15)
    finally:
        held.stop()
        idle.stop()


def test_job_level_pause_resume_list_and_delete_of_200(daemon: Daemon, fleet: Client) -> None:
    before = residue(daemon)
    spec = SandboxSpec(image="busybox", labels={"job": "preempted"}, resources=Resources(memory="64MiB", pids=32))
    other = fleet.create(image="busybox", labels={"job": "other"})
    results = fleet.create_many([spec] * 200, concurrency=32)
    sandboxes = [r for r in results if isinstance(r, Sandbox)]
    assert len(sandboxes) == 200, [r for r in results if not isinstance(r, Sandbox)][:3]
    try:
        paused = fleet.pause_many({"job": "preempted"})
        assert sorted(paused) == sorted(sb.id for sb in sandboxes), len(paused)
        assert len(fleet.list(labels={"job": "preempted"}, state="paused")) == 200
        assert fleet.get(other.id).info.state == "running"  # other jobs untouched
        assert all(_frozen(daemon, sb.id) for sb in sandboxes[::20])

        assert sandboxes[0].exec("echo one").stdout == "one\n"  # one comes back by itself
        resumed = fleet.resume_many({"job": "preempted"})
        assert len(resumed) == 199 and sandboxes[0].id not in resumed
        assert len(fleet.list(labels={"job": "preempted"}, state="running")) == 200

        fleet.pause_many({"job": "preempted"})  # a finished job is deleted at once, paused or not
        assert len(fleet.stop_many({"job": "preempted"})) == 200
    finally:
        other.stop()
    assert fleet.list(labels={"job": "preempted"}, state="running") == []
    assert wait_until(lambda: residue(daemon).cgroups == () and residue(daemon).sandbox_dirs == ())
    after = residue(daemon)
    assert after.processes == before.processes and after.zombies == ()


def test_paused_sandbox_survives_a_daemon_restart(own_daemon: Daemon) -> None:
    d = own_daemon
    d.start()
    with d.client() as fleet:
        sb = fleet.create(image="busybox", idle_ttl=600)
        sb.files.write("/task/x", b"before")
        sb.pause()
    d.kill()
    assert _frozen(d, sb.id)
    d.start()
    with d.client() as fleet:
        again = fleet.get(sb.id)
        # paused on request: paused again once adopted (its agent was thawed to hand over its channel)
        assert wait_until(lambda: again.refresh().state == "paused" and _frozen(d, sb.id), 10)
        assert again.exec("cat /task/x").stdout == "before"  # any request resumes it
        assert again.refresh().state == "running" and not _frozen(d, sb.id)
        again.stop()


# -- QoS classes and usage ----------------------------------------------------------------------------


def _agent_pid(d: Daemon, sb: Sandbox) -> int:
    return agent_pid(d, sb.id)


def test_qos_classes_set_scheduling_and_cpu_weight(daemon: Daemon, fleet: Client) -> None:
    import os

    with fleet.create(image="busybox", qos="best_effort") as be, fleet.create(image="busybox") as ls:
        assert os.sched_getscheduler(_agent_pid(daemon, be)) == os.SCHED_IDLE
        assert os.sched_getscheduler(_agent_pid(daemon, ls)) == os.SCHED_OTHER
        # every process of the sandbox inherits it, and cannot leave it for a better class
        assert be.exec("grep policy /proc/self/sched").stdout.split()[-1] == "5"  # SCHED_IDLE
        assert ls.exec("grep policy /proc/self/sched").stdout.split()[-1] == "0"
        assert _cgroup_file(daemon, "cpu", be.id, "cpu.shares").read_text().strip() == "2"
        assert _cgroup_file(daemon, "cpu", ls.id, "cpu.shares").read_text().strip() == "1024"
        assert be.exec("chrt -o -p 0 $$ 2>&1 || renice -n -5 $$ 2>&1").exit_code != 0


def test_usage_reports_memory_cpu_and_tasks(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        sb.exec("i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done")
        u = sb.usage()
        assert u.cpu_seconds > 0.01 and u.memory_bytes > 0 and u.memory_peak_bytes >= u.memory_bytes
        assert u.pids >= 1 and u.oom_kills == 0
        sb.pause()
        assert sb.usage().memory_bytes >= 0 and fleet.get(sb.id).info.state == "paused"  # no resume


def test_a_pause_racing_a_stop_is_refused_and_leaves_nothing(daemon: Daemon, fleet: Client) -> None:
    """Stop does not wait for a pause: the pause fails as a wrong state (or a sandbox not found),
    never as an internal error, and a freeze that landed after the stop's thaw does not keep the
    killed processes (and so the cgroup) alive."""
    before = residue(daemon)
    for delay in (0.0, 0.02, 0.05, 0.1):
        sb = fleet.create(image="busybox", labels={"job": "pause-stop-race"})
        sb.start("dd if=/dev/zero bs=100M count=1 | sleep 1000")  # memory to push out: a pause of some length
        time.sleep(0.3)
        stopper = threading.Timer(delay, sb.stop)
        stopper.start()
        try:
            sb.pause()
        except (WrongStateError, SandboxNotFoundError):
            pass
        finally:
            stopper.join()
    assert fleet.list(labels={"job": "pause-stop-race"}) == []
    assert wait_until(lambda: residue(daemon).cgroups == before.cgroups, timeout=30), residue(daemon)
