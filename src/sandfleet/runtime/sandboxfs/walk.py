"""Bounded, race-checked walks of a sandbox tree by directory fds (`_Walk`), and the recursive remove built on one."""

from __future__ import annotations

import ctypes
import errno
import os
import stat as stat_mod
from array import array
from typing import TYPE_CHECKING

from sandfleet.runtime.openat2 import _syscall, openat2
from sandfleet.runtime.sandboxfs.paths import _STRICT, _UP, _join, _show
from sandfleet.runtime.sandboxfs.results import FileOpError, FileTooLargeError, _close, _from_oserror, _mount_refused
from sandfleet.runtime.sandboxfs.syscalls import _DIRENT, _GETDENTS64, _statx

if TYPE_CHECKING:
    from sandfleet.runtime.sandboxfs.syscalls import _St

#: Entries one tree walk may visit (a sandbox that keeps creating files cannot keep a walk going).
DEFAULT_MAX_ENTRIES = 1 << 24
# Directory fds a walk keeps open below its top (then the top, plus one or two transient fds).
_FD_WINDOW = 8
_DENTS_BUF = 32 << 10


class _Frame:
    """An open directory of a walk and what is left of its last getdents64 buffer."""

    __slots__ = ("fd", "level", "buf", "pos", "skip", "done")

    def __init__(self, fd: int, level: int) -> None:
        self.fd = fd
        self.level = level
        self.buf = b""
        self.pos = 0
        self.skip = 0  # os.listdir fallback: entries already consumed
        self.done = False  # os.listdir fallback: listing handed out


class _Walk:
    """Depth-first walk below a directory fd (``top_fd``, borrowed) with bounded fds and memory.

    ``next_name()`` gives the entries of the current directory one by one (``None`` at its end),
    ``descend(name)`` enters a subdirectory, ``ascend()`` goes back to the parent. The top's fd
    and those of the ``_FD_WINDOW`` deepest levels are kept open; per level the walk keeps only
    the name (in ``rel``), the inode number and the directory offset where its listing resumes.
    A directory whose fd was closed is reopened as ``..`` of its child and identified by
    (st_dev, st_ino); any mismatch stops the walk with ``changed``. Subdirectories are opened
    with ``_STRICT`` (no symlink, no other mount) and checked to be on the top's mount.
    """

    def __init__(self, top_fd: int, top_path: str, *, max_entries: int) -> None:
        st = _statx(top_fd, b"")
        self.top_path = top_path
        self.dev = st.dev
        self.mnt_id = st.mnt_id
        self.max_entries = max_entries
        self.entries = 0
        self.frames = [_Frame(top_fd, 0)]  # the top, then the deepest levels (contiguous)
        self.rel = bytearray()  # the current directory below the top: b"a/b/c"
        self.lens = array("B")  # name length of each level below the top
        self.inos = array("Q", [st.ino])  # inode number of each level, the top first
        self.cookies = array("q", [0])  # d_off of the last entry taken at each level
        self._dbuf = ctypes.create_string_buffer(_DENTS_BUF) if _GETDENTS64 is not None else None
        self._seek(self.frames[0], 0)

    @property
    def depth(self) -> int:
        return len(self.inos) - 1

    @property
    def fd(self) -> int:
        """An fd of the current directory (valid until the next descend/ascend)."""
        return self.frames[-1].fd

    def arc(self, name: bytes) -> bytes:
        """``name`` in the current directory, relative to the top (b"a/b/name")."""
        return bytes(self.rel) + b"/" + name if self.rel else name

    def spath(self, name: bytes | None = None) -> str:
        """Sandbox path of the current directory or of ``name`` in it (shortened if very long)."""
        rel = bytes(self.rel) if name is None else self.arc(name)
        return _show(_join(self.top_path, os.fsdecode(rel)) if rel else self.top_path)

    def stat(self, name: bytes) -> _St | None:
        """statx of ``name`` in the current directory (not followed); None if it is gone meanwhile."""
        try:
            return _statx(self.fd, name)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _from_oserror(exc, self.spath(name)) from exc

    def is_mount(self, st: _St) -> bool:
        """Whether an entry of a directory of this walk is a mount point (in the sandbox's namespace)."""
        if st.mount_root or (self.mnt_id and st.mnt_id and st.mnt_id != self.mnt_id):
            return True
        return stat_mod.S_ISDIR(st.mode) and st.dev != self.dev

    def next_name(self) -> bytes | None:
        fr = self.frames[-1]
        while True:
            if fr.pos >= len(fr.buf):
                fr.buf, fr.pos = self._read(fr), 0
                if not fr.buf:
                    return None
            _ino, off, reclen, _type = _DIRENT.unpack_from(fr.buf, fr.pos)
            start = fr.pos + _DIRENT.size
            name = fr.buf[start : fr.buf.index(b"\0", start, fr.pos + reclen)]
            fr.pos += reclen
            self.cookies[-1] = off
            if name == b"." or name == b"..":
                continue
            self.entries += 1
            if self.entries > self.max_entries:
                raise FileTooLargeError(
                    _show(self.top_path), f"more than {self.max_entries} entries walked (a huge or changing tree)"
                )
            return name

    def descend(self, name: bytes) -> None:
        """Enter directory ``name`` of the current directory; OSError (EXDEV, ELOOP, ENOTDIR, ENOENT...)
        if it is not a plain directory on this walk's mount."""
        fd = openat2(self.fd, name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, 0, _STRICT)
        try:
            st = _statx(fd, b"")
            if self.is_mount(st):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(name))
        except BaseException:
            _close(fd)
            raise
        if self.rel:
            self.rel += b"/"
        self.rel += name
        self.lens.append(len(name))
        self.inos.append(st.ino)
        self.cookies.append(0)
        self.frames.append(_Frame(fd, self.depth))
        if len(self.frames) > _FD_WINDOW + 1:
            _close(self.frames.pop(1).fd)  # its listing resumes from its cookie when we come back

    def ascend(self) -> tuple[bytes, int]:
        """Go back to the parent of the current directory; returns (its name, its inode number)."""
        level = self.depth - 1
        pino = self.inos[level]
        child = self.frames.pop()
        try:
            if self.frames[-1].level == level:  # parent still open: the child must still sit in it
                st = _statx(child.fd, b"..")
                if st.ino != pino or st.dev != self.dev:
                    raise self._changed()
            else:  # reopen the parent as the child's "..", and check it is the one we came from
                pfd = openat2(child.fd, "..", os.O_RDONLY | os.O_DIRECTORY, 0, _UP)
                try:
                    st = _statx(pfd, b"")
                    if st.ino != pino or st.dev != self.dev or self.is_mount(st):
                        raise self._changed()
                    fr = _Frame(pfd, level)
                    self._seek(fr, self.cookies[level])
                except BaseException:
                    _close(pfd)
                    raise
                self.frames.append(fr)
        except OSError as exc:
            raise self._changed() from exc
        finally:
            _close(child.fd)
        n = self.lens.pop()
        name = bytes(self.rel[len(self.rel) - n :])
        del self.rel[max(0, len(self.rel) - n - 1) :]
        ino = self.inos.pop()
        self.cookies.pop()
        return name, ino

    def close(self) -> None:
        for fr in self.frames[1:]:
            _close(fr.fd)
        del self.frames[1:]

    def _changed(self) -> FileOpError:
        return FileOpError(
            "changed", self.spath(), "was moved or replaced by the sandbox during the operation; stopped there"
        )

    def _seek(self, fr: _Frame, cookie: int) -> None:
        fr.buf, fr.pos = b"", 0
        if self._dbuf is None:
            fr.skip, fr.done = cookie, False
        else:
            os.lseek(fr.fd, cookie, os.SEEK_SET)

    def _read(self, fr: _Frame) -> bytes:
        buf, nr = self._dbuf, _GETDENTS64
        if buf is None or nr is None:  # no getdents64 here: hand out the whole listing once, in the same format
            if fr.done:
                return b""
            fr.done = True
            out = bytearray()
            names = os.listdir(fr.fd)
            for i in range(fr.skip, len(names)):
                raw = os.fsencode(names[i])
                out += _DIRENT.pack(0, i + 1, _DIRENT.size + len(raw) + 1, 0) + raw + b"\0"
            return bytes(out)
        while True:
            n = _syscall(ctypes.c_long(nr), ctypes.c_int(fr.fd), buf, ctypes.c_size_t(_DENTS_BUF))
            if n >= 0:
                return ctypes.string_at(buf, n)
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise _from_oserror(OSError(err, os.strerror(err)), self.spath())


