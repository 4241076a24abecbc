"""Running QEMU for the microvm and vm tiers: its command line, the jail it runs in, a small QMP
client, and the host side of the agent channel relay.

The jail: QEMU never runs as root. Each VM's QEMU gets a host uid of its own (jail_uid_base + slot),
no capabilities and an empty bounding set (setpriv), and a private mount namespace (bubblewrap in
a user namespace of that uid) holding /usr read-only, a minimal /dev and, bound from file
descriptors the daemon opened as root, exactly the files it needs: the kernel, the initramfs, the
read-only layer files (or, for the vm tier, the image's base disk) and its own run directory
(sockets, pidfile, console log, the vm tier's copy-on-write root disk).
No network namespace device but loopback exists in it, and QEMU gets no NIC. QEMU's own -sandbox
(seccomp) denies spawning, privilege changes and resource control on top.

The channel: the guest's vminit relays agent datagrams over a virtio-serial port as frames
(u32 little-endian length + bytes) and sends SYNC_MAGIC first on every (re)connection; the daemon
turns the stream back into datagrams on a SOCK_SEQPACKET socketpair whose other end is an ordinary
AgentChannel, so the service cannot tell a VM's agent from a container's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sandfleet.runtime.agent_wire import MAX_DATAGRAM

log = logging.getLogger("sandfleet.qemu")

SYNC_MAGIC = b"SFVMSYNC"  # never a valid frame length (0x4d564653 > MAX_DATAGRAM): see vminit.c
CTRL_MAGIC = b"SFVMCTRL"  # a frame of CTRL_MAGIC + an 8-byte command is for vminit, not the agent
KEEP_NEXT = b"keepnext"  # a snapshot follows: a copy's agent keeps its execs when its host goes
KEEP_DONE = b"keepdone"  # the snapshot is done: the parent's next host loss orphans them again
ENTROPY, REALTIME, HOSTNAME = b"entropy\0", b"realtime", b"hostname"  # + an argument: StreamRelay.freshen
AGENT_PORT = "sandfleet.agent"
JAIL_ROOT = "/vm"  # where the jail shows the VM's files
Machine = Literal["microvm", "vm"]


@dataclass(frozen=True)
class VMLayout:
    """One VM's files as QEMU sees them inside its jail."""

    run: str = f"{JAIL_ROOT}/run"  # the VM's own directory, writable
    kernel: str = f"{JAIL_ROOT}/kernel"
    initrd: str = f"{JAIL_ROOT}/initrd"
    base: str = f"{JAIL_ROOT}/base"  # vm: the image's shared base disk (the root overlay's backing file)
    # vm, restored: the snapshot's frozen copy of its parent's overlay (over base), under this VM's own
    snapdisk: str = f"{JAIL_ROOT}/snapdisk"
    ram: str = f"{JAIL_ROOT}/ram"  # a template's guest memory file (templates.py)
    shim: str = f"{JAIL_ROOT}/shim.so"  # qemu_shim.c, preloaded when that file is mapped privately

    def layer(self, i: int) -> str:
        return f"{JAIL_ROOT}/layer{i}"

    @property
    def agent_socket(self) -> str:
        return f"{self.run}/agent.sock"

    @property
    def qmp_socket(self) -> str:
        return f"{self.run}/qmp.sock"

    @property
    def migrate_socket(self) -> str:
        """Where a snapshot's migration stream goes (the daemon listens; QEMU may not spawn `cat`)."""
        return f"{self.run}/migrate.sock"

    @property
    def incoming_socket(self) -> str:
        """Where a restored VM's QEMU listens for the snapshot's migration stream."""
        return f"{self.run}/incoming.sock"


