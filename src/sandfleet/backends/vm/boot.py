"""What a QEMU tier's VM boots from, and the names of the files in a VM's and a snapshot's directory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sandfleet.backends.vm import disks
from sandfleet.backends.vm.qemu import RamMode
from sandfleet.models import SandboxSpec

ROOT_DISK = "root.qcow2"  # the vm tier's copy-on-write root disk, in the VM's directory

# A snapshot's directory: the migration stream, the boot files, the vm tier's frozen disk.
SNAP_FORMAT = 1
SNAP_STATE, SNAP_KERNEL, SNAP_INITRD, SNAP_DISK = "state.bin", "kernel", "initrd", "disk.qcow2"


@dataclasses.dataclass(frozen=True)
class Boot:
    """What one VM boots from (host paths)."""

    kernel: Path
    initramfs: Path
    layers: list[Path]  # microvm: the image's layers, read-only disks
    base: disks.BaseDisk | None = None  # vm: the shared base under its root overlay
    snapdisk: Path | None = None  # vm, restored: the snapshot's disk, between base and root overlay
    ram: Path | None = None  # a template's guest memory file (templates.py)
    ram_mode: RamMode = "anonymous"
    shim: Path | None = None  # qemu_shim.c's build: with ram_mode "from_template"


def wants_init(spec: SandboxSpec) -> bool:
    """Whether a vm-tier spec asks for the image's init as PID 1 (`options.init`, vm options only)."""
    options = getattr(spec, "options", None)
    return options is not None and getattr(options, "type", None) == "vm" and bool(getattr(options, "init", False))
