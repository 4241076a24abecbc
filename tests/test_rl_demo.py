"""The real task of `sandfleet demo` end to end: more-itertools from PyPI with a bug put in, rollouts
forked from a set-up snapshot, each verified apart against the project's hidden suite."""

from __future__ import annotations

import asyncio

import pytest

from sandfleet import Client
from sandfleet.client import AsyncClient
from sandfleet.rl_demo import LABEL, run_task

from conftest import Daemon


@pytest.mark.slow
def test_the_real_task_rewards_fixes_and_nothing_else(daemon: Daemon) -> None:
    async def go():  # type: ignore[no-untyped-def]
        async with AsyncClient(daemon.socket, timeout=120) as fleet:
            return await run_task(fleet, groups=1, group_size=7)  # seeds 0-6: every kind of move

    report = asyncio.run(go())
    by_move: dict[str, list[tuple[float, str | None]]] = {}
    for r in report.rollouts:
        assert not r.error, r
        by_move.setdefault(r.move, []).append((r.reward, r.cause))
    assert {"fix", "wrong-fix", "no-op", "cheat", "hang-then-fix"} <= set(by_move), by_move
    assert all(v == (1.0, None) for v in by_move["fix"] + by_move["hang-then-fix"])
    assert all(v == (0.0, "agent") for v in by_move["wrong-fix"] + by_move["no-op"] + by_move["cheat"])
    cheat = next(r for r in report.rollouts if r.move == "cheat")
    assert "A tests/test_more.py" in cheat.changed and "M tests/test_recipes.py" in cheat.changed
    hang = next(r for r in report.rollouts if r.move == "hang-then-fix")
    assert hang.step_causes == ["timeout"]
    assert report.causes()["step:timeout"] >= 1 and report.per_minute > 0
    with Client(daemon.socket) as fleet:  # nothing left: sandboxes, snapshots, trajectories
        assert not [s for s in fleet.list() if LABEL in s.spec.labels]
        assert not [s for s in fleet.snapshots() if LABEL in s.labels]
        assert not [t for t in fleet.trajectories() if LABEL in t.labels]
