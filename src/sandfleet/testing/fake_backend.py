"""A tier for tests without root: sandboxes are directories, their commands host processes.

`FakeBackend` implements the base `TierBackend` protocol and two capabilities (`Pausable` through
SIGSTOP/SIGCONT of the commands' process groups, `HostFiles` over the sandbox's directory), with the
real agent channel on the daemon's side and `FakeAgent` on the other. There is NO isolation: it is for
testing the SDK, the API, error mapping, the state machine and the service logic fast, never for
running untrusted code. Snapshots, pack, layer caches and recovery are absent, so the service's
`unsupported` answers can be tested too.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.errors import InvalidArgumentError, UnavailableError
from sandfleet.images import ImageManifest
from sandfleet.models import SandboxSpec, Usage
from sandfleet.runtime.agent import AgentChannel
from sandfleet.testing.fake_agent import FakeAgent

# Directories every fake sandbox has, so the usual working directories exist.
SKELETON = ("root", "tmp", "home", "work")


class FakeBackend:
    def __init__(self, root: Path, *, name: str = "container", fail_creates: int = 0) -> None:
        """`root`: where sandbox directories go. `fail_creates`: the next that many creates fail
        (with `UnavailableError`), to test what the service does then."""
        self.name = name
        self.root = Path(root)
        self.fail_creates = fail_creates
        self.created = 0
        self._agents: dict[str, tuple[FakeAgent, asyncio.Task[None]]] = {}

    # -- TierBackend ----------------------------------------------------------------------------

    async def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    async def close(self) -> None:
        for sandbox_id in list(self._agents):
            await self._stop_agent(sandbox_id)

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        if spec.mounts:
            raise InvalidArgumentError("the fake tier has no bind mounts")
        if self.fail_creates > 0:
            self.fail_creates -= 1
            raise UnavailableError("fake create failure")
        sdir = self.root / sandbox_id
        for sub in SKELETON:
            (sdir / sub).mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        agent = FakeAgent(theirs, sdir)
        task = asyncio.get_running_loop().create_task(agent.run(), name=f"fake-agent-{sandbox_id}")
        self._agents[sandbox_id] = (agent, task)
        channel = AgentChannel(ours)
        try:
            await channel.wait_hello(timeout=10)
        except BaseException:
            channel.close()
            await self._stop_agent(sandbox_id)
            shutil.rmtree(sdir, ignore_errors=True)
            raise
        self.created += 1
        return LiveSandbox(
            id=sandbox_id,
            channel=channel,
            agent_pid=os.getpid(),
            agent_start_time=None,
            uid_base=os.getuid(),  # sandbox root owns files as the caller
            runtime={"dir": str(sdir)},
        )

    async def destroy(self, sandbox: LiveSandbox) -> None:
        sandbox.channel.close()
        await self._stop_agent(sandbox.id)
        await asyncio.to_thread(shutil.rmtree, self.root / sandbox.id, True)

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        return None  # fake agents live in the daemon's process: none outlives it

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        await self._stop_agent(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, self.root / sandbox_id, True)

    def residue(self) -> set[str]:
        with contextlib.suppress(FileNotFoundError):
            return {p.name for p in self.root.iterdir() if p.is_dir()}
        return set()

    def usage(self, sandbox: LiveSandbox) -> Usage:
        agent = self._agents.get(sandbox.id)
        pids = len(agent[0].pids) if agent else 0
        return Usage(memory_bytes=0, memory_peak_bytes=0, cpu_seconds=0.0, pids=pids, oom_kills=0, pids_limit_hits=0)

    def cpu_seconds(self, sandbox: LiveSandbox | None) -> float:
        return 0.0

    # -- Pausable ------------------------------------------------------------------------------

    async def pause(self, sandbox: LiveSandbox) -> tuple[int, int]:
        self._signal(sandbox.id, signal.SIGSTOP)
        return 0, 0

    async def resume(self, sandbox: LiveSandbox) -> None:
        self._signal(sandbox.id, signal.SIGCONT)

    # -- HostFiles -----------------------------------------------------------------------------

    def open_root(self, sandbox: LiveSandbox) -> int:
        try:
            return os.open(self.root / sandbox.id, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running") from exc

    def mount_points(self, sandbox: LiveSandbox) -> frozenset[str]:
        return frozenset()

    # -- helpers -------------------------------------------------------------------------------

    def _signal(self, sandbox_id: str, signo: int) -> None:
        entry = self._agents.get(sandbox_id)
        if entry is not None:
            entry[0].kill_all(signo)

    async def _stop_agent(self, sandbox_id: str) -> None:
        entry = self._agents.pop(sandbox_id, None)
        if entry is None:
            return
        agent, task = entry
        agent.kill_all(signal.SIGKILL)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
