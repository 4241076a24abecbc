"""A tree search over the more-itertools task of rl_demo, run three ways to compare what a node costs.

The task is rl_demo's (`build_task`): more-itertools 10.5.0 with `chunked(..., strict=True)` broken
(`if len(chunk) > n:` where `!= n` belongs). A scripted "policy" proposes actions with priors: looks
around (no-ops: read the issue, look at the code, add a comment) and patches of the buggy line, of
which one is right (`!= n`) and the others wrong (raise on every chunk, never raise, a typo that
breaks the module). A node is the repository after a path of actions; its score is the share of the
visible tests (`tests/test_recipes.py`) that pass plus the share of three quick checks of `chunked`
(full chunks, a short last chunk under strict, the same without strict) that hold.

Best-first: the frontier holds (node, untried action) pairs, best first by the node's score plus the
action's prior less a cost per depth; an expansion takes the best pair, applies the action to the
node's state and scores the result. The search stops at a node that passes (every visible test and
every check), or after a budget of expansions. At most `max_open` nodes keep a state to come back to
(the worst are dropped past that), and a node's state is let go once all its actions are tried.

The same search (the same nodes in the same order: the scores are deterministic) runs three ways:

- checkpoint: one sandbox; a node's state is a checkpoint of it, taken when the node is first
  expanded. An expansion puts the sandbox in the node's state (unless it is in it already: going
  down the tree) by rolling back to the nearest checkpoint on the node's path and replaying the
  rest (the node's own action, as a rule: its parent was checkpointed when first expanded),
  checkpoints the node if it is not yet, applies the action and scores.
- fork: a node's state is a live sandbox. An expansion forks the node's sandbox, acts in the child
  and scores it; the child is stopped at once if it will not be expanded, else once its actions are
  all tried (or it is dropped).
- fresh: nothing is kept. An expansion creates a sandbox from the task image, replays the node's
  path, applies the action, scores, and stops it.

Only the SDK is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import re
import secrets
import shlex
import time
import typing
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from sandfleet.client import AsyncClient, AsyncSandbox
from sandfleet.errors import SandboxError
from sandfleet.models import Backend, Resources, SandboxSpec
from sandfleet.rl_demo import LABEL, PROJECT, REPO, VERSION, build_task

MORE = f"{REPO}/more_itertools/more.py"


def _patch(line: str) -> str:
    """Rewrite the one `if len(chunk) ...:` line of more.py (whatever it holds now) to `line`."""
    return f"sed -i 's/^\\( *\\)if len(chunk) [^:]*:$/\\1{line}/' {MORE}"


@dataclass(frozen=True)
class Action:
    name: str
    prior: float  # the scripted policy's preference: higher is tried first
    command: str


ACTIONS: tuple[Action, ...] = (
    Action("read-issue", 0.50, f"cat {REPO}/ISSUE.md"),
    Action("look", 0.45, f"grep -n 'def chunked' -A 32 {MORE}"),
    Action("comment", 0.30, f"echo '# looked at chunked' >> {MORE}"),
    Action("never-raise", 0.28, _patch("if len(chunk) < 0:")),
    Action("patch->=", 0.25, _patch("if len(chunk) >= n:")),
    Action("patch-==", 0.22, _patch("if len(chunk) == n:")),
    Action("typo", 0.20, _patch("if len(chunk) != n")),  # no colon: the module no longer imports
    Action("patch-!=", 0.15, _patch("if len(chunk) != n:")),  # the fix
)
RIGHT = "patch-!="
DEPTH_COST = 0.2
MAX_DEPTH = 3
MAX_OPEN = 24  # nodes holding a state (a checkpoint: 32 at most per sandbox; a live sandbox)

VISIBLE = f"cd {REPO} && python3 -m pytest -q -p no:cacheprovider tests/test_recipes.py 2>&1 | tail -1"
_CHECK_CODE = """\
from more_itertools import chunked
def short():
    it = chunked([1, 2, 3], 2, strict=True)
    if next(it) != [1, 2]:
        return False
    try:
        next(it)
    except ValueError:
        return True
    return False
checks = [
    lambda: list(chunked([1, 2, 3, 4], 2, strict=True)) == [[1, 2], [3, 4]],
    short,
    lambda: list(chunked([1, 2, 3], 2)) == [[1, 2], [3]],
]
def ok(check):
    try:
        return bool(check())
    except Exception:
        return False
