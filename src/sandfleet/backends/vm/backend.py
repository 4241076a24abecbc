"""The QEMU tiers: `microvm` (QEMU's microvm machine, virtio-mmio) and `vm` (q35, PCI, ACPI).

microvm: a guest booted from Debian's cloud kernel and sandfleet's initramfs (guest.py); its
init (vminit.c) mounts the image's EROFS layers from read-only virtio disks (the same layer
files the container tier uses: every VM shares their page cache) and starts the agent with the
container tier's own launcher, so code in the guest is a container inside a VM, and the agent's
channel is out of its reach.

vm: a full virtual machine. Its root disk is a qcow2 overlay (in the VM's directory, gone with it)
over an ext4 base disk of the image's merged tree, built once per image and shared read-only by all
its VMs (disks.py); the overlay is `resources.disk` larger than the base and vminit grows
the root filesystem into it, so that is what the guest can write and what the overlay can grow to.
It boots the image's own kernel if the image has one (/boot/vmlinuz-V and /lib/modules/V; with an
initramfs built for it), else the node's. vminit runs in full mode: the
disk becomes the root, the agent runs there as the guest's real root (no container: docker, mount,
modprobe work as on any machine), and with `options.init` the image's /sbin/init becomes PID 1.
In such a guest, root owns everything, the agent and its channel included: user code can break its
own sandbox's agent but reach nothing beyond the VM. The VM is the boundary; the host is protected by
QEMU's jail (own uid, no capabilities, bwrap, seccomp, own cgroup), exactly as for microvm.

Both: the agent's channel crosses the VM boundary over virtio-serial (qemu.py relays it), and
the service talks to an ordinary AgentChannel.

Per VM on the host: a directory under run_dir/<tier>/<id> (sockets, pidfile, console log), a host
uid of its own for QEMU (jail_uid_base + slot; the `vm` tier's slots start 2^20 above the base so
both tiers can share one base), a cgroup under cgroup_parent, and the jailed QEMU process, which
runs in a session of its own so that it outlives a daemon restart and is adopted again.

Snapshots (snapshots.py, migration.py): QEMU's migration stream of the stopped VM, saved through a unix
socket into the snapshot's directory with the exact kernel and initramfs the guest booted (copied
from QEMU's jail, checked by digest on restore) and, for the vm tier, a copy of its overlay taken
while the VM is stopped (a frozen disk over the base, which must still exist). Each restored child
is a VM of its own (directory, uid, cgroup, sockets) started with -incoming, fed the stream, with
an overlay of its own over the snapshot's disk; the parent resumes and keeps running.

Booted templates (templates.py): the first create of an image boots a template VM whose RAM is a
file and saves its devices (vm: and its disk overlay); later creates map that file copy-on-write and
load the small stream (a restore, not a boot; the guest pages nobody wrote are shared by every VM
of the image). microvm forks go through a template of their snapshot the same way.

A snapshot of a restored vm-tier VM (a child, or a VM after a rollback) merges its overlay and the
snapshot disk beneath it onto the base (disks.flatten_onto_base): no snapshot needs an earlier one's.

Not done yet: vm-tier forks through a template of the snapshot; removing base disks of images that
are gone (they are a cache under the state dir).
"""

from __future__ import annotations

from sandfleet.backends.vm.templates import VMTemplates


class VMBackend(VMTemplates):
    """The microvm and vm tiers' backend: VMMachines (machines.py) with snapshots (snapshots.py) and
    booted templates (templates.py)."""
