"""`sandfleet demo --task search`: a best-first search over the more-itertools task, run with
checkpoint/rollback in one sandbox, a fork per node, and a fresh sandbox per node. The search itself
is tried on a model of the task (unit); the three strategies on the real task and a real daemon."""

from __future__ import annotations

import asyncio
import io
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from rich.console import Console

from sandfleet import Client
from sandfleet.client import AsyncClient
from sandfleet.search_demo import (
    ACTIONS,
    LABEL,
    RIGHT,
    SCORE,
    STRATEGIES,
    Action,
    Node,
    Score,
    Strategy,
    best_first,
    run_search,
    show,
)

from conftest import Daemon

# -- the search, on a model of the task ------------------------------------------------------------

# What each patch leaves on the buggy line, and what that scores: (visible passed, failed, checks).
LINES = {"never-raise": "< 0", "patch->=": ">= n", "patch-==": "== n", "typo": "typo", "patch-!=": "!= n"}
SCORES = {"> n": (130, 0, 2), "< 0": (130, 0, 2), ">= n": (130, 0, 1), "== n": (130, 0, 1), "!= n": (130, 0, 3)}


class Model(Strategy):
    """The task's states as the line chunked's check holds; a handle per kept node, counted."""

    name = "model"

    def __init__(self) -> None:
        self.state_seconds = self.act_seconds = 0.0
        self.kept: set[int] = set()
        self.released: list[int] = []
        self.closed = False

    def _line(self, path: tuple[str, ...]) -> str:
        line = "> n"
        for name in path:
            if name in LINES and line != "typo":  # a typo'd line matches no patch any more
                line = LINES[name]
        return line

    def _score(self, path: tuple[str, ...]) -> Score:
        line = self._line(path)
        return Score(0, 1, 0) if line == "typo" else Score(*SCORES[line])

    async def setup(self) -> Score:
        return self._score(())

    async def expand(self, parent: Node, action: Action, child: Node, keep: bool) -> Score:
        assert not parent.dropped and parent.pending > 0
        score = self._score(child.path)
        if keep and not score.solved:
            child.handle = id(child)
            self.kept.add(id(child))
        return score

    async def release(self, node: Node) -> None:
        if node.handle is not None:
            self.kept.remove(node.handle)
            self.released.append(node.handle)
            node.handle = None

    async def close(self) -> None:
        self.closed = True


@pytest.mark.unit
def test_scores_are_read_from_the_runs_output() -> None:
    bug = Score.parse("130 passed in 0.61s\nchecks 2 3\n")
    assert bug == Score(130, 0, 2) and not bug.solved and bug.value == pytest.approx(5 / 3)
    assert Score.parse("130 passed in 0.6s\nchecks 3 3").solved
    broken = Score.parse("1 error in 0.21s\nSyntaxError: expected ':'")
    assert broken == Score(0, 1, 0) and broken.value == 0
    assert Score.parse("2 failed, 128 passed in 0.7s\nchecks 3 3") == Score(128, 2, 3)


@pytest.mark.unit
def test_best_first_tries_the_likely_actions_first_and_stops_at_the_fix() -> None:
    model = Model()
    result = asyncio.run(best_first(model, budget=40))
    paths = [e.path for e in result.expansions]
    assert result.found == (RIGHT,) and paths[-1] == (RIGHT,) and len(paths) == 16
    assert paths[:4] == [("read-issue",), ("look",), ("comment",), ("read-issue", "read-issue")]
    assert ("typo",) in paths and [e.solved for e in result.expansions].count(True) == 1
    assert model.closed and not result.error and result.dropped == 0


@pytest.mark.unit
def test_the_budget_and_the_open_nodes_are_bounded() -> None:
    model = Model()
    result = asyncio.run(best_first(model, budget=5))
    assert result.found is None and len(result.expansions) == 5
    # Few nodes may hold a state: the worst are dropped (their state let go) and never expanded.
    model = Model()
    result = asyncio.run(best_first(model, budget=40, max_open=3))
    assert result.dropped > 0 and result.found is not None and result.found[-1] == RIGHT
    assert len(model.kept) <= 3 and len(model.released) == len(set(model.released))
    full = asyncio.run(best_first(Model(), budget=40, max_depth=1))
    assert [e.path for e in full.expansions] == [(a.name,) for a in sorted(ACTIONS, key=lambda a: -a.prior)]


