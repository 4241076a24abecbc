"""The sandfleet SDK: `Client` (blocking) and `AsyncClient` (asyncio) over one I/O-free core."""

from sandfleet.client._base import UNSET
from sandfleet.client.aio import (
    AsyncClient,
    AsyncEventStream,
    AsyncFiles,
    AsyncProcess,
    AsyncSandbox,
    AsyncSession,
    AsyncTerminal,
    AsyncTrajectory,
)
from sandfleet.client.sync import Client, EventStream, Files, Process, Sandbox, Session, Terminal, Trajectory

__all__ = [
    "UNSET",
    "AsyncClient",
    "AsyncEventStream",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncTerminal",
    "AsyncTrajectory",
    "Client",
    "EventStream",
    "Files",
    "Process",
    "Sandbox",
    "Session",
    "Terminal",
    "Trajectory",
]
