"""The default seccomp profile, as an OCI `linux.seccomp` object.

A deny-list: everything is allowed except syscalls that reach kernel surface a sandbox has no business
with (modules, kexec, swap, clocks, keyrings, BPF, perf, raw mount APIs, new user namespaces,
io_uring). Denied calls fail with EPERM rather than killing the process, so tools that probe a
feature degrade gracefully. `clone3` gets ENOSYS so libc falls back to `clone`, whose flags seccomp
can inspect (clone3 passes them in memory, out of a filter's reach).
"""

from __future__ import annotations

from typing import Any

EPERM = 1
ENOSYS = 38
CLONE_NEWUSER = 0x10000000

DENIED_SYSCALLS: tuple[str, ...] = (
    # kernel code and boot
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    # host-wide state
    "swapon",
    "swapoff",
    "acct",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "stime",
    "syslog",
    "vhangup",
    "nfsservctl",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "iopl",
    "ioperm",
    "uselib",
    "vm86",
    "vm86old",
    "pciconfig_read",
    "pciconfig_write",
    # filesystems and namespaces: the sandbox's mount tree is fixed at creation
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "setns",
    "unshare",
    "open_by_handle_at",
    "name_to_handle_at",
    # keyrings, BPF, perf, userfaultfd, io_uring: large attack surface, rarely needed by agents
    "add_key",
    "request_key",
    "keyctl",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    # cross-process memory and kernel introspection
    "process_vm_writev",
    "kcmp",
)


def default_profile() -> dict[str, Any]:
    names = list(DENIED_SYSCALLS)
    return {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": EPERM},
            {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS},
            {
                # clone(flags, ...) with CLONE_NEWUSER: no nested user namespaces.
                "names": ["clone"],
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": EPERM,
                "args": [{"index": 0, "value": CLONE_NEWUSER, "valueTwo": CLONE_NEWUSER, "op": "SCMP_CMP_MASKED_EQ"}],
            },
        ],
    }
