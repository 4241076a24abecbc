"""The QEMU tiers, `microvm` and `vm`: their backend (backend.py, snapshots.py), QEMU's command line,
jail and QMP (qemu.py), the guest's kernel and initramfs (guest.py, vminit.c), the vm tier's disks
(disks.py) and QEMU's migration stream (migration.py). Importing this package imports none of them."""
