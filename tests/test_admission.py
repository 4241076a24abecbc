"""Node admission (retryable refusals instead of an overloaded node) and the SDK's batch create."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandfleet import Resources, Sandbox, SandboxSpec
from sandfleet.errors import ImageNotFoundError, ResourceExhaustedError, SandboxError

from conftest import Daemon, destroy_daemon, make_daemon, wait_until
from leakcheck import residue

MEM_TOTAL = next(
    int(line.split()[1]) * 1024
    for line in Path("/proc/meminfo").read_text().splitlines()
    if line.startswith("MemTotal:")
)


@pytest.fixture
def small_node() -> Iterator[Daemon]:
    # Room for three sandboxes, and memory limits summing to at most 1.5 GiB.
    overcommit = 1.5 * 1024**3 / MEM_TOTAL
    d = make_daemon("admission", f"max_sandboxes = 3\nmemory_overcommit = {overcommit}\n")
    d.start()
    yield d
    destroy_daemon(d)


def _stop_all(items: list[Sandbox | SandboxError]) -> None:
    for item in items:
        if isinstance(item, Sandbox):
            item.stop()


def test_count_gate_batch_create_and_retry(small_node: Daemon) -> None:
    spec = SandboxSpec(image="busybox", resources=Resources(memory="64MiB"))
    with small_node.client() as fleet:
        results = fleet.create_many([spec] * 5, concurrency=5, retry_for=0)
        made = [r for r in results if isinstance(r, Sandbox)]
        refused = [r for r in results if isinstance(r, SandboxError)]
        assert len(made) == 3 and len(refused) == 2
        assert all(isinstance(e, ResourceExhaustedError) and e.retryable for e in refused)
        assert all(m.exec("echo ok").stdout == "ok\n" for m in made)

        # A refused create succeeds once room appears, when the caller is willing to retry.
        timer = threading.Timer(1.0, made[0].stop)
        timer.start()
        t0 = time.monotonic()
        (late,) = fleet.create_many([spec], retry_for=20)
        timer.join()
        assert isinstance(late, Sandbox), late
        assert time.monotonic() - t0 >= 0.9
        _stop_all([*made[1:], late])
        assert fleet.list(state="running") == []


def test_memory_gate_counts_limits_and_releases_them(small_node: Daemon) -> None:
    big = SandboxSpec(image="busybox", resources=Resources(memory="1GiB"))
    small = SandboxSpec(image="busybox", resources=Resources(memory="128MiB"))
    with small_node.client() as fleet:
        # Failed creates hand their budget back (else these would fill the node).
        for _ in range(3):
            with pytest.raises(ImageNotFoundError):
                fleet.create(big.model_copy(update={"image": "no-such-image"}))
        first = fleet.create(big)
        with pytest.raises(ResourceExhaustedError, match="memory"):
            fleet.create(big, timeout=1)  # a create waits for capacity, up to its timeout
        second = fleet.create(small)  # still fits under the budget
        first.stop()
        third = fleet.create(big)  # the stopped sandbox's limit was released
        _stop_all([second, third])


def test_batch_items_fail_on_their_own(small_node: Daemon) -> None:
    good = SandboxSpec(image="busybox", resources=Resources(memory="64MiB"))
    bad = SandboxSpec(image="no-such-image", resources=Resources(memory="64MiB"))
    with small_node.client() as fleet:
        results = fleet.create_many([good, bad, good], retry_for=5)
        assert isinstance(results[0], Sandbox) and isinstance(results[2], Sandbox)
        assert isinstance(results[1], ImageNotFoundError)
        _stop_all(results)
    r = residue(small_node)
    assert r.sandbox_dirs == () and r.cgroups == () and r.state_rows == 0


async def test_async_batch_create(small_node: Daemon) -> None:
    from sandfleet import AsyncClient, AsyncSandbox

    spec = SandboxSpec(image="busybox", resources=Resources(memory="64MiB"))
    async with AsyncClient(small_node.socket) as fleet:
        results = await fleet.create_many([spec] * 4, concurrency=4, retry_for=0)
        made = [r for r in results if isinstance(r, AsyncSandbox)]
        assert len(made) == 3
        assert sum(isinstance(r, ResourceExhaustedError) for r in results) == 1
        for sb in made:
            assert (await sb.exec("echo $((1+1))")).stdout == "2\n"
            await sb.stop()


@pytest.fixture
def cpu_node() -> Iterator[Daemon]:
    # CPU requests summing to at most one CPU; refuse while latency-sensitive sandboxes use more than
    # 0.4 of the node's CPUs (sampled by a fast reaper).
    ncpu = len(os.sched_getaffinity(0))
    d = make_daemon("cpu", f"cpu_overcommit = {1 / ncpu}\nmax_cpu_load = {0.4 / ncpu * 2}\n")
    d.start()
    yield d
    destroy_daemon(d)


def test_cpu_requests_are_admitted_up_to_the_overcommit(cpu_node: Daemon) -> None:
    asks = SandboxSpec(image="busybox", resources=Resources(memory="64MiB", cpu=2, cpu_request=0.4))
    with cpu_node.client() as fleet:
        a, b = fleet.create(asks), fleet.create(asks)
        with pytest.raises(ResourceExhaustedError, match="CPU is fully committed") as refused:
            fleet.create(asks, timeout=1)
        assert refused.value.retryable
        # the default request is small (min(cpu, 0.1)): an idle-shaped sandbox still fits
        small = fleet.create(image="busybox", resources=Resources(memory="64MiB"))
        a.stop()
        c = fleet.create(asks)  # room again once a request is released
        _stop_all([b, c, small])
    with pytest.raises(ValueError, match="cannot exceed"):
        Resources(cpu=0.5, cpu_request=1)


HOG = "while :; do :; done"


def test_cpu_load_of_latency_sensitive_sandboxes_gates_creates_best_effort_does_not(cpu_node: Daemon) -> None:
    spec = SandboxSpec(image="busybox", resources=Resources(memory="64MiB", cpu_request=0.05))

    def refused() -> bool:
        try:
            fleet.create(spec, timeout=0.5).stop()  # no waiting for capacity here: the refusal itself
            return False
        except ResourceExhaustedError as exc:
            assert "saturated" in exc.message
            return True

    with cpu_node.client() as fleet:
        # a best-effort hog using a whole CPU yields to everyone: creates go on
        be = fleet.create(image="busybox", qos="best_effort", resources=Resources(memory="64MiB", cpu_request=0))
        be.start(HOG)
        time.sleep(1.5)
        assert not any(refused() for _ in range(3))
        be.stop()
        # the same hog, latency-sensitive: the node is saturated for new work until it stops
        ls = fleet.create(image="busybox", resources=Resources(memory="64MiB", cpu_request=0.05))
        ls.start(HOG)
        assert wait_until(refused, timeout=10)
        ls.stop()
        assert wait_until(lambda: not refused(), timeout=10)
