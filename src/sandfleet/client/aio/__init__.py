"""`AsyncClient`: the asyncio SDK. Mirrors `sandfleet.client.sync` call for call.

The client's calls are grouped by what they act on (`_node`, `_images`, `_fleet`, `_rl`) over how
they are sent (`_http`); a sandbox and what runs in it have a module each (`_sandbox`,
`_processes`, `_files`, `_terminal`). The blocking client is generated from these modules, one
for one (scripts/gen_sync_client.py).
"""

from sandfleet.client.aio._client import AsyncClient
from sandfleet.client.aio._files import AsyncFiles
from sandfleet.client.aio._http import AsyncEventStream
from sandfleet.client.aio._processes import AsyncProcess, AsyncSession
from sandfleet.client.aio._rl import AsyncTrajectory
from sandfleet.client.aio._sandbox import AsyncSandbox
from sandfleet.client.aio._terminal import AsyncTerminal

__all__ = [
    "AsyncClient",
    "AsyncEventStream",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncTerminal",
    "AsyncTrajectory",
]
