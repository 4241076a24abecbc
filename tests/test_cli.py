"""The `sandfleet` command line against a real daemon: create, exec, shell, ls, rm, images, doctor, demo."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import Daemon


def sf(daemon: Daemon, *args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SANDFLEET_SOCKET=str(daemon.socket), COLUMNS="200")
    argv = [sys.executable, "-m", "sandfleet", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=timeout)


def test_create_exec_ls_rm(daemon: Daemon) -> None:
    r = sf(daemon, "create", "--image", "busybox", "--memory", "128MiB", "--label", "who=cli", "--env", "GREETING=hi")
    assert r.returncode == 0, r.stderr
    sid = r.stdout.strip()
    assert sid.startswith("sb-")

    r = sf(daemon, "exec", sid, "--", "sh", "-c", "echo $GREETING; echo oops >&2; exit 3")
    assert r.returncode == 3
    assert r.stdout == "hi\n"
    assert "oops" in r.stderr

    r = sf(daemon, "exec", sid, "echo one && echo two")
    assert r.returncode == 0 and r.stdout == "one\ntwo\n"

    r = sf(daemon, "ls", "--label", "who=cli")
    assert r.returncode == 0 and sid in r.stdout and "running" in r.stdout

    # The interactive shell keeps state between lines (it is a session).
    r = sf(daemon, "shell", sid, stdin="cd /tmp\nX=42\necho $X $(pwd)\nexit\n")
    assert r.returncode == 0, r.stderr
    assert "42 /tmp" in r.stdout

    r = sf(daemon, "pause", "--label", "who=cli")
    assert r.returncode == 0 and sid in r.stdout
    assert "paused" in sf(daemon, "ls", "--label", "who=cli").stdout
    r = sf(daemon, "resume", sid)
    assert r.returncode == 0 and sid in r.stdout
    assert "running" in sf(daemon, "ls", "--label", "who=cli").stdout

    r = sf(daemon, "rm", "--label", "who=cli")
    assert r.returncode == 0 and sid in r.stdout
    r = sf(daemon, "exec", sid, "true")
    assert r.returncode == 2 and "not_found" in r.stderr


def test_errors_are_typed_and_brief(daemon: Daemon) -> None:
    r = sf(daemon, "create", "--image", "no-such-image")
    assert r.returncode == 2
    assert "not_found" in r.stderr and "Traceback" not in r.stderr
    r = sf(daemon, "create", "--memory", "lots")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    env = dict(os.environ, SANDFLEET_SOCKET="/nonexistent/sandfleet.sock")
    r = subprocess.run([sys.executable, "-m", "sandfleet", "ls"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2 and "unavailable" in r.stderr


def test_images_and_doctor(daemon: Daemon) -> None:
    r = sf(daemon, "images")
    assert r.returncode == 0 and "busybox" in r.stdout
    r = sf(daemon, "doctor", "--socket", str(daemon.socket))
    assert "crun" in r.stdout and "cgroups" in r.stdout and "erofs" in r.stdout
    assert "FAIL" not in r.stdout, r.stdout
    assert r.returncode == 0


@pytest.mark.parametrize("image", ["busybox", pytest.param("python:3.11", marks=pytest.mark.slow)])
def test_demo_rollout(daemon: Daemon, image: str) -> None:
    r = sf(daemon, "demo", "--sandboxes", "3", "--image", image, "--socket", str(daemon.socket), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3/3 rollouts solved" in r.stdout
