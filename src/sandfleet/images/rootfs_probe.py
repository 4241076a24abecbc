"""What a root filesystem holds, read without running it: Debian release and arch, Python and glibc versions."""

from __future__ import annotations

import os
import posixpath
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .recipe import _APT_PKG_RE, _SUITE_RE, RecipeError
from .recipe_tree import _resolve_in_root


@dataclass
class DebianInfo:
    suite: str
    packages: list[str]  # installed, as mmdebstrap --include names


def read_debian_info(root: Path, native_arch: str) -> DebianInfo | None:
    """Suite and installed packages of a mounted Debian root, or None if it is not Debian-based.

    The stack may come from an imported image or a run step, so its files are untrusted: they go
    into mmdebstrap's argv (the suite as an argument, the packages joined by commas into
    --include), and a suite like ``--setup-hook=...`` or a "package" ``/tmp/x.deb`` or ``a,b``
    would be obeyed there. Anything that is not a plain name raises RecipeError.
    """
    status = _resolve_in_root(root, "var/lib/dpkg/status")
    os_release = _resolve_in_root(root, "etc/os-release")
    if status is None or os_release is None:
        return None
    fields: dict[str, str] = {}
    for line in os_release.read_text(errors="replace").splitlines():
        k, sep, v = line.partition("=")
        if sep:
            fields[k.strip()] = v.strip().strip('"')
    ids = {fields.get("ID", ""), *fields.get("ID_LIKE", "").split()}
    suite = fields.get("VERSION_CODENAME", "")
    if "debian" not in ids or not suite:
        return None
    if not _SUITE_RE.fullmatch(suite):
        raise RecipeError(f"the stack's /etc/os-release has an invalid VERSION_CODENAME {suite!r}")
    packages = []
    for para in re.split(r"\n\s*\n", status.read_text(errors="replace")):
        info: dict[str, str] = {}
        for line in para.splitlines():
            if line[:1].isspace() or ":" not in line:
                continue
            k, _, v = line.partition(":")
            info[k] = v.strip()
        if info.get("Status", "").split()[-1:] != ["installed"] or "Package" not in info:
            continue
        arch = info.get("Architecture", "all")
        pkg = info["Package"] if arch in (native_arch, "all") else f"{info['Package']}:{arch}"
        # The user's packages pass the same check (_check_packages). Failing is better than
        # dropping the entry: the apt layer's dpkg database would silently forget the package.
        if not _APT_PKG_RE.fullmatch(pkg) or "=" in pkg:
            raise RecipeError(f"the stack's /var/lib/dpkg/status lists an invalid package {pkg!r}")
        packages.append(pkg)
    return DebianInfo(suite=suite, packages=sorted(set(packages)))


def drop_whiteouts(root: Path) -> int:
    """Remove whiteouts (0/0 char devices) from a layer dir; return how many (blocking).

    An apt step's full tree only knows what dpkg installed: files that copy/git/pip/run steps
    put in the stack are missing from it, and must not be deleted by the apt layer.
    """
    n = 0
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                os.unlink(p)
                n += 1
    return n


def python_version_in(root: Path) -> tuple[int, int] | None:
    """``(major, minor)`` of the image's ``python3``, read from the mounted stack, or None."""
    for cand in ("usr/local/bin/python3", "usr/bin/python3"):
        link = root / cand
        if not (link.exists() or link.is_symlink()):
            continue
        # python3 is normally a symlink to python3.N; follow the chain inside the image.
        name = cand
        for _ in range(8):
            p = root / name
            if not p.is_symlink():
                break
            target = os.readlink(p)
            name = target.lstrip("/") if target.startswith("/") else posixpath.join(posixpath.dirname(name), target)
        m = re.search(r"python(\d+)\.(\d+)$", name)
        if m:
            return int(m.group(1)), int(m.group(2))
        libs = sorted(root.glob("usr/lib/python3.*")) + sorted(root.glob("usr/local/lib/python3.*"))
        for lib in reversed(libs):
            m = re.fullmatch(r"python(\d+)\.(\d+)", lib.name)
            if m:
                return int(m.group(1)), int(m.group(2))
    return None


def glibc_version_in(root: Path) -> tuple[int, int] | None:
    """``(major, minor)`` of the glibc in a mounted stack (from its libc.so.6), or None."""
    cands = ["lib64/libc.so.6", "usr/lib64/libc.so.6", "lib/libc.so.6", "usr/lib/libc.so.6"]
    for libdir in ("usr/lib", "lib"):
        real = _resolve_in_root(root, libdir)  # inside the image, even through an absolute link
        if real is not None and real.is_dir():
            cands += sorted(f"{libdir}/{e.name}/libc.so.6" for e in os.scandir(real) if "-linux-gnu" in e.name)
    for cand in cands:
        path = _resolve_in_root(root, cand)
        if path is None or not path.is_file():
            continue
        with open(path, "rb") as f:
            head = f.read(64 * 1024**2)  # a libc is a few MB; the image's file may be anything
        m = re.search(rb"GNU C Library [^\n]*?release version (\d+)\.(\d+)", head)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


def _manylinux_platforms(glibc: tuple[int, int], arch: str) -> list[str]:
    """pip --platform values for the wheels that run on ``glibc``: pip does not widen a
    manylinux_2_N tag to the older ones itself. With the legacy names of 2.17, 2.12 and 2.5."""
    if glibc[0] != 2:
        return []
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    tags = []
    for minor in range(glibc[1], 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in legacy:
            tags.append(f"{legacy[minor]}_{arch}")
    return tags
