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
# What is reported of one file (a sandbox sets what it likes on its own files: a listing must not
# carry it all into the daemon): at most READ_COUNT attributes, a value longer than READ_VALUE left
# out, and at most Budget's bytes over a whole listing (later entries report none).
READ_COUNT = 64
READ_VALUE = 4096
# A filesystem without user attributes, or none of them on this file; more names than one list
# call returns (E2BIG, ERANGE): reported as none rather than failing the stat or the listing.
_ABSENT = (errno.ENOTSUP, errno.ENODATA)
_TOO_MANY = (errno.E2BIG, errno.ERANGE)


class Budget:
    """Bytes of attributes one listing may report."""

    def __init__(self, total: int = 1 << 20) -> None:
        self.left = total


def read(fd: int, budget: Budget | None = None) -> dict[str, str] | None:
    """The `user.` attributes of the file `fd` refers to (None when it has none). `fd` may be an
    O_PATH descriptor: the calls go through its /proc link, which names exactly that file (the
    f*xattr calls refuse O_PATH). Names or values that are not UTF-8 text are left out."""
    return _read(f"/proc/self/fd/{fd}", True, budget)


def read_at(dir_fd: int, name: str, st_mode: int, budget: Budget | None = None) -> dict[str, str] | None:
    """`read` of entry `name` (one component) of directory `dir_fd`, never following a symlink:
    through the directory's /proc link, one call per entry and no descriptor of its own."""
    if not (stat.S_ISREG(st_mode) or stat.S_ISDIR(st_mode)):
        return None
    return _read(f"/proc/self/fd/{dir_fd}/{name}", False, budget)


def _read(link: str, follow: bool, budget: Budget | None) -> dict[str, str] | None:
    if budget is not None and budget.left <= 0:
        return None
    try:
        names = os.listxattr(link, follow_symlinks=follow)
    except FileNotFoundError:
        return None  # removed meanwhile
    except OSError as exc:
        if exc.errno in _ABSENT or exc.errno in _TOO_MANY:
            return None
        raise
    out: dict[str, str] = {}
    for name in names:
        if not name.startswith(PREFIX) or not _text(name):
            continue
        try:
            value = os.getxattr(link, name, follow_symlinks=follow)
        except OSError as exc:
            if exc.errno in _ABSENT or exc.errno in _TOO_MANY:
                continue  # removed meanwhile
            raise
        if len(value) > READ_VALUE:
            continue
        try:
            out[name[len(PREFIX) :]] = value.decode()
        except UnicodeDecodeError:
            continue
        if budget is not None:
            budget.left -= len(name) + len(value)
        if len(out) >= READ_COUNT or (budget is not None and budget.left <= 0):
            break
    return out or None


def _text(name: str) -> bool:
    try:
        name.encode("utf-8")  # os.listxattr's surrogate escapes: bytes that are not UTF-8
    except UnicodeEncodeError:
        return False
    return True


def replace(fd: int, attrs: dict[str, str], scope: str = "") -> None:
    """Make `attrs` the attributes of the open file `fd` under `user.<scope>`: the others there are
    removed, those outside the scope kept (every name of `attrs` is in it)."""
    wanted = {PREFIX + name: value.encode("utf-8", "surrogateescape") for name, value in attrs.items()}
    try:
        present = [n for n in os.listxattr(fd) if n.startswith(PREFIX + scope)]
    except OSError as exc:
        if exc.errno not in _ABSENT:
            raise  # E2BIG: too many to know which to remove (a typed error, not a half-done write)
        present = []
    for name in present:
        if name not in wanted:
            try:
                os.removexattr(fd, name)
            except OSError as exc:
                if exc.errno != errno.ENODATA:
                    raise
    for name, value in wanted.items():
        os.setxattr(fd, name, value)
