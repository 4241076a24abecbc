"""`sandfleet demo`: a miniature RL rollout against the local daemon.

Each rollout gets a sandbox with a buggy `solution.py` and a test, then plays a scripted "policy"
for a few turns (inspect, run the test, patch, re-run), the way an agent drives a sandbox, and is
scored by the test's exit code. Rollouts run concurrently, as a trainer's would.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sandfleet.client import AsyncClient
from sandfleet.errors import SandboxError
from sandfleet.models import Backend, Resources, SandboxSpec

BUGGY = "def add(a, b):\n    return a - b\n"
TEST_PY = "from solution import add\nassert add(2, 3) == 5, 'add is wrong'\nprint('tests passed')\n"
TEST_SH = (
    'r=$(sh /task/solution.sh 2 3); [ "$r" -eq 5 ] && echo "tests passed" || { echo "add is wrong" >&2; exit 1; }\n'
)
BUGGY_SH = "echo $(( $1 - $2 ))\n"


@dataclass
class Rollout:
    index: int
    sandbox_id: str = ""
    create_ms: float = 0.0
    exec_ms: list[float] = field(default_factory=list)
    reward: float = 0.0
    error: str = ""


async def _rollout(fleet: AsyncClient, index: int, image: str, python: bool, backend: Backend) -> Rollout:
    out = Rollout(index)
    t0 = time.perf_counter()
    try:
        spec = SandboxSpec(
            backend=backend,
            image=image,
            resources=Resources(cpu=1, memory="512MiB"),
            idle_ttl=120,
            labels={"job": "demo", "rollout": str(index)},
            # The patch keeps the file's size and lands within the same second: a cached .pyc
            # would look fresh to CPython and the fix would go unseen.
            env={"PYTHONDONTWRITEBYTECODE": "1"},
        )
        async with await fleet.create(spec) as sb:
            out.sandbox_id = sb.id
            out.create_ms = (time.perf_counter() - t0) * 1000
            if python:
                await sb.files.write("/task/solution.py", BUGGY)
                await sb.files.write("/task/test.py", TEST_PY)
                turns = [
                    "cat /task/solution.py",
                    "cd /task && python3 test.py",
                    "sed -i 's/a - b/a + b/' /task/solution.py",
                    "cd /task && python3 test.py",
                ]
            else:
                await sb.files.write("/task/solution.sh", BUGGY_SH)
                await sb.files.write("/task/test.sh", TEST_SH)
                turns = [
                    "cat /task/solution.sh",
                    "sh /task/test.sh",
                    "sed -i 's/- \\$2/+ $2/' /task/solution.sh",
                    "sh /task/test.sh",
                ]
            result = None
            for cmd in turns:
                t = time.perf_counter()
                result = await sb.exec(cmd, timeout=30)
                out.exec_ms.append((time.perf_counter() - t) * 1000)
            out.reward = 1.0 if result is not None and result.exit_code == 0 else 0.0
    except SandboxError as exc:
        out.error = f"{exc.code}: {exc.message}"[:80]
    return out


def run_demo(console: Console, socket: Path, n: int, image: str, *, backend: Backend = "container") -> bool:
    async def main() -> list[Rollout]:
        async with AsyncClient(socket) as fleet:
            with console.status(f"preparing image {image} (built on first use)..."):
                await fleet.build_image(image)
            python = image.startswith("python")
            return await asyncio.gather(*(_rollout(fleet, i, image, python, backend) for i in range(n)))

    t0 = time.perf_counter()
    rollouts = asyncio.run(main())
    wall = time.perf_counter() - t0
    title = f"demo rollout on {image}, {backend} tier"
    table = Table("#", "SANDBOX", "CREATE ms", "TURNS", "EXEC p50 ms", "REWARD", title=title)
    for r in rollouts:
        p50 = statistics.median(r.exec_ms) if r.exec_ms else 0.0
        table.add_row(
            str(r.index),
            r.sandbox_id or "-",
            f"{r.create_ms:.1f}",
            str(len(r.exec_ms)),
            f"{p50:.1f}",
            f"{r.reward:.0f}" if not r.error else f"[red]{r.error}[/red]",
        )
    console.print(table)
    ok = all(r.reward == 1.0 for r in rollouts)
    console.print(
        f"{sum(r.reward for r in rollouts):.0f}/{n} rollouts solved in {wall:.1f}s "
        f"({'all sandboxes stopped' if ok else 'see errors above'})"
    )
    return ok
