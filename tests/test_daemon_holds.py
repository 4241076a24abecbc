"""What a sandbox's commands can make the daemon hold stays bounded: the records and output of its
background processes (issue 26, item 14: the class of the egress proxy's unbounded connections;
connections and exposed ports are in tests/test_network.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandfleet import Client

from conftest import Daemon, wait_until


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError("no VmRSS")


@pytest.mark.slow
def test_finished_background_processes_are_kept_within_bounds(daemon: Daemon, fleet: Client) -> None:
    """Each background process's record and output stayed until the sandbox stopped: a loop of
    starts made the daemon hold them all. Now the finished ones are kept newest first (by when they
    finished), at most 1024 of them and 64 MiB of their output; running ones are never dropped."""
    with fleet.create(image="busybox") as sb:
        keep = sb.start("sleep 600")
        before = _rss_mib(daemon.pid)
        for _ in range(160):  # 1 MiB of output each
            sb.start("head -c 1048576 /dev/zero; echo >> /tmp/done")
        assert wait_until(lambda: sb.exec("wc -l < /tmp/done").stdout.strip() == "160", 60)
        time.sleep(0.5)  # their exits reach the daemon
        held = _rss_mib(daemon.pid) - before
        finished = [p for p in sb.processes() if not p.running]
        assert 60 <= len(finished) <= 64, len(finished)
        assert held < 110, held  # 160 MiB of output was made
        late = sb.start("while [ ! -f /tmp/go ]; do sleep 0.05; done")  # started before them, ends after
        for _ in range(1100):
            sb.start("true")
        assert wait_until(lambda: sum(p.running for p in sb.processes()) == 2, 60)
        sb.exec("touch /tmp/go")
        assert wait_until(lambda: not any(p.id == late.id and p.running for p in sb.processes()), 30)
        ended = late.wait(timeout=0)  # the newest finished: kept, however early it started
        assert ended.result is not None and ended.result.exit_code == 0, ended
        procs = sb.processes()
        assert len(procs) <= 1025 and any(p.id == keep.id and p.running for p in procs)
        assert keep.wait(timeout=0).running
