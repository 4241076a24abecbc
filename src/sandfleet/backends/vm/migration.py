"""Snapshots of the QEMU tiers: QEMU's migration stream, saved to a file and fed back.

QEMU runs with `-sandbox spawn=deny`, so it cannot migrate to `exec:cat > FILE`. Instead:

save: the daemon listens on a unix socket in the VM's directory, stops the vCPUs, has QEMU
  `migrate` to that socket and copies the stream into the snapshot's file. When it completes the
  source is `postmigrate` with its disks flushed and inactive: the caller copies what it needs
  (the vm tier's overlay) before `cont` resumes the VM, which keeps running.
load: the restored VM's QEMU starts with `-incoming unix:...` (it listens on that socket in its
  directory); the daemon connects and sends the file; QEMU loads it and starts the guest.

A restored guest's memory expects the exact files its QEMU was started with; `pin` copies those
bytes into the snapshot and records their digests, `check` refuses a restore whose files are gone
or changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sandfleet.backends.vm.qemu import QMP, QMPError

CHUNK = 1 << 20
POLL = 0.02


class SnapshotFileError(RuntimeError):
    """A file a restore needs is missing or not the one the snapshot was taken with."""


def digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def pin(src: Path, dest: Path) -> str:
    """Copy `src` to `dest` (readable by the restored VMs' jail uids, through bound fds); its sha256."""
    shutil.copyfile(src, dest)
    os.chmod(dest, 0o644)
    return digest(dest)


def check(path: Path, expected: str, what: str) -> None:
    if not path.is_file():
        raise SnapshotFileError(f"the snapshot's {what} is missing")
    if digest(path) != expected:
        raise SnapshotFileError(f"the snapshot's {what} was changed")


def _listen(path: Path, owner: int) -> socket.socket:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(str(path))
        os.chown(path, owner, owner)  # QEMU connects as its jail uid
        os.chmod(path, 0o600)
        sock.listen(1)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _copy_stream(conn: socket.socket, out: Path) -> int:
    """Blocking: everything QEMU sends until it closes the connection, into `out`; bytes copied."""
    conn.setblocking(True)
    total = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(out, "wb") as f:
        while n := conn.recv_into(buf):
            f.write(view[:n])
            total += n
        f.flush()
        os.fsync(f.fileno())
    return total


async def _receive(listener: socket.socket, out: Path) -> int:
    loop = asyncio.get_running_loop()
    conn, _ = await loop.sock_accept(listener)
    with conn:
        return await asyncio.to_thread(_copy_stream, conn, out)


async def _wait_migration(qmp: QMP) -> None:
    """Until the outgoing migration completes; QMPError if it fails."""
    while True:
        info = await qmp.execute("query-migrate")
        status = info.get("status") if isinstance(info, dict) else None
        if status == "completed":
            return
        if status in ("failed", "cancelled"):
            raise QMPError(f"migration {status}: {info.get('error-desc', '')}")
        await asyncio.sleep(POLL)


async def save(
    qmp_path: Path,
    listen_path: Path,
    uri_path: str,
    out: Path,
    owner: int,
    while_stopped: Callable[[], Awaitable[None]],
    *,
    ignore_shared: bool = False,
    resume: bool = True,
) -> dict[str, Any]:
    """Migrate the VM behind `qmp_path` into `out`, run `while_stopped` (the stream is complete, the
    guest still stopped, its disks flushed), resume the VM. `listen_path` is our socket,
    `uri_path` the same socket as QEMU sees it. Returns QEMU's version and the stream's size.
    The caller bounds the time (asyncio.timeout); the VM is resumed whatever happens, unless
    `resume` is false (a template: its memory file must stay as the stream left it).
    `ignore_shared`: RAM in a shared file backend is left out of the stream (a template's)."""
    listener = _listen(listen_path, owner)
    qmp = await QMP.connect(qmp_path)
    receiver: asyncio.Task[int] | None = None
    try:
        version = await qmp.execute("query-version")
        await qmp.execute("stop")
        try:
            # Stopped: nothing to converge, so no reason to throttle (the default is 128 MiB/s).
            await qmp.execute("migrate-set-parameters", {"max-bandwidth": 1 << 40})
            # Said every time: a VM started from a template was loaded with it on.
            await _ignore_shared(qmp, ignore_shared)
            receiver = asyncio.create_task(_receive(listener, out))
            await qmp.execute("migrate", {"uri": f"unix:{uri_path}"})
            try:
                await _wait_migration(qmp)
            except BaseException:
                with contextlib.suppress(QMPError, OSError, TimeoutError):
                    await asyncio.shield(qmp.execute("migrate_cancel"))
                raise
            size = await receiver
            await while_stopped()
        finally:
            # Also after a failed migration: the sandbox keeps running, as before the snapshot.
            if resume:
                await asyncio.shield(qmp.execute("cont"))
        return {"qemu": _version(version), "bytes": size}
    finally:
        if receiver is not None and not receiver.done():
            receiver.cancel()
            with contextlib.suppress(BaseException):
                await receiver
        qmp.close()
        listener.close()
        listen_path.unlink(missing_ok=True)  # noqa: ASYNC240 (a socket's name: never blocks)


async def _ignore_shared(qmp: QMP, on: bool = True) -> None:
    """Leave RAM of shared file backends out of the stream (or, loading, expect it left out)."""
    caps = [{"capability": "x-ignore-shared", "state": on}]
    await qmp.execute("migrate-set-capabilities", {"capabilities": caps})


def _version(reply: Any) -> str:
    """QEMU's version as query-version says it ("7.2.22 (Debian ...)")."""
    q = reply.get("qemu", {}) if isinstance(reply, dict) else {}
    return f"{q.get('major')}.{q.get('minor')}.{q.get('micro')} {reply.get('package', '')}".strip()


class VersionMismatchError(RuntimeError):
    """The snapshot was taken by another QEMU build (its machine types may differ)."""


async def connect(path: Path) -> socket.socket:
    """A connection to the socket a starting QEMU listens on (retried until it exists)."""
    loop = asyncio.get_running_loop()
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, str(path))
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            await asyncio.sleep(POLL)  # QEMU has not made its socket yet
        except BaseException:
            sock.close()
            raise


