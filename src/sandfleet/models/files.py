"""Files of a sandbox: listings and watch events."""

from __future__ import annotations

from typing import Literal

from sandfleet.models.common import _Model


class FileEvent(_Model):
    """One change under a watched directory (`GET .../files/watch`, a line each)."""

    type: Literal["create", "modify", "delete", "rename_from", "rename_to", "chmod", "overflow", "heartbeat"]
    path: str = ""
    is_dir: bool = False


class FileInfo(_Model):
    path: str
    name: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    link_target: str | None = None


class FileList(_Model):
    files: list[FileInfo]
