"""Escape tests: what sandboxed code can see and touch, always checked against the host's own view.

Every test pairs the assertion about the sandbox with a positive control on the host (the marker
exists, the listener accepts, the host process runs, ...), so a missing isolation layer makes the
test fail instead of passing vacuously. All sandboxes are real busybox containers of the session
daemon; everything a test creates on the host is removed again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shlex
import shutil
import socket
import stat
import struct
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from sandfleet import Client, Mount, Sandbox
from sandfleet.errors import InternalError, InvalidArgumentError, SandboxError, WrongStateError

from conftest import EXPECT, IMAGES, Daemon, agent_pid

T = TypeVar("T")
HOST_SLEEP = str(31000 + os.getpid() % 1000)  # argv of a host process the sandbox must not see
# top-level directories a minimal image may have; anything else in the host's / must not show up inside
IMAGE_DIRS = {"bin", "dev", "etc", "home", "lib", "lib64", "proc", "root", "sys", "tmp", "usr", "var", "sbin", "run",
              "mnt", "opt", "srv", "media"}  # fmt: skip

CAP_NET_ADMIN = 12
CAP_NET_RAW = 13
CAP_SYS_MODULE = 16
CAP_SYS_RAWIO = 17
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_SYS_TIME = 25
CAP_MKNOD = 27


# -- helpers -----------------------------------------------------------------------------------------


def sh(sb: Sandbox, cmd: str, **kw: object) -> tuple[int, str, str]:
    r = sb.exec(cmd, timeout=kw.pop("timeout", 30), **kw)  # type: ignore[arg-type]
    return r.exit_code, r.stdout, r.stderr


def ok(sb: Sandbox, cmd: str, **kw: object) -> str:
    code, out, err = sh(sb, cmd, **kw)
    assert code == 0, f"{cmd!r} failed ({code}): {err}"
    return out


def host_root_of(daemon: Daemon, sandbox_id: str) -> Path:
    """The sandbox's root filesystem as the host reaches it: /proc/<agent pid>/root."""
    return Path(f"/proc/{agent_pid(daemon, sandbox_id)}/root")


def host_pids_by_cmdline(needle: bytes) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if Path(f"/proc/{name}/cmdline").read_bytes() == needle:
                found.append(int(name))
        except OSError:
            continue
    return found


