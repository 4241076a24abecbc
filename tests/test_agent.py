"""Tests for the in-sandbox agent (agent.c) and its asyncio channel (agent.py).

The agent runs directly on the host here (not as PID 1 of a namespace); it is a child
subreaper, so orphaned grandchildren are still reaped by it.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

try:
    import sandfleet.runtime.agent_wire as agent_mod
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    import sandfleet.runtime.agent_wire as agent_mod

from sandfleet.runtime.agent import AgentChannel, grab_handoff_channel
from sandfleet.runtime.agent_build import build_agent
from sandfleet.runtime.agent_errors import ChannelClosedError, ExecStartError
from sandfleet.runtime.agent_wire import AGENT_VERSION, SCOPE_DESCENDANTS, ExitInfo, OutputChunk

ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C"}


def _children(pid: int) -> list[int]:
    """All descendants of pid (via /proc ppid chains)."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                rest = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        parents[int(name)] = int(rest[1])
    found = {pid}
    changed = True
    while changed:
        changed = False
        for p, pp in parents.items():
            if pp in found and p not in found:
                found.add(p)
                changed = True
    found.discard(pid)
    return sorted(found)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


async def _gone(pids: list[int], limit: float = 3.0) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        await asyncio.sleep(0.02)
    return False


class Agent:
    def __init__(self, proc: subprocess.Popen[bytes], channel: AgentChannel) -> None:
        self.proc = proc
        self.channel = channel

    @classmethod
    def start(cls, binary: Path) -> Agent:
        """Spawn the agent with one end of a fresh socketpair as its fd 3."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfd = theirs.fileno()

        def to_fd3() -> None:
            if cfd == 3:
                os.set_inheritable(3, True)
            else:
                os.dup2(cfd, 3)  # inheritable; everything else is CLOEXEC

        try:
            proc = subprocess.Popen([str(binary)], close_fds=False, preexec_fn=to_fd3, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        return cls(proc, AgentChannel(ours))

    def stop(self) -> None:
        self.channel.close()
        for pid in _children(self.proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="session")
def agent_bin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield build_agent(tmp_path_factory.mktemp("agent-cache"))


@pytest.fixture
async def agent(agent_bin: Path) -> AsyncIterator[Agent]:
    a = Agent.start(agent_bin)
    try:
        yield a
    finally:
        a.stop()


async def run(a: Agent, argv: list[str], **kw: object) -> tuple[bytes, bytes, ExitInfo]:
    kw.setdefault("env", ENV)
    proc = await a.channel.start(argv, **kw)
    return await asyncio.wait_for(proc.wait(), 10)


# ---- pure protocol -----------------------------------------------------------------------


def test_codec_roundtrip() -> None:
    req = agent_mod.ExecRequest(["sh", "-c", "x"], {"A": "1=2"}, "/tmp", 1, 2, 300, 99, 3)
    mtype, mid, payload = agent_mod.decode_message(agent_mod.encode_exec(7, req))
    assert (mtype, mid) == (agent_mod.MSG_EXEC, 7)
    assert agent_mod.decode_exec(payload) == req
    _, _, p = agent_mod.decode_message(agent_mod.encode_exit(1, 9, 3, 10, 20, 1_500_000))
    info = agent_mod.decode_exit(p)
    assert (info.exit_code, info.signal, info.timed_out, info.stdout_truncated) == (137, 9, True, True)
    assert info.duration == 1.5 and not info.stderr_truncated and info.cpu is None  # an agent before the CPU
    _, _, p = agent_mod.decode_message(agent_mod.encode_exit(1, 0, 0, 0, 0, 10, cpu_us=250_000))
    assert agent_mod.decode_exit(p).cpu == 0.25
    _, _, p = agent_mod.decode_message(agent_mod.encode_error(1, 2, "nope"))
    assert agent_mod.decode_error(p) == (2, "nope")
    _, _, p = agent_mod.decode_message(agent_mod.encode_signal(1, 15, 2))
    assert agent_mod.decode_signal(p) == (15, 2)
    with pytest.raises(ValueError):
        agent_mod.encode_stdin(1, b"x" * (agent_mod.MAX_PAYLOAD + 1))


def test_build_is_cached(agent_bin: Path) -> None:
    assert build_agent(agent_bin.parent.parent) == agent_bin
    assert os.access(agent_bin, os.X_OK)


# ---- agent behaviour ---------------------------------------------------------------------


async def test_hello_and_ping(agent: Agent) -> None:
    assert await agent.channel.wait_hello(5) == AGENT_VERSION
    assert await agent.channel.ping(5) < 1


async def test_echo_and_exit_codes(agent: Agent) -> None:
    out, err, info = await run(agent, ["echo", "hello"])
    assert (out, err, info.exit_code, info.signal) == (b"hello\n", b"", 0, None)
    assert info.stdout_bytes == 6 and info.duration > 0
    _, _, info = await run(agent, ["sh", "-c", "exit 42"])
    assert info.exit_code == 42


async def test_signal_exit(agent: Agent) -> None:
    _, _, info = await run(agent, ["sh", "-c", "kill -TERM $$"])
    assert (info.exit_code, info.signal) == (128 + signal.SIGTERM, signal.SIGTERM)


async def test_stderr_separate(agent: Agent) -> None:
    proc = await agent.channel.start(["sh", "-c", "echo out; echo err >&2"], env=ENV)
    events = [ev async for ev in proc.events()]
    assert OutputChunk("stdout", b"out\n") in events and OutputChunk("stderr", b"err\n") in events
    assert isinstance(events[-1], ExitInfo) and events[-1].stderr_bytes == 4


async def test_stdin(agent: Agent) -> None:
    proc = await agent.channel.start(["cat"], env=ENV, stdin=True)
    await proc.write_stdin(b"abc")
    await proc.close_stdin()
    out, _, info = await proc.wait()
    assert (out, info.exit_code) == (b"abc", 0)


async def test_stdin_large_does_not_block(agent: Agent) -> None:
    # much more than a pipe buffer: the agent must queue it and keep serving other requests
    data = os.urandom(4 << 20)
    proc = await agent.channel.start(["sh", "-c", "sleep 0.3; cat"], env=ENV, stdin=True)
    await proc.write_stdin(data)
    assert await agent.channel.ping(2) < 1
    await proc.close_stdin()
    out, _, info = await proc.wait()
    assert info.exit_code == 0 and out == data


async def test_env_and_cwd(agent: Agent, tmp_path: Path) -> None:
    out, _, _ = await run(agent, ["sh", "-c", 'echo "$FOO:$(pwd)"'], env={**ENV, "FOO": "bar"}, cwd=str(tmp_path))
    assert out.decode() == f"bar:{tmp_path}\n"
    # PATH comes from the request env (and defaults when absent)
    out, _, _ = await run(agent, ["printenv"], env={"ONLY": "1"})
    assert out == b"ONLY=1\n"


async def test_uid_switch(agent: Agent) -> None:
    out, _, info = await run(agent, ["sh", "-c", "id -u; id -g; id -G"], uid=65534, gid=65534)
    assert info.exit_code == 0
    assert out.split() == [b"65534", b"65534", b"65534"]


async def test_exec_failure(agent: Agent) -> None:
    with pytest.raises(ExecStartError) as ei:
        await agent.channel.start(["/nonexistent/prog"], env=ENV)
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(ExecStartError) as ei:
        await agent.channel.start(["no-such-command-xyz"], env=ENV)
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(ExecStartError) as ei:
        await agent.channel.start(["true"], env=ENV, cwd="/nonexistent")
    assert ei.value.errno == errno.ENOENT and "chdir" in ei.value.message
    _, _, info = await run(agent, ["true"])  # agent still fine
    assert info.exit_code == 0


async def test_timeout_kills_tree(agent: Agent) -> None:
    script = "sleep 100 & echo $!; setsid sleep 100 & echo $!; sleep 100"
    t0 = time.monotonic()
    out, _, info = await run(agent, ["sh", "-c", script], timeout=0.5)
    assert time.monotonic() - t0 < 5
    assert info.timed_out and info.exit_code == 137
    pids = [int(x) for x in out.split()]
    assert len(pids) == 2
    assert await _gone(pids)


async def test_out_cap(agent: Agent) -> None:
    out, _, info = await run(agent, ["yes"], timeout=0.5, out_cap=10000)
    assert info.timed_out and info.stdout_truncated and not info.stderr_truncated
    assert len(out) == 10000 and info.stdout_bytes > 10000


async def test_background_grandchild_does_not_hang(agent: Agent) -> None:
    t0 = time.monotonic()
    out, _, info = await run(agent, ["sh", "-c", "sleep 100 & echo done"])
    assert out == b"done\n" and info.exit_code == 0
    assert time.monotonic() - t0 < 2


async def test_concurrent_execs(agent: Agent) -> None:
    results = await asyncio.gather(*(run(agent, ["sh", "-c", f"echo {i}"]) for i in range(50)))
    assert [r[0] for r in results] == [f"{i}\n".encode() for i in range(50)]
    assert agent.channel.active_execs == 0


async def test_signal_group(agent: Agent) -> None:
    proc = await agent.channel.start(["sleep", "100"], env=ENV)
    await proc.signal(signal.SIGTERM)
    _, _, info = await asyncio.wait_for(proc.wait(), 5)
    assert info.signal == signal.SIGTERM


async def test_signal_descendants_keeps_shell(agent: Agent) -> None:
    proc = await agent.channel.start(["sh"], env=ENV, stdin=True, setsid=True)
    await proc.write_stdin(b"sleep 100; echo after $?\n")
    for _ in range(100):  # wait until the command is running
        if _children(proc.pid):
            break
        await asyncio.sleep(0.02)
    sleeper = _children(proc.pid)
    assert sleeper
    await proc.signal(signal.SIGKILL, SCOPE_DESCENDANTS)
    await proc.write_stdin(b"exit 3\n")
    out, _, info = await asyncio.wait_for(proc.wait(), 5)
    assert out == b"after 137\n" and info.exit_code == 3
    assert await _gone(sleeper)


async def test_channel_loss_and_handoff(agent: Agent) -> None:
    await agent.channel.wait_hello(5)
    with pytest.raises(OSError):
        grab_handoff_channel(agent.proc.pid)  # nothing to hand off yet
    survivor = await agent.channel.start(["sleep", "100"], env=ENV)
    closed: list[AgentChannel] = []
    agent.channel.on_close = closed.append
    agent.channel.close()
    with pytest.raises(ChannelClosedError):
        await survivor.wait()
    sock = None
    for _ in range(200):
        try:
            sock = grab_handoff_channel(agent.proc.pid)
            break
        except OSError:
            await asyncio.sleep(0.01)
    assert sock is not None
    agent.channel = AgentChannel(sock)
    assert await agent.channel.wait_hello(5) == AGENT_VERSION
    out, _, info = await run(agent, ["echo", "again"])
    assert (out, info.exit_code) == (b"again\n", 0)
    assert _alive(survivor.pid)  # processes outlive the daemon
    with pytest.raises(OSError):
        grab_handoff_channel(agent.proc.pid)  # consumed by the first message
    assert closed == []  # explicit close() doesn't fire on_close


async def test_agent_death_fails_pending(agent: Agent) -> None:
    proc = await agent.channel.start(["sleep", "100"], env=ENV)
    closed: list[AgentChannel] = []
    agent.channel.on_close = closed.append
    agent.proc.kill()
    try:
        with pytest.raises(ChannelClosedError):
            await asyncio.wait_for(proc.wait(), 5)
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # reparented away from the dead agent: not found by stop()
    assert closed == [agent.channel] and agent.channel.closed
    with pytest.raises(ChannelClosedError):
        await agent.channel.start(["true"], env=ENV)


# A parent waiting for its vfork child (which never execs) sleeps uninterruptibly ('D' in /proc):
# SIGSTOP does not take effect while it waits there, only a fatal signal ends the wait.
VFORK_STUCK = b"#include <unistd.h>\nint main(void) { if (vfork() == 0) { pause(); _exit(0); } return 0; }\n"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


@pytest.fixture
def stuck(tmp_path: Path) -> Path:
    (tmp_path / "stuck.c").write_bytes(VFORK_STUCK)
    subprocess.run(["cc", "-O2", "-o", str(tmp_path / "stuck"), str(tmp_path / "stuck.c")], check=True)
    return tmp_path / "stuck"


async def test_killing_a_tree_whose_root_cannot_stop_does_not_stall_the_agent(agent: Agent, stuck: Path) -> None:
    """A tree kill stops the root first and waits (up to 50 ms) until it has stopped; a root in 'D'
    never does. That wait must not hold up the agent's other work (every exec of the sandbox)."""
    procs = [await agent.channel.start([str(stuck)], env=ENV) for _ in range(5)]
    for _ in range(200):
        if all(_state(p.pid) == "D" for p in procs):
            break
        await asyncio.sleep(0.02)
    assert [_state(p.pid) for p in procs] == ["D"] * 5
    children = [c for p in procs for c in _children(p.pid)]
    pings = []
    for p in procs:
        await p.signal(signal.SIGKILL, agent_mod.SCOPE_TREE)
        pings.append(await agent.channel.ping(5))
    assert min(pings) < 0.025, pings  # not behind a 50 ms wait
    for p in procs:
        _, _, info = await asyncio.wait_for(p.wait(), 5)
        assert info.signal == signal.SIGKILL
    assert await _gone(children)


