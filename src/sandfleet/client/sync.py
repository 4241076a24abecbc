"""`Client`: the blocking SDK. Generated from aio.py by scripts/gen_sync_client.py: do not edit."""

from __future__ import annotations

import builtins
import functools
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from sandfleet.client import _base as b
from sandfleet.errors import ResourceExhaustedError, SandboxError, SandboxNotFoundError
from sandfleet.models import (
    CreateBatchResult,
    EventList,
    ExecEvent,
    ExecResult,
    FileInfo,
    FileList,
    GcResult,
    IdList,
    ImageInfo,
    ImageList,
    ImportRequest,
    ProcessInfo,
    ProcessList,
    SandboxEvent,
    SandboxInfo,
    SandboxList,
    SandboxSpec,
    SessionInfo,
    SnapshotInfo,
    SnapshotList,
    StopManyResult,
    Usage,
)

M = TypeVar("M", bound=BaseModel)


class Client:
    """Talks to a sandfleet daemon. `with Client() as fleet: sb = fleet.create(...)`."""

    def __init__(
        self,
        socket: str | os.PathLike[str] | None = None,
        *,
        url: str | None = None,
        token: str | None = None,
        timeout: float = b.DEFAULT_TIMEOUT,
    ) -> None:
        self.endpoint = b.Endpoint.resolve(socket, url, token)
        self.timeout = timeout
        transport = httpx.HTTPTransport(uds=self.endpoint.socket) if self.endpoint.socket else None
        self._http = httpx.Client(
            base_url=self.endpoint.url, transport=transport, timeout=timeout, headers=self.endpoint.headers()
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- plumbing

    def _send(self, call: b.Call) -> bytes:
        try:
            resp = self._http.request(
                call.method,
                call.path,
                params=call.params,
                json=call.json,
                content=call.content,
                headers=dict(call.headers),
                timeout=self.timeout if call.timeout == "default" else call.timeout,
            )
        except httpx.HTTPError as exc:
            raise b.map_transport_error(exc, self.endpoint) from exc
        except OSError as exc:
            raise b.map_transport_error(exc, self.endpoint) from exc
        b.raise_for(resp.status_code, resp.content, self.endpoint)
        return resp.content

    def _model(self, model: type[M], call: b.Call) -> M:
        return b.decode(model, self._send(call))

    def _stream_lines(self, call: b.Call) -> Iterator[bytes]:
        try:
            timeout = self.timeout if call.timeout == "default" else call.timeout
            with self._http.stream(call.method, call.path, json=call.json, timeout=timeout) as resp:
                if resp.status_code >= 400:
                    b.raise_for(resp.status_code, resp.read(), self.endpoint)
                for line in resp.iter_lines():
                    if line:
                        yield line.encode()
        except httpx.HTTPError as exc:
            raise b.map_transport_error(exc, self.endpoint) from exc

    # -- node

    def health(self) -> dict[str, Any]:
        import json

        result: dict[str, Any] = json.loads(self._send(b.Call("GET", "/v1/health")))
        return result

    def images(self) -> list[ImageInfo]:

        return (self._model(ImageList, b.Call("GET", "/v1/images"))).images

    def delete_image(self, ref: str) -> None:
        """Delete an image's manifest (its layers go at the next `gc_images` once nothing uses them)."""
        self._send(b.Call("DELETE", "/v1/images/" + quote(ref, safe="")))

    def gc_images(self, min_age: float = 600.0) -> GcResult:
        """Delete layer files no image, sandbox or snapshot uses (and older than `min_age` seconds)."""
        return self._model(GcResult, b.Call("POST", "/v1/images/gc", params={"min_age": min_age}))

    def build_image(self, ref: str, timeout: float = 1800) -> ImageInfo:
        return self._model(ImageInfo, b.Call("POST", "/v1/images/build", params={"ref": ref}, timeout=timeout))

    def push_image(self, ref: str, timeout: float = 1800) -> ImageInfo:
        """Publish a local image to the daemon's shared store as on-demand layers (other nodes
        then use it without copying its file data)."""
        return self._model(ImageInfo, b.Call("POST", "/v1/images/push", params={"ref": ref}, timeout=timeout))

    def import_image(self, path: str, ref: str | None = None, timeout: float = 1800) -> ImageInfo:
        """Import a `docker save` tarball or an OCI image layout (a path on the daemon's host)."""
        body = ImportRequest(path=path, ref=ref).model_dump(mode="json")
        return self._model(ImageInfo, b.Call("POST", "/v1/images/import", json=body, timeout=timeout))

    # -- sandboxes

    def create(self, spec: SandboxSpec | None = None, *, timeout: float | None = None, **fields: Any) -> Sandbox:
        """Create a sandbox from a spec or from SandboxSpec fields (`image=..., resources=...`)."""
        spec = b.spec_from(spec, fields)
        info = self._model(SandboxInfo, b.call_create(spec, timeout or max(self.timeout, 600)))
        return Sandbox(self, info)

    def create_many(
        self,
        specs: Sequence[SandboxSpec],
        *,
        concurrency: int = 16,
        batch_size: int = 64,
        retry_for: float = 60.0,
    ) -> builtins.list[Sandbox | SandboxError]:
        """Create one sandbox per spec; one result per spec, in order: the sandbox or its SandboxError.

        Specs travel `batch_size` to a request (one round trip per batch, not per sandbox), two
        requests in flight, and the daemon runs `concurrency` creates of each batch at once. Each
        item succeeds or fails on its own. Refusals of a full node (`ResourceExhaustedError`) are
        retried with backoff for up to `retry_for` seconds (nothing else is: after a timeout or a
        broken connection the create may have happened, and a retry would duplicate it).
        """
        results: dict[int, Sandbox | SandboxError] = {}
        pending = builtins.list(enumerate(specs))
        deadline = time.monotonic() + retry_for
        delay = 0.05
        while pending:
            chunks = [pending[i : i + batch_size] for i in range(0, len(pending), batch_size)]
            calls = [functools.partial(self._create_batch, chunk, concurrency) for chunk in chunks]
            pending = []
            for chunk_results in b.gather_bounded_sync(2, calls):
                for index, spec, outcome in chunk_results:
                    if isinstance(outcome, ResourceExhaustedError) and time.monotonic() + delay <= deadline:
                        pending.append((index, spec))
                    else:
                        results[index] = outcome
            if pending:
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        return [results[i] for i in range(len(specs))]

    def _create_batch(
        self, chunk: Sequence[tuple[int, SandboxSpec]], concurrency: int
    ) -> builtins.list[tuple[int, SandboxSpec, Sandbox | SandboxError]]:
        try:
            reply = self._model(
                CreateBatchResult,
                b.call_create_batch([spec for _, spec in chunk], concurrency, max(self.timeout, 600)),
            )
        except SandboxError as exc:
            return [(index, spec, exc) for index, spec in chunk]
        return [
            (index, spec, Sandbox(self, item.sandbox) if item.sandbox else b.item_error(item))
            for (index, spec), item in zip(chunk, reply.results, strict=True)
        ]

    def get(self, sandbox_id: str) -> Sandbox:
        """Attach to an existing sandbox by id (e.g. from another process, after a trainer restart)."""
        return Sandbox(self, self._model(SandboxInfo, b.Call("GET", b.sandbox_path(sandbox_id))))

    def list(self, labels: Mapping[str, str] | None = None, state: str | None = None) -> list[SandboxInfo]:

        return (self._model(SandboxList, b.call_list(labels, state))).sandboxes

    def stop_many(self, labels: Mapping[str, str], reason: str = "user") -> builtins.list[str]:

        call = b.Call("POST", "/v1/sandboxes/stop", json={"labels": dict(labels), "reason": reason})
        return (self._model(StopManyResult, call)).stopped

    def pause_many(self, labels: Mapping[str, str]) -> builtins.list[str]:
        """Pause every running sandbox with these labels (a preempted trainer's whole job); the ids paused."""
        call = b.Call("POST", "/v1/sandboxes/pause", json={"labels": dict(labels)}, timeout=max(self.timeout, 600))
        return (self._model(IdList, call)).sandboxes

    def resume_many(self, labels: Mapping[str, str]) -> builtins.list[str]:
        """Resume every paused sandbox with these labels; the ids resumed."""
        call = b.Call("POST", "/v1/sandboxes/resume", json={"labels": dict(labels)}, timeout=max(self.timeout, 600))
        return (self._model(IdList, call)).sandboxes

    def restore(
        self, snapshot_id: str, count: int = 1, labels: Mapping[str, str] | None = None
    ) -> builtins.list[Sandbox | SandboxError]:
        """`count` new sandboxes from a snapshot (processes, memory, files); one result per child, in order."""
        return self._batch(b.call_restore(snapshot_id, count, labels, max(self.timeout, 600)))

    def snapshots(self, sandbox_id: str | None = None) -> builtins.list[SnapshotInfo]:
        params = {"sandbox_id": sandbox_id} if sandbox_id else None
        return (self._model(SnapshotList, b.Call("GET", "/v1/snapshots", params=params))).snapshots

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._send(b.Call("DELETE", b.snapshot_path(snapshot_id)))

    def _batch(self, call: b.Call) -> builtins.list[Sandbox | SandboxError]:
        reply = self._model(CreateBatchResult, call)
        return [Sandbox(self, item.sandbox) if item.sandbox else b.item_error(item) for item in reply.results]


class Sandbox:
    def __init__(self, client: Client, info: SandboxInfo) -> None:
        self._c = client
        self.info = info
        self.id = info.id
        self.files = Files(self)

    def __repr__(self) -> str:
        return f"<Sandbox {self.id} {self.info.state}>"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.stop()
        except SandboxError:
            if et is None:
                raise

    def refresh(self) -> SandboxInfo:
        self.info = self._c._model(SandboxInfo, b.Call("GET", b.sandbox_path(self.id)))
        return self.info

    def usage(self) -> Usage:
        """Current and peak memory, CPU seconds, tasks and limit hits (does not resume a paused sandbox)."""
        return self._c._model(Usage, b.Call("GET", b.sandbox_path(self.id) + "/usage"))

    def pause(self) -> SandboxInfo:
        """Freeze the sandbox and push its memory out; any later request resumes it transparently."""
        self.info = self._c._model(SandboxInfo, b.Call("POST", b.sandbox_path(self.id) + "/pause"))
        return self.info

    def resume(self) -> SandboxInfo:
        self.info = self._c._model(SandboxInfo, b.Call("POST", b.sandbox_path(self.id) + "/resume"))
        return self.info

    def snapshot(self) -> SnapshotInfo:
        """Checkpoint processes, memory and files; the sandbox keeps running (a paused one stays paused)."""
        call = b.Call("POST", b.sandbox_path(self.id) + "/snapshots", timeout=max(self._c.timeout, 600))
        return self._c._model(SnapshotInfo, call)

    def pack(self, image: str, *, exclude: Sequence[str] = ()) -> ImageInfo:
        """Save this sandbox's changes as image `name:tag` (its layers + one new layer); `exclude`d paths
        keep their base content. Create sandboxes from it with `fleet.create(image=...)`."""
        body = {"image": image, "exclude": list(exclude)}
        call = b.Call("POST", b.sandbox_path(self.id) + "/pack", json=body, timeout=max(self._c.timeout, 1800))
        return self._c._model(ImageInfo, call)

    def fork(self, count: int = 1, labels: Mapping[str, str] | None = None) -> builtins.list[Sandbox | SandboxError]:
        """`count` copies of this sandbox as it is now, each isolated from it and from each other."""
        return self._c._batch(b.call_fork(self.id, count, labels, max(self._c.timeout, 600)))

    def stop(self, reason: str = "user") -> SandboxInfo:
        """Stop the sandbox; stopping one that is already gone (TTL, stop_many) is not an error."""
        try:
            self.info = self._c._model(SandboxInfo, b.Call("DELETE", b.sandbox_path(self.id), json={"reason": reason}))
        except SandboxNotFoundError:
            self.info = self.info.model_copy(update={"state": "stopped"})
        return self.info

    def exec(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
    ) -> ExecResult:
        """Run a command to completion. A string runs under /bin/sh -c; a list is an argv."""
        body = b.exec_body(
            command,
            env=dict(env) if env else None,
            cwd=cwd,
            user=user,
            stdin=stdin,
            timeout=timeout,
            output_limit=output_limit,
        )
        return self._c._model(ExecResult, b.call_exec(self.id, body, self._c.timeout))

    def exec_stream(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | None = None,
        timeout: float | None = 60.0,
        output_limit: int | None = None,
    ) -> Iterator[ExecEvent]:
        """Yield stdout/stderr chunks as they arrive, then one `exit` event with the result."""
        body = b.exec_body(
            command,
            env=dict(env) if env else None,
            cwd=cwd,
            user=user,
            stdin=stdin,
            timeout=timeout,
            output_limit=output_limit,
        )
        for line in self._c._stream_lines(b.call_exec(self.id, body, self._c.timeout, stream=True)):
            yield b.decode_event(line)

    def start(
        self,
        command: str | builtins.list[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float | None = None,
        output_limit: int | None = None,
    ) -> Process:
        """Start a background process (its own session); returns a handle to wait on or kill."""
        body = b.exec_body(
            command, env=dict(env) if env else None, cwd=cwd, user=user, timeout=timeout, output_limit=output_limit
        )
        info = self._c._model(ProcessInfo, b.Call("POST", b.sandbox_path(self.id) + "/processes", json=body))
        return Process(self, info)

    def processes(self) -> builtins.list[ProcessInfo]:

        return (self._c._model(ProcessList, b.Call("GET", b.sandbox_path(self.id) + "/processes"))).processes

    def session(
        self, *, env: Mapping[str, str] | None = None, cwd: str | None = None, user: str | None = None
    ) -> Session:
        """Open a persistent shell: commands share cwd, environment and shell variables."""
        body = {"env": dict(env or {}), "cwd": cwd, "user": user}
        info = self._c._model(SessionInfo, b.Call("POST", b.sandbox_path(self.id) + "/sessions", json=body))
        return Session(self, info)

    def events(self, after: int = 0) -> builtins.list[SandboxEvent]:

        call = b.Call("GET", b.sandbox_path(self.id) + "/events", params={"after": after})
        return (self._c._model(EventList, call)).events


class Process:
    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self._sb = sandbox
        self.info = info
        self.id = info.id

    def wait(self, timeout: float = 60.0) -> ProcessInfo:
        call = b.Call(
            "GET",
            b.sandbox_path(self._sb.id) + f"/processes/{self.id}",
            params={"wait": timeout},
            timeout=timeout + b.EXEC_MARGIN,
        )
        self.info = self._sb._c._model(ProcessInfo, call)
        return self.info

    def kill(self, signal: int = 9) -> ProcessInfo:
        call = b.Call("DELETE", b.sandbox_path(self._sb.id) + f"/processes/{self.id}", params={"signal": signal})
        self.info = self._sb._c._model(ProcessInfo, call)
        return self.info


class Session:
    def __init__(self, sandbox: Sandbox, info: SessionInfo) -> None:
        self._sb = sandbox
        self.info = info
        self.id = info.id

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, command: str, *, timeout: float | None = 60.0, output_limit: int = 1024**2) -> ExecResult:
        call = b.call_session_run(self._sb.id, self.id, command, timeout, output_limit, self._sb._c.timeout)
        return self._sb._c._model(ExecResult, call)

    def close(self) -> None:
        self._sb._c._send(b.Call("DELETE", b.sandbox_path(self._sb.id) + f"/sessions/{self.id}"))


class Files:
    """File operations inside the sandbox; paths are absolute sandbox paths."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        return self._sb._c._send(b.call_read(self._sb.id, path, offset, length))

    def read_text(self, path: str) -> str:
        return (self.read(path)).decode()

    def write(
        self, path: str, data: bytes | str, *, mode: int = 0o644, user: str | None = None, append: bool = False
    ) -> FileInfo:
        raw = data.encode() if isinstance(data, str) else data
        return self._sb._c._model(FileInfo, b.call_write(self._sb.id, path, raw, mode, user, append))

    def list(self, path: str = "/") -> builtins.list[FileInfo]:

        call = b.Call("GET", b.sandbox_path(self._sb.id) + "/files/list", params={"path": path})
        return (self._sb._c._model(FileList, call)).files

    def stat(self, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        call = b.Call(
            "GET",
            b.sandbox_path(self._sb.id) + "/files/stat",
            params={"path": path, "follow_symlinks": str(follow_symlinks).lower()},
        )
        return self._sb._c._model(FileInfo, call)

    def exists(self, path: str) -> bool:
        from sandfleet.errors import NotFoundError

        try:
            self.stat(path)
        except NotFoundError:
            return False
        return True

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755, user: str | None = None) -> FileInfo:
        params: dict[str, Any] = {"path": path, "parents": str(parents).lower(), "mode": mode}
        if user:
            params["user"] = user
        call = b.Call("POST", b.sandbox_path(self._sb.id) + "/files/mkdir", params=params)
        return self._sb._c._model(FileInfo, call)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sb._c._send(
            b.Call(
                "DELETE",
                b.sandbox_path(self._sb.id) + "/files",
                params={"path": path, "recursive": str(recursive).lower()},
            )
        )

    def upload(self, local: str | os.PathLike[str], path: str, *, user: str | None = None) -> None:
        """Copy a local file or directory's contents into the sandbox directory `path` (as a tar)."""
        data = b.local_tar(Path(local))
        self._sb._c._send(b.call_upload(self._sb.id, path, data, user))

    def download(self, path: str, local: str | os.PathLike[str]) -> None:
        """Copy a sandbox file or directory into the local directory `local`."""
        data = self.download_tar(path)
        b.extract_tar(data, Path(local))

    def download_tar(self, path: str) -> bytes:
        return self._sb._c._send(b.Call("GET", b.sandbox_path(self._sb.id) + "/files/tar", params={"path": path}))
