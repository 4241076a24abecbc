"""Regression tests for what attacking and fuzzing a node found: wedged agents, forged session
results, floods, costly sandbox-chosen work on the daemon, poisoned listings, 500s for bad input,
mount points removed through the files API, faults of the state store, TTLs across restarts and
creates nobody heard about. Each test failed before its fix.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandfleet import Client, Sandbox
from sandfleet.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    SandboxError,
    SandboxNotFoundError,
    SandboxTimeoutError,
    UnavailableError,
    WrongStateError,
)

from conftest import Daemon, agent_pid, destroy_daemon, make_daemon, wait_until

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _http(d: Daemon) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://sandfleet", timeout=60)


def _rss_hwm(pid: int) -> int:
    """Peak resident memory of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


def _reset_hwm(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _freezer(d: Daemon, sandbox_id: str) -> Path:
    return CGROUP_ROOT / "freezer" / d.cgroup_parent / sandbox_id / "freezer.state"


@pytest.fixture
def python_sb(fleet: Client) -> Iterator[Sandbox]:
    with fleet.create(image="python:3.11", idle_ttl=300) as sb:
        yield sb


# -- the daemon never waits forever on a sandbox ---------------------------------------------------

STOPPER = r"""
import os, signal, time
end = time.time() + 40
while time.time() < end:
    for p in os.listdir('/proc'):
        if p.isdigit() and p != '1' and int(p) != os.getpid():
            try:
                if open(f'/proc/{p}/comm').read().strip() == 'sandfleet-agent':
                    os.kill(int(p), signal.SIGSTOP)  # the agent's child, between fork and exec
            except OSError:
                pass
"""


def test_child_stopped_before_exec_does_not_wedge_the_agent(python_sb: Sandbox) -> None:
    """A sandbox process SIGSTOPs the agent's child between fork and exec: the exec still ends at
    its timeout, and the agent goes on serving other requests."""
    python_sb.files.write("/tmp/stopper.py", STOPPER)
    stopper = python_sb.start("python3 /tmp/stopper.py")
    # a long PATH keeps the child between fork and exec long enough for the stopper to catch it
    path = ":".join(f"/n{i}" for i in range(2400)) + ":/bin:/usr/bin"
    caught = 0
    for _ in range(20):
        t0 = time.monotonic()
        r = python_sb.exec(["true"], env={"PATH": path}, timeout=2)
        assert time.monotonic() - t0 < 10, "the exec did not end by its timeout"
        caught += r.timed_out
        if caught >= 2:
            break
    assert caught >= 1, "the stopper never caught a child before its exec (test did not test anything)"
    stopper.kill()
    # the agent still answers
    assert python_sb.exec(["echo", "alive"], timeout=10).stdout == "alive\n"


@pytest.mark.slow
def test_unresponsive_agent_is_reported_and_ttls_still_apply(daemon: Daemon, fleet: Client) -> None:
    """An agent that stops answering (its whole sandbox frozen from the host): the exec gets a
    typed error by the daemon's own deadline, an event says so, and the idle TTL still stops it."""
    # An idle TTL longer than the exec's deadline: the events are read before it stops the sandbox.
    sb = fleet.create(image="busybox", idle_ttl=12)
    state = _freezer(daemon, sb.id)
    failures: list[BaseException] = []

    def run() -> None:
        try:
            sb.exec("sleep 30", timeout=1)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    t0 = time.monotonic()
    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.3)
    state.write_text("FROZEN")
    try:
        worker.join(40)
        assert not worker.is_alive(), "the exec never answered"
        assert failures and isinstance(failures[0], UnavailableError), failures
        assert time.monotonic() - t0 < 30
        assert any(e.kind == "agent_unresponsive" for e in sb.events())
        # the idle TTL applies although the agent never answered: stopped (thawed to die)
        assert wait_until(lambda: _stopped(fleet, sb.id), timeout=30)
    finally:
        if state.exists():
            state.write_text("THAWED")
        sb.stop()


