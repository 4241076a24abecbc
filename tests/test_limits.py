"""Resource limits: memory, pids, output, disk and CPU caps hold, are reported as events, and a sandbox
that hits one does not hurt the daemon, the host or other sandboxes.

Limits are also read back from the host's cgroup tree (cgroup v1 here), so a limit that is reported
but not enforced, or enforced on the wrong cgroup, fails the test.
"""

from __future__ import annotations

import os
import threading
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from sandfleet import Client, ExecResult, Resources, Sandbox
from sandfleet.models import SandboxEvent

from conftest import EXPECT, Daemon

T = TypeVar("T")
MiB = 1024**2
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_dir(daemon: Daemon, controller: str, sandbox_id: str) -> Path:
    parent = str(tomllib.loads(daemon.config.read_text())["container"]["cgroup_parent"]).strip("/")
    return CGROUP_ROOT / controller / parent / sandbox_id


def read_int(path: Path) -> int:
    return int(path.read_text().split()[0])


def wait_for(fn: Callable[[], T], timeout: float = 10.0, interval: float = 0.02) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def pids_refused(pids_cgroup: Path) -> int:
    """Forks the pids controller refused so far (`max N` in pids.events)."""
    return int((pids_cgroup / "pids.events").read_text().split()[1])


def kinds(events: list[SandboxEvent]) -> list[str]:
    return [e.kind for e in events]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def pid_ns_members(ns: str) -> list[int]:
    """Host pids of every process in the pid namespace `ns` (a readlink of /proc/<pid>/ns/pid)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.readlink(f"/proc/{name}/ns/pid") == ns:
                    found.append(int(name))
            except OSError:
                continue
    return found


def assert_daemon_healthy(daemon: Daemon, fleet: Client) -> None:
    assert daemon.process.alive(), "the daemon died"
    assert fleet.health()


# -- memory ------------------------------------------------------------------------------------------


def test_oom_is_contained(daemon: Daemon, fleet: Client, sandbox: Sandbox) -> None:
    with fleet.create(image="busybox", resources=Resources(memory="64MiB"), labels={EXPECT: "oom_repeat"}) as sb:
        mem = cgroup_dir(daemon, "memory", sb.id)
        assert read_int(mem / "memory.limit_in_bytes") == 64 * MiB  # enforced on the host, not just recorded
        # `tail` keeps everything after the last newline: /dev/zero has none, so it holds all 200 MiB.
        r = sb.exec("head -c 200m /dev/zero | tail", timeout=60)
        assert r.exit_code == 137, r
        assert "Killed" in r.stderr or r.signal == 9, r
        assert "oom_kill 1" in (mem / "memory.oom_control").read_text()
        assert read_int(mem / "memory.max_usage_in_bytes") <= 64 * MiB

        assert sb.refresh().state == "running"
        assert sb.exec("echo still here").stdout == "still here\n"
        oom = [e for e in sb.events() if e.kind == "oom_kill"]
        assert len(oom) == 1 and oom[0].data == {"count": 1, "limit": 64 * MiB}, oom
        # an allocation that fits is fine afterwards
        assert sb.exec("head -c 16m /dev/zero | tail | wc -c", timeout=60).stdout.strip() == str(16 * MiB)

    assert_daemon_healthy(daemon, fleet)
    assert sandbox.exec("echo bystander").stdout == "bystander\n"
    assert "oom_kill" not in kinds(sandbox.events())


# -- pids ----------------------------------------------------------------------------------------------

# Every bomb process waits after forking, so the tree sits at the cap instead of burning out at once
# (busybox sh exits on a failed fork).
BOMB = "bomb() { bomb | bomb & sleep 60; }; bomb"


def test_fork_bomb_is_contained(daemon: Daemon, fleet: Client, sandbox: Sandbox) -> None:
    with fleet.create(image="busybox", resources=Resources(pids=64), labels={EXPECT: "fork_flood"}) as sb:
        pids = cgroup_dir(daemon, "pids", sb.id)
        assert read_int(pids / "pids.max") == 64
        result: list[ExecResult] = []
        t = threading.Thread(target=lambda: result.append(sb.exec(f"sleep 60 & ({BOMB}); wait", timeout=5)))
        t.start()
        try:
            # while the bomb is at the cap, the daemon and other sandboxes carry on
            assert wait_for(lambda: pids_refused(pids) > 0, timeout=4), "the bomb never reached the cap"
            assert read_int(pids / "pids.peak") == 64
            assert sandbox.exec("echo bystander").stdout == "bystander\n"
            assert_daemon_healthy(daemon, fleet)
        finally:
            t.join(30)
        [r] = result
        assert r.timed_out and r.exit_code == 137, r
        assert "can't fork" in r.stderr

        # the timeout killed the whole tree: the sandbox is usable again
        assert wait_for(lambda: read_int(pids / "pids.current") <= 2, timeout=10), (pids / "pids.current").read_text()
        assert sb.exec("echo survived").stdout == "survived\n"
        events = sb.events()
        limit = [e for e in events if e.kind == "pids_limit"]
        assert limit and limit[0].data["limit"] == 64 and limit[0].data["refused_forks"] > 0, events
        assert "exec_timeout" in kinds(events)


def test_background_fork_bomb_is_reaped_on_stop(daemon: Daemon, fleet: Client) -> None:
    """A bomb that detaches from its exec outlives it; stopping the sandbox must still reap every task."""
    sb = fleet.create(image="busybox", resources=Resources(pids=64), labels={EXPECT: "fork_flood"})
    try:
        pids = cgroup_dir(daemon, "pids", sb.id)
        agent = int((pids / "cgroup.procs").read_text().split()[0])
        ns = os.readlink(f"/proc/{agent}/ns/pid")
        sb.exec(f"({BOMB}) >/dev/null 2>&1 &", timeout=5)
        assert wait_for(lambda: pids_refused(pids) > 0, timeout=5), "the bomb never reached the cap"
        assert len(pid_ns_members(ns)) >= 10  # control: the scan finds the bomb
    finally:
        t0 = time.monotonic()
        sb.stop()
        stop_seconds = time.monotonic() - t0
    assert stop_seconds < 10
    assert pid_ns_members(ns) == []
    for controller in ("pids", "memory", "cpuacct", "freezer"):
        assert not cgroup_dir(daemon, controller, sb.id).exists(), controller
    assert_daemon_healthy(daemon, fleet)
    with fleet.create(image="busybox", resources=Resources(pids=64)) as fresh:
        assert fresh.exec("echo fresh").stdout == "fresh\n"


# -- output (exec) --------------------------------------------------------------------------------------------


def test_output_is_capped_and_daemon_memory_stays_flat(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", labels={EXPECT: "output_flood"}) as sandbox:  # an output flood on purpose
        _output_is_capped(daemon, sandbox)


def _output_is_capped(daemon: Daemon, sandbox: Sandbox) -> None:
    r = sandbox.exec("yes", timeout=3)
    assert len(r.stdout) == MiB and r.stdout.startswith("y\ny\n"), len(r.stdout)
    assert r.stdout_truncated and not r.stderr_truncated and r.timed_out and r.exit_code == 137
    trunc = [e for e in sandbox.events() if e.kind == "output_truncated"]
    assert len(trunc) == 1 and trunc[0].data["limit"] == MiB and trunc[0].data["stdout_bytes"] > 10 * MiB, trunc

    r = sandbox.exec("head -c 3000000 /dev/zero | tr '\\0' e >&2")
    assert r.exit_code == 0 and r.stdout == "" and len(r.stderr) == MiB and r.stderr_truncated
    r = sandbox.exec("yes | head -c 5000", output_limit=1000)
    assert r.exit_code == 0 and len(r.stdout) == 1000 and r.stdout_truncated

    before = rss_kib(daemon.pid)
    results: list[ExecResult] = []
    runs = [threading.Thread(target=lambda: results.append(sandbox.exec("yes", timeout=3))) for _ in range(5)]
    for t in runs:
        t.start()
    for t in runs:
        t.join(60)
    assert len(results) == 5
    assert all(len(x.stdout) == MiB and x.stdout_truncated for x in results)
    grown_mib = (rss_kib(daemon.pid) - before) / 1024
    assert grown_mib < 50, f"daemon RSS grew by {grown_mib:.0f} MiB"


# -- disk ----------------------------------------------------------------------------------------------


def test_disk_quota(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", resources=Resources(disk="16MiB")) as sb:
        sdir = daemon.run_dir / "sandboxes" / sb.id
        # The scratch tmpfs and the overlay live only in the sandbox's own mount namespace.
        assert str(sdir) not in daemon.mountinfo()

        r = sb.exec("dd if=/dev/zero of=/big bs=1M count=64", timeout=60)
        assert r.exit_code != 0 and "No space left on device" in r.stderr, r
        assert int(sb.exec("stat -c %s /big").stdout) <= 16 * MiB
        df = sb.exec("df -k /").stdout.splitlines()[1].split()
        assert int(df[1]) == 16384, df
        r = sb.exec("echo x > /more")
        assert r.exit_code != 0 and "No space left" in r.stderr
        # the sandbox still works and space comes back when the file goes
        assert sb.exec("rm /big && echo small > /more && cat /more").stdout == "small\n"
        # other writable places are capped too (and charged to the sandbox's memory)
        r = sb.exec("dd if=/dev/zero of=/dev/shm/big bs=1M count=100", timeout=60)
        assert r.exit_code != 0 and "No space left on device" in r.stderr, r
        assert sb.exec("rm /dev/shm/big && echo ok").stdout == "ok\n"

    mounts = daemon.mountinfo()
    assert str(sdir) not in mounts
    assert not sdir.exists()


# -- cpu -----------------------------------------------------------------------------------------------


def test_cpu_limit(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", resources=Resources(cpu=0.5)) as sb:
        cpu = cgroup_dir(daemon, "cpu", sb.id)
        assert read_int(cpu / "cpu.cfs_quota_us") == 50_000 and read_int(cpu / "cpu.cfs_period_us") == 100_000
        usage = cgroup_dir(daemon, "cpuacct", sb.id) / "cpuacct.usage"
        spin = "sh -c 'while :; do :; done'"
        before, t0 = read_int(usage), time.monotonic()
        # two spinners: on this 2-core host they would use ~2 cores without the quota
        r = sb.exec(f"{spin} & {spin} & wait", timeout=2)
        wall = time.monotonic() - t0
        used = (read_int(usage) - before) / 1e9
        assert r.timed_out, r
        assert 0.3 * wall <= used <= 0.75 * wall, f"used {used:.2f}s of CPU in {wall:.2f}s"


# -- sessions ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_session_output_cannot_grow_daemon_memory(own_daemon: Daemon) -> None:
    own_daemon.start()  # a daemon of its own: this test inflates its memory when the bug is present
    with own_daemon.client() as c, c.create(image="busybox") as sb, sb.session() as s:
        assert s.run("echo warm").stdout == "warm\n"
        before = rss_kib(own_daemon.pid)
        # a process the command leaves behind keeps writing to the session's stdout between commands
        assert s.run("yes & echo started").exit_code == 0
        wait_for(lambda: rss_kib(own_daemon.pid) - before > 64 * 1024, timeout=8, interval=0.05)
        grown_mib = (rss_kib(own_daemon.pid) - before) / 1024
        assert grown_mib < 50, f"daemon RSS grew by {grown_mib:.0f} MiB"