print("checks", sum(ok(c) for c in checks), len(checks))
"""
SCORE = f"{VISIBLE}; cd {REPO} && python3 -c {shlex.quote(_CHECK_CODE)} 2>&1 | tail -1"
N_CHECKS = 3


@dataclass(frozen=True)
class Score:
    passed: int  # visible tests
    failed: int  # visible tests failed or in error (a module that does not import: 1 error)
    checks: int  # of N_CHECKS

    @classmethod
    def parse(cls, out: str) -> Score:
        def count(pattern: str) -> int:
            return sum(int(m) for m in re.findall(pattern, out))

        checks = re.search(r"^checks (\d+) \d+$", out, re.M)
        return cls(count(r"(\d+) passed"), count(r"(\d+) (?:failed|errors?)\b"), int(checks[1]) if checks else 0)

    @property
    def value(self) -> float:
        total = self.passed + self.failed
        return (self.passed / total if total else 0.0) + self.checks / N_CHECKS

    @property
    def solved(self) -> bool:
        return self.passed > 0 and self.failed == 0 and self.checks == N_CHECKS


@dataclass(eq=False)
class Node:
    path: tuple[str, ...]
    score: Score
    parent: Node | None = None
    handle: Any = None  # the strategy's: a checkpoint id, a live sandbox
    pending: int = 0  # its actions not tried yet
    dropped: bool = False

    @property
    def depth(self) -> int:
        return len(self.path)


@dataclass
class Expansion:
    path: tuple[str, ...]
    score: float
    solved: bool
    seconds: float


@dataclass
class SearchResult:
    strategy: str
    expansions: list[Expansion]
    found: tuple[str, ...] | None
    wall: float  # the search's seconds (the set-up and the final clean-up excluded)
    setup: float
    state_seconds: float  # spent keeping and restoring states (checkpoint/rollback, fork/stop, create/replay/stop)
    act_seconds: float  # spent applying the actions and scoring
    dropped: int = 0  # nodes dropped past max_open
    error: str = ""

    @property
    def per_minute(self) -> float:
        return len(self.expansions) * 60 / self.wall if self.wall else 0.0


class Strategy:
    """How a node's state is kept and come back to. `setup` readies and scores the root state;
    `expand` applies `action` to `parent`'s state, scores the result and, when `keep`, keeps it in
    `child.handle`; `release` lets a node's state go; `close` ends everything."""

    name = ""

    def __init__(self, fleet: AsyncClient, image: str, run: str, backend: Backend) -> None:
        self.fleet, self.image, self.run, self.backend = fleet, image, run, backend
        self.state_seconds = self.act_seconds = 0.0
        self.actions = {a.name: a for a in ACTIONS}

    def spec(self) -> SandboxSpec:
        return SandboxSpec(
            backend=self.backend,
            image=self.image,
            resources=Resources(cpu=1, memory="512MiB"),
            idle_ttl=600,
            labels={LABEL: self.run, "sandfleet.demo/strategy": self.name},
        )

    @contextlib.asynccontextmanager
    async def _timed(self, what: str) -> AsyncIterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            if what == "state":
                self.state_seconds += dt
            else:
                self.act_seconds += dt

    async def _act_and_score(self, sb: AsyncSandbox, action: Action | None) -> Score:
        async with self._timed("act"):
            if action is not None:
                await sb.exec(action.command, timeout=30)
            return Score.parse((await sb.exec(SCORE, timeout=120)).stdout)

    async def setup(self) -> Score:
        raise NotImplementedError

    async def expand(self, parent: Node, action: Action, child: Node, keep: bool) -> Score:
        raise NotImplementedError

    async def release(self, node: Node) -> None:
        return None

    async def close(self) -> None:
        return None


class CheckpointStrategy(Strategy):
    name = "checkpoint"

    async def setup(self) -> Score:
        self.sb = await self.fleet.create(self.spec())
        score = await self._act_and_score(self.sb, None)  # the first run warms the caches
        self.root_cp = (await self.sb.checkpoint(labels={"node": "root"})).id
        self.at: tuple[str, ...] = ()  # the path of the node whose state the sandbox is in
        return score

    async def expand(self, parent: Node, action: Action, child: Node, keep: bool) -> Score:
        async with self._timed("state"):
            if self.at != parent.path:
                await self._go_to(parent)
            if parent.path and parent.handle is None:  # its first expansion: checkpoint it
                parent.handle = (await self.sb.checkpoint()).id
        self.at = child.path
        return await self._act_and_score(self.sb, action)

    async def _go_to(self, node: Node) -> None:
        """Roll back to the nearest checkpointed node on `node`'s path, then replay the rest of it."""
        base, rest = node, []
        while base.path and base.handle is None:
            assert base.parent is not None
            rest.append(base.path[-1])
            base = base.parent
        await self.sb.rollback(base.handle if base.path else self.root_cp)
        for name in reversed(rest):
            await self.sb.exec(self.actions[name].command, timeout=30)
        self.at = node.path

    async def release(self, node: Node) -> None:
        if node.handle is not None:
            async with self._timed("state"):
                await self.sb.delete_checkpoint(node.handle)
            node.handle = None

    async def close(self) -> None:
        await self.sb.stop()  # its checkpoints go with it


