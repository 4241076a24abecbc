"""The cgroup facility (`runtime/cgroups.py`) on the host's real hierarchies: what the daemon's
freezer users and a rollback's renames rely on when the node is busy or the daemon dies part way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from sandfleet.runtime import cgroups
from sandfleet.runtime.cgroups import CGROUP_ROOT, V1_JOINED, Cgroups

from conftest import wait_until


@pytest.fixture
def cg() -> Iterator[Cgroups]:
    cg = Cgroups(f"sandfleet-test-cg-{os.getpid()}")
    if cg.mode == "v2":
        pytest.skip("the v1 freezer, CFS and rename are used directly here")
    yield cg
    cg.remove(cg.parent)  # (and what a test left under it)


def test_a_freeze_that_does_not_complete_in_time_is_undone(cg: Cgroups) -> None:
    """On a node so busy that a sandbox's tasks get no CPU to stop at, a freeze (a pause, a
    checkpoint) times out. It is undone, not left half done: a cgroup left freezing stops its tasks
    one by one, and frozen tasks ignore SIGKILL until thawed, so the sandbox could neither run on
    nor be stopped. (The daemon answers such a freeze with a retryable 503.) Busy tasks throttled
    to 1 ms of CPU a second stand for the busy node: they cannot stop until the next second."""
    rel = cg.path_for("busy").lstrip("/")
    freezer, cpu = CGROUP_ROOT / "freezer" / rel, CGROUP_ROOT / "cpu" / rel
    busy: list[subprocess.Popen[bytes]] = []
    try:
        for d in (freezer, cpu):
            d.mkdir(parents=True)
        (cpu / "cpu.cfs_period_us").write_text("1000000")
        (cpu / "cpu.cfs_quota_us").write_text("1000")
        for _ in range(2):
            busy.append(subprocess.Popen(["sh", "-c", "while :; do :; done"]))
            for d in (freezer, cpu):
                (d / "cgroup.procs").write_text(str(busy[-1].pid))

        def throttled() -> int:
            return int(dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())["nr_throttled"])

        # Just throttled: the next CPU they get is about a second away.
        seen = throttled()
        assert wait_until(lambda: throttled() > seen, timeout=5, interval=0.001)
        with pytest.raises(TimeoutError):
            cg.freeze(rel, timeout=0.2)
        assert (freezer / "freezer.state").read_text().strip() == "THAWED"
        assert cg.thawed(rel) and not cg.frozen(rel)
        (cpu / "cpu.cfs_quota_us").write_text("-1")  # (a throttled task waits for CPU to exit, too)
        for p in busy:  # killable at once: nothing of them stayed frozen
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=2)
        # With CPU to stop at, the same freeze completes (the timeout above was the busy node's).
        busy.append(subprocess.Popen(["sh", "-c", "while :; do :; done"]))
        (freezer / "cgroup.procs").write_text(str(busy[-1].pid))
        cg.freeze(rel, timeout=5)
        assert cg.frozen(rel) and not cg.thawed(rel)
        cg.thaw(rel)
        assert cg.thawed(rel)
    finally:
        if freezer.exists():
            (freezer / "freezer.state").write_text("THAWED")
        for p in busy:
            p.kill()
            p.wait()
        cg.remove(rel)


def test_a_process_is_held_by_a_cgroup_renamed_whole_and_not_by_one_renamed_in_part(cg: Cgroups) -> None:
    """A rollback renames cgroups hierarchy by hierarchy (the old part out of the sandbox's name, a
    standby into it). A daemon killed between two of those renames leaves a process under two names:
    its restart must adopt it as neither sandbox."""
    rel, other = cg.path_for("a"), cg.path_for("a.standby-x")
    dirs = [CGROUP_ROOT / c / rel.lstrip("/") for c in V1_JOINED if (CGROUP_ROOT / c).is_dir()]
    p = subprocess.Popen(["sleep", "100"])
    try:
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
            (d / "cgroup.procs").write_text(str(p.pid))
        assert cg.holds(p.pid, rel) and not cg.holds(p.pid, other)
        memory = CGROUP_ROOT / "memory" / rel.lstrip("/")
        memory.rename(memory.with_name("a.standby-x"))  # the first of the renames, and no more
        assert not cg.holds(p.pid, rel) and not cg.holds(p.pid, other)
        cg.rename(rel, other)  # the rest, as the rename would have
        assert cg.holds(p.pid, other) and not cg.holds(p.pid, rel)
        assert not cg.holds(os.getpid(), other)  # (this process: in none of ours)
    finally:
        p.kill()
        p.wait()
        for name in (rel, other):
            assert wait_until(lambda name=name: not cg.procs(name))  # type: ignore[misc]
            cg.remove(name)


def test_remove_takes_a_cgroup_with_its_children_from_every_hierarchy_and_never_a_busy_one(cg: Cgroups) -> None:
    rel = f"{cg.parent}/sb-remove"
    hierarchies = [CGROUP_ROOT / c for c in V1_JOINED if (CGROUP_ROOT / c).is_dir()]
    for h in hierarchies:
        (h / rel.lstrip("/") / "nested" / "deeper").mkdir(parents=True)
    (CGROUP_ROOT / "memory" / rel.lstrip("/") / "sibling").mkdir()
    cg.remove(rel)  # one rmdir fails (children): the walk takes them, deepest first
    assert not cg.exists(rel)
    assert not any((h / rel.lstrip("/")).exists() for h in hierarchies)

    for h in hierarchies:
        (h / rel.lstrip("/")).mkdir()
    pids = CGROUP_ROOT / "pids" / rel.lstrip("/")
    busy = subprocess.Popen(["sleep", "30"])
    try:
        (pids / "cgroup.procs").write_text(str(busy.pid))
        with pytest.raises(OSError):
            cg.remove(rel)  # a task inside: EBUSY, not hidden
        assert pids.is_dir() and cg.holds(busy.pid, rel)
    finally:
        busy.kill()
        busy.wait()
    assert wait_until(lambda: not cg.procs(rel) and not (pids / "cgroup.procs").read_text().split())
    cg.remove(rel)
    assert not cg.exists(rel)


# Run in a mount namespace of its own: the probe mounts never reach the host's table.
_FAVOR_PROBE = """
import json, tempfile
from sandfleet.runtime import cgroups, mounts
def remount(options):
    with tempfile.TemporaryDirectory() as point:
        mounts.mount("cgroup2", point, "cgroup2", 0, ",".join(options) or None)
        mounts.umount(point, lazy=True)