async def load(
    incoming_path: Path, qmp_path: Path, state: Path, qemu: str, *, ignore_shared: bool = False, start: bool = True
) -> None:
    """Send the stream in `state` to a QEMU started with -incoming on `incoming_path` (refused
    unless that QEMU's version is `qemu`, the snapshot's), and `cont` the guest once loaded. The
    caller bounds the time; QEMU exits if the stream does not load. `ignore_shared`: the stream was
    saved without the RAM of shared file backends (a template's: the guest's RAM is that file).
    `start` false: the guest stays stopped once loaded (a template is made of it)."""
    loop = asyncio.get_running_loop()
    sock = await connect(incoming_path)  # QEMU listens once it is set up: its QMP socket exists too
    with sock:
        qmp = await QMP.connect(qmp_path)
        try:
            version = _version(await qmp.execute("query-version"))
            if version != qemu:
                raise VersionMismatchError(f"the snapshot was taken with QEMU {qemu}, this node runs {version}")
            if ignore_shared:
                await _ignore_shared(qmp)  # read when the stream is: nothing was sent yet
            f = await asyncio.to_thread(open, state, "rb")
            with f:
                await loop.sock_sendfile(sock, f)
            sock.close()
            while True:
                status = await qmp.execute("query-status")
                run_state = status.get("status") if isinstance(status, dict) else None
                if run_state == "running":
                    return
                if run_state != "inmigrate":
                    if not start:
                        return
                    # Loaded: the source was stopped when it was migrated, so QEMU does not start it.
                    await qmp.execute("cont")
                await asyncio.sleep(POLL)
        finally:
            qmp.close()