class ForkStrategy(Strategy):
    name = "fork"

    async def setup(self) -> Score:
        self.root = await self.fleet.create(self.spec())
        self.live: set[AsyncSandbox] = {self.root}
        return await self._act_and_score(self.root, None)

    async def expand(self, parent: Node, action: Action, child: Node, keep: bool) -> Score:
        source: AsyncSandbox = parent.handle if parent.path else self.root
        async with self._timed("state"):
            (sb,) = await source.fork(1)
        if isinstance(sb, SandboxError):
            raise sb
        self.live.add(sb)
        score = await self._act_and_score(sb, action)
        if keep and not score.solved:
            child.handle = sb
        else:
            async with self._timed("state"):
                await self._stop(sb)
        return score

    async def _stop(self, sb: AsyncSandbox) -> None:
        await sb.stop()
        self.live.discard(sb)

    async def release(self, node: Node) -> None:
        if node.handle is not None:
            async with self._timed("state"):
                await self._stop(node.handle)
            node.handle = None

    async def close(self) -> None:
        for sb in list(self.live):
            await self._stop(sb)


class FreshStrategy(Strategy):
    name = "fresh"

    async def setup(self) -> Score:
        async with await self.fleet.create(self.spec()) as sb:
            return await self._act_and_score(sb, None)

    async def expand(self, parent: Node, action: Action, child: Node, keep: bool) -> Score:
        async with self._timed("state"):
            sb = await self.fleet.create(self.spec())
        try:
            async with self._timed("state"):
                for name in parent.path:
                    await sb.exec(self.actions[name].command, timeout=30)
            return await self._act_and_score(sb, action)
        finally:
            async with self._timed("state"):
                await sb.stop()


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (CheckpointStrategy, ForkStrategy, FreshStrategy)}


async def best_first(
    strategy: Strategy,
    budget: int,
    actions: Sequence[Action] = ACTIONS,
    max_depth: int = MAX_DEPTH,
    max_open: int = MAX_OPEN,
) -> SearchResult:
    """Best-first search with `strategy` until a node is solved or `budget` expansions are done."""
    t0 = time.perf_counter()
    root = Node((), await strategy.setup())
    t1 = time.perf_counter()
    seq = itertools.count()
    frontier: list[tuple[float, int, Node, Action]] = []
    open_nodes: list[Node] = []
    expansions: list[Expansion] = []
    found: tuple[str, ...] | None = root.path if root.score.solved else None
    dropped = 0

    priors = sorted((a.prior for a in actions), reverse=True)  # a node's actions are tried in this order

    def best_pending(node: Node) -> float:
        return node.score.value + priors[len(priors) - node.pending] - DEPTH_COST * node.depth

    def push(node: Node) -> None:
        base = node.score.value - DEPTH_COST * node.depth
        for a in actions:
            heapq.heappush(frontier, (-round(base + a.prior, 9), next(seq), node, a))  # ties: first pushed
        node.pending = len(actions)
        open_nodes.append(node)

    try:
        push(root)
        while found is None and frontier and len(expansions) < budget:
            _, _, parent, action = heapq.heappop(frontier)
            if parent.dropped:
                continue
            child = Node((*parent.path, action.name), Score(0, 0, 0), parent)
            keep = child.depth < max_depth
            te = time.perf_counter()
            child.score = await strategy.expand(parent, action, child, keep)
            expansions.append(Expansion(child.path, child.score.value, child.score.solved, time.perf_counter() - te))
            parent.pending -= 1
            if parent.pending == 0:
                open_nodes.remove(parent)
                await strategy.release(parent)
            if child.score.solved:
                found = child.path
            elif keep:
                push(child)
                while len(open_nodes) > max_open:  # the node whose best untried action ranks lowest
                    worst = min(reversed(open_nodes), key=best_pending)
                    worst.dropped = True
                    open_nodes.remove(worst)
                    await strategy.release(worst)
                    dropped += 1
        error = ""
    except SandboxError as exc:
        error = f"{exc.code}: {exc.message}"[:200]
    t2 = time.perf_counter()
    try:
        await strategy.close()
    except SandboxError as exc:
        error = error or f"{exc.code}: {exc.message}"[:200]
    return SearchResult(
        strategy.name,
        expansions,
        found,
        t2 - t1,
        t1 - t0,
        strategy.state_seconds,
        strategy.act_seconds,
        dropped,
        error,
    )


