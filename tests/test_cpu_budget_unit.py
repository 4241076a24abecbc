"""A CPU budget (`cpu_time`) counts the command's own processes, read on the host: a tier whose
commands the host cannot see (a VM's guest; the fake tier's) refuses it as `unsupported` instead of
counting something else (QEMU's threads, the whole sandbox)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandfleet import SandboxSpec, UnsupportedError
from sandfleet.backends.base import HostProcesses, capabilities
from sandfleet.backends.container.backend import ContainerBackend
from sandfleet.backends.fncall.backend import FncallBackend
from sandfleet.backends.vm.backend import VMBackend
from sandfleet.testing import InProcessNode

pytestmark = pytest.mark.unit


def test_only_tiers_whose_commands_are_host_processes_measure_them() -> None:
    assert issubclass(ContainerBackend, HostProcesses) and issubclass(FncallBackend, HostProcesses)
    assert not issubclass(VMBackend, HostProcesses)


async def test_a_tier_that_cannot_measure_a_command_refuses_a_cpu_budget(tmp_path: Path) -> None:
    async with InProcessNode(tmp_path) as node, node.client(timeout=20) as fleet:
        assert "host_processes" not in capabilities(node.backend)
        sb = await fleet.create(image="busybox")
        for start in (sb.exec, sb.start):
            with pytest.raises(UnsupportedError, match="cpu_time"):
                await start("true", cpu_time=1)
        assert (await sb.exec("true", timeout=5)).exit_code == 0  # no budget: as ever
        assert await sb.processes() == []  # nothing was started


async def test_a_trajectory_step_with_a_budget_the_tier_cannot_measure_is_refused_not_logged(tmp_path: Path) -> None:
    """Refused before its step begins (the caller's 400): never logged as a failure of the agent's step,
    which every replay would answer again and a trainer would score."""
    async with InProcessNode(tmp_path) as node, node.client(timeout=20) as fleet:
        traj = await fleet.trajectory("budget-on-a-vm", SandboxSpec(image="busybox"))
        with pytest.raises(UnsupportedError, match="cpu_time"):
            await traj.exec("true", cpu_time=1)
        assert (await traj.exec("echo step-0")).stdout == "step-0\n"  # step 0 is still untaken
        assert (await fleet.get_trajectory("budget-on-a-vm")).info.steps == 1
