"""I/O-free core shared by `Client` and `AsyncClient`: request building and response decoding.

Each API call is described as a `Call` (method, path, params, body, expected model); the sync and
async clients only differ in how they send it. Transport errors and wire errors are mapped to the
`SandboxError` tree here, so both clients raise the same exceptions.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ValidationError

from sandfleet.errors import (
    InternalError,
    InvalidArgumentError,
    SandboxError,
    SandboxTimeoutError,
    UnavailableError,
    error_from_wire,
)
from sandfleet.models import CreateBatchItem, CreateBatchRequest, ExecEvent, ExecRequest, ForkRequest, SandboxSpec

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

DEFAULT_SOCKET = "/run/sandfleet/sandfleet.sock"
DEFAULT_TIMEOUT = 60.0
# Extra HTTP time on top of a command's own timeout, so the daemon's answer (timed_out=true) wins.
EXEC_MARGIN = 10.0


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    params: Mapping[str, Any] | list[tuple[str, Any]] | None = None
    json: Any = None
    content: bytes | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # "default": the client's timeout; None: wait as long as it takes (e.g. exec with timeout=None).
    timeout: float | None | Literal["default"] = "default"


@dataclass(frozen=True)
class Endpoint:
    """Where the daemon is: a unix socket (default) or an HTTP URL with a bearer token."""

    socket: str | None
    url: str
    token: str | None

    @classmethod
    def resolve(cls, socket: str | os.PathLike[str] | None, url: str | None, token: str | None) -> Endpoint:
        url = url or os.environ.get("SANDFLEET_URL")
        token = token or os.environ.get("SANDFLEET_TOKEN")
        if url:
            return cls(None, url.rstrip("/"), token)
        sock = str(socket or os.environ.get("SANDFLEET_SOCKET") or DEFAULT_SOCKET)
        return cls(sock, "http://sandfleet", token)

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    def describe(self) -> str:
        return f"unix socket {self.socket}" if self.socket else self.url


def exec_timeout(timeout: float | None, default: float) -> float | None:
    if timeout is None:
        return None
    return max(default, timeout + EXEC_MARGIN)


def spec_from(spec: SandboxSpec | None, kwargs: dict[str, Any]) -> SandboxSpec:
    try:
        if spec is not None and kwargs:
            return SandboxSpec.model_validate({**spec.model_dump(exclude_unset=True), **kwargs})
        if spec is not None:
            return spec
        return SandboxSpec.model_validate(kwargs)
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid sandbox spec: {exc}") from exc


def exec_body(command: str | list[str], *, timeout: float | None, **kw: Any) -> dict[str, Any]:
    """The exec request body: unset options are left to the daemon's defaults; `timeout=None` means none."""
    fields = {k: v for k, v in kw.items() if v is not None} | {"timeout": timeout}
    try:
        return ExecRequest.model_validate({"command": command, **fields}).model_dump(mode="json")
    except ValidationError as exc:
        raise InvalidArgumentError(f"invalid exec request: {exc}") from exc


def raise_for(response_status: int, body: bytes, endpoint: Endpoint) -> None:
    if response_status < 400:
        return
    try:
        decoded: object = json.loads(body)
    except ValueError:
        decoded = body[:200].decode(errors="replace")
    raise error_from_wire(decoded, status=response_status)


