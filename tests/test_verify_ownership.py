"""A verifier's sandbox belongs to its verification: gone when the verification ends, however it
ends (an answer, the client gone, the daemon SIGKILLed and restarted), and a verification the node
lost is answered `infra`, never a verdict of some other run."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.daemon.rl.verify import VERIFY_LABEL
from sandfleet.errors import SandboxError

from conftest import CGROUP_ROOT, Daemon, destroy_daemon, make_daemon, wait_until

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


def test_verifications_cut_by_a_daemon_sigkill_answer_infra_and_leave_no_verifier() -> None:
    """Two checks running (a plain verify, a trajectory's) and a third trajectory's waiting its turn
    (two CPUs for checks) when the daemon is SIGKILLed: the two running answer infra, the waiting
    one had not started and runs when asked again, and no verifier is left."""
    d = make_daemon("verify-kill", "[verify]\ncpus = 2\n")
    try:
        d.start()
        with d.client(timeout=30) as fleet:
            agent = fleet.create(SandboxSpec(image="busybox", idle_ttl=300, labels=JOB))
            running = fleet.trajectory("verify-killed", SandboxSpec(image="busybox", idle_ttl=300, labels=JOB))
            waiting = fleet.trajectory("verify-queued", SandboxSpec(image="busybox", idle_ttl=300, labels=JOB))
            for traj in (running, waiting):
                traj.exec("echo fixed > /answer")
            got: dict[str, Any] = {}

            def call(name: str, verify: Any, check: str) -> threading.Thread:
                def run() -> None:  # the SDK retries a trajectory's verify through the restart
                    try:
                        got[name] = verify(check, timeout=60)
                    except SandboxError as exc:
                        got[name] = exc

                t = threading.Thread(target=run)
                t.start()
                return t

            threads = [call("plain", agent.verify, CHECK), call("running", running.verify, CHECK)]
            assert wait_until(
                lambda: len(vids := _verifiers(fleet)) == 2 and all(_started(fleet, v) for v in vids), timeout=60
            ), d.log()[-2000:]
            threads.append(call("waiting", waiting.verify, "test -f /answer"))
            time.sleep(1)  # in the queue: no sandbox for it
            assert len(_verifiers(fleet)) == 2
            verifiers = _verifiers(fleet)
            d.kill()
            d.start()
            for t in threads:
                t.join(timeout=120)
            plain, killed, queued = got.get("plain"), got.get("running"), got.get("waiting")
            assert isinstance(plain, SandboxError) and plain.cause == "infra", got
            assert killed is not None and not isinstance(killed, SandboxError), got
            assert (killed.passed, killed.cause) == (False, "infra"), killed
            assert killed.error is not None and "restarted" in killed.error.message
            again = fleet.get_trajectory("verify-killed").verify(CHECK, timeout=60)  # the same recorded verdict
            assert again.replayed and again.cause == "infra"
            assert queued is not None and not isinstance(queued, SandboxError), got
            assert (queued.passed, queued.cause) == (True, None), queued
            # Neither verifier was taken back by the new daemon: not listed, no cgroup, nothing running.
            assert _verifiers(fleet) == []
            assert wait_until(lambda: not any(_cgroup(d, v).exists() for v in verifiers), timeout=15)
            for traj in (running, waiting):
                traj.close()
                traj.delete()
            agent.stop()
    finally:
        destroy_daemon(d)


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
