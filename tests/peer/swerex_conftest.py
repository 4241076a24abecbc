"""Stands in for SWE-ReX's tests/conftest.py (its sdist ships the test modules, not their conftest),
so SWE-ReX's own runtime tests run against `SandfleetRuntime`. test_adapter_swerex.py copies this
file in as `conftest.py` next to the sdist's unmodified test modules, in a scratch directory.

Upstream's fixtures run one `swerex-remote` server on this machine for the session and give each test
a fresh `RemoteRuntime` to it; here one sandbox plays the server and each test gets a fresh
`SandfleetRuntime` over it. The tests check files through the host's `tmp_path` too (they assume the
runtime shares the machine's filesystem), so the sandbox bind-mounts pytest's base temp directory at
the same path (`--basetemp` must be under the daemon's `mount_allowlist`). The modules import
`_Action` and `_Command` from their conftest: SWE-ReX's action and command with a 5 s default timeout.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, Command, CreateBashSessionRequest

from sandfleet import AsyncClient, Client, Mount
from sandfleet.adapters.swerex import SandfleetRuntime

SOCKET = os.environ.get("SANDFLEET_PEER_SOCKET", "")
IMAGE = os.environ.get("SANDFLEET_PEER_IMAGE", "python:3.11")
LABELS: dict[str, str] = json.loads(os.environ.get("SANDFLEET_PEER_LABELS", '{"job": "swerex-peer-test"}'))


@pytest.fixture(scope="session")
def remote_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The sandbox that serves every test (upstream: one server for the session); its id."""
    if not SOCKET:
        pytest.skip("set SANDFLEET_PEER_SOCKET to a sandfleet daemon's socket")
    base = str(tmp_path_factory.getbasetemp())
    with Client(SOCKET) as fleet:
        sb = fleet.create(
            image=IMAGE, labels=LABELS, idle_ttl=900, mounts=[Mount(source=base, target=base, read_only=False)]
        )
        try:
            yield sb.id
        finally:
            sb.stop()


@pytest.fixture(autouse=True)
def _sandbox_shares_tmp_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> None:
    """pytest makes its temp dirs 0700, and the sandbox's root is not the host's (a user namespace):
    open the test's `tmp_path` (and the dirs above it) to the sandbox, as a shared machine would be."""
    if "tmp_path" not in request.fixturenames:
        return
    path: Path = request.getfixturevalue("tmp_path")
    base = tmp_path_factory.getbasetemp()
    for d in [path, *path.parents]:
        d.chmod(0o777)
        if d == base:
            break


@pytest.fixture
async def remote_runtime(remote_server: str) -> AsyncIterator[SandfleetRuntime]:
    async with AsyncClient(SOCKET) as client:
        runtime = SandfleetRuntime(await client.get(remote_server))
        try:
            yield runtime
        finally:
            await runtime.close()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: SandfleetRuntime) -> AsyncIterator[SandfleetRuntime]:
    await remote_runtime.create_session(CreateBashSessionRequest())
    try:
        yield remote_runtime
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest())


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5
