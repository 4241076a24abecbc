"""Recipes for the built-in images (busybox, debian:bookworm, python:3.11)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from . import fsutil
from .builtin_images import BUILTIN_IMAGES, BuildContext, Builder
from .models import ImageError, ImageManifest, LayerRef, canonical_ref
from .store import LayerStore

log = logging.getLogger(__name__)

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SUITE = "bookworm"
HOST_BUSYBOX = Path("/bin/busybox")


# --------------------------------------------------------------------------- helpers


def debian_mirror(suite: str = DEBIAN_SUITE) -> str:
    """The host's apt mirror for ``suite`` (deb822 first, then sources.list), else deb.debian.org."""
    d = Path("/etc/apt/sources.list.d")
    candidates = [d / "debian.sources"]
    with contextlib.suppress(OSError):
        candidates += sorted(p for p in d.glob("*.sources") if p.name != "debian.sources")
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[:1].isspace():
                    continue
                k, _, v = line.partition(":")
                fields[k.strip().lower()] = v.strip()
            if (
                suite in fields.get("suites", "").split()
                and "deb" in fields.get("types", "").split()
                and fields.get("enabled", "yes").lower() != "no"
                and fields.get("uris")
            ):
                return fields["uris"].split()[0]
    try:
        lines = Path("/etc/apt/sources.list").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        line = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0])  # drop [options]
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "deb" and parts[2] == suite:
            return parts[1]
    return DEFAULT_MIRROR


async def mmdebstrap(target: Path, mirror: str, *, include: Sequence[str] = ()) -> None:
    argv = ["mmdebstrap", "--variant=minbase", "--mode=root", "--quiet"]
    if include:
        argv.append("--include=" + ",".join(include))
    argv += [DEBIAN_SUITE, str(target), mirror]
    await fsutil.run(*argv, what="mmdebstrap")


def trim_debian_rootfs(root: Path) -> None:
    """Drop caches and host-specific files mmdebstrap leaves behind (blocking)."""
    for pattern in ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin"):
        for p in root.glob(pattern):
            p.unlink()
    lists = root / "var/lib/apt/lists"
    if lists.is_dir():
        for p in lists.iterdir():
            if p.is_file() or p.is_symlink():
                p.unlink()
    # mmdebstrap copies the build host's hostname/resolv.conf; the runtime provides both.
    etc = root / "etc"
    (etc / "hostname").write_text("sandbox\n")
    (etc / "resolv.conf").write_text("# provided by the sandbox runtime\n")
    for name in ("hostname", "resolv.conf"):
        os.chmod(etc / name, 0o644)
        # Fixed mtime, so these don't show up as changed in every derived layer's diff.
        os.utime(etc / name, (0, 0))


@contextlib.asynccontextmanager
async def mounted_layers(layers: Sequence[Path], mountpoint: Path) -> AsyncIterator[Path]:
    """Read-only view of a layer stack (bottom -> top): one erofs mount, or an overlay of several."""
    if len(layers) == 1:
        async with fsutil.mounted_erofs(layers[0], mountpoint) as mp:
            yield mp
        return
    async with contextlib.AsyncExitStack() as stack:
        mounted = []
        for i, layer in enumerate(layers):
            mounted.append(
                await stack.enter_async_context(
                    fsutil.mounted_erofs(layer, mountpoint.with_name(f"{mountpoint.name}-l{i}"))
                )
            )
        await asyncio.to_thread(mountpoint.mkdir, parents=True, exist_ok=True)
        lowerdir = ":".join(str(p) for p in reversed(mounted))  # overlayfs wants top first
        await fsutil.run(
            "mount",
            "-t",
            "overlay",
            "overlay",
            "-o",
            f"ro,lowerdir={lowerdir}",
            str(mountpoint),
            what="mount overlay",
        )
        try:
            yield mountpoint
        finally:
            await asyncio.shield(fsutil.run("umount", str(mountpoint), what="umount overlay"))