class FakeSandbox:
    """A sandbox that knows which actions were applied to it; SCORE answers what they score."""

    def __init__(self, world: FakeFleet, path: tuple[str, ...] = ()) -> None:
        self.world, self.path, self.checkpoints = world, path, dict[str, tuple[str, ...]]()
        world.live.add(self)
        world.most = max(world.most, len(world.live))

    async def exec(self, command: str, timeout: float | None = None) -> Any:
        if command != SCORE:
            self.path += (BY_COMMAND[command],)
            return SimpleNamespace(stdout="")
        self.world.scored.append(self.path)
        score = Model()._score(self.path)
        out = (
            "1 error in 0.1s\nSyntaxError"
            if score.failed
            else f"{score.passed} passed in 0.4s\nchecks {score.checks} 3"
        )
        return SimpleNamespace(stdout=out)

    async def checkpoint(self, labels: Any = None) -> Any:
        cid = f"cp{next(self.world.ids)}"
        self.checkpoints[cid] = self.path
        self.world.most = max(self.world.most, len(self.checkpoints))
        return SimpleNamespace(id=cid)

    async def rollback(self, cid: str) -> None:
        self.path = self.checkpoints[cid]
        self.world.rollbacks += 1

    async def delete_checkpoint(self, cid: str) -> None:
        del self.checkpoints[cid]

    async def fork(self, count: int) -> list[FakeSandbox]:
        return [FakeSandbox(self.world, self.path)]

    async def stop(self) -> None:
        self.world.live.discard(self)
        self.checkpoints.clear()

    async def __aenter__(self) -> FakeSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


class FakeFleet:
    def __init__(self) -> None:
        self.scored: list[tuple[str, ...]] = []
        self.live: set[FakeSandbox] = set()
        self.ids = itertools.count()
        self.most = self.rollbacks = 0

    async def create(self, spec: Any) -> FakeSandbox:
        return FakeSandbox(self)


BY_COMMAND = {a.command: a.name for a in ACTIONS}


@pytest.mark.unit
@pytest.mark.parametrize("max_open", [24, 3])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_scores_the_state_the_search_means(name: str, max_open: int) -> None:
    """Each way of keeping states puts the sandbox in the right state for every expansion (the
    actions of the node's path, in order), keeps at most `max_open` of them besides the root's (as
    checkpoints, or live sandboxes), and leaves none."""
    world = FakeFleet()
    result = asyncio.run(best_first(STRATEGIES[name](world, "img", "run", "container"), 40, max_open=max_open))  # type: ignore[arg-type]
    expected = asyncio.run(best_first(Model(), 40, max_open=max_open))
    assert not result.error and result.found == expected.found and result.found[-1] == RIGHT
    assert [e.path for e in result.expansions] == [e.path for e in expected.expansions]
    assert world.scored == [(), *(e.path for e in result.expansions)]
    # Besides the root's state: with forks, the child being scored before the search keeps or drops it.
    assert world.most <= max_open + (2 if name == "fork" else 1) and not world.live
    if name == "checkpoint":  # a rollback for most expansions, a checkpoint only for expanded nodes
        assert 0 < world.rollbacks <= len(result.expansions) and next(world.ids) < len(result.expansions)


# -- the three strategies, on the real task -------------------------------------------------------

# A smaller choice of actions keeps it short: 4 expansions, one of them two deep and one a rollback
# (or fork) from the root after going down.
FEW = [a for a in ACTIONS if a.name in ("read-issue", "patch->=", RIGHT)]
EXPECTED = [("read-issue",), ("read-issue", "read-issue"), ("patch->=",), (RIGHT,)]


@pytest.mark.slow  # ~12 s: three searches over the real task
def test_each_strategy_finds_the_fix_through_the_same_tree(daemon: Daemon, fleet: Client) -> None:
    async def go() -> Any:
        async with AsyncClient(daemon.socket, timeout=120) as c:
            return await run_search(c, budget=6, actions=FEW)

    report = asyncio.run(go())
    assert [r.strategy for r in report.results] == ["checkpoint", "fork", "fresh"]
    for r in report.results:
        assert not r.error, r
        assert r.found == (RIGHT,) and [e.path for e in r.expansions] == EXPECTED, r
        assert [e.solved for e in r.expansions] == [False, False, False, True]
        assert r.per_minute > 0 and r.state_seconds > 0 and r.act_seconds > 0
        assert r.wall >= sum(e.seconds for e in r.expansions)
    scores = [[round(e.score, 6) for e in r.expansions] for r in report.results]
    assert scores[0] == scores[1] == scores[2] == [round(5 / 3, 6), round(5 / 3, 6), round(4 / 3, 6), 2.0]
    assert report.same_tree() and report.ratio("checkpoint") == 1.0 and report.ratio("fork")

    out = io.StringIO()
    assert show(Console(file=out, width=200), report, budget=6)
    text = " ".join(out.getvalue().split())
    assert "(b) fork-per-node" in text and "the same tree each way: yes" in text, text
    assert not fleet.list(labels={LABEL: report.run})  # every sandbox was stopped