@dataclass
class Report:
    run: str  # the runs' label value (LABEL) on every sandbox they made
    results: list[SearchResult] = field(default_factory=list)
    build: float = 0.0

    def ratio(self, name: str) -> float | None:
        """How many times as many nodes per minute the checkpoint strategy explores as `name`."""
        by = {r.strategy: r.per_minute for r in self.results}
        return by["checkpoint"] / by[name] if by.get("checkpoint") and by.get(name) else None

    def same_tree(self) -> bool:
        paths = [[e.path for e in r.expansions] for r in self.results]
        return all(p == paths[0] for p in paths)


def refusal(tiers: dict[str, list[str]], backend: str) -> str | None:
    """Why the search cannot run on `backend` of a node running `tiers`, or None."""
    if backend not in tiers:
        return f"this node does not run the {backend} tier (it runs: {', '.join(sorted(tiers))})"
    if "snapshot" not in tiers[backend]:
        return f"the search checkpoints and forks sandboxes: the {backend} tier cannot"
    return None


async def run_search(
    fleet: AsyncClient,
    budget: int = 24,
    strategies: Sequence[str] = ("checkpoint", "fork", "fresh"),
    backend: Backend = "container",
    actions: Sequence[Action] = ACTIONS,
) -> Report:
    """Build the task (cached), then run the same search with each strategy, one after the other."""
    t0 = time.perf_counter()
    image, _hidden = await build_task(fleet)
    report = Report(f"search-{secrets.token_hex(3)}", build=time.perf_counter() - t0)
    for name in strategies:
        strategy = STRATEGIES[name](fleet, image, report.run, backend)
        report.results.append(await best_first(strategy, budget, actions))
    return report


def show(console: Console, report: Report, budget: int) -> bool:
    """The strategies as a table and a summary; whether every search found the fix, the same way."""
    title = (
        f"{PROJECT} {VERSION}: best-first search for the chunked(strict=True) fix, at most {budget} expansions; "
        "per node, s keeping and restoring states (STATE), acting and scoring (SCORE)"
    )
    table = Table(
        Column("WAY", no_wrap=True), "NODES", "FOUND", "NODES/MIN", "(a) ÷", "STATE s", "SCORE s", title=title
    )
    for r in report.results:
        n = len(r.expansions) or 1
        ratio = report.ratio(r.strategy)
        table.add_row(
            f"({'abc'[list(STRATEGIES).index(r.strategy)]}) {r.strategy}",
            str(len(r.expansions)),
            " > ".join(r.found) if r.found else f"[red]{escape(r.error) or 'not found'}[/red]",
            f"{r.per_minute:.1f}",
            f"{ratio:.2f}x" if ratio else "-",
            f"{r.state_seconds / n:.2f}",
            f"{r.act_seconds / n:.2f}",
        )
    console.print(table)
    fork, fresh = report.ratio("fork"), report.ratio("fresh")
    if fork is not None:
        console.print(
            f"(a) checkpoint/rollback explores {fork:.2f}x the nodes per minute of (b) fork-per-node"
            + (f" and {fresh:.2f}x those of (c) a fresh sandbox per node" if fresh is not None else "")
            + f" (issue target B7: (a) >= 5x (b): {'met' if fork >= 5 else 'not met'}); "
            f"the same tree each way: {'yes' if report.same_tree() else 'NO'}; seconds of the searches "
            + ", ".join(f"{r.wall:.1f}" for r in report.results)
            + ", of their set-ups "
            + ", ".join(f"{r.setup:.1f}" for r in report.results)
            + f"; task build {report.build:.1f}s"
        )
    return report.same_tree() and all(r.found and r.found[-1] == RIGHT and not r.error for r in report.results)


def run_demo(console: Console, err_console: Console, sock: Path, budget: int, backend: str) -> int:
    """`sandfleet demo --task search` on the daemon at `sock`: its exit status (2: the tier cannot)."""

    async def go() -> int:
        async with AsyncClient(sock, timeout=120) as fleet:
            why = refusal(await fleet.tiers(), backend)
            if why is not None:
                err_console.print(f"[red]{escape(why)}: run it on the container tier[/red]")
                return 2
            with console.status("building the task (more-itertools from PyPI), then searching 3 ways..."):
                await fleet.build_image("python:3.11")
                report = await run_search(fleet, budget, backend=typing.cast(Backend, backend))
            return 0 if show(console, report, budget) else 1

    try:
        return asyncio.run(go())
    except SandboxError as exc:
        err_console.print(f"[red]{exc.code} ({exc.cause}): {escape(exc.message)}[/red]")
        return 1
