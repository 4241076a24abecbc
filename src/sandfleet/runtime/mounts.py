"""Mount facility: the daemon's private mount namespace, shared EROFS layers, per-sandbox rootfs.

The daemon moves itself into a private mount namespace at start (`enter_private_namespace`). Every
mount it makes (layers, scratch tmpfs, overlay roots) lives there: invisible to the host, and torn
down by the kernel when the daemon and its sandboxes are gone, so a SIGKILLed daemon cannot leak a
mount into the host's table. Sandboxes' own mount namespaces are copies made by the runtime, which
keep their rootfs alive for as long as the sandbox runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2
CLONE_NEWNS = 0x00020000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class MountError(OSError):
    pass


def _raise(what: str) -> None:
    err = ctypes.get_errno()
    raise MountError(err, f"{what}: {os.strerror(err)}")


def mount(source: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        flags,
        data.encode() if data else None,
    )
    if rc != 0:
        _raise(f"mount {fstype or ''} {source} on {target}")


def umount(target: str, *, lazy: bool = False, missing_ok: bool = True) -> None:
    if _libc.umount2(target.encode(), MNT_DETACH if lazy else 0) != 0:
        err = ctypes.get_errno()
        if missing_ok and err in (errno.EINVAL, errno.ENOENT):
            return
        raise MountError(err, f"umount {target}: {os.strerror(err)}")


def mounted_under(prefix: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points at or below `prefix` (deepest first, so they can be unmounted in order)."""
    points: list[str] = []
    with open(mountinfo) as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def enter_private_namespace(*, hide_hybrid_cgroup2: bool) -> None:
    """Unshare our mount namespace; mounts from the host still propagate in, ours never out.

    `hide_hybrid_cgroup2`: crun 1.8 refuses to run on a hybrid cgroup host whose cgroup2 mount
    offers controllers; unmounting /sys/fs/cgroup/unified in our namespace only fixes that without
    touching the host (see host-notes).
    """
    if _libc.unshare(CLONE_NEWNS) != 0:
        _raise("unshare(CLONE_NEWNS)")
    mount("none", "/", None, MS_REC | MS_SLAVE)
    if hide_hybrid_cgroup2 and os.path.ismount("/sys/fs/cgroup/unified"):
        umount("/sys/fs/cgroup/unified", lazy=True)


# A layer's files as they were when they were opened and verified: (path, device, inode, size, and
# for the local image file its mtime and ctime; a blob on a shared filesystem is checked by size).
_Identity = tuple[tuple[str, int, int, int, int, int], ...]


def _identity(image_file: Path, blob: Path | None) -> _Identity:
    st = os.stat(image_file)
    out = [(str(image_file), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)]
    if blob is not None:
        st = os.stat(blob)
        out.append((str(blob), st.st_dev, st.st_ino, st.st_size, 0, 0))
    return tuple(out)


def _unchanged(identity: _Identity) -> bool:
    try:
        for i, (path, dev, ino, size, mtime, ctime) in enumerate(identity):
            st = os.stat(path)
            if (st.st_dev, st.st_ino, st.st_size) != (dev, ino, size):
                return False
            if i == 0 and (st.st_mtime_ns, st.st_ctime_ns) != (mtime, ctime):
                return False
    except OSError:
        return False
    return True


@dataclass
class _Layer:
    path: str
    refs: int
    # Its files when verified: a mount is reused only while they are the same (a file deleted or
    # replaced under the store is checked again, as a restarted daemon would check it).
    identity: _Identity
    checking: threading.Lock


# Opens a layer for mounting: its verified EROFS image file and, for an on-demand layer, the blob
# that holds its file data (else None); raises if the layer is missing or corrupt. Called when the
# layer is not mounted yet, and when its files changed since it was.
LayerOpener = Callable[[], tuple[Path, Path | None]]


def _mount_erofs(image_file: Path, target: Path, blob: Path | None) -> None:
    flags = MS_RDONLY | MS_NODEV | MS_NOSUID
    if blob is None:
        mount(str(image_file), str(target), "erofs", flags)
        return
    # `directio` reads the blob around the page cache: EROFS caches the file data itself, and a
    # buffered blob would hold every page a second time. Kernels before 6.13 lack the option.
    try:
        mount(str(image_file), str(target), "erofs", flags, f"device={blob},directio")
    except MountError as exc:
        if exc.errno != errno.EINVAL:
            raise
        mount(str(image_file), str(target), "erofs", flags, f"device={blob}")