# --------------------------------------------------------------------------- busybox

_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def stage_busybox(root: Path, busybox: Path = HOST_BUSYBOX) -> int:
    """Create a minimal busybox rootfs in ``root`` (blocking); return the number of applet links."""
    for d in (
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "root",
        "proc",
        "sys",
        "dev",
        "home",
        "var",
        "task",
        "tmp",
    ):
        (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / d, 0o755)
    os.chmod(root / "tmp", 0o1777)
    os.chmod(root / "root", 0o700)
    shutil.copy2(busybox, root / "bin/busybox")
    os.chmod(root / "bin/busybox", 0o755)
    listing = subprocess.run([str(busybox), "--list-full"], check=True, capture_output=True, text=True).stdout.split()
    n = 0
    for applet in listing:
        # --list-full gives install paths (bin/ls, usr/bin/awk); skip oddities like "linuxrc".
        if "/" not in applet or applet == "bin/busybox":
            continue
        link = root / applet
        if link.exists() or link.is_symlink():
            continue
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("/bin/busybox")
        n += 1
    if not (root / "bin/sh").is_symlink():
        (root / "bin/sh").symlink_to("/bin/busybox")
    (root / "etc/passwd").write_text(_PASSWD)
    (root / "etc/group").write_text(_GROUP)
    (root / "etc/hostname").write_text("sandbox\n")
    for f in ("passwd", "group", "hostname"):
        os.chmod(root / "etc" / f, 0o644)
    return n


async def build_busybox(ctx: BuildContext) -> list[LayerRef]:
    rootfs = ctx.workdir / "rootfs"
    ctx.report("busybox: staging rootfs", 0.1)
    n = await asyncio.to_thread(stage_busybox, rootfs)
    ctx.report("busybox: mkfs.erofs", 0.5)
    layer = await ctx.store.add_layer_from_dir(rootfs, f"busybox-static from host, {n} applets", kind="base")
    return [layer]


# --------------------------------------------------------------------------- debian


async def build_debian(ctx: BuildContext) -> list[LayerRef]:
    mirror = await asyncio.to_thread(debian_mirror)
    rootfs = ctx.workdir / "rootfs"
    ctx.report(f"debian:{DEBIAN_SUITE}: mmdebstrap minbase from {mirror}", 0.05)
    await mmdebstrap(rootfs, mirror)
    ctx.report(f"debian:{DEBIAN_SUITE}: trimming caches", 0.75)
    await asyncio.to_thread(trim_debian_rootfs, rootfs)
    ctx.report(f"debian:{DEBIAN_SUITE}: mkfs.erofs", 0.8)
    layer = await ctx.store.add_layer_from_dir(rootfs, f"debian {DEBIAN_SUITE} minbase ({mirror})", kind="base")
    return [layer]


# --------------------------------------------------------------------------- python


# What users of a python image expect: `python`, pip and venv (Debian splits them out of python3).
PYTHON_PACKAGES = ("python3", "python-is-python3", "python3-pip", "python3-venv")
PYTHON_RECIPE = (
    f"debian:{DEBIAN_SUITE} + diff(mmdebstrap --include={','.join(PYTHON_PACKAGES)}), no EXTERNALLY-MANAGED marker"
)
# Bump when what the python image holds changes: nodes that have an older one rebuild it.
PYTHON_BUILDER_VERSION = 2
PYTHON_LEGACY_RECIPES = (f"debian:{DEBIAN_SUITE} + diff(mmdebstrap --include=python3)",)  # version 1


def drop_externally_managed(root: Path) -> list[Path]:
    """Remove Debian's PEP 668 marker, so `pip install` into the image's Python works as in any
    python image (a sandbox is the environment to install into; there is no system to protect)."""
    removed = []
    for marker in sorted(root.glob("usr/lib/python3*/EXTERNALLY-MANAGED")):
        marker.unlink()
        removed.append(marker)
    return removed


