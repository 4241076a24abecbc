"""Container backend: an OCI runtime (crun by default) over an overlay of shared EROFS layers.

Create, in order: mount layers (shared, once per node) -> scratch tmpfs + overlay rootfs ->
config.json -> `crun run --detach` with the agent channel at fd 3 and the agent binary at fd 4 ->
wait for the agent's HELLO. The agent is PID 1 of the sandbox; sandboxed code never sees its
channel on any filesystem path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import shutil
import signal
import socket
import stat
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sandfleet.backends.base import LiveSandbox
from sandfleet.errors import InternalError, InvalidArgumentError, SandboxError, UnavailableError
from sandfleet.images import ImageManifest, LayerCorruptError, LayerStore
from sandfleet.models import SandboxSpec
from sandfleet.runtime import cgroups, files, mounts, oci, proc
from sandfleet.runtime.agent import AgentChannel, ChannelClosedError, build_agent, grab_handoff_channel
from sandfleet.runtime.cgroups import CgroupStats

log = logging.getLogger("sandfleet.container")


class ContainerBackendConfig(BaseModel):
    """Settings of the container backend."""

    model_config = ConfigDict(extra="forbid")

    runtime: Literal["crun", "runc"] = Field("crun", description="OCI runtime binary to drive")
    uid_base: int = Field(100000, ge=1, description="host uid/gid that root inside a sandbox maps to")
    cgroup_parent: str = Field("/sandfleet", description="cgroup under which sandbox cgroups are made")
    start_timeout: float = Field(20.0, gt=0, description="seconds to wait for the runtime and agent")
    mount_allowlist: list[str] = Field(
        default_factory=list, description="host directories whose subpaths sandboxes may bind-mount"
    )


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

    async def start(self) -> None:
        self.sandboxes_dir.mkdir(parents=True, exist_ok=True)
        self.runtime_root.mkdir(parents=True, exist_ok=True)
        if shutil.which(self.config.runtime) is None:
            raise UnavailableError(
                f"OCI runtime {self.config.runtime!r} not found (apt-get install {self.config.runtime})"
            )
        self.agent_path = await asyncio.to_thread(build_agent, self.state_dir / "agent")
        self._agent_fd = os.open(self.agent_path, os.O_RDONLY | os.O_CLOEXEC)
        self.cgroups = cgroups.Cgroups(self.config.cgroup_parent)  # re-detect inside our mount namespace

    async def close(self) -> None:
        if self._agent_fd is not None:
            os.close(self._agent_fd)
            self._agent_fd = None
        await asyncio.to_thread(self.layers.unmount_unused)
        await asyncio.to_thread(self.cgroups.remove_parent_if_empty)

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
    def _stage_bind(sdir: Path, index: int, root: str, rel: str, bind: oci.BindMount) -> oci.BindMount:
        """Pin the mount source now, without following any symlink, and hand the runtime a private copy.

        A path string checked now and resolved again later by the runtime could be swapped for a
        symlink in between (by a sandbox that has the allowlisted directory mounted read-write).
        openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS) pins the object; a bind mount of that very
        object onto a root-only staging point in our mount namespace is what the runtime sees.
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
        try:
            st = os.fstat(fd)
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise InvalidArgumentError(f"mount source {bind.source} is neither a file nor a directory")
            staging = sdir / "binds" / str(index)
            staging.parent.mkdir(mode=0o711, exist_ok=True)  # the runtime mounts it as the sandbox uid
            if stat.S_ISDIR(st.st_mode):
                staging.mkdir()
            else:
                staging.touch()
            mounts.mount(f"/proc/self/fd/{fd}", str(staging), None, mounts.MS_BIND)
        finally:
            os.close(fd)
        return oci.BindMount(str(staging), bind.target, bind.read_only)

    def _prepare(
        self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest, binds: list[tuple[str, str, oci.BindMount]]
    ) -> Path:
        """Blocking part of create (mounts, files); runs in a worker thread."""
        sdir = self.sandboxes_dir / sandbox_id
        sdir.mkdir(mode=0o711)  # traversable by the sandbox root uid, not listable
        lowers: list[str] = []
        try:
            staged = [self._stage_bind(sdir, i, *b) for i, b in enumerate(binds)]
            for layer in image.layers:
                lowers.append(self.layers.acquire(layer.digest, self.store.layer_path(layer.digest)))
            rootfs = mounts.mount_rootfs(sdir, lowers, disk_bytes=spec.resources.disk, owner=self.config.uid_base)
            cfg = oci.ContainerConfig(
                rootfs=str(rootfs),
                args=["/proc/self/fd/4"],
                hostname=spec.hostname or sandbox_id,
                limits=oci.ContainerLimits(
                    cpu=spec.resources.cpu, memory=spec.resources.memory, pids=spec.resources.pids
                ),
                cgroup_path=self.cgroups.path_for(sandbox_id),
                uid_base=self.config.uid_base,
                binds=tuple(staged),
                # Never above our own hard limit: without CAP_SYS_RESOURCE (as on this host) the
                # runtime could not raise it and every create would fail.
                nofile=min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
            )
            (sdir / "config.json").write_text(json.dumps(oci.build(cfg)))
        except BaseException:
            self._teardown_files(sandbox_id, [layer.digest for layer in image.layers][: len(lowers)])
            raise
        return sdir

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        assert self._agent_fd is not None, "backend not started"
        binds = self._check_mounts(spec)
        try:
            sdir = await asyncio.to_thread(self._prepare, sandbox_id, spec, image, binds)
        except LayerCorruptError as exc:
            raise InternalError(f"image {image.name}:{image.tag} has a corrupt layer: {exc}") from exc
        except OSError as exc:
            raise InternalError(f"preparing the sandbox root failed: {exc}") from exc
        digests = [layer.digest for layer in image.layers]
        runtime: dict[str, Any] = {"layers": digests}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            pid_file = sdir / "agent.pid"
            log_file = sdir / "runtime.log"
            argv = [
                self.config.runtime,
                "--root",
                str(self.runtime_root),
                "--log",
                self._log_arg(log_file),
                "run",
                "--detach",
                "--preserve-fds",
                "2",
                "--pid-file",
                str(pid_file),
                "--bundle",
                str(sdir),
                sandbox_id,
            ]
            try:
                done = await proc.spawn(
                    argv,
                    fd_map={3: theirs.fileno(), 4: self._agent_fd},
                    timeout=self.config.start_timeout,
                    capture=False,
                )
            except TimeoutError as exc:
                raise UnavailableError(f"{self.config.runtime} did not start the sandbox in time") from exc
            finally:
                theirs.close()
            proc.reap_orphans()  # the runtime's own detached helper, if it has already exited
            if done.returncode != 0:
                try:
                    log = log_file.read_text(errors="replace").strip()[-2000:]
                except OSError:
                    log = ""
                raise InternalError(f"{self.config.runtime} run failed ({done.returncode}): {log}")
            pid = int(pid_file.read_text().strip())
            runtime["agent_pid"] = pid
            runtime["agent_start_time"] = proc.process_start_time(pid)
            channel = AgentChannel(ours)
            try:
                await channel.wait_hello(timeout=self.config.start_timeout)
            except (TimeoutError, ChannelClosedError) as exc:
                channel.close()
                raise UnavailableError("sandbox agent did not come up") from exc
            return LiveSandbox(
                id=sandbox_id,
                channel=channel,
                agent_pid=pid,
                agent_start_time=runtime["agent_start_time"],
                uid_base=self.config.uid_base,
                runtime=runtime,
            )
        except BaseException as exc:
            ours.close()
            await asyncio.shield(self.cleanup(sandbox_id, runtime))
            if isinstance(exc, SandboxError | asyncio.CancelledError):
                raise
            if isinstance(exc, OSError | ValueError):
                raise InternalError(f"starting the sandbox failed: {exc}") from exc
            raise

    def _log_arg(self, log_file: Path) -> str:
        # crun takes a log *driver* spec, runc a plain path.
        return f"file:{log_file}" if self.config.runtime == "crun" else str(log_file)

    # -- destroy / cleanup ------------------------------------------------------------------

    async def destroy(self, sandbox: LiveSandbox) -> None:
        sandbox.channel.close()
        await self.cleanup(sandbox.id, sandbox.runtime)

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
        finally:
            os.close(pidfd)
        # Our child when we launched it (we are a subreaper); merely a process after a restart.
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (WNOHANG: never blocks)

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        pid = runtime.get("agent_pid")
        if isinstance(pid, int):
            await self._kill_and_wait(sandbox_id, pid, runtime.get("agent_start_time"))
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

    def _teardown_files(self, sandbox_id: str, digests: list[str]) -> None:
        sdir = self.sandboxes_dir / sandbox_id
        mounts.unmount_rootfs(sdir)
        shutil.rmtree(sdir, ignore_errors=True)
        shutil.rmtree(self.runtime_root / sandbox_id, ignore_errors=True)
        cg = self.cgroups.path_for(sandbox_id)
        with contextlib.suppress(OSError):
            self.cgroups.remove(cg)
        for digest in digests:
            self.layers.release(digest)

    # -- adoption after a daemon restart -----------------------------------------------------

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        pid = runtime.get("agent_pid")
        if not isinstance(pid, int) or proc.process_start_time(pid) != runtime.get("agent_start_time"):
            return None
        sock: socket.socket | None = None
        for _ in range(100):  # the agent notices the old channel's EOF and offers a new one at fd 4
            try:
                sock = await asyncio.to_thread(grab_handoff_channel, pid)
                break
            except OSError:
                await asyncio.sleep(0.02)
        if sock is None:
            return None
        channel = AgentChannel(sock)
        try:
            await channel.wait_hello(timeout=5)
            await channel.ping(timeout=5)
        except (TimeoutError, ChannelClosedError):
            channel.close()
            return None
        # Layers stay mounted inside the sandbox's own namespace; re-acquire our shared copies.
        digests = runtime.get("layers", [])
        for digest in digests if isinstance(digests, list) else []:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.layers.acquire, digest, self.store.layer_path(digest))
        return LiveSandbox(
            id=sandbox_id,
            channel=channel,
            agent_pid=pid,
            agent_start_time=runtime.get("agent_start_time"),
            uid_base=self.config.uid_base,
            runtime=runtime,
        )

    # -- introspection ------------------------------------------------------------------------

    def open_root(self, sandbox: LiveSandbox) -> int:
        fd = os.open(f"/proc/{sandbox.agent_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if proc.process_start_time(sandbox.agent_pid) != sandbox.agent_start_time:
            os.close(fd)
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running")
        return fd

    def stats(self, sandbox: LiveSandbox) -> CgroupStats:
        return self.cgroups.stats(self.cgroups.path_for(sandbox.id))

    def leftovers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        with contextlib.suppress(FileNotFoundError):
            out["sandbox_dirs"] = sorted(os.listdir(self.sandboxes_dir))
        with contextlib.suppress(FileNotFoundError):
            out["runtime_state"] = sorted(os.listdir(self.runtime_root))
        out["cgroups"] = sorted(self.cgroups.children())
        out["mounts"] = mounts.mounted_under(str(self.sandboxes_dir))
        return out
