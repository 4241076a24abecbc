"""Calls on the node itself: image builds (recipes and their event streams) and the audit log."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sandfleet.client._base.wire import Call, _stream_item, _validated
from sandfleet.errors import InvalidArgumentError, UnavailableError
from sandfleet.models import AuditQuery, AuditRecord, BuildEvent, ImageInfo


def build_event(line: bytes) -> BuildEvent | None:
    """A recipe build's event; None for a heartbeat."""
    event = _stream_item(BuildEvent, line)
    return None if event.type == "heartbeat" else event


def built(image: ImageInfo | None) -> ImageInfo:
    if image is None:
        raise UnavailableError("the daemon's stream ended before the build did (the daemon went away)")
    return image


def recipe_source(recipe: str | os.PathLike[str], base_dir: str | os.PathLike[str] | None) -> tuple[str, str]:
    """A recipe's TOML text and the absolute directory its sources are read from."""
    if base_dir is None:
        if isinstance(recipe, str) and "\n" in recipe:
            raise InvalidArgumentError("a recipe given as text needs base_dir")
        path = Path(recipe).absolute()
        try:
            return path.read_text(), str(path.parent)
        except (OSError, UnicodeError) as exc:
            raise InvalidArgumentError(f"cannot read the recipe {str(path)!r}: {exc}") from exc
    if not isinstance(recipe, str):
        raise InvalidArgumentError("with base_dir, give the recipe's text")
    return recipe, str(Path(base_dir).absolute())


def audit_query(
    since: int,
    since_time: float | None,
    kinds: Sequence[str] | None,
    sandbox_id: str | None,
    limit: int,
    newest: bool = False,
) -> AuditQuery:
    fields = {"since": since, "since_time": since_time, "kinds": kinds, "sandbox_id": sandbox_id, "limit": limit}
    return _validated(AuditQuery, "audit query", fields | {"newest": newest})


def call_audit(query: AuditQuery, *, follow: bool) -> Call:
    params: list[tuple[str, Any]] = [("since", query.since)]
    if not follow:
        params.append(("limit", query.limit))
    if query.since_time is not None:
        params.append(("since_time", query.since_time))
    if query.sandbox_id is not None:
        params.append(("sandbox_id", query.sandbox_id))
    params += [("kind", k) for k in query.kinds or []]
    if query.newest and not follow:
        params.append(("newest", "true"))
    if follow:
        return Call("GET", "/v1/audit/follow", params=params, timeout=None)
    return Call("GET", "/v1/audit", params=params)


def audit_record(line: bytes) -> AuditRecord | None:
    """A line of the followed audit stream; None for a heartbeat."""
    if line.startswith(b'{"type":"heartbeat"'):
        return None
    return _stream_item(AuditRecord, line)
