"""Standbys' bookkeeping with a fake tier: which checkpoint a standby is of, who destroys it and when,
and what a sweep removes. The real swap (criu, renamed cgroups) is tested in test_checkpoints.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sandfleet.backends.base import LiveSandbox
from sandfleet.daemon.node.standbys import STANDBY_MARK, Standbys, is_standby
from sandfleet.errors import UnavailableError

pytestmark = pytest.mark.unit


class FakeTier:
    def __init__(self) -> None:
        self.live: dict[str, LiveSandbox] = {}  # name -> its live part, while it exists
        self.destroyed: list[str] = []
        self.cleaned: list[str] = []
        self.leftover: set[str] = set()
        self.fail_aside = False
        self.delay = 0.0
        self.idle: list[bool] = []  # each restore: on idle CPU?
        self.hurried: list[str] = []

    def standbys_possible(self) -> bool:
        return True

    async def restore_standby(
        self, name: str, spec: Any, source: Path, meta: dict[str, Any], *, idle: bool
    ) -> LiveSandbox:
        self.idle.append(idle)
        await asyncio.sleep(self.delay)
        live = LiveSandbox(id=name, channel=None, agent_pid=1, agent_start_time=None, uid_base=0)  # type: ignore[arg-type]
        self.live[name] = live
        return live

    async def hurry(self, name: str, spec: Any) -> None:
        self.hurried.append(name)

    async def promote(self, standby: LiveSandbox, sandbox_id: str, spec: Any, replacing: LiveSandbox | None) -> None:
        standby.runtime["part"] = standby.id  # (under its own name)

    async def set_aside(self, live: LiveSandbox, name: str) -> None:
        if self.fail_aside:
            raise UnavailableError("no")
        self.live[name] = self.live.pop(live.id)
        live.id = name

    async def destroy(self, sandbox: LiveSandbox) -> None:
        await asyncio.sleep(0)
        self.live.pop(sandbox.id, None)
        self.destroyed.append(sandbox.id)

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        self.leftover.discard(sandbox_id)
        self.cleaned.append(sandbox_id)

    def residue(self) -> set[str]:
        return set(self.live) | self.leftover


class FakeCore:
    def __init__(self, tier: FakeTier) -> None:
        self.backends = {"container": tier}
        self.stop_hooks: list[Any] = []
        self.shutting_down = False
        self.table: list[Any] = []  # the sandboxes (`live`: their live parts)
        self._tier = tier

    def tier(self, sb: Any) -> FakeTier:
        return self._tier

    def spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        return asyncio.ensure_future(coro)


def _checkpoint(tmp_path: Path, pages: int = 4096) -> Path:
    (tmp_path / "img").mkdir(exist_ok=True)
    with open(tmp_path / "img" / "pages-1.img", "wb") as f:
        f.truncate(pages)  # (sparse)
    return tmp_path


def _meminfo(tmp_path: Path, total_kib: int, available_kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:  {total_kib} kB\nMemFree: 1 kB\nMemAvailable:  {available_kib} kB\n")
    return path


def _standbys(tmp_path: Path, tier: FakeTier, *, available_kib: int = 8 << 20, enabled: bool = True) -> Standbys:
    core: Any = FakeCore(tier)
    return Standbys(core, enabled=enabled, meminfo=_meminfo(tmp_path, 16 << 20, available_kib), delay=0.01)


SB = SimpleNamespace(id="sb-1", spec=None, state="running")


async def test_a_standby_is_of_one_checkpoint_and_taken_once(tmp_path: Path) -> None:
    tier = FakeTier()
    standbys = _standbys(tmp_path, tier)
    cp = _checkpoint(tmp_path)
    standbys.prepare(SB, "cp-1", cp, {}, 4096)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert standbys.ready("sb-1", "cp-1") and not standbys.ready("sb-1", "cp-2")
    assert await standbys.take("sb-1", "cp-2") is None  # another checkpoint's: kept
    taken = await standbys.take("sb-1", "cp-1")
    assert taken is not None and is_standby(taken[1].id) and taken[1].id.startswith(f"sb-1{STANDBY_MARK}")
    assert await standbys.take("sb-1", "cp-1") is None  # once
    assert tier.destroyed == []


async def test_a_new_checkpoint_replaces_the_standby_and_a_stop_releases_it(tmp_path: Path) -> None:
    tier = FakeTier()
    standbys = _standbys(tmp_path, tier)
    cp = _checkpoint(tmp_path)
    standbys.prepare(SB, "cp-1", cp, {}, 4096)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    first = next(iter(tier.live))
    tier.delay = 0.1
    standbys.prepare(SB, "cp-2", cp, {}, 4096)  # type: ignore[arg-type]
    await asyncio.sleep(0.02)
    assert tier.destroyed == [first]
    # Stopped while the next one is still being made: the stop hurries it, waits and destroys it.
    await standbys.release(SB)  # type: ignore[arg-type]
    assert tier.live == {} and len(tier.destroyed) == 2
    # (the first one, replaced, was not hurried: its destroy is no one's wait)
    assert tier.idle == [True, True] and len(set(tier.hurried)) == 1 and first not in tier.hurried
    assert await standbys.take("sb-1", "cp-2") is None


async def test_a_dropped_checkpoint_takes_only_its_own_standby(tmp_path: Path) -> None:
    tier = FakeTier()
    standbys = _standbys(tmp_path, tier)
    standbys.prepare(SB, "cp-1", _checkpoint(tmp_path), {}, 4096)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    standbys.drop("sb-1", "cp-other")
    assert standbys.ready("sb-1", "cp-1")
    standbys.drop("sb-1", "cp-1")
    await asyncio.sleep(0.05)
    assert tier.live == {} and not standbys.ready("sb-1", "cp-1")


async def test_no_standby_when_memory_is_short_or_they_are_off(tmp_path: Path) -> None:
    tier = FakeTier()
    cp = _checkpoint(tmp_path)
    short = _standbys(tmp_path, tier, available_kib=6 << 20)  # 6 of 16 GiB: 3 left, under a quarter
    short.prepare(SB, "cp-1", cp, {}, 3 << 30)  # type: ignore[arg-type]
    assert await short.take("sb-1", "cp-1") is None and tier.live == {}
    off = _standbys(tmp_path, tier, enabled=False)
    off.prepare(SB, "cp-1", _checkpoint(tmp_path), {}, 4096)  # type: ignore[arg-type]
    assert off.of == {}


async def test_retire_destroys_in_the_background_and_a_stop_waits_for_it(tmp_path: Path) -> None:
    tier = FakeTier()
    standbys = _standbys(tmp_path, tier)
    old = LiveSandbox(
        id="sb-1", channel=SimpleNamespace(close=lambda: None), agent_pid=1, agent_start_time=None, uid_base=0
    )  # type: ignore[arg-type]
    tier.live["sb-1"] = old
    await standbys.retire(SB, old)  # type: ignore[arg-type]
    assert "sb-1" not in tier.live and is_standby(old.id)  # out of the id's way at once
    await standbys.release(SB)  # type: ignore[arg-type]
    assert tier.destroyed == [old.id]
    # A tier that cannot set it aside: destroyed in place.
    tier.fail_aside = True
    again = LiveSandbox(
        id="sb-1", channel=SimpleNamespace(close=lambda: None), agent_pid=1, agent_start_time=None, uid_base=0
    )  # type: ignore[arg-type]
    tier.live["sb-1"] = again
    await standbys.retire(SB, again)  # type: ignore[arg-type]
    assert tier.destroyed[-1] == "sb-1"


async def test_a_standby_not_begun_costs_nothing_when_dropped_or_taken(tmp_path: Path) -> None:
    tier = FakeTier()
    core: Any = FakeCore(tier)
    standbys = Standbys(core, meminfo=_meminfo(tmp_path, 16 << 20, 8 << 20), delay=0.2)
    cp = _checkpoint(tmp_path)
    standbys.prepare(SB, "cp-1", cp, {}, 4096)  # type: ignore[arg-type]
    assert await standbys.take("sb-1", "cp-1") is None  # a rollback at once restores: nothing waited for
    standbys.prepare(SB, "cp-2", cp, {}, 4096)  # type: ignore[arg-type]
    standbys.drop("sb-1", "cp-2")
    await asyncio.sleep(0.3)
    assert tier.live == {} and tier.destroyed == []  # never restored


async def test_a_sweep_removes_only_another_runs_standbys(tmp_path: Path) -> None:
    tier = FakeTier()
    standbys = _standbys(tmp_path, tier)
    standbys.prepare(SB, "cp-1", _checkpoint(tmp_path), {}, 4096)  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    ours = next(iter(tier.live))
    # sb-4's live part: a standby another run promoted in a rollback (adopted under that name)
    promoted = f"sb-4{STANDBY_MARK}0badc0de-1"
    standbys.core.table.append(SimpleNamespace(id="sb-4", live=SimpleNamespace(id=promoted)))
    # sb-5 is being rolled back (no live part meanwhile): its old part is the rollback's to destroy
    standbys.core.table.append(SimpleNamespace(id="sb-5", live=None, state="running"))
    tier.leftover = {f"sb-2{STANDBY_MARK}0badc0de-3", "sb-3", promoted, f"sb-5{STANDBY_MARK}0badc0de-2"}
    assert await standbys.sweep() == [f"sb-2{STANDBY_MARK}0badc0de-3"]
    assert tier.cleaned == [f"sb-2{STANDBY_MARK}0badc0de-3"] and ours in tier.live
    await standbys.close()
    assert tier.live == {}


async def test_a_stop_during_retire_still_finds_the_old_part_destroyed(tmp_path: Path) -> None:
    """The sandbox stops while its old part is being set aside: `release` has nothing to wait for
    yet, so the retire destroys it itself before it returns (never left running in the background)."""
    tier = FakeTier()
    standbys = _standbys(tmp_path, tier)
    gate = asyncio.Event()
    plain_set_aside = tier.set_aside

    async def slow_set_aside(live: LiveSandbox, name: str) -> None:
        await gate.wait()
        await plain_set_aside(live, name)

    tier.set_aside = slow_set_aside  # type: ignore[method-assign]
    sb = SimpleNamespace(id="sb-1", spec=None, state="running")
    old = LiveSandbox(
        id="sb-1", channel=SimpleNamespace(close=lambda: None), agent_pid=1, agent_start_time=None, uid_base=0
    )  # type: ignore[arg-type]
    tier.live["sb-1"] = old
    retiring = asyncio.ensure_future(standbys.retire(sb, old))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    sb.state = "stopping"
    await standbys.release(sb)  # type: ignore[arg-type]
    gate.set()
    await retiring
    assert tier.destroyed == [old.id] and tier.live == {}
