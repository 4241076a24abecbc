"""Shared fixtures: a real daemon (`sandfleet serve` as a subprocess, as root) and clients to it.

Every test talks to the daemon the way users do: over its unix socket through the SDK. The layer
store is shared across runs (/var/lib/sandfleet/images) so the Debian/Python images build once.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandfleet import Client
from sandfleet.errors import SandboxError

IMAGES = Path(os.environ.get("SANDFLEET_TEST_IMAGES", "/var/lib/sandfleet/images"))


@dataclass
class Daemon:
    root: Path
    socket: Path
    state_dir: Path
    run_dir: Path
    config: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> None:
        ready = self.root / "ready"
        ready.unlink(missing_ok=True)
        log = open(self.root / "daemon.log", "ab")  # noqa: SIM115 (lives as long as the daemon)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandfleet", "serve", "--config", str(self.config), "--ready-file", str(ready)],
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.time() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {(self.root / 'daemon.log').read_text()[-3000:]}")
            if time.time() > deadline:
                raise RuntimeError("daemon did not become ready")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, **kw: object) -> Client:
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def mountinfo(self) -> str:
        return Path(f"/proc/{self.pid}/mountinfo").read_text()

    def log(self) -> str:
        return (self.root / "daemon.log").read_text(errors="replace")


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy or `timeout` seconds pass; whether it became truthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def make_daemon(name: str, extra: str = "") -> Daemon:
    root = Path(tempfile.mkdtemp(prefix=f"sandfleet-{name}-"))
    os.chmod(root, 0o755)
    d = Daemon(root, root / "sandfleet.sock", root / "state", root / "run", root / "config.toml")
    (root / "shared").mkdir()
    # A cgroup parent of its own: daemons clean up unknown cgroups under their parent at start.
    d.config.write_text(
        f'socket = "{d.socket}"\nstate_dir = "{d.state_dir}"\nrun_dir = "{d.run_dir}"\n'
        f'image_dir = "{IMAGES}"\nstopped_retention = 0\nreaper_interval = 0.2\n'
        + extra
        + f'[container]\ncgroup_parent = "/sandfleet-test-{root.name}"\nmount_allowlist = ["{root / "shared"}"]\n'
    )
    return d


def destroy_daemon(d: Daemon) -> None:
    """Stop every sandbox through the API so nothing outlives the test run, then the daemon.

    A daemon that died during the test is started again first: it adopts its orphaned sandboxes,
    so they can be stopped the normal way instead of leaking past the session.
    """
    try:
        if d.proc is not None and d.proc.poll() is not None:
            d.start()
        if d.proc is not None:
            with d.client(timeout=120) as c:
                for s in c.list(state="running"):
                    c.get(s.id).stop()
    except (SandboxError, RuntimeError):
        pass
    finally:
        d.stop()
        shutil.rmtree(d.root, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    d = make_daemon("main")
    d.start()
    yield d
    destroy_daemon(d)


@pytest.fixture
def fleet(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


@pytest.fixture
def sandbox(fleet: Client) -> Iterator[object]:
    with fleet.create(image="busybox", idle_ttl=300) as sb:
        yield sb


@pytest.fixture
def own_daemon() -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that kill or restart it."""
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    d = make_daemon("own")
    yield d
    destroy_daemon(d)
