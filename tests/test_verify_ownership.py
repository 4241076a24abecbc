"""A verifier's sandbox belongs to its verification: gone when the verification ends, however it
ends (an answer, the client gone, the daemon SIGKILLed and restarted), and a verification the node
lost is answered `infra`, never a verdict of some other run."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.daemon.verify import VERIFY_LABEL
from sandfleet.errors import SandboxError

from conftest import CGROUP_ROOT, Daemon, wait_until

JOB = {"job": "verify-ownership"}
CHECK = "touch /tmp/started; sleep 20"


def _verifiers(fleet: Client) -> list[str]:
    return [s.id for s in fleet.list() if VERIFY_LABEL in s.spec.labels]


def _started(fleet: Client, vid: str) -> bool:
    try:
        return bool(fleet.get(vid).files.exists("/tmp/started"))
    except SandboxError:
        return False


def _cgroup(d: Daemon, sandbox_id: str) -> Path:
    hierarchy = CGROUP_ROOT / "pids" if (CGROUP_ROOT / "pids").is_dir() else CGROUP_ROOT
    return hierarchy / d.cgroup_parent / sandbox_id


# httpcore's sync transport leaves the socket of a refused unix-socket connect to the garbage
# collector (connect_unix_socket does not close it): the retries while the daemon is down do that.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_verifications_cut_by_a_daemon_sigkill_answer_infra_and_leave_no_verifier(own_daemon: Daemon) -> None:
    d = own_daemon
    d.start()
    with d.client(timeout=30) as fleet:
        agent = fleet.create(SandboxSpec(image="busybox", idle_ttl=300, labels=JOB))
        traj = fleet.trajectory("verify-killed", SandboxSpec(image="busybox", idle_ttl=300, labels=JOB))
        traj.exec("echo fixed > /answer")
        got: dict[str, Any] = {}

        def plain() -> None:
            try:
                got["plain"] = agent.verify(CHECK, timeout=60)
            except SandboxError as exc:
                got["plain"] = exc

        def logged() -> None:  # the SDK retries a trajectory's verify through the restart
            try:
                got["traj"] = traj.verify(CHECK, timeout=60)
            except SandboxError as exc:
                got["traj"] = exc

        threads = [threading.Thread(target=plain), threading.Thread(target=logged)]
        for t in threads:
            t.start()
        # Both checks are running, each in a verifier sandbox of its own.
        assert wait_until(
            lambda: len(vids := _verifiers(fleet)) == 2 and all(_started(fleet, v) for v in vids), timeout=60
        ), d.log()[-2000:]
        verifiers = _verifiers(fleet)
        d.kill()
        d.start()
        for t in threads:
            t.join(timeout=120)
        plain_got, traj_got = got.get("plain"), got.get("traj")
        assert isinstance(plain_got, SandboxError) and plain_got.cause == "infra", got
        assert traj_got is not None and not isinstance(traj_got, SandboxError), got
        assert (traj_got.passed, traj_got.cause) == (False, "infra"), traj_got
        assert traj_got.error is not None and "restarted" in traj_got.error.message
        again = fleet.get_trajectory("verify-killed").verify(CHECK, timeout=60)  # the same recorded verdict
        assert again.replayed and again.cause == "infra"
        # Neither verifier was taken back by the new daemon: not listed, no cgroup, nothing running.
        assert _verifiers(fleet) == []
        assert wait_until(lambda: not any(_cgroup(d, v).exists() for v in verifiers), timeout=15)
        traj.close()
        traj.delete()
        agent.stop()


def test_a_verification_whose_client_left_still_stops_its_verifier(daemon: Daemon, fleet: Client) -> None:
    with fleet.create(SandboxSpec(image="busybox", idle_ttl=120, labels=JOB)) as sb:
        transport = httpx.HTTPTransport(uds=str(daemon.socket))
        with (
            httpx.Client(transport=transport, base_url="http://sandfleet", timeout=3) as http,
            pytest.raises(httpx.ReadTimeout),
        ):
            http.post(f"/v1/sandboxes/{sb.id}/verify", json={"command": "sleep 6", "timeout": 30})
        assert [s for s in fleet.list() if s.spec.labels.get(VERIFY_LABEL) == sb.id]
        # The verification ends (cut short, or its check done): its sandbox goes with it.
        assert wait_until(lambda: not [s for s in fleet.list() if s.spec.labels.get(VERIFY_LABEL) == sb.id], 30)
    assert fleet.list(labels=JOB) == []