# -- sessions: results that cannot be forged, floods that cost the daemon nothing -------------------

FORGER = r"""
import os, time
end = time.time() + 20
while time.time() < end:
    for p in os.listdir('/proc'):
        if not p.isdigit() or int(p) == os.getpid():
            continue
        for fd in os.listdir(f'/proc/{p}/fd') if os.access(f'/proc/{p}/fd', os.R_OK) else []:
            path = f'/proc/{p}/fd/{fd}'
            try:  # steal the script (and its nonce), or plant a report / output
                with open(path, 'rb', buffering=0) as f:
                    os.set_blocking(f.fileno(), False)
                    data = f.read(4096)
                    if data:
                        open('/tmp/stolen', 'ab').write(data)
            except OSError:
                pass
            try:
                with open(path, 'wb', buffering=0) as f:
                    f.write(b'00000000000000000000000000000000 0\n__FORGED__\n')
            except OSError:
                pass
    time.sleep(0.01)
"""


def test_session_results_cannot_be_forged(python_sb: Sandbox) -> None:
    python_sb.files.write("/tmp/forger.py", FORGER)
    with python_sb.session() as s:
        # fds a subshell of the session inherits: it tries to report a status of its own
        s.run("( for i in $(seq 300); do printf '%s 0\\n' 00000000000000000000000000000000 >&100; done ) "
              ">/dev/null 2>&1 &")  # fmt: skip
        python_sb.start("python3 /tmp/forger.py")
        time.sleep(0.5)
        for _ in range(20):
            r = s.run("echo real; (exit 7)")
            assert (r.exit_code, r.stdout) == (7, "real\n"), r
        assert s.run("echo ok").stdout == "ok\n"
    stolen = python_sb.exec("cat /tmp/stolen 2>/dev/null").stdout
    assert "command printf" not in stolen, "the session's script was readable by another process"


PEEK = r"""
import ctypes, os, sys
pid = int(sys.argv[1])
out = []
for what in (f"/proc/{pid}/fd/0", f"/proc/{pid}/fd/100", f"/proc/{pid}/mem", f"/proc/{pid}/environ"):
    try:
        os.readlink(what) if "/fd/" in what else open(what, "rb").read(1)
        out.append(what + ": open")
    except OSError as exc:
        out.append(what + ": " + exc.strerror)
libc = ctypes.CDLL(None, use_errno=True)
pidfd = os.pidfd_open(pid)
fd = libc.syscall(438, pidfd, 0, 0)  # pidfd_getfd: the shell's stdin
out.append("pidfd_getfd: " + ("got it" if fd >= 0 else os.strerror(ctypes.get_errno())))
out.append("ptrace: " + ("attached" if libc.ptrace(16, pid, 0, 0) == 0 else os.strerror(ctypes.get_errno())))
print("\n".join(out))
"""


def test_session_shells_are_out_of_reach_of_other_processes(python_sb: Sandbox) -> None:
    """A bash session's shell is non-dumpable: no process of the sandbox, even root, can read its
    fds, memory or environment, take its fds or trace it (a plain exec'd shell is the control)."""
    python_sb.files.write("/tmp/peek.py", PEEK)
    with python_sb.session() as s:
        shell = int(s.run("echo $$").stdout)
        assert s.run("id -u; id -g; id -G").stdout == "0\n0\n0\n"  # its own identity is unchanged
        report = python_sb.exec(["python3", "/tmp/peek.py", str(shell)]).stdout
        assert "open" not in report and "got it" not in report and "attached" not in report, report
        control = python_sb.start("echo $$ > /tmp/control.pid; exec sleep 30")
        assert wait_until(lambda: python_sb.exec("cat /tmp/control.pid").stdout.strip() != "", 10)
        target = int(python_sb.exec("cat /tmp/control.pid").stdout)
        assert "/fd/0: open" in python_sb.exec(["python3", "/tmp/peek.py", str(target)]).stdout
        control.kill()


