"""Trajectories: each step taken exactly once through trainer and daemon deaths; replays answer the
logged result; the reproducibility record; failures typed by cause."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from sandfleet import Client, SandboxSpec
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    UnavailableError,
    WrongStateError,
)

from conftest import EXPECT, Daemon, agent_pid, destroy_daemon, make_daemon, wait_until

TRAINER = Path(__file__).with_name("rl_trainer.py")


def _spec(job: str, **kw: Any) -> SandboxSpec:
    return SandboxSpec(image="busybox", idle_ttl=300, labels={"job": job}, **kw)


def test_steps_run_once_and_replay_the_log(fleet: Client) -> None:
    traj = fleet.trajectory("unit-replay", _spec("traj-unit"), seed=42, metadata={"task": "counter"})
    try:
        assert traj.sandbox is not None and traj.info.state == "open"
        bump = "echo x >> /count; wc -l < /count; echo seed=$SANDFLEET_SEED"
        first = [traj.exec(bump) for _ in range(3)]
        assert [r.stdout.split()[0] for r in first] == ["1", "2", "3"]
        assert "seed=42" in first[0].stdout
        assert traj.last is not None and not traj.last.replayed

        # A restarted trainer opens it again (same arguments) and replays from step 0.
        again = fleet.trajectory("unit-replay", _spec("traj-unit"), seed=42, metadata={"task": "counter"})
        assert again.sandbox is not None and again.sandbox.id == traj.sandbox.id
        replayed = [again.exec(bump) for _ in range(3)]
        assert replayed == first and again.last is not None and again.last.replayed
        fourth = again.exec(bump)
        assert fourth.stdout.split()[0] == "4" and not again.last.replayed
        assert traj.sandbox.exec("wc -l < /count").stdout.strip() == "4"  # nothing ran twice

        # The recorded action is the step's: another one at that step is refused, and so are gaps.
        with pytest.raises(InvalidArgumentError, match="another action"):
            fleet.trajectory("unit-replay", _spec("traj-unit"), seed=42, metadata={"task": "counter"}).exec("true")
        with pytest.raises(WrongStateError, match="step 4"):
            again.step(_exec("true"), step=9)
        with pytest.raises(InvalidArgumentError, match="other arguments"):
            fleet.trajectory("unit-replay", _spec("traj-unit"), seed=7)

        # Files and snapshots are steps too; an error is a recorded result, typed, the agent's fault.
        assert again.write("/task/a.txt", "hello").size == 5
        assert again.read("/task/a.txt") == b"hello"
        with pytest.raises(NotFoundError) as missing:
            again.read("/task/none.txt")
        assert missing.value.cause == "agent"
        snap = again.snapshot()
        steps = again.steps()
        assert [s.kind for s in steps] == ["exec"] * 4 + ["write", "read", "read", "snapshot"]
        assert steps[6].error is not None and steps[6].cause == "agent"
        assert again.refresh().failures == {"agent": 1}

        rec = again.record()
        assert rec.trajectory.seed == 42 and rec.trajectory.metadata == {"task": "counter"}
        assert rec.layers and all(x.startswith("sha256:") for x in rec.layers)
        assert rec.spec is not None and rec.spec.env.get("SANDFLEET_SEED") == "42"
        assert rec.snapshots == [snap] and len(rec.actions) == 8
        assert rec.actions[0]["exec"]["command"] == bump
        assert rec.node.sandfleet and rec.node.agent.startswith("sandfleet-agent/") and rec.node.kernel

        info = again.close(reward=0.5)
        assert info.state == "closed" and info.reward == 0.5
        assert traj.sandbox.id not in {s.id for s in fleet.list()}  # stopped with it
        with pytest.raises(WrongStateError, match="closed"):
            again.exec("true")
        assert again.close().reward == 0.5  # closing again changes nothing
        listed = fleet.trajectories({"sandfleet.trajectory": "unit-replay"})
        assert listed == [] or listed[0].id == "unit-replay"
        assert [t.id for t in fleet.trajectories(state="closed") if t.id == "unit-replay"] == ["unit-replay"]
        fleet.delete_snapshot(snap)
    finally:
        with pytest.raises(NotFoundError):
            traj.delete()
            traj.refresh()


def _exec(command: str) -> Any:
    from sandfleet.models import ExecAction, ExecRequest

    return ExecAction(exec=ExecRequest(command=command))


def test_bad_trajectory_requests_are_typed(fleet: Client) -> None:
    with pytest.raises(InvalidArgumentError):
        fleet.trajectory("bad id!", _spec("traj-bad"))
    with pytest.raises(InvalidArgumentError):
        fleet.trajectory("no-place")  # neither spec, snapshot nor sandbox
    with pytest.raises(NotFoundError):
        fleet.trajectory("no-snapshot", snapshot_id="snap-doesnotexist")
    with pytest.raises(NotFoundError):  # a refused open leaves no trajectory behind
        fleet.get_trajectory("no-snapshot")
    with fleet.create(image="busybox", idle_ttl=60) as sb:
        t = fleet.trajectory("existing-sandbox", sandbox_id=sb.id)
        assert t.exec("echo hi").stdout == "hi\n"
        t.close()
        assert sb.refresh().state == "running"  # a sandbox it did not make stays the caller's
        t.delete()
    with pytest.raises(NotFoundError):
        fleet.get_trajectory("never-opened")


def _start_trainer(d: Daemon, prefix: str, out: Path, rollouts: int, steps: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(TRAINER), "--socket", str(d.socket), "--prefix", prefix, "--out", str(out)]
        + ["--rollouts", str(rollouts), "--steps", str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def _check_exactly_once(fleet: Client, prefix: str, out: Path, rollouts: int, steps: int) -> None:
    """Every rollout's sandbox ran each step's command exactly once, in order, and every answer any
    trainer got for a step is the one in the log."""
    seen: dict[tuple[str, int], set[str]] = {}
    for rec in _records(out):
        assert "error" not in rec, rec
        seen.setdefault((rec["rollout"], rec["step"]), set()).add(rec["stdout"])
    for r in range(rollouts):
        rid = f"{prefix}-{r}"
        traj = fleet.get_trajectory(rid)
        logged = traj.steps()
        assert len(logged) == steps and traj.info.state == "closed"
        assert traj.sandbox is not None
        ran = traj.sandbox.exec("cat /ran.log").stdout.split()
        assert ran == [f"step-{i}" for i in range(steps)], f"{rid}: {ran}"
        for i, step in enumerate(logged):
            assert step.exec is not None and step.exec.stdout == f"{i}:{1000 + r}:{i + 1}\n"
            assert seen[(rid, i)] == {step.exec.stdout}, (rid, i, seen[(rid, i)])
        traj.sandbox.stop()
        traj.delete()


@pytest.mark.slow
def test_trainer_sigkilled_mid_rollout_completes_each_step_once(daemon: Daemon, tmp_path: Path) -> None:
    rollouts, steps = 3, 6
    out = tmp_path / "answers.jsonl"
    trainer = _start_trainer(daemon, "preempt", out, rollouts, steps)
    for kill_after in (3, 9):  # killed twice, each time while a step runs (they last 0.3 s)
        assert wait_until(lambda n=kill_after: out.exists() and len(_records(out)) >= n, timeout=60)
        time.sleep(0.15)
        trainer.send_signal(signal.SIGKILL)
        trainer.communicate()
        trainer = _start_trainer(daemon, "preempt", out, rollouts, steps)
    output, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, output.decode()
    with daemon.client() as fleet:
        _check_exactly_once(fleet, "preempt", out, rollouts, steps)
    replays = [r for r in _records(out) if r["replayed"]]
    assert replays, "the restarted trainers replayed nothing"


@pytest.mark.slow
def test_daemon_restart_mid_rollout_completes_each_step_once(own_daemon: Daemon, tmp_path: Path) -> None:
    """A daemon stopped (SIGTERM) and started again while a trainer drives rollouts: it finishes the
    running step first, the trainer's calls wait for the new one, nothing runs twice."""
    d = own_daemon
    d.start()
    rollouts, steps = 2, 6
    out = tmp_path / "answers.jsonl"
    trainer = _start_trainer(d, "restart", out, rollouts, steps)
    assert wait_until(lambda: out.exists() and len(_records(out)) >= 4, timeout=60)
    d.stop()
    time.sleep(0.5)
    d.start()
    output, _ = trainer.communicate(timeout=120)
    assert trainer.returncode == 0, output.decode()
    with d.client() as fleet:
        _check_exactly_once(fleet, "restart", out, rollouts, steps)


