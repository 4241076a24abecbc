"""Nothing a sandbox used survives it: after 500 create/exec/stop cycles and after failed creates."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sandfleet import Mount, Resources, SandboxSpec
from sandfleet.errors import ImageNotFoundError, InvalidArgumentError, SandboxError

from conftest import Daemon, destroy_daemon, make_daemon
from leakcheck import residue


def _wait_settled(d: Daemon, baseline_procs: int, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        r = residue(d)
        if not r.sandbox_dirs and not r.cgroups and not r.zombies and r.processes <= baseline_procs:
            return
        time.sleep(0.1)


@pytest.fixture
def leak_daemon() -> Iterator[Daemon]:
    d = make_daemon("leak")
    d.start()
    yield d
    destroy_daemon(d)


@pytest.mark.slow
def test_no_residue_after_500_cycles_and_failed_creates(leak_daemon: Daemon) -> None:
    d = leak_daemon
    with d.client() as fleet:
        fleet.build_image("busybox")
        before = residue(d)
        assert not before.sandbox_dirs and not before.cgroups and before.state_rows == 0

        def cycle(i: int) -> str:
            with fleet.create(
                image="busybox", resources=Resources(memory="64MiB", pids=32), labels={"i": str(i)}
            ) as sb:
                r = sb.exec(f"echo {i} > /tmp/x && cat /tmp/x")
                assert r.stdout == f"{i}\n"
                if i % 50 == 0:
                    sb.files.write("/task/f", b"x" * 1000)
                    sb.session().run("cd /tmp && ls")
                    sb.start("sleep 100")  # left running: stop must kill it
            return sb.id

        with ThreadPoolExecutor(4) as pool:
            ids = list(pool.map(cycle, range(500)))
        assert len(set(ids)) == 500

        # Failed creates, each kind several times: bad image, bad mount, bad user (fails after start).
        for _ in range(10):
            with pytest.raises(ImageNotFoundError):
                fleet.create(image="no-such-image")
            with pytest.raises(InvalidArgumentError):
                fleet.create(image="busybox", mounts=[Mount(source="/etc", target="/host-etc")])
            with pytest.raises(SandboxError):
                fleet.create(image="busybox", user="nosuchuser")

        _wait_settled(d, before.processes)
        after = residue(d)
        assert after.mounts == before.mounts
        assert after.cgroups == ()
        assert after.sandbox_dirs == ()
        assert after.runtime_state == ()
        assert after.state_rows == 0
        assert after.processes == before.processes
        assert after.loops <= before.loops  # a host-wide count: other work on the node may free some
        assert after.zombies == ()
        # Network namespaces come and go with other processes on the host; ours must not pile up.
        assert after.netns <= before.netns + 2
        assert fleet.list() == []


@pytest.mark.slow
def test_no_residue_after_a_5000_sandbox_burst(leak_daemon: Daemon) -> None:
    """5,000 sandboxes alive at once (the density promise), each exec-ready, then nothing left."""
    d = leak_daemon
    n = 5000
    with d.client() as fleet:
        fleet.build_image("busybox")
        before = residue(d)
        spec = SandboxSpec(
            image="busybox", labels={"burst": "5000"}, resources=Resources(memory="64MiB", pids=32, cpu_request=0.01)
        )
        results = fleet.create_many([spec] * n, concurrency=32)
        failed = [r for r in results if isinstance(r, SandboxError)]
        assert not failed, (len(failed), failed[:3])
        sandboxes = [r for r in results if not isinstance(r, SandboxError)]
        assert len({sb.id for sb in sandboxes}) == n
        assert len(fleet.list(labels={"burst": "5000"}, state="running")) == n
        # every one is exec-ready, and they are isolated from each other (own pid namespace each)
        for sb in sandboxes[:: n // 50]:
            assert sb.exec("echo $$").stdout.split() != ["1"]  # the shell is not the sandbox's init
            assert int(sb.exec("ls /proc | grep -c '^[0-9]'").stdout) < 6  # agent, sh, ls, grep: no neighbours
        assert len(sandboxes) == n and sandboxes[-1].exec("true").exit_code == 0
        assert len(fleet.stop_many({"burst": "5000"})) == n
        _wait_settled(d, before.processes, timeout=120)
        after = residue(d)
        assert after.cgroups == () and after.sandbox_dirs == () and after.state_rows == 0
        assert after.mounts == before.mounts and after.processes == before.processes
        assert after.zombies == () and after.loops <= before.loops
        assert after.netns <= before.netns + 2
