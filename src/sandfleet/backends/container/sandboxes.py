"""The container tier's sandboxes: create (launcher or OCI runtime), stop, pause, clean up, adopt after a
restart, recover after a lost database, and what the service reads of a live one (root, usage, netns)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandfleet.backends.base import PART_SEP, LiveSandbox, cgroup_cpu_seconds, cgroup_usage, part_of, sandbox_of
from sandfleet.backends.container.preparation import (
    OWNER_BASE,
    OWNER_SPAN,
    ContainerPreparation,
    Prepared,
    spec_nofile,
    userns_owner,
)
from sandfleet.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    SandboxError,
    UnavailableError,
)
from sandfleet.images import ImageManifest, LayerCorruptError
from sandfleet.models import Resources, SandboxSpec, Usage
from sandfleet.runtime import mounts, proc
from sandfleet.runtime.agent import AgentChannel, grab_handoff_channel
from sandfleet.runtime.agent_errors import ChannelClosedError
from sandfleet.runtime.launcher import LaunchError
from sandfleet.runtime.sandboxfs.paths import mount_points

log = logging.getLogger("sandfleet.container")

# The file in a promoted standby's directory naming the sandbox whose live part it is (`part_of`)
# and when it became so, for a recovery that lost the records (`_owner`).
PROMOTED = "promoted"


class ContainerSandboxes(ContainerPreparation):
    """A container tier's sandboxes, without snapshots (snapshots.py)."""

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

    async def _launch(self, sandbox_id: str, spec: SandboxSpec, prepared: Prepared, channel_fd: int, owner: int) -> int:
        """Start the agent with the launcher server; return its pid."""
        assert self._launcher is not None
        disk = spec.resources.disk
        args = ["--uid", str(self.config.uid_base), "--owner", str(owner)]
        args += ["--hostname", spec.hostname or sandbox_id, "--nofile", str(spec_nofile(spec))]
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
        await self._cleanup(sandbox.id, sandbox.runtime)

    # -- pause / resume -------------------------------------------------------------------------

    async def _freeze(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self._freeze_now, sandbox_id)

    def _freeze_now(self, sandbox_id: str) -> None:
        """Freeze the sandbox's cgroup. On a node so busy that its tasks do not stop in time the
        freeze is undone and the caller gets a retryable error: the sandbox runs on unharmed."""
        try:
            self.cgroups.freeze(self.cgroups.path_for(sandbox_id))
        except TimeoutError as exc:
            raise UnavailableError(
                f"sandbox {sandbox_of(sandbox_id)} could not be frozen in time (a busy node): retry"
            ) from exc
        except OSError as exc:
            raise InternalError(f"freezing sandbox {sandbox_of(sandbox_id)} failed: {exc}") from exc

    async def pause(self, sandbox: LiveSandbox) -> tuple[int, int]:
        rel = self.cgroups.path_for(sandbox.id)

        def run() -> tuple[int, int]:
            before = self.cgroups.memory_bytes(rel)
            self._freeze_now(sandbox.id)
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
        if not self.cgroups.thawed(rel):
            with contextlib.suppress(OSError, TimeoutError):
                self.cgroups.thaw(rel)

    def _is_ours(self, sandbox_id: str, pid: int, start_time: int | None) -> bool:
        """Is `pid` still this sandbox's init? By start time if we know it, else by its cgroup."""
        if start_time is not None:
            return proc.process_start_time(pid) == start_time
        return self.cgroups.holds(pid, self.cgroups.path_for(sandbox_id))

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
                try:
                    async with asyncio.timeout(0.5):
                        await asyncio.shield(exited)
                except TimeoutError:
                    # A freeze (a pause racing this stop) that landed after the thaw before the
                    # kill keeps the killed processes from dying until thawed.
                    await asyncio.to_thread(self._thaw_quietly, sandbox_id)
                async with asyncio.timeout(9.5):
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
        await self._cleanup(part_of(sandbox_id, runtime), runtime)

    async def _cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        """`sandbox_id`: the name of the live part's cgroup and directory."""
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

    # -- adoption after a daemon restart -----------------------------------------------------

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        sandbox_id = part_of(sandbox_id, runtime)  # (its cgroup and directory)
        pid = runtime.get("agent_pid")
        if not isinstance(pid, int) or proc.process_start_time(pid) != runtime.get("agent_start_time"):
            return None
        if not await asyncio.to_thread(self._is_ours, sandbox_id, pid, None):
            return None  # in another cgroup: set aside by a rollback the old daemon died in
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

    async def recover(self, name: str) -> tuple[LiveSandbox, Resources] | None:
        """A sandbox running on the node that the daemon has no record of (its state database was
        lost): its agent is the cgroup's `sandfleet-agent` whose parent is outside the cgroup. `name`:
        a sandbox id, or a part's name that a rollback made a sandbox's live part (a standby's)."""
        sandbox_id = await asyncio.to_thread(self._owner, name)
        if sandbox_id is None:
            return None
        rel = self.cgroups.path_for(name)
        agent = await asyncio.to_thread(self._find_agent, rel)
        if agent is None:
            return None
        runtime: dict[str, Any] = {"agent_pid": agent, "agent_start_time": proc.process_start_time(agent), "layers": []}
        if name != sandbox_id:
            runtime["part"] = name
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

    def _owner(self, name: str) -> str | None:
        """The sandbox whose live part `name` is, as far as the node tells: its own id, or the one
        `promote` marked it as. Of the parts that claim one sandbox (a daemon killed before it
        destroyed the one a rollback replaced) the newest promoted one that runs wins, then the id's
        own."""
        sandbox_id = sandbox_of(name)
        claims = self._claims(sandbox_id)
        if PART_SEP in name and name not in claims:
            return None  # a standby, or a part set aside: never a sandbox
        for claim in sorted(claims, key=lambda n: claims[n], reverse=True):
            if self._find_agent(self.cgroups.path_for(claim)) is not None:  # (one that still runs)
                return sandbox_id if claim == name else None
        return None

    def _claims(self, sandbox_id: str) -> dict[str, int]:
        """The parts that claim to be the sandbox's live part: name -> when promoted (0: its own)."""
        claims = {sandbox_id: 0}
        with contextlib.suppress(OSError):
            for name in os.listdir(self.sandboxes_dir):
                if sandbox_of(name) != sandbox_id or PART_SEP not in name:
                    continue
                with contextlib.suppress(OSError, UnicodeDecodeError, ValueError):
                    owner, at = (self.sandboxes_dir / name / PROMOTED).read_text().split()
                    if owner == sandbox_id and part_of(owner, {"part": name}) == name:
                        claims[name] = int(at)
        return claims

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
            raise UnavailableError(f"sandbox {sandbox.sandbox_id} is no longer running") from exc
        return mount_points(text)

    # -- introspection ------------------------------------------------------------------------

    def open_root(self, sandbox: LiveSandbox) -> int:
        fd = os.open(f"/proc/{sandbox.agent_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        if proc.process_start_time(sandbox.agent_pid) != sandbox.agent_start_time:
            os.close(fd)
            raise UnavailableError(f"sandbox {sandbox.sandbox_id} is no longer running")
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
