"""Benchmark (c) of issue 4: upgrade one toolkit layer under 100 environments; count what is rebuilt.

Each environment is a recipe: busybox base + its own workspace (copy step) + the shared toolkit
(copy step, also published as `toolkit/harness:<version>`). All 100 are built cold, then the
toolkit gets a new version and all 100 recipes are built again. A layer is rebuilt only when its
cache key changed: copy steps are keyed by their content, not by what is below them, so the upgrade
should rebuild exactly one layer (the toolkit) and rewrite 100 manifests.

For comparison: a Dockerfile-style chained cache (each step keyed by everything below it) would
rebuild the toolkit once per environment, since each sits on a different workspace: 100 layers.

    python3 bench/upgrade.py [--envs 100] [--results bench/results]

Runs without a daemon (copy steps are built on the host) in a private layer store under /tmp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import cast

from sandfleet.images import LayerStore
from sandfleet.images.recipe import Recipe
from sandfleet.images.recipe_build import build_recipe

REPO = Path(__file__).resolve().parent.parent


def make_tree(root: Path, files: int, size: int, seed: int) -> None:
    """A small source tree: `files` files of about `size` bytes under a few directories."""
    rng = random.Random(seed)
    for i in range(files):
        d = root / f"pkg{i % 5}"
        d.mkdir(parents=True, exist_ok=True)
        words = " ".join(rng.choice(["def", "return", "self", "value", "import", "class"]) for _ in range(size // 6))
        (d / f"mod{i}.py").write_text(f"# file {i} seed {seed}\n{words}\n")


def recipe_text(i: int, toolkit_version: str) -> str:
    return f"""
ref = "bench-env/e{i}:1"
base = "busybox"
[[step]]
copy = {{ src = "workspaces/w{i}", dest = "/work" }}
[[step]]
copy = {{ src = "toolkit", dest = "/opt/harness" }}
name = "toolkit/harness:{toolkit_version}"
"""


async def build_all(store: LayerStore, work: Path, envs: int, version: str) -> dict[str, float]:
    built = hits = 0
    t0 = time.perf_counter()
    for i in range(envs):
        result = await build_recipe(Recipe.parse(recipe_text(i, version), work), store)
        built += sum(not s.cache_hit for s in result.steps)
        hits += result.cache_hits
    return {"layers_built": built, "cache_hits": hits, "seconds": time.perf_counter() - t0}


async def measure(envs: int) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="sandfleet-upgrade-"))
    try:
        store = LayerStore(work / "store")
        for i in range(envs):
            make_tree(work / "workspaces" / f"w{i}", files=40, size=2000, seed=i)
        make_tree(work / "toolkit", files=60, size=3000, seed=-1)
        await store.ensure("busybox")  # the base, built once before timing
        cold = await build_all(store, work, envs, "3.1")
        (work / "toolkit" / "pkg0" / "mod0.py").write_text("# harness 3.2: a fix\n")
        upgrade = await build_all(store, work, envs, "3.2")
        again = await build_all(store, work, envs, "3.2")
        # Every environment now names the new toolkit layer and keeps its workspace layer.
        new_toolkit = store.resolve("toolkit/harness:3.2").layers[-1].digest
        old_toolkit = store.resolve("toolkit/harness:3.1").layers[-1].digest
        stacks = [store.resolve(f"bench-env/e{i}:1").layers for i in range(envs)]
        assert all(s[-1].digest == new_toolkit for s in stacks) and new_toolkit != old_toolkit
        layer_files = len(list(store.layers_dir.glob("*.erofs")))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"cold": cold, "upgrade": upgrade, "rebuild_unchanged": again, "layer_files_in_store": layer_files}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", type=int, default=100)
    parser.add_argument("--results", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    measured = asyncio.run(measure(args.envs))
    cold, upgrade, again = (cast(dict[str, float], measured[k]) for k in ("cold", "upgrade", "rebuild_unchanged"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    out = {
        "benchmark": "upgrade one toolkit layer under N environments (issue 4, c)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit.strip(),
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores",
        "envs": args.envs,
        **measured,
        # Chained (Dockerfile-style) keys: the toolkit step sits above each environment's own
        # workspace, so its key differs per environment and the upgrade rebuilds N layers.
        "chained_cache_would_rebuild": args.envs,
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "upgrade.json").write_text(json.dumps(out, indent=2) + "\n")
    md = [
        f"# Toolkit upgrade under {args.envs} environments ({out['date']}, commit {out['commit']}, {out['machine']})",
        "",
        "| build | layers built | cache hits | seconds |",
        "|---|---|---|---|",
        f"| cold: {args.envs} recipes (base + workspace + toolkit) | {cold['layers_built']:.0f} "
        f"| {cold['cache_hits']:.0f} | {cold['seconds']:.2f} |",
        f"| toolkit 3.1 -> 3.2, all {args.envs} rebuilt | **{upgrade['layers_built']:.0f}** "
        f"| {upgrade['cache_hits']:.0f} | {upgrade['seconds']:.2f} |",
        f"| nothing changed | {again['layers_built']:.0f} | {again['cache_hits']:.0f} | {again['seconds']:.2f} |",
        "",
        f"A chained (Dockerfile-style) cache, where each step's key includes every layer below it, would "
        f"rebuild {out['chained_cache_would_rebuild']} toolkit layers for the same upgrade (one per environment).",
        "",
        "Command: `python3 bench/upgrade.py`",
    ]
    (args.results / "upgrade.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))  # noqa: T201 (a benchmark's report)


if __name__ == "__main__":
    main()
