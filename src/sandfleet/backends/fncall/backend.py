"""The fncall tier: where a stateless call runs. A worker is a container-isolated sandbox (the same
namespaces, cgroups, seccomp and layers as the container tier: it is made by a container backend);
what makes it a function worker is the warm interpreter the service starts in it
(daemon/node/stateless_calls.py, zygote.py), which forks one fresh process per call.

When the node also runs the container tier, this tier shares its backend (one launcher, one layer
cache, one cgroup parent, one set of sandbox directories): that backend reports the residue and the
CPU of both. Workers are neither snapshotted nor packed (a call is stateless by contract; set a
worker up with exec and files, then call it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.backends.config import ContainerBackendConfig, FncallBackendConfig
from sandfleet.backends.container.backend import ContainerBackend
from sandfleet.images import ImageManifest
from sandfleet.models import Resources, SandboxSpec, Usage


class FncallBackend:
    name = "fncall"

    def __init__(self, config: FncallBackendConfig, *, container: ContainerBackend, shared: bool) -> None:
        """`container`: the node's container backend (`shared`), or one of this tier's own."""
        self.fncall_config = config
        self.inner = container
        self.shared = shared

    @classmethod
    def own(cls, config: FncallBackendConfig, **kwargs: Any) -> FncallBackend:
        """A tier with a container backend of its own (a node without the container tier)."""
        inner = ContainerBackend(ContainerBackendConfig(cgroup_parent=config.cgroup_parent), **kwargs)
        return cls(config, container=inner, shared=False)

    def supports(self, capability: str) -> bool:
        # The shared backend's node-level duties (layer cache, host checks, recovery) are the
        # container tier's.
        if capability in ("layer_cache", "host_checks", "recover"):
            return not self.shared
        return self.inner.supports(capability)

    async def start(self) -> None:
        if not self.shared:
            await self.inner.start()

    async def close(self) -> None:
        if not self.shared:
            await self.inner.close()

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        return await self.inner.create(sandbox_id, spec, image)

    async def destroy(self, sandbox: LiveSandbox) -> None:
        await self.inner.destroy(sandbox)

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        return await self.inner.adopt(sandbox_id, runtime)

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        await self.inner.cleanup(sandbox_id, runtime)

    def residue(self) -> set[str]:
        return set() if self.shared else self.inner.residue()

    def usage(self, sandbox: LiveSandbox) -> Usage:
        return self.inner.usage(sandbox)

    def cpu_seconds(self, sandbox: LiveSandbox | None) -> float:
        if sandbox is None and self.shared:
            return 0.0  # counted by the container tier
        return self.inner.cpu_seconds(sandbox)

    # Pausable: an idle worker is paused like any sandbox (its interpreter resumes with it).
    async def pause(self, sandbox: LiveSandbox) -> tuple[int, int]:
        return await self.inner.pause(sandbox)

    async def resume(self, sandbox: LiveSandbox) -> None:
        await self.inner.resume(sandbox)

    # HostProcesses: a command run in a worker (its set-up) is read like a container's.
    def init_pid(self, sandbox: LiveSandbox) -> int:
        return self.inner.init_pid(sandbox)

    # HostFiles: a worker is set up through the files API like a container.
    def open_root(self, sandbox: LiveSandbox) -> int:
        return self.inner.open_root(sandbox)

    def mount_points(self, sandbox: LiveSandbox) -> frozenset[str]:
        return self.inner.mount_points(sandbox)

    # LayerCache, Recoverable, HostChecks: only with a backend of its own (see supports()).
    async def unmount_unused_layers(self) -> int:
        return await self.inner.unmount_unused_layers()

    def busy_layers(self) -> set[str]:
        return self.inner.busy_layers()

    def remove_layer_if_idle(self, digest: str, remove: Callable[[], None]) -> bool:
        return self.inner.remove_layer_if_idle(digest, remove)

    async def recover(self, sandbox_id: str) -> tuple[LiveSandbox, Resources] | None:
        return await self.inner.recover(sandbox_id)

    def leftovers(self) -> dict[str, list[str]]:
        return self.inner.leftovers()
