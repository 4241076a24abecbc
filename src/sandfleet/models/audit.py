"""The audit stream."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field

from sandfleet.models.common import _Model


class AuditRecord(_Model):
    """One entry of the node's audit stream: an API call (`api`), a connection a sandbox made or was
    refused (`connection`), a limit it hit (`oom_kill`, `pids_limit`, `output_truncated`), a change
    of its policy (`network_policy`), an attempt on its agent (`agent_attack`), a detector's
    `finding`."""

    seq: int
    ts: float
    kind: str
    sandbox_id: str | None = None
    labels: dict[str, str] | None = None
    actor: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)


class AuditQuery(_Model):
    """Which audit records to read: after `since` (a seq), from `since_time` (epoch seconds)."""

    since: int = Field(0, ge=0, description="records with a greater seq (0: from the oldest kept)")
    since_time: float | None = Field(None, ge=0, description="records at or after this time (epoch seconds)")
    limit: int = Field(1000, ge=1, le=10000)
    kinds: list[Annotated[str, Field(max_length=64)]] | None = Field(None, max_length=32)
    sandbox_id: str | None = Field(None, max_length=64)
    newest: bool = Field(False, description="the last `limit` matching records (still oldest first), not the first")


class AuditList(_Model):
    records: list[AuditRecord]
    last_seq: int = Field(description="pass as `since` to read on from here")