def _rmtree_fd(top_fd: int, top_path: str, *, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
    """Empty the directory ``top_fd`` (borrowed; its file offset is used) without following
    symlinks and without removing or entering any mount point (``permission_denied`` /
    ``crosses_mount``; what was removed before stays removed).

    Iterative with a bounded number of fds (see :class:`_Walk`). Entries that appear while a
    directory is being emptied are picked up by going through it again; a sandbox that keeps
    creating them meets ``max_entries``.
    """
    w = _Walk(top_fd, top_path, max_entries=max_entries)
    redo = -1  # w.entries when a directory was last gone through again
    try:
        while True:
            name = w.next_name()
            if name is None:
                if w.depth == 0:
                    return
                cname, ino = w.ascend()
                try:
                    st: _St | None = _statx(w.fd, cname)
                except FileNotFoundError:
                    st = None
                if st is None or st.ino != ino or not stat_mod.S_ISDIR(st.mode):
                    raise FileOpError(
                        "changed", w.spath(cname), "was moved or replaced by the sandbox while being removed"
                    )
                try:
                    os.rmdir(cname, dir_fd=w.fd)
                except OSError as exc:
                    if exc.errno != errno.ENOTEMPTY or redo == w.entries:
                        raise _from_oserror(exc, w.spath(cname)) from exc
                    redo = w.entries  # entries appeared meanwhile: go through it again
                    try:
                        w.descend(cname)
                    except OSError as exc2:
                        raise _from_oserror(exc2, w.spath(cname)) from exc2
                continue
            if (st := w.stat(name)) is None:
                continue
            if w.is_mount(st):
                raise _mount_refused(w.spath(name))
            if stat_mod.S_ISDIR(st.mode):
                try:
                    w.descend(name)
                except OSError as exc:
                    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                        continue  # gone or swapped for a file/symlink: the parent's rmdir sends us back
                    raise _from_oserror(exc, w.spath(name)) from exc
            else:
                try:
                    os.unlink(name, dir_fd=w.fd)
                except (FileNotFoundError, IsADirectoryError):
                    pass  # gone, or swapped for a directory: the parent's rmdir sends us through again
                except OSError as exc:
                    raise _from_oserror(exc, w.spath(name)) from exc
    finally:
        w.close()


__all__ = ["DEFAULT_MAX_ENTRIES"]
