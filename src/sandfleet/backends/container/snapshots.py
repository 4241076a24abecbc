"""The container tier's snapshots (CRIU: dump, restore, fork) and its writable layer packed as a layer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.backends.container.preparation import userns_owner
from sandfleet.backends.container.sandboxes import PROMOTED, ContainerSandboxes
from sandfleet.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    SandboxError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.images import LayerCorruptError
from sandfleet.models import SandboxSpec
from sandfleet.runtime import cgroups, criu, proc
from sandfleet.runtime.agent import AgentChannel
from sandfleet.runtime.agent_errors import ChannelClosedError
from sandfleet.runtime.agent_wire import AGENT_VERSION
from sandfleet.runtime.launcher import LaunchError

log = logging.getLogger("sandfleet.container")


class ContainerSnapshots(ContainerSandboxes):
    """A container tier's sandboxes with snapshot, restore and pack."""

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
                f"sandbox {sandbox.sandbox_id} runs {sandbox.channel.agent_version}, from before the daemon was "
                "upgraded; "
                f"snapshots need {AGENT_VERSION}"
            )
        pid = sandbox.agent_pid
        try:
            mountinfo = await asyncio.to_thread(Path(f"/proc/{pid}/mountinfo").read_text)
            externals = criu.Criu.external_mounts(mountinfo)
        except ValueError as exc:
            raise InvalidArgumentError(f"sandbox {sandbox.sandbox_id} cannot be snapshotted: {exc}") from exc
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.sandbox_id} is no longer running") from exc
        # The agent binary as the sandbox maps it: criu names it by its mount (in the namespace of the
        # daemon that started the sandbox, perhaps not this one) and inode, and a restore gives this
        # daemon's copy back in its place, so it must be this very file.
        try:
            exe = Path(f"/proc/{pid}/exe")
            if not os.path.samestat(os.stat(exe), os.stat(self.agent_path)):
                raise WrongStateError(
                    f"sandbox {sandbox.sandbox_id} runs another build of the agent than this daemon's (started "
                    "before an upgrade): it cannot be snapshotted"
                )
            agent_key = criu.Criu.external_file_key(exe)
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.sandbox_id} is no longer running") from exc
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
            await self._freeze(sandbox.id)
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
                for attempt in range(2):
                    if attempt:  # a log of its own (criu truncates its log): the first one's errors stay
                        retry_log = target / "dump-again.log"
                        argv[argv.index(str(log_file))] = str(retry_log)
                        log_file = retry_log
                    done = await proc.spawn(argv, env=tool.dump_env(pid), timeout=300)
                    if done.returncode == 0:
                        break
                    why = _criu_error(log_file)
                    if await asyncio.to_thread(self._oom_kills, sandbox) > ooms or "killed by 9 unexpectedly" in why:
                        # criu's parasite runs in the sandbox's processes and needs a little memory
                        # there: a sandbox at its memory limit loses one to the OOM killer (or killed
                        # it itself). The sandbox's state, not the node's.
                        raise WrongStateError(
                            f"a process of sandbox {sandbox.id} was killed while it was being checkpointed "
                            f"(at its memory limit? raise it, or free memory, and retry): {why}"[:500]
                        )
                    if not _only_vanished(log_file):
                        raise InternalError(f"criu dump failed ({done.returncode}): {why}")
                    if attempt or channel.closed or not await asyncio.to_thread(self.cgroups.frozen, rel):
                        # stopped meanwhile (the caller says so), or lost, or thawed under the dump
                        raise UnavailableError(f"processes of sandbox {sandbox.id} vanished during its dump: retry")
                    # A process killed from outside (the host's OOM killer, say) vanished under criu,
                    # which put the cgroup back as frozen: a second dump sees the tree without it.
                    log.info("sandbox %s: a process vanished during its dump, dumping again: %s", sandbox.id, why)
                    await asyncio.to_thread(_empty_dir, images)
                # Still frozen: the tree the images were taken from is the one checked.
                await self._check_restore_paths(sandbox, images)
            finally:
                await asyncio.to_thread(self._thaw_quietly, sandbox.id)
        finally:
            await self._take_new_channel(sandbox)
        if channel.closed:
            raise UnavailableError(f"sandbox {sandbox.sandbox_id} was lost while its snapshot was taken")
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
            raise UnavailableError(f"sandbox {sandbox.sandbox_id} is no longer running") from exc
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
                f"sandbox {sandbox.sandbox_id} cannot be snapshotted: {problems[0]}{more}. A restore recreates such "
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
            await self._freeze(sandbox.id)
            try:
                await self._copy_scratch(sandbox, ["upper"], staging)
            finally:
                if not was_frozen:
                    await asyncio.to_thread(self._thaw_quietly, sandbox.id)
            await asyncio.to_thread((staging / "upper").rename, dest)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

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

    # -- standbys: a checkpoint restored ahead of its rollback -----------------------------------------

    def standbys_possible(self) -> bool:
        return self.uses_launcher and self.cgroups.renamable

    async def restore_standby(
        self, name: str, spec: SandboxSpec, source: Path, meta: dict[str, Any], *, idle: bool
    ) -> LiveSandbox:
        """A restore under `name`, frozen as soon as its agent answered: its processes ran only
        that long past the checkpoint (as any restore's do before the caller's next call). `idle`:
        made with a best-effort sandbox's CPU weight (the launcher's copy and criu run in its cgroup)."""
        made = spec.model_copy(update={"qos": "best_effort"}) if idle else spec
        live = await self.restore(name, made, source, meta)

        def settle() -> None:
            self._freeze_now(name)
            # Frozen, it takes no CPU: its sandbox's own weight from now (not written at the swap).
            try:
                self.cgroups.set_idle(self.cgroups.path_for(name), spec.qos == "best_effort")
            except OSError as exc:
                raise InternalError(f"giving a standby its sandbox's CPU weight failed: {exc}") from exc

        try:
            await asyncio.to_thread(settle)
        except BaseException:
            await asyncio.shield(self.destroy(live))
            raise
        return live

    def _rename(self, old: str, new: str) -> None:
        """A live part's cgroup and directory under another name (its tasks stay in the renamed
        cgroup, its mounts on the renamed directory); it is no sandbox's live part any more."""
        with contextlib.suppress(FileNotFoundError):  # (first: a part set aside never claims a sandbox)
            os.unlink(self.sandboxes_dir / old / PROMOTED)
        self.cgroups.rename(self.cgroups.path_for(old), self.cgroups.path_for(new))
        try:
            if os.path.lexists(self.sandboxes_dir / old):
                os.rename(self.sandboxes_dir / old, self.sandboxes_dir / new)
        except OSError:
            self.cgroups.rename(self.cgroups.path_for(new), self.cgroups.path_for(old))
            raise

    async def set_aside(self, live: LiveSandbox, name: str) -> None:
        """Move a sandbox's live part out of its id's way, to be destroyed later under `name`."""
        try:
            await asyncio.to_thread(self._rename, live.id, name)
        except OSError as exc:
            raise UnavailableError(f"sandbox {live.sandbox_id} could not be set aside: {exc}") from exc
        live.id = name

    async def hurry(self, name: str, spec: SandboxSpec) -> None:
        with contextlib.suppress(OSError):  # not made yet (its launch writes the weight it was asked)
            await asyncio.to_thread(self.cgroups.set_idle, self.cgroups.path_for(name), spec.qos == "best_effort")

    async def promote(
        self, standby: LiveSandbox, sandbox_id: str, spec: SandboxSpec, replacing: LiveSandbox | None
    ) -> None:
        """Thaw the standby, marked as the sandbox's live part under its own name (nothing is
        renamed: its runtime says which part it is), and freeze the part it replaces (not waited
        for: its destroy thaws it first). It has the sandbox's CPU weight since it was frozen."""

        def swap() -> None:
            (self.sandboxes_dir / standby.id / PROMOTED).write_text(f"{sandbox_id} {time.time_ns()}\n")
            self.cgroups.thaw(self.cgroups.path_for(standby.id))
            if replacing is not None:
                with contextlib.suppress(OSError):  # (it only keeps running until destroyed)
                    self.cgroups.freeze_soon(self.cgroups.path_for(replacing.id))

        try:
            await asyncio.to_thread(swap)
        except (OSError, TimeoutError) as exc:
            await asyncio.shield(self.destroy(standby))
            raise UnavailableError(f"the standby restore could not take the sandbox's place: {exc}") from exc
        standby.runtime["part"] = standby.id

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


def _empty_dir(path: Path) -> None:
    for child in path.iterdir():
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()


def _only_vanished(log_file: Path) -> bool:
    """Whether every error criu logged is of a task gone under it (ESRCH), and nothing else failed."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return False
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln and "Dumping FAILED" not in ln]
    return bool(errors) and all("No such process" in ln for ln in errors)


def _criu_error(log_file: Path) -> str:
    """The error lines of a criu log (criu reports through its log, not stderr)."""
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        return "(no criu log)"
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE" not in ln]
    return " | ".join((errors or lines)[-4:])[-1500:]
