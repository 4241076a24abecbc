"""A sandbox's network: its egress policy (set at create, changed at any time), the proxy
environment of its commands (with the node's CA bundle, when it has one), and the ports it exposes
to the node.

The mechanism is egress.py's proxy (a listening socket in the sandbox's namespace, no veth); a
policy that allows nothing costs nothing. An exposed port is reached the other way: the daemon
connects to 127.0.0.1:<port> *inside* the sandbox's namespace (a socket made there), for an HTTP
request to `/v1/sandboxes/{id}/ports/{port}/...` of its API (its authentication applies) or a byte
stream through a unix socket on the node (mode 0600: root's, like the API socket). Nothing is
reachable from outside that was not exposed, and everything goes with the sandbox.

The node's CA bundle (`[network] ca_bundle`, for a TLS-inspecting egress) is written into each
networked sandbox's /dev: its scratch tmpfs, outside the writable layer, so it is never packed,
never one of the agent's changes a verification sees, and never in a shared layer; the variables
tools read a CA bundle from point at it.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno
import functools
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from sandfleet.backends.base import HostFiles, LiveSandbox, Networked, offers
from sandfleet.daemon.net.egress import ConnectionSlots, EgressProxy, accept_loop, proxy_env
from sandfleet.daemon.net.policy import NetworkConfig, Policy, compile_policy, read_ca_bundle
from sandfleet.daemon.node.core import NodeCore
from sandfleet.daemon.node.lifecycle import HOLDING_STATES, Sandbox
from sandfleet.daemon.node.monitor import Monitor
from sandfleet.daemon.node.pausing import Pauser
from sandfleet.errors import (
    InvalidArgumentError,
    NotFoundError,
    SandboxError,
    UnavailableError,
    UnsupportedError,
    WrongStateError,
)
from sandfleet.models import ExposedPort, NetworkPolicy, SandboxInfo, SandboxSpec
from sandfleet.runtime import netns, openat2, splice
from sandfleet.runtime.sandboxfs.fs import SandboxFS
from sandfleet.runtime.sandboxfs.results import FileOpError

log = logging.getLogger(__name__)

MAX_EXPOSED = 16  # ports per sandbox
CONNECT_TIMEOUT = 10.0
CA_BUNDLE_PATH = "/dev/sandfleet-ca.pem"  # inside a networked sandbox
# What OpenSSL (Python's ssl, curl), requests, pip, Node.js (npm), curl and git read a CA bundle from.
CA_VARS = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")


@dataclass
class _Exposure:
    port: int
    socket_path: Path
    accepting: asyncio.Task[None]  # owns the listening unix socket; cancelled, it closes it
    conns: set[asyncio.Task[None]]


class Networking:
    def __init__(self, core: NodeCore, pauser: Pauser, monitor: Monitor, config: NetworkConfig, run_dir: Path) -> None:
        self.core = core
        self.pauser = pauser
        self.monitor = monitor
        self.config = config
        self.ports_dir = run_dir / "ports"
        self.slots = ConnectionSlots(config.max_node_connections)  # the proxy's and the exposures'
        self.proxy = EgressProxy(config, monitor, self.slots)
        self._exposed: dict[str, dict[int, _Exposure]] = {}
        self._ca_bundle: bytes | None = None
        core.table.on_stopped(self._stopped)

    async def start(self) -> None:
        """Read the node's CA bundle; the exposure sockets of a previous daemon are stale (their
        sandboxes re-expose on demand)."""

        def clean() -> None:
            self.ports_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            for p in self.ports_dir.iterdir():
                with contextlib.suppress(OSError):
                    p.unlink()

        await asyncio.to_thread(clean)
        if self.config.ca_bundle is not None:
            self._ca_bundle = await asyncio.to_thread(read_ca_bundle, self.config.ca_bundle)

    async def close(self) -> None:
        await self.proxy.close()
        for sid in list(self._exposed):
            self._unexpose_all(sid)

    # ---- policy ------------------------------------------------------------------------------

    def check(self, spec: SandboxSpec) -> Policy:
        """The spec's policy, compiled: an unknown service is the caller's mistake, and a tier that
        cannot enforce a policy refuses anything but `none`."""
        policy = compile_policy(spec.network, self.config)
        if not policy.none:
            backend = self.core.tier_for(spec.backend)
            if not (isinstance(backend, Networked) and offers(backend, "network")):
                raise UnsupportedError(f"the {backend.name} tier has no network: its policy can only be 'none'")
        return policy

    def env(self, sb: Sandbox) -> dict[str, str]:
        """Variables every command of the sandbox gets (the proxy's address and the node's CA bundle,
        when it has them)."""
        if sb.spec.network.none:
            return {}
        env = proxy_env(self.config.proxy_port)
        if self._ca_bundle is not None:
            env.update(dict.fromkeys(CA_VARS, CA_BUNDLE_PATH))
        return env

    async def attach(self, sb: Sandbox) -> None:
        """Enforce the sandbox's policy (after a create, a restore, an adoption)."""
        if sb.spec.network.none or sb.live is None:
            return
        backend = self.core.tier(sb)
        if not isinstance(backend, Networked):
            return
        policy = compile_policy(sb.spec.network, self.config)
        await self.proxy.apply(sb.id, backend.netns_path(sb.live), policy)
        await self._install_ca_bundle(sb, sb.live)

    def detach(self, sb: Sandbox) -> None:
        """Its policy's enforcement ends (its network namespace is being replaced: `attach` again)."""
        self.proxy.detach(sb.id)

    async def _install_ca_bundle(self, sb: Sandbox, live: LiveSandbox) -> None:
        """The node's CA bundle at CA_BUNDLE_PATH in the sandbox (its /dev: the scratch tmpfs), as its
        root's, read-only. A sandbox that made that path unwritable gets a warning in the log: it
        only breaks its own TLS."""
        host = self.core.tier(sb)
        bundle = self._ca_bundle
        if bundle is None or not isinstance(host, HostFiles):
            return

        def write() -> None:
            root = host.open_root(live)
            try:
                # /dev is a mount of its own, which SandboxFS does not cross: root it there.
                how = openat2.RESOLVE_IN_ROOT | openat2.RESOLVE_NO_SYMLINKS | openat2.RESOLVE_NO_MAGICLINKS
                dev = openat2.openat2(root, "dev", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, 0, how)
            finally:
                os.close(root)
            try:
                SandboxFS(dev, uid_base=live.uid_base).write(CA_BUNDLE_PATH.removeprefix("/dev"), bundle, mode=0o444)
            finally:
                os.close(dev)

        try:
            await asyncio.to_thread(write)
        except (FileOpError, OSError, SandboxError) as exc:
            log.warning("sandbox %s: the node's CA bundle could not be written to %s: %s", sb.id, CA_BUNDLE_PATH, exc)

    async def set_network(self, sandbox_id: str, network: NetworkPolicy) -> SandboxInfo:
        sb, live = await self.pauser.ready(sandbox_id)
        spec = sb.spec.model_copy(update={"network": network})
        policy = self.check(spec)
        backend = self.core.tier(sb)
        if isinstance(backend, Networked):
            try:
                await self.proxy.apply(sb.id, backend.netns_path(live), policy)
            except OSError as exc:
                raise _listen_error(sandbox_id, self.config.proxy_port, exc) from exc
            if not policy.none:
                await self._install_ca_bundle(sb, live)
        sb.spec = spec
        await self.core.state.update(sb.id, spec=spec.model_dump(mode="json"))
        self.core.journal.record(sb.id, "network_policy", {"allow": list(network.allow)})
        return sb.info()

    async def set_network_many(self, labels: dict[str, str], network: NetworkPolicy) -> builtins.list[str]:
        done = []
        for sb in self.core.matching(labels, HOLDING_STATES):
            with contextlib.suppress(NotFoundError, UnavailableError):
                await self.set_network(sb.id, network)
                done.append(sb.id)
        return done

    # ---- exposed ports -------------------------------------------------------------------------

    def _networked(self, sb: Sandbox) -> Networked:
        backend = self.core.tier(sb)
        if not (isinstance(backend, Networked) and offers(backend, "network")):
            raise UnsupportedError(f"the {backend.name} tier cannot expose ports")
        return backend

    def _info(self, sandbox_id: str, e: _Exposure) -> ExposedPort:
        return ExposedPort(port=e.port, path=f"/v1/sandboxes/{sandbox_id}/ports/{e.port}/", socket=str(e.socket_path))

    async def expose(self, sandbox_id: str, port: int) -> ExposedPort:
        sb, _live = await self.pauser.ready(sandbox_id)
        self._networked(sb)
        mine = self._exposed.setdefault(sb.id, {})
        if port in mine:
            return self._info(sb.id, mine[port])
        if len(mine) >= MAX_EXPOSED:
            raise InvalidArgumentError(f"a sandbox exposes at most {MAX_EXPOSED} ports")
        path = self.ports_dir / f"{sb.id}-{port}.sock"
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is made 0600 (root's only), with no window
        try:
            server.bind(str(path))
            server.listen(64)
            server.setblocking(False)
        except BaseException:
            server.close()
            raise
        finally:
            os.umask(old)
        if sb.id not in self._exposed or sb.state not in HOLDING_STATES:  # stopped meanwhile
            server.close()
            with contextlib.suppress(OSError):
                path.unlink()
            raise NotFoundError(f"sandbox {sandbox_id} stopped")
        conns: set[asyncio.Task[None]] = set()
        accepting = asyncio.get_running_loop().create_task(self._accept(sb.id, port, server, conns))
        mine[port] = _Exposure(port, path, accepting, conns)
        self.core.journal.record(sb.id, "port_exposed", {"port": port})
        return self._info(sb.id, mine[port])

    async def unexpose(self, sandbox_id: str, port: int) -> None:
        sb = self.core.sandbox(sandbox_id)
        e = self._exposed.get(sb.id, {}).pop(port, None)
        if e is None:
            raise NotFoundError(f"sandbox {sandbox_id} does not expose port {port}")
        _close_exposure(e)

    async def list_exposed(self, sandbox_id: str) -> builtins.list[ExposedPort]:
        sb = self.core.sandbox(sandbox_id)
        return [self._info(sb.id, e) for e in sorted(self._exposed.get(sb.id, {}).values(), key=lambda e: e.port)]

    async def _accept(self, sandbox_id: str, port: int, server: socket.socket, conns: set[asyncio.Task[None]]) -> None:
        """Each connection to an exposure's unix socket: relayed to the port in the sandbox, within the
        sandbox's `max_connections` (over all its exposures) and the node's slots, until both ends
        close or neither sends a byte for `idle_timeout` (a server that never closes holds nothing)."""
        loop = asyncio.get_running_loop()

        async def serve(client: socket.socket) -> None:
            try:
                upstream = await self.connect_port(sandbox_id, port)
            except SandboxError:
                client.close()
                return
            try:
                await splice.both_ways(loop, client, upstream, idle=self.config.idle_timeout)
            finally:
                client.close()
                upstream.close()

        def closed(client: socket.socket, task: asyncio.Task[None]) -> None:
            conns.discard(task)
            client.close()
            self.slots.give()

        try:
            while True:
                client = await accept_loop(server, f"port {port} of sandbox {sandbox_id}")
                held = sum(len(e.conns) for e in self._exposed.get(sandbox_id, {}).values())
                if held >= self.config.max_connections or not self.slots.take():
                    client.close()  # a byte stream: nothing to answer with but its end
                    continue
                task = loop.create_task(serve(client))
                conns.add(task)
                task.add_done_callback(functools.partial(closed, client))
        finally:
            server.close()

    async def open_port(self, sandbox_id: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the sandbox's 127.0.0.1:`port`, as streams (the HTTP route's)."""
        return await asyncio.open_connection(sock=await self.connect_port(sandbox_id, port))

    async def connect_port(self, sandbox_id: str, port: int) -> socket.socket:
        """A non-blocking socket connected to the sandbox's 127.0.0.1:`port`, which it must have
        exposed (resumes it if paused)."""
        sb = self.core.sandbox(sandbox_id)
        if port not in self._exposed.get(sb.id, {}):
            raise NotFoundError(f"sandbox {sandbox_id} does not expose port {port} (expose it first)")
        sb, live = await self.pauser.ready(sandbox_id)
        ns = self._networked(sb).netns_path(live)
        try:
            sock = await netns.loopback_socket(ns)
        except OSError as exc:
            raise WrongStateError(f"sandbox {sandbox_id} is no longer running ({exc.strerror})") from exc
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port)), CONNECT_TIMEOUT)
            return sock
        except (OSError, TimeoutError) as exc:
            sock.close()
            if getattr(exc, "errno", None) == errno.ECONNREFUSED:  # the sandbox's state, not the node's
                raise WrongStateError(f"nothing listens on port {port} of sandbox {sandbox_id}") from exc
            raise UnavailableError(f"port {port} of sandbox {sandbox_id} does not answer: {exc}") from exc

    # ---- the end of a sandbox -------------------------------------------------------------------

    def _unexpose_all(self, sandbox_id: str) -> None:
        for e in self._exposed.pop(sandbox_id, {}).values():
            _close_exposure(e)

    def _stopped(self, sb: Sandbox) -> None:
        self.proxy.detach(sb.id)
        self._unexpose_all(sb.id)


def _listen_error(sandbox_id: str, port: int, exc: OSError) -> WrongStateError:
    if exc.errno == errno.EADDRINUSE:
        return WrongStateError(
            f"a process of sandbox {sandbox_id} listens on 127.0.0.1:{port}, where the egress proxy must: "
            "stop it, or run the node with another [network] proxy_port"
        )
    return WrongStateError(f"sandbox {sandbox_id} is no longer running ({exc.strerror})")


def _close_exposure(e: _Exposure) -> None:
    e.accepting.cancel()
    for task in list(e.conns):
        task.cancel()
    with contextlib.suppress(OSError):
        e.socket_path.unlink()
