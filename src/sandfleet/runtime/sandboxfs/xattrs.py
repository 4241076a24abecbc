"""A file's extended attributes of the `user.` namespace: metadata a caller keeps on a file, as
text (E2B's SDK keeps its file metadata there, as `user.e2b.*`).

Names are given and reported without the `user.` prefix. Only regular files and directories carry
them (the kernel refuses `user.` attributes on anything else); a value that is not UTF-8 text is
left out of what is reported, never altered.
"""

from __future__ import annotations

import errno
import os
import stat

PREFIX = "user."
# A filesystem without user attributes, or none of them on this file.
_ABSENT = (errno.ENOTSUP, errno.ENODATA)


def read(fd: int) -> dict[str, str] | None:
    """The `user.` attributes of the file `fd` refers to (None when it has none). `fd` may be an
    O_PATH descriptor: the calls go through its /proc link, which names exactly that file (the
    f*xattr calls refuse O_PATH)."""
    link = f"/proc/self/fd/{fd}"
    try:
        names = os.listxattr(link)
    except OSError as exc:
        if exc.errno in _ABSENT:
            return None
        raise
    out: dict[str, str] = {}
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            value = os.getxattr(link, name)
        except OSError as exc:
            if exc.errno in _ABSENT:
                continue  # removed meanwhile
            raise
        try:
            out[name[len(PREFIX) :]] = value.decode()
        except UnicodeDecodeError:
            continue
    return out or None


def read_at(dir_fd: int, name: str, st_mode: int) -> dict[str, str] | None:
    """`read` of entry `name` of directory `dir_fd` (never following a symlink)."""
    if not (stat.S_ISREG(st_mode) or stat.S_ISDIR(st_mode)):
        return None
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None  # removed meanwhile
    try:
        return read(fd)
    finally:
        os.close(fd)


def replace(fd: int, attrs: dict[str, str]) -> None:
    """Make `attrs` the `user.` attributes of the open file `fd`: the others are removed."""
    try:
        present = [n for n in os.listxattr(fd) if n.startswith(PREFIX)]
    except OSError as exc:
        if exc.errno not in _ABSENT:
            raise
        present = []
    wanted = {PREFIX + name: value.encode("utf-8", "surrogateescape") for name, value in attrs.items()}
    for name in present:
        if name not in wanted:
            try:
                os.removexattr(fd, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
    for name, value in wanted.items():
        os.setxattr(fd, name, value)