def test_a_trajectory_holds_its_sandbox_past_the_claim_window() -> None:
    """A trainer that thinks longer than the node's claim window before its first step still finds
    the trajectory's sandbox: the trajectory claimed it (it was reaped as a create nobody heard of
    unless the client happened to name the sandbox, as the SDK does; a plain HTTP client does not)."""
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    d = make_daemon("claim", "claim_window = 1\n")
    try:
        d.start()
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://node") as http:
            opened = http.post("/v1/trajectories", json={"id": "slow-thinker", "spec": {"image": "busybox"}})
            assert opened.status_code == 200, opened.text
            time.sleep(2.5)  # the claim window, and a few reaper sweeps, pass before the first step
            step = http.post(
                "/v1/trajectories/slow-thinker/steps",
                json={"step": 0, "action": {"kind": "exec", "exec": {"command": "echo still-here"}}},
            )
            assert step.status_code == 200, step.text
            assert step.json()["exec"]["stdout"] == "still-here\n"
    finally:
        destroy_daemon(d)


def test_daemon_killed_mid_step_never_runs_it_twice(own_daemon: Daemon) -> None:
    """SIGKILL while a step runs: its output is gone with the daemon, so it is answered as an infra
    failure (the trainer masks it), logged, and never run again; the rollout goes on."""
    d = own_daemon
    d.start()
    with d.client(timeout=30) as fleet:
        traj = fleet.trajectory("killed-mid-step", _spec("traj-kill"))
        traj.exec("echo before >> /ran.log")
        got: dict[str, Any] = {}

        def long_step() -> None:
            try:
                got["result"] = traj.exec("echo long >> /ran.log; sleep 2; echo done", timeout=30)
            except SandboxError as exc:
                got["error"] = exc

        t = threading.Thread(target=long_step)
        t.start()
        assert wait_until(lambda: traj.sandbox is not None and "long" in _ran(d, traj.sandbox.id), timeout=10)
        d.kill()
        time.sleep(0.3)
        d.start()
        t.join(timeout=60)
        err = got.get("error")
        assert isinstance(err, UnavailableError) and err.cause == "infra" and "restarted" in err.message, got
        # Asked again, the same recorded answer; the command ran once (it finished as an orphan).
        again = fleet.trajectory("killed-mid-step", _spec("traj-kill"))
        again.exec("echo before >> /ran.log")
        with pytest.raises(UnavailableError, match="restarted"):
            again.exec("echo long >> /ran.log; sleep 2; echo done", timeout=30)
        assert again.last is not None and again.last.replayed and again.last.cause == "infra"
        assert again.exec("cat /ran.log").stdout.split() == ["before", "long"]
        assert again.refresh().failures == {"infra": 1}
        again.close()
        again.delete()


