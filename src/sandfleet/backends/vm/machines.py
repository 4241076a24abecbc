"""The QEMU tiers' VMs: a jailed QEMU per sandbox, booted, adopted after a restart, paused, stopped
and cleaned up (the tier's backend without its snapshots: backend.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import signal
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox, cgroup_cpu_seconds, cgroup_usage
from sandfleet.backends.config import VMBackendConfig
from sandfleet.backends.vm import disks, guest, migration, qemu
from sandfleet.backends.vm.boot import (
    ROOT_DISK,
    SNAP_DISK,
    SNAP_INITRD,
    SNAP_KERNEL,
    Boot,
    wants_init,
)
from sandfleet.errors import (
    DataLossError,
    InternalError,
    InvalidArgumentError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.images import ImageManifest, LayerCorruptError, LayerStore
from sandfleet.models import SandboxSpec, Usage
from sandfleet.runtime import cgroups, proc, seccomp
from sandfleet.runtime.agent import AgentChannel
from sandfleet.runtime.agent_errors import ChannelClosedError

log = logging.getLogger("sandfleet.vm")

MIB = 1024**2
QEMU_OVERHEAD = 192 * MIB  # QEMU's own memory beyond guest RAM and the TCG cache (measured ~60 MiB idle)
QEMU_PIDS = 128  # QEMU's threads (vCPUs, I/O workers, RCU) plus bwrap
SLOTS = 1 << 20
FIRST_FD = 3  # where the jail's fds land in the spawned process


@dataclasses.dataclass
class _VM:
    """What the daemon holds for a live VM besides its LiveSandbox."""

    relay: qemu.StreamRelay | None = None
    reaper: asyncio.Task[None] | None = None


class VMMachines:
    """A QEMU tier's VMs: boot, adopt, pause, stop and clean up (VMBackend adds snapshots)."""

    def __init__(self, config: VMBackendConfig, *, state_dir: Path, run_dir: Path, store: LayerStore) -> None:
        self.config = config
        self.name: str = config.type
        self.store = store
        self.state_dir = state_dir
        self.vms_dir = run_dir / config.type
        # one parent per tier: each tier's residue and leftovers are its own
        self.cgroups = cgroups.Cgroups(f"{config.cgroup_parent}/{config.type}")
        self.kernel: guest.Kernel | None = None
        self.initramfs: Path | None = None
        self.accel: str = "tcg"
        self._uid_base = config.jail_uid_base + (SLOTS if config.type == "vm" else 0)
        self._uids: set[int] = set()
        self._vms: dict[str, _VM] = {}
        self.full = config.type == "vm"  # a full VM on a copy-on-write disk (else microvm's design)
        self.disks_dir = state_dir / "vm-disks"
        self._bpf = b""
        self._image_initramfs: dict[Path, tuple[guest.Kernel, Path]] = {}  # by the image kernel's dir

    # -- node ---------------------------------------------------------------------------------

    async def start(self) -> None:
        ok, why = guest.usable(self.config.qemu, self.config.guest_dir)
        if not ok:
            raise UnavailableError(why)
        try:
            bpf = await asyncio.to_thread(seccomp.compile_bpf, seccomp.default_profile())
        except seccomp.SeccompUnavailableError as exc:
            raise UnavailableError(str(exc)) from exc
        self._bpf = bpf
        self.kernel = guest.find_kernel(self.config.guest_dir)
        self.initramfs = await asyncio.to_thread(guest.build_initramfs, self.state_dir / "vm-guest", self.kernel, bpf)
        self.accel = self._pick_accel()
        self.vms_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.vms_dir, 0o711)
        check_traversable(self.vms_dir)
        # re-detect inside our mount namespace (one parent per tier, as in __init__)
        self.cgroups = cgroups.Cgroups(f"{self.config.cgroup_parent}/{self.config.type}")

    def _pick_accel(self) -> str:
        """KVM only when asked for explicitly: on this kind of host /dev/kvm exists but cannot run a
        standard guest (PVM), and a trustworthy probe is a full boot; `auto` therefore means TCG."""
        if self.config.accel == "kvm":
            if not os.access("/dev/kvm", os.R_OK | os.W_OK):
                raise UnavailableError("accel = 'kvm' but /dev/kvm is not usable")
            return "kvm"
        return "tcg"

    async def close(self) -> None:
        for vm in self._vms.values():
            if vm.relay is not None:
                vm.relay.close()
            if vm.reaper is not None:
                vm.reaper.cancel()
        self._vms.clear()
        await asyncio.to_thread(self.cgroups.remove_parent_if_empty)
        # and the configured parent, if no other tier left anything in it
        await asyncio.to_thread(cgroups.Cgroups(self.config.cgroup_parent).remove_parent_if_empty)

    # -- create -------------------------------------------------------------------------------

    def _layer_files(self, image: ImageManifest) -> list[Path]:
        paths = []
        for layer in image.layers:
            if self.store.blob_path(layer.digest) is not None:
                raise InvalidArgumentError(
                    f"image {image.name}:{image.tag} has on-demand layers, which the {self.name} tier cannot use"
                )
            path = self.store.verified_layer_path(layer.digest)
            self.store.touch(path)
            paths.append(path)
        return paths

    def _new_uid(self) -> int:
        for slot in range(SLOTS):
            uid = self._uid_base + slot
            if uid not in self._uids:
                self._uids.add(uid)
                return uid
        raise UnavailableError(f"no free jail uid for another {self.name}")

    def _memory(self, spec: SandboxSpec) -> int:
        """Guest RAM in MiB: the spec's memory, at least min_memory."""
        return max(int(spec.resources.memory), self.config.min_memory) // MIB

    def _vcpus(self, spec: SandboxSpec) -> int:
        return max(self.config.vcpus, min(64, int(spec.resources.cpu + 0.999)))

    def _make_cgroup(self, sandbox_id: str, spec: SandboxSpec, memory_mib: int) -> list[str]:
        """The VM's cgroup with its limits; returns the cgroup.procs files QEMU's jail joins."""
        host_memory = (memory_mib + self.config.tcg_cache_mib) * MIB + QEMU_OVERHEAD
        plan = self.cgroups.plan(
            self.cgroups.path_for(sandbox_id),
            memory=host_memory,
            cpu_quota_us=max(1000, int(spec.resources.cpu * 100_000)),
            cpu_period_us=100_000,
            pids=QEMU_PIDS,
        )
        for d in plan.dirs:
            os.makedirs(d, exist_ok=True)
        for path, value in plan.writes:
            if "/devices/" in path:
                continue  # QEMU's device access is the jail's business (bwrap's minimal /dev)
            with open(path, "w") as f:
                f.write(value)
        return [f"{d}/cgroup.procs" for d in plan.dirs]

    def _spec(self, spec: SandboxSpec, layers: int, sandbox_id: str) -> qemu.VMSpec:
        hostname = spec.hostname or sandbox_id
        if self.full:
            cmdline = {"mode": "full", "init": "1" if wants_init(spec) else "0", "hostname": hostname}
            layers, writable = 0, f"{qemu.VMLayout().run}/{ROOT_DISK}"
        else:
            disk = int(spec.resources.disk)
            cmdline = {
                "layers": str(layers),
                "disk": str(disk),
                "inodes": str(max(4096, disk // 8192)),
                "uid": str(self.config.uid_base),
                "nofile": "1024",
                "hostname": hostname,
            }
            writable = None
        return qemu.VMSpec(
            machine="vm" if self.full else "microvm",
            memory_mib=self._memory(spec),
            vcpus=self._vcpus(spec),
            layers=layers,
            accel="kvm" if self.accel == "kvm" else "tcg",
            tcg_cache_mib=self.config.tcg_cache_mib,
            cmdline=cmdline,
            writable_disk=writable,
            ram_object=True,
        )

    def _spawn(
        self, vdir: Path, uid: int, boot: Boot, vm_spec: qemu.VMSpec, procs: list[str], *, incoming: bool = False
    ) -> int:
        """Start the jailed QEMU (blocking part); returns the pid of bwrap, its parent."""
        optional = {"base": boot.base.path if boot.base else None, "snapdisk": boot.snapdisk}
        optional |= {"ram": boot.ram, "shim": boot.shim}
        present = {k: v for k, v in optional.items() if v is not None}
        paths = [vdir, boot.kernel, boot.initramfs, *boot.layers, *present.values()]
        opened = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in paths]
        try:
            numbers = list(range(FIRST_FD, FIRST_FD + len(opened)))
            n_layers = len(boot.layers)
            extra = dict(zip(present, numbers[3 + n_layers :], strict=True))
            files = qemu.JailFiles(
                numbers[0],
                numbers[1],
                numbers[2],
                numbers[3 : 3 + n_layers],
                kvm=vm_spec.accel == "kvm",
                ram_writable=boot.ram_mode == "template_build",
                **extra,
            )
            layout = qemu.VMLayout()
            argv = qemu.qemu_argv(self.config.qemu, vm_spec, layout, incoming=incoming, ram=boot.ram_mode)
            inner = qemu.jail_argv(uid, files, layout, argv)
            # Join the VM's cgroups before anything of QEMU exists (as root, then setpriv drops it).
            # QEMU's own complaints (a stream that does not load) go to qemu.err, for the error we raise.
            join = 'e=$1; n=$2; shift 2; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 1; shift; n=$((n-1)); done; '
            join += 'exec "$@" 2>"$e"'
            argv = ["/bin/sh", "-c", join, "sh", str(vdir / "qemu.err"), str(len(procs)), *procs, *inner]
            return proc.start_background(argv, fd_map=dict(zip(numbers, opened, strict=True)))
        finally:
            for fd in opened:
                os.close(fd)

    def _prepare(self, image: ImageManifest) -> Boot:
        """What a VM of this image boots from (blocking: a first VM of an image builds its base disk,
        and the initramfs of the image's kernel if it has one)."""
        assert self.kernel is not None and self.initramfs is not None
        layers = self._layer_files(image)
        if not self.full:
            return Boot(self.kernel.image, self.initramfs, layers)
        base = disks.ensure_base(self.disks_dir, [x.digest for x in image.layers], layers)
        if base.kernel_dir is None:
            return Boot(self.kernel.image, self.initramfs, [], base)
        kernel, initramfs = self._image_kernel(base.kernel_dir)
        return Boot(kernel.image, initramfs, [], base)

    def _image_kernel(self, kernel_dir: Path) -> tuple[guest.Kernel, Path]:
        """The image's kernel (extracted with its base disk) and an initramfs built for it."""
        cached = self._image_initramfs.get(kernel_dir)
        if cached is not None and cached[1].exists():
            return cached
        kernel = guest.find_kernel(kernel_dir)
        initramfs = guest.build_initramfs(
            self.state_dir / "vm-guest", kernel, self._bpf, wanted=guest.FULL_MODULES, out_dir=kernel_dir / "initramfs"
        )
        self._image_initramfs[kernel_dir] = (kernel, initramfs)
        return kernel, initramfs

    async def _boot_files(self, image: ImageManifest) -> Boot:
        """_prepare, its failures typed."""
        assert self.kernel is not None, "backend not started"
        try:
            return await asyncio.to_thread(self._prepare, image)
        except LayerCorruptError as exc:
            raise DataLossError(f"image {image.name}:{image.tag} has a corrupt layer: {exc}") from exc
        except (disks.DiskBuildError, guest.GuestUnavailableError, OSError) as exc:
            raise InternalError(f"preparing {image.name}:{image.tag} for the {self.name} tier failed: {exc}") from exc

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        assert self.kernel is not None, "backend not started"
        boot = await self._boot_files(image)
        runtime = self._runtime(spec, image, boot)
        try:
            return await self._boot(sandbox_id, spec, boot, runtime)
        except BaseException as exc:
            await self._start_failed(sandbox_id, runtime, exc, f"the {self.name}")
            raise

    async def _start_failed(self, name: str, runtime: dict[str, Any], exc: BaseException, what: str) -> None:
        """A VM that did not start (booting, restoring, from or as a template; `what` names it):
        everything it made removed, and the cause raised as a typed error (anything else the caller
        re-raises as it was)."""
        console = self._console_tail(name)
        await asyncio.shield(self.cleanup(name, runtime))
        if isinstance(exc, migration.VersionMismatchError):
            raise WrongStateError(str(exc)) from exc
        if isinstance(exc, TimeoutError | ChannelClosedError):
            raise UnavailableError(f"{what} did not come up: {console}") from exc
        if isinstance(exc, OSError | ValueError | qemu.QMPError | disks.DiskBuildError):
            raise InternalError(f"starting {what} failed: {exc}: {console}") from exc

    def _runtime(self, spec: SandboxSpec, image: ImageManifest, boot: Boot) -> dict[str, Any]:
        """A new VM's record: its jail uid, layers and (vm) base disk, kernel and disk size."""
        assert self.kernel is not None, "backend not started"
        runtime: dict[str, Any] = {"uid": self._new_uid(), "layers": [x.digest for x in image.layers]}
        if boot.base is not None:
            runtime["base"] = boot.base.path.parent.name
            runtime["kernel"] = "node" if boot.kernel == self.kernel.image else str(boot.kernel)
            runtime["disk_bytes"] = boot.base.size + int(spec.resources.disk)  # the root overlay's virtual size
        return runtime

    async def _boot(self, sandbox_id: str, spec: SandboxSpec, boot: Boot, runtime: dict[str, Any]) -> LiveSandbox:
        vm_spec = self._spec(spec, len(boot.layers), sandbox_id)
        runtime["vm"] = dataclasses.asdict(vm_spec)  # what a snapshot's restore must start again
        vdir = await self._launch(sandbox_id, spec, boot, vm_spec, runtime)
        async with asyncio.timeout(self.config.start_timeout):
            await self._wait_qemu(vdir, runtime)
            relay, theirs = await qemu.StreamRelay.connect(vdir / "agent.sock", self.config.start_timeout)
            self._vms[sandbox_id].relay = relay
            channel = AgentChannel(theirs)
            try:
                await channel.wait_hello()
            except BaseException:
                channel.close()
                raise
        return self._live(sandbox_id, channel, runtime)

    async def _launch(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        boot: Boot,
        vm_spec: qemu.VMSpec,
        runtime: dict[str, Any],
        *,
        incoming: bool = False,
    ) -> Path:
        """The VM's directory, root overlay (vm), cgroup and jailed QEMU; returns the directory.
        Everything made is recorded for cleanup (in runtime and self._vms). Not under a timeout: a
        cancelled thread would go on and start a QEMU nobody recorded."""
        vdir = self.vms_dir / sandbox_id
        uid = runtime["uid"]
        vdir.mkdir(mode=0o700)
        os.chown(vdir, uid, uid)
        if incoming:
            boot = await asyncio.to_thread(self._stage, vdir, boot)
        if boot.base is not None:
            overlay = vdir / ROOT_DISK
            layout = qemu.VMLayout()
            size = int(runtime.get("disk_bytes") or boot.base.size)  # a snapshot of an older daemon: the base's
            if boot.snapdisk is None:
                await asyncio.to_thread(disks.create_overlay, overlay, size, layout.base, uid)
            else:  # a restored child: its own overlay over the snapshot's frozen disk
                await asyncio.to_thread(disks.create_overlay, overlay, size, layout.snapdisk, uid, "qcow2")
        procs = await asyncio.to_thread(self._make_cgroup, sandbox_id, spec, vm_spec.memory_mib)
        jail = await asyncio.to_thread(self._spawn, vdir, uid, boot, vm_spec, procs, incoming=incoming)
        runtime["jail_pid"] = jail
        runtime["jail_start_time"] = proc.process_start_time(jail)
        vm = self._vms.setdefault(sandbox_id, _VM())
        vm.reaper = asyncio.create_task(self._reap(jail))
        return vdir

    @staticmethod
    def _stage(vdir: Path, boot: Boot) -> Boot:
        """A restore's snapshot files, linked (else copied) into the VM's directory: bwrap resolves a
        bound fd's path as the jail uid, which may not enter the root-only snapshot directory (a
        template's files are reachable where they are)."""

        def stage(src: Path, name: str) -> Path:
            if _traversable(src.parent):
                return src
            dest = vdir / name
            try:
                os.link(src, dest)
            except OSError:
                disks.copy_disk(src, dest)
            return dest

        snapdisk = None if boot.snapdisk is None else stage(boot.snapdisk, SNAP_DISK)
        kernel, initramfs = stage(boot.kernel, SNAP_KERNEL), stage(boot.initramfs, SNAP_INITRD)
        return dataclasses.replace(boot, kernel=kernel, initramfs=initramfs, snapdisk=snapdisk)

    async def _wait_qemu(self, vdir: Path, runtime: dict[str, Any]) -> None:
        qemu_pid = await self._read_pidfile(vdir / "qemu.pid", runtime["jail_pid"])
        runtime["qemu_pid"] = qemu_pid
        runtime["qemu_start_time"] = proc.process_start_time(qemu_pid)

    @staticmethod
    async def _reap(pid: int) -> None:
        """bwrap (QEMU's parent) is our child until the daemon restarts: collect it when it ends."""
        with contextlib.suppress(ChildProcessError, OSError):
            await proc.wait_pid(pid)
        proc.forget(pid)

    @staticmethod
    async def _read_pidfile(path: Path, jail_pid: int) -> int:
        while True:
            with contextlib.suppress(OSError, ValueError):
                return int((await asyncio.to_thread(path.read_text)).strip())
            if proc.process_start_time(jail_pid) is None or proc.exited(jail_pid):
                raise OSError("QEMU exited at start")
            await asyncio.sleep(0.01)

    def _console_tail(self, sandbox_id: str) -> str:
        vdir = self.vms_dir / sandbox_id
        with contextlib.suppress(OSError):
            err = (vdir / "qemu.err").read_text(errors="replace").strip()
            if err:
                return "QEMU: " + " | ".join(err.splitlines()[-4:])[-1000:]
        try:
            text = (vdir / "console.log").read_text(errors="replace")
        except OSError:
            return "(no console log)"
        return " | ".join(text.strip().splitlines()[-6:])[-1500:]

    def _live(self, sandbox_id: str, channel: AgentChannel, runtime: dict[str, Any]) -> LiveSandbox:
        return LiveSandbox(
            id=sandbox_id,
            channel=channel,
            agent_pid=runtime["qemu_pid"],  # the host-side process that holds the sandbox
            agent_start_time=runtime.get("qemu_start_time"),
            uid_base=self.config.uid_base,
            runtime=runtime,
        )

    # -- destroy / cleanup --------------------------------------------------------------------

    async def destroy(self, sandbox: LiveSandbox) -> None:
        sandbox.channel.close()
        await self.cleanup(sandbox.id, sandbox.runtime)

    def _is(self, pid: Any, start_time: Any) -> bool:
        return isinstance(pid, int) and start_time is not None and proc.process_start_time(pid) == start_time

    async def cleanup(self, sandbox_id: str, runtime: dict[str, Any]) -> None:
        vm = self._vms.pop(sandbox_id, None)
        if vm is not None and vm.relay is not None:
            vm.relay.close()
        rel = self.cgroups.path_for(sandbox_id)
        # Frozen (v1 freezer: a paused VM is only QMP-stopped, but be safe) tasks ignore SIGKILL.
        with contextlib.suppress(OSError, TimeoutError):
            if await asyncio.to_thread(self.cgroups.frozen, rel):
                await asyncio.to_thread(self.cgroups.thaw, rel)
        # QEMU first: bwrap, its parent, reaps it and exits. Were bwrap killed first, QEMU would be
        # re-parented to the daemon (a subreaper) and its zombie would wait for us.
        await self._kill_and_wait(runtime.get("qemu_pid"), runtime.get("qemu_start_time"))
        await self._kill_and_wait(runtime.get("jail_pid"), runtime.get("jail_start_time"), grace=3.0)
        # Whatever else joined the cgroup (a half-started jail whose pid we never recorded).
        for _ in range(500):
            if not await asyncio.to_thread(self.cgroups.procs, rel):
                break
            await asyncio.to_thread(self.cgroups.kill_all, rel)
            await asyncio.sleep(0.01)
        if vm is not None and vm.reaper is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(vm.reaper), 5)
        await asyncio.to_thread(self._remove_files, sandbox_id)
        uid = runtime.get("uid")
        if isinstance(uid, int):
            self._uids.discard(uid)

    async def _kill_and_wait(self, pid: Any, start_time: Any, grace: float = 0.0) -> None:
        """SIGKILL one process through a pidfd (after `grace` seconds for it to exit on its own),
        wait up to 10 s for it to exit, and reap it if it is our child (a QEMU whose bwrap died)."""
        if not isinstance(pid, int):
            return
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        loop = asyncio.get_running_loop()
        try:
            # Checked after opening the pidfd: from here on it cannot refer to a recycled pid.
            if proc.process_start_time(pid) != start_time:
                return
            exited = loop.create_future()
            loop.add_reader(pidfd, lambda: None if exited.done() else exited.set_result(None))
            try:
                if grace:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(exited), grace)
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(exited, 10)
            finally:
                loop.remove_reader(pidfd)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)  # noqa: ASYNC222 (never blocks)
        finally:
            os.close(pidfd)

    def _remove_files(self, sandbox_id: str) -> None:
        with contextlib.suppress(OSError):
            self.cgroups.remove(self.cgroups.path_for(sandbox_id))
        shutil.rmtree(self.vms_dir / sandbox_id, ignore_errors=True)

    # -- adopt --------------------------------------------------------------------------------

    async def adopt(self, sandbox_id: str, runtime: dict[str, Any]) -> LiveSandbox | None:
        if not self._is(runtime.get("qemu_pid"), runtime.get("qemu_start_time")):
            return None
        vdir = self.vms_dir / sandbox_id
        uid = runtime.get("uid")
        if isinstance(uid, int):
            self._uids.add(uid)  # never handed to another VM while this one lives
        with contextlib.suppress(OSError, TimeoutError, qemu.QMPError):
            await self._resume(sandbox_id)  # paused when the old daemon died
        try:
            relay, theirs = await qemu.StreamRelay.connect(vdir / "agent.sock", 5)
        except (OSError, TimeoutError):
            return None
        channel = AgentChannel(theirs)
        try:
            # vminit saw the old connection go, had the agent offer a fresh channel (HELLO queued).
            await channel.wait_hello(timeout=10)
            await channel.forget()
            await channel.ping(timeout=10)
        except (TimeoutError, ChannelClosedError):
            channel.close()
            relay.close()
            return None
        self._vms[sandbox_id] = _VM(relay=relay)
        return self._live(sandbox_id, channel, runtime)

    # -- pause / resume -----------------------------------------------------------------------

    async def pause(self, sandbox: LiveSandbox) -> tuple[int, int]:
        """Stop the vCPUs (QMP), then push QEMU's memory (guest RAM included) out to swap."""
        rel = self.cgroups.path_for(sandbox.id)
        try:
            await qemu.qmp_command(self.vms_dir / sandbox.id / "qmp.sock", "stop")
            before = await asyncio.to_thread(self.cgroups.memory_bytes, rel)
            await asyncio.to_thread(self.cgroups.reclaim, rel)
            return before, await asyncio.to_thread(self.cgroups.memory_bytes, rel)
        except (OSError, TimeoutError, qemu.QMPError) as exc:
            raise InternalError(f"pausing {sandbox.id} failed: {exc}") from exc

    async def resume(self, sandbox: LiveSandbox) -> None:
        try:
            await self._resume(sandbox.id)
        except (OSError, TimeoutError, qemu.QMPError) as exc:
            raise InternalError(f"resuming {sandbox.id} failed: {exc}") from exc

    async def _resume(self, sandbox_id: str) -> None:
        await qemu.qmp_command(self.vms_dir / sandbox_id / "qmp.sock", "cont")

    # -- introspection ------------------------------------------------------------------------

    def usage(self, sandbox: LiveSandbox) -> Usage:
        return cgroup_usage(self.cgroups, sandbox)

    def cpu_seconds(self, sandbox: LiveSandbox | None) -> float:
        return cgroup_cpu_seconds(self.cgroups, sandbox)

    def residue(self) -> set[str]:
        found = self.leftovers()
        return set(found.get("vm_dirs", [])) | set(found.get("cgroups", []))

    def leftovers(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        with contextlib.suppress(FileNotFoundError):
            out["vm_dirs"] = sorted(os.listdir(self.vms_dir))
        out["cgroups"] = sorted(self.cgroups.children())
        out["qemu_processes"] = self._jailed_processes()
        return out

    def _jailed_processes(self) -> list[str]:
        """Processes running as one of this tier's jail uids ("pid:uid")."""
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                uid = os.stat(entry.path).st_uid
            except OSError:
                continue
            if self._uid_base <= uid < self._uid_base + SLOTS:
                found.append(f"{entry.name}:{uid}")
        return found


def _traversable(path: Path) -> bool:
    return all(parent.stat().st_mode & 0o001 for parent in [path, *path.parents])


def check_traversable(path: Path) -> None:
    """QEMU runs as an unprivileged uid, and bubblewrap resolves the directories bound into its jail
    as that uid: every directory above a VM's must let others through (o+x), or every create would
    fail at QEMU's start. Said once, at the daemon's start, with the fix."""
    for parent in [path, *path.parents]:
        if not parent.stat().st_mode & 0o001:
            raise UnavailableError(
                f"the QEMU tiers need {parent} (above {path}) to be traversable by other users (chmod o+x {parent}): "
                "QEMU runs as an unprivileged uid of its own"
            )
