"""Files of a sandbox: listings and watch events."""

from __future__ import annotations

from typing import Literal

from sandfleet.models.common import _Model, shown

# A write's extended attributes (`xattrs`, of the `user.` namespace, named without it): the kernel
# allows 255-byte names and 64 KiB values; these travel in a URL (their JSON at most 2,048 characters).
MAX_XATTR_NAME = 200
MAX_XATTR_VALUE = 1024
MAX_XATTRS = 32


def check_xattrs(attrs: dict[str, str]) -> dict[str, str]:
    if len(attrs) > MAX_XATTRS:
        raise ValueError(f"at most {MAX_XATTRS} extended attributes")
    for name, value in attrs.items():
        raw = name.encode("utf-8", "surrogateescape")
        if not raw or len(raw) > MAX_XATTR_NAME or b"\0" in raw:
            raise ValueError(f"an extended attribute's name is 1 to {MAX_XATTR_NAME} bytes, no NUL: {shown(name)}")
        if len(value.encode("utf-8", "surrogateescape")) > MAX_XATTR_VALUE:
            raise ValueError(f"the value of extended attribute {shown(name)} is longer than {MAX_XATTR_VALUE} bytes")
    return attrs


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
    # its extended attributes of the `user.` namespace, named without `user.` (text values only)
    xattrs: dict[str, str] | None = None


class FileList(_Model):
    files: list[FileInfo]
