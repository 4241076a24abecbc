"""The launcher server (`sandfleet-run --serve`): a daemon that loses it notices at once, fails what
was in flight with a retryable error, reaps everything the dead server had started, starts a new
one without waiting for a create to find it gone, and leaves nothing behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from sandfleet import Resources, SandboxSpec
from sandfleet.errors import SandboxError, UnavailableError

from conftest import Daemon, wait_until
from leakcheck import children, residue, zombie_children


def _servers(d: Daemon) -> list[int]:
    """The daemon's launcher servers (its children running `sandfleet-run --serve`)."""
    out = []
    for pid, state, _ in children(d.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if state != "Z" and argv[1:2] == [b"--serve"]:
            out.append(pid)
    return out


def test_a_killed_launcher_is_replaced_at_once_and_leaves_nothing(own_daemon: Daemon) -> None:
    d = own_daemon
    d.start()
    with d.client(timeout=120) as fleet, d.client(timeout=120) as burst_client:
        fleet.build_image("busybox")
        before = residue(d)
        assert not before.cgroups and not before.zombies

        # 1. SIGKILL the server in the middle of a burst of creates.
        [server] = _servers(d)
        spec = SandboxSpec(
            image="busybox", labels={"burst": "kill"}, resources=Resources(memory="64MiB", pids=32, cpu_request=0.01)
        )
        results: list[object] = []
        burst = threading.Thread(target=lambda: results.extend(burst_client.create_many([spec] * 100, concurrency=32)))
        burst.start()
        cgroups = Path("/sys/fs/cgroup/pids") / d.cgroup_parent
        assert wait_until(lambda: cgroups.is_dir() and sum(p.is_dir() for p in cgroups.iterdir()) >= 8, timeout=30)
        os.kill(server, signal.SIGKILL)
        burst.join(timeout=120)
        assert not burst.is_alive()
        errors = [r for r in results if isinstance(r, SandboxError)]
        made = [r for r in results if not isinstance(r, SandboxError)]
        assert len(results) == 100 and made, (len(results), errors[:3])
        # what was in flight failed with a retryable error; nothing else did
        odd = [e for e in errors if not (isinstance(e, UnavailableError) and e.retryable)]
        assert not odd, [(type(e).__name__, e.code, e.retryable, str(e)) for e in odd[:3]]
        assert len(fleet.list(labels={"burst": "kill"}, state="running")) == len(made)
        for sb in made[:: max(1, len(made) // 8)]:
            assert sb.exec("echo alive").stdout == "alive\n"  # type: ignore[attr-defined]
        assert wait_until(lambda: not zombie_children(d.pid), timeout=5), zombie_children(d.pid)

        # 2. SIGKILL it with nothing going on: a new one is up without a create to trigger it.
        [server] = _servers(d)
        os.kill(server, signal.SIGKILL)
        assert wait_until(lambda: _servers(d) not in ([], [server]), timeout=3), _servers(d)
        assert len(_servers(d)) == 1
        t0 = time.monotonic()
        with fleet.create(image="busybox") as sb:
            assert sb.exec("echo fine").stdout == "fine\n"
        assert time.monotonic() - t0 < 5
        assert wait_until(lambda: not zombie_children(d.pid), timeout=5), zombie_children(d.pid)

        # 3. Nothing is left once everything is stopped.
        fleet.stop_many({"burst": "kill"})
        assert wait_until(lambda: residue(d).cgroups == () and residue(d).processes <= before.processes, timeout=30)
        after = residue(d)
        assert after.mounts == before.mounts
        assert after.sandbox_dirs == () and after.runtime_state == ()
        assert after.processes == before.processes
        assert after.zombies == ()
        assert fleet.list() == []
