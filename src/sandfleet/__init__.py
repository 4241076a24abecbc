"""sandfleet: elastic sandboxes for agentic reinforcement learning.

from sandfleet import Client, SandboxSpec, Resources
with Client() as fleet, fleet.create(image="debian:bookworm", resources=Resources(cpu=1, memory="1GiB")) as sb:
    print(sb.exec("echo hello").stdout)
"""

__version__ = "0.1.0"

from sandfleet.client import (  # noqa: E402
    AsyncClient,
    AsyncSandbox,
    AsyncTerminal,
    AsyncTrajectory,
    Client,
    Sandbox,
    Terminal,
    Trajectory,
)
from sandfleet.errors import (  # noqa: E402
    DataLossError,
    ImageNotFoundError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SandboxError,
    SandboxLostError,
    SandboxNotFoundError,
    SandboxTimeoutError,
    SnapshotNotFoundError,
    UnavailableError,
    UnsupportedError,
    WrongStateError,
)
from sandfleet.models import (  # noqa: E402
    AuditRecord,
    ContainerOptions,
    ExecEvent,
    ExecResult,
    ExposedPort,
    Mount,
    NetworkPolicy,
    Resources,
    SandboxSpec,
    TerminalSize,
    VerifyRequest,
    VerifyResult,
    VMOptions,
)

__all__ = [
    "AsyncClient",
    "AsyncSandbox",
    "AsyncTerminal",
    "Terminal",
    "TerminalSize",
    "AsyncTrajectory",
    "Trajectory",
    "VerifyRequest",
    "VerifyResult",
    "AuditRecord",
    "ExposedPort",
    "NetworkPolicy",
    "Client",
    "DataLossError",
    "SandboxLostError",
    "ExecEvent",
    "ExecResult",
    "ImageNotFoundError",
    "SnapshotNotFoundError",
    "InvalidArgumentError",
    "Mount",
    "NotFoundError",
    "PermissionDeniedError",
    "UnsupportedError",
    "ContainerOptions",
    "VMOptions",
    "Resources",
    "ResourceExhaustedError",
    "Sandbox",
    "SandboxError",
    "SandboxNotFoundError",
    "SandboxSpec",
    "SandboxTimeoutError",
    "UnavailableError",
    "WrongStateError",
]
