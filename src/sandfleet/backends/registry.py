"""Building a tier from its configuration model; a tier's module is imported only when a node runs it."""

from __future__ import annotations

from pathlib import Path

from sandfleet.backends.base import Backend
from sandfleet.backends.config import BackendConfig
from sandfleet.images import LayerStore


def build_backend(config: BackendConfig, *, state_dir: Path, run_dir: Path, store: LayerStore) -> Backend:
    """The tier `config` describes, not started yet."""
    if config.type == "container":
        from sandfleet.backends.container import ContainerBackend

        return ContainerBackend(config, state_dir=state_dir, run_dir=run_dir, store=store)
    raise ValueError(f"unknown tier {config.type!r}")  # pragma: no cover (the union admits no other)