def wait_for(fn: Callable[[], T], timeout: float = 10.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def proc_pids(listing: str) -> set[int]:
    return {int(x) for x in listing.split() if x.isdigit()}


def host_primary_ip() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent; just picks the outgoing address
        except OSError:
            return None
        ip = s.getsockname()[0]
    return None if ip.startswith("127.") else ip


@pytest.fixture(params=["none", "pypi"], ids=["net-none", "net-pypi"])
def sandbox(fleet: Client, request: pytest.FixtureRequest) -> Iterator[Sandbox]:
    """Each escape test on the sandbox runs twice: with no network, and with networking on (an
    egress policy allowing a service: the proxy listens in the sandbox's namespace)."""
    # This file attacks on purpose; the agent is one target (the other detectors must stay quiet).
    with fleet.create(image="busybox", idle_ttl=300, network=request.param, labels={EXPECT: "agent_attack"}) as sb:
        yield sb


@pytest.fixture
def host_sleep() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", HOST_SLEEP])
    yield p
    p.kill()
    p.wait()


@pytest.fixture
def shared(daemon: Daemon) -> Iterator[Path]:
    """A fresh directory under the daemon's mount allowlist, removed afterwards."""
    d = daemon.root / "shared" / f"t-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    yield d
    shutil.rmtree(d)


# -- processes ---------------------------------------------------------------------------------------


def test_cannot_see_host_processes(daemon: Daemon, sandbox: Sandbox, host_sleep: subprocess.Popen[bytes]) -> None:
    host_view = proc_pids(" ".join(os.listdir("/proc")))
    assert daemon.pid in host_view and host_sleep.pid in host_view  # control: the host sees both
    assert len(host_view) > 20

    inside = proc_pids(ok(sandbox, "ls /proc"))
    ps = ok(sandbox, "ps -o pid,args")
    # Only the agent (pid 1), the shell and ls/ps: a handful, numbered from 1 in its own namespace.
    assert 1 in inside and len(inside) <= 5, inside
    assert ok(sandbox, "cat /proc/1/cmdline") == "/proc/self/fd/4\x00"
    assert daemon.pid not in inside and host_sleep.pid not in inside
    assert "serve" not in ps and "python" not in ps and f"sleep {HOST_SLEEP}" not in ps, ps
    # Not even by number: the host pids don't exist in the sandbox's pid namespace.
    code, _, err = sh(sandbox, f"kill -0 {host_sleep.pid} || kill -0 {daemon.pid}")
    assert code != 0, err
    assert host_sleep.poll() is None


def test_cannot_see_host_files(sandbox: Sandbox) -> None:
    tag = f"sandfleet-marker-{uuid.uuid4().hex}"
    markers = [Path("/tmp") / tag, Path("/root") / tag, Path("/") / tag]
    try:
        for m in markers:
            m.write_text("host secret\n")
            assert m.exists()  # control
        for m in markers:
            code, out, _ = sh(sandbox, f"cat {m}")
            assert code != 0 and "host secret" not in out, m
        assert tag not in ok(sandbox, "ls -a / /tmp /root")
        # `/` inside is the image, not the host: this very test file and the host's repo are absent.
        here = Path(__file__).resolve()
        assert here.exists()
        code, _, _ = sh(sandbox, f"test -e {shlex.quote(str(here))} || test -e {shlex.quote(str(here.parent))}")
        assert code != 0
        host_only = set(os.listdir("/")) - IMAGE_DIRS
        assert host_only, "control: the host's / has entries a busybox image lacks"
        assert not host_only & set(ok(sandbox, "ls -a /").split()), host_only
        assert "BusyBox" in ok(sandbox, "ls --help 2>&1 || true")
    finally:
        for m in markers:
            m.unlink(missing_ok=True)


ESCAPE_PROBE = r"""
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
static int err(long rc) { return rc == 0 ? 0 : errno; }
int main(void) {
    /* Namespace and mount calls that could reach what lies under the sandbox's root. */
    int ns = open("/proc/self/ns/mnt", O_RDONLY);
    printf("setns %d\n", err(setns(ns, CLONE_NEWNS)));
    printf("umount %d\n", err(umount2("/", MNT_DETACH)));
    printf("unshare %d\n", err(unshare(CLONE_NEWUSER | CLONE_NEWNS)));
    printf("pivot_root %d\n", err(syscall(SYS_pivot_root, ".", ".")));
    printf("open_tree %d\n", syscall(SYS_open_tree, AT_FDCWD, "/", 1) >= 0 ? 0 : errno);
    /* The classic chroot escape (root keeps CAP_SYS_CHROOT): chroot into a subdirectory, keep a
     * directory outside it, climb with "..", chroot there. */
    mkdir("/escape-jail", 0755);
    int outside = open("/", O_PATH | O_DIRECTORY);
    printf("chroot %d\n", err(chroot("/escape-jail")));
    fchdir(outside);
    for (int i = 0; i < 64; i++)
        chdir("..");
    chroot(".");
    printf("root:");
    DIR *d = opendir("/");
    for (struct dirent *e; d && (e = readdir(d));)
        printf(" %s", e->d_name);
    printf("\n");
    return 0;
}
"""


def test_root_cannot_be_left(daemon: Daemon, sandbox: Sandbox, tmp_path: Path) -> None:
    """The sandbox's root is its rootfs moved over a near-empty template namespace: no namespace or
    mount call gets underneath it, climbing out of a nested chroot ends at the same root, and
    /proc/self/mountinfo shows only the sandbox's own mounts, naming no host path."""
    src, probe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(ESCAPE_PROBE)
    subprocess.run(["gcc", "-O1", "-static", "-o", str(probe), str(src)], check=True)
    sandbox.files.write("/probe", probe.read_bytes(), mode=0o755)
    before = set(ok(sandbox, "ls -a /").split())
    out = dict(line.split(" ", 1) for line in ok(sandbox, "/probe").splitlines())
    for call in ("setns", "umount", "unshare", "pivot_root", "open_tree"):
        assert out[call] != "0", f"{call} succeeded inside the sandbox"
    assert out["chroot"] == "0"  # control: the sandbox's root may chroot, so the climb was really tried
    assert set(out["root:"].split()) == before | {"escape-jail"}
    host_only = set(os.listdir("/")) - IMAGE_DIRS
    assert host_only and not host_only & set(out["root:"].split())

    mountinfo = ok(sandbox, "cat /proc/self/mountinfo")
    assert str(daemon.run_dir) in daemon.mountinfo()  # control: the host's table names the run dir
    for host_path in (str(daemon.run_dir), str(daemon.state_dir), str(IMAGES)):
        assert host_path not in mountinfo
    assert "sandfleet-template" not in mountinfo
    assert [line.split()[4] for line in mountinfo.splitlines()].count("/") == 1


# -- other sandboxes ---------------------------------------------------------------------------------


def test_cannot_see_or_signal_other_sandboxes(fleet: Client) -> None:
    tag = str(27000 + os.getpid() % 1000)
    with fleet.create(image="busybox") as a, fleet.create(image="busybox") as b:
        ok(a, "echo from-a > /secret-a")
        proc = a.start(f"exec sleep {tag}")
        try:
            [host_pid] = wait_for(lambda: host_pids_by_cmdline(f"sleep\x00{tag}\x00".encode()))
            a_view = ok(a, "ps -o pid,args")
            assert f"sleep {tag}" in a_view  # control: A sees its own process

            assert f"sleep {tag}" not in ok(b, "ps -o pid,args")
            assert proc_pids(ok(b, "ls /proc")) <= {1, *range(2, 10)}
            code, out, _ = sh(b, "cat /secret-a")
            assert code != 0 and "from-a" not in out
            # B cannot signal A's sleep by its host pid (it does not exist in B's pid namespace).
            code, _, _ = sh(b, f"kill -9 {host_pid}")
            assert code != 0
            assert Path(f"/proc/{host_pid}").exists(), "B killed a process of A"
            assert f"sleep {tag}" in ok(a, "ps -o pid,args")

            ha, hb = ok(a, "hostname").strip(), ok(b, "hostname").strip()
            assert ha and hb and ha != hb
            assert (ha, hb) == (a.id, b.id)
            assert ok(a, "cat /secret-a") == "from-a\n"
        finally:
            proc.kill()


# -- network -----------------------------------------------------------------------------------------


def test_network_is_loopback_only(sandbox: Sandbox) -> None:
    host_ifaces = set(os.listdir("/sys/class/net"))
    assert host_ifaces - {"lo"}, "control: the host has a real interface"

    dev = ok(sandbox, "cat /proc/net/dev")
    ifaces = {line.split(":")[0].strip() for line in dev.splitlines()[2:]}
    assert ifaces == {"lo"}, dev
    assert ok(sandbox, "ls /sys/class/net").split() == ["lo"]
    links = ok(sandbox, "ip -o link")
    assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"], links

    with socket.create_server(("0.0.0.0", 0)) as listener:
        port = listener.getsockname()[1]
        targets = ["127.0.0.1"]
        ip = host_primary_ip()
        if ip:
            targets.append(ip)
        for t in targets:  # control: the listener is reachable from the host on every address
            with socket.create_connection((t, port), timeout=2):
                pass
            conn, _ = listener.accept()
            conn.close()
        for t in targets:
            code, out, err = sh(sandbox, f"echo hello | nc -w 2 {t} {port}; echo rc=$?")
            assert "rc=0" not in out, (t, out, err)
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing from the sandbox ever arrived

    # DNS and outbound connections fail (busybox wget segfaults in Debian's 1.35 build, even on the host: use nc)
    for cmd in ("nslookup -timeout=2 example.com", "nslookup -timeout=2 example.com 8.8.8.8"):
        code, out, err = sh(sandbox, cmd)
        assert code != 0 and "Address" not in out.split("\n\n", 1)[-1], (cmd, out, err)
    for target in ("1.1.1.1 80", "8.8.8.8 53", "192.0.2.1 80"):
        code, out, err = sh(sandbox, f"nc -w 2 {target} </dev/null")
        assert code != 0 and "Network is unreachable" in err, (target, err)


def test_abstract_and_daemon_unix_sockets_are_out_of_reach(daemon: Daemon, sandbox: Sandbox) -> None:
    name = f"sandfleet-test-{uuid.uuid4().hex[:12]}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as abstract:
        abstract.bind("\0" + name)
        abstract.listen()
        host_unix = Path("/proc/net/unix").read_text()
        assert str(daemon.socket) in host_unix and "@" + name in host_unix  # control
        inside = ok(sandbox, "cat /proc/net/unix")
        assert str(daemon.socket) not in inside and name not in inside
    assert daemon.socket.exists()
    code, _, _ = sh(sandbox, f"test -e {daemon.socket} || ls {daemon.socket.parent}")
    assert code != 0
    code, _, _ = sh(sandbox, f"test -e {daemon.state_dir} || test -e {daemon.run_dir}")
    assert code != 0


# -- user namespace ----------------------------------------------------------------------------------


def test_root_inside_is_unprivileged_outside(daemon: Daemon, fleet: Client, shared: Path) -> None:
    host_file = shared / "owned-by-host-root"
    host_file.write_text("host original\n")
    os.chown(host_file, 0, 0)
    os.chmod(host_file, 0o644)
    rw_dir = shared / "rw"
    rw_dir.mkdir()
    os.chmod(rw_dir, 0o777)
    mounts = [
        Mount(source=str(host_file), target="/host/file", read_only=False),
        Mount(source=str(rw_dir), target="/host/dir", read_only=False),
    ]
    with fleet.create(image="busybox", mounts=mounts) as sb:
        assert ok(sb, "cat /proc/self/uid_map").split() == ["0", "100000", "65536"]
        assert ok(sb, "cat /proc/self/gid_map").split() == ["0", "100000", "65536"]
        assert ok(sb, "id -u").strip() == "0"

        assert ok(sb, "cat /host/file") == "host original\n"  # control: the mount is there
        code, _, err = sh(sb, "echo pwned > /host/file")
        assert code != 0 and "Permission denied" in err, err
        code, _, err = sh(sb, "echo pwned >> /host/file")
        assert code != 0 and "Permission denied" in err, err
        code, _, _ = sh(sb, "chmod 666 /host/file || chown 0 /host/file")
        assert code != 0
        assert host_file.read_text() == "host original\n"
        st = host_file.stat()
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, 0, 0o644)
        # host root is unmapped inside: it shows as the overflow id
        assert ok(sb, "stat -c %u /host/file").strip() == "65534"

        ok(sb, "echo made-inside > /host/dir/created && echo x > /made-in-root")
        created = rw_dir / "created"
        assert created.read_text() == "made-inside\n"
        assert (created.stat().st_uid, created.stat().st_gid) == (100000, 100000)
        in_root = host_root_of(daemon, sb.id) / "made-in-root"
        assert (in_root.stat().st_uid, in_root.stat().st_gid) == (100000, 100000)
        # and a file made by uid 1000 inside is host uid 101000
        ok(sb, "echo u > /host/dir/by-user", user="1000")
        assert (rw_dir / "by-user").stat().st_uid == 101000


