"""`sandfleet demo` options that would be ignored are refused, and the tier benchmark's peers leave no
cgroup behind (issue 26, item 24)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from sandfleet.runtime.cgroups import Cgroups
from test_cli import sf

from conftest import IMAGES, Daemon, destroy_daemon, make_daemon, wait_until

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_demo_refuses_a_tier_its_task_cannot_run_on(daemon: Daemon) -> None:
    """The real task needs snapshots and pack: on fncall it refuses at once, naming why, instead of
    running on the container tier as if `--backend` had not been given."""
    t0 = time.monotonic()
    r = sf(daemon, "demo", "--backend", "fncall", "--socket", str(daemon.socket), timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    err = " ".join(r.stderr.split())
    assert "the fncall tier cannot snapshot or pack" in err and "--task toy" in err, err
    assert time.monotonic() - t0 < 30  # nothing was built or created
    r = sf(daemon, "demo", "--backend", "microvm", "--socket", str(daemon.socket), timeout=60)
    assert r.returncode == 2 and "does not run the microvm tier" in " ".join(r.stderr.split())
    # Options of the other task are refused too, not dropped.
    r = sf(daemon, "demo", "--image", "busybox", "--socket", str(daemon.socket), timeout=60)
    assert r.returncode == 2 and "--image: not an option of --task more-itertools" in r.stderr
    r = sf(daemon, "demo", "--task", "toy", "--groups", "2", "--socket", str(daemon.socket), timeout=60)
    assert r.returncode == 2 and "--groups: not an option of --task toy" in r.stderr


def _cgroups_named(name: str) -> list[str]:
    """Cgroup directories of that name in any hierarchy, and beneath the cgroup2 mount point of a
    hybrid host (in the tmpfs a process sees where that mount is hidden, as crun's wrapper hides it)."""
    root = Path("/sys/fs/cgroup")
    found = [str(c / name) for c in root.iterdir() if (c / name).is_dir()]
    hidden = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "--", "sh", "-c",
         f"umount /sys/fs/cgroup/unified 2>/dev/null; ls -d /sys/fs/cgroup/unified/{name} 2>/dev/null"],
        capture_output=True, text=True,
    )  # fmt: skip
    return found + [f"{ln} (beneath the mount)" for ln in hidden.stdout.split()]


def test_tier_bench_peers_leave_no_cgroup() -> None:
    """bench/tiers.py's per-call peers (crun with sandfleet's OCI config) on the python image: the
    cgroups crun made (the container's and its parent) are gone afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    sys.path.insert(0, str(BENCH))
    from common import in_cgroup_ns_wrapper

    manifest = json.loads((IMAGES / "images" / "python" / "3.11.json").read_text())
    layers = [str(IMAGES / "layers" / (x["digest"].replace(":", "-") + ".erofs")) for x in manifest["layers"]]
    parent = f"sandfleet-test-peers-{os.getpid()}"
    tmp_path = Path(tempfile.mkdtemp(prefix="sfb-tiers-test-"))  # under /tmp: the peers' root uid reaches it
    params = tmp_path / "params.json"
    out = tmp_path / "out.json"
    params.write_text(
        json.dumps({"layers": layers, "n": 2, "width": 1, "tmp": str(tmp_path), "cgroup_parent": f"/{parent}",
                    "out": str(out)})
    )  # fmt: skip
    r = subprocess.run(
        in_cgroup_ns_wrapper([sys.executable, str(BENCH / "tiers.py"), "--peers", str(params)]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        assert r.returncode == 0, r.stderr[-2000:]
        got = json.loads(out.read_text())
        crun = got["crun run (sandfleet's config), python3 -c"]
        assert "rate_per_s" in crun, crun  # the peer really ran (and made its cgroups)
        assert _cgroups_named(parent) == []
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
        subprocess.run(in_cgroup_ns_wrapper(["rm", "-rf", f"/sys/fs/cgroup/unified/{parent}"]), check=False)
        Cgroups(parent).remove(parent)


def test_an_oci_runtime_leaves_nothing_beneath_the_hidden_cgroup2_mount() -> None:
    """The daemon hides a hybrid host's cgroup2 mount in its namespace (crun 1.8 needs that); crun then
    writes its "unified" cgroup as plain directories and files into the tmpfs beneath that mount point,
    invisible from the host. They go with the sandbox, and the parent with the daemon."""
    if not Path("/sys/fs/cgroup/unified/cgroup.controllers").exists():
        pytest.skip("not a hybrid cgroup host")
    d = make_daemon("crun-cg")
    d.config.write_text(d.config.read_text().replace("[container]\n", '[container]\nruntime = "crun"\n'))
    d.start()
    try:
        parent = d.cgroup_parent
        with d.client() as fleet:
            for _ in range(2):
                with fleet.create(image="busybox") as sb:
                    assert sb.exec("echo hi").stdout == "hi\n"
                    assert any(sb.id in p for p in _cgroups_named(f"{parent}/{sb.id}"))  # crun made it there
                assert wait_until(lambda sid=sb.id: _cgroups_named(f"{parent}/{sid}") == [])  # type: ignore[misc]
    finally:
        destroy_daemon(d)
    assert _cgroups_named(parent) == []
