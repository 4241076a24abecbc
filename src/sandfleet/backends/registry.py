"""Building a tier from its configuration model; a tier's module is imported only when a node runs it."""

from __future__ import annotations

from pathlib import Path

from sandfleet.backends.base import Backend
from sandfleet.backends.config import BackendConfig
from sandfleet.images import LayerStore


def build_backend(
    config: BackendConfig, *, state_dir: Path, run_dir: Path, store: LayerStore, built: dict[str, Backend] | None = None
) -> Backend:
    """The tier `config` describes, not started yet. `built`: the node's tiers built before it (the
    fncall tier shares the container tier's backend when there is one)."""
    if config.type == "container":
        from sandfleet.backends.container import ContainerBackend

        return ContainerBackend(config, state_dir=state_dir, run_dir=run_dir, store=store)
    if config.type in ("microvm", "vm"):
        from sandfleet.backends.vm import VMBackend

        return VMBackend(config, state_dir=state_dir, run_dir=run_dir, store=store)
    if config.type == "fncall":
        from sandfleet.backends.container import ContainerBackend
        from sandfleet.backends.fncall import FncallBackend

        container = (built or {}).get("container")
        if isinstance(container, ContainerBackend):
            return FncallBackend(config, container=container, shared=True)
        return FncallBackend.own(config, state_dir=state_dir / "fncall", run_dir=run_dir / "fncall", store=store)
    raise ValueError(f"unknown tier {config.type!r}")  # pragma: no cover (the union admits no other)