def test_read_only_mount_is_read_only(fleet: Client, shared: Path) -> None:
    os.chmod(shared, 0o777)  # writable by anyone on the host: only the mount flag stops the sandbox
    (shared / "f").write_text("orig\n")
    os.chmod(shared / "f", 0o666)
    with fleet.create(image="busybox", mounts=[Mount(source=str(shared), target="/ro", read_only=True)]) as sb:
        assert ok(sb, "cat /ro/f") == "orig\n"
        for cmd in ("echo x > /ro/f", "echo x > /ro/new", "mkdir /ro/d", "rm /ro/f", "chmod 600 /ro/f"):
            code, _, err = sh(sb, cmd)
            assert code != 0 and "Read-only file system" in err, (cmd, err)
        opts = [ln.split()[3] for ln in ok(sb, "cat /proc/mounts").splitlines() if ln.split()[1] == "/ro"]
        assert len(opts) == 1 and {"ro", "nosuid", "nodev"} <= set(opts[0].split(",")), opts
    assert sorted(os.listdir(shared)) == ["f"] and (shared / "f").read_text() == "orig\n"


def test_mount_allowlist(daemon: Daemon, fleet: Client, shared: Path) -> None:
    (shared / "to-etc").symlink_to("/etc")
    sandboxes_dir = daemon.run_dir / "sandboxes"
    cg = Path("/sys/fs/cgroup/pids") / daemon.cgroup_parent

    def snapshot() -> tuple[set[str], set[str], set[str]]:
        return (
            {s.id for s in fleet.list()},
            set(os.listdir(sandboxes_dir)) if sandboxes_dir.exists() else set(),
            {p.name for p in cg.iterdir() if p.is_dir()} if cg.exists() else set(),
        )

    sibling = daemon.root / "shared-sibling"  # shares a prefix with the allowlisted dir but is not under it
    sibling.mkdir()
    before = snapshot()
    bad_sources = ["/etc", "/", str(shared / "to-etc"), str(shared / ".." / ".." / ".." / "etc"), str(sibling),
                   str(daemon.state_dir)]  # fmt: skip
    try:
        for source in bad_sources:
            with pytest.raises(InvalidArgumentError):
                fleet.create(image="busybox", mounts=[Mount(source=source, target="/x", read_only=True)])
    finally:
        sibling.rmdir()
    assert snapshot() == before
    # control: a source under the allowlist is accepted
    with fleet.create(image="busybox", mounts=[Mount(source=str(shared), target="/x")]) as sb:
        assert ok(sb, "ls -a /x").split()[:2] == [".", ".."]


