"""Sockets in a sandbox's network namespace, made from the daemon.

A socket belongs to the network namespace its creator was in when it made it, and keeps it after:
so the daemon can listen on a sandbox's 127.0.0.1 (the egress proxy's front) or connect to a server
listening there (an exposed port) with no process, veth or address of its own in the sandbox. The
namespace is entered by one short-lived thread (setns(2) changes only the calling thread's
namespace), which ends right after: no thread of the daemon is ever left in a sandbox's namespace,
even if switching back failed.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
from collections.abc import Callable
from typing import TypeVar

CLONE_NEWNET = 0x40000000
T = TypeVar("T")

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def in_netns(ns_path: str, fn: Callable[[], T]) -> T:
    """Run `fn` on a fresh thread that has joined the network namespace at `ns_path`
    (`/proc/<pid>/ns/net`); its result or exception is returned or raised here. Blocking: call it
    through asyncio.to_thread."""
    out: list[T] = []
    err: list[BaseException] = []
    fd = os.open(ns_path, os.O_RDONLY | os.O_CLOEXEC)

    def run() -> None:
        try:
            _setns(fd)
            out.append(fn())
        except BaseException as exc:  # handed to the caller
            err.append(exc)

    try:
        t = threading.Thread(target=run, name="sandfleet-netns", daemon=True)
        t.start()
        t.join()
    finally:
        os.close(fd)
    if err:
        raise err[0]
    return out[0]


def listen_loopback(ns_path: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on 127.0.0.1:`port` of the namespace (non-blocking, close-on-exec)."""

    def make() -> socket.socket:
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

    return in_netns(ns_path, make)


def loopback_socket(ns_path: str) -> socket.socket:
    """An unconnected, non-blocking TCP socket of the namespace (connect it to its 127.0.0.1)."""

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        return s

    return in_netns(ns_path, make)


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
