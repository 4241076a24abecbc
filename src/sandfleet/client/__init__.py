"""The sandfleet SDK: `Client` (blocking) and `AsyncClient` (asyncio) over one I/O-free core."""

from sandfleet.client._base import UNSET
from sandfleet.client.aio import (
    AsyncClient,
    AsyncEventStream,
    AsyncFiles,
    AsyncProcess,
    AsyncSandbox,
    AsyncSession,
    AsyncTrajectory,
)
from sandfleet.client.sync import Client, EventStream, Files, Process, Sandbox, Session, Trajectory

__all__ = [
    "UNSET",
    "AsyncClient",
    "AsyncEventStream",
    "AsyncFiles",
    "AsyncProcess",
    "AsyncSandbox",
    "AsyncSession",
    "AsyncTrajectory",
    "Client",
    "EventStream",
    "Files",
    "Process",
    "Sandbox",
    "Session",
    "Trajectory",
]
