"""A real RL task on sandfleet: fix a bug in more-itertools, graded by its own hidden test suite.

The task: more-itertools 10.5.0's source, fetched from the Python package index (its sdist) when
the task is built, with one bug put in (`chunked(..., strict=True)` stops raising on a short last
chunk). The image holds the repository (no history: an sdist has none), pytest, the issue text and
the visible tests (`tests/test_recipes.py`); the project's main suite (`tests/test_more.py`, 500+
tests) is a layer only verifiers mount, at the path where it belongs.

A run: one sandbox is set up (its first test run warms the caches) and snapshotted; each group of
rollouts restores from that snapshot, one trajectory per rollout (every step logged exactly once);
a scripted "policy" reads the issue, runs the visible tests, looks at the code and, by its seed,
patches it right, patches it wrong, does nothing, cheats on the tests, or hangs a command; each
rollout is then verified apart (a fresh sandbox: the set-up state + its changes to the package, and
nothing else it changed, + the hidden suite) and closed with the verifier's reward. Only the SDK is used.
"""

from __future__ import annotations

import asyncio
import collections
import random
import secrets
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sandfleet.client import AsyncClient
from sandfleet.errors import SandboxError
from sandfleet.models import Backend, Resources, SandboxSpec

PROJECT, VERSION = "more-itertools", "10.5.0"
TASK_IMAGE = "tasks/more-itertools-chunked:1"
HIDDEN_IMAGE = "tasks/more-itertools-chunked-hidden:1"
REPO = "/work/repo"
PYTEST = "pytest==8.3.4"
LABEL = "sandfleet.demo/task"
# What the task asks of its tier: rollouts restored from a set-up snapshot, each verified apart from
# the agent's changes taken as a layer (pack).
NEEDS = ("snapshot", "pack")

BUG = ("                if len(chunk) != n:", "                if len(chunk) > n:")
ISSUE = """\
chunked(iterable, n, strict=True) must raise ValueError when len(iterable) is not a
multiple of n, before yielding the short last chunk. It yields it instead.
"""
VISIBLE = f"cd {REPO} && python3 -m pytest -q -p no:cacheprovider tests/test_recipes.py 2>&1 | tail -2"
# The verdict is pytest's exit status (1: tests failed, the agent's fault; 2-5: the run itself broke).
CHECKS = f"cd {REPO} && python3 -m pytest -q --tb=no -p no:cacheprovider tests/test_more.py tests/test_recipes.py"

# The scripted policy's moves once it has looked around: (name, weight, commands).
FIX = f"sed -i 's/if len(chunk) > n:/if len(chunk) != n:/' {REPO}/more_itertools/more.py"
MOVES: list[tuple[str, int, list[str]]] = [
    ("fix", 6, [FIX]),
    ("fix-other-way", 2, [f"sed -i 's/if len(chunk) > n:/if len(chunk) < n:/' {REPO}/more_itertools/more.py"]),
    ("wrong-fix", 3, [f"sed -i 's/if len(chunk) > n:/if len(chunk) >= n:/' {REPO}/more_itertools/more.py"]),
    ("no-op", 2, [f"echo '# looked at chunked' >> {REPO}/more_itertools/more.py"]),
    (
        "cheat",  # rewrite the visible tests, plant a passing "test_more.py" where the hidden one goes
        2,
        [
            f"cat {REPO}/tests/test_more.py 2>&1 | head -1",
            f"printf 'def test_ok():\\n    pass\\n' > {REPO}/tests/test_recipes.py",
            f"cp {REPO}/tests/test_recipes.py {REPO}/tests/test_more.py",
        ],
    ),
    ("hang-then-fix", 1, ["python3 -c 'while True: pass'", FIX]),
]


@dataclass
class Rollout:
    group: int
    index: int
    seed: int
    move: str = ""
    steps: int = 0
    replayed: int = 0
    step_causes: list[str] = field(default_factory=list)
    reward: float = 0.0
    cause: str | None = None
    changed: list[str] = field(default_factory=list)
    error: str = ""
    seconds: float = 0.0


