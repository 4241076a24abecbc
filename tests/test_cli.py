"""The `sandfleet` command line against a real daemon: create, exec, shell, ls, rm, checkpoints, images, doctor,
demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Daemon


def sf(daemon: Daemon, *args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SANDFLEET_SOCKET=str(daemon.socket), COLUMNS="200")
    argv = [sys.executable, "-m", "sandfleet", *args]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow
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


def test_checkpoint_rollback_and_delete(daemon: Daemon) -> None:
    """checkpoint, checkpoints, rollback (the file is back, a later session dropped), delete-checkpoint;
    a bad or deleted checkpoint id is a typed error and exit 2."""
    sid = sf(daemon, "create", "--image", "busybox", "--memory", "128MiB", "--label", "who=cli-cp").stdout.strip()
    assert sid.startswith("sb-")
    try:
        assert sf(daemon, "exec", sid, "echo before > /tmp/f").returncode == 0
        r = sf(daemon, "checkpoint", sid, "--label", "step=1", "--label", "k=v")
        assert r.returncode == 0, r.stderr
        m = re.fullmatch(r"(cp-\S+)  \(\d+\.\d MiB, \d+\.\d{3} s\)\n", r.stdout)
        assert m, r.stdout
        cp = m.group(1)

        r = sf(daemon, "checkpoints", sid)
        assert r.returncode == 0, r.stderr
        row = next(line for line in r.stdout.splitlines() if cp in line)
        assert "step=1,k=v" in row and "MiB" in row, r.stdout
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", row), row

        assert sf(daemon, "exec", sid, "echo after > /tmp/f").returncode == 0
        with daemon.client() as fleet:  # a session opened after the checkpoint: the rollback drops it
            session = fleet.get(sid).session()
        r = sf(daemon, "rollback", sid, cp)
        assert r.returncode == 0, r.stderr
        want = rf"{sid} back to {cp}  \(\d+\.\d{{3}} s\); dropped: sessions {session.id}\n"
        assert re.fullmatch(want, r.stdout), r.stdout
        assert sf(daemon, "exec", sid, "cat /tmp/f").stdout == "before\n"

        r = sf(daemon, "delete-checkpoint", sid, cp)
        assert r.returncode == 0 and r.stdout == f"{cp}\n", r.stdout + r.stderr
        assert cp not in sf(daemon, "checkpoints", sid).stdout

        for bad in (cp, "cp-nope"):
            r = sf(daemon, "rollback", sid, bad)
            assert r.returncode == 2 and "not_found" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = sf(daemon, "delete-checkpoint", sid, "cp-nope")
        assert r.returncode == 2 and "not_found" in r.stderr and "Traceback" not in r.stderr, r.stderr
        r = sf(daemon, "checkpoint", sid, "--label", "novalue")
        assert r.returncode != 0 and "KEY=VALUE" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        sf(daemon, "rm", sid)
    r = sf(daemon, "checkpoints", sid)  # its checkpoints went with it
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


def test_images_and_doctor(daemon: Daemon) -> None:
    r = sf(daemon, "images")
    assert r.returncode == 0 and "busybox" in r.stdout
    r = sf(daemon, "doctor", "--socket", str(daemon.socket))
    assert "crun" in r.stdout and "cgroups" in r.stdout and "erofs" in r.stdout
    assert "FAIL" not in r.stdout, r.stdout
    assert r.returncode == 0


@pytest.mark.parametrize("image", ["busybox", "python:3.11"])
def test_demo_rollout(daemon: Daemon, image: str) -> None:
    r = sf(
        daemon,
        "demo",
        "--task",
        "toy",
        "--sandboxes",
        "3",
        "--image",
        image,
        "--socket",
        str(daemon.socket),
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3/3 rollouts solved" in r.stdout


@pytest.mark.slow
def test_images_build_recipe_import_and_layers(daemon: Daemon, tmp_path: Path) -> None:
    """`images build recipe.toml` (sent to the daemon; a run step in a build sandbox), `create --layer`,
    `images import`."""
    marker = os.urandom(4).hex()  # so the shared store's build cache cannot answer for this test
    (tmp_path / "tool").mkdir()
    (tmp_path / "tool" / "tk").write_text(f"#!/bin/sh\necho tk {marker}\n")
    (tmp_path / "env.toml").write_text(
        f'ref = "t/cli-env:1"\nbase = "busybox"\n'
        f'[[step]]\ncopy = {{ src = "tool", dest = "/opt/tool" }}\nname = "t/cli-tool:{marker}"\n'
        f'[[step]]\nrun = "chmod +x /opt/tool/tk && echo {marker} > /built"\n'
    )
    r = sf(daemon, "images", "build", str(tmp_path / "env.toml"), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "t/cli-env:1" in r.stdout and "1/3 from cache" in r.stdout, r.stdout  # the base image was there
    r = sf(daemon, "images", "build", str(tmp_path / "env.toml"))
    assert r.returncode == 0 and "3/3 from cache" in r.stdout, r.stdout + r.stderr

    sid = sf(daemon, "create", "--image", "t/cli-env:1").stdout.strip()
    r = sf(daemon, "exec", sid, "cat /built && /opt/tool/tk")
    assert r.stdout == f"{marker}\ntk {marker}\n", r.stderr
    sf(daemon, "rm", sid)
    # The named step is a layer of its own: stack it on busybox at create time.
    sid = sf(daemon, "create", "--image", "busybox", "--layer", f"t/cli-tool:{marker}").stdout.strip()
    assert sf(daemon, "exec", sid, "test -x /opt/tool/tk || echo not-executable").stdout == "not-executable\n"
    sf(daemon, "rm", sid)

    r = sf(daemon, "images", "import", str(tmp_path / "missing.tar"))
    assert r.returncode == 2 and "invalid_argument" in r.stderr and "Traceback" not in r.stderr
    for ref in ("t/cli-env:1", f"t/cli-tool:{marker}"):
        assert sf(daemon, "images", "rm", ref).returncode == 0


def test_images_build_takes_the_daemons_config_and_prints_each_step(daemon: Daemon, tmp_path: Path) -> None:
    """`images build --config` finds the daemon's socket in its config (no --socket, even with
    $SANDFLEET_SOCKET elsewhere); off a terminal it prints every step and a run step's output as the
    daemon streams them; flags override the config."""
    nonce = os.urandom(4).hex()
    (tmp_path / "f").write_text(nonce)
    (tmp_path / "env.toml").write_text(
        f'ref = "t/cli-config:1"\nbase = "busybox"\nworkdir = "/srv/{nonce}"\n'
        '[[step]]\ncopy = { src = "f", dest = "/etc/f" }\n'
        f'[[step]]\nrun = "echo hello-{nonce}; echo warn-{nonce} >&2; mkdir -p /srv/{nonce}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "SANDFLEET_SOCKET"}
    env.update(COLUMNS="80", SANDFLEET_SOCKET="/nonexistent/sandfleet.sock")  # the config wins over it

    def build(*flags: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "sandfleet", "images", "build", str(tmp_path / "env.toml"), *flags]
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)

    try:
        r = build("--config", str(daemon.config))
        assert r.returncode == 0, r.stdout + r.stderr
        lines = r.stdout.splitlines()
        assert re.search(r"step 0/2 base: cache hit sha256:[0-9a-f]{64} \(\d+\.\d\ds\)", r.stdout), r.stdout
        assert re.search(r"step 1/2 copy: built sha256:[0-9a-f]{64} \(\d+\.\d\ds\)", r.stdout), r.stdout
        assert re.search(r"step 2/2 run: built sha256:[0-9a-f]{64} \(\d+\.\d\ds\)", r.stdout), r.stdout
        assert f"  [2] hello-{nonce}" in lines and f"  [2 stderr] warn-{nonce}" in lines, r.stdout
        # the output comes before the step is reported done, and long lines are not wrapped
        assert lines.index(f"  [2] hello-{nonce}") < next(i for i, x in enumerate(lines) if "step 2/2 run" in x)
        assert "t/cli-config:1: 3 layer(s), 1/3 from cache" in r.stdout

        r = build("--config", str(daemon.config))
        assert r.returncode == 0 and r.stdout.count("cache hit") == 3, r.stdout + r.stderr
        assert f"hello-{nonce}" not in r.stdout and "3/3 from cache" in r.stdout

        # A flag overrides the config: this socket has no daemon, so the (fresh) run step fails.
        (tmp_path / "f").write_text(nonce + "-2")
        r = build("--config", str(daemon.config), "--socket", str(tmp_path / "no-daemon.sock"))
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "cannot reach the sandfleet daemon" in r.stderr and "no-daemon.sock" in r.stderr, r.stderr
        r = build("--config", str(tmp_path / "missing.toml"))
        assert r.returncode == 2 and "--config" in r.stderr and "Traceback" not in r.stderr, r.stderr
    finally:
        sf(daemon, "images", "rm", "t/cli-config:1")
