"""The guest side of the QEMU tiers: the kernel (Debian's cloud kernel, unpacked by setup under the
`guest_dir`) and the initramfs every VM boots, built here.

The initramfs holds /init (vminit.c), the agent, the launcher, the compiled seccomp filter and the
kernel modules the guest needs (the cloud kernel has virtio, EROFS and overlayfs as modules), in
dependency order (/modules/order). It is content-addressed: one file per set of inputs under the
backend's state directory, built once and shared by every VM (read by QEMU, never written).
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandfleet.runtime.agent_build import build_agent, build_launcher, build_static

VMINIT_SOURCE = Path(__file__).with_name("vminit.c")
# What vminit loads, by module name; their `depends=` pull in the rest (libcrc32c for EROFS). One
# list for both tiers (ext4 for the vm tier's root disk), so they share one initramfs.
WANTED_MODULES = (
    "virtio_mmio", "virtio_pci", "virtio_blk", "virtio_console", "virtio_balloon", "erofs", "overlay", "ext4",
)  # fmt: skip
# What a full VM booting the image's own kernel needs before its root disk is mounted (the image's
# init loads the rest from the disk's /lib/modules).
FULL_MODULES = ("virtio_pci", "virtio_blk", "virtio_console", "virtio_balloon", "ext4")
# Module files as distributions ship them; vminit has the kernel decompress the compressed ones.
MODULE_SUFFIXES = (".ko", ".ko.xz", ".ko.zst", ".ko.gz")
KERNEL_PREFIX = "vmlinuz-"


class GuestUnavailableError(RuntimeError):
    """The kernel, its modules or QEMU are missing."""


@dataclass(frozen=True)
class Kernel:
    image: Path  # the bzImage QEMU boots with -kernel
    version: str
    modules: Path  # lib/modules/<version>/kernel

    def builtin(self) -> set[str]:
        """Names of the modules compiled into the kernel (modules.builtin)."""
        try:
            text = (self.modules.parent / "modules.builtin").read_text()
        except OSError:
            return set()
        return {Path(line.strip()).name.removesuffix(".ko").replace("-", "_") for line in text.splitlines() if line}


def find_kernel(guest_dir: Path) -> Kernel:
    """The newest kernel under guest_dir/boot that has its modules under guest_dir/lib/modules."""
    boot = guest_dir / "boot"
    try:
        images = sorted(p for p in boot.iterdir() if p.name.startswith(KERNEL_PREFIX))
    except OSError as exc:
        raise GuestUnavailableError(f"no guest kernel: {boot} cannot be read ({exc.strerror}); run setup.sh") from exc
    for image in reversed(images):
        version = image.name.removeprefix(KERNEL_PREFIX)
        modules = guest_dir / "lib" / "modules" / version / "kernel"
        if modules.is_dir():
            return Kernel(image, version, modules)
    raise GuestUnavailableError(f"no guest kernel with its modules under {guest_dir} (run setup.sh)")


def module_name(path: Path) -> str | None:
    """A module file's module name ('_' for '-', as the kernel treats them); None if not a module."""
    for suffix in MODULE_SUFFIXES:
        if path.name.endswith(suffix):
            return path.name.removesuffix(suffix).replace("-", "_")
    return None


def _module_index(kernel: Kernel) -> dict[str, Path]:
    """Module name -> module file."""
    out: dict[str, Path] = {}
    for p in kernel.modules.rglob("*.ko*"):
        name = module_name(p)
        if name is not None:
            out[name] = p
    return out


def _dep_map(kernel: Kernel) -> dict[str, list[str]] | None:
    """Module name -> the names it depends on, from modules.dep (a distribution's tree has it;
    the unpacked guest kernel does not); None without one."""
    try:
        text = (kernel.modules.parent / "modules.dep").read_text()
    except OSError:
        return None
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        mod, _, deps = line.partition(":")
        name = module_name(Path(mod))
        if name is not None:
            out[name] = [n for d in deps.split() if (n := module_name(Path(d))) is not None]
    return out


def _depends(ko: Path) -> list[str]:
    """The `depends=` of a module's .modinfo. The .modinfo strings are NUL-separated key=value pairs;
    no other section has this key at a string start."""
    data = ko.read_bytes()
    if ko.name.endswith(".xz"):
        data = lzma.decompress(data)
    elif ko.name.endswith(".gz"):
        data = gzip.decompress(data)
    at = data.find(b"\0depends=")
    if at < 0:
        return []
    value = data[at + 9 : data.index(b"\0", at + 9)].decode()
    return [d.replace("-", "_") for d in value.split(",") if d]


