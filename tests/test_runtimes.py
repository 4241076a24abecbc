"""The container backend drives runc as well as crun (same config.json, same isolation)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from sandfleet import Resources

from conftest import Daemon, destroy_daemon, make_daemon
from leakcheck import residue


@pytest.fixture
def runc_daemon() -> Iterator[Daemon]:
    if shutil.which("runc") is None:
        pytest.skip("runc is not installed (apt-get install runc)")
    d = make_daemon("runc")
    d.config.write_text(d.config.read_text().replace("[container]\n", '[container]\nruntime = "runc"\n'))
    d.start()
    yield d
    destroy_daemon(d)


def test_runc_runtime(runc_daemon: Daemon) -> None:
    with runc_daemon.client() as fleet:
        with fleet.create(image="busybox", resources=Resources(memory="64MiB", pids=32)) as sb:
            r = sb.exec("id -u; cat /proc/self/uid_map; grep -E 'NoNewPrivs|Seccomp:' /proc/self/status; ls /proc")
            lines = r.stdout.split()
            assert lines[0] == "0" and lines[1:4] == ["0", "100000", "65536"]
            assert "NoNewPrivs:" in r.stdout and "Seccomp:" in r.stdout
            assert sb.session().run("cd /tmp && pwd").stdout == "/tmp\n"
            assert sb.exec("head -c 100m /dev/zero | tail").exit_code == 137
            assert "oom_kill" in [e.kind for e in sb.events()]
        r = residue(runc_daemon)
        assert r.sandbox_dirs == () and r.cgroups == () and r.mounts == ()
