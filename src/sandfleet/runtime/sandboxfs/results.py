"""What sandbox file operations return (`FileStat`) and how they fail (`FileOpError`, by errno)."""

from __future__ import annotations

import errno
import os
import stat as stat_mod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

FileOpKind = Literal[
    "not_found",
    "exists",
    "not_a_directory",
    "is_a_directory",
    "permission_denied",
    "crosses_mount",
    "invalid_path",
    "too_large",
    "no_space",
    "changed",
    "io_error",
]
_ERRNO_KIND: dict[int, tuple[FileOpKind, str]] = {
    errno.ENOENT: ("not_found", "no such file or directory"),
    errno.EEXIST: ("exists", "already exists"),
    errno.ENOTEMPTY: ("exists", "directory not empty"),
    errno.ENOTDIR: ("not_a_directory", "a path component is not a directory"),
    errno.EISDIR: ("is_a_directory", "is a directory"),
    errno.EACCES: ("permission_denied", "permission denied"),
    errno.EPERM: ("permission_denied", "operation not permitted"),
    errno.EROFS: ("permission_denied", "read-only file system"),
    errno.EXDEV: ("crosses_mount", "path crosses a mount point (e.g. /proc, /dev, /sys or a bind mount)"),
    errno.EBUSY: ("crosses_mount", "path is a mount point or busy"),
    errno.ELOOP: ("invalid_path", "too many levels of symlinks, or a refused (magic) symlink"),
    errno.ENOSPC: ("no_space", "no space left on device"),
    errno.EDQUOT: ("no_space", "disk quota exceeded"),
    errno.ENAMETOOLONG: ("invalid_path", "file name too long"),
    errno.EINVAL: ("invalid_path", "invalid argument"),
    errno.E2BIG: ("too_large", "the file carries more extended attributes than can be listed"),
}


class FileOpError(Exception):
    """A file operation inside a sandbox failed.

    ``kind`` is one of :data:`FileOpKind` ("io_error" is the catch-all for errnos that have
    no better mapping; "changed": a directory was renamed or replaced by the sandbox while a
    walk was in it, and the walk stopped); ``path`` is the sandbox path; ``errno`` the
    underlying errno if any.
    """

    def __init__(self, kind: FileOpKind, path: str, message: str, *, err: int | None = None) -> None:
        super().__init__(f"{path}: {message}")
        self.kind: FileOpKind = kind
        self.path = path
        self.errno = err


class FileTooLargeError(FileOpError):
    def __init__(self, path: str, message: str) -> None:
        super().__init__("too_large", path, message)


def _from_oserror(exc: OSError, path: str) -> FileOpError:
    err = exc.errno if exc.errno is not None else 0
    kind, msg = _ERRNO_KIND.get(err, ("io_error", exc.strerror or str(exc)))
    return FileOpError(kind, path, msg, err=err)


@contextmanager
def _translate(path: str) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise _from_oserror(exc, path) from exc


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _mount_refused(path: str, inside: str | None = None) -> FileOpError:
    if inside is None:
        return FileOpError(
            "permission_denied", path, "is a mount point of the sandbox; it cannot be removed or replaced"
        )
    return FileOpError(
        "permission_denied", path, f"contains a mount point of the sandbox ({inside}); it cannot be removed"
    )


FileKind = Literal["file", "dir", "symlink", "other"]


@dataclass(frozen=True)
class FileStat:
    path: str
    name: str
    type: FileKind
    size: int
    mode: int  # permission bits only (S_IMODE)
    uid: int  # as seen inside the sandbox
    gid: int
    mtime: float
    link_target: str | None = None
    xattrs: dict[str, str] | None = None  # its `user.` attributes (sandboxfs/xattrs.py)


def _kind(st_mode: int) -> FileKind:
    if stat_mod.S_ISREG(st_mode):
        return "file"
    if stat_mod.S_ISDIR(st_mode):
        return "dir"
    if stat_mod.S_ISLNK(st_mode):
        return "symlink"
    return "other"


__all__ = ["FileKind", "FileOpError", "FileOpKind", "FileStat", "FileTooLargeError"]
