"""File calls: read, write, list, stat, mkdir, remove, tar upload and download, watch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sandfleet.client._base.wire import _OCTET_STREAM, Call, _sb, _stream_item
from sandfleet.models import FileEvent


def file_event(line: bytes) -> FileEvent | None:
    """A watch stream's event; None for a heartbeat."""
    event = _stream_item(FileEvent, line)
    return None if event.type == "heartbeat" else event


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


def call_write(
    sandbox_id: str,
    path: str,
    data: bytes,
    mode: int,
    user: str | None,
    append: bool,
    xattrs: dict[str, str] | None,
    xattrs_scope: str = "",
) -> Call:
    params: dict[str, Any] = {"path": path, "mode": mode, "append": str(append).lower()}
    if user:
        params["user"] = user
    if xattrs is not None:
        params["xattrs"] = json.dumps(xattrs)
    if xattrs_scope:
        params["xattrs_scope"] = xattrs_scope
    return Call("PUT", _sb(sandbox_id, "/files/content"), params=params, content=data, headers=_OCTET_STREAM)


def call_read(sandbox_id: str, path: str, offset: int, length: int | None) -> Call:
    params: dict[str, Any] = {"path": path, "offset": offset}
    if length is not None:
        params["length"] = length
    return Call("GET", _sb(sandbox_id, "/files/content"), params=params)


def call_list_files(sandbox_id: str, path: str, xattrs: bool = False) -> Call:
    params: dict[str, Any] = {"path": path}
    if xattrs:
        params["xattrs"] = "true"
    return Call("GET", _sb(sandbox_id, "/files/list"), params=params)


def call_stat(sandbox_id: str, path: str, follow_symlinks: bool) -> Call:
    params = {"path": path, "follow_symlinks": str(follow_symlinks).lower()}
    return Call("GET", _sb(sandbox_id, "/files/stat"), params=params)


def call_mkdir(sandbox_id: str, path: str, parents: bool, mode: int, user: str | None) -> Call:
    params: dict[str, Any] = {"path": path, "parents": str(parents).lower(), "mode": mode}
    if user:
        params["user"] = user
    return Call("POST", _sb(sandbox_id, "/files/mkdir"), params=params)


def call_remove(sandbox_id: str, path: str, recursive: bool) -> Call:
    return Call("DELETE", _sb(sandbox_id, "/files"), params={"path": path, "recursive": str(recursive).lower()})


def call_upload(sandbox_id: str, path: str, data: bytes, user: str | None) -> Call:
    params: dict[str, Any] = {"path": path}
    if user:
        params["user"] = user
    return Call(
        "PUT", _sb(sandbox_id, "/files/tar"), params=params, content=data, headers={"content-type": "application/x-tar"}
    )


def call_download(sandbox_id: str, path: str) -> Call:
    return Call("GET", _sb(sandbox_id, "/files/tar"), params={"path": path})


def call_watch(sandbox_id: str, path: str, recursive: bool) -> Call:
    """A stream with no end of its own (None): it lasts until the caller stops reading."""
    params = {"path": path, "recursive": str(recursive).lower()}
    return Call("GET", _sb(sandbox_id, "/files/watch"), params=params, timeout=None)
