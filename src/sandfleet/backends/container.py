"""Container backend: sandboxes over an overlay of shared EROFS layers, started by the launcher or an OCI runtime.

Create with the launcher (the default): mount layers (shared, once per node) -> cgroup with limits
-> `sandfleet-run` (runtime/launcher.c), which mounts the scratch tmpfs and overlay rootfs inside the
sandbox's own mount namespace and applies the isolation steps -> wait for the agent's HELLO.
Create with crun or runc: layers -> scratch tmpfs + overlay rootfs in the daemon's namespace ->
config.json -> `crun run --detach` -> HELLO. Either way the agent channel is at fd 3 and the agent
binary at fd 4; the agent is PID 1 of the sandbox and sandboxed code never sees its channel on
any filesystem path.
"""

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
import signal
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox, cgroup_cpu_seconds, cgroup_usage
from sandfleet.backends.config import ContainerBackendConfig
from sandfleet.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    SandboxError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.images import ImageManifest, LayerCorruptError, LayerStore
from sandfleet.models import ContainerOptions, Resources, SandboxSpec, Usage
from sandfleet.runtime import cgroups, criu, files, mounts, oci, proc, seccomp
from sandfleet.runtime.agent import (
    AGENT_VERSION,
    AgentChannel,
    ChannelClosedError,
    build_agent,
    build_launcher,
    grab_handoff_channel,
)
from sandfleet.runtime.launcher import LaunchError, LauncherServer

log = logging.getLogger("sandfleet.container")


@dataclass(frozen=True)
class _Prepared:
    sdir: Path | None  # the sandbox's directory; launcher creates have none
    lowers: list[str]  # bottom -> top
    cgroup_dirs: list[str]  # launcher only: cgroup directories the sandbox joins
    binds: list[tuple[int, oci.BindMount]]  # launcher only: pinned O_PATH fds of the sources
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


def _nofile(spec: SandboxSpec) -> int:
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


