"""Functional tests of the sandbox lifecycle API against a real daemon (busybox sandboxes).

The test daemon runs with `stopped_retention = 0`: a stopped sandbox is forgotten at once, so
"stopped" is observed as SandboxNotFoundError on the next get/exec.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import pytest

from sandfleet import (
    Client,
    ImageNotFoundError,
    InvalidArgumentError,
    Resources,
    Sandbox,
    SandboxNotFoundError,
    SandboxSpec,
    UnavailableError,
    WrongStateError,
)

if TYPE_CHECKING:
    from conftest import Daemon


def _tag() -> str:
    return uuid.uuid4().hex[:12]


def _poll(cond: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(interval)
    return cond()


def _gone(fleet: Client, sandbox_id: str) -> bool:
    try:
        info = fleet.get(sandbox_id).info
    except SandboxNotFoundError:
        return True
    return info.state in ("stopped", "failed")


@pytest.fixture
def cleanup(fleet: Client) -> Iterator[list[Sandbox]]:
    """Sandboxes a test creates outside a `with`; stopped at teardown unless already gone."""
    made: list[Sandbox] = []
    yield made
    for sb in made:
        try:
            sb.stop()
        except SandboxNotFoundError:
            pass


def test_create_get_list_stop(fleet: Client, cleanup: list[Sandbox]) -> None:
    tag = _tag()
    a = fleet.create(image="busybox", labels={"t": tag, "role": "a"})
    cleanup.append(a)
    b = fleet.create(SandboxSpec(image="busybox", labels={"t": tag, "role": "b"}))
    cleanup.append(b)
    assert a.id != b.id and a.id.startswith("sb-")
    assert a.info.state == "running"
    assert a.info.spec.labels == {"t": tag, "role": "a"}

    got = fleet.get(a.id)
    assert got.id == a.id and got.info.state == "running" and got.info.spec.image == "busybox"
    assert got.info.created_at <= got.info.last_active_at

    assert {s.id for s in fleet.list(labels={"t": tag})} == {a.id, b.id}
    assert [s.id for s in fleet.list(labels={"t": tag, "role": "b"})] == [b.id]
    assert fleet.list(labels={"t": tag, "role": "nope"}) == []
    assert {a.id, b.id} <= {s.id for s in fleet.list(state="running")}
    assert fleet.list(labels={"t": tag}, state="stopped") == []
    assert fleet.list(labels={"t": tag}, state="creating") == []

    info = a.stop()
    assert info.state == "stopped" and info.stop_reason == "user" and info.stopped_at is not None
    with pytest.raises(SandboxNotFoundError):
        fleet.get(a.id)
    assert [s.id for s in fleet.list(labels={"t": tag})] == [b.id]
    assert a.id not in {s.id for s in fleet.list(state="running")}
    # b is untouched by a's stop
    assert b.exec("echo alive").stdout == "alive\n"


def test_context_manager_stops(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        assert sb.exec("true").exit_code == 0
        sid = sb.id
    with pytest.raises(SandboxNotFoundError):
        fleet.get(sid)

    # also when the body raises; the body's exception propagates unchanged
    with pytest.raises(RuntimeError, match="boom"), fleet.create(image="busybox") as sb2:
        sid2 = sb2.id
        raise RuntimeError("boom")
    with pytest.raises(SandboxNotFoundError):
        fleet.get(sid2)


def test_attach_from_second_client(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(image="busybox", labels={"who": "first"}) as sb:
        sb.files.write("/tmp/mark", b"from-first")
        with daemon.client() as other:
            attached = other.get(sb.id)
            assert attached.id == sb.id and attached.info.spec.labels == {"who": "first"}
            r = attached.exec("cat /tmp/mark; echo; hostname")
            assert r.exit_code == 0
            assert r.stdout == f"from-first\n{sb.id}\n"
            attached.files.write("/tmp/mark2", b"from-second")
        assert sb.files.read("/tmp/mark2") == b"from-second"


def test_stop_twice(fleet: Client) -> None:
    sb = fleet.create(image="busybox")
    assert sb.stop().state == "stopped"
    # Idempotent: a second stop either reports the stopped sandbox or (retention 0) that it is gone.
    try:
        again = sb.stop()
    except SandboxNotFoundError:
        pass
    else:
        assert again.state == "stopped"
    with pytest.raises(SandboxNotFoundError):
        fleet.get(sb.id)


def test_explicit_stop_inside_with_block(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        sb.stop()


def test_exec_on_stopped_sandbox(fleet: Client) -> None:
    sb = fleet.create(image="busybox")
    sb.stop()
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        sb.exec("true")
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        sb.files.read("/etc/passwd")
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        sb.session()


def test_stop_many_by_label(fleet: Client, cleanup: list[Sandbox]) -> None:
    tag = _tag()
    doomed = [fleet.create(image="busybox", labels={"t": tag, "grp": "x"}) for _ in range(2)]
    keep_same_tag = fleet.create(image="busybox", labels={"t": tag, "grp": "y"})
    keep_other = fleet.create(image="busybox", labels={"grp": "x"})
    cleanup.extend([*doomed, keep_same_tag, keep_other])

    stopped = fleet.stop_many({"t": tag, "grp": "x"})
    assert sorted(stopped) == sorted(s.id for s in doomed)
    for s in doomed:
        with pytest.raises(SandboxNotFoundError):
            fleet.get(s.id)
    assert keep_same_tag.exec("echo y").stdout == "y\n"
    assert keep_other.exec("echo x").stdout == "x\n"
    # nothing left that matches
    assert fleet.stop_many({"t": tag, "grp": "x"}) == []
    with pytest.raises(InvalidArgumentError):
        fleet.stop_many({})


def test_spec_hostname_env_workdir_user_take_effect(fleet: Client) -> None:
    spec = SandboxSpec(image="busybox", hostname="box-one", env={"FOO": "bar baz", "PATH": "/bin:/usr/bin"},
                       workdir="/tmp", user="nobody")  # fmt: skip
    with fleet.create(spec) as sb:
        r = sb.exec('hostname; echo "$FOO"; echo "$PATH"; pwd; id -u; id -g; echo "$HOSTNAME"')
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split("\n") == ["box-one", "bar baz", "/bin:/usr/bin", "/tmp", "65534", "65534", "box-one", ""]
        # per-exec settings override the spec's defaults
        r = sb.exec('echo "$FOO"; pwd; id -u', env={"FOO": "over"}, cwd="/", user="root")
        assert r.stdout == "over\n/\n0\n"
        # the default user owns files the API writes
        assert sb.files.write("/tmp/owned", b"x").uid == 65534


def test_unknown_user_is_rejected(fleet: Client) -> None:
    with pytest.raises(InvalidArgumentError):
        fleet.create(image="busybox", user="no-such-user")
    with fleet.create(image="busybox") as sb, pytest.raises(InvalidArgumentError):
        sb.exec("true", user="no-such-user")


def test_idle_ttl_stops_sandbox(fleet: Client) -> None:
    t0 = time.monotonic()
    sb = fleet.create(image="busybox", idle_ttl=1)
    try:
        assert _poll(lambda: _gone(fleet, sb.id), timeout=10), "idle sandbox was not reaped"
        assert time.monotonic() - t0 >= 1.0
        with pytest.raises((WrongStateError, SandboxNotFoundError)):
            sb.exec("true")
    finally:
        if not _gone(fleet, sb.id):
            sb.stop()


def test_activity_postpones_idle_ttl(fleet: Client) -> None:
    with fleet.create(image="busybox", idle_ttl=1.5) as sb:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:  # twice the ttl, but never idle for long
            assert sb.exec("true").exit_code == 0
            time.sleep(0.3)
        assert fleet.get(sb.id).info.state == "running"


def test_running_exec_keeps_idle_sandbox_alive(fleet: Client) -> None:
    sb = fleet.create(image="busybox", idle_ttl=1)
    try:
        r = sb.exec("sleep 3; echo survived", timeout=20)
        assert r.exit_code == 0 and r.stdout == "survived\n"
        assert fleet.get(sb.id).info.state == "running"
        # a streamed exec counts as activity too
        events = list(sb.exec_stream("sleep 2.5; echo streamed", timeout=20))
        assert events[-1].type == "exit" and events[-1].result is not None and events[-1].result.exit_code == 0
        assert fleet.get(sb.id).info.state == "running"
        # and once idle it does get reaped
        assert _poll(lambda: _gone(fleet, sb.id), timeout=10)
    finally:
        if not _gone(fleet, sb.id):
            sb.stop()


def test_max_lifetime_stops_busy_sandbox(fleet: Client) -> None:
    t0 = time.monotonic()
    sb = fleet.create(image="busybox", idle_ttl=300, max_lifetime=1.5)
    try:

        def busy_then_gone() -> bool:
            try:
                sb.exec("true")
            except (WrongStateError, SandboxNotFoundError):
                return True
            return False

        assert _poll(busy_then_gone, timeout=10, interval=0.1)
        assert time.monotonic() - t0 >= 1.4
    finally:
        if not _gone(fleet, sb.id):
            sb.stop()


def test_max_lifetime_interrupts_running_exec(fleet: Client) -> None:
    sb = fleet.create(image="busybox", idle_ttl=None, max_lifetime=1)
    try:
        t0 = time.monotonic()
        with pytest.raises((UnavailableError, SandboxNotFoundError, WrongStateError)):
            sb.exec("sleep 60", timeout=60)
        assert time.monotonic() - t0 < 15
        assert _poll(lambda: _gone(fleet, sb.id), timeout=5)
    finally:
        if not _gone(fleet, sb.id):
            sb.stop()


def test_unknown_image(fleet: Client) -> None:
    with pytest.raises(ImageNotFoundError):
        fleet.create(image="no-such-image:nope")
    assert fleet.health()["status"] == "ok"


def test_unsupported_backend(fleet: Client) -> None:
    with pytest.raises(InvalidArgumentError, match="microvm"):
        fleet.create(image="busybox", backend="microvm")


def test_failed_creates_leave_nothing_behind(fleet: Client) -> None:
    tag = _tag()
    for kwargs in ({"image": "no-such-image"}, {"backend": "microvm"}, {"user": "ghost"}):
        with pytest.raises((ImageNotFoundError, InvalidArgumentError)):
            fleet.create(labels={"t": tag}, **kwargs)  # type: ignore[arg-type]
    assert fleet.list(labels={"t": tag}) == []


def test_resources_are_reported_in_spec(fleet: Client) -> None:
    with fleet.create(image="busybox", resources=Resources(cpu=0.5, memory="64MiB", pids=32, disk="4MiB")) as sb:
        res = fleet.get(sb.id).info.spec.resources
        assert (res.cpu, res.memory, res.pids, res.disk) == (0.5, 64 * 1024**2, 32, 4 * 1024**2)
        assert sb.exec("echo ok").stdout == "ok\n"


@pytest.mark.parametrize("bad_id", ["", "..", "x/exec"])
def test_get_malformed_id(fleet: Client, bad_id: str) -> None:
    with pytest.raises((SandboxNotFoundError, InvalidArgumentError)) as exc_info:
        fleet.get(bad_id)
    assert not (isinstance(exc_info.value, InvalidArgumentError) and "method not allowed" in str(exc_info.value))


def test_readme_example_python_image(fleet: Client) -> None:
    """The README flow on the Debian-based python:3.11 image (builds debian + python once, then cached)."""
    with fleet.create(image="python:3.11", resources=Resources(cpu=1, memory="1GiB"), timeout=1800) as sb:
        r = sb.exec("echo hello && uname -a")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith("hello\nLinux ")
        sb.files.write("/task/a.py", b"print(6*7)")
        r = sb.exec("python3 /task/a.py")
        assert (r.exit_code, r.stdout, r.stderr) == (0, "42\n", "")
        assert sb.exec(["python3", "-c", "import sys; print(sys.version_info[:2])"]).stdout == "(3, 11)\n"
