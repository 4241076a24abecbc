# Generated from client/aio/__init__.py by scripts/gen_sync_client.py: do not edit.
"""`Client`: the blocking SDK, generated from the asyncio one (client/aio/): do not edit.

The client's calls are grouped by what they act on (`_node`, `_images`, `_fleet`, `_rl`) over how
they are sent (`_http`); a sandbox and what runs in it have a module each (`_sandbox`,
`_processes`, `_files`, `_terminal`). The blocking client is generated from these modules, one
for one (scripts/gen_sync_client.py).
"""

from sandfleet.client.sync._client import Client
from sandfleet.client.sync._files import Files
from sandfleet.client.sync._http import EventStream
from sandfleet.client.sync._processes import Process, Session
from sandfleet.client.sync._rl import Trajectory
from sandfleet.client.sync._sandbox import Sandbox
from sandfleet.client.sync._terminal import Terminal

__all__ = [
    "Client",
    "EventStream",
    "Files",
    "Process",
    "Sandbox",
    "Session",
    "Terminal",
    "Trajectory",
]
