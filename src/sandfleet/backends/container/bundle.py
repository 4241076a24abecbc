"""OCI runtime config (config.json) for one container sandbox.

The isolation steps, in the order the runtime applies them, each named after its kernel facility:
user namespace (root inside = `uid_base` outside), pid/mount/uts/ipc/net namespaces, cgroup limits,
rootfs pivot, masked and read-only /proc paths, capability drop, no_new_privs, seccomp. The runtime
(crun, runc, runsc) is the mechanism; this module is the policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sandfleet.runtime.seccomp import default_profile

ID_RANGE = 65536
SHM_SIZE = 64 * 1024**2

# Docker's default set minus NET_RAW and MKNOD; SETUID/SETGID let the agent run commands as other users.
DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)

MASKED_PATHS: tuple[str, ...] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/kmsg",
    "/proc/sysrq-trigger",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/sys/kernel/debug",
    "/sys/fs/cgroup",
    "/sys/kernel/vmcoreinfo",  # the kernel's physical load address and symbol offsets: a KASLR leak
)

READONLY_PATHS: tuple[str, ...] = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys")


@dataclass(frozen=True)
class BindMount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerLimits:
    cpu: float
    memory: int
    pids: int
    cpu_period_us: int = 100_000
    best_effort: bool = False  # lowest CPU weight (the launcher also sets SCHED_IDLE; crun 1.8 cannot)

    @property
    def cpu_quota_us(self) -> int:
        return max(1000, int(self.cpu * self.cpu_period_us))


@dataclass(frozen=True)
class ContainerConfig:
    rootfs: str
    args: list[str]
    hostname: str
    limits: ContainerLimits
    cgroup_path: str
    uid_base: int
    env: list[str] = field(
        default_factory=lambda: ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    )
    binds: tuple[BindMount, ...] = ()
    shm_size: int = SHM_SIZE
    nofile: int = 4096


def build(cfg: ContainerConfig) -> dict[str, Any]:
    """Return the OCI runtime spec (1.0.2) for `cfg` as a JSON-ready dict."""
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "max=32"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={cfg.shm_size}"],
        },
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    ]
    for bind in cfg.binds:
        opts = ["rbind", "nosuid", "nodev", "rprivate"]
        if bind.read_only:
            opts.append("ro")
        mounts.append({"destination": bind.target, "type": "bind", "source": bind.source, "options": opts})

    caps = list(DEFAULT_CAPABILITIES)
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": cfg.args,
            "env": cfg.env,
            "cwd": "/",
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
            },
            "rlimits": [
                {"type": "RLIMIT_NOFILE", "hard": cfg.nofile, "soft": min(1024, cfg.nofile)},
                {"type": "RLIMIT_CORE", "hard": 0, "soft": 0},
            ],
            "noNewPrivileges": True,
            "oomScoreAdj": 500,
        },
        "root": {"path": cfg.rootfs, "readonly": False},
        "hostname": cfg.hostname,
        "mounts": mounts,
        "linux": {
            "uidMappings": [{"containerID": 0, "hostID": cfg.uid_base, "size": ID_RANGE}],
            "gidMappings": [{"containerID": 0, "hostID": cfg.uid_base, "size": ID_RANGE}],
            "namespaces": [
                {"type": "pid"},
                {"type": "network"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "user"},
                {"type": "cgroup"},
            ],
            "cgroupsPath": cfg.cgroup_path,
            "resources": {
                "memory": {"limit": cfg.limits.memory, "swap": cfg.limits.memory},
                "cpu": {"quota": cfg.limits.cpu_quota_us, "period": cfg.limits.cpu_period_us}
                | ({"shares": 2} if cfg.limits.best_effort else {}),
                "pids": {"limit": cfg.limits.pids},
                "devices": [{"allow": False, "access": "rwm"}],
            },
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
            "seccomp": default_profile(),
        },
    }
