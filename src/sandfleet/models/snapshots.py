"""Snapshots, forks, checkpoints and packs."""

from __future__ import annotations

from pydantic import Field

from sandfleet.models.common import MAX_REF, MAX_SECONDS, AbsPath, IdempotencyKey, Labels, _Model

MAX_FORK = 64


class SnapshotInfo(_Model):
    """A checkpoint of a running sandbox: its processes with their memory, and its writable layer.
    It outlives the sandbox: kept until deleted or until `expires_at`."""

    id: str
    sandbox_id: str = Field(description="the sandbox it was taken from (which may have stopped since)")
    created_at: float
    size_bytes: int = Field(description="bytes on the node's disk (memory images + writable layer)")
    seconds: float = Field(description="how long taking it took (the sandbox is frozen meanwhile)")
    labels: dict[str, str] = Field(default_factory=dict, description="the snapshot's own labels")
    expires_at: float | None = Field(None, description="when the node deletes it (None: kept until deleted)")
    project: str | None = Field(None, description="its sandbox's project: restored sandboxes belong to it too")


class SnapshotRequest(_Model):
    ttl: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="seconds to keep it (default: the node's snapshot_retention)"
    )
    labels: Labels = Field(default_factory=dict)


class SnapshotList(_Model):
    snapshots: list[SnapshotInfo]


class CheckpointInfo(_Model):
    """A state of one sandbox it can be rolled back to, in place (same id, sessions and processes):
    its processes with their memory, and its files. It lives and dies with the sandbox."""

    id: str
    sandbox_id: str
    created_at: float
    size_bytes: int = Field(description="bytes on the node's disk (memory images + writable layer)")
    seconds: float = Field(description="how long taking it took (the sandbox is frozen meanwhile)")
    labels: dict[str, str] = Field(default_factory=dict, description="the checkpoint's own labels")


class CheckpointRequest(_Model):
    labels: Labels = Field(default_factory=dict)


class CheckpointList(_Model):
    checkpoints: list[CheckpointInfo] = Field(description="oldest first")


class RollbackRequest(_Model):
    checkpoint_id: str = Field(max_length=MAX_REF, description="one of the sandbox's checkpoints")


class RollbackResult(_Model):
    sandbox_id: str
    checkpoint_id: str
    seconds: float = Field(description="from the call until the sandbox answers again")
    dropped_sessions: list[str] = Field(
        default_factory=list, description="sessions opened after the checkpoint: gone with the rollback"
    )
    dropped_processes: list[str] = Field(
        default_factory=list, description="background processes started after it: gone with the rollback"
    )


class ForkRequest(_Model):
    """New sandboxes from one snapshot (restore) or one live sandbox (fork), each on its own."""

    count: int = Field(1, ge=1, le=MAX_FORK, description="how many sandboxes to start")
    labels: Labels = Field(
        default_factory=dict, description="labels of the new sandboxes (added to the source's labels)"
    )
    idempotency_key: IdempotencyKey | None = Field(
        None, description="a retried fork or restore with the same key returns the sandboxes it already made"
    )


class PackRequest(_Model):
    """Turn a live sandbox's changes into a new image: its layers plus one layer of what it changed."""

    image: str = Field(max_length=MAX_REF, description="name:tag of the new image (replaced if it exists)")
    exclude: list[AbsPath] = Field(
        default_factory=list,
        max_length=256,
        description="absolute paths whose changes are left out (caches, shell history, answer files)",
    )