class ContainerBackend:
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

    def _check_mounts(self, spec: SandboxSpec) -> list[tuple[str, str, oci.BindMount]]:
        """Lexical check: each source lies under an allowlisted directory -> (root, relative path, mount)."""
        out = []
        roots = [os.path.realpath(p) for p in self.config.mount_allowlist]
        for m in spec.mounts:
            source = os.path.normpath(m.source)
            for root in roots:
                if source == root or source.startswith(root.rstrip("/") + "/"):
                    out.append((root, os.path.relpath(source, root), oci.BindMount(source, m.target, m.read_only)))
                    break
            else:
                raise InvalidArgumentError(f"mount source {m.source} is not under the daemon's mount_allowlist")
        return out

    @staticmethod
    def _pin_bind(root: str, rel: str, bind: oci.BindMount) -> int:
        """Pin the mount source now, without following any symlink: an O_PATH fd of the very object.

        A path string checked now and resolved again later by the runtime could be swapped for a
        symlink in between (by a sandbox that has the allowlisted directory mounted read-write).
        openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) pins the object; the launcher mounts a copy
        of that fd's mount (open_tree), an OCI runtime a staged bind of it.
        """
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            resolve = files.RESOLVE_BENEATH | files.RESOLVE_NO_SYMLINKS | files.RESOLVE_NO_MAGICLINKS
            try:
                fd = files.openat2(root_fd, rel, os.O_PATH | os.O_CLOEXEC, 0, resolve)
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
    def _stage_bind(sdir: Path, index: int, fd: int, bind: oci.BindMount) -> oci.BindMount:
        """For an OCI runtime: bind the pinned object onto a root-only staging point in our namespace."""
        staging = sdir / "binds" / str(index)
        staging.parent.mkdir(mode=0o711, exist_ok=True)  # the runtime mounts it as the sandbox uid
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            staging.mkdir()
        else:
            staging.touch()
        mounts.mount(f"/proc/self/fd/{fd}", str(staging), None, mounts.MS_BIND)
        return oci.BindMount(str(staging), bind.target, bind.read_only)

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
        binds: list[tuple[str, str, oci.BindMount]],
        acquired: list[str] | None = None,
        *,
        own_dir: bool = False,
    ) -> _Prepared:
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
        pinned: list[tuple[int, oci.BindMount]] = []
        try:
            for root, rel, bind in binds:
                pinned.append((self._pin_bind(root, rel, bind), bind))
            for digest in digests[len(lowers) :]:
                lowers.append(self.layers.acquire(digest, functools.partial(self._open_layer, digest)))
            limits = oci.ContainerLimits(
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
                return _Prepared(sdir, lowers, plan.dirs, pinned, plan.writes)
            assert sdir is not None
            staged = [self._stage_bind(sdir, i, fd, bind) for i, (fd, bind) in enumerate(pinned)]
            rootfs = mounts.mount_rootfs(sdir, lowers, disk_bytes=spec.resources.disk, owner=self.config.uid_base)
            cfg = oci.ContainerConfig(
                rootfs=str(rootfs),
                args=["/proc/self/fd/4"],
                hostname=spec.hostname or sandbox_id,
                limits=limits,
                cgroup_path=self.cgroups.path_for(sandbox_id),
                uid_base=self.config.uid_base,
                binds=tuple(staged),
                nofile=_nofile(spec),
            )
            (sdir / "config.json").write_text(json.dumps(oci.build(cfg)))
            for fd, _bind in pinned:
                os.close(fd)
            return _Prepared(sdir, lowers, [], [])
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
        binds: list[tuple[str, str, oci.BindMount]],
        *,
        own_dir: bool = False,
    ) -> _Prepared:
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

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        assert self._agent_fd is not None, "backend not started"
        binds = self._check_mounts(spec)
        try:
            prepared = await self._prepare_uncancellable(sandbox_id, spec, [x.digest for x in image.layers], binds)
        except LayerCorruptError as exc:
            raise DataLossError(f"image {image.name}:{image.tag} has a corrupt layer: {exc}") from exc
        except OSError as exc:
            raise InternalError(f"preparing the sandbox failed: {exc}") from exc
        runtime: dict[str, Any] = {"layers": [layer.digest for layer in image.layers]}
        if self.uses_launcher:
            runtime["userns_owner"] = self._new_owner()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            try:
                if self.uses_launcher:
                    pid = await self._launch(sandbox_id, spec, prepared, theirs.fileno(), runtime["userns_owner"])
                else:
                    assert prepared.sdir is not None
                    pid = await self._run_oci(sandbox_id, prepared.sdir, theirs.fileno())
            finally:
                theirs.close()
                for fd, _bind in prepared.binds:
                    os.close(fd)
            runtime["agent_pid"] = pid
            runtime["agent_start_time"] = proc.process_start_time(pid)
            channel = AgentChannel(ours)
            try:
                await channel.wait_hello(timeout=self.config.start_timeout)
            except (TimeoutError, ChannelClosedError) as exc:
                channel.close()
                raise UnavailableError("sandbox agent did not come up") from exc
            return self._live(sandbox_id, channel, runtime)
        except BaseException as exc:
            ours.close()
            await asyncio.shield(self.cleanup(sandbox_id, runtime))
            if isinstance(exc, SandboxError | asyncio.CancelledError):
                raise
            if isinstance(exc, OSError | ValueError):
                raise InternalError(f"starting the sandbox failed: {exc}") from exc
            raise

    async def _launch(
        self, sandbox_id: str, spec: SandboxSpec, prepared: _Prepared, channel_fd: int, owner: int
    ) -> int:
        """Start the agent with the launcher server; return its pid."""
        assert self._launcher is not None
        disk = spec.resources.disk
        args = ["--uid", str(self.config.uid_base), "--owner", str(owner)]
        args += ["--hostname", spec.hostname or sandbox_id, "--nofile", str(_nofile(spec))]
        args += ["--disk", str(disk), "--inodes", str(max(4096, disk // 8192)), "--qos", spec.qos]
        for lower in reversed(prepared.lowers):  # overlay wants the top layer first
            args += ["--lower", lower]
        args += prepared.cgroup_args()
        for i, (_fd, bind) in enumerate(prepared.binds):
            args += ["--bind", f"{6 + i}:{'ro' if bind.read_only else 'rw'}:{bind.target}"]
        try:
            return await self._launcher.launch(
                args,
                channel_fd=channel_fd,
                bind_fds=[fd for fd, _bind in prepared.binds],
                timeout=self.config.start_timeout,
            )
        except TimeoutError as exc:
            raise UnavailableError("the launcher did not start the sandbox in time") from exc
        except LaunchError as exc:
            if exc.invalid:
                raise InvalidArgumentError(exc.message) from exc
            if exc.unavailable:
                raise UnavailableError(f"the sandbox was not started: {exc.message}") from exc
            raise InternalError(f"starting the sandbox failed: {exc.message}") from exc

    async def _run_oci(self, sandbox_id: str, sdir: Path, channel_fd: int) -> int:
        """Start the agent with `crun/runc run --detach`; return its pid."""
        assert self._agent_fd is not None
        pid_file = sdir / "agent.pid"
        log_file = sdir / "runtime.log"
        argv = [self.config.runtime, "--root", str(self.runtime_root), "--log", self._log_arg(log_file)]
        argv += ["run", "--detach", "--preserve-fds", "2", "--pid-file", str(pid_file), "--bundle", str(sdir)]
        argv.append(sandbox_id)
        # The runtime chowns its stdio to the sandbox root (crun 1.8.1 does so even to the host's
        # /dev/null: containers/crun#1845), so it gets private ones: an empty pipe and a log file.
        stdin_r, stdin_w = os.pipe2(os.O_CLOEXEC)
        os.close(stdin_w)
        out = os.open(sdir / "runtime.stdio", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            done = await proc.spawn(
                argv,
                fd_map={0: stdin_r, 1: out, 2: out, 3: channel_fd, 4: self._agent_fd},
                timeout=self.config.start_timeout,
                capture=False,
            )
        except TimeoutError as exc:
            raise UnavailableError(f"{self.config.runtime} did not start the sandbox in time") from exc
        finally:
            os.close(stdin_r)
            os.close(out)
        proc.reap_orphans()  # the runtime's own detached helper, if it has already exited
        if done.returncode != 0:
            try:
                log = log_file.read_text(errors="replace").strip()[-2000:]
            except OSError:
                log = ""
            raise InternalError(f"{self.config.runtime} run failed ({done.returncode}): {log}")
        return int(pid_file.read_text().strip())

    def _log_arg(self, log_file: Path) -> str:
        # crun takes a log *driver* spec, runc a plain path.
        return f"file:{log_file}" if self.config.runtime == "crun" else str(log_file)

    # -- destroy / cleanup ------------------------------------------------------------------

    async def destroy(self, sandbox: LiveSandbox) -> None:
        sandbox.channel.close()
        await self.cleanup(sandbox.id, sandbox.runtime)

    # -- pause / resume -------------------------------------------------------------------------

    async def pause(self, sandbox: LiveSandbox) -> tuple[int, int]:
        rel = self.cgroups.path_for(sandbox.id)

        def run() -> tuple[int, int]:
            before = self.cgroups.memory_bytes(rel)
            self.cgroups.freeze(rel)
            try:
                self.cgroups.reclaim(rel)
            except BaseException:
                self.cgroups.thaw(rel)
                raise
            return before, self.cgroups.memory_bytes(rel)

        try:
            return await asyncio.to_thread(run)
        except (OSError, TimeoutError) as exc:
            raise InternalError(f"pausing sandbox {sandbox.id} failed: {exc}") from exc

    async def resume(self, sandbox: LiveSandbox) -> None:
        try:
            await asyncio.to_thread(self.cgroups.thaw, self.cgroups.path_for(sandbox.id))
        except (OSError, TimeoutError) as exc:
            raise InternalError(f"resuming sandbox {sandbox.id} failed: {exc}") from exc

    def _thaw_quietly(self, sandbox_id: str) -> None:
        """Frozen tasks do not die of SIGKILL until thawed, and a frozen agent cannot answer."""
        rel = self.cgroups.path_for(sandbox_id)
        if self.cgroups.frozen(rel):
            with contextlib.suppress(OSError, TimeoutError):
                self.cgroups.thaw(rel)

    def _is_ours(self, sandbox_id: str, pid: int, start_time: int | None) -> bool:
        """Is `pid` still this sandbox's init? By start time if we know it, else by its cgroup."""
        if start_time is not None:
            return proc.process_start_time(pid) == start_time
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                return f"{self.cgroups.path_for(sandbox_id)}\n" in f.read().replace(":", "\n")
        except OSError:
            return False

    async def _kill_and_wait(self, sandbox_id: str, pid: int, start_time: int | None) -> None:
        """SIGKILL the sandbox's init (its pid namespace dies with it) and wait, on one pidfd."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        loop = asyncio.get_running_loop()
        try:
            # Checked after opening the pidfd: from here on it cannot refer to a recycled pid.
            if not self._is_ours(sandbox_id, pid, start_time):
                return
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            exited = loop.create_future()
            loop.add_reader(pidfd, lambda: None if exited.done() else exited.set_result(None))
            try:
                async with asyncio.timeout(10):
                    await exited
            except TimeoutError:
                # Stuck in uninterruptible sleep; the runtime's delete below still removes its
                # cgroup once it goes, and a later restart retries.
                log.warning("sandbox init %d did not exit within 10s of SIGKILL", pid)
            finally:
                loop.remove_reader(pidfd)
            # Our child when we launched it (we are a subreaper); merely a process after a restart.
            # Reaped through the pidfd: exactly this process, even if the orphan reaper got its
            # zombie first and the pid has been reused since.
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 (never blocks)
        finally:
            os.close(pidfd)

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        await asyncio.to_thread(self._thaw_quietly, sandbox_id)
        pid = runtime.get("agent_pid")
        if isinstance(pid, int):
            await self._kill_and_wait(sandbox_id, pid, runtime.get("agent_start_time"))
        elif self.uses_launcher:
            # Half-created: whatever the launcher started joined the cgroup first.
            await self._kill_cgroup(sandbox_id)
        else:
            # Half-created: the runtime may have written its pid file before we read it; only its
            # cgroup membership tells whether that pid is still the sandbox's init.
            pid_file = self.sandboxes_dir / sandbox_id / "agent.pid"
            with contextlib.suppress(OSError, ValueError):
                await self._kill_and_wait(sandbox_id, int(pid_file.read_text().strip()), None)
        if (self.runtime_root / sandbox_id).exists():
            with contextlib.suppress(TimeoutError):
                await proc.spawn(
                    [self.config.runtime, "--root", str(self.runtime_root), "delete", "--force", sandbox_id],
                    timeout=self.config.start_timeout,
                )
        digests = runtime.get("layers", [])
        await asyncio.to_thread(self._teardown_files, sandbox_id, digests if isinstance(digests, list) else [])
        self._release_owner(runtime)  # its namespace is gone with its last process

    async def _kill_cgroup(self, sandbox_id: str) -> None:
        rel = self.cgroups.path_for(sandbox_id)
        for _ in range(100):
            if await asyncio.to_thread(self.cgroups.kill_all, rel) == 0:
                proc.reap_orphans()  # the killed init, our child by now, is a zombie the reaper knows
                return
            await asyncio.sleep(0.01)
        log.warning("processes of half-created sandbox %s survived SIGKILL for 1s", sandbox_id)

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

    # -- snapshot and restore (criu) ------------------------------------------------------------

    def _criu(self) -> criu.Criu:
        if not self.uses_launcher:
            raise InvalidArgumentError("snapshots need the launcher runtime (container.runtime = 'launcher')")
        tool = criu.Criu(self.config.criu_root, shim=self._shim_path)
        try:
            tool.command()
        except criu.CriuUnavailableError as exc:
            raise UnavailableError(str(exc)) from exc
        return tool

    async def snapshot(self, sandbox: LiveSandbox, target: Path) -> dict[str, Any]:
        """Writable layer + criu images of the whole process tree, taken while the cgroup is frozen.

        Steps: the agent moves its channel to a socketpair of its own (criu cannot dump our end's
        socket, made in the host's network namespace) -> freeze -> copy the writable layer and /dev
        from the scratch tmpfs (reached at /proc/PID/root/dev/.sandfleet) -> criu dump, leaving the
        tree running -> thaw -> take the agent's new channel over, every exec still attached.
        """
        tool = self._criu()
        assert self.agent_path is not None
        if sandbox.channel.agent_version != AGENT_VERSION:
            raise WrongStateError(
                f"sandbox {sandbox.id} runs {sandbox.channel.agent_version}, from before the daemon was upgraded; "
                f"snapshots need {AGENT_VERSION}"
            )
        if sandbox.runtime.get("restored"):
            # criu checks a tree's namespaces from inside its user namespace, where it may not read a
            # non-dumpable init whose memory was set up by criu itself (owned by the host's user
            # namespace); making the agent dumpable for that would open its fds to sandboxed code.
            raise WrongStateError(
                f"sandbox {sandbox.id} was itself restored from a snapshot: snapshot or fork its source instead"
            )
        pid = sandbox.agent_pid
        try:
            mountinfo = await asyncio.to_thread(Path(f"/proc/{pid}/mountinfo").read_text)
            externals = criu.Criu.external_mounts(mountinfo)
        except ValueError as exc:
            raise InvalidArgumentError(f"sandbox {sandbox.id} cannot be snapshotted: {exc}") from exc
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running") from exc
        # The agent binary as the sandbox maps it: criu names it by its mount (in the namespace of the
        # daemon that started the sandbox, perhaps not this one) and inode, and a restore gives this
        # daemon's copy back in its place, so it must be this very file.
        try:
            exe = Path(f"/proc/{pid}/exe")
            if not os.path.samestat(os.stat(exe), os.stat(self.agent_path)):
                raise WrongStateError(
                    f"sandbox {sandbox.id} runs another build of the agent than this daemon's (started before an "
                    "upgrade): it cannot be snapshotted"
                )
            agent_key = criu.Criu.external_file_key(exe)
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running") from exc
        rel = self.cgroups.path_for(sandbox.id)
        images, fs = target / "img", target / "fs"
        images.mkdir(parents=True)
        fs.mkdir()
        log_file = target / "dump.log"
        channel = sandbox.channel
        next_id = channel.next_id
        try:
            await channel.reopen(timeout=self.config.start_timeout)
        except (TimeoutError, ChannelClosedError) as exc:
            await self._take_new_channel(sandbox)  # it may still have moved; if not, the sandbox is lost
            raise UnavailableError(f"the agent of {sandbox.id} did not hand over its channel") from exc
        except BaseException:  # cancelled past REOPEN: sends stay held until the new channel is taken
            await self._take_new_channel(sandbox)
            raise
        try:
            await asyncio.to_thread(self.cgroups.freeze, rel)
            try:
                await self._copy_scratch(sandbox, ["upper", "dev"], fs)
                argv = tool.dump_argv(
                    pid,
                    images,
                    externals=externals,
                    agent_key=agent_key,
                    freezer=str(self.cgroups.freezer_dir(rel)),
                    log=log_file,
                )
                ooms = await asyncio.to_thread(self._oom_kills, sandbox)
                done = await proc.spawn(argv, timeout=300)
                if done.returncode != 0:
                    why = _criu_error(log_file)
                    if await asyncio.to_thread(self._oom_kills, sandbox) > ooms or "killed by 9 unexpectedly" in why:
                        # criu's parasite runs in the sandbox's processes and needs a little memory
                        # there: a sandbox at its memory limit loses one to the OOM killer (or killed
                        # it itself). The sandbox's state, not the node's.
                        raise WrongStateError(
                            f"a process of sandbox {sandbox.id} was killed while it was being checkpointed "
                            f"(at its memory limit? raise it, or free memory, and retry): {why}"[:500]
                        )
                    raise InternalError(f"criu dump failed ({done.returncode}): {why}")
                # Still frozen: the tree the images were taken from is the one checked.
                await self._check_restore_paths(sandbox, images)
            finally:
                await asyncio.to_thread(self._thaw_quietly, sandbox.id)
        finally:
            await self._take_new_channel(sandbox)
        if channel.closed:
            raise UnavailableError(f"sandbox {sandbox.id} was lost while its snapshot was taken")
        return {
            "layers": sandbox.runtime.get("layers", []),
            "externals": externals,
            "agent_key": agent_key,
            "agent": self.agent_path.parent.name,  # the build: criu maps this very binary back
            # The restored agent still runs the snapshot's execs: new ids start past theirs.
            "next_id": max(next_id, channel.next_id) + 1024,
            # Every path a restore creates by name was checked (restores refuse snapshots without).
            "paths_checked": 1,
        }

    async def _check_restore_paths(self, sandbox: LiveSandbox, images: Path) -> None:
        """Refuse a snapshot whose restore would create or remove a file through a path the sandbox
        controls (see criu.unsafe_restore_paths): an open file that was deleted is recreated by
        criu, by name, as host root, before the restored tree is confined to its own root."""
        if not await asyncio.to_thread((images / "remap-fpath.img").exists):
            return  # nothing is recreated by path (the common case)
        t0 = time.perf_counter()
        try:
            root = os.open(f"/proc/{sandbox.agent_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running") from exc
        try:
            problems = await asyncio.to_thread(criu.unsafe_restore_paths, images, root)
        except (criu.ImageError, OSError) as exc:
            raise InternalError(f"checking the snapshot of {sandbox.id} failed: {exc}") from exc
        finally:
            os.close(root)
        log.debug("sandbox %s: restore paths checked in %.2f ms", sandbox.id, (time.perf_counter() - t0) * 1000)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise WrongStateError(
                f"sandbox {sandbox.id} cannot be snapshotted: {problems[0]}{more}. A restore recreates such "
                "a file by that path before the new sandbox is confined to its root, so it would land outside "
                "it. Close the file (or end the process holding it open), or put a real directory back on its "
                "path, then snapshot or fork again"
            )

    async def _copy_scratch(self, sandbox: LiveSandbox, parts: list[str], dest: Path) -> None:
        """`cp -a` parts of a (frozen) sandbox's scratch tmpfs into `dest`: whiteouts, xattrs, owners kept."""
        if not self.uses_launcher:
            raise InvalidArgumentError("this needs the launcher runtime (container.runtime = 'launcher')")
        scratch = f"/proc/{sandbox.agent_pid}/root{criu.SCRATCH_MOUNT}"
        done = await proc.spawn(["cp", "-a", "--", *(f"{scratch}/{part}" for part in parts), str(dest)], timeout=600)
        if done.returncode != 0:
            why = done.stderr.decode(errors="replace")[-500:]
            raise InternalError(f"copying the writable layer of {sandbox.id} failed: {why}")

    async def export_writable_layer(self, sandbox: LiveSandbox, dest: Path) -> None:
        """Copy the sandbox's writable layer, as overlayfs keeps it, to `dest` (made here).

        The sandbox is frozen meanwhile, so the copy is of one moment. Overlay whiteouts (0/0
        character devices) and opaque-directory xattrs are kept, so the copy works as a layer
        above the sandbox's own layers; ownership stays shifted (root inside = uid_base).
        """
        rel = self.cgroups.path_for(sandbox.id)
        was_frozen = await asyncio.to_thread(self.cgroups.frozen, rel)
        staging = dest.parent / f".{dest.name}.copy"
        await asyncio.to_thread(staging.mkdir, 0o700, True)
        try:
            await asyncio.to_thread(self.cgroups.freeze, rel)
            try:
                await self._copy_scratch(sandbox, ["upper"], staging)
            finally:
                if not was_frozen:
                    await asyncio.to_thread(self._thaw_quietly, sandbox.id)
            await asyncio.to_thread((staging / "upper").rename, dest)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

    @staticmethod
    async def _grab_channel(
        pid: int, seconds: float, until: Callable[[], bool] = lambda: False
    ) -> socket.socket | None:
        """The channel an agent offers on its fd 4 (after losing or moving its old one), polled for up
        to `seconds`; None if it offers none (or `until()` says to stop waiting)."""
        deadline = time.monotonic() + seconds
        while not until():
            try:
                return await asyncio.to_thread(grab_handoff_channel, pid)
            except OSError:
                if time.monotonic() > deadline:
                    return None
                await asyncio.sleep(0.01)
        return None

    def _live(self, sandbox_id: str, channel: AgentChannel, runtime: dict[str, Any]) -> LiveSandbox:
        return LiveSandbox(
            id=sandbox_id,
            channel=channel,
            agent_pid=runtime["agent_pid"],
            agent_start_time=runtime.get("agent_start_time"),
            uid_base=self.config.uid_base,
            runtime=runtime,
        )

    async def _take_new_channel(self, sandbox: LiveSandbox) -> None:
        """After a reopen: adopt the socketpair the agent offers on fd 4; failing that, the sandbox is lost."""
        sock = await self._grab_channel(sandbox.agent_pid, 5.0, until=lambda: sandbox.channel.closed)
        if sock is not None:
            try:
                sandbox.channel.adopt_socket(sock)
            except ChannelClosedError:
                sock.close()
                return
            with contextlib.suppress(TimeoutError, ChannelClosedError):
                await sandbox.channel.ping(timeout=5)  # the agent parks fd 4 again on its first message
            return
        if sandbox.channel.closed:
            return
        log.error("sandbox %s: the agent offered no new channel after a reopen", sandbox.id)
        sandbox.channel.fail("the agent offered no new channel after a reopen")

    async def restore(self, sandbox_id: str, spec: SandboxSpec, source: Path, meta: dict[str, Any]) -> LiveSandbox:
        tool = self._criu()
        assert self._launcher is not None and self.agent_path is not None
        if meta.get("agent") != self.agent_path.parent.name:
            raise WrongStateError("the snapshot was taken with another build of the agent (before an upgrade)")
        if not meta.get("paths_checked"):
            raise WrongStateError(
                "the snapshot was taken before snapshots were checked for files a restore would recreate "
                "outside the sandbox (an upgrade): take a new snapshot"
            )
        async with self._restores:
            return await self._restore(sandbox_id, spec, source, meta, tool)

    async def _restore(
        self, sandbox_id: str, spec: SandboxSpec, source: Path, meta: dict[str, Any], tool: criu.Criu
    ) -> LiveSandbox:
        assert self._launcher is not None
        digests = [str(d) for d in meta["layers"]]
        try:
            prepared = await self._prepare_uncancellable(sandbox_id, spec, digests, [], own_dir=True)
        except LayerCorruptError as exc:
            raise DataLossError(f"a layer of the snapshot is corrupt: {exc}") from exc
        except OSError as exc:
            raise InternalError(f"preparing the sandbox failed: {exc}") from exc
        owner = self._new_owner()
        runtime: dict[str, Any] = {"layers": digests, "restored": True, "userns_owner": owner}
        sdir = prepared.sdir
        assert sdir is not None
        log_file = sdir / "restore.log"
        try:
            disk = spec.resources.disk
            args = ["--restore", str(source), "--dir", str(sdir), "--pid-file", str(sdir / "agent.pid")]
            args += ["--uid", str(self.config.uid_base), "--owner", str(owner)]
            args += ["--disk", str(disk), "--inodes", str(max(4096, disk // 8192))]
            for lower in reversed(prepared.lowers):
                args += ["--lower", lower]
            args += prepared.cgroup_args()
            args.append("--")
            args += tool.restore_argv(
                source / "img",
                rootfs=sdir / "r",
                scratch=sdir / "s",
                shared=self.run_dir / "shared",
                externals=dict(meta["externals"]),
                agent_key=str(meta["agent_key"]),
                pid_file=sdir / "agent.pid",
                log=log_file,
                action_script=sdir / "criu-action.sh",
                cgroup_root=self.cgroups.path_for(sandbox_id),
                cgroup_controllers=[] if self.cgroups.mode == "v2" else list(cgroups.V1_JOINED),
            )
            await asyncio.to_thread(criu.Criu.write_action_script, sdir / "criu-action.sh", sdir / "s")
            placeholder = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)  # no channel: the agent has its own
            try:
                pid = await self._launcher.launch(args, channel_fd=placeholder, bind_fds=[], timeout=60)
            except TimeoutError as exc:
                raise UnavailableError("restoring the snapshot timed out") from exc
            except LaunchError as exc:
                if exc.unavailable:
                    raise UnavailableError(f"the snapshot was not restored: {exc.message}") from exc
                raise InternalError(f"restoring the snapshot failed: {exc.message}: {_criu_error(log_file)}") from exc
            finally:
                os.close(placeholder)
            runtime["agent_pid"] = pid
            runtime["agent_start_time"] = proc.process_start_time(pid)
            if userns_owner(pid) != owner:  # criu made the namespace; the shim makes it the sandbox's own
                raise InternalError("the restored sandbox's user namespace is not owned by its own uid")
            sock = await self._grab_channel(pid, 2.5)
            if sock is None:
                raise UnavailableError("the restored agent offered no channel")
            channel = AgentChannel(sock, first_id=int(meta.get("next_id", 1)))
            # The parent's sessions and background processes go on here under the same exec ids:
            # their handles exist before the agent is told to drop every other exec.
            keep = [int(i) for i in meta.get("keep_execs", [])]
            inherited = {exec_id: channel.attach(exec_id, -1) for exec_id in keep}
            try:
                await channel.wait_hello(timeout=self.config.start_timeout)
                await channel.forget(keep)  # the parent's other execs run on here, but nobody asks for them
                await channel.ping(timeout=self.config.start_timeout)
            except (TimeoutError, ChannelClosedError) as exc:
                channel.close()
                raise UnavailableError("the restored agent did not answer") from exc
            live = self._live(sandbox_id, channel, runtime)
            live.inherited = inherited
            return live
        except BaseException as exc:
            await asyncio.shield(self.cleanup(sandbox_id, runtime))
            if isinstance(exc, SandboxError | asyncio.CancelledError):
                raise
            if isinstance(exc, OSError | ValueError | KeyError):
                raise InternalError(f"restoring the snapshot failed: {exc}") from exc
            raise

    # -- adoption after a daemon restart -----------------------------------------------------

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        pid = runtime.get("agent_pid")
        if not isinstance(pid, int) or proc.process_start_time(pid) != runtime.get("agent_start_time"):
            return None
        await asyncio.to_thread(self._thaw_quietly, sandbox_id)  # paused when the old daemon died
        # The agent notices the old channel's EOF and offers a new one at fd 4.
        sock = await self._grab_channel(pid, 2.0)
        if sock is None:
            return None
        channel = AgentChannel(sock)
        try:
            await channel.wait_hello(timeout=5)
            await channel.forget()  # execs of the previous daemon (orphaned already, unless it died mid-snapshot)
            await channel.ping(timeout=5)
        except (TimeoutError, ChannelClosedError):
            channel.close()
            return None
        # Layers stay mounted inside the sandbox's own namespace; re-acquire our shared copies.
        digests = runtime.get("layers", [])
        for digest in digests if isinstance(digests, list) else []:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.layers.acquire, digest, functools.partial(self._open_layer, digest))
        self._keep_owner(runtime)  # never handed to another sandbox while this one lives
        return self._live(sandbox_id, channel, runtime)

    async def recover(self, sandbox_id: str) -> tuple[LiveSandbox, Resources] | None:
        """A sandbox running on the node that the daemon has no record of (its state database was
        lost): its agent is the cgroup's `sandfleet-agent` whose parent is outside the cgroup."""
        rel = self.cgroups.path_for(sandbox_id)
        agent = await asyncio.to_thread(self._find_agent, rel)
        if agent is None:
            return None
        runtime: dict[str, Any] = {"agent_pid": agent, "agent_start_time": proc.process_start_time(agent), "layers": []}
        owner = userns_owner(agent)
        if owner is not None and OWNER_BASE <= owner < OWNER_BASE + OWNER_SPAN:
            runtime["userns_owner"] = owner
        live = await self.adopt(sandbox_id, runtime)
        if live is None:
            return None
        memory, cpu, pids = await asyncio.to_thread(self.cgroups.limits, rel)
        fields: dict[str, Any] = {}
        if memory is not None and 16 * 1024**2 <= memory <= 2**40:
            fields["memory"] = memory
        if cpu is not None and 0 < cpu <= 256:
            fields["cpu"] = round(cpu, 3)
            fields["cpu_request"] = min(round(cpu, 3), 0.1)
        if pids is not None and 8 <= pids <= 32768:
            fields["pids"] = pids
        try:
            resources = Resources.model_validate(fields)
        except ValueError:
            resources = Resources()
        return live, resources

    def _find_agent(self, rel: str) -> int | None:
        members = set(self.cgroups.procs(rel))
        for pid in members:
            try:
                stat_text = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            name = stat_text[stat_text.find("(") + 1 : stat_text.rfind(")")]
            ppid = int(stat_text[stat_text.rfind(")") + 2 :].split()[1])
            if name == "sandfleet-agent" and ppid not in members:
                return pid
        return None

    def mount_points(self, sandbox: LiveSandbox) -> frozenset[str]:
        """Where the sandbox has mounts, as paths inside it (from its agent's mountinfo)."""
        try:
            text = Path(f"/proc/{sandbox.agent_pid}/mountinfo").read_text()
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running") from exc
        return files.mount_points(text)

    # -- introspection ------------------------------------------------------------------------

    def open_root(self, sandbox: LiveSandbox) -> int:
        fd = os.open(f"/proc/{sandbox.agent_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if proc.process_start_time(sandbox.agent_pid) != sandbox.agent_start_time:
            os.close(fd)
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running")
        return fd

    def usage(self, sandbox: LiveSandbox) -> Usage:
        return cgroup_usage(self.cgroups, sandbox)

    def _oom_kills(self, sandbox: LiveSandbox) -> int:
        try:
            return self.usage(sandbox).oom_kills
        except OSError:
            return 0

    def netns_path(self, sandbox: LiveSandbox) -> str:
        return f"/proc/{sandbox.agent_pid}/ns/net"

    def init_pid(self, sandbox: LiveSandbox) -> int:
        return sandbox.agent_pid

    def layer_paths(self, sandbox: LiveSandbox) -> tuple[Path, list[Path]]:
        # The scratch tmpfs is bound at /dev/.sandfleet in every sandbox (launcher.c), readable by
        # the host's root only; the layers are the shared EROFS mounts, named by digest.
        upper = Path(f"/proc/{sandbox.agent_pid}/root/dev/.sandfleet/upper")
        digests = sandbox.runtime.get("layers", [])
        return upper, [self.layers.root / d.replace(":", "-") for d in reversed(digests)]

    def cpu_seconds(self, sandbox: LiveSandbox | None) -> float:
        return cgroup_cpu_seconds(self.cgroups, sandbox)

    def residue(self) -> set[str]:
        found = self.leftovers()
        return set(found.get("sandbox_dirs", [])) | set(found.get("cgroups", []))

    def leftovers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        with contextlib.suppress(FileNotFoundError):
            out["sandbox_dirs"] = sorted(os.listdir(self.sandboxes_dir))
        with contextlib.suppress(FileNotFoundError):
            out["runtime_state"] = sorted(os.listdir(self.runtime_root))
        out["cgroups"] = sorted(self.cgroups.children())
        out["mounts"] = mounts.mounted_under(str(self.sandboxes_dir))
        return out


def _criu_error(log_file: Path) -> str:
    """The error lines of a criu log (criu reports through its log, not stderr)."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return "(no criu log)"
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return " | ".join((errors or lines)[-4:])[-1500:]
