"""The default seccomp profile, as an OCI `linux.seccomp` object.

A deny-list: everything is allowed except syscalls that reach kernel surface a sandbox has no business
with (modules, kexec, swap, clocks, keyrings, BPF, perf, raw mount APIs, new user namespaces,
io_uring). Denied calls fail with EPERM rather than killing the process, so tools that probe a
feature degrade gracefully. `clone3` gets ENOSYS so libc falls back to `clone`, whose flags seccomp
can inspect (clone3 passes them in memory, out of a filter's reach).

The launcher's filter (`compile_bpf`, not crun's `config.json`) also reports attempts on the agent,
PID 1 of the sandbox's pid namespace (`ATTEMPT_RULES`): signals, ptrace, pidfd_open and
process_vm_readv aimed at pid 1 return SECCOMP_RET_USER_NOTIF. The launcher installs the filter
with SECCOMP_FILTER_FLAG_NEW_LISTENER and hands the listener to the agent (its fd 5), which answers
EPERM (or lets the call through when the caller sits in a nested pid namespace, where "1" is another
init) and tells the daemon (an ALERT message). The kernel refuses those calls anyway (the agent is
non-dumpable, a pid-namespace init drops signals it has no handler for): the rules make the attempt
visible. Without a listener (a restored sandbox: criu cannot dump one) they fail with ENOSYS.
`process_vm_writev` and `kcmp` stay denied for every pid (EPERM, not reported).
"""

from __future__ import annotations

import ctypes
import os
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


# A pid is a pid_t: the kernel reads the low 32 bits of the register, so the filter compares those
# only (a caller setting the high bits must not slip past). libseccomp: MASKED_EQ(mask, value).
_PID1 = {"value": 0xFFFFFFFF, "valueTwo": 1, "op": "SCMP_CMP_MASKED_EQ"}
# syscall names -> index of the argument that holds the target pid (tgkill: the tgid)
ATTEMPT_SYSCALLS: dict[str, int] = {
    "kill": 0,
    "tkill": 0,
    "tgkill": 0,
    "rt_sigqueueinfo": 0,
    "rt_tgsigqueueinfo": 0,
    "ptrace": 1,  # any request: only ptrace(PTRACE_TRACEME) ignores its pid, and no one passes 1 there
    "pidfd_open": 0,
    "process_vm_readv": 0,
}


def attempt_rules() -> list[dict[str, Any]]:
    """SCMP_ACT_NOTIFY rules for calls aimed at pid 1 (the agent). Launcher only: crun and runc
    would need a listener socket for them."""
    return [
        {"names": [name], "action": "SCMP_ACT_NOTIFY", "args": [{"index": index, **_PID1}]}
        for name, index in ATTEMPT_SYSCALLS.items()
    ]


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


class SeccompUnavailableError(RuntimeError):
    """libseccomp (Debian's libseccomp2, a dependency of crun) could not be loaded or used."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


_ACTIONS = {"SCMP_ACT_ALLOW": 0x7FFF0000, "SCMP_ACT_KILL": 0x00000000, "SCMP_ACT_NOTIFY": 0x7FC00000}
_ERRNO_ACTION = 0x00050000
_ATTR_OPTIMIZE = 8  # SCMP_FLTATR_CTL_OPTIMIZE (libseccomp >= 2.5)
_OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5}
_OPS.update({"SCMP_CMP_GT": 6, "SCMP_CMP_MASKED_EQ": 7})
_ARCHES = {"SCMP_ARCH_X86_64": b"x86_64", "SCMP_ARCH_X86": b"x86", "SCMP_ARCH_X32": b"x32"}


def _action(rule: dict[str, Any]) -> int:
    name = rule["action"]
    if name == "SCMP_ACT_ERRNO":
        return _ERRNO_ACTION | (int(rule.get("errnoRet", EPERM)) & 0xFFFF)
    return _ACTIONS[name]


def compile_bpf(profile: dict[str, Any], *, attempts: bool = True) -> bytes:
    """Compile an OCI seccomp object to the classic BPF program the kernel loads (struct sock_filter[]).

    libseccomp does what crun does with the same profile; the launcher then only has to install the
    bytes, so a create costs no filter compilation. `attempts`: add `attempt_rules()` (the launcher
    installs this filter with a listener the agent serves).
    """
    if attempts:
        profile = {**profile, "syscalls": [*profile["syscalls"], *attempt_rules()]}
    try:
        lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    except OSError as exc:
        raise SeccompUnavailableError("libseccomp.so.2 not found (apt-get install libseccomp2)") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_arch_native.restype = ctypes.c_uint32
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]

    ctx = lib.seccomp_init(_ACTIONS[profile["defaultAction"]])
    if not ctx:
        raise SeccompUnavailableError("seccomp_init failed")
    try:
        # A binary search over syscall numbers instead of a linear chain of compares. Installing a
        # filter makes the kernel evaluate it for every syscall number of every arch (to cache the
        # always-allowed ones), once per sandbox: the tree takes ~90 us off each create. Older
        # libseccomp lacks the attribute and keeps the chain.
        lib.seccomp_attr_set(ctx, _ATTR_OPTIMIZE, 2)
        native = lib.seccomp_arch_native()
        for arch in profile.get("architectures", []):
            token = lib.seccomp_arch_resolve_name(_ARCHES[arch])
            if token and token != native:
                rc = lib.seccomp_arch_add(ctx, token)
                if rc not in (0, -17):  # -EEXIST
                    raise SeccompUnavailableError(f"seccomp_arch_add({arch}) failed: {rc}")
        for rule in profile["syscalls"]:
            args = rule.get("args", [])
            cmps = (_ArgCmp * max(1, len(args)))()
            for i, a in enumerate(args):
                cmps[i] = _ArgCmp(a["index"], _OPS[a["op"]], a["value"], a.get("valueTwo", 0))
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr == -1:  # __NR_SCMP_ERROR: unknown to this libseccomp; skipped, as crun does
                    continue
                rc = lib.seccomp_rule_add_array(ctx, _action(rule), nr, len(args), cmps)
                if rc != 0:
                    raise SeccompUnavailableError(f"seccomp rule for {name} failed: {rc}")
        fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc != 0:
                raise SeccompUnavailableError(f"seccomp_export_bpf failed: {rc}")
            size = os.lseek(fd, 0, os.SEEK_END)
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)
