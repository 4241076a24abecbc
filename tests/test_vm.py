"""The QEMU tiers end to end, through the SDK: busybox sandboxes in jailed QEMUs (TCG here); the
microvm tier (a container in a VM) and the vm tier (a full VM on a copy-on-write disk)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import Resources
from sandfleet.backends.vm import disks, guest
from sandfleet.errors import SandboxError

from conftest import Daemon, destroy_daemon, make_daemon, wait_until

pytestmark = [pytest.mark.vm]

CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1024**2


def _with_vms(d: Daemon, vm_extra: str = "") -> str:
    """Turn the test config's `[container]` table into `[[backends]]` tables: the container tier
    as before, plus the microvm and vm tiers (sharing a cgroup parent of their own, each tier under
    it in <parent>/<tier>); returns that parent. `vm_extra`: more lines for the vm tier's table."""
    parent = f"/sandfleet-vmtest-{d.root.name}"
    text = d.config.read_text()
    head, container = text.split("[container]\n", 1)
    d.config.write_text(
        head
        + '[[backends]]\ntype = "container"\n'
        + container
        + f'[[backends]]\ntype = "microvm"\ncgroup_parent = "{parent}"\n'
        + f'[[backends]]\ntype = "vm"\ncgroup_parent = "{parent}"\n{vm_extra}'
    )
    return parent


def _daemon_with_vms(name: str, vm_extra: str = "") -> tuple[Daemon, str]:
    if os.geteuid() != 0:
        pytest.skip("the QEMU tiers need root")
    ok, why = guest.usable("qemu-system-x86_64", Path("/opt/sandfleet/guest"))
    if not ok:
        pytest.skip(why)
    d = make_daemon(name)
    return d, _with_vms(d, vm_extra)


@pytest.fixture(scope="module")
def vmd() -> Iterator[tuple[Daemon, str]]:
    d, parent = _daemon_with_vms("vm")
    d.start()
    yield d, parent
    destroy_daemon(d)


def _measured(line: str) -> None:
    """A figure for the report (visible with -s)."""
    sys.stderr.write(f"\n[vm] {line}")


def _cgroup(parent: str, sandbox_id: str) -> str:
    """<parent>/<tier>/<id> (the tier: whichever has it)."""
    for tier in ("microvm", "vm"):
        rel = f"{parent.strip('/')}/{tier}/{sandbox_id}"
        if (CGROUP_ROOT / "pids" / rel).exists():
            return rel
    return f"{parent.strip('/')}/none/{sandbox_id}"


