"""The wire's building blocks: `Call` (one API call, no I/O), validating request bodies,
decoding answers and stream lines, and the paths of the API's resources."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, Literal, TypeVar
from urllib.parse import quote

from pydantic import BaseModel, ValidationError

from sandfleet.errors import InternalError, InvalidArgumentError, error_from_wire
from sandfleet.operations import OPERATION

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


class Unset(Enum):
    """The type of `UNSET`: "argument not given", where None already means something (no limit)."""

    UNSET = "UNSET"

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    params: Mapping[str, Any] | list[tuple[str, Any]] | None = None
    json: Any = None
    content: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # A one-response call: seconds to wait for the answer ("default": the client's timeout).
    # A streamed call: seconds the whole stream may last (None or "default": as long as the daemon
    # keeps talking; silence is bounded by `silence_limit` of the client's timeout).
    timeout: float | None | Literal["default"] = "default"


def operation_call(
    name: str, body: BaseModel | None = None, *, timeout: float | Literal["default"] = "default", **path: str
) -> Call:
    """The call of operation `name` as sandfleet/operations.py declares it: its method, its path with
    `path`'s parameters filled in, `body` as its JSON; `timeout` as `Call.timeout`."""
    op = OPERATION[name]
    json = None if body is None else body.model_dump(mode="json")
    return Call(op.methods[0], op.path_of(**path), json=json, timeout=timeout)


def validated(model: type[M], what: str, fields: dict[str, Any]) -> M:
    """`model(**fields)`, or an InvalidArgumentError saying what was wrong (never a pydantic error)."""
    return _validated(model, what, fields)


def _validated(model: type[M], what: str, data: Mapping[str, Any]) -> M:
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid {what}: {exc}") from exc


def as_bytes(data: bytes | str) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


def decode(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValueError as exc:
        raise InternalError(f"malformed response from the daemon: {exc}") from exc


def _stream_item(model: type[M], line: bytes) -> M:
    """One line of an ndjson stream; an `error` line is the error the daemon hit mid-stream."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise InternalError(f"malformed stream line from the daemon: {line[:200]!r}") from exc
    if isinstance(data, dict) and data.get("type") == "error":
        raise error_from_wire(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InternalError(f"malformed stream line from the daemon: {exc}") from exc


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_OCTET_STREAM = {"content-type": "application/octet-stream"}


def _id(kind: str, value: str) -> str:
    """An id as one path segment, refusing ids that could not name anything (or would change the route)."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise InvalidArgumentError(f"invalid {kind} id {value!r}")
    return quote(value, safe="")


def sandbox_path(sandbox_id: str) -> str:
    """`/v1/sandboxes/<id>`, refusing ids that could not name a sandbox (or would change the route)."""
    return "/v1/sandboxes/" + _id("sandbox", sandbox_id)


def _sb(sandbox_id: str, suffix: str = "") -> str:
    return sandbox_path(sandbox_id) + suffix


def snapshot_path(snapshot_id: str) -> str:
    return "/v1/snapshots/" + _id("snapshot", snapshot_id)


def process_path(sandbox_id: str, process_id: str) -> str:
    return _sb(sandbox_id, "/processes/" + _id("process", process_id))


def session_path(sandbox_id: str, session_id: str) -> str:
    return _sb(sandbox_id, "/sessions/" + _id("session", session_id))
