# Generated from client/aio/_files.py by scripts/gen_sync_client.py: do not edit.
"""`Files`: file operations inside a sandbox (`sb.files`)."""

from __future__ import annotations

import builtins
import os
from pathlib import Path
from typing import TYPE_CHECKING

from sandfleet.client import _base as b
from sandfleet.models import FileEvent, FileInfo, FileList

if TYPE_CHECKING:
    from sandfleet.client.sync._http import EventStream
    from sandfleet.client.sync._sandbox import Sandbox


class Files:
    """File operations inside the sandbox; paths are absolute, or relative to the sandbox's working
    directory."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def read(self, path: str, *, offset: int = 0, length: int | None = None) -> bytes:
        return self._sb._c._send(b.call_read(self._sb.id, path, offset, length))

    def read_text(self, path: str) -> str:
        return (self.read(path)).decode()

    def write(
        self,
        path: str,
        data: bytes | str,
        *,
        mode: int = 0o644,
        user: str | None = None,
        append: bool = False,
        xattrs: dict[str, str] | None = None,
        xattrs_scope: str = "",
    ) -> FileInfo:
        """`xattrs` given: they become the file's extended attributes of the `user.` namespace (named
        without `user.`) whose names start with `xattrs_scope` (default: all of them), the others
        there go; the container tier keeps them."""
        call = b.call_write(self._sb.id, path, b.as_bytes(data), mode, user, append, xattrs, xattrs_scope)
        return self._sb._c._model(FileInfo, call)

    def list(self, path: str = "/", *, xattrs: bool = False) -> builtins.list[FileInfo]:
        """The entries of directory `path`; `xattrs`: with each one's extended attributes (a
        syscall more per entry, so asked for)."""
        return (self._sb._c._model(FileList, b.call_list_files(self._sb.id, path, xattrs))).files

    def stat(self, path: str, *, follow_symlinks: bool = False) -> FileInfo:
        return self._sb._c._model(FileInfo, b.call_stat(self._sb.id, path, follow_symlinks))

    def exists(self, path: str) -> bool:
        from sandfleet.errors import NotFoundError

        try:
            self.stat(path)
        except NotFoundError:
            return False
        return True

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755, user: str | None = None) -> FileInfo:
        return self._sb._c._model(FileInfo, b.call_mkdir(self._sb.id, path, parents, mode, user))

    def remove(self, path: str, *, recursive: bool = False) -> None:
        self._sb._c._send(b.call_remove(self._sb.id, path, recursive))

    def upload(self, local: str | os.PathLike[str], path: str, *, user: str | None = None) -> None:
        """Copy a local file or directory's contents into the sandbox directory `path` (as a tar)."""
        data = b.local_tar(Path(local))
        self._sb._c._send(b.call_upload(self._sb.id, path, data, user))

    def download(self, path: str, local: str | os.PathLike[str]) -> None:
        """Copy a sandbox file or directory into the local directory `local`."""
        data = self.download_tar(path)
        b.extract_tar(data, Path(local))

    def download_tar(self, path: str) -> bytes:
        return self._sb._c._send(b.call_download(self._sb.id, path))

    def watch(self, path: str = ".", *, recursive: bool = True) -> EventStream[FileEvent]:
        """Changes under directory `path` as they happen: create, modify, delete, rename_from /
        rename_to, chmod, and `overflow` when the kernel dropped events (re-scan then). The watch is
        in place once `with sb.files.watch(path) as changes:` is entered (or at the first
        iteration), and lasts until it is left (or `close()`), which closes the stream. Heartbeats
        are swallowed; a daemon silent for the client's timeout raises `SandboxTimeoutError`."""
        return self._sb._c._events(b.call_watch(self._sb.id, path, recursive), b.file_event)
