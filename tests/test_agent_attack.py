"""Attempts on the agent: calls aimed at PID 1 are refused (EPERM) and reported (ALERT).

Two levels. The agent run as PID 1 of a pid namespace of its own on the host, under the launcher's
seccomp filter with the listener at fd 5 (as the launcher hands it over), so the ALERT messages are
seen on the AgentChannel itself. Then real sandboxes of the session daemon: the same calls fail from
inside, the agent keeps working, ptrace of other processes still works, and snapshots still work
(criu cannot dump a listener: the agent closes it before the dump, so afterwards, and in restored
sandboxes, the calls fail with ENOSYS and go unreported).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import Client, Sandbox, SandboxError
from sandfleet.runtime import seccomp
from sandfleet.runtime.agent import AgentChannel, grab_handoff_channel
from sandfleet.runtime.agent_build import build_agent
from sandfleet.runtime.agent_wire import ExitInfo

from conftest import EXPECT

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C"}

# Becomes PID 1 of a new pid namespace (with a private /proc), installs the filter with a listener
# (seccomp(2), SECCOMP_FILTER_FLAG_NEW_LISTENER) at fd 5 and execs the agent, whose channel is fd 3.
# The outer process prints the agent's pid and waits for it.
PID1_HELPER = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
def check(rc, what):
    if rc < 0:
        sys.stderr.write(f"{what}: {os.strerror(ctypes.get_errno())}\n")
        os._exit(3)
    return rc
check(libc.unshare(0x00020000 | 0x20000000), "unshare")  # CLONE_NEWNS | CLONE_NEWPID
pid = os.fork()
if pid:
    os.close(3)  # the channel is the agent's alone: its EOF must mean the agent closed it
    print(pid, flush=True)
    os.waitpid(pid, 0)
    os._exit(0)
check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "make / private")  # MS_REC | MS_PRIVATE
check(libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, None), "mount /proc")
check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
bpf = open(sys.argv[2], "rb").read()
class Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
prog = Prog(len(bpf) // 8, bpf)
fd = check(libc.syscall(317, 1, 8, ctypes.byref(prog)), "seccomp")  # SET_MODE_FILTER, NEW_LISTENER
if fd != 5:
    os.dup2(fd, 5)
    os.close(fd)
os.execv(sys.argv[1], [sys.argv[1]])
"""

# ctypes probes run inside: print the errno name each call ends with ("ok" when it succeeded)
PROBE = r"""
import ctypes, errno, os, signal, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.ptrace.restype = ctypes.c_long
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
def res(rc):
    return "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
what = sys.argv[1]
if what == "attach1":
    print(res(libc.ptrace(16, 1, None, None)))  # PTRACE_ATTACH
elif what == "seize1":
    print(res(libc.ptrace(0x4206, 1, None, None)))  # PTRACE_SEIZE
elif what == "pidfd1":
    print(res(libc.syscall(434, 1, 0)))  # pidfd_open
elif what == "vmread1":
    buf = ctypes.create_string_buffer(8)
    iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
    print(res(libc.syscall(310, 1, iov, 1, iov, 1, 0)))  # process_vm_readv
elif what == "highbits":
    # the kernel reads a pid_t: 1 with the high half of the register set is still pid 1
    print(res(libc.syscall(62, ctypes.c_long(0x700000001), 0)))  # kill
elif what == "attach_child":
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    rc = libc.ptrace(16, child, None, None)
    out = res(rc)
    if rc == 0:
        os.waitpid(child, 0)  # stopped by the attach
        libc.ptrace(17, child, None, None)  # PTRACE_DETACH
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    print(out)
"""


def _test_profile() -> dict[str, Any]:
    """The default profile minus what `unshare --pid --fork --mount-proc` needs (to make a nested
    pid namespace, which a real sandbox cannot)."""
    profile = seccomp.default_profile()
    allowed = {"unshare", "mount", "umount", "umount2"}
    rules = [dict(r, names=[n for n in r["names"] if n not in allowed]) for r in profile["syscalls"]]
    return {**profile, "syscalls": [r for r in rules if r["names"]]}


