"""Functional tests of exec, streaming, background processes and sessions against a real daemon."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

from sandfleet import ExecEvent, InvalidArgumentError, NotFoundError, WrongStateError
from sandfleet.client.sync import Process
from sandfleet.models import ProcessInfo

if TYPE_CHECKING:
    from sandfleet import Client, Sandbox

    from conftest import Daemon

MiB = 1024**2


def _sleeps(sb: Sandbox) -> list[str]:
    """Lines of `ps` in the sandbox that show a sleep process."""
    ps = sb.exec(["ps", "-o", "pid,args"])
    assert ps.exit_code == 0, ps.stderr
    return [line for line in ps.stdout.splitlines() if "sleep" in line and "ps -o" not in line]


# -- one-shot exec ---------------------------------------------------------------------------------


def test_exit_codes(sandbox: Sandbox) -> None:
    ok = sandbox.exec("true")
    assert ok.exit_code == 0 and ok.ok and not ok.timed_out and ok.signal is None
    assert sandbox.exec("exit 3").exit_code == 3
    assert sandbox.exec(["false"]).exit_code == 1
    assert sandbox.exec(["sh", "-c", "exit 255"]).exit_code == 255
    r = sandbox.exec("kill -TERM $$")
    assert r.exit_code == 128 + 15 or r.signal == 15


def test_script_without_shebang_runs_with_sh(sandbox: Sandbox) -> None:
    """As with glibc's execvp, by path and through PATH (the agent may be built against musl)."""
    sandbox.files.write("/bin/noshebang", b'echo "scripted $1"\n', mode=0o755)
    assert sandbox.exec(["/bin/noshebang", "a"]).stdout == "scripted a\n"
    assert sandbox.exec(["noshebang", "b"]).stdout == "scripted b\n"
    sandbox.files.write("/tmp/notexec", b"echo no\n", mode=0o644)
    assert sandbox.exec(["/tmp/notexec"]).exit_code != 0  # control: not executable, not run


def test_stdout_and_stderr_are_separate(sandbox: Sandbox) -> None:
    r = sandbox.exec("echo out1; echo err1 >&2; echo out2; printf err2 >&2")
    assert r.stdout == "out1\nout2\n"
    assert r.stderr == "err1\nerr2"
    assert r.duration >= 0 and not r.truncated


def test_argv_list_vs_shell_string(sandbox: Sandbox) -> None:
    # an argv is not interpreted by a shell
    r = sandbox.exec(["echo", "$HOME", "a  b", "; false", "*"])
    assert r.exit_code == 0
    assert r.stdout == "$HOME a  b ; false *\n"
    # a string is
    r = sandbox.exec("X=1; echo $HOME $X; false; echo $?")
    assert r.stdout == "/root 1\n1\n"
    r = sandbox.exec("echo a | tr a b && echo c > /tmp/f && cat /tmp/f")
    assert r.stdout == "b\nc\n"


def test_env_cwd_user_stdin(sandbox: Sandbox) -> None:
    r = sandbox.exec('echo "$A|$B"', env={"A": "1", "B": "two words"})
    assert r.stdout == "1|two words\n"
    assert sandbox.exec("pwd", cwd="/tmp").stdout == "/tmp\n"
    assert sandbox.exec(["pwd"], cwd="/etc").stdout == "/etc\n"
    r = sandbox.exec("id -u; id -g; echo $HOME", user="nobody")
    assert r.stdout == "65534\n65534\n/nonexistent\n"
    assert sandbox.exec("id -u", user="1234").stdout == "1234\n"
    # nobody cannot write root's files
    assert sandbox.exec("touch /root/x", user="nobody").exit_code != 0
    r = sandbox.exec("cat; echo END", stdin="line1\nline2\n")
    assert r.stdout == "line1\nline2\nEND\n"
    assert sandbox.exec(["wc", "-c"], stdin="x" * 300_000).stdout.strip() == "300000"
    # no stdin: reads see EOF rather than hanging
    r = sandbox.exec("cat; echo done", timeout=10)
    assert r.stdout == "done\n" and not r.timed_out