before = cgroups.root_options()
try:
    remount(["memory_localevents"])  # every mount from the host's cgroup namespace sets all root options
    cleared = cgroups.root_options()
    favored = cgroups.favor_moves(cleared)
    after = cgroups.root_options()
    unknown = cgroups.favor_moves(None)  # no cgroup2 in view: the root's options are not guessed
    untouched = cgroups.root_options()
finally:
    remount(before)  # the host's own options back, whatever happened
print(json.dumps({"before": before, "cleared": cleared, "favored": favored, "after": after,
                  "unknown": unknown, "untouched": untouched, "restored": cgroups.root_options()}))
"""


def test_cgroup_moves_are_favoured_and_the_root_s_other_options_kept(daemon: object) -> None:
    """The daemon gives the host's cgroup2 root `favordynmods`: without it the first write to a
    cgroup.procs after an idle spell waits for an RCU grace period (15 ms on this host kind: a lone
    create took 11 ms against 3 ms back to back). Setting it takes a mount of cgroup2, and a mount
    from the host's cgroup namespace sets every root option at once, so the ones the host had
    (systemd's nsdelegate, memory_recursiveprot...) are given again, not dropped."""
    options = cgroups.root_options()
    if options is None:
        pytest.skip("no cgroup2 mount in view")
    assert cgroups.FAVOR_MOVES in options, options  # the session's daemon set it
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", _FAVOR_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    seen = json.loads(out.stdout)
    assert seen["cleared"] == ["memory_localevents"], seen  # (the probe's own step: a mount without it)
    assert seen["favored"] is True
    assert sorted(seen["after"]) == sorted(["memory_localevents", cgroups.FAVOR_MOVES]), seen
    assert seen["unknown"] is False and seen["untouched"] == seen["after"], seen
    assert seen["restored"] == seen["before"], seen


def test_a_sandbox_cannot_change_the_cgroup_root_s_options(sandbox: Any) -> None:
    """The root's options are the host's: a mount of cgroup2 from inside a sandbox, which from the
    host's cgroup namespace would set them all, is refused (and would be in the sandbox's own cgroup
    namespace, where the kernel ignores them anyway)."""
    options = cgroups.root_options()
    if options is None:
        pytest.skip("no cgroup2 mount in view")
    for cmd in ("mkdir -p /tmp/c && mount -t cgroup2 none /tmp/c", "mount -t cgroup2 -o nsdelegate none /tmp/c"):
        r = sandbox.exec(cmd)
        assert r.exit_code != 0, (cmd, r)
    assert cgroups.root_options() == options
    assert " /tmp/c " not in sandbox.exec("cat /proc/mounts").stdout
