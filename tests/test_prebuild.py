"""The helpers are compiled at setup; a daemon starting later copies them and runs no compiler."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandfleet.runtime import agent_build, criu
from sandfleet.runtime.prebuild import prebuild

pytestmark = pytest.mark.unit


def test_a_daemon_uses_the_prebuilt_helpers_without_a_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = prebuild(tmp_path / "prebuilt")
    assert {p.name for p in built} == {"agent", agent_build.LAUNCHER_NAME, criu.SHIM_NAME}
    monkeypatch.setenv("SANDFLEET_PREBUILT", str(tmp_path / "prebuilt"))
    monkeypatch.setenv("PATH", str(tmp_path / "no-compilers-here"))  # gcc and musl-gcc are gone
    cache = tmp_path / "daemon-state"
    got = [
        agent_build.build_agent(cache / "agent"),
        agent_build.build_launcher(cache / "launcher"),
        criu.build_shim(cache / "s"),
    ]
    for have, want in zip(got, built, strict=True):
        assert have.read_bytes() == want.read_bytes() and os.access(have, os.X_OK)
        # the daemon's copy keeps its own path (snapshots name the agent build by it)
        assert have.parent.name == want.parent.name and str(cache) in str(have)


def test_without_a_prebuilt_set_the_daemon_still_builds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDFLEET_PREBUILT", str(tmp_path / "empty"))
    assert agent_build.build_agent(tmp_path / "agent").stat().st_size > 0
