"""The SWE-ReX adapter against a real daemon: SWE-ReX's own runtime tests (tests/test_execution.py
of its sdist, unmodified) run against `SandfleetRuntime`, then our tests of the deployment's
lifecycle, interactive programs, error mapping and what the peer tests leave out.

The peer tests come from the swe-rex sdist of the installed version, looked for in
$SANDFLEET_PEER_CACHE (default ~/.cache/sandfleet/peer) and fetched there with `pip download` when
missing (setup: `pip download --no-binary :all: --no-deps swe-rex==1.4.0 -d ~/.cache/sandfleet/peer`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tarfile
import uuid
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("swerex")

from swerex.exceptions import (  # noqa: E402
    BashIncorrectSyntaxError,
    CommandTimeoutError,
    DeploymentNotStartedError,
    NonZeroExitCodeError,
    SessionDoesNotExistError,
    SessionExistsError,
    SwerexException,
)
from swerex.runtime.abstract import (  # noqa: E402
    BashAction,
    BashInterruptAction,
    CloseBashSessionRequest,
    Command,
    CreateBashSessionRequest,
    ReadFileRequest,
    UploadRequest,
    WriteFileRequest,
)

from sandfleet import AsyncClient, Client  # noqa: E402
from sandfleet.adapters.swerex import SandfleetDeployment, SandfleetDeploymentConfig, SandfleetRuntime  # noqa: E402

LABELS = {"job": "swerex-test"}
PEER_LABELS = {"job": "swerex-peer-test"}
IMAGE = "python:3.11"
# The peer tests' image: python:3.11 and `less` (test_interrupt_pager interrupts it), built once.
PEER_RECIPE = Path(__file__).parent / "data" / "recipes" / "python-less.toml"
CACHE = Path(os.environ.get("SANDFLEET_PEER_CACHE", Path.home() / ".cache" / "sandfleet" / "peer"))

# Peer tests left out, and why (everything else in test_execution.py runs).
DESELECTED = {
    "test_server_dead": "checks SWE-ReX's RemoteRuntime against an unresolvable host, not the runtime under test",
}


def swerex_sdist() -> Path:
    """The swe-rex sdist of the installed version, fetched into the cache with pip when missing."""
    ver = version("swe-rex")
    found = sorted(CACHE.glob(f"swe_rex-{ver}.tar.gz"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps", f"swe-rex=={ver}"]
        proc = subprocess.run([*cmd, "-d", str(CACHE)], capture_output=True, text=True, timeout=300)
        found = sorted(CACHE.glob(f"swe_rex-{ver}.tar.gz"))
        if not found:
            pytest.skip(f"no swe-rex {ver} sdist in {CACHE} and pip could not fetch it: {proc.stderr[-500:]}")
    return found[0]


def peer_suite(sdist: Path, into: Path) -> Path:
    """A scratch checkout of SWE-ReX's tests (their files unmodified, their pytest config) with our
    conftest shim; its root."""
    with tarfile.open(sdist) as tar:
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if m.isfile() and (parts[1:] == ("pyproject.toml",) or (len(parts) == 3 and parts[1] == "tests")):
                dest = into.joinpath(*parts[1:])
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = tar.extractfile(m)
                assert src is not None
                dest.write_bytes(src.read())
    (into / "tests" / "__init__.py").touch()
    shutil.copy(Path(__file__).parent / "peer" / "swerex_conftest.py", into / "tests" / "conftest.py")
    return into


@pytest.mark.slow
def test_swerex_own_runtime_tests(daemon: object, fleet: Client, tmp_path: Path) -> None:
    root = peer_suite(swerex_sdist(), tmp_path / "swe-rex")
    # pytest's temp dirs, bind-mounted into the sandbox: under the daemon's mount allowlist.
    basetemp = Path(daemon.root) / "shared" / f"swerex-peer-{uuid.uuid4().hex[:8]}"  # type: ignore[attr-defined]
    junit = tmp_path / "junit.xml"
    image = fleet.build_recipe(PEER_RECIPE)
    env = {
        **os.environ,
        "SANDFLEET_PEER_SOCKET": str(daemon.socket),  # type: ignore[attr-defined]
        "SANDFLEET_PEER_IMAGE": f"{image.name}:{image.tag}",
        "SANDFLEET_PEER_LABELS": json.dumps(PEER_LABELS),
    }
    deselect = [f"--deselect=tests/test_execution.py::{name}" for name in DESELECTED]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}"]
    try:
        proc = subprocess.run(
            [*cmd, f"--junitxml={junit}", *deselect, "tests/test_execution.py"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    (tmp_path.parent / "swerex-peer-report.txt").write_text(proc.stdout)  # kept with pytest's temp dirs
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite is not None, report
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert proc.returncode == 0 and counts["failures"] == counts["errors"] == 0, report
    # Only the upstream xfail (mixed interactive and normal commands) may be skipped.
    assert counts["tests"] - counts["skipped"] >= 46 and counts["skipped"] <= 1, report
    assert fleet.list(labels=PEER_LABELS) == []


# -- our own tests


@pytest.fixture
async def aclient(daemon: object, fleet: Client) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket) as c:  # type: ignore[attr-defined]
        yield c
    assert fleet.list(labels=LABELS) == []


@pytest.fixture
async def deployment(aclient: AsyncClient) -> AsyncIterator[SandfleetDeployment]:
    d = SandfleetDeployment(client=aclient, image=IMAGE, labels=LABELS)
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def runtime(deployment: SandfleetDeployment) -> SandfleetRuntime:
    await deployment.runtime.create_session(CreateBashSessionRequest())
    return deployment.runtime


async def test_deployment_lifecycle_by_config(daemon: object, fleet: Client) -> None:
    steps: list[str] = []

    class Hook:
        def on_custom_step(self, message: str) -> None:
            steps.append(message)

    config = SandfleetDeploymentConfig.model_validate(
        {
            "type": "sandfleet",
            "image": "busybox",
            "socket": str(daemon.socket),
            "labels": LABELS,  # type: ignore[attr-defined]
            "sandbox": {"idle_ttl": 120},
        }  # fmt: skip
    )
    d = config.get_deployment()
    d.add_hook(Hook())  # type: ignore[arg-type]
    with pytest.raises(DeploymentNotStartedError):
        d.runtime  # noqa: B018
    with pytest.raises(DeploymentNotStartedError):
        await d.is_alive()
    await d.start()
    try:
        assert steps == ["Starting sandbox"]
        assert await d.is_alive()
        [info] = fleet.list(labels=LABELS)
        assert info.id == d.sandbox.id and info.spec.image == "busybox" and info.spec.idle_ttl == 120
        r = await d.runtime.execute(Command(command="echo $0", shell=True))
        assert r.stdout == "/bin/sh\n"
    finally:
        await d.stop()
        await d.stop()  # idempotent
    assert fleet.list(labels=LABELS) == []
    with pytest.raises(DeploymentNotStartedError):
        d.runtime  # noqa: B018


async def test_session_state_checks_and_errors(runtime: SandfleetRuntime) -> None:
    await runtime.run_in_session(BashAction(command="cd /tmp && export FOO=bar && x=1"))
    r = await runtime.run_in_session(BashAction(command="echo $PWD $FOO $x"))
    assert (r.output, r.exit_code) == ("/tmp bar 1\n", 0)
    r = await runtime.run_in_session(
        BashAction(command="echo err >&2; exit_code() { return 4; }; exit_code", check="silent")
    )
    assert (r.output, r.exit_code) == ("err\n", 4)
    assert (await runtime.run_in_session(BashAction(command="false", check="ignore"))).exit_code is None
    with pytest.raises(NonZeroExitCodeError, match="^oops: Command 'false' failed"):
        await runtime.run_in_session(BashAction(command="false", error_msg="oops"))
    with pytest.raises(BashIncorrectSyntaxError):
        await runtime.run_in_session(BashAction(command="if then fi"))
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="sleep 5", timeout=0.3))
    interrupted = await runtime.run_in_session(BashInterruptAction())
    assert interrupted.exit_code == 0
    assert (await runtime.run_in_session(BashAction(command="echo $FOO"))).output == "bar\n"  # shell lives on
    with pytest.raises(SessionExistsError):
        await runtime.create_session(CreateBashSessionRequest())
    with pytest.raises(SessionDoesNotExistError):
        await runtime.run_in_session(BashAction(command="true", session="nope"))


async def test_startup_source(runtime: SandfleetRuntime) -> None:
    await runtime.write_file(WriteFileRequest(path="/root/env.sh", content="export GREETING=hi\necho sourced\n"))
    r = await runtime.create_session(CreateBashSessionRequest(session="s2", startup_source=["/root/env.sh"]))
    assert r.output == "sourced\n"
    assert (await runtime.run_in_session(BashAction(command="echo $GREETING", session="s2"))).output == "hi\n"
    await runtime.close_session(CloseBashSessionRequest(session="s2"))


async def test_interactive_program_gets_a_terminal(runtime: SandfleetRuntime) -> None:
    r = await runtime.run_in_session(
        BashAction(command="python3", is_interactive_command=True, expect=[">>> "], timeout=10)
    )
    assert r.expect_string == ">>> " and "Python 3" in r.output
    r = await runtime.run_in_session(BashAction(command="print(6*7)", is_interactive_command=True, expect=[">>> "]))
    assert r.output == "42"
    # ^C interrupts the REPL (KeyboardInterrupt, a new prompt), it keeps running.
    r = await runtime.run_in_session(BashInterruptAction(expect=[">>> "], timeout=5))
    assert "KeyboardInterrupt" in r.output and r.expect_string == ">>> "
    r = await runtime.run_in_session(BashAction(command="quit()", is_interactive_quit=True, timeout=10))
    assert r.exit_code == 0 and r.expect_string == ""
    # Back to normal commands; an interrupt with nothing running is a no-op.
    assert (await runtime.run_in_session(BashAction(command="echo back"))).output == "back\n"
    assert (await runtime.run_in_session(BashInterruptAction())).output == ""


async def test_interrupt_ends_a_program_that_ignores_ctrl_c(runtime: SandfleetRuntime) -> None:
    code = "import signal,sys; signal.signal(signal.SIGINT, signal.SIG_IGN); print('ready'); sys.stdin.read()"
    prog = f'python3 -c "{code}"'
    r = await runtime.run_in_session(
        BashAction(command=prog, is_interactive_command=True, expect=["ready"], timeout=10)
    )
    assert r.expect_string == "ready"
    # ^C ignored: as SWE-ReX, ^Z (the shell's job control takes the terminal back) and kill -9 of the job
    await runtime.run_in_session(BashInterruptAction(timeout=1, n_retry=2))
    r = await runtime.run_in_session(BashAction(command="echo ok"))
    assert r.output.endswith("ok\n") and "Killed" in r.output  # the shell's notice of the job it killed


async def test_a_timed_out_command_runs_on_until_interrupted(runtime: SandfleetRuntime) -> None:
    """As in SWE-ReX's shell: a timeout leaves the command running; what it prints afterwards comes
    with the next observation; ^C ends it, and the shell (its state) lives on."""
    await runtime.run_in_session(BashAction(command="export KEEP=1"))
    with pytest.raises(CommandTimeoutError):
        await runtime.run_in_session(BashAction(command="sleep 1; echo late; sleep 60", timeout=0.3))
    with pytest.raises(SwerexException):  # busy: a command is still running
        await runtime.run_in_session(BashAction(command="echo next"))
    await asyncio.sleep(1.5)
    r = await runtime.run_in_session(BashInterruptAction(timeout=5))
    assert "late" in r.output
    assert (await runtime.run_in_session(BashAction(command="echo $KEEP"))).output == "1\n"


async def test_execute_files_and_upload(runtime: SandfleetRuntime, tmp_path: Path) -> None:
    r = await runtime.execute(Command(command=["sh", "-c", "echo $A; pwd; echo e >&2"], env={"A": "1"}, cwd="/usr"))
    assert (r.stdout, r.stderr, r.exit_code) == ("1\n/usr\n", "e\n", 0)
    with pytest.raises(NonZeroExitCodeError):
        await runtime.execute(Command(command="exit 2", shell=True, check=True))
    with pytest.raises(CommandTimeoutError):
        await runtime.execute(Command(command="sleep 5", shell=True, timeout=0.3))
    await runtime.write_file(WriteFileRequest(path="/w/a/b.txt", content="héllo"))
    assert (await runtime.read_file(ReadFileRequest(path="/w/a/b.txt"))).content == "héllo"
    with pytest.raises(FileNotFoundError):
        await runtime.read_file(ReadFileRequest(path="/w/missing"))
    (tmp_path / "tool.sh").write_text("#!/bin/sh\necho tool\n")
    (tmp_path / "tool.sh").chmod(0o755)
    await runtime.upload(UploadRequest(source_path=str(tmp_path / "tool.sh"), target_path="/w"))  # into a dir
    await runtime.upload(UploadRequest(source_path=str(tmp_path / "tool.sh"), target_path="/w/renamed.sh"))
    assert (await runtime.execute(Command(command="/w/tool.sh && /w/renamed.sh", shell=True))).stdout == "tool\ntool\n"
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "sub" / "f.txt").write_text("f")
    await runtime.upload(UploadRequest(source_path=str(tmp_path / "d"), target_path="/copied"))
    assert (await runtime.read_file(ReadFileRequest(path="/copied/sub/f.txt"))).content == "f"


async def test_sandbox_gone_maps_to_swerex_errors(deployment: SandfleetDeployment, fleet: Client) -> None:
    runtime = deployment.runtime
    fleet.get(deployment.sandbox.id).stop()  # behind the deployment's back (TTL, stop_many, ...)
    alive = await runtime.is_alive()
    assert not alive and "stopped" in alive.message
    with pytest.raises(DeploymentNotStartedError) as exc:
        await runtime.execute(Command(command="true", shell=True))
    assert exc.value.__cause__ is not None
    with pytest.raises(DeploymentNotStartedError):
        await runtime.create_session(CreateBashSessionRequest())
