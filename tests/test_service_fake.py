"""The SDK, the routes and the node service end to end on the fake tier (sandfleet.testing): no root,
no sandboxes, milliseconds per test. What this proves is the service's logic (states, typed errors,
admission, idempotency, TTLs, lifetimes, events, unsupported capabilities); that isolation and the
real tier work is the conformance suite's and the real-runtime tests' job."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sandfleet import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxNotFoundError,
    SandboxSpec,
    UnavailableError,
    UnsupportedError,
    WrongStateError,
)
from sandfleet.client import AsyncClient
from sandfleet.daemon.node.state import StateConflictError, StateDiskFullError
from sandfleet.testing import InProcessNode

from leakcheck import children

pytestmark = pytest.mark.unit


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[InProcessNode]:
    async with InProcessNode(tmp_path, max_sandboxes=4) as n:
        yield n


@pytest.fixture
async def fleet(node: InProcessNode) -> AsyncIterator[AsyncClient]:
    async with node.client(timeout=20) as c:
        yield c


async def test_create_exec_stop(fleet: AsyncClient, node: InProcessNode) -> None:
    sb = await fleet.create(image="busybox", env={"GREETING": "hi"})
    assert sb.info.state == "running"
    r = await sb.exec("echo $GREETING; echo err >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr) == (3, "hi\n", "err\n")
    assert (await sb.exec(["printf", "%s", "argv"])).stdout == "argv"
    info = await sb.stop()
    assert info.state == "stopped"
    assert not (node.backend.root / sb.id).exists(), "the fake tier's directory outlived its sandbox"


async def test_exec_timeout_output_cap_and_stdin(fleet: AsyncClient) -> None:
    sb = await fleet.create(image="busybox")
    r = await sb.exec("sleep 5", timeout=0.3)
    assert r.timed_out and r.exit_code == 128 + 9
    r = await sb.exec("head -c 5000 /dev/zero | tr '\\0' x", output_limit=100)
    assert r.stdout == "x" * 100 and r.stdout_truncated
    assert (await sb.exec("cat", stdin="piped")).stdout == "piped"
    r = await sb.exec("definitely-not-a-command-xyz")
    assert r.exit_code == 127


async def test_background_process(fleet: AsyncClient) -> None:
    sb = await fleet.create(image="busybox")
    p = await sb.start("echo started; sleep 0.2; echo done")
    info = await p.wait(10)
    assert info.result is not None and info.result.stdout == "started\ndone\n"


async def test_typed_errors(fleet: AsyncClient) -> None:
    with pytest.raises(SandboxNotFoundError):
        await fleet.get("sb-0000000000000000")
    with pytest.raises(InvalidArgumentError):
        await fleet.create(SandboxSpec(backend="microvm", image="busybox"))
    sb = await fleet.create(image="busybox")
    with pytest.raises(UnsupportedError, match="cannot snapshot"):
        await sb.snapshot()
    await sb.stop()
    with pytest.raises(WrongStateError):
        await sb.exec("true")


async def test_pause_resume_and_transparent_resume(fleet: AsyncClient) -> None:
    sb = await fleet.create(image="busybox")
    assert (await sb.pause()).state == "paused"
    assert (await fleet.get(sb.id)).info.state == "paused"
    assert (await sb.exec("echo back")).stdout == "back\n"  # any request resumes
    assert (await fleet.get(sb.id)).info.state == "running"
    kinds = [e.kind for e in await sb.events()]
    assert kinds[:1] == ["created"] and "paused" in kinds and "resumed" in kinds


async def test_admission_refuses_past_max_sandboxes(node: InProcessNode, fleet: AsyncClient) -> None:
    for _ in range(4):
        await fleet.create(image="busybox")
    with pytest.raises(ResourceExhaustedError, match="sandboxes"):
        await node.service.creation.create(SandboxSpec(image="busybox"))
    async with node.client(timeout=0.5) as impatient:  # the SDK retries a full node until its deadline
        with pytest.raises(ResourceExhaustedError):
            await impatient.create(image="busybox")


async def test_idempotent_create(node: InProcessNode, fleet: AsyncClient) -> None:
    spec = SandboxSpec(image="busybox", labels={"k": "v"})
    a = await node.service.creation.create(spec, idempotency_key="key-1")
    b = await node.service.creation.create(spec, idempotency_key="key-1")
    assert a.id == b.id and node.backend.created == 1
    with pytest.raises(InvalidArgumentError, match="another request"):
        await node.service.creation.create(SandboxSpec(image="busybox"), idempotency_key="key-1")


async def test_a_failed_create_leaves_a_failed_record_and_frees_its_budget(
    node: InProcessNode, fleet: AsyncClient
) -> None:
    node.backend.fail_creates = 1
    with pytest.raises(Exception, match="fake create failure"):
        await fleet.create(image="busybox", labels={"try": "1"})
    failed = [s for s in await fleet.list(state="failed")]
    assert len(failed) == 1 and "create failed" in (failed[0].stop_reason or "")
    for _ in range(4):  # the failed create's admission budget came back
        await fleet.create(image="busybox")


@pytest.mark.parametrize("failure", ["conflict", "disk full", "disk known full"])
async def test_a_create_whose_row_cannot_be_written_is_taken_down(
    node: InProcessNode, fleet: AsyncClient, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """The row is written while the sandbox starts: when it cannot be (its key still held by a row
    being removed, a full disk), the started sandbox is stopped, its budget and key freed, and the
    caller told why. While the store knows its disk is full, nothing is launched for a row it
    would refuse."""

    def insert(row: Any) -> asyncio.Future[None]:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        fut.set_exception(StateConflictError("taken") if failure == "conflict" else StateDiskFullError("full"))
        return fut

    monkeypatch.setattr(node.state, "insert", insert)
    if failure == "disk known full":  # (held so: the store's own batches would set it back)
        monkeypatch.setattr(type(node.state), "full", property(lambda _s: True, lambda _s, _v: None), raising=False)
    spec = SandboxSpec(image="busybox", labels={"row": "lost"})
    with pytest.raises(UnavailableError if failure == "conflict" else StateDiskFullError):
        await node.service.creation.create(spec, idempotency_key="k-row")
    launched = 0 if failure == "disk known full" else 1
    assert node.backend.created == launched and not list(node.backend.root.iterdir()), "it outlived its create"
    assert await fleet.list(labels={"row": "lost"}) == []
    monkeypatch.undo()
    for i in range(3):  # its admission budget came back (4 fit), and its key is free
        assert (await node.service.creation.create(spec, idempotency_key=f"k-row-{i}")).state == "running"
    again = await node.service.creation.create(spec, idempotency_key="k-row")
    assert again.state == "running" and node.backend.created == 4 + launched


async def test_idle_ttl_stops_a_sandbox(fleet: AsyncClient) -> None:
    sb = await fleet.create(image="busybox", idle_ttl=0.3)
    for _ in range(100):
        if (await fleet.get(sb.id)).info.state == "stopped":
            break
        await asyncio.sleep(0.05)
    info = (await fleet.get(sb.id)).info
    assert info.state == "stopped" and info.stop_reason == "idle_ttl"


async def test_labels_lifetimes_and_stop_many(fleet: AsyncClient) -> None:
    a = await fleet.create(image="busybox", labels={"job": "a"})
    await fleet.create(image="busybox", labels={"job": "b"})
    assert [s.id for s in await fleet.list(labels={"job": "a"})] == [a.id]
    await a.set_lifetime(idle_ttl=600)
    assert (await fleet.get(a.id)).info.spec.idle_ttl == 600
    assert await fleet.stop_many({"job": "a"}) == [a.id]
    assert {s.spec.labels["job"] for s in await fleet.list()} == {"b"}


async def test_files_through_the_host_side(fleet: AsyncClient) -> None:
    sb = await fleet.create(image="busybox")
    await sb.files.write("/work/a.txt", "content")
    assert await sb.files.read("/work/a.txt") == b"content"
    names = {f.name for f in await sb.files.list("/work")}
    assert names == {"a.txt"}
    with pytest.raises(InvalidArgumentError):
        await sb.files.read("/work/../../etc/passwd")


async def test_tiers_report_capabilities(fleet: AsyncClient) -> None:
    assert await fleet.tiers() == {"container": ["pause", "host_files"]}


async def test_nothing_left_behind(tmp_path: Path) -> None:
    """Closing the node stops its sandboxes: no directory, and no command still running."""
    async with InProcessNode(tmp_path) as node, node.client() as fleet:
        sb = await fleet.create(image="busybox")
        await sb.start("sleep 30")
        for _ in range(100):  # sh -c "sleep 30": a grandchild, once the forked sh has exec'd it
            if "sleep" in _descendants(os.getpid()):
                break
            await asyncio.sleep(0.05)
        assert "sleep" in _descendants(os.getpid())
    assert not any((tmp_path / "sandboxes").iterdir())
    assert "sleep" not in _descendants(os.getpid())


def _descendants(pid: int) -> list[str]:
    """Command names of every live process below `pid` (zombies left out: they hold nothing)."""
    below, frontier = [], [pid]
    while frontier:
        kids = [(child, comm) for p in frontier for child, state, comm in children(p) if state != "Z"]
        below += [comm for _, comm in kids]
        frontier = [child for child, _ in kids]
    return below


async def test_build_recipe_streams_its_steps(fleet: AsyncClient, tmp_path: Path) -> None:
    """A recipe goes to the node, which builds it and streams its steps (here: only the base)."""
    (tmp_path / "r.toml").write_text('ref = "t/fake-build:1"\nbase = "busybox"\nenv = { K = "v" }\n')
    seen: list[object] = []
    image = await fleet.build_recipe(tmp_path / "r.toml", on_event=seen.append)
    assert (image.name, image.tag) == ("t/fake-build", "1")
    assert [(e.type, e.index, e.kind) for e in seen if e.type == "step"] == [("step", 0, "base")]  # type: ignore[attr-defined]
    assert "t/fake-build" in {i.name for i in await fleet.images()}
    with pytest.raises(InvalidArgumentError):
        await fleet.build_recipe("ref = [not a recipe\n", base_dir=tmp_path)
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        await fleet.build_recipe('ref = "a:1"\nbase = "busybox"\n', base_dir=tmp_path / "missing")


async def test_set_labels_replaces_them_and_label_wide_calls_follow(fleet: AsyncClient) -> None:
    sb = await fleet.create(image="busybox", labels={"job": "j1", "phase": "act"})
    other = await fleet.create(image="busybox", labels={"job": "j1"})
    info = await sb.set_labels({"job": "j2"})
    assert info.spec.labels == {"job": "j2"} == sb.info.spec.labels  # "phase" left out: removed
    assert [s.id for s in await fleet.list(labels={"job": "j2"})] == [sb.id]
    assert [s.id for s in await fleet.list(labels={"job": "j1"})] == [other.id]
    assert "labels_changed" in [e.kind for e in await sb.events()]
    # Labels under sandfleet. are the node's own (a verifier's, a trajectory's, a pool's).
    with pytest.raises(InvalidArgumentError, match="node's own"):
        await sb.set_labels({"sandfleet.verify": "sb-x"})
    with pytest.raises(InvalidArgumentError):
        await sb.set_labels({"bad key!": "x"})
    assert (await fleet.stop_many({"job": "j2"})) == [sb.id]
    with pytest.raises(WrongStateError):
        await sb.set_labels({"job": "j3"})