def test_mount_allowlist_cannot_be_raced_by_a_sandbox(fleet: Client, shared: Path) -> None:
    """Sandbox A (rw mount of an allowlisted dir) flips `p` between a real dir and a symlink to a host dir
    outside the allowlist while the client creates sandboxes mounting `p`. No sandbox may ever see the host dir."""
    victim = Path(f"/tmp/sandfleet-victim-{uuid.uuid4().hex[:8]}")
    victim.mkdir()
    (victim / "HOST-ONLY").write_text("host\n")
    os.chmod(shared, 0o777)
    (shared / "p").mkdir(mode=0o777)
    try:
        with fleet.create(image="busybox", mounts=[Mount(source=str(shared), target="/h", read_only=False)]) as a:
            ok(a, f"ln -s {victim} /h/l")
            flipper = a.start("cd /h; while :; do mv p q; mv l p; mv p l; mv q p; done")
            try:
                leaked = []
                for _ in range(300):
                    try:
                        with fleet.create(image="busybox", mounts=[Mount(source=str(shared / "p"), target="/x")]) as b:
                            if "HOST-ONLY" in ok(b, "ls /x"):
                                leaked.append(b.id)
                                break
                    except (InvalidArgumentError, InternalError):
                        continue  # lost the race: the check or crun found the symlink or nothing at `p`
            finally:
                flipper.kill()
        assert not leaked, f"sandbox {leaked} got {victim} mounted"
    finally:
        shutil.rmtree(victim)


# -- /proc and capabilities --------------------------------------------------------------------------


def test_proc_hardening(sandbox: Sandbox) -> None:
    assert Path("/sys/kernel/vmcoreinfo").read_text().strip()  # control: the host's is not empty
    for path in ("/proc/kpagecgroup", "/proc/kpageflags", "/proc/kpagecount", "/proc/kcore", "/proc/keys",
                 "/proc/sysrq-trigger", "/proc/timer_list", "/sys/kernel/vmcoreinfo"):  # fmt: skip
        code, out, _ = sh(sandbox, f"head -c 64 {path} | wc -c")
        assert out.strip() == "0", (path, out)
    # a recursive grep over the masked files terminates quietly
    code, out, err = sh(sandbox, "grep -r x /proc/kpagecgroup /proc/kpageflags /proc/kpagecount", timeout=10)
    assert code == 1 and out == "", (code, out, err)
    host_name = socket.gethostname()
    code, _, err = sh(sandbox, "echo evil > /proc/sys/kernel/hostname")
    assert code != 0 and "Read-only" in err, err
    code, _, _ = sh(sandbox, "sysctl -w kernel.hostname=evil || echo 1 > /proc/sys/vm/drop_caches")
    assert code != 0
    code, _, _ = sh(sandbox, "echo c > /proc/sysrq-trigger && cat /proc/sysrq-trigger | grep c")
    assert code != 0
    assert socket.gethostname() == host_name
    assert ok(sandbox, "hostname").strip() == sandbox.id
    # the cgroup tree is masked too
    assert ok(sandbox, "ls -A /sys/fs/cgroup 2>/dev/null | wc -l").strip() == "0"
    # /sys is read-only, cannot be made writable, and shows no host network device
    assert ok(sandbox, "ls /sys/class/net").split() == ["lo"]
    code, _, err = sh(sandbox, "echo 1 > /sys/kernel/mm/ksm/run || mount -o remount,rw /sys")
    assert code != 0, err
    assert ok(sandbox, "grep ' /sys ' /proc/self/mountinfo").split()[5].startswith("ro")


def _caps(status: str, field: str) -> int:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"{field} missing")


def test_capabilities_and_no_new_privs(sandbox: Sandbox) -> None:
    host = Path("/proc/self/status").read_text()
    assert _caps(host, "CapEff") >> CAP_SYS_ADMIN & 1  # control: the parsing sees root's caps
    status = ok(sandbox, "cat /proc/self/status")
    forbidden = (CAP_SYS_ADMIN, CAP_NET_RAW, CAP_SYS_PTRACE, CAP_SYS_MODULE, CAP_NET_ADMIN, CAP_SYS_RAWIO,
                 CAP_SYS_TIME, CAP_MKNOD)  # fmt: skip
    for field in ("CapEff", "CapPrm", "CapBnd", "CapInh", "CapAmb"):
        caps = _caps(status, field)
        assert not [c for c in forbidden if caps >> c & 1], (field, hex(caps))
    assert "NoNewPrivs:\t1" in status and "Seccomp:\t2" in status, status

    for cmd in ("mount -t tmpfs x /mnt", "mount --bind /bin /mnt", "unshare -U true", "unshare -m true",
                "unshare -n true", "nsenter -t 1 -m true", "mknod /tmp/mem c 1 1", "umount /proc"):  # fmt: skip
        code, _, err = sh(sandbox, cmd)
        assert code != 0, (cmd, err)
    assert " /mnt " not in ok(sandbox, "cat /proc/mounts")


def test_agent_channel_out_of_reach(sandbox: Sandbox) -> None:
    # control: ordinary processes' fds and environ are readable by root inside
    assert ok(sandbox, "readlink /proc/self/fd/1").startswith("pipe:")
    ok(sandbox, "sleep 30 & p=$!; cat /proc/$p/environ >/dev/null && readlink /proc/$p/fd/1; kill $p")

    for cmd in ("readlink /proc/1/fd/3", "readlink /proc/1/fd/4", "cat /proc/1/environ", "head -c 1 /proc/1/mem",
                "readlink /proc/1/root", "readlink /proc/1/exe", "ls /proc/1/root/", "cat /proc/1/fd/4"):  # fmt: skip
        for user in ("root", "65534"):
            code, out, err = sh(sandbox, cmd, user=user)
            assert code != 0 and out == "", (cmd, user, out)
            if not cmd.startswith("readlink"):  # busybox readlink fails silently
                assert "denied" in err or "not permitted" in err, (cmd, user, err)
    code, out, err = sh(sandbox, "ls -l /proc/1/fd")
    assert "Permission denied" in err and "socket:" not in out, (out, err)
    # the agent (pid 1 of the namespace) ignores signals from inside, so the sandbox keeps working
    sh(sandbox, "kill -TERM 1; kill -KILL 1; kill -INT 1")
    assert ok(sandbox, "echo alive") == "alive\n"


