"""Sandbox paths: lexical normalisation, how they are resolved (openat2 flag sets), tar member names, mount points."""

from __future__ import annotations

import os
import posixpath
import re

from sandfleet.runtime.openat2 import (
    RESOLVE_BENEATH,
    RESOLVE_IN_ROOT,
    RESOLVE_NO_MAGICLINKS,
    RESOLVE_NO_SYMLINKS,
    RESOLVE_NO_XDEV,
)
from sandfleet.runtime.sandboxfs.results import FileOpError

# Resolution of sandbox paths from the sandbox root.
_IN_ROOT = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
# One component below a directory fd we already trust: no symlinks, no mounts, no escape.
_STRICT = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
# ".." of a directory a walk is in (checked against the recorded parent afterwards).
_UP = RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_MAX_SYMLINK_HOPS = 40
#: Bytes of a tar member name at most (PATH_MAX without its NUL); deeper trees are refused.
MAX_MEMBER_NAME = 4095


def _norm(path: str, cwd: str | None = None) -> str:
    """Validate and normalise a user-supplied sandbox path ("/a//b/./c/" -> "/a/b/c").

    Absolute paths may not contain ``..``. A relative path is resolved against ``cwd`` (an
    absolute, normalised path; None: relative paths are refused), its ``..`` taken lexically
    and clamped at ``/``; symlinks are still resolved by the kernel, inside the root.
    """
    if not isinstance(path, str) or not path:
        raise FileOpError("invalid_path", repr(path), "path must be a non-empty string")
    if "\0" in path:
        raise FileOpError("invalid_path", repr(path), "path contains a NUL byte")
    if not path.startswith("/"):
        if cwd is None:
            raise FileOpError("invalid_path", path, "path must be absolute")
        stack = [p for p in cwd.split("/") if p]
        for comp in path.split("/"):
            if comp in ("", "."):
                continue
            if comp == "..":
                if stack:
                    stack.pop()
                continue
            stack.append(comp)
        return "/" + "/".join(stack)
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileOpError("invalid_path", path, "'..' components are not allowed")
    return "/" + "/".join(parts)


def _rel(path: str) -> str:
    """Normalised absolute sandbox path -> path for openat2 relative to the root fd."""
    return path.lstrip("/") or "."


def _split(path: str) -> tuple[str, str]:
    parent, name = posixpath.split(path)
    return parent, name


def _join(parent: str, name: str) -> str:
    return parent.rstrip("/") + "/" + name


def _show(path: str) -> str:
    """A path for an error message: very deep ones are shortened in the middle."""
    return path if len(path) <= 600 else f"{path[:280]}/.../{path[-280:]}"


def _member_parts(name: str) -> list[str]:
    """Validate a tar member / link name: relative, no '..', no NUL."""
    if "\0" in name:
        raise FileOpError("invalid_path", name, "tar member name contains a NUL byte")
    if name.startswith("/"):
        raise FileOpError("invalid_path", name, "absolute tar member names are not allowed")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise FileOpError("invalid_path", name, "'..' in tar member names is not allowed")
    return parts


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_points(mountinfo: str | bytes) -> frozenset[str]:
    """The mount points listed in a ``/proc/<pid>/mountinfo`` text (field 5), as absolute paths.

    Read from ``/proc/<agent>/mountinfo`` they are paths inside the sandbox (the kernel shows
    them relative to that process's root). The kernel's octal escapes (``\\040`` space,
    ``\\011`` tab, ``\\012`` newline, ``\\134`` backslash) are decoded; undecodable bytes are kept
    as surrogate escapes, as ``os.fsdecode`` does.
    """
    text = os.fsdecode(mountinfo) if isinstance(mountinfo, bytes) else mountinfo
    out: set[str] = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        raw = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        if not raw.startswith("/"):
            continue
        out.add(_canon(raw))
    return frozenset(out)


def _canon(path: str) -> str:
    """``/a//b/`` -> ``/a/b`` (no other normalisation: mount points are the kernel's paths)."""
    return "/" + "/".join(p for p in path.split("/") if p not in ("", "."))


__all__ = ["MAX_MEMBER_NAME", "mount_points"]
