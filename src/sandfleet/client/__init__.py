"""The sandfleet SDK: `Client` (blocking) and `AsyncClient` (asyncio) over one I/O-free core."""

from sandfleet.client._base import UNSET
from sandfleet.client.aio import AsyncClient, AsyncEventStream, AsyncFiles, AsyncProcess, AsyncSandbox, AsyncSession
from sandfleet.client.sync import Client, EventStream, Files, Process, Sandbox, Session

__all__ = [
    "UNSET",
    "AsyncClient",
    "AsyncEventStream",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "EventStream",
    "Files",
    "Process",
    "Sandbox",
    "Session",
]
