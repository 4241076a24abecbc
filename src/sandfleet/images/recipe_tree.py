"""Copying a tree into a staging dir and hashing it, safely: no symlink followed, ownership and modes normalised."""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
from pathlib import Path

from .recipe import RecipeError


def _excluded(rel: str, name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(rel, p) for p in patterns)


# Every open of a copy step's source refuses symlinks and, below the top, is relative to an open
# directory. O_NONBLOCK: a FIFO swapped in for a file must not hang the build (fstat rejects it).
_O_SRC = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_O_SRC_DIR = _O_SRC | os.O_DIRECTORY
_O_DEST = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1024**2


def _copy_tree(fd: int, out: Path | None, exclude: list[str]) -> tuple[int, str]:
    """Hash the file or tree open at ``fd`` and, unless ``out`` is None, copy it to ``out``;
    return (entries, content hash). Blocking; ``fd`` stays the caller's.

    The walk never follows a symlink (symlinks are copied as links), so renaming or replacing
    things in the source meanwhile cannot make it read outside the tree; and the hash is of
    exactly the bytes and modes written, so an edit during the copy cannot end up in a layer
    cached under the previous content's key.

    The hash covers names, types, permission bits, file contents and link targets, in sorted
    order. Owners and mtimes are left out on purpose: the layer makes everything root's, and a
    fresh checkout or `touch` should not invalidate the cache when nothing actually changed.
    """
    h = hashlib.sha256()
    count = 0
    dir_times: list[tuple[Path, os.stat_result]] = []

    def record(rel: str, st: os.stat_result, payload: bytes) -> None:
        nonlocal count
        count += 1
        h.update(f"{rel}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode):o}\0".encode(errors="surrogateescape"))
        h.update(payload + b"\n")

    def copy_file(src_fd: int, rel: str, st: os.stat_result) -> None:
        fh = hashlib.sha256()
        dst = None if out is None else os.open(out / rel if rel else out, _O_DEST, 0o600)
        try:
            while chunk := os.read(src_fd, _COPY_CHUNK):
                fh.update(chunk)
                view = memoryview(chunk)
                while dst is not None and view:
                    view = view[os.write(dst, view) :]
            if dst is not None:
                os.fchmod(dst, stat.S_IMODE(st.st_mode))
                os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            if dst is not None:
                os.close(dst)
        record(rel, st, fh.digest())

    def entry(entry_fd: int, rel: str) -> None:
        # The type and mode of what was opened, not of an earlier lstat: that is what is copied.
        st = os.fstat(entry_fd)
        if stat.S_ISREG(st.st_mode):
            copy_file(entry_fd, rel, st)
            return
        if not stat.S_ISDIR(st.st_mode):
            raise RecipeError(f"{rel or 'the source'}: only files, directories and symlinks can be copied")
        record(rel, st, b"")
        if out is not None:
            d = out / rel if rel else out
            d.mkdir(exist_ok=not rel)  # the top may be the staging root itself (dest = "/")
            os.chmod(d, stat.S_IMODE(st.st_mode))
            dir_times.append((d, st))
        for name in sorted(os.listdir(entry_fd)):
            r = f"{rel}/{name}" if rel else name
            if _excluded(r, name, exclude):
                continue
            lst = os.stat(name, dir_fd=entry_fd, follow_symlinks=False)
            if stat.S_ISLNK(lst.st_mode):
                target = os.readlink(name, dir_fd=entry_fd)
                if out is not None:
                    os.symlink(target, out / r)
                record(r, lst, os.fsencode(target))
            elif stat.S_ISDIR(lst.st_mode) or stat.S_ISREG(lst.st_mode):
                child = os.open(name, _O_SRC_DIR if stat.S_ISDIR(lst.st_mode) else _O_SRC, dir_fd=entry_fd)
                try:
                    entry(child, r)
                finally:
                    os.close(child)
            else:
                raise RecipeError(f"{r}: only files, directories and symlinks can be copied")

    entry(fd, "")
    for d, st in reversed(dir_times):  # children are in place: restore the dirs' mtimes last
        os.utime(d, ns=(st.st_atime_ns, st.st_mtime_ns))
    return count, h.hexdigest()


def hash_tree(src: Path, exclude: list[str]) -> str:
    """Content hash of the file or directory ``src`` (not a symlink), as a copy step keys it."""
    fd = os.open(src, _O_SRC)
    try:
        return _copy_tree(fd, None, exclude)[1]
    finally:
        os.close(fd)