def _cgroup_procs(parent: str, sandbox_id: str) -> list[int]:
    try:
        procs = CGROUP_ROOT / "pids" / _cgroup(parent, sandbox_id) / "cgroup.procs"
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
    """No QEMU, no VM directory (sockets, console log, the vm tier's overlay), no cgroup."""
    return (
        not Path(f"/proc/{qemu_pid}").exists()
        and not any((d.run_dir / tier / sandbox_id).exists() for tier in ("microvm", "vm"))
        and not any(
            (CGROUP_ROOT / c / parent.strip("/") / tier / sandbox_id).exists()
            for c in ("memory", "pids", "cpu")
            for tier in ("microvm", "vm")
        )
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


@pytest.mark.parametrize("tier", ["microvm", "vm"])
def test_restart_adopts_vm(vmd: tuple[Daemon, str], tier: str) -> None:
    d, parent = vmd
    with d.client(timeout=300) as c:
        sb = c.create(backend=tier, image="busybox", idle_ttl=600)
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


# ---- the vm tier: a full VM on a copy-on-write disk ----------------------------------------------


def _jailed_open_inodes(pid: int) -> set[tuple[int, int]]:
    """(dev, ino) of the files a process holds open."""
    out = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            st = os.stat(fd)
        except OSError:
            continue
        out.add((st.st_dev, st.st_ino))
    return out


def test_vm_full_machine(vmd: tuple[Daemon, str]) -> None:
    d, parent = vmd
    with d.client(timeout=300) as c:
        t0 = time.monotonic()
        a = c.create(backend="vm", image="busybox", idle_ttl=600)
        assert a.exec("echo hello").stdout == "hello\n"
        _measured(f"vm create to first exec (base built or reused): {time.monotonic() - t0:.2f}s")
        t0 = time.monotonic()
        b = c.create(backend="vm", image="busybox", idle_ttl=600)
        assert b.exec("echo hello").stdout == "hello\n"
        _measured(f"vm create to first exec (base reused): {time.monotonic() - t0:.2f}s")
        # Real root of the guest: the initial user namespace, mounts allowed.
        assert a.exec("cat /proc/self/uid_map").stdout.split() == ["0", "0", "4294967295"]
        assert (
            a.exec("mkdir -p /mnt/t && mount -t tmpfs none /mnt/t && grep -c ' /mnt/t ' /proc/mounts").stdout == "1\n"
        )
        assert a.exec("grep ' / ' /proc/mounts").stdout.split()[2] == "ext4"
        # One shared base under the image's template disk (what its boot wrote), under both VMs'
        # own qcow2 overlays.
        bases = list((d.state_dir / "vm-disks").glob("*/base.raw"))
        assert len(bases) == 1
        st = os.stat(bases[0])

        def info(disk: Path) -> dict[str, Any]:
            run = subprocess.run(
                ["qemu-img", "info", "-U", "--output=json", str(disk)], capture_output=True, check=True
            )
            return json.loads(run.stdout)  # type: ignore[no-any-return]

        templates = [p for p in (d.state_dir / "vm-templates").glob("*/disk.qcow2")]
        assert templates and all(info(t)["backing-filename"] == "/vm/base" for t in templates)
        for sb in (a, b):
            overlay = info(d.run_dir / "vm" / sb.id / "root.qcow2")
            assert overlay["format"] == "qcow2" and overlay["backing-filename"] == "/vm/snapdisk"
            assert (st.st_dev, st.st_ino) in _jailed_open_inodes(_qemu_pid(parent, sb.id))
        # Writes are each VM's own, and persist across execs.
        a.exec("echo mine > /written && sync")
        assert a.exec("cat /written").stdout == "mine\n"
        assert b.exec("cat /written 2>/dev/null; echo $?").stdout == "1\n"
        # Pause / resume.
        a.pause()
        a.resume()
        assert a.exec("cat /written").stdout == "mine\n"
        qa, qb = _qemu_pid(parent, a.id), _qemu_pid(parent, b.id)
        a.stop()
        b.stop()
        assert wait_until(lambda: _gone(d, parent, a.id, qa) and _gone(d, parent, b.id, qb), timeout=30)
        assert bases[0].exists()  # the base is a cache: it outlives its VMs


@pytest.mark.parametrize("tier", ["microvm", "vm"])
def test_writes_stop_at_the_disk_limit(vmd: tuple[Daemon, str], tier: str) -> None:
    """`resources.disk` bounds what a guest writes: ENOSPC in the guest after about that much (the
    vm tier's root overlay is that much larger than the image's base, and vminit grows the root
    filesystem into it; the microvm's writable layer is a tmpfs of that size), and the vm tier's
    overlay never grows past it on the host."""
    d, _parent = vmd
    with d.client(timeout=300) as c:
        sb = c.create(backend=tier, image="busybox", idle_ttl=600, resources=Resources(disk="64MiB"))
        try:
            r = sb.exec("dd if=/dev/zero of=/fill bs=1M count=200 2>&1; sync; stat -c %s /fill", timeout=300)
            assert "No space left on device" in r.stdout, r.stdout
            written = int(r.stdout.split()[-1])
            assert 60 * MIB <= written <= 80 * MIB, written  # the disk, and a busybox base's few MiB of slack
            if tier == "vm":
                overlay = d.run_dir / "vm" / sb.id / "root.qcow2"
                virtual = json.loads(
                    subprocess.run(
                        ["qemu-img", "info", "-U", "--output=json", str(overlay)], capture_output=True, check=True
                    ).stdout
                )["virtual-size"]
                allocated = overlay.stat().st_blocks * 512
                assert allocated <= virtual <= 64 * MIB + 64 * MIB, (allocated, virtual)
                _measured(f"vm disk=64MiB: {written / MIB:.0f} MiB written, overlay {allocated / MIB:.0f} MiB")
            assert sb.exec("rm /fill && echo ok").stdout == "ok\n"  # the guest goes on
        finally:
            sb.stop()


def test_vm_failed_create_leaves_nothing() -> None:
    """QEMU starts but the agent cannot say hello within start_timeout: nothing may stay."""
    d, parent = _daemon_with_vms("vmfail", "start_timeout = 1.0\n")
    d.start()
    try:
        with d.client(timeout=300) as c, pytest.raises(SandboxError):
            c.create(backend="vm", image="busybox", idle_ttl=600)
        jail_base = 3_000_000 + (1 << 20)  # the vm tier's jail uids (shared with other test daemons: none run here)

        def clean() -> bool:
            if list((d.run_dir / "vm").iterdir()):
                return False
            tier_cgroups = [CGROUP_ROOT / ctl / parent.strip("/") / "vm" for ctl in ("memory", "pids", "cpu")]
            if any(p.is_dir() for d in tier_cgroups for p in d.glob("*")):
                return False
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        if jail_base <= entry.stat().st_uid < jail_base + (1 << 20):
                            return False
                    except OSError:
                        continue
            return True

        assert wait_until(clean, timeout=30)
    finally:
        destroy_daemon(d)


# ---- snapshots: QEMU's migration stream ---------------------------------------------------------


def _vm_residue(d: Daemon, parent: str, tier: str) -> list[str]:
    """What the node still holds of this tier: VM directories, cgroups, QEMU processes."""
    found = [str(p) for p in (d.run_dir / tier).glob("*")]
    found += [
        str(p)
        for ctl in ("memory", "pids", "cpu")
        for p in (CGROUP_ROOT / ctl / parent.strip("/") / tier).glob("*")
        if p.is_dir()
    ]
    base = 3_000_000 + (1 << 20 if tier == "vm" else 0)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if base <= entry.stat().st_uid < base + (1 << 20):
                    found.append(f"pid {entry.name}")
            except OSError:
                continue
    return found


@pytest.mark.parametrize("tier", ["microvm", "vm"])
def test_snapshot_restore_twice_at_once(vmd: tuple[Daemon, str], tier: str) -> None:
    d, parent = vmd
    with d.client(timeout=300) as c:
        sb = c.create(backend=tier, image="busybox", idle_ttl=600)
        try:
            sb.exec("echo parent > /tmp/state; echo p > /tmp/from_parent")
            # (renamed into place: a reader never sees the file empty between truncate and write)
            counter = sb.start("i=0; while true; do i=$((i+1)); echo $i >/tmp/c; mv /tmp/c /tmp/count; sleep 0.1; done")
            time.sleep(1)
            t0 = time.monotonic()
            snap = sb.snapshot()
            _measured(f"{tier} snapshot: {time.monotonic() - t0:.2f}s ({snap.size_bytes / 2**20:.0f} MiB)")
            # The parent keeps running: its counter goes on.
            before = int(sb.exec("cat /tmp/count").stdout)
            time.sleep(0.5)
            assert int(sb.exec("cat /tmp/count").stdout) > before
            t0 = time.monotonic()
            children = c.restore(snap.id, count=2)
            _measured(f"{tier} restore of 2 at once: {time.monotonic() - t0:.2f}s")
            assert all(not isinstance(x, Exception) for x in children), children
            a, b = children
            assert not isinstance(a, Exception) and not isinstance(b, Exception)
            for child in (a, b):
                assert child.exec("cat /tmp/state").stdout == "parent\n"
            # Each its own: writes stay in the child that made them (and the parent sees none).
            a.exec("echo a > /tmp/state")
            b.exec("echo b > /tmp/state")
            assert a.exec("cat /tmp/state").stdout == "a\n"
            assert b.exec("cat /tmp/state").stdout == "b\n"
            assert sb.exec("cat /tmp/state").stdout == "parent\n"
            # A child's own snapshot (vm: its overlay and the snapshot disk beneath it merged onto the
            # base) restores with what the parent and the child wrote.
            a.exec("echo a > /tmp/own")
            snap2 = a.snapshot()
            (grand,) = c.restore(snap2.id)
            assert grand.exec("cat /tmp/state /tmp/own /tmp/from_parent").stdout == "a\na\np\n"
            grand.stop()
            c.delete_snapshot(snap2.id)
            # The counter runs on in each child, and the child keeps the background process.
            n = int(a.exec("cat /tmp/count").stdout)
            time.sleep(0.5)
            assert int(a.exec("cat /tmp/count").stdout) > n
            assert counter.id in {p.id for p in a.processes()}
            qemus = {x.id: _qemu_pid(parent, x.id) for x in (sb, a, b)}
            assert len(set(qemus.values())) == 3
            for x in (a, b):
                x.stop()
            c.delete_snapshot(snap.id)
        finally:
            sb.stop()
        assert wait_until(lambda: not _vm_residue(d, parent, tier), timeout=30), _vm_residue(d, parent, tier)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_microvm_creates_from_its_images_booted_template(vmd: tuple[Daemon, str]) -> None:
    """A microvm create restores its image's booted template (built once, by the first create of
    that image and size) instead of booting. The template's memory file is root's, bound read-only
    into QEMU's jail, and never changes; each VM gets its own hostname, the host's clock and fresh
    kernel entropy, and what one VM writes (into its guest RAM) no other VM sees."""
    d, parent = vmd
    templates = d.state_dir / "microvm-templates"
    with d.client(timeout=300) as c:
        spec = {"backend": "microvm", "image": "busybox", "resources": Resources(memory="160MiB")}
        before = {p.name for p in templates.glob("*") if p.is_dir()}
        t0 = time.monotonic()
        a = c.create(**spec, hostname="alpha")
        _measured(f"microvm first create of a size (boots its template): {time.monotonic() - t0:.2f}s")
        try:
            built = {p.name for p in templates.glob("*") if p.is_dir()} - before
            assert len(built) == 1, built
            tdir = templates / built.pop()
            ram = tdir / "ram"
            digest = _sha256(ram)
            assert (ram.stat().st_uid, ram.stat().st_mode & 0o777) == (0, 0o644)
            t0 = time.monotonic()
            b = c.create(**spec)
            assert b.exec("true").exit_code == 0
            _measured(f"microvm create-to-first-exec from the template: {time.monotonic() - t0:.2f}s")
            try:
                assert {p.name for p in templates.glob("*") if p.is_dir()} - before == {tdir.name}
                assert a.exec("hostname").stdout == "alpha\n"
                assert b.exec("hostname").stdout == f"{b.id}\n"
                for x in (a, b):
                    assert abs(int(x.exec("date +%s").stdout) - time.time()) < 5
                rand = [x.exec("head -c 16 /dev/urandom | od -An -tx1").stdout for x in (a, b)]
                assert rand[0] != rand[1]
                a.exec("echo a > /tmp/mine; dd if=/dev/urandom of=/tmp/big bs=1M count=8 2>/dev/null")
                assert b.exec("cat /tmp/mine").exit_code != 0
                assert a.exec("cat /tmp/mine").stdout == "a\n"
                for x in (a, b):
                    pid = _qemu_pid(parent, x.id)
                    mounts = [m.split() for m in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
                    ram_mounts = [m for m in mounts if m[4] == "/vm/ram"]
                    assert ram_mounts and "ro" in ram_mounts[0][5].split(","), ram_mounts
                    assert os.stat(f"/proc/{pid}").st_uid != 0
                # A snapshot of a VM from a template restores (into anonymous memory) with all it had.
                snap = a.snapshot()
                (child,) = c.restore(snap.id)
                assert child.exec("cat /tmp/mine; hostname").stdout == "a\nalpha\n"
                child.stop()
                c.delete_snapshot(snap.id)
            finally:
                b.stop()
        finally:
            a.stop()
        assert _sha256(ram) == digest
        # A damaged template is built again, not used.
        state = tdir / "state.bin"
        size = state.stat().st_size
        os.truncate(state, size // 2)
        sb = c.create(**spec)
        assert sb.exec("echo ok").stdout == "ok\n"
        sb.stop()
        assert state.stat().st_size > size // 2
    assert wait_until(lambda: not _vm_residue(d, parent, "microvm"), timeout=30), _vm_residue(d, parent, "microvm")


@pytest.mark.parametrize("tier", ["microvm", "vm"])
def test_fork_children_share_the_snapshots_memory(vmd: tuple[Daemon, str], tier: str) -> None:
    """A fork (several restores of one snapshot at once): the snapshot is made a template once,
    each child maps its memory copy-on-write (bound read-only into its jail) and loads only its
    devices (the vm tier: each child's overlay on the snapshot's disk); the children are each
    their own, keep the parent's background process, and the template goes with the snapshot."""
    d, parent = vmd
    templates = d.state_dir / f"{tier}-templates"
    with d.client(timeout=300) as c:
        sb = c.create(backend=tier, image="busybox", idle_ttl=600)
        try:
            sb.exec("echo parent > /tmp/state")
            counter = sb.start("i=0; while true; do i=$((i+1)); echo $i >/tmp/c; mv /tmp/c /tmp/count; sleep 0.1; done")
            snap = sb.snapshot()
            t0 = time.monotonic()
            kids = c.restore(snap.id, count=3)
            _measured(f"{tier} restore of 3 at once through a template of the snapshot: {time.monotonic() - t0:.2f}s")
            assert all(not isinstance(k, Exception) for k in kids), kids
            made = [p for p in templates.glob("snapshot-*") if p.is_dir()]
            assert len(made) == 1, made
            digest = _sha256(made[0] / "ram")
            for i, k in enumerate(kids):
                assert k.exec(f"cat /tmp/state; echo {i} > /tmp/state").stdout == "parent\n"
                assert counter.id in {p.id for p in k.processes()}
                mounts = [
                    m.split() for m in Path(f"/proc/{_qemu_pid(parent, k.id)}/mountinfo").read_text().splitlines()
                ]
                assert [m for m in mounts if m[4] == "/vm/ram" and "ro" in m[5].split(",")]
            for i, k in enumerate(kids):
                assert k.exec("cat /tmp/state").stdout == f"{i}\n"
            assert sb.exec("cat /tmp/state").stdout == "parent\n"
            assert _sha256(made[0] / "ram") == digest
            for k in kids:
                k.stop()
            c.delete_snapshot(snap.id)
            assert not made[0].exists()
            # A fork: the same, with its snapshot and template gone after it.
            t0 = time.monotonic()
            forks = sb.fork(2)
            _measured(f"{tier} fork of 2: {time.monotonic() - t0:.2f}s")
            assert [f.exec("cat /tmp/state").stdout for f in forks] == ["parent\n", "parent\n"]
            assert not list(templates.glob("snapshot-*"))
            for f in forks:
                f.stop()
        finally:
            sb.stop()
    assert wait_until(lambda: not _vm_residue(d, parent, tier), timeout=30), _vm_residue(d, parent, tier)


def test_a_daemon_killed_while_it_builds_a_template_leaves_nothing(vmd: tuple[Daemon, str]) -> None:
    """SIGKILL while the first create of a size boots its template: after the restart neither the
    builder VM (directory, cgroup, QEMU) nor a half-built template is left, and the create (the
    SDK retries it with its idempotency key) builds the template afresh."""
    d, parent = vmd
    templates = d.state_dir / "microvm-templates"
    spec = {"backend": "microvm", "image": "busybox", "resources": Resources(memory="176MiB")}
    made: list[Any] = []

    def create() -> None:
        with d.client(timeout=300) as c:
            made.append(c.create(**spec).id)

    thread = threading.Thread(target=create)
    thread.start()
    assert wait_until(lambda: any((d.run_dir / "microvm").glob("template-*")), timeout=60)
    time.sleep(1.0)  # its QEMU runs
    d.kill()
    builders = [p.name for p in (d.run_dir / "microvm").glob("template-*")]
    d.start()
    thread.join(300)
    assert made, "the retried create did not answer"
    assert not any((d.run_dir / "microvm" / b).exists() for b in builders)
    assert not [p.name for p in templates.glob(".*") if p.is_dir()]
    with d.client(timeout=300) as c:
        sb = c.get(made[0])
        assert sb.exec("echo ok").stdout == "ok\n"
        sb.stop()
    assert wait_until(lambda: not _vm_residue(d, parent, "microvm"), timeout=30), _vm_residue(d, parent, "microvm")


def test_restore_of_incomplete_snapshot_fails_typed(vmd: tuple[Daemon, str]) -> None:
    d, parent = vmd
    with d.client(timeout=300) as c:
        sb = c.create(backend="microvm", image="busybox", idle_ttl=600)
        try:
            snap = sb.snapshot()
        finally:
            sb.stop()
        found = list(d.root.rglob(f"{snap.id}/kernel"))
        assert found, "the snapshot's kernel copy"
        found[0].unlink()
        [child] = c.restore(snap.id)
        assert isinstance(child, SandboxError) and child.code == "data_loss", child
        c.delete_snapshot(snap.id)
    assert wait_until(lambda: not _vm_residue(d, parent, "microvm"), timeout=30), _vm_residue(d, parent, "microvm")


# ---- unit: the image's own kernel ------------------------------------------------------------------


def _fake_kernel_tree(root: Path, version: str, *, absolute_links: bool = False) -> None:
    """A tree with /boot/vmlinuz-V and /lib/modules/V/kernel/<the modules FULL_MODULES need>."""
    (root / "boot").mkdir(parents=True, exist_ok=True)
    (root / "boot" / f"vmlinuz-{version}").write_bytes(b"bzImage " + version.encode())
    mods = root / "usr" / "lib" / "modules" / version
    (mods / "kernel" / "drivers").mkdir(parents=True)
    dep = []
    for name in ("virtio_pci", "virtio_blk", "virtio_console", "virtio_balloon", "virtio_ring"):
        (mods / "kernel" / "drivers" / f"{name}.ko.zst").write_bytes(b"x")
        dep.append(
            f"kernel/drivers/{name}.ko.zst:" + ("" if name == "virtio_ring" else " kernel/drivers/virtio_ring.ko.zst")
        )
    (mods / "modules.dep").write_text("\n".join(dep) + "\n")
    (mods / "modules.builtin").write_text("kernel/fs/ext4/ext4.ko\n")
    if not (root / "lib").exists():
        (root / "lib").symlink_to("/usr/lib" if absolute_links else "usr/lib")


def test_select_image_kernel(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    assert disks.select_kernel(tree) is None  # no kernel: the node's
    (tree / "boot").mkdir()
    (tree / "boot" / "vmlinuz-6.9.0-1-amd64").write_bytes(b"no modules")  # without modules: not usable
    assert disks.select_kernel(tree) is None
    _fake_kernel_tree(tree, "6.1.0-9-amd64", absolute_links=True)
    _fake_kernel_tree(tree, "6.1.0-10-amd64", absolute_links=True)
    found = disks.select_kernel(tree)
    assert found is not None and found[2] == "6.1.0-10-amd64"  # newest by version, not by name
    assert found[1] == tree / "usr" / "lib" / "modules" / "6.1.0-10-amd64"  # /lib -> /usr/lib inside the tree
    dest = tmp_path / "kernel"
    assert disks.extract_kernel(tree, dest)
    kernel = guest.find_kernel(dest)
    assert kernel.version == "6.1.0-10-amd64"
    order = [p.name for p in guest.module_order(kernel, guest.FULL_MODULES)]
    assert order[0] == "virtio_ring.ko.zst" and "virtio_blk.ko.zst" in order and "ext4.ko" not in order


def test_image_kernel_links_stay_in_the_tree(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _fake_kernel_tree(tree, "6.1.0-10-amd64")
    secret = tmp_path / "secret"
    secret.write_text("host file")
    (tree / "boot" / "vmlinuz-6.1.0-10-amd64").unlink()
    (tree / "boot" / "vmlinuz-6.1.0-10-amd64").symlink_to(secret)  # absolute: the tree's /…/secret
    assert disks.select_kernel(tree) is None
    assert disks.resolve_in(tree, "boot/../../../secret") is None
