"""Warm pools: hand-out, refill, no state shared between users, and nothing left behind."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from sandfleet import Client, Resources

from conftest import Daemon, agent_pid, destroy_daemon, make_daemon
from leakcheck import residue

POOL = '[[pools]]\nimage = "busybox"\nsize = 3\n[pools.resources]\nmemory = "128MiB"\n'
SHAPE = Resources(memory="128MiB")


def _ready(fleet: Client) -> int:
    return sum(fleet.health()["pools"].values())


def _wait_ready(fleet: Client, n: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while _ready(fleet) < n:
        assert time.time() < deadline, f"pool did not refill to {n}: {fleet.health()['pools']}"
        time.sleep(0.05)


@pytest.fixture
def pooled() -> Iterator[Daemon]:
    d = make_daemon("pool", POOL)
    d.start()
    yield d
    destroy_daemon(d)


def test_hand_out_and_refill(pooled: Daemon) -> None:
    with pooled.client() as fleet:
        _wait_ready(fleet, 3)
        ready = set(residue(pooled).sandbox_ids)
        assert len(ready) == 3
        sb = fleet.create(image="busybox", resources=SHAPE, labels={"who": "a"}, env={"X": "1"}, user="nobody")
        assert sb.id in ready  # served from the pool
        assert any(e.kind == "created" and e.data.get("pooled") for e in sb.events())
        # The caller's spec applies to the pooled sandbox: env, user, labels.
        assert sb.exec("echo $X; id -u").stdout == "1\n65534\n"
        assert [s.id for s in fleet.list(labels={"who": "a"})] == [sb.id]
        _wait_ready(fleet, 3)  # refilled
        # Another shape is created cold and leaves the pool alone.
        other = fleet.create(image="busybox", resources=Resources(memory="64MiB"))
        assert other.id not in ready
        assert _ready(fleet) == 3
        other.stop()
        sb.stop()


def test_pooled_sandboxes_share_nothing(pooled: Daemon) -> None:
    with pooled.client() as fleet:
        _wait_ready(fleet, 3)
        first = fleet.create(image="busybox", resources=SHAPE)
        first.files.write("/tmp/secret", b"user a's answer")
        first.start("sleep 1000")
        first.stop()
        seen = {first.id}
        for _ in range(4):
            _wait_ready(fleet, 1)
            sb = fleet.create(image="busybox", resources=SHAPE)
            assert sb.id not in seen, "a pooled sandbox was handed out twice"
            seen.add(sb.id)
            assert not sb.files.exists("/tmp/secret")
            assert "sleep" not in sb.exec("ps").stdout
            sb.stop()


def test_pool_is_drained_at_shutdown_and_cleaned_after_a_crash() -> None:
    d = make_daemon("pool-crash", POOL)
    d.start()
    try:
        with d.client() as fleet:
            _wait_ready(fleet, 3)
            crashed = set(residue(d).sandbox_ids)
        d.kill()  # pooled sandboxes have no state rows: residue for the next start
        d.start()
        with d.client() as fleet:
            _wait_ready(fleet, 3)
            now = set(residue(d).sandbox_ids)
            assert len(now) == 3 and not (now & crashed)
        d.stop()  # graceful: the pool is destroyed
        r = residue(d, daemon_alive=False)
        assert r.sandbox_dirs == () and r.sandbox_ids == () and r.processes == 0, r
    finally:
        destroy_daemon(d)


def test_a_pooled_sandbox_that_dies_is_replaced_and_cleaned(pooled: Daemon) -> None:
    with pooled.client() as fleet:
        _wait_ready(fleet, 3)
        victim = sorted(residue(pooled).sandbox_ids)[0]
        pid = agent_pid(pooled, victim)
        os.kill(pid, signal.SIGKILL)
        deadline = time.time() + 30
        while victim in residue(pooled).sandbox_ids:
            assert time.time() < deadline, "the dead pooled sandbox was not cleaned up"
            time.sleep(0.05)
        _wait_ready(fleet, 3)
        sb = fleet.create(image="busybox", resources=SHAPE)
        assert sb.id != victim and sb.exec("echo ok").stdout == "ok\n"
        sb.stop()