# -- files API ---------------------------------------------------------------------------------------


def test_files_api_symlinks_never_reach_host(daemon: Daemon, sandbox: Sandbox) -> None:
    name = f"sandfleet-secret-{uuid.uuid4().hex}"
    secret = Path("/tmp") / name
    victim = Path("/tmp") / (name + "-victim")
    secret.write_text("HOST SECRET\n")
    try:
        ok(sandbox, f"ln -s /tmp/{name} /abs && ln -s ../../../../../../../tmp/{name} /tmp/rel && ln -s / /rootlink"
                    f" && ln -s /proc/{daemon.pid}/root/tmp/{name} /viaproc && ln -s /proc/1/root/tmp/{name} /magic"
                    f" && ln -s {victim} /writelink && ln -s /tmp /tmpdir")  # fmt: skip
        paths = ["/abs", "/tmp/rel", f"/rootlink/../../../tmp/{name}", "/viaproc", "/magic", f"/../../../../tmp/{name}",
                 f"/tmpdir/{name}", f"/tmpdir/../../tmp/{name}", f"/rootlink/tmp/{name}"]  # fmt: skip
        for p in paths:
            try:
                data = sandbox.files.read(p)
            except SandboxError:
                continue
            assert b"HOST SECRET" not in data, p
        # With a same-named file inside, the symlinks resolve to it: resolution happens in the sandbox's root.
        sandbox.files.write(f"/tmp/{name}", "sandbox copy\n")
        for p in ("/abs", "/tmp/rel", f"/rootlink/tmp/{name}", f"/tmpdir/{name}"):
            assert sandbox.files.read(p) == b"sandbox copy\n", p
        listing = {f.name for f in sandbox.files.list("/rootlink")}
        assert "abs" in listing and "work" not in listing
        # writes through a symlink to a host path land inside the sandbox, never on the host
        sandbox.files.write("/writelink", "written\n")
        assert not victim.exists()
        assert ok(sandbox, f"cat {victim}") == "written\n"
        assert secret.read_text() == "HOST SECRET\n"
    finally:
        secret.unlink(missing_ok=True)
        victim.unlink(missing_ok=True)


def test_sandbox_signal_does_not_reach_host(host_sleep: subprocess.Popen[bytes], sandbox: Sandbox) -> None:
    # `kill -1` (everything we may signal) as root inside must only hit the sandbox's own processes.
    sh(sandbox, "kill -9 -1")
    assert host_sleep.poll() is None
    os.kill(host_sleep.pid, 0)
    assert ok(sandbox, "echo alive") == "alive\n"


def test_host_device_nodes_keep_owner_and_mode(fleet: Client) -> None:
    """The sandbox's /dev/null is the host's node, bound in: neither creating a sandbox nor root
    inside may change the host's owner or mode (crun 1.8.1 chowns it to the sandbox root)."""
    before = {dev: os.stat(f"/dev/{dev}") for dev in ("null", "zero", "urandom", "tty")}
    with fleet.create(image="busybox") as sb:
        assert ok(sb, "echo hi > /dev/null && head -c 4 /dev/zero | wc -c").strip() == "4"
        for dev in before:
            code, _, err = sh(sb, f"chmod 000 /dev/{dev} || chown 0:0 /dev/{dev}")
            assert code != 0, (dev, err)
        code, _, _ = sh(sb, "mknod /tmp/mem c 1 1")
        assert code != 0
    for dev, st in before.items():
        now = os.stat(f"/dev/{dev}")
        assert (now.st_uid, now.st_gid, now.st_mode) == (st.st_uid, st.st_gid, st.st_mode), dev


def test_sandbox_mounts_never_enter_the_daemons_mount_table(daemon: Daemon, fleet: Client, shared: Path) -> None:
    """Each sandbox's scratch, overlay and bind mounts exist only in its own mount namespace, so the
    daemon's table (copied by every new namespace) does not grow with the number of sandboxes."""
    baseline = len(daemon.mountinfo().splitlines())
    sandboxes = [
        fleet.create(image="busybox", mounts=[Mount(source=str(shared), target="/data", read_only=True)])
        for _ in range(8)
    ]
    try:
        for sb in sandboxes:
            assert ok(sb, "grep -c ' /data ' /proc/self/mountinfo").strip() == "1"
        assert len(daemon.mountinfo().splitlines()) <= baseline + 1  # at most the busybox layer, once
        assert str(daemon.run_dir / "sandboxes") not in daemon.mountinfo()
    finally:
        for sb in sandboxes:
            sb.stop()


def test_bind_target_that_cannot_take_the_mount_is_invalid_and_leaves_nothing(
    daemon: Daemon, fleet: Client, shared: Path
) -> None:
    sandboxes_dir = daemon.run_dir / "sandboxes"
    cg = Path("/sys/fs/cgroup/pids") / daemon.cgroup_parent
    before = set(os.listdir(sandboxes_dir)), {p.name for p in cg.iterdir() if p.is_dir()} if cg.exists() else set()
    # a directory onto a file of the image
    with pytest.raises(InvalidArgumentError, match="/bin/busybox"):
        fleet.create(image="busybox", mounts=[Mount(source=str(shared), target="/bin/busybox")])
    after = set(os.listdir(sandboxes_dir)), {p.name for p in cg.iterdir() if p.is_dir()} if cg.exists() else set()
    assert after == before


