"""E2B's in-sandbox daemon (envd) as its SDK calls it, over sandfleet's API: the Connect services
process.Process (commands.py) and filesystem.Filesystem (filesystem.py), and the /files and /health
routes. Every call names its sandbox (E2b-Sandbox-Id) and carries the access token the create
answered (X-Access-Token: the caller's API key, so it acts as the caller's project)."""

from __future__ import annotations

import posixpath
import re
import zlib

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from sandfleet.client.aio import AsyncSandbox
from sandfleet.e2b._connect import ConnectService
from sandfleet.e2b._proto import filesystem_pb2 as fs
from sandfleet.e2b._proto import process_pb2 as pp
from sandfleet.e2b._upstream import Upstream, edge_error, envd_user, resolve
from sandfleet.e2b.commands import Processes
from sandfleet.e2b.filesystem import METADATA_XATTR, Filesystem, metadata
from sandfleet.errors import InvalidArgumentError, NotFoundError, SandboxError, SandboxNotFoundError

# The node refuses a file body past 256 MiB too (upload larger trees as a tar in parts); this layer
# refuses it before holding it.
MAX_UPLOAD = 256 * 1024**2
# A file's metadata: X-Metadata-<key> headers of an upload, kept as the file's `user.e2b.<key>`
# extended attributes (keys lowercased, as envd does); keys are HTTP tokens, values printable ASCII.
METADATA_HEADER = "x-metadata-"
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
_PRINTABLE = re.compile(r"[\x20-\x7e]*\Z")


class Files:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def routes(self) -> list[Route]:
        return [
            Route("/files", self.download, methods=["GET"]),
            Route("/files", self.upload, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
        ]

    async def download(self, request: Request) -> Response:
        try:
            sb = self.upstream.envd_sandbox(request.headers)
            data = await sb.files.read(resolve(request.query_params.get("path", "")))
        except SandboxError as exc:
            return edge_error(exc)
        return Response(data, media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        try:
            sb = self.upstream.envd_sandbox(request.headers)
            given = request.query_params.get("path")
            user = envd_user(request.headers, request.query_params)
            xattrs = _metadata(request)
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > MAX_UPLOAD:
                raise InvalidArgumentError(f"an upload is at most {MAX_UPLOAD} bytes")
            written = []
            if request.headers.get("content-type", "").startswith("multipart/form-data"):
                async with request.form() as form:
                    parts = [p for p in form.getlist("file") if isinstance(p, UploadFile)]
                    if not parts:
                        raise InvalidArgumentError("the form has no file part")
                    for part in parts:
                        target = given if given and len(parts) == 1 else part.filename
                        written.append(await _write(sb, target or "", await part.read(), user, xattrs))
            else:
                data = await _capped(request)
                if request.headers.get("content-encoding", "").lower() == "gzip":
                    data = _gunzip(data)
                written.append(await _write(sb, given or "", data, user, xattrs))
        except SandboxError as exc:
            return edge_error(exc)
        except (OSError, EOFError, zlib.error) as exc:  # a gzip body that is not gzip
            return edge_error(InvalidArgumentError(f"the body cannot be read: {exc}"))
        except HTTPException as exc:  # Starlette's form parser: a multipart body it cannot parse
            return edge_error(InvalidArgumentError(f"the form cannot be read: {exc.detail}"))
        return JSONResponse(written)

    async def health(self, request: Request) -> Response:
        try:
            sb = self.upstream.envd_sandbox(request.headers)
            info = await sb.refresh()
        except SandboxError as exc:
            return edge_error(exc)
        if info.state != "running":  # paused too: E2B's envd of a paused sandbox is not running
            return edge_error(SandboxNotFoundError(f"sandbox {info.id} is {info.state}"))
        return Response(status_code=204)


async def _capped(request: Request) -> bytes:
    """The body, refused past MAX_UPLOAD as it arrives (a sized or a chunked one alike)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_UPLOAD:
            raise InvalidArgumentError(f"an upload is at most {MAX_UPLOAD} bytes")
    return bytes(body)


def _gunzip(data: bytes) -> bytes:
    """A gzip body, refused when it would inflate past MAX_UPLOAD (a small bomb is no way around it)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    out = inflater.decompress(data, MAX_UPLOAD + 1)
    if len(out) > MAX_UPLOAD or inflater.unconsumed_tail:
        raise InvalidArgumentError(f"an upload is at most {MAX_UPLOAD} bytes (inflated)")
    if not inflater.eof:
        raise InvalidArgumentError("the gzip body ends early")
    return out


def _metadata(request: Request) -> dict[str, str]:
    """The upload's metadata as the file's `user.e2b.*` extended attributes (every upload sets
    them: a file written without metadata keeps none of E2B's from before; others stay)."""
    out = {}
    for name, value in request.headers.items():  # names come lowercased
        if not name.startswith(METADATA_HEADER):
            continue
        key = name[len(METADATA_HEADER) :]
        if not _TOKEN.match(key) or not _PRINTABLE.match(value):
            raise InvalidArgumentError(f"invalid metadata {key!r}: keys are HTTP tokens, values printable ASCII")
        out[METADATA_XATTR + key] = value
    return out


async def _write(
    sb: AsyncSandbox, path: str, data: bytes, user: str | None, xattrs: dict[str, str]
) -> dict[str, object]:
    """envd's write: the parents made as needed (the user's), the file replaced."""
    target = resolve(path)
    try:
        made = await sb.files.write(target, data, user=user, xattrs=xattrs, xattrs_scope=METADATA_XATTR)
    except NotFoundError:
        await sb.files.mkdir(posixpath.dirname(target), parents=True, user=user)
        made = await sb.files.write(target, data, user=user, xattrs=xattrs, xattrs_scope=METADATA_XATTR)
    written: dict[str, object] = {"path": made.path, "name": made.name, "type": "file"}
    if found := metadata(made):
        written["metadata"] = found
    return written


class Envd:
    """envd's services and routes, and what they keep between calls (terminals, watchers)."""

    def __init__(self, upstream: Upstream) -> None:
        self.processes = Processes(upstream)
        self.filesystem = Filesystem(upstream)
        self.files = Files(upstream)

    def routes(self) -> list[Route | Mount]:
        process = ConnectService(pp.DESCRIPTOR.services_by_name["Process"], self.processes)
        filesystem = ConnectService(fs.DESCRIPTOR.services_by_name["Filesystem"], self.filesystem)
        return [Mount(process.path, app=process), Mount(filesystem.path, app=filesystem), *self.files.routes()]

    def close(self) -> None:
        self.processes.close()
        self.filesystem.close()
