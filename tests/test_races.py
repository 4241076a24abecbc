"""Requests that race a sandbox's lifecycle, and sandboxes that try to blow up the daemon's memory."""

from __future__ import annotations

import io
import tarfile
import threading
import time
from pathlib import Path

import pytest

from sandfleet import Client, Resources, Sandbox
from sandfleet.errors import SandboxError

from conftest import Daemon
from leakcheck import residue


def _vm_hwm(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_stop_while_creating_leaves_nothing_running(own_daemon: Daemon) -> None:
    own_daemon.start()
    with own_daemon.client() as fleet, own_daemon.client() as other:
        fleet.build_image("busybox")
        for _attempt in range(5):
            result: dict[str, Sandbox | SandboxError] = {}

            def create(result: dict[str, Sandbox | SandboxError] = result) -> None:
                try:
                    result["sb"] = fleet.create(image="busybox")
                except SandboxError as exc:
                    result["sb"] = exc

            t = threading.Thread(target=create)
            t.start()
            caught = None
            deadline = time.time() + 10
            while caught is None and time.time() < deadline and t.is_alive():
                for info in other.list(state="creating"):
                    caught = other.get(info.id).stop()
                    break
            t.join(30)
            if caught is None:
                continue  # the create won the race this time; try again
            assert caught.state in ("stopped", "failed")
            # Whatever the create returned, nothing of that sandbox may still run.
            assert other.list(state="running") == []
            r = residue(own_daemon)
            assert r.sandbox_dirs == () and r.cgroups == () and r.mounts == () and r.runtime_state == (), r
            return
        pytest.skip("never caught a sandbox in `creating` in 5 tries")


def test_sparse_file_cannot_make_the_daemon_build_a_huge_archive(daemon: Daemon, fleet: Client) -> None:
    """A sparse file is archived by what it stores (GNU sparse members), never by its apparent
    size; a tree that really holds more than the sandbox could is refused before a byte is sent."""
    with fleet.create(image="busybox", resources=Resources(disk="16MiB")) as sb:
        sb.exec("mkdir /w && truncate -s 8G /w/big && echo small > /w/small")
        before = _vm_hwm(daemon.pid)
        data = sb.files.download_tar("/w")
        assert len(data) < 1024**2
        assert _vm_hwm(daemon.pid) - before < 64 * 1024**2
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            big = tar.getmember("big")
            assert big.size == 8 * 1024**3 and big.issparse()