def test_no_controlling_terminal_and_noexec_shm(sandbox: Sandbox) -> None:
    """The sandbox's init leads a session of its own: /dev/tty reaches no terminal of the host's
    (the daemon may run in an operator's shell). /dev/shm is noexec, as in crun."""
    assert ok(sandbox, "cut -d' ' -f6 /proc/1/stat").strip() == "1"  # init is its own session leader
    code, _, err = sh(sandbox, "echo x > /dev/tty")
    assert code != 0 and "No such device" in err, err
    code, _, err = sh(sandbox, "cp /bin/busybox /dev/shm/bb && /dev/shm/bb true")
    assert code != 0 and "denied" in err, err
    assert ok(sandbox, "echo data > /dev/shm/f && cat /dev/shm/f") == "data\n"  # still a place for data


@pytest.mark.parametrize("target", ["/", "/proc", "/proc/sys", "/sys/kernel", "/dev", "/dev/shm", "/x/../dev"])
def test_bind_targets_reserved_for_the_sandbox_itself(fleet: Client, shared: Path, target: str) -> None:
    with pytest.raises(ValueError, match="mount target"):  # the SDK refuses it locally ...
        Mount(source=str(shared), target=target)
    unchecked = Mount.model_construct(source=str(shared), target=target, read_only=True)
    with pytest.raises(InvalidArgumentError, match="mount target"):  # ... and so does the daemon
        fleet.create(image="busybox", mounts=[unchecked])


def test_bind_targets_through_image_symlinks(fleet: Client, shared: Path) -> None:
    """A target is checked where it resolves inside the image: an image's symlink cannot aim a bind
    at /, /dev, /dev/shm, /proc/sys or a bound device node, with or without a trailing slash."""
    (shared / "marker").write_text("shared\n")
    with fleet.create(image="busybox") as sb:
        ok(sb, "mkdir -p /mnt /srv/ok && ln -s /dev/shm /mnt/shm && ln -s /proc/sys /mnt/psys && ln -s / /mnt/root")
        ok(sb, "ln -s /srv/ok /mnt/fine && ln -s /dev/null /mnt/null && touch /srv/file && ln -s /srv/file /mnt/file")
        sb.pack("t/symlinks:1")
    try:
        for target in ("/mnt/shm", "/mnt/shm/", "/mnt/psys", "/mnt/root", "/mnt/root/", "/mnt/root/dev"):
            with pytest.raises(InvalidArgumentError, match="mount target"):
                fleet.create(image="t/symlinks:1", mounts=[Mount(source=str(shared), target=target)])
        with pytest.raises(InvalidArgumentError, match="mount target"):  # a file onto a bound device node
            fleet.create(image="t/symlinks:1", mounts=[Mount(source=str(shared / "marker"), target="/mnt/null")])
        # Controls: a symlink to an ordinary directory or file is followed, and the bind works.
        with fleet.create(
            image="t/symlinks:1",
            mounts=[Mount(source=str(shared), target="/mnt/fine", read_only=True)],
        ) as sb:
            assert ok(sb, "cat /srv/ok/marker") == "shared\n"
        with pytest.raises(InvalidArgumentError, match="mount target"):  # a file target must not be a symlink
            fleet.create(image="t/symlinks:1", mounts=[Mount(source=str(shared / "marker"), target="/mnt/file")])
        with fleet.create(
            image="t/symlinks:1",
            mounts=[Mount(source=str(shared / "marker"), target="/srv/file", read_only=True)],
        ) as sb:
            assert ok(sb, "cat /srv/file") == "shared\n"
    finally:
        fleet.delete_image("t/symlinks:1")


def test_launcher_restarts_if_it_dies(daemon: Daemon, fleet: Client) -> None:
    servers = [
        int(pid)
        for pid in os.listdir("/proc")
        if pid.isdigit() and _ppid(int(pid)) == daemon.pid and _cmdline(int(pid))[1:2] == ["--serve"]
    ]
    assert len(servers) == 1, servers
    os.kill(servers[0], 9)
    with fleet.create(image="busybox") as sb:
        assert ok(sb, "echo alive") == "alive\n"


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rfind(")") + 2 :].split()[1])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")
    except OSError:
        return []


# -- snapshot and fork: criu never acts on host paths a sandbox chose ---------------------------------

HOLDER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
/* holder OP PATH ...: opens each PATH at the next fd from 3 (w: create and write "data", f: a FIFO
 * read-write, p: the symlink itself (O_PATH), d: a directory), touches /tmp/held, then waits. */
