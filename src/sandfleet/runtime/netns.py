"""Sockets in a sandbox's network namespace, made from the daemon.

A socket belongs to the network namespace its creator was in when it made it, and keeps it after:
so the daemon can listen on a sandbox's 127.0.0.1 (the egress proxy's front) or connect to a server
listening there (an exposed port) with no process, veth or address of its own in the sandbox. One
thread of the daemon enters the namespaces (setns(2) changes only the calling thread's): it does
nothing but make these sockets, each job entering its sandbox's namespace first, so it may stay in
whichever it entered last. A job costs ~0.2 ms (a thread started per job: ~0.7 ms).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import socket
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)
_entering = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandfleet-netns")


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _in(ns_path: str, fn: Callable[[], T]) -> T:
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd)
    finally:
        os.close(fd)
    return fn()


async def in_netns(ns_path: str, fn: Callable[[], T]) -> T:
    """Run `fn` on the namespace thread, inside the network namespace at `ns_path`
    (`/proc/<pid>/ns/net`); its result or exception comes back here."""
    return await asyncio.get_running_loop().run_in_executor(_entering, _in, ns_path, fn)


def _listener(port: int, backlog: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(backlog)
        s.setblocking(False)
    except BaseException:
        s.close()
        raise
    return s


def _unconnected() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    return s


async def listen_loopback(ns_path: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` of the namespace (non-blocking, close-on-exec)."""
    return await in_netns(ns_path, lambda: _listener(port, backlog))


async def loopback_socket(ns_path: str) -> socket.socket:
    """An unconnected, non-blocking TCP socket of the namespace (connect it to its 127.0.0.1)."""
    return await in_netns(ns_path, _unconnected)


def is_local_address(ip: str) -> bool:
    """Whether this host (in the caller's namespace) owns `ip`: binding to an address is allowed only
    for one of the host's own (without IP_FREEBIND), so the kernel answers with the current set."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
        return True
