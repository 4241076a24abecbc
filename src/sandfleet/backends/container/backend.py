"""Container backend: sandboxes over an overlay of shared EROFS layers, started by the launcher or an OCI runtime.

Create with the launcher (the default): mount layers (shared, once per node) -> cgroup with limits
-> `sandfleet-run` (runtime/launcher.c), which mounts the scratch tmpfs and overlay rootfs inside the
sandbox's own mount namespace and applies the isolation steps -> wait for the agent's HELLO.
Create with crun or runc: layers -> scratch tmpfs + overlay rootfs in the daemon's namespace ->
config.json -> `crun run --detach` -> HELLO. Either way the agent channel is at fd 3 and the agent
binary at fd 4; the agent is PID 1 of the sandbox and sandboxed code never sees its channel on
any filesystem path.
"""

from __future__ import annotations

from sandfleet.backends.container.snapshots import ContainerSnapshots


class ContainerBackend(ContainerSnapshots):
    """The container tier's backend (and the fncall tier's workers'): ContainerPreparation
    (preparation.py), ContainerSandboxes (sandboxes.py) and ContainerSnapshots (snapshots.py)."""