def test_session_output_flood_costs_the_daemon_nothing(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", idle_ttl=120, resources={"cpu": 0.5}) as sb, sb.session() as s:
        s.run("(yes > /dev/stdout &); (yes &)")
        time.sleep(0.5)
        before = _cpu_seconds(daemon.pid)
        time.sleep(3)
        used = (_cpu_seconds(daemon.pid) - before) / 3
        assert used < 0.10, f"the daemon used {used:.0%} of a core forwarding a session's background flood"
        r = s.run("echo done", output_limit=1000)
        assert r.exit_code == 0 and len(r.stdout) <= 1000
        assert any(e.kind == "session_output_dropped" and e.data["bytes"] > 0 for e in sb.events())


# -- work done for a sandbox is bounded by the sandbox ----------------------------------------------


def test_huge_passwd_costs_the_daemon_nothing(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", idle_ttl=120, resources={"disk": "256MiB", "memory": "512MiB"}) as sb:
        sb.exec("yes 'x:x:1:1::/:/bin/sh' | head -c 62000000 >> /etc/passwd; "
                "echo 'lastuser:x:4242:4242::/home/last:/bin/sh' >> /etc/passwd", timeout=60)  # fmt: skip
        _reset_hwm(daemon.pid)
        base = _rss_hwm(daemon.pid)
        assert sb.exec("id -u", user="nobody").stdout == "65534\n"  # found near the top
        with pytest.raises(InvalidArgumentError):
            sb.exec("id -u", user="lastuser")  # past the parser's cap: a typed error, not 170 MiB
        assert _rss_hwm(daemon.pid) - base < 30


@pytest.mark.slow
def test_deep_trees_cost_bounded_memory_and_fds(daemon: Daemon, fleet: Client, tmp_path: Path) -> None:
    with fleet.create(image="python:3.11", idle_ttl=300, resources={"disk": "512MiB"}) as sb:
        sb.exec("python3 -c \"import os\nos.chdir('/tmp')\nfor i in range(15000):\n os.mkdir('d')\n os.chdir('d')\"",
                timeout=120)  # fmt: skip
        _reset_hwm(daemon.pid)
        base = _rss_hwm(daemon.pid)
        fds_before = len(os.listdir(f"/proc/{daemon.pid}/fd"))
        sb.files.remove("/tmp/d", recursive=True)
        assert _rss_hwm(daemon.pid) - base < 40
        assert len(os.listdir(f"/proc/{daemon.pid}/fd")) - fds_before < 20
        assert not sb.files.exists("/tmp/d")
        # a 1,200-deep tree downloads, or is refused with a typed error: never a 500
        sb.exec("python3 -c \"import os\nos.chdir('/tmp')\nfor i in range(1200):\n os.mkdir('e')\n os.chdir('e')\"")
        try:
            sb.files.download("/tmp/e", tmp_path / "out")
        except SandboxError as exc:
            assert exc.code in ("invalid_argument", "resource_exhausted"), exc
        finally:  # deeper than shutil.rmtree's recursion (pytest's cleanup of tmp_path)
            subprocess.run(["rm", "-rf", str(tmp_path / "out")], check=False)


def test_sparse_file_download_is_bounded_by_what_the_sandbox_holds(daemon: Daemon, fleet: Client) -> None:
    """A sparse 900 MiB file in a 64 MiB-disk sandbox: the download carries what it stores (a GNU
    sparse member), never 900 MiB spooled on the node and sent."""
    with fleet.create(image="busybox", idle_ttl=120, resources={"disk": "64MiB"}) as sb, _http(daemon) as http:
        sb.exec("truncate -s 900M /tmp/sparse && echo tail >> /tmp/sparse")
        _reset_hwm(daemon.pid)
        base = _rss_hwm(daemon.pid)
        t0 = time.monotonic()
        with http.stream("GET", f"/v1/sandboxes/{sb.id}/files/tar", params={"path": "/tmp/sparse"}) as resp:
            assert resp.status_code == 200, resp.read()[:300]
            got = sum(len(chunk) for chunk in resp.iter_bytes())
        assert got < 8 * 1024**2, f"{got} bytes sent for a file that stores a few KiB"
        assert time.monotonic() - t0 < 10
        assert _rss_hwm(daemon.pid) - base < 64


# -- bad input is a 4xx and poisons nothing -------------------------------------------------------------


def test_lone_surrogates_are_refused_and_listing_survives(daemon: Daemon, fleet: Client) -> None:
    with _http(daemon) as http:
        for body in (
            '{"image": "busybox", "labels": {"a": "\\ud800"}}',
            '{"image": "busybox", "env": {"A": "x\\udfff"}}',
            '{"image": "busybox", "workdir": "/\\ud800"}',
        ):
            r = http.post("/v1/sandboxes", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_argument", r.text
        # a valid surrogate pair (an emoji written as escapes) is fine
        r = http.post("/v1/sandboxes", content='{"image": "busybox", "labels": {"e": "\\ud83d\\ude00"}}',
                      headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        r = http.post("/v1/sandboxes", content=b'{"image": "busybox", "labels": {"a": "\xff"}}',
                      headers={"content-type": "application/json"})  # fmt: skip
        assert r.status_code == 400
        assert http.get("/v1/sandboxes").status_code == 200
        assert fleet.list() is not None
        for path in (f"/v1/sandboxes/{sid}/fork", "/v1/snapshots/snap-0000000000000000/restore"):
            r = http.post(path, json={"count": 1, "labels": {"bad key!": "v"}})
            assert r.status_code == 400, r.text
        http.delete(f"/v1/sandboxes/{sid}")
        assert isinstance(fleet.list(state="all"), list)


def test_requests_that_can_be_validated_are_4xx(daemon: Daemon, sandbox: Sandbox) -> None:
    big = "v" * (32 * 1024**2)
    with _http(daemon) as http:
        cases = [
            ("POST", f"/v1/sandboxes/{sandbox.id}/sessions", {"cwd": ""}),
            ("POST", f"/v1/sandboxes/{sandbox.id}/sessions", {"env": {"BAD-NAME": "1"}}),
            ("POST", "/v1/sandboxes", {"image": "busybox", "env": {"BIG": big}}),
            ("POST", f"/v1/sandboxes/{sandbox.id}/pack", {"image": "a" * 300}),
            ("POST", f"/v1/sandboxes/{sandbox.id}/exec", {"command": "true", "env": {"BIG": "x" * 20000}}),
        ]
        for method, path, body in cases:
            r = http.request(method, path, json=body)
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
            assert len(r.content) < 4096, "an error echoed unbounded input"
        sid = http.post(f"/v1/sandboxes/{sandbox.id}/sessions", json={}).json()["id"]
        r = http.post(f"/v1/sandboxes/{sandbox.id}/sessions/{sid}/run", json={"command": ""})
        assert r.status_code == 400
        r = http.post(
            f"/v1/sandboxes/{sandbox.id}/exec", content=b"\xff\xfe{", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "internal" not in r.text
        ref = "a" * 300
        for method, path, params in (
            ("DELETE", f"/v1/images/{ref}", None),
            ("POST", "/v1/images/build", {"ref": ref}),
            ("POST", "/v1/images/push", {"ref": ref}),
        ):
            r = http.request(method, path, params=params)
            assert r.status_code in (400, 404), (path, r.status_code, r.text[:200])
        # a failed pack leaves no unnamed layer behind
        layers = IMAGES_DIR / "layers"
        before = set(os.listdir(layers)) if layers.exists() else set()
        r = http.post(f"/v1/sandboxes/{sandbox.id}/pack", json={"image": "UPPER:case"})
        assert r.status_code == 400
        assert (set(os.listdir(layers)) if layers.exists() else set()) == before


def test_files_api_cannot_remove_the_sandboxs_mount_points(sandbox: Sandbox) -> None:
    for path in ("/proc", "/dev", "/sys", "/dev/shm", "/"):
        for recursive in (False, True):
            with pytest.raises((PermissionDeniedError, InvalidArgumentError, WrongStateError)):
                sandbox.files.remove(path, recursive=recursive)
    assert sandbox.exec("cat /proc/self/comm; ls /dev/null").exit_code == 0
    sandbox.files.write("/tmp/x", b"x")
    sandbox.files.remove("/tmp/x")
    snap = sandbox.snapshot()  # the sandbox is whole: still snapshottable
    assert snap.id


# -- state that survives faults -------------------------------------------------------------------------


@pytest.mark.slow
def test_ttls_hold_across_a_daemon_crash(own_daemon: Daemon) -> None:
    own_daemon.start()
    with own_daemon.client() as c:
        used = c.create(image="busybox", idle_ttl=8)
        held = c.create(image="busybox", idle_ttl=3)
        held.pause()
        used.exec("true")
        time.sleep(2.6)  # used 2.6 s ago: not yet flushed (every 5 s)
        own_daemon.kill()
        own_daemon.start()
    with own_daemon.client() as c:
        time.sleep(1.5)
        assert c.get(used.id).info.state == "running", "reaped right after the restart"
        time.sleep(3)
        assert c.get(held.id).info.state == "paused", "a sandbox paused on request lost its hold in the restart"
        assert wait_until(lambda: c.get(used.id).info.state != "running" if _exists(c, used.id) else True, 15)


def _stopped(c: Client, sandbox_id: str) -> bool:
    """Stopped, or already forgotten (a daemon with no stopped_retention drops it at once)."""
    try:
        return c.get(sandbox_id).info.state in ("stopped", "failed")
    except SandboxNotFoundError:
        return True


def _exists(c: Client, sandbox_id: str) -> bool:
    try:
        c.get(sandbox_id)
    except SandboxNotFoundError:
        return False
    return True


def test_corrupt_state_database_is_set_aside_and_sandboxes_taken_back(own_daemon: Daemon) -> None:
    own_daemon.start()
    with own_daemon.client() as c:
        sb = c.create(image="busybox", labels={"job": "x"}, idle_ttl=300)
        sb.exec("echo before > /tmp/mark")
    own_daemon.kill()
    db = own_daemon.state_dir / "state.db"
    db.write_bytes(b"this is not a database" * 100)
    for extra in ("state.db-wal", "state.db-shm"):
        (own_daemon.state_dir / extra).unlink(missing_ok=True)
    own_daemon.start()
    assert list(own_daemon.state_dir.glob("state.db.corrupt-*")), "the damaged file was not kept aside"
    with own_daemon.client() as c:
        again = c.get(sb.id)  # taken back from the node, still driven
        assert again.exec("cat /tmp/mark").stdout == "before\n"
        assert any(e.kind == "recovered" for e in again.events())
        again.stop()
    assert "state database" in own_daemon.log()


def test_stop_on_a_full_state_disk_stops_or_says_it_did_not(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.system(f"mount -t tmpfs -o size=4m sandfleet-test-full {state}")
    d = make_daemon("fulldisk")
    try:
        d.config.write_text(d.config.read_text().replace(f'state_dir = "{d.state_dir}"', f'state_dir = "{state}"'))
        d.state_dir = state
        d.start()
        with d.client() as c:
            sb = c.create(image="busybox", idle_ttl=300)
            pid = agent_pid(d, sb.id)
            filler = state / "filler"
            os.system(f"dd if=/dev/zero of={filler} bs=64k >/dev/null 2>&1")
            try:
                sb.stop()
                stopped = True
            except SandboxError as exc:
                assert exc.code != "internal" or "could not be stopped" in exc.message
                stopped = False
            if stopped:
                assert wait_until(lambda: not Path(f"/proc/{pid}").exists(), 10), "stop() said yes, it still runs"
        d.kill()
        filler.unlink(missing_ok=True)
        d.start()
        with d.client() as c:
            assert all(s.id != sb.id for s in c.list()), "it came back as running after a restart"
    finally:
        destroy_daemon(d)
        os.system(f"umount -l {state}")


# -- creates nobody heard about ----------------------------------------------------------------------


def test_idempotency_key_returns_the_same_sandbox(daemon: Daemon, fleet: Client) -> None:
    with _http(daemon) as http:
        key = f"k-{os.getpid()}-{time.time_ns()}"
        a = http.post("/v1/sandboxes", json={"image": "busybox"}, headers={"Idempotency-Key": key})
        b = http.post("/v1/sandboxes", json={"image": "busybox"}, headers={"Idempotency-Key": key})
        assert a.status_code == 201 and b.status_code == 201
        assert a.json()["id"] == b.json()["id"]
        c = http.post(
            "/v1/sandboxes", json={"image": "busybox", "labels": {"x": "y"}}, headers={"Idempotency-Key": key}
        )
        assert c.status_code == 400  # the same key for another request
        fleet.get(a.json()["id"]).stop()


def test_create_answered_by_nobody_is_claimed_by_its_retry_or_reaped() -> None:
    """The daemon dies between a create's commit and its answer (a failpoint): a retry with the
    same idempotency key gets that very sandbox; one created without a key is reaped at restart."""
    d = make_daemon("failpoint")

    def start(crash: bool) -> None:
        if crash:
            os.environ["SANDFLEET_FAILPOINTS"] = "create_before_answer"
        try:
            d.start()
        finally:
            os.environ.pop("SANDFLEET_FAILPOINTS", None)

    try:
        for headers in ({"Idempotency-Key": "retry-me"}, {}):
            start(crash=True)
            with _http(d) as http, pytest.raises(httpx.HTTPError):
                http.post("/v1/sandboxes", json={"image": "busybox"}, headers=headers)
            assert wait_until(lambda: not d.process.alive(), 10)
        start(crash=False)
        with d.client() as c:
            live = c.list()
            assert len(live) == 1, f"expected only the keyed create to be kept, found {live}"
            with _http(d) as http:
                r = http.post("/v1/sandboxes", json={"image": "busybox"}, headers={"Idempotency-Key": "retry-me"})
            assert r.status_code == 201 and r.json()["id"] == live[0].id
            assert len(c.list()) == 1
    finally:
        destroy_daemon(d)


IMAGES_DIR = Path(os.environ.get("SANDFLEET_TEST_IMAGES", "/var/lib/sandfleet/images"))


# -- clients never hang ------------------------------------------------------------------------------


@pytest.mark.slow
def test_client_calls_end_by_their_deadline_against_a_stopped_daemon(own_daemon: Daemon) -> None:
    own_daemon.start()
    with own_daemon.client(timeout=3) as c:
        sb = c.create(image="busybox", idle_ttl=120)
        s = sb.session()
        os.kill(own_daemon.pid, signal.SIGSTOP)
        try:
            for call in (
                lambda: sb.exec("sleep 1", timeout=None),  # streamed: a deadline on silence
                lambda: s.run("sleep 1", timeout=None),
                lambda: c.create(image="busybox"),
                lambda: sb.snapshot(),
                lambda: sb.fork(1),
                lambda: c.pause_many({"x": "y"}),
                lambda: c.images(),
            ):
                t0 = time.monotonic()
                with pytest.raises(SandboxTimeoutError):
                    call()
                assert time.monotonic() - t0 < 20
        finally:
            os.kill(own_daemon.pid, signal.SIGCONT)
        assert sb.exec("echo back").stdout == "back\n"
    # The calls queued while it was stopped all run now, their callers gone (a create, a snapshot and a
    # fork of this sandbox among them): on a busy node the stop after them can take longer than 3 s.
    with own_daemon.client(timeout=60) as c:
        c.get(sb.id).stop()
