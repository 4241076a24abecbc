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
import errno
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sandfleet.runtime import proc
from sandfleet.runtime.agent_build import build_shared
from sandfleet.runtime.agent_errors import AgentBuildError
from sandfleet.runtime.openat2 import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2

DEFAULT_ROOT = Path("/opt/sandfleet/criu")
AGENT_FD = 4  # where the restorer finds the agent binary (the launcher's fd 4)

SCRATCH_MOUNT = "/dev/.sandfleet"
# What the launcher binds from outside (launcher.c: devices[] and the /dev/null over masked files),
# and where in the scratch tmpfs the sandbox's /dev, /dev/shm and /dev/.sandfleet come from.
DEVICE_ROOTS = frozenset({"/null", "/zero", "/full", "/random", "/urandom", "/tty"})
SCRATCH_ROOTS = frozenset({"/", "/dev", "/dev/shm"})

SHIM_SOURCE = Path(__file__).with_name("criu_shim.c")
SHIM_NAME = "sandfleet-criu-shim.so"
# The environment variable that tells the shim which uid owns the user namespace criu restores into.
OWNER_ENV = "SANDFLEET_USERNS_OWNER"
# ... and which pid is the init of the tree a dump checks (a restored one's too: see the shim).
DUMP_ROOT_ENV = "SANDFLEET_DUMP_ROOT"


class CriuUnavailableError(RuntimeError):
    """No working criu (>= 4) at the configured place."""


class ShimBuildError(RuntimeError):
    """The criu preload shim did not compile."""


@dataclass(frozen=True)
class Criu:
    root: Path = DEFAULT_ROOT
    # LD_PRELOAD-style shim (criu_shim.c): the restored user namespace is owned by the sandbox's
    # own uid, a dump may read the rlimits of tasks in such a namespace, and a tree criu restored
    # can be dumped again (its init stays non-dumpable).
    shim: Path | None = None

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
        # --preload loads the shim into criu only: unlike LD_PRELOAD, the programs criu runs (ip,
        # iptables-restore, the action script) do not inherit it.
        preload = ["--preload", str(self.shim)] if self.shim is not None else []
        return [str(loader), *preload, "--library-path", str(self._libdir), str(self.binary)]

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
            # A restore binds each of these by path as host root: only the roots the launcher
            # itself mounts are carried (the sandbox cannot mount, so nothing else can show up).
            if fstype == "devtmpfs" and root in DEVICE_ROOTS:
                kind = "device"
            elif fstype == "sysfs":
                kind = "sysfs"
            elif fstype == "tmpfs" and source == "sandfleet-scratch" and root in SCRATCH_ROOTS:
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
        # The sandbox's network is locked while it is dumped, and again while it is restored (the
        # images name the method): by one nftables table, not iptables-restore runs for IPv4 and
        # IPv6 each way, ~120 ms of every dump and restore here.
        argv += ["--log-file", str(log), "-v2", "--network-lock", "nftables", "--external", agent_key]
        if freezer is not None:
            # Already frozen by us (the writable layer is copied meanwhile); criu leaves it frozen.
            argv += ["--freeze-cgroup", freezer]
        for point, ext in externals.items():
            argv += ["--external", f"mnt[{point}]:{ext['key']}"]
        return argv

    @staticmethod
    def dump_env(pid: int) -> dict[str, str]:
        """The environment for `dump_argv`'s command: the shim's name for the dumped init."""
        return {**os.environ, DUMP_ROOT_ENV: str(pid)}

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


# -- the shim ---------------------------------------------------------------------------------------


def build_shim(cache_dir: Path) -> Path:
    """Compile criu_shim.c to ``cache_dir/<hash>/sandfleet-criu-shim.so`` (content-addressed, reused).

    A shared object built against the host's glibc; criu's own (newer) glibc provides every symbol
    version it needs.
    """
    try:
        return build_shared(SHIM_SOURCE, cache_dir, SHIM_NAME)
    except AgentBuildError as exc:
        raise ShimBuildError(str(exc)) from exc


# -- what a restore would create by path ----------------------------------------------------------------
#
# criu recreates an open file that was deleted (a "ghost") by path before the restored tree enters
# its mount namespace: the restore's root task opens, mknods, mkdirs or symlinks
# `<name>.cr.<id>.ghost` (a directory: `<name>` itself, with mkdir -p) under the tree criu assembles
# on the host, following whatever symlinks lie on that path, and criu itself, as host root, unlinks
# it again at the end (also after a failure). The names are the sandbox's. So before a snapshot is
# kept, every such path is walked in the frozen sandbox: each directory on it must be a real
# directory (or not exist: criu then makes real directories, or goes up a level) on the file's own
# mount.
#
# Images are read without protobuf: u32 LE IMG_COMMON_MAGIC, u32 LE image magic, then repeated
# [u32 LE length, message] (criu/image.c, criu/protobuf.c).

