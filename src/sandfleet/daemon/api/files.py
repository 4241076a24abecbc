"""Files of a sandbox: content, lists, stats, directories, removal, tar down- and uploads, watches."""

from __future__ import annotations

import asyncio
import tempfile
from typing import Annotated, BinaryIO, cast

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from sandfleet.daemon.api.common import (
    FILE_BEAT,
    MAX_INT64,
    NDJSON,
    Api,
    CheckedRoute,
    file_body,
    stream,
)
from sandfleet.errors import (
    InvalidArgumentError,
)
from sandfleet.models import (
    MAX_PATH,
    MAX_XATTR_NAME,
    FileEvent,
    FileInfo,
    FileList,
    Ok,
    check_xattrs,
)

XATTRS_DOC = (
    'a JSON object of text, {"name": "value"}: the file\'s extended attributes of the `user.` namespace '
    "under xattrs_scope become these (names without `user.`), the others there go"
)
SCOPE_DOC = "the names xattrs replaces start with this (default: all of `user.`); xattrs' names must too"
# The JSON in the query, at most, in characters: percent-encoded (up to 12 bytes each) beside a
# longest path, the request's head stays within what the HTTP server reads (httptools: 80 KiB).
XATTRS_QUERY = 2048
_XATTRS: TypeAdapter[dict[str, str]] = TypeAdapter(dict[str, str])


def parse_xattrs(raw: str | None, scope: str = "") -> dict[str, str] | None:
    if raw is None:
        return None
    try:
        attrs = _XATTRS.validate_json(raw)
    except ValidationError as exc:
        raise InvalidArgumentError('xattrs: a JSON object of text, {"name": "value"}') from exc
    try:
        check_xattrs(attrs)
    except ValueError as exc:
        raise InvalidArgumentError(f"xattrs: {exc}") from exc
    outside = [name for name in attrs if not name.startswith(scope)]
    if outside:
        raise InvalidArgumentError(f"xattrs: {outside[0]!r} is outside xattrs_scope {scope!r}"[:300])
    return attrs


def router(api: Api) -> APIRouter:
    r = APIRouter(route_class=CheckedRoute)
    node = api.node

    @api.route(r, "read_file", response_class=Response, responses={200: {"content": {"application/octet-stream": {}}}})
    async def read_file(
        sandbox_id: str,
        path: str,
        offset: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
        length: Annotated[int | None, Query(ge=0, le=MAX_INT64)] = None,
    ) -> Response:
        data = await node.files.read_file(sandbox_id, path, offset, length)
        return Response(data, media_type="application/octet-stream")

    @api.route(
        r, "write_file", openapi_extra={"requestBody": {"content": {"application/octet-stream": {}}, "required": True}}
    )
    async def write_file(
        request: Request,
        sandbox_id: str,
        path: str,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
        user: str | None = None,
        append: bool = False,
        xattrs: Annotated[str | None, Query(max_length=XATTRS_QUERY, description=XATTRS_DOC)] = None,
        xattrs_scope: Annotated[str, Query(max_length=MAX_XATTR_NAME, description=SCOPE_DOC)] = "",
    ) -> FileInfo:
        attrs = parse_xattrs(xattrs, xattrs_scope)
        data = await file_body(request)
        return await node.files.write_file(
            sandbox_id, path, data, mode=mode, user=user, append=append, xattrs=attrs, xattrs_scope=xattrs_scope
        )

    @api.route(r, "list_files")
    async def list_files(sandbox_id: str, path: str = "/", xattrs: bool = False) -> FileList:
        """`xattrs`: each entry's extended attributes too (a syscall more per entry)."""
        return FileList(files=await node.files.list_files(sandbox_id, path, xattrs))

    @api.route(r, "stat_file")
    async def stat_file(sandbox_id: str, path: str, follow_symlinks: bool = False) -> FileInfo:
        return await node.files.stat_file(sandbox_id, path, follow_symlinks)

    @api.route(r, "mkdir")
    async def mkdir(
        sandbox_id: str,
        path: str,
        parents: bool = True,
        user: str | None = None,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o755,
    ) -> FileInfo:
        return await node.files.make_dir(sandbox_id, path, parents=parents, mode=mode, user=user)

    @api.route(r, "remove")
    async def remove(sandbox_id: str, path: str, recursive: bool = False) -> Ok:
        await node.files.remove_path(sandbox_id, path, recursive)
        return Ok()

    @api.route(r, "download", response_class=StreamingResponse, responses={200: {"content": {"application/x-tar": {}}}})
    async def download(sandbox_id: str, path: str = "/") -> StreamingResponse:
        """A tar of a file or directory, streamed as it is read (never spooled on the node); a
        sparse file counts by what it really stores, and a tree larger than the sandbox could hold
        is refused."""
        return StreamingResponse(await node.files.download_tar(sandbox_id, path), media_type="application/x-tar")

    @api.route(r, "upload", openapi_extra={"requestBody": {"content": {"application/x-tar": {}}, "required": True}})
    async def upload(request: Request, sandbox_id: str, path: str = "/", user: str | None = None) -> Ok:
        # Never more than the sandbox's writable layer could take (plus the tar's own headers).
        cap = await node.files.upload_limit(sandbox_id)
        with tempfile.SpooledTemporaryFile(max_size=8 * 1024**2) as spool:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise InvalidArgumentError(f"tar upload larger than the sandbox's disk allows ({cap} bytes)")
                await asyncio.to_thread(spool.write, chunk)
            spool.seek(0)
            await node.files.upload_tar(sandbox_id, path, cast(BinaryIO, spool), size, user)
        return Ok()

    FileEvent(type="heartbeat").model_dump_json(exclude_none=True).encode() + b"\n"

    @api.route(r, "watch", response_class=StreamingResponse, responses=NDJSON)
    async def watch(
        sandbox_id: str,
        path: Annotated[str, Query(min_length=1, max_length=MAX_PATH, pattern=r"^[^\x00]+$")] = ".",
        recursive: bool = True,
    ) -> StreamingResponse:
        """FileEvent lines for changes under a directory (create, modify, delete, rename_from,
        rename_to, chmod; overflow when events were lost), until the client goes away."""
        events = await node.files.watch(sandbox_id, path, recursive)
        return stream(events, FILE_BEAT)

    return r
