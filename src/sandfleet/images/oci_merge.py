"""Merging staged layer trees into one, and readying a staged tree to be packed."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from . import fsutil
from .oci_archive import _DIR_FLAGS
from .oci_unpack import OPAQUE_XATTR, _is_opaque, _is_whiteout, _lstat_at, _remove_at, _set_opaque


def _merge_into(upper: Path, lower: Path) -> None:
    """Stack the staged layer ``upper`` onto the staged layer ``lower``, in place in ``lower``.

    The result is one layer equivalent to the two: upper's entries replace lower's (moved by
    rename, so hard links survive); a whiteout replaces the lower entry and stays, as it may hide
    something beneath both; an opaque upper dir empties the lower one and stays opaque; an upper
    dir replacing a lower non-dir or whiteout becomes opaque, since what it replaced hid whatever
    lies below at that path. Dirs present in both merge; upper's metadata wins.
    """
    ufd = os.open(upper, _DIR_FLAGS)
    try:
        lfd = os.open(lower, _DIR_FLAGS)
        try:
            _merge_dir(ufd, lfd)
        finally:
            os.close(lfd)
    finally:
        os.close(ufd)
    fsutil.rmtree(upper)  # only the shells of merged dirs are left


def _merge_dir(ufd: int, lfd: int) -> None:
    if _is_opaque(ufd):
        for name in os.listdir(lfd):
            _remove_at(lfd, name, os.lstat(name, dir_fd=lfd))
    st = os.fstat(ufd)
    os.fchown(lfd, st.st_uid, st.st_gid)
    os.fchmod(lfd, stat.S_IMODE(st.st_mode))
    keys = os.listxattr(ufd)
    for key in os.listxattr(lfd):
        if key not in keys and key != OPAQUE_XATTR:  # lower's opaque marker still hides what is below
            os.removexattr(lfd, key)
    for key in keys:
        os.setxattr(lfd, key, os.getxattr(ufd, key))
    for name in os.listdir(ufd):
        ust = os.lstat(name, dir_fd=ufd)
        lst = _lstat_at(lfd, name)
        if stat.S_ISDIR(ust.st_mode) and lst is not None and stat.S_ISDIR(lst.st_mode):
            usub = os.open(name, _DIR_FLAGS, dir_fd=ufd)
            try:
                lsub = os.open(name, _DIR_FLAGS, dir_fd=lfd)
                try:
                    _merge_dir(usub, lsub)
                finally:
                    os.close(lsub)
            finally:
                os.close(usub)
            continue
        if lst is not None:
            _remove_at(lfd, name, lst)
        os.rename(name, name, src_dir_fd=ufd, dst_dir_fd=lfd)
        if stat.S_ISDIR(ust.st_mode) and lst is not None:
            moved = os.open(name, _DIR_FLAGS, dir_fd=lfd)
            try:
                _set_opaque(moved)
            finally:
                os.close(moved)


def _walk_dirs(root: Path) -> Iterator[tuple[str, int]]:
    """Yield (relative path, fd) of ``root`` and every dir below it, parents first. Unlike os.fwalk,
    never stats or opens a symlink's target (staged symlinks may point anywhere on the host)."""
    fds, rels = [os.open(root, _DIR_FLAGS)], [""]
    try:
        yield "", fds[0]
        pending = [_subdirs(fds[0])]
        while pending:
            if not pending[-1]:
                pending.pop()
                rels.pop()
                os.close(fds.pop())
                continue
            name = pending[-1].pop()
            fds.append(os.open(name, _DIR_FLAGS, dir_fd=fds[-1]))
            rels.append(f"{rels[-1]}/{name}" if rels[-1] else name)
            yield rels[-1], fds[-1]
            pending.append(_subdirs(fds[-1]))
    finally:
        for fd in fds:
            os.close(fd)


def _subdirs(fd: int) -> list[str]:
    with os.scandir(fd) as entries:
        return [e.name for e in entries if e.is_dir(follow_symlinks=False)]


def _strip_overlay_markers(root: Path) -> None:
    """Drop whiteouts and opaque markers from the bottom layer: there is nothing below it to hide,
    and mounted on its own (``builders.mounted_layers`` of a one-layer image) its whiteouts
    would show up as character devices."""
    for _rel, fd in _walk_dirs(root):
        if _is_opaque(fd):
            os.removexattr(fd, OPAQUE_XATTR)
        with os.scandir(fd) as entries:
            whiteouts = [e.name for e in entries if _is_whiteout(e.stat(follow_symlinks=False))]
        for name in whiteouts:
            os.unlink(name, dir_fd=fd)


def _restore_dir_times(root: Path, times: dict[str, int]) -> None:
    """Set dir mtimes (from the topmost layer that has each dir) now that nothing is added below them."""
    for rel, fd in _walk_dirs(root):
        t = times.get(rel)
        if t is not None:
            os.utime(fd, ns=(t, t))