def _ran(d: Daemon, sandbox_id: str) -> str:
    try:
        return Path(f"/proc/{agent_pid(d, sandbox_id)}/root/ran.log").read_text()
    except (OSError, StopIteration, AssertionError):
        return ""


def test_failures_are_typed_by_cause(fleet: Client, daemon: Daemon) -> None:
    spec = SandboxSpec(image="busybox", idle_ttl=120, resources={"memory": "64MiB"}, labels={EXPECT: "oom_repeat"})
    with fleet.create(spec) as sb:
        assert sb.exec("true").cause is None
        assert sb.exec("exit 3").cause == "agent"
        assert sb.exec("sleep 5", timeout=0.5).cause == "timeout"
        oom = sb.exec("tail /dev/zero", timeout=30)  # buffers one endless line
        assert oom.oom_killed and oom.cause == "agent"
    with pytest.raises(NotFoundError) as stopped:
        sb.exec("true")
    assert stopped.value.cause == "caller"  # it was stopped on request
    with pytest.raises(NotFoundError) as no_image:
        fleet.create(image="no-such-image:1")
    assert no_image.value.cause == "caller"

    # The node's fault: the sandbox's init killed from the host (nothing inside can kill it).
    lost = fleet.create(image="busybox", idle_ttl=120)
    os.kill(agent_pid(daemon, lost.id), signal.SIGKILL)
    assert wait_until(lambda: not [s for s in fleet.list() if s.id == lost.id], timeout=15)
    with pytest.raises(SandboxError) as gone:
        lost.exec("true")
    assert gone.value.cause == "infra", gone.value

    metrics = fleet._http.get("/metrics").text  # type: ignore[attr-defined]
    for cause in ("agent", "timeout", "caller", "infra"):
        line = f'sandfleet_failures_total{{cause="{cause}"}}'
        value = next(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(line))
        assert value > 0, cause
