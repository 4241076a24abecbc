"""Booted templates (microvm and vm): a create is a restore, not a boot, and its guest memory is shared.

The first create of an image (with given memory, vCPUs and disk) boots one VM whose guest RAM is a
file in the template's directory, mapped shared (the guest writes the file). Once its agent answers,
its devices are saved with QEMU's `x-ignore-shared` migration capability (the stream leaves that RAM
out: it is the file) and its QEMU is killed without resuming, so the file holds exactly the memory
the stream expects. Every later create of that image starts a QEMU that maps the file privately
(copy on write) and loads the small stream: pages no VM writes stay the template's, once, in the
page cache; the QEMU shim (qemu_shim.c) opens the file read-only and the jail binds it from a
read-only mount, so no VM can change it. Each VM then gets fresh kernel entropy, the host's time and
its own hostname over vminit's control frames (StreamRelay.freshen). On the vm tier the builder's
root overlay (what its boot wrote over the image's base, its filesystem grown) is kept too, as the
template's `disk.qcow2`: each VM's own overlay lies on it, as a restored child's on its snapshot's.

Forks: before several restores of one snapshot, `share` makes a template of the snapshot
(its stream loaded once into a QEMU that never runs it, saved without RAM); `unshare` removes it
with the snapshot.

A template's directory, under state_dir/<tier>-templates/<key> (a cache):
`ram`, `state.bin`, the `kernel` and `initrd` it booted, (vm) `disk.qcow2`, `template.json`. The key
names all a template depends on: the VM's spec without its hostname, the image's layers, the disk's
size, the kernel, the initramfs and the QEMU binary; a change of any is another template. The builder VM is an ordinary
VM of the tier (`template-<key>` in its VM directory), so a daemon killed mid-build leaves residue
that recovery removes like any other; half-built directories are removed at start. At most
MAX_TEMPLATES are kept, the least recently used removed first (running VMs keep their mapping).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sandfleet.backends.base import LiveSandbox
from sandfleet.backends.vm import migration, qemu
from sandfleet.backends.vm.boot import SNAP_DISK, SNAP_INITRD, SNAP_KERNEL, SNAP_STATE, Boot
from sandfleet.backends.vm.machines import check_traversable
from sandfleet.backends.vm.snapshots import VMSnapshots
from sandfleet.errors import DataLossError, UnavailableError
from sandfleet.images import ImageManifest
from sandfleet.models import SandboxSpec
from sandfleet.runtime.agent import AgentChannel
from sandfleet.runtime.agent_build import build_shared
from sandfleet.runtime.agent_errors import AgentBuildError

log = logging.getLogger("sandfleet.vm")

TEMPLATE_FORMAT = 1
MAX_TEMPLATES = 16
SHIM_SOURCE = Path(__file__).with_name("qemu_shim.c")
SHIM_NAME = "sandfleet-qemu-shim.so"
RAM, META = "ram", "template.json"
SNAP_PREFIX = "snapshot-"  # a template made of a snapshot (a fork's), not of an image


class VMTemplates(VMSnapshots):
    """A QEMU tier's VMs, created from booted templates (unless `templates = false`)."""

    @property
    def templates_dir(self) -> Path:
        # On the state disk, not run_dir's tmpfs: a snapshot of a VM reads every guest page, and a
        # read of a hole of the file (a page the template never touched) makes a page cache page of
        # it, which on disk is clean and reclaimable, and on a tmpfs would be memory for good.
        return self.state_dir / f"{self.name}-templates"

    @property
    def _templated(self) -> bool:
        return self.config.templates

    @property
    def _shares(self) -> bool:
        """Forks through a template of the snapshot (on the vm tier each child's overlay lies on the
        snapshot's own disk, as in a plain restore: the template carries no disk)."""
        return self._templated

    async def start(self) -> None:
        await super().start()
        self._template_locks: dict[str, asyncio.Lock] = {}
        self._checked: set[str] = set()  # templates whose boot files were checked by digest
        self._shim: Path | None = None
        if self._templated:
            await asyncio.to_thread(self._prepare_templates_dir)

    def _prepare_templates_dir(self) -> None:
        """The directory (traversable: QEMU's jail binds from it), without half-built templates, and
        the shim beside them (readable by the jail uids)."""
        self.templates_dir.mkdir(mode=0o711, exist_ok=True)
        os.chmod(self.templates_dir, 0o711)
        check_traversable(self.templates_dir)
        for entry in self.templates_dir.iterdir():
            if entry.name.startswith(".") or (entry.name.startswith(SNAP_PREFIX) and not _source_exists(entry)):
                shutil.rmtree(entry, ignore_errors=True)  # half built, or of a snapshot deleted since
        try:
            built = build_shared(SHIM_SOURCE, self.state_dir / "qemu-shim", SHIM_NAME)
        except AgentBuildError as exc:
            raise UnavailableError(f"building the QEMU shim failed: {exc}") from exc
        shim = self.templates_dir / SHIM_NAME
        tmp = self.templates_dir / f".{SHIM_NAME}"
        shutil.copyfile(built, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, shim)
        self._shim = shim

    # -- create -------------------------------------------------------------------------------

    async def create(self, sandbox_id: str, spec: SandboxSpec, image: ImageManifest) -> LiveSandbox:
        if not self._templated:
            return await super().create(sandbox_id, spec, image)
        boot = await self._boot_files(image)
        vm_spec = self._spec(spec, len(boot.layers), sandbox_id)
        hostname = vm_spec.cmdline["hostname"]
        vm_spec = dataclasses.replace(vm_spec, cmdline={k: v for k, v in vm_spec.cmdline.items() if k != "hostname"})
        disk_bytes = boot.base.size + int(spec.resources.disk) if boot.base is not None else None
        key = await asyncio.to_thread(self._key, vm_spec, image, boot, disk_bytes)
        meta = await self._template(key, spec, boot, vm_spec, disk_bytes)
        runtime = self._runtime(spec, image, boot)
        runtime["template"] = key
        runtime["vm"] = dataclasses.asdict(vm_spec)  # a snapshot's restore: the same VM, anonymous RAM
        from_template = self._from(key, boot)
        try:
            return await self._from_template(sandbox_id, spec, from_template, vm_spec, meta, runtime, hostname)
        except BaseException as exc:
            await self._start_failed(sandbox_id, runtime, exc, f"the {self.name} from its template")
            raise

    async def _from_template(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        boot: Boot,
        vm_spec: qemu.VMSpec,
        meta: dict[str, Any],
        runtime: dict[str, Any],
        hostname: str,
    ) -> LiveSandbox:
        vdir = await self._launch(sandbox_id, spec, boot, vm_spec, runtime, incoming=True)
        async with asyncio.timeout(self.config.start_timeout):
            await self._wait_qemu(vdir, runtime)
            state = self.templates_dir / runtime["template"] / SNAP_STATE
            await migration.load(vdir / "incoming.sock", vdir / "qmp.sock", state, meta["qemu"], ignore_shared=True)
            channel, _ = await self._reconnect(sandbox_id, vdir, int(meta["next_id"]), [])
            try:
                self._relay(sandbox_id).freshen(hostname)
                await channel.ping()
            except BaseException:
                channel.close()
                raise
        return self._live(sandbox_id, channel, runtime)

    # -- forks: a template of the snapshot ----------------------------------------------------

    async def share(self, spec: SandboxSpec, source: Path, meta: dict[str, Any]) -> None:
        """Before a fork's restores: the snapshot made a template (its stream loaded once into a
        stopped QEMU whose RAM is a shared file, then saved without the RAM), so that the children
        map its memory copy-on-write instead of each loading all of it."""
        if not self._shares or not meta.get("vm", {}).get("ram_object"):
            return  # templates off, or a snapshot from before them (its RAM is not a backend object)
        key = _snapshot_key(source)
        try:
            boot, vm_spec = await asyncio.to_thread(self._snapshot_boot, source, meta)
        except (migration.SnapshotFileError, OSError, KeyError, TypeError, ValueError) as exc:
            raise DataLossError(f"the snapshot cannot be restored: {exc}") from exc
        async with self._template_locks.setdefault(key, asyncio.Lock()):
            try:
                await asyncio.to_thread(self._load, key, vm_spec)
                return
            except migration.SnapshotFileError:
                pass
            build = self._load_snapshot(source, meta)
            extra = {"next_id": meta["next_id"], "source": str(source)}
            await self._build(key, spec, boot, vm_spec, build, extra, meta.get("disk_bytes"))

    async def unshare(self, source: Path) -> None:
        key = _snapshot_key(source)
        self._checked.discard(key)
        await asyncio.to_thread(shutil.rmtree, self.templates_dir / key, True)

    async def _stream(self, source: Path, meta: dict[str, Any], boot: Boot) -> tuple[Boot, Path, bool]:
        """A restore of a snapshot that `share` made a template of starts from the template."""
        key = _snapshot_key(source)
        if not self._shares or not (self.templates_dir / key).is_dir():
            return await super()._stream(source, meta, boot)
        try:
            await asyncio.to_thread(self._load, key, qemu.VMSpec(**meta["vm"]))
        except migration.SnapshotFileError as exc:
            log.warning("the template of snapshot %s is damaged (%s): restoring from the snapshot", source, exc)
            return await super()._stream(source, meta, boot)
        return self._from(key, boot), self.templates_dir / key / SNAP_STATE, True

    @staticmethod
    def _load_snapshot(source: Path, meta: dict[str, Any]) -> Builder:
        """A builder's guest: the snapshot's stream, loaded and left stopped (it never runs: the
        template is the snapshot's very state)."""

        async def load(vdir: Path, work: Path, stack: contextlib.AsyncExitStack) -> None:
            state = source / SNAP_STATE
            await migration.load(vdir / "incoming.sock", vdir / "qmp.sock", state, str(meta["qemu"]), start=False)

        return Builder(load, incoming=True)

    # -- the templates ------------------------------------------------------------------------

    def _key(self, vm_spec: qemu.VMSpec, image: ImageManifest, boot: Boot, disk_bytes: int | None) -> str:
        """What the template depends on, hashed (blocking: stats the kernel and QEMU)."""

        def ident(path: Path | str | None) -> list[Any]:
            found = shutil.which(str(path)) if path is not None else None
            st = os.stat(found) if found else None
            return [str(found), st.st_size, st.st_mtime_ns] if st else [str(path)]

        what = {
            "format": TEMPLATE_FORMAT,
            "vm": dataclasses.asdict(vm_spec),
            "layers": [x.digest for x in image.layers],
            "disk_bytes": disk_bytes,  # vm: the root overlay's size (the guest grew its filesystem to it)
            "kernel": ident(boot.kernel),
            "initramfs": ident(boot.initramfs),
            "qemu": ident(self.config.qemu),
        }
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]

    async def _template(
        self, key: str, spec: SandboxSpec, boot: Boot, vm_spec: qemu.VMSpec, disk_bytes: int | None
    ) -> dict[str, Any]:
        """The template's metadata, built first if it is missing or damaged (one build per key)."""
        lock = self._template_locks.setdefault(key, asyncio.Lock())
        async with lock:
            try:
                return await asyncio.to_thread(self._load, key, vm_spec)
            except migration.SnapshotFileError as exc:
                if (self.templates_dir / key).exists():
                    log.warning("template %s is damaged (%s): building it again", key, exc)
            await self._build(key, spec, boot, vm_spec, Builder(self._boot_agent), {}, disk_bytes)
            return await asyncio.to_thread(self._load, key, vm_spec)

    def _load(self, key: str, vm_spec: qemu.VMSpec) -> dict[str, Any]:
        """A template's metadata, its files checked (sizes every time, boot files' digests once);
        SnapshotFileError (the directory removed) if one is missing or changed."""
        tdir = self.templates_dir / key
        try:
            meta: dict[str, Any] = json.loads((tdir / META).read_text())
            files = meta["files"]
            if (tdir / SNAP_STATE).stat().st_size != int(files["state"]):
                raise migration.SnapshotFileError("its device state is truncated")
            if (tdir / RAM).stat().st_size != vm_spec.memory_mib << 20:
                raise migration.SnapshotFileError("its memory file has the wrong size")
            if "disk" in files and (tdir / SNAP_DISK).stat().st_size != int(files["disk"]):
                raise migration.SnapshotFileError("its disk has the wrong size")
            if key not in self._checked:
                migration.check(tdir / SNAP_KERNEL, str(files["kernel"]), "kernel")
                migration.check(tdir / SNAP_INITRD, str(files["initrd"]), "initramfs")
                self._checked.add(key)
            os.utime(tdir / META)  # recently used: pruned last
            return meta
        except (OSError, ValueError, KeyError, TypeError, migration.SnapshotFileError) as exc:
            self._checked.discard(key)
            shutil.rmtree(tdir, ignore_errors=True)
            raise migration.SnapshotFileError(str(exc)) from exc

    def _from(self, key: str, boot: Boot) -> Boot:
        """What a VM started from the template `key` boots from: its files, its RAM mapped privately."""
        tdir = self.templates_dir / key
        kernel, initrd = tdir / SNAP_KERNEL, tdir / SNAP_INITRD
        # vm: the template's disk (over the image's base) beneath each VM's own overlay
        snapdisk = tdir / SNAP_DISK if boot.base is not None and not key.startswith(SNAP_PREFIX) else boot.snapdisk
        ram = tdir / RAM
        return Boot(
            kernel, initrd, boot.layers, boot.base, snapdisk, ram=ram, ram_mode="from_template", shim=self._shim
        )

    async def _boot_agent(self, vdir: Path, work: Path, stack: contextlib.AsyncExitStack) -> None:
        """An image template's guest: booted until its agent answers (then its channel is dropped:
        the VMs started from it reconnect as after a daemon restart)."""
        relay, theirs = await qemu.StreamRelay.connect(vdir / "agent.sock", self.config.start_timeout)
        self._vms[vdir.name].relay = relay
        channel = AgentChannel(theirs)
        try:
            await channel.wait_hello()
            await channel.ping()
            (work / "next_id").write_text(str(channel.next_id + 1024))  # noqa: ASYNC240 (a few bytes)
        finally:
            channel.close()

    async def _build(
        self,
        key: str,
        spec: SandboxSpec,
        boot: Boot,
        vm_spec: qemu.VMSpec,
        builder: Builder,
        extra: dict[str, Any],
        disk_bytes: int | None,
    ) -> None:
        """Start the template's VM with its RAM in a shared file, bring its guest to the state to keep
        (`builder`), save its devices (RAM left out), kill it unresumed, publish the directory."""
        work = self.templates_dir / f".{key}"
        name = f"template-{key}"
        uid = self._new_uid()
        runtime: dict[str, Any] = {"uid": uid, "disk_bytes": disk_bytes}
        try:
            await asyncio.to_thread(self._start_work, work, vm_spec.memory_mib, uid)
            building = dataclasses.replace(boot, ram=work / RAM, ram_mode="template_build")
            vdir = await self._launch(name, spec, building, vm_spec, runtime, incoming=builder.incoming)
            # A boot has start_timeout to answer, as any VM's; a snapshot's stream the time a restore has.
            limit = self.config.start_timeout + (60 if builder.incoming else 0)
            async with asyncio.timeout(limit), contextlib.AsyncExitStack() as stack:
                await self._wait_qemu(vdir, runtime)
                await builder.run(vdir, work, stack)
                files = await asyncio.to_thread(self._pin_boot_files, runtime["qemu_pid"], work)
                saved = await migration.save(
                    vdir / "qmp.sock",
                    vdir / "migrate.sock",
                    qemu.VMLayout().migrate_socket,
                    work / SNAP_STATE,
                    uid,
                    # vm: an image template's overlay over the base; a snapshot's keeps the snapshot's disk
                    (lambda: _nothing()) if builder.incoming else (lambda: self._freeze_disk(vdir, work, runtime)),
                    ignore_shared=True,
                    resume=False,
                )
        except BaseException as exc:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, work, True))
            await self._start_failed(name, runtime, exc, f"the {self.name} template's builder")
            raise
        await asyncio.shield(self.cleanup(name, runtime))
        files["state"] = saved["bytes"]
        if (work / SNAP_DISK).exists():
            files["disk"] = (work / SNAP_DISK).stat().st_size
        meta = {"format": TEMPLATE_FORMAT, "qemu": saved["qemu"], "files": files, **extra}
        await asyncio.to_thread(self._publish, work, key, meta)
        log.info("built the %s template %s", self.name, key)

    @staticmethod
    def _start_work(work: Path, memory_mib: int, uid: int) -> None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(mode=0o711)
        os.chmod(work, 0o711)
        ram = work / RAM
        with open(ram, "wb") as f:
            f.truncate(memory_mib << 20)  # sparse: the guest's untouched pages take nothing
        os.chown(ram, uid, uid)  # the builder's QEMU writes it
        os.chmod(ram, 0o600)

    def _publish(self, work: Path, key: str, meta: dict[str, Any]) -> None:
        """The built template, read-only for everyone but root, under its key (atomically)."""
        ram = work / RAM
        os.chown(ram, 0, 0)
        os.chmod(ram, 0o644)
        if "next_id" not in meta:
            meta["next_id"] = int((work / "next_id").read_text())
        (work / META).write_text(json.dumps(meta))
        target = self.templates_dir / key
        shutil.rmtree(target, ignore_errors=True)
        os.rename(work, target)
        self._prune(keep=key)

    def _prune(self, keep: str) -> None:
        """At most MAX_TEMPLATES, the least recently used removed first."""
        found = []
        for entry in self.templates_dir.iterdir():
            if entry.is_dir() and not entry.name.startswith(".") and entry.name != keep:
                with contextlib.suppress(OSError):
                    found.append(((entry / META).stat().st_mtime, entry))
        found.sort()
        for _, entry in found[: max(0, len(found) + 1 - MAX_TEMPLATES)]:
            shutil.rmtree(entry, ignore_errors=True)

    def templates(self) -> list[str]:
        """The keys of the templates kept (for tests and the doctor)."""
        with contextlib.suppress(FileNotFoundError):
            return sorted(e.name for e in self.templates_dir.iterdir() if e.is_dir() and not e.name.startswith("."))
        return []


@dataclasses.dataclass(frozen=True)
class Builder:
    """How a template's VM reaches the state kept: `run(vm_dir, work_dir, stack)` once its QEMU
    runs (`stack` closes what must stay open until its devices are saved); `incoming`: its QEMU
    loads a stream (a snapshot's) instead of booting."""

    run: Callable[[Path, Path, contextlib.AsyncExitStack], Awaitable[None]]
    incoming: bool = False


async def _nothing() -> None:
    return None


def _snapshot_key(source: Path) -> str:
    """A snapshot's template: named by the snapshot's directory (a snapshot's files never change)."""
    return SNAP_PREFIX + hashlib.sha256(str(source).encode()).hexdigest()[:24]


def _source_exists(tdir: Path) -> bool:
    try:
        return Path(json.loads((tdir / META).read_text())["source"]).is_dir()
    except (OSError, ValueError, KeyError, TypeError):
        return False
