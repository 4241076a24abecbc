"""The `vm` tier's disks: one ext4 base disk per image, shared read-only, and a qcow2 overlay per VM.

The base holds the image's merged tree (its EROFS layers stacked, upper wins, whiteouts honoured by
overlayfs itself) plus a little slack (an eighth of the tree and SLACK), not the VMs' writes. It
is content-addressed by the layer digests (and LAYOUT) under the backend's cache directory, built
once in a private mount namespace (`unshare -m`, so no mount outlives the build), renamed into place
atomically, and built by one creator at a time (an flock per key: concurrent creates of one image
wait for that build and reuse it).

If the image brings a kernel (/boot/vmlinuz-V with /lib/modules/V), the build also copies that
kernel and the modules the guest's init needs into the base's directory, laid out as
`guest.find_kernel` expects, so the VM boots the image's own kernel.

Each VM's root disk is a qcow2 overlay in its own directory whose backing file is the base *as the
VM's jailed QEMU sees it* (qemu.VMLayout.base): the overlay is created with `-u` (the host never
opens that path) and QEMU opens the base read-only through the fd the jail binds there. The
overlay's virtual size is the base's plus the sandbox's `resources.disk`; the guest's init grows
the filesystem to it at boot (ext4 online resize), so the guest gets ENOSPC once it has written
about `disk` bytes, and the overlay, which only ever holds blocks of that virtual disk, never grows
past it on the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandfleet.backends.vm import guest

MIB = 1024**2
SLACK = 8 * MIB  # free space in every base beyond an eighth of its tree (a VM's own room is its overlay's)
BLOCK = 4096
LAYOUT = "2"  # in the key: bases of an earlier layout (1 GiB free for every VM) are not reused
BUILD_TIMEOUT = 1800.0
META = "meta.json"


class DiskBuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class BaseDisk:
    path: Path  # the raw ext4 image (never written once built)
    size: int
    kernel_dir: Path | None  # the image's kernel, laid out for guest.find_kernel; None: use the node's
    has_init: bool  # the image has /sbin/init (vminit checks again in the guest before exec'ing it)


def base_key(digests: list[str]) -> str:
    return hashlib.sha256("\n".join([f"layout {LAYOUT}", *digests]).encode()).hexdigest()[:32]


def _load(d: Path) -> BaseDisk:
    meta = json.loads((d / META).read_text())
    kernel_dir = d / "kernel" if meta["kernel"] else None
    return BaseDisk(d / "base.raw", int(meta["size"]), kernel_dir, bool(meta["init"]))


def load_base(cache_dir: Path, key: str) -> BaseDisk | None:
    """The base disk built under this key, if it (still) exists."""
    if not re.fullmatch(r"[0-9a-f]{32}", key):
        return None
    try:
        base = _load(cache_dir / key)
    except (OSError, ValueError, KeyError):
        return None
    return base if base.path.is_file() else None


def ensure_base(cache_dir: Path, digests: list[str], layers: list[Path]) -> BaseDisk:
    """The base disk of the image with these layers (bottom first), built if missing (blocking)."""
    key = base_key(digests)
    final = cache_dir / key
    with contextlib.suppress(OSError, ValueError, KeyError):
        return _load(final)
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(cache_dir, 0o711)  # QEMU reaches the bases only through fds, but the dir is not secret
    with open(cache_dir / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed: a crashed builder holds nothing
        with contextlib.suppress(OSError, ValueError, KeyError):
            return _load(final)  # built while we waited
        for stale in cache_dir.glob(f".{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)  # an interrupted build (we hold its key's lock)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_dir))
        try:
            argv = ["unshare", "-m", "--propagation", "private", sys.executable, "-m", __name__, str(tmp)]
            run = subprocess.run([*argv, *map(str, layers)], capture_output=True, text=True, timeout=BUILD_TIMEOUT)
            if run.returncode != 0:
                raise DiskBuildError(f"building the base disk failed: {run.stderr.strip()[-2000:]}")
            for mountpoint in [*tmp.glob("l[0-9]*"), tmp / "merged"]:
                with contextlib.suppress(OSError):
                    mountpoint.rmdir()  # empty: the build's mounts died with its namespace
            os.chmod(tmp, 0o711)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return _load(final)


def create_overlay(path: Path, size: int, backing_as_seen: str, owner: int, backing_format: str = "raw") -> None:
    """A qcow2 overlay of `size` bytes (the base's and the VM's own room) over the base (or over a
    snapshot's qcow2 copy of an overlay over it: then backing_format is qcow2, and the size that
    copy's), owned by the VM's jail uid (blocking)."""
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", backing_format, "-b", backing_as_seen]
    run = subprocess.run([*argv, str(path), str(size)], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        raise DiskBuildError(f"qemu-img create failed: {run.stderr.strip()}")
    os.chown(path, owner, owner)
    os.chmod(path, 0o600)


def copy_disk(src: Path, dest: Path) -> None:
    """A snapshot's frozen copy of a stopped VM's overlay (holes kept), read-only to every jail uid:
    each restored child's QEMU opens it through a bound fd as the backing file of its own overlay."""
    argv = ["cp", "--sparse=always", "--reflink=auto", "--", str(src), str(dest)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise DiskBuildError(f"copying the disk failed: {run.stderr.strip()}")
    os.chmod(dest, 0o644)


def flatten_onto_base(overlay: Path, snapdisk: Path, base: Path, dest: Path) -> None:
    """A snapshot's frozen copy of a restored VM's disk: its overlay and the snapshot disk beneath
    it, merged into one qcow2 over the base (what a copy of a booted VM's overlay is), so that the
    snapshot needs no earlier one's disk. The files name their backing files as QEMU's jail sees
    them (/vm/snapdisk, /vm/base), so copies are pointed at the host's files (`rebase -u`) for the
    merge (`commit`: the overlay's clusters written into the copy of the snapshot disk), and the
    result at the jail's base again (blocking; the VM is stopped, its disks inactive)."""
    top = dest.with_name(dest.name + ".top")
    try:
        copy_disk(snapdisk, dest)
        copy_disk(overlay, top)
        steps = [
            ["qemu-img", "rebase", "-q", "-u", "-b", str(base), "-F", "raw", str(dest)],
            ["qemu-img", "rebase", "-q", "-u", "-b", str(dest), "-F", "qcow2", str(top)],
            ["qemu-img", "commit", "-q", str(top)],
            ["qemu-img", "rebase", "-q", "-u", "-b", "/vm/base", "-F", "raw", str(dest)],
        ]
        for argv in steps:
            run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                raise DiskBuildError(f"qemu-img {argv[1]} failed: {run.stderr.strip()}")
    finally:
        top.unlink(missing_ok=True)


# ---- the build (runs in its own mount namespace: python -m sandfleet.backends.vm.disks OUT LAYER...) ----


def _mount(argv: list[str]) -> None:
    subprocess.run(["mount", *argv], check=True, capture_output=True, timeout=60)


def _merged_tree(out: Path, layers: list[Path]) -> Path:
    """Mount the layers (bottom first) and return the merged tree."""
    dirs = []
    for i, layer in enumerate(layers):
        d = out / f"l{i}"
        d.mkdir()
        _mount(["-t", "erofs", "-o", "ro", str(layer), str(d)])
        dirs.append(d)
    if len(dirs) == 1:
        return dirs[0]  # overlayfs wants two lower layers when it has no upper one
    merged = out / "merged"
    merged.mkdir()
    lower = ":".join(str(d) for d in reversed(dirs))  # top layer first
    _mount(["-t", "overlay", "-o", f"ro,lowerdir={lower}", "sandfleet-base", str(merged)])
    return merged


def _used(tree: Path) -> tuple[int, int]:
    """(bytes, entries) of the tree once on ext4: sizes in whole blocks (st_blocks would count an
    EROFS layer's compressed size)."""
    total = entries = 0
    for root, dirs, files in os.walk(tree):
        for name in [*dirs, *files]:
            entries += 1
            with contextlib.suppress(OSError):
                total += -(-os.lstat(os.path.join(root, name)).st_size // BLOCK) * BLOCK
    return total, entries


def resolve_in(tree: Path, rel: str, depth: int = 0) -> Path | None:
    """`rel` inside `tree`, following symlinks as the guest would (absolute targets relative to the
    tree's root, `..` never above it); None if missing or a loop. Never leaves the tree: an image's
    /boot/vmlinuz -> /etc/shadow must not copy the host's file."""
    if depth > 40:
        return None
    parts = [p for p in rel.split("/") if p and p != "."]
    cur: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == "..":
            if cur:
                cur.pop()
            continue
        path = tree.joinpath(*cur, part)
        if path.is_symlink():
            target = os.readlink(path)
            base = "" if target.startswith("/") else "/".join(cur)
            resolved = resolve_in(tree, f"{base}/{target}", depth + 1)
            if resolved is None:
                return None
            cur = list(resolved.relative_to(tree).parts)
            continue
        if not os.path.lexists(path):
            return None
        cur.append(part)
    return tree.joinpath(*cur)


def _version_key(version: str) -> list[tuple[int, str]]:
    return [(int(x), "") if x.isdigit() else (-1, x) for x in re.split(r"(\d+)", version) if x]


def select_kernel(tree: Path) -> tuple[Path, Path, str] | None:
    """The image's newest kernel that has its modules: (bzImage, lib/modules/V dir, V); None if none."""
    boot = resolve_in(tree, "boot")
    if boot is None or not boot.is_dir():
        return None
    versions = [
        p.name.removeprefix(guest.KERNEL_PREFIX) for p in boot.iterdir() if p.name.startswith(guest.KERNEL_PREFIX)
    ]
    for version in sorted(versions, key=_version_key, reverse=True):
        image = resolve_in(tree, f"boot/{guest.KERNEL_PREFIX}{version}")
        modules = resolve_in(tree, f"lib/modules/{version}")
        if image is not None and image.is_file() and modules is not None and (modules / "kernel").is_dir():
            return image, modules, version
    return None


def extract_kernel(tree: Path, dest: Path) -> bool:
    """Copy the image's kernel and the modules the guest's init loads into dest (boot/, lib/modules/);
    False if the image has no kernel."""
    found = select_kernel(tree)
    if found is None:
        return False
    image, modules, version = found
    kernel = guest.Kernel(image, version, modules / "kernel")
    order = guest.module_order(kernel, guest.FULL_MODULES)
    (dest / "boot").mkdir(parents=True)
    shutil.copyfile(image, dest / "boot" / f"{guest.KERNEL_PREFIX}{version}")
    out_modules = dest / "lib" / "modules" / version
    for ko in order:
        target = out_modules / ko.relative_to(modules)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ko, target)
    (out_modules / "kernel").mkdir(parents=True, exist_ok=True)
    for name in ("modules.builtin", "modules.dep"):
        if (modules / name).is_file():
            shutil.copyfile(modules / name, out_modules / name)
    for p in [dest, *dest.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)  # QEMU reads the kernel as its jail uid
    return True


def build(out: Path, layers: list[Path]) -> None:
    tree = _merged_tree(out, layers)
    used, entries = _used(tree)
    inodes = entries * 5 // 4 + 16384
    size = used * 9 // 8 + inodes * 256 + SLACK
    journal = 4 if size < 128 * MIB else 16  # MiB, mke2fs's choice for a filesystem of that size
    size = -(-size // MIB) * MIB + journal * MIB
    raw = out / "base.raw"
    # -m 0: no blocks reserved for root (the guest's root is the only user); -d: the tree's files,
    # owners, modes, xattrs; lazy inits: the guest's kernel finishes them in the background. 4 KiB
    # blocks and inodes for the tree and more: a small base would get 1 KiB blocks and, grown to
    # the VM's size at boot, too few inodes for its size.
    argv = ["mke2fs", "-q", "-F", "-t", "ext4", "-m", "0", "-b", str(BLOCK), "-N", str(inodes)]
    argv += ["-J", f"size={journal}", "-L", "sandfleet-root", "-d", str(tree)]
    argv += ["-E", "lazy_itable_init=1,lazy_journal_init=1", str(raw), f"{size // 1024}k"]
    subprocess.run(argv, check=True, capture_output=True, timeout=BUILD_TIMEOUT)
    os.chmod(raw, 0o644)  # QEMU opens it read-only as its jail uid (through a bound fd)
    kernel = extract_kernel(tree, out / "kernel")
    has_init = resolve_in(tree, "sbin/init") is not None
    (out / META).write_text(json.dumps({"size": size, "kernel": kernel, "init": has_init}))


def main() -> None:
    out, *layers = sys.argv[1:]
    try:
        build(Path(out), [Path(x) for x in layers])
    except (OSError, subprocess.CalledProcessError, guest.GuestUnavailableError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else ""
        sys.exit(f"{exc} {detail!s}".strip())


if __name__ == "__main__":
    main()