async def test_exit_reports_the_cpu_of_the_command_and_what_it_waited_for(agent: Agent) -> None:
    spin = "i=0; while [ $i -lt 300000 ]; do i=$((i+1)); done"
    _, _, alone = await run(agent, ["sh", "-c", spin])
    _, _, waited = await run(agent, ["sh", "-c", f"(sh -c '{spin}'); sleep 0.2"])
    _, _, idle = await run(agent, ["sleep", "0.3"])
    assert alone.cpu is not None and 0.05 < alone.cpu <= alone.duration + 0.05, alone
    assert waited.cpu is not None and waited.cpu > 0.5 * alone.cpu, (waited, alone)  # its child's, reaped by it
    assert idle.cpu is not None and idle.cpu < 0.05, idle


async def test_a_timeout_kills_a_tree_whose_root_cannot_stop(agent: Agent, stuck: Path) -> None:
    t0 = time.monotonic()
    _, _, info = await run(agent, [str(stuck)], timeout=0.3)
    assert info.timed_out and info.signal == signal.SIGKILL and time.monotonic() - t0 < 3


async def test_a_lazy_start_comes_with_a_short_commands_answer_and_soon_for_a_long_one(agent: Agent) -> None:
    # Short: STARTED held back until the EXIT (or the first output), so one datagram burst answers
    # it all; the result is then whole at once (`collected`, no suspension), output before EXIT.
    merged = 0
    for i in range(40):
        argv = ["sh", "-c", "exit 3"] if i % 2 else ["sh", "-c", "echo out; echo err >&2; exit 3"]
        proc = await agent.channel.start(argv, env=ENV, lazy=True)
        done = proc.collected()
        merged += done is not None and i % 2
        out, err, info = done if done is not None else await asyncio.wait_for(proc.wait(), 10)
        assert (out, err, info.exit_code) == ((b"", b"") if i % 2 else (b"out\n", b"err\n")) + (3,)
    assert merged >= 10  # of 20 (a loaded host may run the agent's two sends across our reads)
    # With a stdin pipe, STARTED comes at once: the daemon writes the input after it, and `cat`
    # would wait for that input (lazy, it waited for the agent's 5 ms every time).
    took = []
    for _ in range(10):
        t = time.monotonic()
        proc = await agent.channel.start(["cat"], env=ENV, stdin=True, lazy=True)
        took.append(time.monotonic() - t)
        await proc.write_stdin(b"in")
        await proc.close_stdin()
        assert (await asyncio.wait_for(proc.wait(), 10))[0] == b"in"
    assert min(took) < 0.004, took
    # Long: STARTED still comes by the agent's 5 ms, not at the exit; not lazy: at once.
    for lazy in (True, False):
        t = time.monotonic()
        proc = await asyncio.wait_for(agent.channel.start(["sleep", "2"], env=ENV, lazy=lazy), 1)
        assert time.monotonic() - t < 1 and proc.pid > 0 and proc.collected() is None
        await proc.signal(signal.SIGKILL)
        _, _, info = await asyncio.wait_for(proc.wait(), 10)
        assert info.signal == signal.SIGKILL
    # A failure to start is an error, lazy or not, and output that comes early comes after STARTED.
    with pytest.raises(ExecStartError):
        await agent.channel.start(["/no/such/binary"], env=ENV, lazy=True)
    proc = await agent.channel.start(["sh", "-c", "echo early; sleep 0.3"], env=ENV, lazy=True)
    first = await asyncio.wait_for(proc.events().__anext__(), 5)
    assert isinstance(first, OutputChunk) and first.data == b"early\n"