IMG_COMMON_MAGIC = 0x54564319
FILES_MAGIC = 0x56303138
REMAP_FPATH_MAGIC = 0x59133954
GHOST_FILE_MAGIC = 0x52583605
MOUNTPOINTS_MAGIC = 0x55563928

FD_TYPE_REG = 1  # fdinfo.proto fd_types
REMAP_LINKED, REMAP_GHOST, REMAP_PROCFS = 0, 1, 2  # remap-file-path.proto remap_type
REMAP_GHOST_BIT = 0x80000000  # images without remap_type: ghosts have this bit in remap_id

_WALK = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
_MAX_ENTRIES = 1 << 20


class ImageError(ValueError):
    """A criu image that does not parse as one."""


Message = dict[int, list[int | bytes]]


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ImageError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def decode_message(buf: bytes) -> Message:
    """One protobuf message: field number -> its values (varints as int, length-delimited as bytes)."""
    out: Message = {}
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        wire = key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise ImageError("truncated field")
            value, pos = buf[pos : pos + size], pos + size
        elif wire == 5:
            if pos + 4 > len(buf):
                raise ImageError("truncated field")
            value, pos = struct.unpack_from("<I", buf, pos)[0], pos + 4
        elif wire == 1:
            if pos + 8 > len(buf):
                raise ImageError("truncated field")
            value, pos = struct.unpack_from("<Q", buf, pos)[0], pos + 8
        else:
            raise ImageError(f"unsupported wire type {wire}")
        out.setdefault(key >> 3, []).append(value)
    return out