def decode(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValueError as exc:
        raise InternalError(f"malformed response from the daemon: {exc}") from exc


def decode_event(line: bytes) -> ExecEvent:
    data = json.loads(line)
    if data.get("type") == "error":
        raise error_from_wire(data)
    return ExecEvent.model_validate(data)


def map_transport_error(exc: Exception, endpoint: Endpoint) -> SandboxError:
    if isinstance(exc, httpx.TimeoutException):
        return SandboxTimeoutError(f"request to the sandfleet daemon timed out ({type(exc).__name__})")
    if isinstance(exc, (httpx.ConnectError, FileNotFoundError, ConnectionRefusedError)):
        return UnavailableError(
            f"cannot reach the sandfleet daemon at {endpoint.describe()} (is `sandfleet serve` running?)"
        )
    return UnavailableError(f"transport error talking to the daemon: {exc}")


async def gather_bounded(limit: int, factories: Sequence[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run the coroutine factories with at most `limit` in flight; results in order."""
    sem = asyncio.Semaphore(max(1, limit))

    async def run(factory: Callable[[], Awaitable[T]]) -> T:
        async with sem:
            return await factory()

    return list(await asyncio.gather(*(run(f) for f in factories)))


def gather_bounded_sync(limit: int, factories: Sequence[Callable[[], T]]) -> list[T]:
    """The blocking client's counterpart: a thread pool of `limit` workers."""
    with ThreadPoolExecutor(max(1, limit)) as pool:
        return list(pool.map(lambda f: f(), factories))


def local_tar(src: Path) -> bytes:
    """Pack a local file or directory for upload (paths relative to it)."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        if src.is_dir():
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=child.name)
        else:
            tar.add(src, arcname=src.name)
    return buf.getvalue()


def extract_tar(data: bytes, dest: Path) -> None:
    import io
    import tarfile

    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(dest, filter="data")


# -- the calls, one builder per API operation (no I/O) ----------------------------------------------


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def sandbox_path(sandbox_id: str) -> str:
    """`/v1/sandboxes/<id>`, refusing ids that could not name a sandbox (or would change the route)."""
    if not isinstance(sandbox_id, str) or not _ID_RE.match(sandbox_id):
        raise InvalidArgumentError(f"invalid sandbox id {sandbox_id!r}")
    return "/v1/sandboxes/" + quote(sandbox_id, safe="")


def _sb(sandbox_id: str, suffix: str = "") -> str:
    return sandbox_path(sandbox_id) + suffix


# Fields the caller left unset are not sent: the daemon fills them from the image's defaults
# (an OCI image's WorkingDir and User) before its own.
def call_create(spec: SandboxSpec, timeout: float) -> Call:
    return Call("POST", "/v1/sandboxes", json=spec.model_dump(mode="json", exclude_unset=True), timeout=timeout)


def call_create_batch(specs: Sequence[SandboxSpec], concurrency: int, timeout: float) -> Call:
    body = CreateBatchRequest(specs=list(specs), concurrency=concurrency)
    return Call("POST", "/v1/sandboxes/batch", json=body.model_dump(mode="json", exclude_unset=True), timeout=timeout)


def snapshot_path(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not _ID_RE.match(snapshot_id):
        raise InvalidArgumentError(f"invalid snapshot id {snapshot_id!r}")
    return "/v1/snapshots/" + snapshot_id


def call_fork(sandbox_id: str, count: int, labels: Mapping[str, str] | None, timeout: float) -> Call:
    body = ForkRequest(count=count, labels=dict(labels or {}))
    return Call("POST", sandbox_path(sandbox_id) + "/fork", json=body.model_dump(mode="json"), timeout=timeout)


def call_restore(snapshot_id: str, count: int, labels: Mapping[str, str] | None, timeout: float) -> Call:
    body = ForkRequest(count=count, labels=dict(labels or {}))
    return Call("POST", snapshot_path(snapshot_id) + "/restore", json=body.model_dump(mode="json"), timeout=timeout)


def item_error(item: CreateBatchItem) -> SandboxError:
    """The error of one failed item of a batch create, as the exception the daemon meant."""
    assert item.error is not None
    return error_from_wire({"error": item.error.model_dump()}, status=200)


def call_list(labels: Mapping[str, str] | None, state: str | None) -> Call:
    params: list[tuple[str, Any]] = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
    if state:
        params.append(("state", state))
    return Call("GET", "/v1/sandboxes", params=params)


def call_exec(sandbox_id: str, body: dict[str, Any], default_timeout: float, *, stream: bool = False) -> Call:
    return Call(
        "POST",
        _sb(sandbox_id, "/exec/stream" if stream else "/exec"),
        json=body,
        timeout=exec_timeout(body.get("timeout"), default_timeout),
    )


def call_session_run(
    sandbox_id: str, session_id: str, command: str, timeout: float | None, output_limit: int, default_timeout: float
) -> Call:
    return Call(
        "POST",
        _sb(sandbox_id, f"/sessions/{session_id}/run"),
        json={"command": command, "timeout": timeout, "output_limit": output_limit},
        timeout=exec_timeout(timeout, default_timeout),
    )


def call_write(sandbox_id: str, path: str, data: bytes, mode: int, user: str | None, append: bool) -> Call:
    params: dict[str, Any] = {"path": path, "mode": mode, "append": str(append).lower()}
    if user:
        params["user"] = user
    return Call(
        "PUT",
        _sb(sandbox_id, "/files/content"),
        params=params,
        content=data,
        headers={"content-type": "application/octet-stream"},
    )


def call_read(sandbox_id: str, path: str, offset: int, length: int | None) -> Call:
    params: dict[str, Any] = {"path": path, "offset": offset}
    if length is not None:
        params["length"] = length
    return Call("GET", _sb(sandbox_id, "/files/content"), params=params)


def call_upload(sandbox_id: str, path: str, data: bytes, user: str | None) -> Call:
    params: dict[str, Any] = {"path": path}
    if user:
        params["user"] = user
    return Call(
        "PUT", _sb(sandbox_id, "/files/tar"), params=params, content=data, headers={"content-type": "application/x-tar"}
    )