class Pid1Agent:
    def __init__(self, outer: asyncio.subprocess.Process, pid: int, channel: AgentChannel) -> None:
        self.outer = outer
        self.pid = pid  # as the host sees it
        self.channel = channel
        self.alerts: list[dict[str, Any]] = []
        self.changed = asyncio.Event()
        channel.on_alert = self.record

    def record(self, alert: dict[str, Any]) -> None:
        self.alerts.append(alert)
        self.changed.set()

    async def until(self, predicate: Callable[[], bool], limit: float = 5.0) -> None:
        """Wait for alerts until `predicate` holds (or `limit` seconds pass)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                while not predicate():
                    self.changed.clear()
                    await self.changed.wait()

    async def run(self, argv: list[str], **kw: Any) -> tuple[bytes, bytes, ExitInfo]:
        kw.setdefault("env", ENV)
        proc = await self.channel.start(argv, **kw)
        return await asyncio.wait_for(proc.wait(), 20)

    async def sh(self, script: str, **kw: Any) -> str:
        out, err, info = await self.run(["/bin/sh", "-c", script], **kw)
        assert info.exit_code == 0, (script, out, err)
        return out.decode()

    async def probe(self, what: str, **kw: Any) -> str:
        out, err, info = await self.run([sys.executable, "-I", "-c", PROBE, what], **kw)
        assert info.exit_code == 0, (what, out, err)
        return out.decode().strip()

    async def alerts_settle(self, n: int, limit: float = 5.0) -> list[dict[str, Any]]:
        await self.until(lambda: len(self.alerts) >= n, limit)
        await asyncio.sleep(0.1)  # and nothing more than expected
        return self.alerts


@pytest.fixture(scope="module")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_agent(tmp_path_factory.mktemp("agent-cache"))


@pytest.fixture(scope="module")
def bpf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        bpf = seccomp.compile_bpf(_test_profile())
    except seccomp.SeccompUnavailableError as exc:
        pytest.skip(str(exc))
    path = tmp_path_factory.mktemp("bpf") / "filter.bpf"
    path.write_bytes(bpf)
    return path


@pytest.fixture
async def pid1(agent_bin: Path, bpf_file: Path) -> AsyncIterator[Pid1Agent]:
    if os.geteuid() != 0:
        pytest.skip("a pid namespace needs root")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cfd = theirs.fileno()

    def to_fd3() -> None:
        os.dup2(cfd, 3)

    try:
        outer = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", PID1_HELPER, str(agent_bin), str(bpf_file),
            close_fds=False,
            preexec_fn=to_fd3,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
        )  # fmt: skip
    finally:
        theirs.close()
    assert outer.stdout is not None
    line = await asyncio.wait_for(outer.stdout.readline(), 10)
    a = Pid1Agent(outer, int(line), AgentChannel(ours))
    try:
        assert (await a.channel.wait_hello(5)).startswith("sandfleet-agent/")
        yield a
    finally:
        a.channel.close()
        os.kill(a.pid, signal.SIGKILL)  # PID 1: the whole namespace goes with it
        await asyncio.wait_for(outer.wait(), 10)


def _attempts(alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [a for a in alerts if a.get("kind") == "attempt"]


# ---- the agent as PID 1 with the listener: refusals and alerts --------------------------------------


async def test_signals_to_pid1_are_refused_and_reported(pid1: Pid1Agent) -> None:
    out = await pid1.sh("kill -TERM 1; echo term=$?; kill -0 1; echo probe=$?; kill -KILL 1; echo kill=$?")
    assert out.split() == ["term=1", "probe=1", "kill=1"]
    alerts = _attempts(await pid1.alerts_settle(3))
    assert [(a["syscall"], a["signal"]) for a in alerts] == [("kill", 15), ("kill", 0), ("kill", 9)]
    for a in alerts:
        assert a["comm"] == "sh" and a["uid"] == 0 and a["euid"] == 0 and a["arch"] == "x86_64"
        assert isinstance(a["pid"], int) and a["pid"] > 1 and "gone" not in a
    # the agent lives on and keeps working
    assert await pid1.sh("echo still here") == "still here\n"
    assert await pid1.channel.ping(5) < 1


async def test_errno_is_eperm(pid1: Pid1Agent) -> None:
    out, err, info = await pid1.run(["/bin/sh", "-c", "kill -TERM 1"])
    assert info.exit_code != 0 and b"not permitted" in err


async def test_ptrace_pidfd_and_memory_of_pid1_are_refused(pid1: Pid1Agent) -> None:
    # the agent runs as the host's root here: only the EPERM answer stands between these and success
    assert await pid1.probe("attach1") == "EPERM"
    assert await pid1.probe("seize1") == "EPERM"
    assert await pid1.probe("pidfd1") == "EPERM"
    assert await pid1.probe("vmread1") == "EPERM"
    assert await pid1.probe("highbits") == "EPERM"
    alerts = _attempts(await pid1.alerts_settle(5))
    assert [a["syscall"] for a in alerts] == ["ptrace", "ptrace", "pidfd_open", "process_vm_readv", "kill"]
    assert [a.get("request") for a in alerts[:2]] == [16, 0x4206]
    assert all(a["comm"].startswith("python") for a in alerts)
    assert await pid1.sh("echo fine") == "fine\n"


async def test_alert_reports_the_callers_uid(pid1: Pid1Agent) -> None:
    out = await pid1.sh("kill -HUP 1; echo $?", uid=65534, gid=65534)
    assert out == "1\n"
    (a,) = _attempts(await pid1.alerts_settle(1))
    assert (a["uid"], a["euid"], a["signal"]) == (65534, 65534, 1)


async def test_ptrace_of_other_processes_still_works(pid1: Pid1Agent) -> None:
    assert await pid1.probe("attach_child") == "ok"
    assert await pid1.sh("kill -0 $$ && echo self") == "self\n"  # signals to others untouched
    assert _attempts(await pid1.alerts_settle(0)) == []


async def test_nested_pid_namespace_is_let_through_unreported(pid1: Pid1Agent) -> None:
    if not shutil.which("unshare"):
        pytest.skip("no unshare(1)")
    # "1" in there is the nested namespace's own init (sh): kill -0 succeeds, and it is no attempt
    out = await pid1.sh("unshare --pid --fork --mount-proc /bin/sh -c 'kill -0 1 && echo nested-ok'")
    assert out == "nested-ok\n"
    assert _attempts(await pid1.alerts_settle(0)) == []
    # while the same from the agent's namespace is
    await pid1.run(["/bin/sh", "-c", "kill -0 1"])
    assert len(_attempts(await pid1.alerts_settle(1))) == 1


async def test_alerts_are_rate_limited(pid1: Pid1Agent) -> None:
    out = await pid1.sh("n=0; for i in $(seq 200); do kill -0 1 2>/dev/null || n=$((n+1)); done; echo $n")
    assert out == "200\n"  # every one refused, none dropped

    def total() -> int:
        return len(_attempts(pid1.alerts)) + sum(int(a["count"]) for a in pid1.alerts if a["kind"] == "suppressed")

    await pid1.until(lambda: total() >= 200)
    assert total() == 200
    attempts = len(_attempts(pid1.alerts))
    windows = 1 + sum(1 for a in pid1.alerts if a["kind"] == "suppressed")
    assert 20 <= attempts <= 20 * windows + 20 and attempts < 200
    assert await pid1.sh("echo alive") == "alive\n"


async def test_channel_survives_a_failing_alert_handler(pid1: Pid1Agent) -> None:
    seen: list[dict[str, Any]] = []

    def boom(alert: dict[str, Any]) -> None:
        seen.append(alert)
        raise RuntimeError("handler bug")

    pid1.channel.on_alert = boom
    await pid1.run(["/bin/sh", "-c", "kill -0 1"])
    assert len(seen) == 1  # the alert came before the command's exit, on the same channel
    assert await pid1.sh("echo ok") == "ok\n"


async def test_listener_is_not_inherited(pid1: Pid1Agent) -> None:
    # a command holding the listener could answer its own notifications
    out = await pid1.sh("ls -l /proc/self/fd/ | grep -c seccomp || true")
    assert out.strip() == "0"


async def _grab(pid: int) -> socket.socket:
    for _ in range(200):
        try:
            return grab_handoff_channel(pid)
        except OSError:
            await asyncio.sleep(0.01)
    raise AssertionError("no channel offered")


async def test_listener_outlives_a_lost_channel(pid1: Pid1Agent) -> None:
    # a daemon restart: the agent offers a new channel and keeps serving its listener
    pid1.channel.close()
    pid1.channel = AgentChannel(await _grab(pid1.pid))
    pid1.channel.on_alert = pid1.record
    await pid1.channel.wait_hello(5)
    out = await pid1.sh("kill -0 1; echo $?")
    assert out == "1\n"
    assert len(_attempts(await pid1.alerts_settle(1))) == 1


async def test_listener_is_closed_before_a_checkpoint(pid1: Pid1Agent) -> None:
    # REOPEN before criu dumps: criu cannot dump a listener, so the agent closes it; the filter's
    # notify rules then answer ENOSYS on their own, unreported
    await pid1.channel.reopen(5)
    pid1.channel.adopt_socket(await _grab(pid1.pid))
    out, err, info = await pid1.run(["/bin/sh", "-c", "kill -0 1"])
    assert info.exit_code != 0 and b"not implemented" in err.lower()
    assert await pid1.probe("attach1") == "ENOSYS"
    assert _attempts(await pid1.alerts_settle(0)) == []
    assert await pid1.sh("ls -l /proc/1/fd/ 2>/dev/null | grep -c seccomp || true") == "0\n"
    assert await pid1.sh("echo alive") == "alive\n"


# ---- real sandboxes of the daemon ------------------------------------------------------------------


def _sh(sb: Sandbox, cmd: str) -> tuple[int, str, str]:
    r = sb.exec(cmd, timeout=30)
    return r.exit_code, r.stdout, r.stderr


def _probe(sb: Sandbox, what: str) -> str:
    r = sb.exec(["python3", "-I", "-c", PROBE, what], timeout=30)
    assert r.exit_code == 0, r.stderr
    return r.stdout.strip()


@pytest.fixture
def py_sandbox(fleet: Client) -> Iterator[Sandbox]:
    with fleet.create(image="python", idle_ttl=300, labels={EXPECT: "agent_attack"}) as sb:
        yield sb


def test_sandbox_attempts_on_pid1_fail_and_the_agent_keeps_working(py_sandbox: Sandbox) -> None:
    sb = py_sandbox
    code, _, err = _sh(sb, "kill -TERM 1")
    assert code != 0 and "not permitted" in err
    code, _, err = _sh(sb, "kill -0 1")
    assert code != 0 and "not permitted" in err
    assert _probe(sb, "attach1") == "EPERM"
    assert _probe(sb, "pidfd1") == "EPERM"
    assert _probe(sb, "vmread1") == "EPERM"
    assert _sh(sb, "echo still here") == (0, "still here\n", "")
    # the daemon heard it: an event of the sandbox (and a finding of the agent_attack detector)
    attempts = [e.data for e in sb.events() if e.kind == "agent_attack"]
    assert {a.get("syscall") for a in attempts} >= {"kill", "ptrace", "pidfd_open", "process_vm_readv"}, attempts
    # ptrace of the sandbox's other processes is untouched
    assert _probe(sb, "attach_child") == "ok"
    # no nested pid namespace to test the pass-through in: the sandbox cannot make one
    code, _, _ = _sh(sb, "unshare --pid --fork --mount-proc sh -c 'kill -0 1'")
    assert code != 0


def test_snapshot_restore_with_the_listener(fleet: Client) -> None:
    sb = fleet.create(image="busybox", labels={EXPECT: "agent_attack"})
    try:
        code, _, err = _sh(sb, "kill -0 1")
        assert code != 0 and "not permitted" in err
        snap = sb.snapshot()
        try:
            # after the snapshot the listener is gone: still refused, as ENOSYS
            code, _, err = _sh(sb, "kill -0 1")
            assert code != 0 and "not implemented" in err.lower()
            assert _sh(sb, "echo parent") == (0, "parent\n", "")
            results = fleet.restore(snap.id)
            errors = [r for r in results if isinstance(r, SandboxError)]
            assert not errors, errors
            (child,) = [r for r in results if isinstance(r, Sandbox)]
            try:
                code, _, err = _sh(child, "kill -0 1")
                assert code != 0 and "not implemented" in err.lower()
                assert _sh(child, "echo child") == (0, "child\n", "")
            finally:
                child.stop()
        finally:
            fleet.delete_snapshot(snap.id)
    finally:
        sb.stop()