def read_image(path: Path, magic: int, *, first_only: bool = False) -> Iterator[Message]:
    """The messages of one criu image file."""
    buf = path.read_bytes()
    if len(buf) < 8 or struct.unpack_from("<II", buf, 0) != (IMG_COMMON_MAGIC, magic):
        raise ImageError(f"{path.name}: not a criu image of the expected kind")
    pos = 8
    for _ in range(_MAX_ENTRIES):
        if pos >= len(buf):
            return
        if pos + 4 > len(buf):
            raise ImageError(f"{path.name}: truncated")
        (size,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if pos + size > len(buf):
            raise ImageError(f"{path.name}: truncated")
        yield decode_message(buf[pos : pos + size])
        pos += size
        if first_only:
            return
    raise ImageError(f"{path.name}: too many entries")


def _int(msg: Message, field: int, default: int = 0) -> int:
    value = msg.get(field, [default])[0]
    if not isinstance(value, int):
        raise ImageError(f"field {field} is not a number")
    return value


def _bytes(msg: Message, field: int) -> bytes | None:
    value = msg.get(field, [None])[0]
    if value is None or isinstance(value, bytes):
        return value
    raise ImageError(f"field {field} is not a string")


def _zigzag(value: int) -> int:
    return (value >> 1) ^ -(value & 1)


@dataclass(frozen=True)
class Remap:
    """A file criu restores by path instead of by reopening its name."""

    kind: int  # REMAP_LINKED, REMAP_GHOST or REMAP_PROCFS
    name: bytes  # the file's path in the sandbox, as its descriptor showed it (without " (deleted)")
    path: bytes  # what criu creates (ghosts) or links from (link remaps)
    mnt_id: int  # the mount the file is on (the kernel's id, as in the sandbox's mountinfo)
    mode: int = 0  # ghosts: the deleted file's type and mode


def restore_remaps(images: Path) -> list[Remap]:
    """Every ghost, link remap and dead-process remap in a dump's images."""
    remap_image = images / "remap-fpath.img"
    if not remap_image.exists():
        return []
    entries = list(read_image(remap_image, REMAP_FPATH_MAGIC))
    if not entries:
        return []
    regs: dict[int, tuple[bytes, int]] = {}
    for entry in read_image(images / "files.img", FILES_MAGIC):
        reg = entry.get(3)
        if _int(entry, 1) == FD_TYPE_REG and reg and isinstance(reg[0], bytes):
            fields = decode_message(reg[0])
            regs[_int(entry, 2)] = (_bytes(fields, 6) or b"", _zigzag(_int(fields, 7, 1)) if 7 in fields else -1)
    out = []
    for entry in entries:
        orig, remap_id = _int(entry, 1), _int(entry, 2)
        if 3 in entry:
            kind = _int(entry, 3)
        else:
            kind = REMAP_GHOST if remap_id & REMAP_GHOST_BIT else REMAP_LINKED
            remap_id &= ~REMAP_GHOST_BIT
        if orig not in regs:
            raise ImageError(f"remap of an unknown file {orig:#x}")
        name, mnt_id = regs[orig]
        if kind == REMAP_GHOST:
            (ghost,) = read_image(images / f"ghost-file-{remap_id:x}.img", GHOST_FILE_MAGIC, first_only=True)
            mode = _int(ghost, 3)
            # criu/files-reg.c open_remap_ghost: a directory is made under its own name
            path = name if stat.S_ISDIR(mode) else name + b".cr.%x.ghost" % remap_id
            out.append(Remap(kind, name, path, mnt_id, mode))
        elif kind == REMAP_LINKED:
            out.append(Remap(kind, name, regs[remap_id][0] if remap_id in regs else b"", mnt_id))
        else:
            out.append(Remap(kind, name, name, mnt_id))
    return out


def mount_points(images: Path) -> dict[int, bytes]:
    """mnt_id -> mount point, from the dump's mountpoints images."""
    out: dict[int, bytes] = {}
    for image in images.glob("mountpoints-*.img"):
        for entry in read_image(image, MOUNTPOINTS_MAGIC):
            point = _bytes(entry, 7)
            if point is not None:
                out[_int(entry, 2)] = point
    return out


def _components(path: bytes) -> list[bytes]:
    return [c for c in path.split(b"/") if c]


def _mnt_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    return -1


def _show(path: bytes) -> str:
    return os.fsdecode(path).encode("unicode_escape", "backslashreplace").decode()


def unsafe_restore_paths(images: Path, root_fd: int) -> list[str]:
    """Why restoring these images could act on a path outside the sandbox: one sentence per file,
    empty if nothing would. `root_fd`: the frozen sandbox's root (/proc/<agent>/root), the tree the
    images were dumped from."""
    remaps = restore_remaps(images)
    if not remaps:
        return []
    mounts = mount_points(images)
    ghosts = {tuple(_components(r.path)) for r in remaps if r.kind == REMAP_GHOST}
    problems = []
    for remap in remaps:
        if stat.S_ISDIR(remap.mode):
            what = f"the deleted directory {_show(remap.name)}, still open (or a working directory) in the sandbox,"
        else:
            noun = "FIFO" if stat.S_ISFIFO(remap.mode) else "file"
            what = f"the deleted {noun} {_show(remap.name)}, still open in the sandbox,"
        if remap.kind == REMAP_PROCFS:
            continue  # a helper task holds /proc/<pid> of a dead process: nothing is made by path
        if remap.kind == REMAP_LINKED:  # never dumped without --link-remap
            problems.append(f"{what} would be restored through a link remap")
            continue
        kind = stat.S_IFMT(remap.mode)
        if kind == stat.S_IFLNK:
            problems.append(f"the deleted symlink {_show(remap.name)}, still held open (O_PATH), cannot be recreated")
            continue
        if kind in (stat.S_IFCHR, stat.S_IFBLK):
            problems.append(f"the deleted device node {_show(remap.name)}, still open, cannot be recreated")
            continue
        why = _why_unsafe(root_fd, remap, mounts, ghosts)
        if why:
            problems.append(f"{what} {why}")
    return problems


def _why_unsafe(root_fd: int, remap: Remap, mounts: dict[int, bytes], ghosts: set[tuple[bytes, ...]]) -> str | None:
    parts = _components(remap.path)
    if not parts or any(c in (b".", b"..") for c in parts):
        return f"has a path criu cannot recreate safely ({_show(remap.path)})"
    point = mounts.get(remap.mnt_id)
    if point is None or parts[: len(_components(point))] != _components(point):
        return "is on a mount the snapshot does not know"
    for depth in range(1, len(parts)):
        if tuple(parts[:depth]) in ghosts:
            inside = _show(b"/" + b"/".join(parts[:depth]))
            return f"would be recreated inside {inside}, another file criu recreates first"
    fd = os.dup(root_fd)
    try:
        for depth, part in enumerate(parts[:-1]):
            try:
                nfd = openat2(fd, part, os.O_PATH | os.O_DIRECTORY, 0, _WALK)  # a symlink: ELOOP
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    break  # criu makes real directories from here (or goes up a level)
                where = _show(b"/" + b"/".join(parts[: depth + 1]))
                if exc.errno in (errno.ELOOP, errno.EXDEV):
                    return f"would be recreated through {where}, which is now a symlink"
                return f"would be recreated through {where} ({exc.strerror})"
            os.close(fd)
            fd = nfd
        # the deepest directory criu reaches must be on the file's own mount (criu walks that mount
        # alone, not what other mounts cover)
        if _mnt_id(fd) != remap.mnt_id:
            return "would be recreated on another mount than its own"
    finally:
        os.close(fd)
    return None
