"""The container tier's node-wide parts and what one sandbox is started from: its layers mounted,
its bind mounts pinned, its cgroup and limits, and (crun/runc) its OCI bundle (bundle.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import resource
import secrets
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.backends.config import ContainerBackendConfig
from sandfleet.backends.container import bundle
from sandfleet.errors import (
    InvalidArgumentError,
    UnavailableError,
)
from sandfleet.images import LayerStore
from sandfleet.models import ContainerOptions, SandboxSpec
from sandfleet.runtime import cgroups, criu, mounts, seccomp
from sandfleet.runtime.agent_build import build_agent, build_launcher
from sandfleet.runtime.launcher import LaunchError, LauncherServer
from sandfleet.runtime.openat2 import RESOLVE_BENEATH, RESOLVE_NO_MAGICLINKS, RESOLVE_NO_SYMLINKS, openat2

log = logging.getLogger("sandfleet.container")


@dataclass(frozen=True)
class Prepared:
    sdir: Path | None  # the sandbox's directory; launcher creates have none
    lowers: list[str]  # bottom -> top
    cgroup_dirs: list[str]  # launcher only: cgroup directories the sandbox joins
    binds: list[tuple[int, bundle.BindMount]]  # launcher only: pinned O_PATH fds of the sources
    cgroup_writes: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # launcher: limits to write

    def cgroup_args(self) -> list[str]:
        """The launcher makes the cgroups and writes their limits (in C: no Python per file)."""
        args = []
        for d in self.cgroup_dirs:
            args += ["--cg-dir", d]
        for path, value in self.cgroup_writes:
            args += ["--cg-write", f"{path}={value}"]
        for d in self.cgroup_dirs:
            args += ["--cgroup", d]
        return args


def _file_max() -> int:
    try:
        with open("/proc/sys/fs/file-max") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


FILE_MAX = _file_max()
FILES_SHARE = 0.25  # of the host's file-max that one sandbox's processes may hold by descriptors


@functools.cache
def _nofile_limit(pids: int) -> int:
    """RLIMIT_NOFILE (hard) for a sandbox's processes, sized against the host: all `pids` of them
    at their limit hold at most a quarter of file-max (never below 256, never above 4096, never
    above our own hard limit: without CAP_SYS_RESOURCE, as on this host, a sandbox could not be
    given more). Files a sandbox keeps mapped after closing them are charged to its memory cgroup
    instead (the daemon raises file-max so that memory is what binds)."""
    share = int(FILES_SHARE * FILE_MAX / max(1, pids))
    return max(256, min(4096, share, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


def spec_nofile(spec: SandboxSpec) -> int:
    """The sandbox's RLIMIT_NOFILE: the node's limit for its pids, or lower if its options ask."""
    limit = _nofile_limit(spec.resources.pids)
    asked = spec.options.nofile if isinstance(spec.options, ContainerOptions) else None
    return min(limit, asked) if asked is not None else limit


# The uids that own sandboxes' user namespaces (launcher runtime): one per live sandbox, picked at
# random from a range no host process or file uses (and below 2^31, clear of any id map). The kernel
# charges a user namespace's per-user counts (inotify instances, fanotify groups, mqueue bytes,
# queued signals, namespaces) to its owner, so each sandbox has its own instead of sharing host
# root's with every other sandbox and the host. The owner uid is a capability: a host process
# running as it could enter the sandbox's user namespace with every capability there.
OWNER_BASE = 2_000_000_000
OWNER_SPAN = 1 << 27
NS_GET_OWNER_UID = 0xB704  # _IO(0xb7, 0x4)


def userns_owner(pid: int) -> int | None:
    """The uid that owns the user namespace of process `pid` (None if it is gone)."""
    try:
        fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, NS_GET_OWNER_UID, buf)
        return int.from_bytes(buf, "little")
    except OSError:
        return None
    finally:
        os.close(fd)


class ContainerPreparation:
    """The node-wide parts (agent, launcher, seccomp filter, layer mounts, owner uids) and what one
    sandbox is started from (layers, binds, cgroup limits, its OCI bundle)."""

    name = "container"

    def __init__(self, config: ContainerBackendConfig, *, state_dir: Path, run_dir: Path, store: LayerStore) -> None:
        self.config = config
        self.store = store
        self.state_dir = state_dir
        self.run_dir = run_dir
        self.sandboxes_dir = run_dir / "sandboxes"
        self.runtime_root = run_dir / config.runtime
        self.layers = mounts.LayerMounts(run_dir / "layers")
        self.cgroups = cgroups.Cgroups(config.cgroup_parent)
        self.agent_path: Path | None = None
        self._agent_fd: int | None = None
        self.launcher_path: Path | None = None
        self._seccomp_fd: int | None = None  # the compiled filter, in a sealed memfd the launcher preads
        self._launcher: LauncherServer | None = None
        self._restores = asyncio.Semaphore(16)  # criu restores at once (each a few CPU-heavy processes)
        self._shim_path: Path | None = None  # criu's preload shim (criu_shim.c)
        self._owners: set[int] = set()  # user-namespace owner uids of live (and starting) sandboxes

    @property
    def uses_launcher(self) -> bool:
        return self.config.runtime == "launcher"

    def supports(self, capability: str) -> bool:
        """Snapshots (criu of the launcher's tree) and pack (the scratch tmpfs the launcher mounts)
        need the launcher runtime."""
        return self.uses_launcher or capability not in ("snapshot", "pack", "layer_view")

    async def start(self) -> None:
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        if self.uses_launcher:
            self.launcher_path = await asyncio.to_thread(build_launcher, self.state_dir / "launcher")
            try:
                bpf = await asyncio.to_thread(seccomp.compile_bpf, seccomp.default_profile())
            except seccomp.SeccompUnavailableError as exc:
                raise UnavailableError(str(exc)) from exc
            fd = os.memfd_create("sandfleet-seccomp", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            os.write(fd, bpf)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK)
            self._seccomp_fd = fd
        else:
            self.runtime_root.mkdir(parents=True, exist_ok=True)
            if shutil.which(self.config.runtime) is None:
                raise UnavailableError(
                    f"OCI runtime {self.config.runtime!r} not found (apt-get install {self.config.runtime})"
                )
        self.agent_path = await asyncio.to_thread(build_agent, self.state_dir / "agent")
        self._agent_fd = os.open(self.agent_path, os.O_RDONLY | os.O_CLOEXEC)
        self.cgroups = cgroups.Cgroups(self.config.cgroup_parent)  # re-detect inside our mount namespace
        if self.uses_launcher:
            assert self.launcher_path is not None and self._seccomp_fd is not None
            self._launcher = LauncherServer(
                self.launcher_path,
                agent_fd=self._agent_fd,
                seccomp_fd=self._seccomp_fd,
                shared_dir=self.run_dir / "shared",
            )
            try:
                await self._launcher.start()
            except LaunchError as exc:
                self._launcher = None
                raise UnavailableError(exc.message) from exc
            try:
                self._shim_path = await asyncio.to_thread(criu.build_shim, self.state_dir / "criu-shim")
            except (criu.ShimBuildError, OSError) as exc:
                raise UnavailableError(str(exc)) from exc
            tool = criu.Criu(self.config.criu_root)
            with contextlib.suppress(criu.CriuUnavailableError, OSError, TimeoutError):
                await tool.prime_kernel_cache()  # snapshots work without it, only slower

    async def close(self) -> None:
        if self._launcher is not None:
            await self._launcher.close()
            self._launcher = None
        if self._agent_fd is not None:
            os.close(self._agent_fd)
            self._agent_fd = None
        if self._seccomp_fd is not None:
            os.close(self._seccomp_fd)
            self._seccomp_fd = None
        await asyncio.to_thread(self.layers.unmount_unused)
        await asyncio.to_thread(self.cgroups.remove_parent_if_empty)

    async def unmount_unused_layers(self) -> int:
        return await asyncio.to_thread(self.layers.unmount_unused)

    def busy_layers(self) -> set[str]:
        return self.layers.busy()

    def remove_layer_if_idle(self, digest: str, remove: Callable[[], None]) -> bool:
        return self.layers.remove_if_idle(digest, remove)

    # -- user-namespace owners ------------------------------------------------------------

    def _new_owner(self) -> int:
        """An owner uid for a new sandbox's user namespace: none other alive has it."""
        while True:
            owner = OWNER_BASE + secrets.randbelow(OWNER_SPAN)
            if owner not in self._owners:
                self._owners.add(owner)
                return owner

    def _keep_owner(self, runtime: dict[str, Any]) -> None:
        owner = runtime.get("userns_owner")
        if isinstance(owner, int):
            self._owners.add(owner)

    def _release_owner(self, runtime: dict[str, Any]) -> None:
        owner = runtime.get("userns_owner")
        if isinstance(owner, int):
            self._owners.discard(owner)

    # -- create ---------------------------------------------------------------------------

    def _check_mounts(self, spec: SandboxSpec) -> list[tuple[str, str, bundle.BindMount]]:
        """Lexical check: each source lies under an allowlisted directory -> (root, relative path, mount)."""
        out = []
        roots = [os.path.realpath(p) for p in self.config.mount_allowlist]
        for m in spec.mounts:
            source = os.path.normpath(m.source)
            for root in roots:
                if source == root or source.startswith(root.rstrip("/") + "/"):
                    out.append((root, os.path.relpath(source, root), bundle.BindMount(source, m.target, m.read_only)))
                    break
            else:
                raise InvalidArgumentError(f"mount source {m.source} is not under the daemon's mount_allowlist")
        return out

    @staticmethod
    def _pin_bind(root: str, rel: str, bind: bundle.BindMount) -> int:
        """Pin the mount source now, without following any symlink: an O_PATH fd of the very object.

        A path string checked now and resolved again later by the runtime could be swapped for a
        symlink in between (by a sandbox that has the allowlisted directory mounted read-write).
        openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) pins the object; the launcher mounts a copy
        of that fd's mount (open_tree), an OCI runtime a staged bind of it.
        """
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
            try:
                fd = openat2(root_fd, rel, os.O_PATH | os.O_CLOEXEC, 0, resolve)
            except OSError as exc:
                raise InvalidArgumentError(
                    f"mount source {bind.source} cannot be used ({exc.strerror}; symlinks are not allowed)"
                ) from exc
        finally:
            os.close(root_fd)
        st = os.fstat(fd)
        if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
            os.close(fd)
            raise InvalidArgumentError(f"mount source {bind.source} is neither a file nor a directory")
        return fd

    @staticmethod
    def _stage_bind(sdir: Path, index: int, fd: int, bind: bundle.BindMount) -> bundle.BindMount:
        """For an OCI runtime: bind the pinned object onto a root-only staging point in our namespace."""
        staging = sdir / "binds" / str(index)
        staging.parent.mkdir(mode=0o711, exist_ok=True)  # the runtime mounts it as the sandbox uid
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            staging.mkdir()
        else:
            staging.touch()
        mounts.mount(f"/proc/self/fd/{fd}", str(staging), None, mounts.MS_BIND)
        return bundle.BindMount(str(staging), bind.target, bind.read_only)

    def _open_layer(self, digest: str) -> tuple[Path, Path | None]:
        """A layer about to be mounted on this node: its verified image file, and its data blob if
        the layer is on demand (blocking: the first use hashes the file once)."""
        path = self.store.verified_layer_path(digest)
        blob = self.store.blob_path(digest)
        self.store.touch(path)
        return path, blob

    def _prepare(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        digests: list[str],
        binds: list[tuple[str, str, bundle.BindMount]],
        acquired: list[str] | None = None,
        *,
        own_dir: bool = False,
    ) -> Prepared:
        """Blocking part of create (mounts, cgroups, files); runs in a worker thread.

        On failure everything made here is undone before the error propagates.
        """
        lowers: list[str] = list(acquired or [])  # `acquired`: references taken by the caller
        # Launcher creates need no directory: the scratch and the rootfs are mounted on mount
        # points of the launcher's template namespace, so a create makes and a stop removes no
        # directory on the host's disk. Restores (criu's log, pid file and action script) and OCI
        # runtimes (the bundle) have one.
        sdir: Path | None = None
        if own_dir or not self.uses_launcher:
            sdir = self.sandboxes_dir / sandbox_id
            try:
                sdir.mkdir(mode=0o711)  # traversable by the sandbox root uid, not listable
                if self.uses_launcher:  # a restore's scratch and rootfs (the launcher adds l/N)
                    (sdir / "s").mkdir()
                    (sdir / "r").mkdir()
            except BaseException:
                for digest in digests[: len(lowers)]:
                    self.layers.release(digest)
                shutil.rmtree(sdir, ignore_errors=True)
                raise
        pinned: list[tuple[int, bundle.BindMount]] = []
        try:
            for root, rel, bind in binds:
                pinned.append((self._pin_bind(root, rel, bind), bind))
            for digest in digests[len(lowers) :]:
                lowers.append(self.layers.acquire(digest, functools.partial(self._open_layer, digest)))
            limits = bundle.ContainerLimits(
                cpu=spec.resources.cpu,
                memory=spec.resources.memory,
                pids=spec.resources.pids,
                best_effort=spec.qos == "best_effort",
            )
            if self.uses_launcher:
                plan = self.cgroups.plan(
                    self.cgroups.path_for(sandbox_id),
                    memory=limits.memory,
                    cpu_quota_us=limits.cpu_quota_us,
                    cpu_period_us=limits.cpu_period_us,
                    pids=limits.pids,
                    best_effort=limits.best_effort,
                )
                return Prepared(sdir, lowers, plan.dirs, pinned, plan.writes)
            assert sdir is not None
            staged = [self._stage_bind(sdir, i, fd, bind) for i, (fd, bind) in enumerate(pinned)]
            rootfs = mounts.mount_rootfs(sdir, lowers, disk_bytes=spec.resources.disk, owner=self.config.uid_base)
            cfg = bundle.ContainerConfig(
                rootfs=str(rootfs),
                args=["/proc/self/fd/4"],
                hostname=spec.hostname or sandbox_id,
                limits=limits,
                cgroup_path=self.cgroups.path_for(sandbox_id),
                uid_base=self.config.uid_base,
                binds=tuple(staged),
                nofile=spec_nofile(spec),
            )
            (sdir / "config.json").write_text(json.dumps(bundle.build(cfg)))
            for fd, _bind in pinned:
                os.close(fd)
            return Prepared(sdir, lowers, [], [])
        except BaseException:
            for fd, _bind in pinned:
                os.close(fd)
            self._teardown_files(sandbox_id, digests[: len(lowers)])
            raise

    async def _prepare_uncancellable(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        digests: list[str],
        binds: list[tuple[str, str, bundle.BindMount]],
        *,
        own_dir: bool = False,
    ) -> Prepared:
        """`_prepare` in a worker thread; if we are cancelled meanwhile, undo what it made once it is done.

        The common case (layers mounted already, no bind mounts, the launcher making the cgroups)
        touches no file: done right here, since a thread hop costs more than that.
        """
        if self.uses_launcher and not binds and not own_dir:
            lowers = self.layers.acquire_mounted(digests)  # atomically: a concurrent gc may unmount
            if lowers is not None:
                return self._prepare(sandbox_id, spec, digests, binds, lowers)
        task = asyncio.ensure_future(
            asyncio.to_thread(functools.partial(self._prepare, sandbox_id, spec, digests, binds, own_dir=own_dir))
        )
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                prepared = await task
                for fd, _bind in prepared.binds:
                    os.close(fd)
                await asyncio.to_thread(self._teardown_files, sandbox_id, digests)
            raise

    def _teardown_files(self, sandbox_id: str, digests: list[str]) -> None:
        sdir = self.sandboxes_dir / sandbox_id
        if os.path.lexists(sdir):  # launcher creates have none (restores and OCI runtimes do)
            mounts.unmount_rootfs(sdir)
            shutil.rmtree(sdir, ignore_errors=True)
        if not self.uses_launcher:
            shutil.rmtree(self.runtime_root / sandbox_id, ignore_errors=True)
        cg = self.cgroups.path_for(sandbox_id)
        with contextlib.suppress(OSError):
            self.cgroups.remove(cg)
        for digest in digests:
            self.layers.release(digest)
