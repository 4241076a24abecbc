"""The asyncio SDK (`AsyncClient`) against a real daemon: the same core flow as the blocking client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from sandfleet import (
    AsyncClient,
    AsyncSandbox,
    ImageNotFoundError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    Resources,
    SandboxNotFoundError,
    WrongStateError,
)

if TYPE_CHECKING:
    from conftest import Daemon


@pytest.fixture
async def afleet(daemon: Daemon) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as c:
        yield c


@pytest.fixture
async def asb(afleet: AsyncClient) -> AsyncIterator[AsyncSandbox]:
    async with await afleet.create(image="busybox", idle_ttl=300) as sb:
        yield sb


async def test_async_lifecycle(afleet: AsyncClient) -> None:
    health = await afleet.health()
    assert health["status"] == "ok" and "container" in health["backends"]
    assert any(i.name == "busybox" for i in await afleet.images())

    async with await afleet.create(image="busybox", labels={"suite": "async-lifecycle"}) as sb:
        assert sb.info.state == "running"
        got = await afleet.get(sb.id)
        assert got.id == sb.id and got.info.spec.labels == {"suite": "async-lifecycle"}
        assert [s.id for s in await afleet.list(labels={"suite": "async-lifecycle"}, state="running")] == [sb.id]
        assert (await sb.refresh()).state == "running"
        sid = sb.id
    with pytest.raises(SandboxNotFoundError):
        await afleet.get(sid)
    with pytest.raises(ImageNotFoundError):
        await afleet.create(image="no-such-image")
    with pytest.raises(InvalidArgumentError):
        await afleet.create(image="busybox", backend="microvm")


async def test_async_exec(asb: AsyncSandbox) -> None:
    r = await asb.exec("echo out; echo err >&2; exit 5")
    assert (r.exit_code, r.stdout, r.stderr) == (5, "out\n", "err\n")
    r = await asb.exec(["echo", "$HOME"], env={"X": "1"})
    assert r.stdout == "$HOME\n"
    r = await asb.exec('echo "$X"; pwd; id -u', env={"X": "1"}, cwd="/tmp", user="nobody")
    assert r.stdout == "1\n/tmp\n65534\n"
    assert (await asb.exec("cat", stdin="piped")).stdout == "piped"
    r = await asb.exec("sleep 100", timeout=0.5)
    assert r.timed_out
    r = await asb.exec("yes | head -c 10000", output_limit=10)
    assert r.stdout == "y\n" * 5 and r.stdout_truncated
    assert (await asb.exec("no_such_cmd")).exit_code == 127


async def test_async_exec_stream(asb: AsyncSandbox) -> None:
    t0 = time.monotonic()
    first_out: float | None = None
    chunks: list[str] = []
    result = None
    async for ev in asb.exec_stream("echo a; sleep 1; echo b"):
        if ev.type == "stdout":
            first_out = first_out if first_out is not None else time.monotonic() - t0
            chunks.append(ev.data)
        elif ev.type == "exit":
            result = ev.result
    end = time.monotonic() - t0
    assert first_out is not None and end - first_out >= 0.7, (first_out, end)
    assert "".join(chunks) == "a\nb\n"
    assert result is not None and result.exit_code == 0 and result.stdout == "a\nb\n"


async def test_async_abandoned_stream_kills_command(asb: AsyncSandbox) -> None:
    async with contextlib.aclosing(asb.exec_stream("echo started; sleep 100")) as stream:
        async for ev in stream:
            assert ev.type == "stdout" and ev.data == "started\n"
            break

    async def sleeping() -> bool:
        ps = await asb.exec(["ps", "-o", "args"])
        return any(line.startswith("sleep") for line in ps.stdout.splitlines())

    deadline = time.monotonic() + 10
    while await sleeping():
        assert time.monotonic() < deadline, "abandoned streamed command still runs"
        await asyncio.sleep(0.1)


async def test_async_files(asb: AsyncSandbox, tmp_path: Path) -> None:
    info = await asb.files.write("/task/a.txt", b"\x00\x01hello", mode=0o640)
    assert (info.size, info.mode, info.uid) == (7, 0o640, 0)
    assert await asb.files.read("/task/a.txt") == b"\x00\x01hello"
    assert await asb.files.read_text("/etc/hostname") == "sandbox\n"
    assert (await asb.exec("od -An -c /task/a.txt | tr -s ' '")).stdout.strip() == "\\0 001 h e l l o"
    await asb.files.mkdir("/task/sub", user="nobody")
    assert (await asb.files.stat("/task/sub")).uid == 65534
    assert sorted(f.name for f in await asb.files.list("/task")) == ["a.txt", "sub"]
    assert await asb.files.exists("/task/a.txt")
    with pytest.raises(NotFoundError):
        await asb.files.read("/task/missing")
    assert await asb.files.read("task/a.txt") == await asb.files.read("/task/a.txt")  # relative to the workdir

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"payload")
    (src / "top").write_text("top\n")
    await asb.files.upload(src, "/task/up")
    assert (await asb.exec("cat /task/up/d/f /task/up/top")).stdout == "payloadtop\n"
    dst = tmp_path / "dst"
    await asb.files.download("/task/up", dst)
    assert (dst / "d" / "f").read_bytes() == b"payload" and (dst / "top").read_text() == "top\n"

    await asb.files.remove("/task", recursive=True)
    assert not await asb.files.exists("/task")


async def test_async_session(asb: AsyncSandbox) -> None:
    async with await asb.session() as s:
        await s.run("cd /tmp; export K=v; f() { echo f$1; }")
        r = await s.run('pwd; echo "$K"; f 1')
        assert r.stdout == "/tmp\nv\nf1\n"
        r = await s.run("sleep 100", timeout=0.5)
        assert r.timed_out
        assert (await s.run('echo "$K"')).stdout == "v\n"
        assert (await s.run("if then")).exit_code != 0
        assert (await s.run("echo alive")).stdout == "alive\n"
    with pytest.raises((NotFoundError, WrongStateError)):
        await s.run("true")


async def test_async_concurrent_execs(asb: AsyncSandbox) -> None:
    t0 = time.monotonic()
    results = await asyncio.gather(*(asb.exec(f"sleep 0.3; echo {i}") for i in range(10)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)]
    assert all(r.exit_code == 0 for r in results)
    assert time.monotonic() - t0 < 3  # concurrent, not 10 x 0.3 s in a row


async def test_async_concurrent_sandboxes(afleet: AsyncClient) -> None:
    sbs = await asyncio.gather(*(afleet.create(image="busybox", labels={"suite": "async-many"}) for _ in range(3)))
    try:
        assert len({sb.id for sb in sbs}) == 3
        outs = await asyncio.gather(*(sb.exec("hostname") for sb in sbs))
        assert [o.stdout for o in outs] == [f"{sb.id}\n" for sb in sbs]
    finally:
        stopped = await afleet.stop_many({"suite": "async-many"})
    assert sorted(stopped) == sorted(sb.id for sb in sbs)


async def test_async_background_process(asb: AsyncSandbox) -> None:
    done = await asb.start("sleep 0.3; echo bg")
    waiting = await asb.start("sleep 100")
    info = await done.wait(timeout=10)
    assert not info.running and info.result is not None and info.result.stdout == "bg\n"
    assert {p.id for p in await asb.processes()} >= {done.id, waiting.id}
    assert (await waiting.wait(timeout=0.2)).running
    await waiting.kill()
    info = await waiting.wait(timeout=10)
    assert not info.running


async def test_async_events_and_errors(afleet: AsyncClient) -> None:
    sb = await afleet.create(image="busybox", resources=Resources(disk="2MiB"))
    try:
        await sb.exec("true")
        await sb.files.write("/tmp/x", b"x")
        with pytest.raises(ResourceExhaustedError):
            await sb.files.write("/tmp/big", b"\0" * (4 * 1024**2))
        kinds = [e.kind for e in await sb.events()]
        assert kinds[0] == "created" and "exec" in kinds and "file_write" in kinds
        seqs = [e.seq for e in await sb.events()]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
        assert [e.seq for e in await sb.events(after=seqs[0])] == seqs[1:]
    finally:
        await sb.stop()
    with pytest.raises((WrongStateError, SandboxNotFoundError)):
        await sb.exec("true")