async def build_python(ctx: BuildContext) -> list[LayerRef]:
    """debian:bookworm + one layer holding exactly what ``apt install python3 python-is-python3
    python3-pip python3-venv`` adds, without the EXTERNALLY-MANAGED marker.

    A second minbase+python bootstrap is diffed against the *stored* debian layer (mounted),
    not a fresh debootstrap, so the result is correct even if the mirror moved in between.
    """
    store = ctx.store
    mirror = await asyncio.to_thread(debian_mirror)
    full = ctx.workdir / "rootfs"
    ctx.report(f"python:3.11: mmdebstrap minbase + {' '.join(PYTHON_PACKAGES)}", 0.0)
    # The full python bootstrap doesn't need the debian layer until the diff, so run it
    # alongside a (possibly cold) debian build: ~30 s instead of ~50 s cold on 2 cores.
    async with asyncio.TaskGroup() as tg:
        base_task = tg.create_task(store.ensure(f"debian:{DEBIAN_SUITE}", ctx.sub(0.0, 0.6)))
        tg.create_task(mmdebstrap(full, mirror, include=PYTHON_PACKAGES))
    base = base_task.result()
    ctx.report("python:3.11: shifting ids", 0.7)
    await asyncio.to_thread(trim_debian_rootfs, full)
    await asyncio.to_thread(drop_externally_managed, full)
    # The stored debian layer is already id-shifted; shift the full tree the same way so the
    # diff compares like with like, then pack the diff without shifting again.
    await asyncio.to_thread(fsutil.shift_ownership, full, store.uid_base)
    ctx.report("python:3.11: diffing against debian layer", 0.75)
    out = ctx.workdir / "layer"
    async with mounted_layers(store.layer_paths(base), ctx.workdir / "lower") as lower:
        stats = await asyncio.to_thread(fsutil.diff_trees, lower, full, out)
    log.info("python layer diff: %s", stats)
    ctx.report("python:3.11: mkfs.erofs", 0.9)
    layer = await store.add_layer_from_dir(
        out,
        f"apt install {' '.join(PYTHON_PACKAGES)} on debian {DEBIAN_SUITE} "
        f"(+{stats.added} ~{stats.changed} -{stats.removed})",
        kind="layer",
        shift_ids=False,
    )
    return [*base.layers, layer]


def alias(target: str) -> Builder:
    """A recipe that just points at another (built-in) ref; stale once the target's layers moved
    on (the target was rebuilt) or the target itself is outdated."""
    recipe = f"alias of {target}"

    async def build(ctx: BuildContext) -> list[LayerRef]:
        m = await ctx.store.ensure(target, ctx.sub(0.0, 1.0))
        return list(m.layers)

    def stale(store: LayerStore, manifest: ImageManifest) -> bool:
        if manifest.recipe != recipe:
            return False  # not made by this alias (imported under the name, say): left alone
        try:
            current = store.resolve(target)
        except ImageError:
            return True
        builder = BUILTIN_IMAGES.get(canonical_ref(target))
        return current.layers != manifest.layers or (builder is not None and builder.outdated(store, current))

    return Builder(recipe=recipe, build=build, stale=stale)


# The built-in recipes, registered where `LayerStore.ensure` looks them up.
BUILTIN_IMAGES.update(
    {
        "busybox:latest": Builder(recipe="host busybox-static + applet symlinks", build=build_busybox),
        f"debian:{DEBIAN_SUITE}": Builder(recipe=f"mmdebstrap --variant=minbase {DEBIAN_SUITE}", build=build_debian),
        "python:3.11": Builder(
            recipe=PYTHON_RECIPE,
            build=build_python,
            version=PYTHON_BUILDER_VERSION,
            legacy_recipes=PYTHON_LEGACY_RECIPES,
        ),
        "debian:latest": alias(f"debian:{DEBIAN_SUITE}"),
        "python:latest": alias("python:3.11"),
    }
)
