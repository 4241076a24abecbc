"""A node: health, load, drain and fence, acks and keys, and the error body of every answer."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from sandfleet.models.common import IdempotencyKey, ProjectPath, _Model
from sandfleet.models.sandboxes import MAX_BATCH


class Health(_Model):
    status: str
    version: str
    sandboxes_running: int
    backends: list[str]
    pools: dict[str, int] = Field(default_factory=dict, description="ready sandboxes per warm pool")
    tiers: dict[str, list[str]] = Field(
        default_factory=dict,
        description="the capabilities of each isolation tier the node runs (pause, snapshot, pack, host_files, ...); "
        "a call a tier cannot serve answers `unsupported`",
    )


class ProjectUsage(_Model):
    """What one project's live sandboxes on a node hold (their limits, as quotas count them)."""

    sandboxes: int
    cpu: float = Field(description="sum of their CPU limits (cores)")
    memory: int = Field(description="sum of their memory limits (bytes)")


class NodeLoad(_Model):
    """What cluster placement and quotas read of a node, about once a second."""

    key: str = Field(description="the node's key: the 6 hex digits after sb- and snap- in the ids it makes")
    group: str = Field(description="its node group (placement spills over from one group to the next)")
    labels: dict[str, str] = Field(default_factory=dict, description="node labels a create may require")
    draining: bool = Field(description="taking no new creates (forks and restores of its snapshots still run)")
    sandboxes: int = Field(description="live sandboxes (creating, running, paused, stopping)")
    capacity: int = Field(description="its admission limit (max_sandboxes)")
    tiers: list[str]
    images: list[str] = Field(default_factory=list, description="image references in its layer store")
    projects: dict[str, ProjectUsage] = Field(
        default_factory=dict, description="per project (not rolled up; '' for none): what its sandboxes hold"
    )
    at: float = Field(description="when this was read (the node's clock, seconds since the epoch)")
    generation: int = Field(
        0, description="cluster mode: the generation the node serves under (raised when it is fenced)"
    )


class DrainRequest(_Model):
    draining: bool = Field(True, description="true: take no new creates; false: take them again")


class FenceRequest(_Model):
    """Cluster mode: the node comes back after the cluster declared it lost."""

    generation: int = Field(
        ge=1, le=2**62, description="the generation to serve under; above the node's own, everything it holds stops"
    )


class AckRequest(_Model):
    """Sandboxes whose create answer a gateway handed to its caller."""

    sandboxes: list[Annotated[str, Field(max_length=64)]] = Field(max_length=4 * MAX_BATCH)


class HeldKey(_Model):
    key: IdempotencyKey
    project: ProjectPath | None = None


class KeysRequest(_Model):
    """Idempotency keys of creates retried through a gateway: which of them this node holds."""

    keys: list[HeldKey] = Field(min_length=1, max_length=MAX_BATCH)


class KeysHeld(_Model):
    held: list[bool] = Field(description="per key, in order: a create with it made (or is making) a sandbox here")


class Ok(_Model):
    ok: bool = True
