"""The package stays ruff-clean and mypy-strict-clean (run as tests so CI enforces them)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff() -> None:
    assert shutil.which("ruff") or _run("ruff", "--version").returncode == 0
    r = _run("ruff", "check", "src", "tests", "bench")
    assert r.returncode == 0, r.stdout + r.stderr
    r = _run("ruff", "format", "--check", "src")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.slow
def test_mypy_strict() -> None:
    r = _run("mypy", "src/sandfleet")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.unit
def test_generated_files_are_fresh() -> None:
    """docs/openapi.json and the sync client are generated; a stale copy fails here. So is the list of
    the SDK's public names and signatures (docs/public-api.txt): a change to it shows in its diff. And
    the E2B layer's protobuf modules, generated from its .proto files."""
    scripts = ("gen_openapi.py", "gen_sync_client.py", "gen_public_api.py", "gen_e2b_proto.py")
    for script in (f"scripts/{name}" for name in scripts):
        r = subprocess.run([sys.executable, script, "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{script} --check: {r.stdout}{r.stderr}"