int main(int argc, char **argv) {
    for (int i = 1; i + 1 < argc; i += 2) {
        int fd;
        if (argv[i][0] == 'w') {
            fd = open(argv[i + 1], O_CREAT | O_RDWR | O_TRUNC, 0644);
            if (fd >= 0 && write(fd, "data\n", 5) != 5)
                return 2;
        } else if (argv[i][0] == 'f') {
            fd = open(argv[i + 1], O_RDWR);
        } else if (argv[i][0] == 'p') {
            fd = open(argv[i + 1], O_PATH | O_NOFOLLOW);
        } else {
            fd = open(argv[i + 1], O_RDONLY | O_DIRECTORY);
        }
        if (fd < 0) {
            perror(argv[i + 1]);
            return 1;
        }
    }
    close(open("/tmp/held", O_CREAT | O_WRONLY, 0644));
    for (;;)
        pause();
}
"""

# inotify events that mean "something was made, changed or removed here"
_IN_CHANGES = 0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800
_libc = ctypes.CDLL(None, use_errno=True)


class DirWatch:
    """Every change in one host directory, even one undone a moment later (criu removes the ghost
    files it made once the restore is over)."""

    def __init__(self, path: Path) -> None:
        self.fd = _libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert _libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_CHANGES) >= 0

    def events(self) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        while True:
            try:
                buf = os.read(self.fd, 65536)
            except BlockingIOError:
                return out
            pos = 0
            while pos < len(buf):
                _wd, mask, _cookie, size = struct.unpack_from("iIII", buf, pos)
                name = buf[pos + 16 : pos + 16 + size].rstrip(b"\0").decode(errors="replace")
                out.append((mask, name))
                pos += 16 + size

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture(scope="module")
def holder(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    d = tmp_path_factory.mktemp("holder")
    (d / "holder.c").write_text(HOLDER)
    subprocess.run(["gcc", "-O1", "-static", "-o", str(d / "holder"), str(d / "holder.c")], check=True)
    return (d / "holder").read_bytes()


@pytest.fixture
def victim_dir() -> Iterator[Path]:
    """A host directory like /tmp (anyone may create files, sticky), holding one root-only file:
    what a sandbox must never touch."""
    d = Path(tempfile.mkdtemp(prefix="sandfleet-victim-"))
    os.chmod(d, 0o1777)
    victim = d / f"victim-{uuid.uuid4().hex[:8]}"
    victim.write_text("host data\n")
    os.chmod(victim, 0o600)
    yield d
    shutil.rmtree(d)


def _hold(sb: Sandbox, holder: bytes, setup: str, args: str, then: str) -> None:
    """Run the holder in the background (opened files at fds 3..), then change the tree under it."""
    sb.files.write("/holder", holder, mode=0o755)
    ok(sb, f"rm -f /tmp/held; {setup}")
    sb.start(f"exec /holder {args}")
    assert wait_for(lambda: sh(sb, "test -e /tmp/held")[0] == 0), "the holder did not start"
    ok(sb, then)


def _ghost_variants(victim_dir: Path) -> dict[str, tuple[str, str, str]]:
    host = str(victim_dir)
    climb = "../" * 24 + host.lstrip("/")  # from anywhere, relative, to the victim directory
    victim = next(victim_dir.iterdir()).name
    return {
        # a deleted file whose directory became an absolute symlink to a host directory
        "absolute-symlink": ("mkdir -p /tmp/d", "w /tmp/d/F", f"rm -rf /tmp/d && ln -s {host} /tmp/d"),
        # the same through a relative symlink that climbs out of wherever criu assembles the tree
        "relative-symlink": ("mkdir -p /tmp/d", "w /tmp/d/F", f"rm -rf /tmp/d && ln -s {climb} /tmp/d"),
        # a deleted FIFO: criu mknods it
        "fifo-ghost": ("mkdir -p /tmp/d && mkfifo /tmp/d/P", "f /tmp/d/P", f"rm -rf /tmp/d && ln -s {host} /tmp/d"),
        # a deleted symlink (criu recreates it: ghost 1, /tmp/s.cr.1.ghost), and a deleted file whose
        # ghost path runs through it
        "symlink-ghost": (
            f"mkdir -p /tmp/s.cr.1.ghost && ln -s {host} /tmp/s",
            "p /tmp/s w /tmp/s.cr.1.ghost/F",
            "rm -rf /tmp/s /tmp/s.cr.1.ghost",
        ),
        # a deleted directory named like the host file: criu makes it with mkdir -p, fails, and its
        # cleanup unlinks what is there
        "dir-ghost-deletion": (
            f"mkdir -p /tmp/d/{victim}",
            f"d /tmp/d/{victim}",
            f"rm -rf /tmp/d && ln -s {host} /tmp/d",
        ),
    }


@pytest.mark.parametrize(
    "variant", ["absolute-symlink", "relative-symlink", "fifo-ghost", "symlink-ghost", "dir-ghost-deletion"]
)
def test_fork_refuses_deleted_files_criu_would_recreate_through_a_symlink(
    sandbox: Sandbox, holder: bytes, victim_dir: Path, variant: str
) -> None:
    """criu recreates a deleted file that is still open ("ghost") by path, as host root, before it
    enters the sandbox's mount namespace, and unlinks it again afterwards: a symlink the sandbox
    planted on that path would point both at the host. The snapshot is refused instead, with a
    typed error naming the file, and nothing on the host is made, changed or removed."""
    setup, args, then = _ghost_variants(victim_dir)[variant]
    _hold(sandbox, holder, setup, args, then)
    before = {p.name: (p.lstat(), p.read_bytes()) for p in victim_dir.iterdir()}
    watch = DirWatch(victim_dir)
    try:
        try:
            outcome: list[Sandbox | SandboxError] | SandboxError = sandbox.fork(1)
        except SandboxError as exc:
            outcome = exc
        events = watch.events()
    finally:
        watch.close()
        for child in outcome if isinstance(outcome, list) else []:
            if isinstance(child, Sandbox):
                child.stop()
    after = {p.name: (p.lstat(), p.read_bytes()) for p in victim_dir.iterdir()}
    assert not events, f"the host directory changed during the fork: {events}"
    assert after.keys() == before.keys()
    for name, (st, data) in before.items():
        assert (after[name][0].st_mode, after[name][0].st_uid, after[name][1]) == (st.st_mode, st.st_uid, data)
    assert isinstance(outcome, WrongStateError), outcome
    assert "deleted" in outcome.message and ("/tmp/d" in outcome.message or "/tmp/s" in outcome.message)
    assert ok(sandbox, "echo still here") == "still here\n"  # the refusal left the sandbox running
    with pytest.raises(WrongStateError, match="deleted"):
        sandbox.snapshot()


def test_fork_carries_deleted_files_that_are_still_open(sandbox: Sandbox, holder: bytes) -> None:
    """Control for the refusals above: deleted files, FIFOs and directories still held open, with
    no symlink on their way, fork fine, and the child reads the file through its descriptor."""
    _hold(
        sandbox,
        holder,
        "mkdir -p /tmp/d /tmp/e/sub && mkfifo /tmp/d/P",
        "w /tmp/d/F f /tmp/d/P d /tmp/e/sub",
        "rm -rf /tmp/d /tmp/e",
    )
    (child,) = sandbox.fork(1)
    assert isinstance(child, Sandbox), child
    try:
        pid = ok(child, "pidof holder").strip()
        assert ok(child, f"cat /proc/{pid}/fd/3") == "data\n"
        assert ok(child, f"readlink /proc/{pid}/fd/5").strip() == "/tmp/e/sub (deleted)"
        assert sh(child, "ls /tmp/d /tmp/e")[0] != 0  # still deleted in the child
    finally:
        child.stop()


def test_forked_sandbox_mountinfo_names_no_host_path(daemon: Daemon, fleet: Client) -> None:
    """A restored sandbox's mount table is as opaque as a fresh one's: its overlay names its layers
    and writable layer by short relative paths, never the daemon's run directory, a layer file or a
    sandbox directory, and its writable layer shows the same 0700 as a fresh sandbox's."""
    with fleet.create(image="busybox") as parent:
        (child,) = parent.fork(1)
        assert isinstance(child, Sandbox), child
        try:
            fresh, forked = ok(parent, "cat /proc/self/mountinfo"), ok(child, "cat /proc/self/mountinfo")
        finally:
            child.stop()
    assert str(daemon.run_dir) in daemon.mountinfo()  # control: the host's table names the run dir
    for table in (fresh, forked):
        for host_path in (str(daemon.run_dir), str(daemon.state_dir), str(IMAGES), "sha256", "sandboxes",
                          parent.id, child.id, "sandfleet-template"):  # fmt: skip
            assert host_path not in table, (host_path, table)
        scratch = [line.split(" - ")[1] for line in table.splitlines() if " sandfleet-scratch " in line]
        assert scratch and all("mode=700" in opts for opts in scratch), scratch
        roots = [line for line in table.splitlines() if line.split()[4] == "/"]
        assert len(roots) == 1 and " - overlay " in roots[0], roots
    assert "lowerdir=l/0" in forked and "upperdir=s/upper" in forked  # relative to the restore's own dir