def _open_source(base_dir: Path, src: str) -> int:
    """An fd of the copy source ``base_dir/src`` (symlinks resolved), which must be in ``base_dir``.

    A recipe may come from someone else: it must not bake the builder's files (``/root/.ssh``,
    ``../../etc``, a symlink to them) into an image. The real path is checked again on the open
    fd, so replacing a directory on the way by a symlink after the first check gains nothing.
    """
    base = os.path.realpath(base_dir)

    def inside(path: str) -> bool:
        return path == base or path.startswith(base.rstrip("/") + "/")

    real = os.path.realpath(base_dir / src)
    if not inside(real):
        raise RecipeError(f"source {src!r} is {real}, outside the recipe's directory {base}")
    try:
        fd = os.open(real, _O_SRC)
    except FileNotFoundError:
        raise RecipeError(f"source {real} does not exist") from None
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
        if not inside(opened):
            raise RecipeError(f"source {src!r} is {opened}, outside the recipe's directory {base}")
    except BaseException:
        os.close(fd)
        raise
    return fd


# Modes for directories a step creates as parents of its dest. In overlayfs the topmost layer's
# directory metadata wins, and copy/git layers cannot look at the stack below, so use what the
# FHS says these directories are instead of a blanket 0755 (which would un-sticky /tmp).
_STANDARD_DIR_MODES = {"tmp": 0o1777, "var/tmp": 0o1777, "root": 0o700}


def _make_parents(root: Path, dest_rel: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    parts = [p for p in dest_rel.split("/") if p][:-1]
    for n in range(1, len(parts) + 1):
        rel = "/".join(parts[:n])
        d = root / rel
        d.mkdir(exist_ok=True)
        os.chmod(d, _STANDARD_DIR_MODES.get(rel, 0o755))


def _own_by_root(root: Path) -> None:
    """lchown everything to 0:0 (root inside, once shifted), keeping setuid bits chown clears."""
    paths = [str(root)]
    for dirpath, dirnames, filenames in os.walk(root):
        paths += [os.path.join(dirpath, n) for n in (*dirnames, *filenames)]
    for path in paths:
        st = os.lstat(path)
        os.lchown(path, 0, 0)
        if not stat.S_ISLNK(st.st_mode) and st.st_mode & (stat.S_ISUID | stat.S_ISGID):
            os.chmod(path, stat.S_IMODE(st.st_mode))


def _normalize_checkout_modes(root: Path) -> None:
    """Git records only "executable or not"; the checkout's modes come from this process's
    umask. Make them what git means (0755 / 0644), so a umask of 077 on the build host does not
    leave files only root can read in the image."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, 0o755 if st.st_mode & 0o111 else 0o644)


def stage_copy(base_dir: Path, src: str, staging: Path, dest: str, exclude: list[str]) -> tuple[int, str]:
    """Lay out ``base_dir/src`` at ``staging/dest`` (blocking); return the number of entries
    copied and the content hash of what was copied (see ``_copy_tree``)."""
    dest_rel = dest.lstrip("/")
    fd = _open_source(base_dir, src)
    try:
        if not dest_rel and not stat.S_ISDIR(os.fstat(fd).st_mode):
            raise RecipeError(f"{src} is a file: dest must name the file, not /")
        _make_parents(staging, dest_rel)
        n, digest = _copy_tree(fd, staging / dest_rel, exclude)
    finally:
        os.close(fd)
    if not dest_rel:
        os.chmod(staging, 0o755)  # the image's / keeps standard metadata whatever src's is
    _own_by_root(staging)  # lchown and chmod leave the mtimes _copy_tree restored alone
    return n, digest


def _resolve_in_root(root: Path, rel: str, hops: int = 16) -> Path | None:
    """``root/rel`` with symlinks resolved inside ``root`` (an absolute link target is relative to
    the image's /, not the host's); None if it does not exist."""
    parts = [p for p in rel.split("/") if p]
    cur: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if cur:
                cur.pop()
            continue
        p = root.joinpath(*cur, part)
        if p.is_symlink():
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(p)
            if target.startswith("/"):
                cur = []
            parts = [x for x in target.split("/") if x] + parts
            continue
        cur.append(part)
    path = root.joinpath(*cur)
    return path if path.exists() or path.is_symlink() else None


__all__ = ["hash_tree"]
