"""The container backend drives crun and runc as well as its own launcher (same config, same isolation)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from sandfleet import Resources

from conftest import Daemon, destroy_daemon, make_daemon
from leakcheck import residue


@pytest.fixture(params=["crun", "runc"])
def oci_daemon(request: pytest.FixtureRequest) -> Iterator[Daemon]:
    runtime = request.param
    if shutil.which(runtime) is None:
        pytest.skip(f"{runtime} is not installed (apt-get install {runtime})")
    d = make_daemon(runtime)
    d.config.write_text(d.config.read_text().replace("[container]\n", f'[container]\nruntime = "{runtime}"\n'))
    d.start()
    yield d
    destroy_daemon(d)


def test_oci_runtime(oci_daemon: Daemon) -> None:
    null_before = os.stat("/dev/null")
    with oci_daemon.client() as fleet:
        with fleet.create(image="busybox", resources=Resources(memory="64MiB", pids=32)) as sb:
            r = sb.exec("id -u; cat /proc/self/uid_map; grep -E 'NoNewPrivs|Seccomp:' /proc/self/status; ls /proc")
            lines = r.stdout.split()
            assert lines[0] == "0" and lines[1:4] == ["0", "100000", "65536"]
            assert "NoNewPrivs:" in r.stdout and "Seccomp:" in r.stdout
            assert sb.session().run("cd /tmp && pwd").stdout == "/tmp\n"
            assert sb.exec("head -c 100m /dev/zero | tail").exit_code == 137
            assert "oom_kill" in [e.kind for e in sb.events()]
        r = residue(oci_daemon)
        assert r.sandbox_dirs == () and r.cgroups == () and r.mounts == ()
    null_after = os.stat("/dev/null")
    assert (null_after.st_uid, null_after.st_mode) == (null_before.st_uid, null_before.st_mode)
