"""The QEMU tiers' snapshots and restores (VMBackend's `Snapshottable` half): QEMU's migration stream
of the stopped VM (migration.py), the boot files pinned beside it and, for the vm tier, its disk."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.backends.vm import disks, migration, qemu
from sandfleet.backends.vm.boot import (
    ROOT_DISK,
    SNAP_DISK,
    SNAP_FORMAT,
    SNAP_INITRD,
    SNAP_KERNEL,
    SNAP_STATE,
    Boot,
)
from sandfleet.backends.vm.machines import VMMachines
from sandfleet.errors import (
    DataLossError,
    InternalError,
    UnavailableError,
    WrongStateError,
)
from sandfleet.images import LayerCorruptError
from sandfleet.models import SandboxSpec
from sandfleet.runtime.agent import AgentChannel
from sandfleet.runtime.agent_errors import ChannelClosedError
from sandfleet.runtime.agent_exec import ExecProcess

log = logging.getLogger("sandfleet.vm")

SNAPSHOT_TIMEOUT = 600.0
HELLO_RETRY = 3.0  # a restored guest that did not see its old host go: reconnect after this long
# From a template of a snapshot (its QEMU never ran the guest) the guest never sees the parent's
# host go by itself: it is shown soon by leaving and coming again (once: then it is given time).
HELLO_RETRY_TEMPLATE = 0.3


class VMSnapshots(VMMachines):
    """A QEMU tier's VMs with snapshot and restore."""

    async def snapshot(self, sandbox: LiveSandbox, target: Path) -> dict[str, Any]:
        """The VM's memory and devices (QEMU's migration stream), its boot files and, for the vm
        tier, a copy of its overlay, all taken while the vCPUs are stopped; then it runs on."""
        runtime = sandbox.runtime
        if not isinstance(runtime.get("vm"), dict):
            raise WrongStateError(f"sandbox {sandbox.id} was started before snapshots of this tier (an upgrade)")
        vm = self._vms.get(sandbox.id)
        if vm is None or vm.relay is None or not self._is(runtime.get("qemu_pid"), runtime.get("qemu_start_time")):
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running")
        vdir = self.vms_dir / sandbox.id
        await asyncio.to_thread(target.mkdir, 0o700, parents=True)
        try:
            files = await asyncio.to_thread(self._pin_boot_files, runtime["qemu_pid"], target)
        except OSError as exc:
            raise UnavailableError(f"sandbox {sandbox.id} is no longer running: {exc}") from exc
        channel, relay = sandbox.channel, vm.relay
        try:
            await self._keep_execs(channel, relay, True)
            async with asyncio.timeout(SNAPSHOT_TIMEOUT):
                saved = await migration.save(
                    vdir / "qmp.sock",
                    vdir / "migrate.sock",
                    qemu.VMLayout().migrate_socket,
                    target / SNAP_STATE,
                    runtime["uid"],
                    lambda: self._freeze_disk(vdir, target, runtime),
                )
        except (OSError, TimeoutError, ChannelClosedError, qemu.QMPError, disks.DiskBuildError) as exc:
            raise InternalError(f"the snapshot of {sandbox.id} failed: {exc}") from exc
        finally:
            with contextlib.suppress(OSError, TimeoutError, ChannelClosedError):
                await self._keep_execs(channel, relay, False)
        files["state"] = saved["bytes"]
        return {
            "format": SNAP_FORMAT,
            "tier": self.name,
            "vm": runtime["vm"],
            "layers": runtime.get("layers", []),
            "base": runtime.get("base"),
            "disk_bytes": runtime.get("disk_bytes"),
            "qemu": saved["qemu"],
            "files": files,
            # The restored agent still runs the snapshot's execs: new ids start past theirs.
            "next_id": channel.next_id + 1024,
        }

    @staticmethod
    async def _keep_execs(channel: AgentChannel, relay: qemu.StreamRelay, keep: bool) -> None:
        """Tell vminit whether a copy that loses its host keeps the agent's execs; the ping returns
        once vminit has handled it (frames are handled in order)."""
        relay.send_control(qemu.KEEP_NEXT if keep else qemu.KEEP_DONE)
        await channel.ping(timeout=10)

    @staticmethod
    def _pin_boot_files(qemu_pid: int, target: Path) -> dict[str, Any]:
        """The kernel and initramfs as QEMU's jail binds them (the very files it booted, even if the
        node's were replaced since), copied into the snapshot; their digests."""
        root = Path(f"/proc/{qemu_pid}/root")
        layout = qemu.VMLayout()
        return {
            "kernel": migration.pin(root / layout.kernel.lstrip("/"), target / SNAP_KERNEL),
            "initrd": migration.pin(root / layout.initrd.lstrip("/"), target / SNAP_INITRD),
        }

    async def _freeze_disk(self, vdir: Path, target: Path, runtime: dict[str, Any]) -> None:
        """The vm tier's overlay, copied while QEMU has it flushed and inactive (after migrating);
        a restored VM's merged with the snapshot disk beneath it, onto the base."""
        if not self.full:
            return
        if not (runtime.get("restored") or runtime.get("template")):
            await asyncio.to_thread(disks.copy_disk, vdir / ROOT_DISK, target / SNAP_DISK)
            return
        base = await asyncio.to_thread(disks.load_base, self.disks_dir, str(runtime["base"]))
        if base is None:
            raise disks.DiskBuildError("the image's base disk is gone")
        # The disk beneath the overlay as QEMU's jail has it bound (a template's may be gone since).
        snapdisk = Path(f"/proc/{runtime['qemu_pid']}/root") / qemu.VMLayout().snapdisk.lstrip("/")
        await asyncio.to_thread(disks.flatten_onto_base, vdir / ROOT_DISK, snapdisk, base.path, target / SNAP_DISK)

    def _snapshot_boot(self, source: Path, meta: dict[str, Any]) -> tuple[Boot, qemu.VMSpec]:
        """What a restore starts from, every file checked (blocking). SnapshotFileError if one is
        missing or changed; WrongStateError if the snapshot cannot run on this node."""
        if meta.get("format") != SNAP_FORMAT or meta.get("tier") != self.name:
            raise WrongStateError(f"the snapshot was not taken by this node's {self.name} tier")
        vm_spec = qemu.VMSpec(**meta["vm"])
        if vm_spec.accel != self.accel:
            raise WrongStateError(f"the snapshot was taken under {vm_spec.accel}, this node runs {self.accel}")
        files = meta["files"]
        migration.check(source / SNAP_KERNEL, str(files["kernel"]), "kernel")
        migration.check(source / SNAP_INITRD, str(files["initrd"]), "initramfs")
        state = source / SNAP_STATE
        if not state.is_file() or state.stat().st_size != int(files["state"]):
            raise migration.SnapshotFileError("the snapshot's memory is missing or truncated")
        if not self.full:
            layers = [self.store.verified_layer_path(str(d)) for d in meta["layers"]]
            return Boot(source / SNAP_KERNEL, source / SNAP_INITRD, layers), vm_spec
        base = disks.load_base(self.disks_dir, str(meta["base"]))
        if base is None:
            raise migration.SnapshotFileError("the image's base disk the snapshot's disk lies on is gone")
        if not (source / SNAP_DISK).is_file():
            raise migration.SnapshotFileError("the snapshot's disk is missing")
        return Boot(source / SNAP_KERNEL, source / SNAP_INITRD, [], base, source / SNAP_DISK), vm_spec

    async def restore(self, sandbox_id: str, spec: SandboxSpec, source: Path, meta: dict[str, Any]) -> LiveSandbox:
        assert self.kernel is not None, "backend not started"
        try:
            boot, vm_spec = await asyncio.to_thread(self._snapshot_boot, source, meta)
        except (migration.SnapshotFileError, LayerCorruptError, FileNotFoundError) as exc:
            raise DataLossError(f"the snapshot cannot be restored: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise WrongStateError(f"the snapshot's metadata is not this tier's: {exc!r}") from exc
        uid = self._new_uid()
        runtime: dict[str, Any] = {"uid": uid, "layers": list(meta["layers"]), "vm": meta["vm"], "restored": True}
        if boot.base is not None:
            runtime["base"] = meta["base"]
            runtime["disk_bytes"] = meta.get("disk_bytes")
        try:
            return await self._restore(sandbox_id, spec, source, meta, boot, vm_spec, runtime)
        except BaseException as exc:
            await self._start_failed(sandbox_id, runtime, exc, f"the {self.name} restored from its snapshot")
            raise

    async def _stream(self, source: Path, meta: dict[str, Any], boot: Boot) -> tuple[Boot, Path, bool]:
        """Where a restore of the snapshot at `source` starts from: (boot files, the migration stream,
        whether that stream leaves the RAM out). Here the snapshot's own; a shared template of it
        where templates.py made one."""
        return boot, source / SNAP_STATE, False

    async def _restore(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        source: Path,
        meta: dict[str, Any],
        boot: Boot,
        vm_spec: qemu.VMSpec,
        runtime: dict[str, Any],
    ) -> LiveSandbox:
        boot, state, ignore_shared = await self._stream(source, meta, boot)
        vdir = await self._launch(sandbox_id, spec, boot, vm_spec, runtime, incoming=True)
        async with asyncio.timeout(self.config.start_timeout + 60):
            await self._wait_qemu(vdir, runtime)
            qmp_path = vdir / "qmp.sock"
            await migration.load(
                vdir / "incoming.sock", qmp_path, state, str(meta["qemu"]), ignore_shared=ignore_shared
            )
            log.info("restored %s: its guest runs", sandbox_id)
            keep = [int(i) for i in meta.get("keep_execs", [])]
            retry = HELLO_RETRY_TEMPLATE if ignore_shared else HELLO_RETRY
            channel, inherited = await self._reconnect(sandbox_id, vdir, int(meta["next_id"]), keep, retry)
            try:
                self._relay(sandbox_id).freshen()
                await channel.forget(keep)  # the parent's other execs run on here, but nobody asks for them
                await channel.ping()
            except BaseException:
                channel.close()
                raise
        live = self._live(sandbox_id, channel, runtime)
        live.inherited = inherited
        return live

    def _relay(self, sandbox_id: str) -> qemu.StreamRelay:
        relay = self._vms[sandbox_id].relay
        assert relay is not None
        return relay

    async def _reconnect(
        self, sandbox_id: str, vdir: Path, first_id: int, keep: list[int], retry: float = HELLO_RETRY
    ) -> tuple[AgentChannel, dict[int, ExecProcess]]:
        """The restored agent's channel (called once its guest runs). Its vminit sees the parent's
        host gone and offers the agent's fresh channel to the next host, as after a daemon restart.
        Should the guest not have seen the old host go before we came (no SYNC, no HELLO), we leave
        briefly so that it does, and come again."""
        while True:
            relay, theirs = await qemu.StreamRelay.connect(vdir / "agent.sock", self.config.start_timeout)
            self._vms[sandbox_id].relay = relay
            channel = AgentChannel(theirs, first_id=first_id)
            # Handles first: output of the kept execs may follow the HELLO at once.
            inherited = {exec_id: channel.attach(exec_id, -1) for exec_id in keep}
            try:
                await channel.wait_hello(timeout=retry)
                return channel, inherited
            except TimeoutError:
                log.info("restored %s: no HELLO yet, reconnecting", sandbox_id)
            except BaseException:
                channel.close()
                raise
            channel.close()
            relay.close()
            retry = HELLO_RETRY  # a guest that saw us leave answers the next time, given time to
            await asyncio.sleep(0.2)  # long enough for vminit to see the port closed
