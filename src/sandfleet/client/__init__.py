"""The sandfleet SDK: `Client` (blocking) and `AsyncClient` (asyncio) over one I/O-free core."""

from sandfleet.client.aio import AsyncClient, AsyncFiles, AsyncProcess, AsyncSandbox, AsyncSession
from sandfleet.client.sync import Client, Files, Process, Sandbox, Session

__all__ = [
    "AsyncClient",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "Client",
    "Files",
    "Process",
    "Sandbox",
    "Session",
]