USER_COUNTS_PROBE = r"""
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/fanotify.h>
#include <sys/inotify.h>
#include <unistd.h>
/* probe hold inotify|fanotify: take instances until the kernel refuses, print how many and the
 * errno, then keep them. probe one: print the errno (0: fine) of one more of each. */
static int one(int fanotify) {
    int fd = fanotify ? fanotify_init(FAN_CLASS_NOTIF | FAN_REPORT_FID, O_RDONLY) : inotify_init1(IN_CLOEXEC);
    return fd < 0 ? errno : 0;
}
int main(int argc, char **argv) {
    if (argc > 2 && !strcmp(argv[1], "hold")) {
        int fanotify = !strcmp(argv[2], "fanotify"), n = 0, err;
        while ((err = one(fanotify)) == 0 && n < 100000)
            n++;
        printf("%d %d\n", n, err);
        fflush(stdout);
        for (;;)
            pause();
    }
    printf("%d %d\n", one(0), one(1));
    return 0;
}
"""


def _owner_of_userns(pid: int) -> int:
    import fcntl

    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, 0xB704, buf)  # NS_GET_OWNER_UID
        return int.from_bytes(buf, "little")
    finally:
        os.close(fd)


def _hold_all(sb: Sandbox, what: str) -> tuple[int, int]:
    sb.start(f"exec /probe hold {what} > /tmp/held-{what}")
    assert wait_for(lambda: ok(sb, f"cat /tmp/held-{what}").strip(), timeout=20), f"no {what} probe output"
    count, err = ok(sb, f"cat /tmp/held-{what}").split()
    return int(count), int(err)


def _host_can(what: str) -> int:
    """errno of one more inotify instance or fanotify group for host root (this test process); 0: fine."""
    fd = _libc.fanotify_init(0, os.O_RDONLY) if what == "fanotify" else _libc.inotify_init1(os.O_CLOEXEC)
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def test_per_user_kernel_counts_are_each_sandboxs_own(daemon: Daemon, fleet: Client, tmp_path: Path) -> None:
    """The kernel charges a user namespace's per-user counts (inotify instances, fanotify groups,
    ...) to the namespace's owner. Each sandbox's namespace has an owner uid of its own (a forked
    one too), so a sandbox that takes every inotify instance and fanotify group it may have leaves
    the host's root and its siblings theirs."""
    src, probe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(USER_COUNTS_PROBE)
    subprocess.run(["gcc", "-O1", "-static", "-o", str(probe), str(src)], check=True)
    limit = int(Path("/proc/sys/fs/inotify/max_user_instances").read_text())
    groups = int(Path("/proc/sys/fs/fanotify/max_user_groups").read_text())
    with fleet.create(image="busybox") as a, fleet.create(image="busybox") as b:
        for sb in (a, b):
            sb.files.write("/probe", probe.read_bytes(), mode=0o755)
        (c,) = b.fork(1)  # a restored sandbox
        assert isinstance(c, Sandbox), c
        try:
            owners = [_owner_of_userns(agent_pid(daemon, sb.id)) for sb in (a, b, c)]
            assert len(set(owners)) == 3 and all(2_000_000_000 <= o < 2_000_000_000 + (1 << 27) for o in owners)
            assert ok(c, "cat /proc/self/uid_map").split() == ["0", "100000", "65536"]
            for hog in (a, c):
                count, err = _hold_all(hog, "inotify")
                assert err == errno.EMFILE and count >= limit - 4, (hog.id, count, err)  # the whole limit
            count, err = _hold_all(a, "fanotify")
            assert err == errno.EMFILE and count >= groups - 4, (count, err)
            # host root, the sibling and a fresh sandbox still get theirs
            assert _host_can("inotify") == 0 and _host_can("fanotify") == 0
            assert ok(b, "/probe one").split() == ["0", "0"]
            with fleet.create(image="busybox") as d:
                d.files.write("/probe", probe.read_bytes(), mode=0o755)
                assert ok(d, "/probe one").split() == ["0", "0"]
            assert ok(a, "/probe one").split() == [str(errno.EMFILE), str(errno.EMFILE)]  # control: a is out
        finally:
            c.stop()
