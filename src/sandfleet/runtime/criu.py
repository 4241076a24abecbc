"""CRIU: checkpoint a sandbox's process tree and restore it into fresh namespaces.

Which criu: Debian bookworm's 3.17 cannot dump on this kernel generation (its vDSO handling
predates the layout change), trixie's 4.1.1 can. It needs trixie's glibc, so it is not installed
into the host: `scripts/setup.sh` extracts the trixie package and its libraries (mmdebstrap
--variant=extract, no maintainer scripts run) into `/opt/sandfleet/criu`, and we run the binary
through that tree's own dynamic loader. Nothing of the host's userland changes.

The sandbox's mount table is dumped with every mount that comes from outside its namespace named
as external (device-node binds, /dev and the scratch tmpfs, the shared sysfs and the empty tmpfs
masks), so a restore binds the new sandbox's own copies in their place; the rootfs overlay is the
one `--root` names. The agent binary, mapped from outside, is an external file given back on
restore by fd. Mechanism only: when to snapshot and what a snapshot may contain is the backend's.
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from pathlib import Path

from sandfleet.runtime import proc

DEFAULT_ROOT = Path("/opt/sandfleet/criu")
AGENT_FD = 4  # where the restorer finds the agent binary (the launcher's fd 4)

SCRATCH_MOUNT = "/dev/.sandfleet"


class CriuUnavailableError(RuntimeError):
    """No working criu (>= 4) at the configured place."""


@dataclass(frozen=True)
class Criu:
    root: Path = DEFAULT_ROOT

    @property
    def binary(self) -> Path:
        return self.root / "usr/sbin/criu"

    @property
    def _libdir(self) -> Path:
        return self.root / "usr/lib/x86_64-linux-gnu"

    def command(self) -> list[str]:
        """argv prefix that runs this criu with its own libraries (never the host's)."""
        loader = self._libdir / "ld-linux-x86-64.so.2"
        if not self.binary.exists() or not loader.exists():
            raise CriuUnavailableError(
                f"criu 4.x not found under {self.root} (scripts/setup.sh installs Debian trixie's criu there)"
            )
        return [str(loader), "--library-path", str(self._libdir), str(self.binary)]

    async def prime_kernel_cache(self) -> None:
        """Write criu's kernel-feature cache (/run/criu.kdat) once, so each run skips ~50 ms of probes.

        criu keeps that cache only where /run is a tmpfs (as on systemd hosts) but reads it from
        anywhere; on hosts whose /run is a plain directory we probe once per daemon start, in a
        private mount namespace with a tmpfs /run, and put the result where criu looks.
        """
        script = 'mount -t tmpfs sandfleet-kdat /run && "$@" check >/dev/null 2>&1; cat /run/criu.kdat'
        done = await proc.spawn(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *self.command()], timeout=60
        )
        if done.returncode == 0 and done.stdout:
            await asyncio.to_thread(_write_private, Path("/run/criu.kdat"), done.stdout)

    @staticmethod
    def external_mounts(mountinfo: str) -> dict[str, dict[str, str]]:
        """The mounts of a sandbox whose source is outside its namespace, classified from its
        mountinfo by filesystem: mount point -> {key (criu's name for it), kind, root (within the
        source filesystem)}. Kinds: `scratch` (/dev, /dev/shm, /dev/.sandfleet: the writable
        layer's tmpfs), `device` (host device nodes, also over masked /proc files), `sysfs` (the
        shared read-only one), `empty` (the shared empty tmpfs over masked directories). proc,
        devpts, mqueue and the rootfs are the sandbox's own; anything else (a bind mount of a host
        directory) cannot be carried and raises ValueError.
        """
        out: dict[str, dict[str, str]] = {}
        unknown = []
        for line in mountinfo.splitlines():
            fields = line.split()
            if "-" not in fields:
                continue
            sep = fields.index("-")
            root, point, fstype, source = fields[3], fields[4], fields[sep + 1], fields[sep + 2]
            if fstype in ("proc", "devpts", "mqueue") or (point == "/" and fstype == "overlay"):
                continue
            if fstype == "devtmpfs":
                kind = "device"
            elif fstype == "sysfs":
                kind = "sysfs"
            elif fstype == "tmpfs" and source == "sandfleet-scratch":
                kind = "scratch"
            elif fstype == "tmpfs" and source == "sandfleet-empty":
                kind = "empty"
            else:
                unknown.append(point)
                continue
            out[point] = {"key": "ext" + re.sub(r"[^a-z0-9]", "_", point), "kind": kind, "root": root}
        if unknown:
            raise ValueError(f"mounts a snapshot cannot carry: {', '.join(sorted(unknown))}")
        return out

    @staticmethod
    def external_file_key(path: Path) -> str:
        """criu's id of a file opened from outside the dumped namespaces (`file[mnt_id:inode]`, hex)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            mnt_id = int(fields["mnt_id"].strip())
            return f"file[{mnt_id:x}:{os.fstat(fd).st_ino:x}]"
        finally:
            os.close(fd)

    def dump_argv(
        self,
        pid: int,
        images: Path,
        *,
        externals: dict[str, dict[str, str]],
        agent_key: str,
        freezer: str | None,
        log: Path,
    ) -> list[str]:
        argv = [*self.command(), "dump", "-t", str(pid), "-D", str(images), "--leave-running"]
        argv += ["--log-file", str(log), "-v2", "--external", agent_key]
        if freezer is not None:
            # Already frozen by us (the writable layer is copied meanwhile); criu leaves it frozen.
            argv += ["--freeze-cgroup", freezer]
        for point, ext in externals.items():
            argv += ["--external", f"mnt[{point}]:{ext['key']}"]
        return argv

    def restore_argv(
        self,
        images: Path,
        *,
        rootfs: Path,
        scratch: Path,
        shared: Path,
        externals: dict[str, dict[str, str]],
        agent_key: str,
        pid_file: Path,
        log: Path,
        action_script: Path,
        cgroup_root: str,
        cgroup_controllers: list[str],
    ) -> list[str]:
        """The restore command for the launcher to run once it has made `scratch` and `rootfs`.

        `action_script` (see `write_action_script`) closes the scratch again before any task runs.
        """
        argv = [*self.command(), "restore", "-D", str(images), "--root", str(rootfs), "--restore-detached"]
        argv += ["--pidfile", str(pid_file), "--log-file", str(log), "-v2"]
        # criu moves the tasks into the new sandbox's cgroups (made by the daemon, with its limits)
        # and recreates the cgroup namespace inside the user namespace, so a child can be forked again.
        argv += ["--manage-cgroups=soft"]
        for controller in cgroup_controllers or [""]:
            argv += ["--cgroup-root", f"{controller}:{cgroup_root}" if controller else cgroup_root]
        argv += ["--inherit-fd", f"fd[{AGENT_FD}]:{agent_key}"]
        argv += ["--action-script", str(action_script)]
        for ext in externals.values():
            argv += ["--external", f"mnt[{ext['key']}]:{self._source(ext, scratch, shared)}"]
        return argv

    @staticmethod
    def write_action_script(path: Path, scratch: Path) -> None:
        """criu binds /dev from the scratch as the restored root, so the launcher opens the scratch
        to 0711 for the restore; this hook closes it to 0700 at pre-resume, before a single restored
        task runs again."""
        path.write_text(f'#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" != pre-resume ] || exec chmod 0700 "{scratch}"\n')
        os.chmod(path, 0o700)

    @staticmethod
    def _source(ext: dict[str, str], scratch: Path, shared: Path) -> str:
        """Where the new sandbox's copy of an external mount comes from (a path in the launcher's namespace)."""
        root = ext["root"].rstrip("/")
        if ext["kind"] == "scratch":
            return str(scratch) + root
        if ext["kind"] == "device":
            return "/dev" + root  # the host's node (/dev/null also backs the masked /proc files)
        if ext["kind"] == "sysfs":
            return str(shared / "sysfs")
        return str(shared / "empty")


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.sandfleet")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)