@dataclass(frozen=True)
class VMSpec:
    machine: Machine
    memory_mib: int
    vcpus: int
    layers: int  # read-only disks, bottom layer first (vda, vdb, ...)
    accel: Literal["kvm", "tcg"]
    tcg_cache_mib: int
    cmdline: dict[str, str] = field(default_factory=dict)  # sandfleet.* kernel arguments
    writable_disk: str | None = None  # vm: a qcow2 overlay in the run dir (the guest's last disk)
    # Guest RAM is the memory backend object "ram" (VMs made since booted templates: a template's
    # file, or anonymous memory of the same name, so that any such VM's stream restores into any)
    ram_object: bool = False


# Where a VM's guest RAM lives: anonymous memory; the file a template is being built in (shared:
# the guest writes it); a template's file mapped privately (copy on write, the file never changes).
RamMode = Literal["anonymous", "template_build", "from_template"]


def host_tsc_khz() -> int:
    """The host's TSC rate in kHz (/proc/cpuinfo's "cpu MHz", which is it with constant_tsc)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return int(float(line.split(":")[1]) * 1000)
    except (OSError, ValueError, IndexError):
        pass
    return 2_000_000


def qemu_argv(
    qemu: str, spec: VMSpec, layout: VMLayout, *, incoming: bool = False, ram: RamMode = "anonymous"
) -> list[str]:
    """QEMU's command line for one VM (paths as the jail shows them). `incoming`: a restore, whose
    QEMU waits for a migration stream on layout.incoming_socket instead of booting."""
    microvm = spec.machine == "microvm"
    bus = "device" if microvm else "pci"  # virtio-mmio on microvm, PCI on q35
    # The guest's TSC ticks at the host's rate under TCG; told so, the kernel skips calibrating it
    # against the PIT, which fails (and then hangs the boot) whenever the host is busy.
    append = ["console=ttyS0", "quiet", "panic=-1", "rdinit=/init", "random.trust_cpu=on"]
    append += [f"tsc_early_khz={host_tsc_khz()}", "no_timer_check"]
    append += [f"sandfleet.{k}={v}" for k, v in spec.cmdline.items()]
    argv = [qemu, "-name", "sandfleet", "-nodefaults", "-no-user-config", "-nographic", "-no-reboot"]
    # Defaults for microvm: with x-option-roms=off or rtc=off the 6.1 kernel hangs calibrating its TSC under TCG.
    machine = "microvm" if microvm else "q35"
    if spec.ram_object:
        size = f"size={spec.memory_mib}M"
        if ram == "anonymous":
            argv += ["-object", f"memory-backend-ram,id=ram,{size}"]
        else:
            share = "on" if ram == "template_build" else "off"
            argv += ["-object", f"memory-backend-file,id=ram,{size},mem-path={layout.ram},share={share}"]
        machine += ",memory-backend=ram"
    argv += ["-M", machine]
    if spec.accel == "kvm":
        argv += ["-accel", "kvm", "-cpu", "host"]
    else:
        # QEMU's default translation cache is 1 GiB per VM; a small one is plenty for one sandbox.
        argv += ["-accel", f"tcg,thread=multi,tb-size={spec.tcg_cache_mib}"]
    argv += ["-m", f"{spec.memory_mib}M", "-smp", str(spec.vcpus)]
    argv += ["-kernel", layout.kernel, "-initrd", layout.initrd, "-append", " ".join(append)]
    for i in range(spec.layers):
        argv += ["-drive", f"file={layout.layer(i)},format=raw,if=none,id=layer{i},read-only=on"]
        argv += ["-device", f"virtio-blk-{bus},drive=layer{i}"]
    if spec.writable_disk is not None:
        argv += ["-drive", f"file={spec.writable_disk},format=qcow2,if=none,id=rw,discard=unmap"]
        argv += ["-device", f"virtio-blk-{bus},drive=rw"]
    argv += ["-chardev", f"socket,id=agent,path={layout.agent_socket},server=on,wait=off"]
    argv += ["-device", f"virtio-serial-{bus},max_ports=2"]
    argv += ["-device", f"virtserialport,chardev=agent,name={AGENT_PORT}"]
    # Free page reporting: pages the guest frees go back to the host (idle VMs shrink).
    argv += ["-device", f"virtio-balloon-{bus},free-page-reporting=on"]
    argv += ["-chardev", f"file,id=console,path={layout.run}/console.log", "-serial", "chardev:console"]
    argv += ["-qmp", f"unix:{layout.qmp_socket},server=on,wait=off"]
    argv += ["-nic", "none", "-pidfile", f"{layout.run}/qemu.pid"]
    argv += ["-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"]
    if incoming:
        argv += ["-incoming", f"unix:{layout.incoming_socket}"]
    return argv


@dataclass(frozen=True)
class JailFiles:
    """File descriptors (opened by the daemon, as root) that the jail binds: the source paths are
    never looked up as the jail uid, so QEMU needs no access to the directories they live in."""

    run_dir: int
    kernel: int
    initrd: int
    layers: list[int]
    kvm: bool = False
    base: int | None = None  # vm: the base disk, bound read-only
    snapdisk: int | None = None  # vm, restored: the snapshot's disk, bound read-only
    ram: int | None = None  # a template's memory file: read-write while it is built, else read-only
    ram_writable: bool = False
    shim: int | None = None  # qemu_shim.c's build, preloaded when `ram` is read-only


def jail_argv(uid: int, files: JailFiles, layout: VMLayout, inner: list[str]) -> list[str]:
    """setpriv (uid, no groups, no capabilities, empty bounding set) -> bwrap (private namespaces,
    only what QEMU needs) -> QEMU. bwrap stays QEMU's parent (it waits for it) in a session of its own."""
    argv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    argv += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
    argv += ["bwrap", "--unshare-user", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    argv += ["--new-session", "--cap-drop", "ALL"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in ("lib", "lib64", "bin", "sbin"):
        if Path(f"/{name}").is_symlink():
            argv += ["--symlink", f"usr/{name}", f"/{name}"]
    argv += ["--dev", "/dev", "--tmpfs", "/tmp", "--dir", JAIL_ROOT]
    if files.kvm:
        argv += ["--dev-bind", "/dev/kvm", "/dev/kvm"]
    argv += ["--bind-fd", str(files.run_dir), layout.run]
    argv += ["--ro-bind-fd", str(files.kernel), layout.kernel, "--ro-bind-fd", str(files.initrd), layout.initrd]
    for i, fd in enumerate(files.layers):
        argv += ["--ro-bind-fd", str(fd), layout.layer(i)]
    if files.base is not None:
        argv += ["--ro-bind-fd", str(files.base), layout.base]
    if files.snapdisk is not None:
        argv += ["--ro-bind-fd", str(files.snapdisk), layout.snapdisk]
    if files.ram is not None:
        argv += ["--bind-fd" if files.ram_writable else "--ro-bind-fd", str(files.ram), layout.ram]
    if files.shim is not None:
        argv += ["--ro-bind-fd", str(files.shim), layout.shim]
        argv += ["--setenv", "LD_PRELOAD", layout.shim, "--setenv", "SANDFLEET_RO_FILE", layout.ram]
    argv += ["--chdir", layout.run, "--", *inner]
    return argv


# ---- QMP ---------------------------------------------------------------------------------------


class QMPError(RuntimeError):
    pass


class QMP:
    """A minimal QMP client: one command at a time, events ignored."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(cls, path: Path, timeout: float = 5.0) -> QMP:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 20)
            qmp = cls(reader, writer)
            await qmp._read()  # the greeting
            await qmp.execute("qmp_capabilities")
            return qmp

    async def _read(self) -> dict[str, Any]:
        while True:
            line = await self._reader.readline()
            if not line:
                raise QMPError("QMP connection closed")
            msg: dict[str, Any] = json.loads(line)
            if "event" not in msg:
                return msg

    async def execute(self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
        async with self._lock, asyncio.timeout(timeout):
            req: dict[str, Any] = {"execute": command}
            if arguments:
                req["arguments"] = arguments
            self._writer.write(json.dumps(req).encode() + b"\n")
            await self._writer.drain()
            reply = await self._read()
            if "error" in reply:
                raise QMPError(f"{command}: {reply['error'].get('desc', reply['error'])}")
            return reply.get("return")

    def close(self) -> None:
        self._writer.close()


async def qmp_command(path: Path, command: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:  # noqa: ASYNC109
    """Connect, run one command, disconnect (QMP accepts one client at a time; we hold none)."""
    qmp = await QMP.connect(path, timeout)
    try:
        return await qmp.execute(command, arguments, timeout)
    finally:
        qmp.close()


# ---- the channel relay -------------------------------------------------------------------------


class StreamRelay:
    """Datagrams <-> the guest's framed byte stream, for one VM.

    `ours` is a SOCK_SEQPACKET end whose peer the AgentChannel holds. Ends when either side closes
    (the AgentChannel closing ends the connection to QEMU's chardev, which the guest sees as the
    host leaving; the guest's agent then offers a fresh channel for the next connection).
    """

    def __init__(self, ours: socket.socket, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ours.setblocking(False)
        self._sock = ours
        self._reader = reader
        self._writer = writer
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def connect(cls, path: Path, timeout: float) -> tuple[StreamRelay, socket.socket]:  # noqa: ASYNC109
        """Connect to QEMU's agent chardev; returns the relay and the socket to hand AgentChannel."""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    reader, writer = await asyncio.open_unix_connection(str(path), limit=4 * MAX_DATAGRAM)
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    await asyncio.sleep(0.02)  # QEMU has not made its socket yet
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        relay = cls(ours, reader, writer)
        relay.start()
        return relay, theirs

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._to_agent()), asyncio.create_task(self._to_guest())]

    async def _to_agent(self) -> None:
        """Guest stream -> datagrams. Bytes before SYNC_MAGIC are an earlier connection's leftovers."""
        loop = asyncio.get_running_loop()
        try:
            await self._reader.readuntil(SYNC_MAGIC)
            while True:
                head = await self._reader.readexactly(4)
                if head == SYNC_MAGIC[:4]:
                    await self._reader.readexactly(4)  # the guest saw a reconnect we did not
                    continue
                (length,) = struct.unpack("<I", head)
                if length > MAX_DATAGRAM:
                    raise ValueError(f"bad frame length {length} from the guest")
                data = await self._reader.readexactly(length)
                await loop.sock_sendall(self._sock, data)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ValueError) as exc:
            log.debug("agent relay: guest side ended: %r", exc)
        finally:
            self.close()

    async def _to_guest(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                data = await loop.sock_recv(self._sock, MAX_DATAGRAM)
                if not data:
                    break
                self._writer.write(struct.pack("<I", len(data)) + data)
                await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            log.debug("agent relay: daemon side ended: %r", exc)
        finally:
            self.close()

    def send_control(self, command: bytes, arg: bytes = b"") -> None:
        """A control frame for vminit (KEEP_NEXT, KEEP_DONE, ENTROPY, REALTIME, HOSTNAME). One write:
        never inside another frame. It is handled before any later datagram reaches the agent (a
        ping after it confirms it)."""
        assert len(command) == 8
        payload = CTRL_MAGIC + command + arg
        self._writer.write(struct.pack("<I", len(payload)) + payload)

    def freshen(self, hostname: str | None = None) -> None:
        """What a restored copy must not keep of its parent (see vminit.c): its kernel's random
        state (fresh host entropy, reseeded), its stopped clock (the host's time) and, from a
        template, the template's hostname."""
        self.send_control(ENTROPY, os.urandom(64))
        self.send_control(REALTIME, struct.pack("<Q", time.time_ns()))
        if hostname is not None:
            self.send_control(HOSTNAME, hostname.encode()[:64])

    def close(self) -> None:
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._writer.close()