def test_missing_cwd(sandbox: Sandbox) -> None:
    r = sandbox.exec("pwd", cwd="/does/not/exist")
    assert r.exit_code != 0


def test_command_not_found(sandbox: Sandbox) -> None:
    r = sandbox.exec("no_such_command_xyz")
    assert r.exit_code == 127
    assert "no_such_command_xyz" in r.stderr
    r = sandbox.exec(["no_such_command_xyz", "arg"])
    assert r.exit_code == 127
    assert "no_such_command_xyz" in r.stderr
    r = sandbox.exec(["/etc/passwd"])  # exists, not executable
    assert r.exit_code == 126
    # a streamed one reports the same
    events = list(sandbox.exec_stream(["no_such_command_xyz"]))
    assert events[-1].type == "exit" and events[-1].result is not None and events[-1].result.exit_code == 127


def test_invalid_requests(sandbox: Sandbox) -> None:
    with pytest.raises((InvalidArgumentError, ValueError)):
        sandbox.exec([])
    with pytest.raises((InvalidArgumentError, ValueError)):
        sandbox.exec("true", cwd="")
    with pytest.raises((InvalidArgumentError, ValueError)):
        sandbox.exec("true", env={"BAD-NAME": "1"})


def test_relative_cwd_is_taken_from_the_workdir(fleet: Client) -> None:
    with fleet.create(image="busybox", workdir="/tmp", idle_ttl=60) as sb:
        sb.exec("mkdir -p /tmp/sub")
        assert sb.exec("pwd", cwd="sub").stdout == "/tmp/sub\n"
        assert sb.exec("pwd", cwd="../etc").stdout == "/etc\n"
        assert sb.exec("pwd", cwd=".").stdout == "/tmp\n"