class LayerMounts:
    """Read-only EROFS layers, each mounted once (straight from its file, no loop device) and shared."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._layers: dict[str, _Layer] = {}
        self._lock = threading.Lock()
        # Layers being mounted: a lock of their own and how many acquires wait on it. Opening a
        # layer the first time can take long (hashing a large file, fetching it from a shared
        # store) and must not stall acquires of other layers. The entry goes with its last waiter.
        self._mounting: dict[str, tuple[threading.Lock, list[int]]] = {}

    def acquire(self, digest: str, open_layer: LayerOpener) -> str:
        with self._lock:
            layer = self._layers.get(digest)
            if layer is not None:
                layer.refs += 1
            else:
                lock, waiters = self._mounting.setdefault(digest, (threading.Lock(), [0]))
                waiters[0] += 1
        if layer is not None:
            return self._reuse(digest, layer, open_layer)
        try:
            with lock:
                return self._mount_once(digest, open_layer)
        finally:
            with self._lock:
                waiters[0] -= 1
                if not waiters[0]:
                    del self._mounting[digest]

    def _reuse(self, digest: str, layer: _Layer, open_layer: LayerOpener) -> str:
        """A mounted layer (referenced already) if its files are still the ones verified; else they
        are opened again (verified, or fetched again from a shared store): the mount stays, since
        its content is the digest's either way, or the error is raised as a first mount's would be."""
        try:
            with layer.checking:
                if not _unchanged(layer.identity):
                    layer.identity = _identity(*open_layer())
        except BaseException:
            self.release(digest)
            raise
        return layer.path

    def _mount_once(self, digest: str, open_layer: LayerOpener) -> str:
        with self._lock:
            layer = self._layers.get(digest)
            if layer is not None:  # mounted by the acquire we waited for
                layer.refs += 1
        if layer is not None:
            return self._reuse(digest, layer, open_layer)
        target = self.root / digest.replace(":", "-")
        image_file, blob = open_layer()
        identity = _identity(image_file, blob)
        if not os.path.ismount(target):
            if blob is not None and "," in str(blob):
                raise MountError(errno.EINVAL, f"blob path {blob} has a comma (mount option separator)")
            target.mkdir(parents=True, exist_ok=True)
            try:
                _mount_erofs(image_file, target, blob)
            except BaseException:
                os.rmdir(target)
                raise
        with self._lock:
            layer = self._layers.setdefault(digest, _Layer(str(target), 0, identity, threading.Lock()))
            layer.refs += 1
        return layer.path

    def acquire_mounted(self, digests: list[str]) -> list[str] | None:
        """References to all of `digests` if every one is mounted and its local file is the one
        verified (a stat each; an on-demand layer's blob, maybe on a network filesystem, is not
        looked at here), else none: `acquire` then checks in a worker thread."""
        with self._lock:
            layers = [self._layers.get(d) for d in digests]
            if any(layer is None or len(layer.identity) > 1 for layer in layers):
                return None
            for layer in layers:
                assert layer is not None
                layer.refs += 1
        if all(_unchanged(layer.identity) for layer in layers if layer is not None):
            return [layer.path for layer in layers if layer is not None]
        for digest in digests:
            self.release(digest)
        return None

    def busy(self) -> set[str]:
        """Layers mounted or being mounted (their files must stay)."""
        with self._lock:
            return set(self._layers) | set(self._mounting)

    def remove_if_idle(self, digest: str, remove: Callable[[], None]) -> bool:
        """Run `remove` (deleting the layer's file) unless the layer is mounted or being mounted;
        under the lock, so no acquire can start using the file halfway."""
        with self._lock:
            if digest in self._layers or digest in self._mounting:
                return False
            remove()
            return True

    def release(self, digest: str) -> None:
        with self._lock:
            layer = self._layers.get(digest)
            if layer is not None:
                layer.refs = max(0, layer.refs - 1)

    def unmount_unused(self) -> int:
        with self._lock:
            unused = [d for d, layer in self._layers.items() if layer.refs == 0]
            for digest in unused:
                layer = self._layers.pop(digest)
                umount(layer.path, lazy=True)
                try:
                    os.rmdir(layer.path)
                except OSError:
                    pass
            return len(unused)

    def in_use(self) -> dict[str, int]:
        with self._lock:
            return {d: layer.refs for d, layer in self._layers.items()}


def mount_rootfs(
    sandbox_dir: Path, lowers: list[str], *, disk_bytes: int, owner: int, inodes: int | None = None
) -> Path:
    """Mount a size-capped scratch tmpfs and an overlay rootfs on it; return the rootfs path.

    `lowers` is bottom -> top. The writable layer lives on the scratch tmpfs so its size (and inode
    count) is capped by the kernel; its pages are charged to the writer's memory cgroup.
    """
    scratch = sandbox_dir / "scratch"
    rootfs = sandbox_dir / "rootfs"
    scratch.mkdir(exist_ok=True)
    rootfs.mkdir(exist_ok=True)
    nr_inodes = inodes if inodes is not None else max(4096, disk_bytes // 8192)
    mount(
        "sandfleet-scratch",
        str(scratch),
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={disk_bytes},nr_inodes={nr_inodes},mode=0700",
    )
    try:
        upper = scratch / "upper"
        work = scratch / "work"
        upper.mkdir()
        work.mkdir()
        # The overlay's root directory takes its owner from the upper dir: root inside must own "/".
        os.chown(upper, owner, owner)
        os.chmod(upper, 0o755)
        lowerdir = ":".join(reversed(lowers))
        mount("overlay", str(rootfs), "overlay", MS_NODEV, f"lowerdir={lowerdir},upperdir={upper},workdir={work}")
    except BaseException:
        umount(str(scratch), lazy=True)
        raise
    return rootfs


def unmount_rootfs(sandbox_dir: Path) -> None:
    for point in mounted_under(str(sandbox_dir)):
        umount(point, lazy=True)
