"""The microvm tier end to end, through the SDK: a busybox sandbox in a jailed QEMU (TCG here)."""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet.runtime import guest

from conftest import Daemon, destroy_daemon, make_daemon, wait_until

pytestmark = [pytest.mark.vm]

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _with_microvm(d: Daemon) -> str:
    """Turn the test config's `[container]` table into `[[backends]]` tables: the container tier
    as before, plus the microvm tier (with a cgroup parent of its own); returns that parent."""
    parent = f"/sandfleet-vmtest-{d.root.name}"
    text = d.config.read_text()
    head, container = text.split("[container]\n", 1)
    d.config.write_text(
        head
        + '[[backends]]\ntype = "container"\n'
        + container
        + f'[[backends]]\ntype = "microvm"\ncgroup_parent = "{parent}"\n'
    )
    return parent


@pytest.fixture(scope="module")
def vmd() -> Iterator[tuple[Daemon, str]]:
    if os.geteuid() != 0:
        pytest.skip("the microvm tier needs root")
    ok, why = guest.usable("qemu-system-x86_64", Path("/opt/sandfleet/guest"))
    if not ok:
        pytest.skip(why)
    d = make_daemon("vm")
    parent = _with_microvm(d)
    d.start()
    yield d, parent
    destroy_daemon(d)


def _measured(line: str) -> None:
    """A figure for the report (visible with -s)."""
    sys.stderr.write(f"\n[vm] {line}")


def _cgroup_procs(parent: str, sandbox_id: str) -> list[int]:
    try:
        procs = CGROUP_ROOT / "pids" / parent.strip("/") / sandbox_id / "cgroup.procs"
        return [int(x) for x in procs.read_text().split()]
    except OSError:
        return []


def _qemu_pid(parent: str, sandbox_id: str) -> int:
    for pid in _cgroup_procs(parent, sandbox_id):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip().startswith("qemu-system"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"no QEMU process in the cgroup of {sandbox_id}")


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _gone(d: Daemon, parent: str, sandbox_id: str, qemu_pid: int) -> bool:
    return (
        not Path(f"/proc/{qemu_pid}").exists()
        and not (d.run_dir / "microvm" / sandbox_id).exists()
        and not any((CGROUP_ROOT / c / parent.strip("/") / sandbox_id).exists() for c in ("memory", "pids", "cpu"))
    )


def test_exec_isolation_and_stop(vmd: tuple[Daemon, str]) -> None:
    d, parent = vmd
    with d.client(timeout=300) as c:
        t0 = time.monotonic()
        sb = c.create(backend="microvm", image="busybox", idle_ttl=600)
        r = sb.exec("echo hello")
        first = time.monotonic() - t0
        assert r.stdout == "hello\n"
        _measured(f"microvm create to first exec: {first:.2f}s")
        # The guest's own kernel, not the host's.
        assert sb.exec("uname -r").stdout.strip() != platform.release()
        # No host files: the guest sees only the image.
        assert sb.exec("test -e /work || test -e /opt/sandfleet || test -e /var/lib/sandfleet; echo $?").stdout == "1\n"
        # The agent's virtio-serial port is not reachable from sandboxed code (no node, no mknod).
        r = sb.exec("ls /dev/vport* /dev/hvc* 2>&1; mknod /dev/x c 248 1 2>&1; echo done")
        assert "No such file" in r.stdout and "done" in r.stdout and not re.search(r"^/dev/vport", r.stdout, re.M)
        # Exec round trip.
        n = 10
        t1 = time.monotonic()
        for _ in range(n):
            sb.exec("true")
        _measured(f"microvm exec round trip: {(time.monotonic() - t1) / n * 1000:.1f} ms")
        # Sessions.
        s = sb.session()
        assert s.run("cd /tmp && pwd").stdout == "/tmp\n"
        assert s.run("pwd").stdout == "/tmp\n"
        # QEMU: its own non-root uid, no capabilities at all, seccomp on.
        qpid = _qemu_pid(parent, sb.id)
        st = _status(qpid)
        assert st["Uid"].split()[0] != "0" and int(st["Uid"].split()[0]) >= 3_000_000
        assert int(st["CapEff"], 16) == 0 and int(st["CapBnd"], 16) == 0 and int(st["CapPrm"], 16) == 0
        assert st["Seccomp"] == "2"
        _measured(f"microvm QEMU idle RSS: {int(st['VmRSS'].split()[0]) / 1024:.0f} MiB")
        # Pause stops the vCPUs and pushes memory out; resume carries on.
        sb.pause()
        sb.resume()
        assert sb.exec("echo again").stdout == "again\n"
        sb.stop()
        assert wait_until(lambda: _gone(d, parent, sb.id, qpid), timeout=30)


def test_restart_adopts_vm(vmd: tuple[Daemon, str]) -> None:
    d, parent = vmd
    with d.client(timeout=300) as c:
        sb = c.create(backend="microvm", image="busybox", idle_ttl=600)
        sb.exec("echo kept > /tmp/state")
        qpid = _qemu_pid(parent, sb.id)
    d.kill()
    time.sleep(0.3)
    assert Path(f"/proc/{qpid}").exists()  # the VM outlives the daemon
    d.start()
    with d.client(timeout=300) as c:
        sb2 = c.get(sb.id)
        assert sb2.info.state == "running"
        assert sb2.exec("cat /tmp/state").stdout == "kept\n"
        assert _qemu_pid(parent, sb.id) == qpid
        sb2.stop()
        assert wait_until(lambda: _gone(d, parent, sb.id, qpid), timeout=30)