@dataclass
class Report:
    rollouts: list[Rollout]
    wall: float  # seconds for the rollouts (set-up and task build excluded)
    setup: float
    build: float

    @property
    def per_minute(self) -> float:
        return len(self.rollouts) * 60 / self.wall if self.wall else 0.0

    def causes(self) -> dict[str, int]:
        """Failures by whose fault: of the verifications, and of steps (`step:<cause>`)."""
        c: collections.Counter[str] = collections.Counter()
        for r in self.rollouts:
            c[r.cause or "passed"] += 1
            c.update(f"step:{x}" for x in r.step_causes)
        return dict(c)


def _fetch_sdist(dest: Path) -> Path:
    """The project's source distribution from the package index, unpacked under `dest`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-binary", ":all:"]
        + ["--no-deps", f"{PROJECT}=={VERSION}", "-d", str(dest)],
        check=True,
        capture_output=True,
    )
    (archive,) = dest.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    return next(p for p in dest.iterdir() if p.is_dir())


def _task_dirs(root: Path) -> None:
    """root/repo (the task: source with the bug, visible tests, the issue) and root/hidden."""
    src = _fetch_sdist(root / "sdist")
    repo, hidden = root / "repo", root / "hidden"
    shutil.copytree(src, repo, ignore=shutil.ignore_patterns(".github", "docs", "__pycache__"))
    more = repo / "more_itertools" / "more.py"
    text = more.read_text()
    if BUG[0] not in text:
        raise RuntimeError(f"{PROJECT} {VERSION}: the line the bug goes into is not there")
    more.write_text(text.replace(BUG[0], BUG[1], 1))
    (repo / "ISSUE.md").write_text(ISSUE)
    hidden.mkdir()
    shutil.move(repo / "tests" / "test_more.py", hidden / "test_more.py")


def _recipe(ref: str, src: str, dest: str) -> str:
    return (
        f'ref = "{ref}"\nbase = "python:3.11"\nworkdir = "{REPO}"\n'
        f'[[step]]\npip = ["{PYTEST}"]\n'
        f'[[step]]\ncopy = {{ src = "{src}", dest = "{dest}", exclude = ["__pycache__"] }}\n'
    )


async def build_task(fleet: AsyncClient) -> tuple[str, str]:
    """(the task image, the digest of the hidden tests' layer); cached by the recipe builder."""
    with tempfile.TemporaryDirectory(prefix="sandfleet-task-") as tmp:
        root = Path(tmp)
        await asyncio.to_thread(_task_dirs, root)
        image = await fleet.build_recipe(_recipe(TASK_IMAGE, "repo", REPO), base_dir=root)
        hidden = await fleet.build_recipe(_recipe(HIDDEN_IMAGE, "hidden", f"{REPO}/tests"), base_dir=root)
    return f"{image.name}:{image.tag}", hidden.layers[-1]


async def _rollout(fleet: AsyncClient, run: str, snapshot: str, hidden: str, group: int, index: int) -> Rollout:
    seed = group * 1000 + index
    out = Rollout(group, index, seed)
    rng = random.Random(seed)
    name, _, moves = rng.choices(MOVES, weights=[w for _, w, _ in MOVES])[0]
    out.move = name
    t0 = time.perf_counter()
    try:
        traj = await fleet.trajectory(
            f"{run}-g{group}-r{index}", snapshot_id=snapshot, seed=seed, labels={LABEL: run}, metadata={"move": name}
        )
        commands = [f"cat {REPO}/ISSUE.md", VISIBLE, f"grep -n 'def chunked' -A 32 {REPO}/more_itertools/more.py"]
        for cmd in [*commands, *moves, VISIBLE]:
            # A hang is cut by the CPU it burns, not by the time a busy node makes it wait.
            result = await traj.exec(cmd, timeout=60, cpu_time=3 if "while True" in cmd else None)
            out.steps += 1
            out.replayed += bool(traj.last and traj.last.replayed)
            if result.cause is not None:
                out.step_causes.append(result.cause)
        verdict = await traj.verify(
            CHECKS, layers=[hidden], allow=[f"{REPO}/more_itertools"], protect=[f"{REPO}/tests"], timeout=300
        )
        out.reward, out.cause = verdict.reward, verdict.cause
        out.changed = [
            f"{c.change[0].upper()} {c.path.removeprefix(REPO + '/')}"
            for c in verdict.changed
            if c.type != "dir" and "__pycache__" not in c.path  # bytecode the runs wrote
        ]
        await traj.close()
    except SandboxError as exc:
        out.error, out.cause = f"{exc.code}: {exc.message}"[:100], exc.cause
    out.seconds = time.perf_counter() - t0
    return out


def tier_refusal(tiers: dict[str, list[str]], backend: str) -> str | None:
    """Why the task cannot run on `backend` of a node running `tiers` (its capabilities), or None."""
    if backend not in tiers:
        return f"this node does not run the {backend} tier (it runs: {', '.join(sorted(tiers))})"
    missing = [c for c in NEEDS if c not in tiers[backend]]
    if missing:
        return (
            f"the {PROJECT} task needs a tier that can {' and '.join(NEEDS)} (rollouts restore a set-up "
            f"snapshot; verification takes the agent's changes as a layer); the {backend} tier cannot "
            f"{' or '.join(missing)}"
        )
    return None


async def run_task(fleet: AsyncClient, groups: int = 1, group_size: int = 16, backend: Backend = "container") -> Report:
    """Build the task (cached), set up one sandbox of `backend` and snapshot it, then run `groups`
    groups of `group_size` rollouts, one group after the other, each group's rollouts at once."""
    t0 = time.perf_counter()
    image, hidden = await build_task(fleet)
    t1 = time.perf_counter()
    run = f"demo-{secrets.token_hex(3)}"
    spec = SandboxSpec(
        backend=backend, image=image, resources=Resources(cpu=1, memory="512MiB"), idle_ttl=600, labels={LABEL: run}
    )
    async with await fleet.create(spec) as setup:
        await setup.exec(VISIBLE, timeout=120)  # the set-up state: caches warm
        snap = await setup.snapshot(ttl=3600, labels={LABEL: run})
    t2 = time.perf_counter()
    rollouts: list[Rollout] = []
    try:
        for g in range(groups):
            rollouts += await asyncio.gather(*(_rollout(fleet, run, snap.id, hidden, g, i) for i in range(group_size)))
    finally:
        await fleet.delete_snapshot(snap.id)
        for info in await fleet.trajectories({LABEL: run}):
            traj = await fleet.get_trajectory(info.id)
            await traj.delete()
    return Report(rollouts, time.perf_counter() - t2, t2 - t1, t1 - t0)


def show(console: Console, report: Report) -> bool:
    """The rollouts as a table and a summary; whether every rollout got a verdict (none lost to infra)."""
    table = Table("ROLLOUT", "MOVE", "STEPS", "FAILED STEPS", "REWARD", "VERDICT", "AGENT CHANGED", "s",
                  title=f"{PROJECT} {VERSION}: fix chunked(strict=True), graded by its hidden suite")  # fmt: skip
    for r in report.rollouts:
        table.add_row(
            f"{r.group}/{r.index}",
            r.move,
            str(r.steps),
            ", ".join(r.step_causes) or "-",
            f"{r.reward:.0f}",
            ("passed" if r.cause is None else r.cause) if not r.error else f"[red]{r.cause}: {r.error}[/red]",
            ", ".join(r.changed) or "-",
            f"{r.seconds:.0f}",
        )
    console.print(table)
    n = len(report.rollouts)
    mean = sum(r.reward for r in report.rollouts) / n if n else 0.0
    console.print(
        f"{n} rollouts in {report.wall:.1f}s ({report.per_minute:.0f} rollouts/min; task build {report.build:.1f}s, "
        f"set-up + snapshot {report.setup:.1f}s); mean reward {mean:.2f}; outcomes {report.causes()}"
    )
    return all(r.cause != "infra" and not r.error for r in report.rollouts)