def module_order(kernel: Kernel, wanted: tuple[str, ...] = WANTED_MODULES) -> list[Path]:
    """The .ko files to load, each after its dependencies (builtin ones skipped)."""
    index = _module_index(kernel)
    deps = _dep_map(kernel)
    builtin = kernel.builtin()
    order: list[Path] = []
    seen: set[str] = set()

    def visit(name: str) -> None:
        if name in seen or name in builtin:
            return
        seen.add(name)
        ko = index.get(name)
        if ko is None:
            raise GuestUnavailableError(f"kernel module {name} not found under {kernel.modules}")
        for dep in deps.get(name, []) if deps is not None else _depends(ko):
            visit(dep)
        order.append(ko)

    for name in wanted:
        visit(name)
    return order


# ---- newc cpio -------------------------------------------------------------------------------


def _cpio_entry(name: str, mode: int, data: bytes = b"", *, ino: int, rdev: tuple[int, int] = (0, 0)) -> bytes:
    """One newc record: header, NUL-terminated name padded to 4, data padded to 4."""
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0]
    head = b"070701" + b"".join(b"%08X" % f for f in fields)
    out = head + name.encode() + b"\0"
    out += b"\0" * (-len(out) % 4)
    out += data + b"\0" * (-len(data) % 4)
    return out


def build_cpio(files: dict[str, bytes], *, dirs: list[str], exec_files: set[str]) -> bytes:
    """An uncompressed newc archive with `dirs`, `files` and a /dev/console node (the kernel opens it
    as init's stdio before any devtmpfs exists)."""
    parts: list[bytes] = []
    ino = 1
    for d in dirs:
        parts.append(_cpio_entry(d, 0o040755, ino=ino))
        ino += 1
    parts.append(_cpio_entry("dev/console", 0o020600, ino=ino, rdev=(5, 1)))
    ino += 1
    for name, data in sorted(files.items()):
        parts.append(_cpio_entry(name, (0o100755 if name in exec_files else 0o100644), data, ino=ino))
        ino += 1
    parts.append(_cpio_entry("TRAILER!!!", 0, ino=0))
    blob = b"".join(parts)
    return blob + b"\0" * (-len(blob) % 512)


# ---- the initramfs -----------------------------------------------------------------------------


def build_vminit(cache_dir: Path) -> Path:
    return build_static(VMINIT_SOURCE, cache_dir, "vminit", prefer_musl=True)


def initramfs_inputs(
    state_dir: Path, kernel: Kernel, seccomp_bpf: bytes, wanted: tuple[str, ...] = WANTED_MODULES
) -> dict[str, bytes]:
    """Path in the initramfs -> contents (building the static binaries if needed; blocking)."""
    files = {
        "init": build_vminit(state_dir / "vminit").read_bytes(),
        "sandfleet/agent": build_agent(state_dir / "agent").read_bytes(),
        "sandfleet/launcher": build_launcher(state_dir / "launcher").read_bytes(),
        "sandfleet/seccomp.bpf": seccomp_bpf,
    }
    order = module_order(kernel, wanted)
    for ko in order:
        files[f"modules/{ko.name}"] = ko.read_bytes()
    files["modules/order"] = "".join(f"{ko.name}\n" for ko in order).encode()
    return files


def build_initramfs(
    state_dir: Path,
    kernel: Kernel,
    seccomp_bpf: bytes,
    *,
    wanted: tuple[str, ...] = WANTED_MODULES,
    out_dir: Path | None = None,
) -> Path:
    """The initramfs for `kernel`, at out_dir (default state_dir/initramfs)/<digest>.cpio.gz (reused
    when its inputs are unchanged; old ones in out_dir are removed)."""
    files = initramfs_inputs(state_dir, kernel, seccomp_bpf, wanted)
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    out_dir = out_dir or state_dir / "initramfs"
    target = out_dir / f"{digest.hexdigest()[:20]}.cpio.gz"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    blob = build_cpio(
        files,
        dirs=["dev", "proc", "sys", "sandfleet", "modules"],
        exec_files={"init", "sandfleet/agent", "sandfleet/launcher"},
    )
    fd, tmp = tempfile.mkstemp(prefix=".initramfs-", dir=out_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            # Level 1: the kernel unpacks it once per boot; speed matters more than a few KiB.
            f.write(gzip.compress(blob, compresslevel=1))
        os.chmod(tmp, 0o644)  # QEMU reads it as its jail uid
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in out_dir.glob("*.cpio.gz"):
        if old != target:
            old.unlink(missing_ok=True)  # a running VM already read its copy at boot
    return target


def usable(qemu: str, guest_dir: Path) -> tuple[bool, str]:
    """Whether the QEMU tiers can run here (for `sandfleet doctor`): QEMU, the kernel, its modules."""
    if shutil.which(qemu) is None:
        return False, f"{qemu} not found (apt-get install qemu-system-x86)"
    try:
        kernel = find_kernel(guest_dir)
        module_order(kernel)
    except GuestUnavailableError as exc:
        return False, str(exc)
    return True, f"QEMU {shutil.which(qemu)}, guest kernel {kernel.version}"