def test_timeout_kills_whole_process_tree(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    r = sandbox.exec("sh -c 'sleep 100 & sleep 100'", timeout=1)
    elapsed = time.monotonic() - t0
    assert r.timed_out
    assert r.exit_code != 0
    assert elapsed < 8, elapsed
    assert 0.9 <= r.duration < 8
    assert _sleeps(sandbox) == []
    assert sandbox.exec("echo fine").stdout == "fine\n"
    kinds = [e.kind for e in sandbox.events()]
    assert "exec_timeout" in kinds


def test_timeout_kills_setsid_daemonized_children(sandbox: Sandbox) -> None:
    r = sandbox.exec("setsid sleep 100 & nohup sleep 101 >/dev/null 2>&1 & sleep 102", timeout=1)
    assert r.timed_out
    assert _sleeps(sandbox) == []


def test_output_cap_default(sandbox: Sandbox) -> None:
    r = sandbox.exec("yes | head -c 5000000; echo tail >&2")
    assert r.exit_code == 0
    assert r.stdout_truncated and r.truncated and not r.stderr_truncated
    assert len(r.stdout) == MiB
    assert r.stdout[:4] == "y\ny\n"
    assert r.stderr == "tail\n"
    # unbounded output until the timeout: still capped, daemon stays responsive
    r = sandbox.exec("yes", timeout=1)
    assert r.timed_out and r.stdout_truncated and len(r.stdout) == MiB
    assert sandbox.exec("echo ok").stdout == "ok\n"
    kinds = [e.kind for e in sandbox.events()]
    assert "output_truncated" in kinds


def test_output_cap_custom(sandbox: Sandbox) -> None:
    r = sandbox.exec("yes | head -c 1000; yes e | head -c 50 >&2", output_limit=100)
    assert r.stdout_truncated and len(r.stdout) == 100
    assert not r.stderr_truncated and len(r.stderr) == 50
    r = sandbox.exec("printf 12345", output_limit=5)
    assert r.stdout == "12345" and not r.stdout_truncated
    r = sandbox.exec("printf 123456", output_limit=5)
    assert r.stdout == "12345" and r.stdout_truncated
    r = sandbox.exec("yes | head -c 3000000", output_limit=2 * MiB)
    assert len(r.stdout) == 2 * MiB and r.stdout_truncated


def test_streaming_is_incremental(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    seen: list[tuple[float, ExecEvent]] = []
    for ev in sandbox.exec_stream("echo a; sleep 1; echo b; echo e >&2"):
        seen.append((time.monotonic() - t0, ev))
    kinds = [ev.type for _, ev in seen]
    assert kinds[-1] == "exit" and kinds.count("exit") == 1
    first_out = next(t for t, ev in seen if ev.type == "stdout")
    end = seen[-1][0]
    assert end - first_out >= 0.7, (first_out, end)
    out = "".join(ev.data for _, ev in seen if ev.type == "stdout")
    err = "".join(ev.data for _, ev in seen if ev.type == "stderr")
    assert out == "a\nb\n" and err == "e\n"
    result = seen[-1][1].result
    assert result is not None and result.exit_code == 0 and result.stdout == "a\nb\n" and result.stderr == "e\n"


def test_streaming_timeout_and_cap(sandbox: Sandbox) -> None:
    events = list(sandbox.exec_stream("yes | head -c 3000; sleep 100", timeout=1, output_limit=1000))
    result = events[-1].result
    assert result is not None and result.timed_out and result.stdout_truncated
    assert sum(len(ev.data) for ev in events if ev.type == "stdout") == 1000
    assert _sleeps(sandbox) == []


def test_abandoned_stream_kills_command(sandbox: Sandbox) -> None:
    stream = sandbox.exec_stream("echo started; sleep 100")
    first = next(stream)
    assert first.type == "stdout" and first.data == "started\n"
    stream.close()  # the client goes away mid-stream

    assert _wait(lambda: _sleeps(sandbox) == [], timeout=10)


def _wait(cond: object, timeout: float) -> bool:
    assert callable(cond)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return bool(cond())


def test_concurrent_execs(sandbox: Sandbox) -> None:
    def one(i: int) -> tuple[int, str, str]:
        r = sandbox.exec(f"sleep 0.2; echo out{i}; echo err{i} >&2; exit {i % 7}")
        return r.exit_code, r.stdout, r.stderr

    t0 = time.monotonic()
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    assert results == [(i % 7, f"out{i}\n", f"err{i}\n") for i in range(20)]
    # they ran concurrently, not one after another (20 x 0.2 s)
    assert time.monotonic() - t0 < 4


# -- background processes ------------------------------------------------------------------------------


def test_background_process_wait(sandbox: Sandbox) -> None:
    p = sandbox.start("sleep 0.5; echo done; echo oops >&2; exit 4")
    assert p.info.running and p.id.startswith("p-")
    assert p.id in {x.id for x in sandbox.processes()}
    info = p.wait(timeout=10)
    assert not info.running
    assert info.result is not None
    assert (info.result.exit_code, info.result.stdout, info.result.stderr) == (4, "done\n", "oops\n")
    # waiting again is harmless
    assert p.wait(timeout=1).result == info.result


def test_background_process_wait_timeout_and_kill(sandbox: Sandbox) -> None:
    p = sandbox.start(["sh", "-c", "sleep 100 & sleep 100"])
    t0 = time.monotonic()
    assert p.wait(timeout=0.5).running
    assert time.monotonic() - t0 >= 0.4
    # an exec runs while the background process is alive
    assert sandbox.exec("echo side").stdout == "side\n"
    p.kill()
    info = p.wait(timeout=10)
    assert not info.running
    assert info.result is not None and (info.result.signal == 9 or info.result.exit_code == 137)
    assert _wait(lambda: _sleeps(sandbox) == [], timeout=5)


def test_background_process_output_is_followed_as_it_comes(sandbox: Sandbox) -> None:
    """`output()`: the first line arrives while the process still runs (it waits for a file only
    this test writes after reading that line), the rest then its exit; a follower that comes after
    the exit gets all of it at once; a UTF-8 character cut across chunks arrives whole."""
    p = sandbox.start("echo first; printf '\\303'; sleep 0.2; printf '\\251\\n'; "
                      "while [ ! -e /tmp/go ]; do sleep 0.05; done; echo last >&2; exit 3")  # fmt: skip
    seen: list[tuple[str, str]] = []
    with p.output() as events:
        for ev in events:
            if ev.type == "exit":
                assert ev.result is not None and ev.result.exit_code == 3
                assert ev.result.stdout == "first\n\u00e9\n" and ev.result.stderr == "last\n"
                break
            seen.append((ev.type, ev.data))
            if ev.type == "stdout" and "".join(d for t, d in seen if t == "stdout") == "first\n\u00e9\n":
                assert p.wait(timeout=0).running  # live: the process has not ended yet
                sandbox.files.write("/tmp/go", b"")
    assert "".join(d for t, d in seen if t == "stdout") == "first\n\u00e9\n"
    assert "".join(d for t, d in seen if t == "stderr") == "last\n"
    with p.output() as events:
        after = [(ev.type, ev.data) for ev in events if ev.type != "exit"]
    assert after == [("stdout", "first\n\u00e9\n"), ("stderr", "last\n")]


def test_a_followed_process_whose_sandbox_stops_ends_its_stream(fleet: Client) -> None:
    """A sandbox stopped under a followed process: the stream ends with `wrong_state` (no exit
    status), never hangs."""
    sb = fleet.create(image="busybox")
    p = sb.start("echo up; sleep 300")
    with p.output() as events:
        assert next(events).data == "up\n"
        sb.stop()
        t0 = time.monotonic()
        with pytest.raises(WrongStateError, match="without an exit status"):
            list(events)
    assert time.monotonic() - t0 < 10


def test_a_process_started_and_followed_in_one_call(sandbox: Sandbox) -> None:
    """`start_stream`: `started` (the process, running, listed) first, then its output and exit; the
    process outlives a stream left early, and is a process like any (waited, killed)."""
    with sandbox.start_stream("echo one; read line; echo got $line", keep_stdin_open=True) as events:
        first = next(events)
        assert first.type == "started" and first.process is not None and first.process.running
        p = Process(sandbox, first.process)
        assert p.id in {x.id for x in sandbox.processes()}
        assert next(events).data == "one\n"
        p.write_stdin("it\n", close=True)
        rest = list(events)
    assert [e.data for e in rest if e.type == "stdout"] == ["got it\n"] and rest[-1].type == "exit"
    with sandbox.start_stream("sleep 0.3; echo late") as events:
        left = next(events).process
    assert left is not None
    info = Process(sandbox, left).wait(timeout=10)  # left early: the process ran on
    assert info.result is not None and info.result.stdout == "late\n"


def test_background_process_timeout(sandbox: Sandbox) -> None:
    p = sandbox.start("sleep 100", timeout=0.5)
    info = p.wait(timeout=10)
    assert not info.running and info.result is not None and info.result.timed_out


def test_background_unknown_process(sandbox: Sandbox) -> None:
    ghost = Process(sandbox, ProcessInfo(id="p-nope", command="x", running=True, started_at=0.0))
    with pytest.raises(NotFoundError):
        ghost.wait(timeout=0)
    with pytest.raises(NotFoundError):
        ghost.kill()


# -- sessions -----------------------------------------------------------------------------------------


def test_session_shares_cwd_env_functions(sandbox: Sandbox) -> None:
    with sandbox.session() as s:
        assert s.id.startswith("s-") and s.info.shell in ("/bin/sh", "/bin/bash")
        r = s.run('cd /tmp && export X=hello && Y=local && greet() { echo "hi $1"; }')
        assert r.exit_code == 0, r.stderr
        r = s.run('pwd; echo "$X $Y"; greet bob')
        assert r.stdout == "/tmp\nhello local\nhi bob\n"
        assert r.exit_code == 0
        r = s.run("false")
        assert r.exit_code == 1
        r = s.run("echo err >&2; (exit 7)")
        assert (r.exit_code, r.stdout, r.stderr) == (7, "", "err\n")
        # a child process sees exported vars only
        assert s.run("sh -c 'echo \"[$X][$Y]\"'").stdout == "[hello][]\n"


def test_session_options(sandbox: Sandbox) -> None:
    with sandbox.session(env={"S": "1"}, cwd="/etc", user="nobody") as s:
        assert s.run('echo "$S"; pwd; id -u').stdout == "1\n/etc\n65534\n"


def test_sessions_are_independent(sandbox: Sandbox) -> None:
    with sandbox.session() as a, sandbox.session() as b:
        a.run("cd /tmp; export V=a")
        b.run("cd /etc; export V=b")
        assert a.run('pwd; echo "$V"').stdout == "/tmp\na\n"
        assert b.run('pwd; echo "$V"').stdout == "/etc\nb\n"
        # one-shot execs don't see session state
        assert sandbox.exec('pwd; echo "[$V]"').stdout == "/\n[]\n"


def test_session_survives_timeout(sandbox: Sandbox) -> None:
    with sandbox.session() as s:
        s.run("export X=kept; cd /tmp")
        t0 = time.monotonic()
        r = s.run("sleep 100", timeout=1)
        assert r.timed_out
        assert time.monotonic() - t0 < 8
        r = s.run('echo "$X"; pwd')
        assert r.stdout == "kept\n/tmp\n" and not r.timed_out and r.exit_code == 0
        assert _sleeps(sandbox) == []


def test_session_survives_syntax_error_and_exit_of_subshell(sandbox: Sandbox) -> None:
    with sandbox.session() as s:
        s.run("export X=still")
        r = s.run("if then fi")
        assert r.exit_code != 0 and r.stderr
        r = s.run("echo 'unterminated")
        assert r.exit_code != 0
        r = s.run('echo "$X"')
        assert r.stdout == "still\n" and r.exit_code == 0


def test_session_output_with_no_trailing_newline_and_cap(sandbox: Sandbox) -> None:
    with sandbox.session() as s:
        assert s.run("printf abc").stdout == "abc"
        r = s.run("yes | head -c 5000", output_limit=100)
        assert len(r.stdout) == 100 and r.stdout_truncated


def test_closed_session_is_gone(sandbox: Sandbox) -> None:
    s = sandbox.session()
    s.run("true")
    s.close()
    with pytest.raises((NotFoundError, WrongStateError)):
        s.run("true")


def test_session_exit_builtin(sandbox: Sandbox) -> None:
    """`exit` ends the session's shell: reported as WrongStateError, and the sandbox is unaffected."""
    s = sandbox.session()
    try:
        with pytest.raises(WrongStateError):
            s.run("echo bye; exit 3")
        with pytest.raises(WrongStateError):
            s.run("true")
    finally:
        s.close()
    assert sandbox.exec("echo ok").stdout == "ok\n"


# -- known bugs -----------------------------------------------------------------------------------------


def test_no_timeout_outlives_client_default_timeout(daemon: Daemon, sandbox: Sandbox) -> None:
    with daemon.client(timeout=2) as c:
        same = c.get(sandbox.id)
        r = same.exec("sleep 3; echo done", timeout=None)
        assert r.stdout == "done\n" and not r.timed_out
        with same.session() as s:
            assert s.run("sleep 3; echo done", timeout=None).stdout == "done\n"


def test_output_limit_zero_keeps_nothing(sandbox: Sandbox) -> None:
    try:
        r = sandbox.exec("yes | head -c 3000000", output_limit=0)
    except InvalidArgumentError:
        return  # rejecting 0 would be fine too
    assert r.stdout == "" and r.stdout_truncated


def _hwm_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def test_session_output_limit_bounds_daemon_memory(own_daemon: Daemon) -> None:
    own_daemon.start()
    with own_daemon.client(timeout=120) as c, c.create(image="busybox") as sb, sb.session() as s:
        s.run("true")
        before = _hwm_mib(own_daemon.pid)
        r = s.run("yes | head -c 100000000", output_limit=100, timeout=60)
        assert r.exit_code == 0 and len(r.stdout) == 100 and r.stdout_truncated
        grown = _hwm_mib(own_daemon.pid) - before
        assert grown < 48, f"daemon peak RSS grew by {grown} MiB for 100 MB of (discarded) session output"
