"""The egress proxy: the only way out of a sandbox, and only where its policy allows.

A sandbox's network namespace has a loopback device and nothing else, whatever its policy: no veth,
no route, no address outside. For a sandbox whose policy allows something, the daemon listens on
127.0.0.1:<proxy_port> *inside that namespace* (a socket made there by runtime/netns.py, served by
this event loop: no process and no network object per sandbox), and every command gets
HTTP_PROXY/HTTPS_PROXY pointing at it (pip, npm, apt, git, curl, urllib honour them). Each request
(`CONNECT host:port` for TLS, an absolute-URI request for plain HTTP) is checked against the policy,
the name is resolved here, each address is checked (never this host's own, loopback, link-local,
metadata or reserved; private ranges only when a service names them), and the connection is made to
a checked address, so no DNS answer is trusted twice. A refusal is an immediate `403` whose body says
why; a tool that ignores the proxy variables finds no route at all (ENETUNREACH at once). Changing a
policy takes effect at once: connections it no longer allows are closed.

What a sandbox can make the daemon hold here is bounded where it starts, at accept: its connections
(`max_connections`, those that never send a request included, closed after `head_timeout`), the
node's (`ConnectionSlots`, shared with exposed ports), and its name lookups (threads of the proxy's
own). Every connection is reported, refused ones too: to the flood detector at accept, to the audit
stream when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandfleet.daemon.net.policy import IPAddress, NetworkConfig, Policy, Rule, ip_literal, normalize_host
from sandfleet.models import split_host_port
from sandfleet.runtime import netns, splice

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
_HOP_BY_HOP = (b"proxy-connection:", b"proxy-authorization:", b"connection:", b"keep-alive:")
# A relayed connection holds two sockets and a pipe (two fds) each way.
FDS_PER_CONNECTION = 6
# Name lookups run on threads of the proxy's own, at most this many of a sandbox's at once: a resolver
# that does not answer holds a thread for seconds, and must not hold the daemon's shared ones (every
# file operation and create needs those) nor every lookup of the other sandboxes.
RESOLVER_THREADS = 4
LOOKUPS_PER_SANDBOX = 2
# Errors of accept(2) that say nothing about the listener: wait a moment and go on accepting.
_ACCEPT_RETRY = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.ECONNABORTED})


class Observer(Protocol):
    """Who hears of a sandbox's connections (the monitor: metrics, audit, detectors)."""

    def accepted(self, sandbox_id: str, refused: bool) -> None:
        """A connection was accepted, before anything was read from it (`refused` at once: over a limit)."""

    def connection(self, sandbox_id: str, rec: dict[str, Any]) -> None:
        """A connection ended: refused (at accept, for its request, or when it sent none) or relayed."""


class ConnectionSlots:
    """The node's connections held open for sandboxes (egress and exposed ports) against one cap, so
    that no sandbox, nor all of them, can run the daemon out of file descriptors. The cap is also held
    to a twelfth of the daemon's open-file limit: at most half its descriptors go to connections."""

    def __init__(self, cap: int) -> None:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.cap = max(1, min(cap, nofile // (2 * FDS_PER_CONNECTION)))
        self.used = 0

    def take(self) -> bool:
        if self.used >= self.cap:
            return False
        self.used += 1
        return True

    def give(self) -> None:
        self.used = max(0, self.used - 1)


async def accept_loop(sock: socket.socket, what: str) -> socket.socket:
    """The next connection to `sock` (non-blocking): a full file table or an aborted handshake is
    waited out, not taken as the end of the listener."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            client, _ = await loop.sock_accept(sock)
        except OSError as exc:
            if exc.errno not in _ACCEPT_RETRY:
                raise
            log.warning("%s: accept failed (%s): retrying", what, exc.strerror)
            await asyncio.sleep(0.1)
            continue
        client.setblocking(False)
        return client


def refuse_now(client: socket.socket, status: int, reason: str) -> None:
    """Answer `status` with `reason` in what the socket buffer takes at once, and close: a refusal
    that never waits on the client, so it holds nothing."""
    body = f"sandfleet: {reason}\n".encode()
    with contextlib.suppress(OSError):
        client.send(_answer(status, body))
    client.close()


def _answer(status: int, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
        b"X-Sandfleet-Egress: refused\r\nConnection: close\r\n\r\n%s"
        % (status, _REASONS.get(status, b"Refused"), len(body), body)
    )


class Refused(Exception):
    """A request the proxy answers itself (status, reason)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(eq=False)  # kept in a set, by identity
class _Conn:
    host: str
    port: int
    task: asyncio.Task[None]


@dataclass
class _Attachment:
    sandbox_id: str
    policy: Policy
    listener: socket.socket
    accepting: asyncio.Task[None] | None = None
    conns: set[_Conn] = field(default_factory=set)  # relayed (their destination known)
    open: int = 0  # accepted and not closed yet: relayed, or still to send or be answered their request
    lookups: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(LOOKUPS_PER_SANDBOX))


def proxy_env(port: int) -> dict[str, str]:
    """What every command of a networked sandbox gets, so tools find the proxy."""
    url = f"http://127.0.0.1:{port}"
    no_proxy = "localhost,127.0.0.1,::1"
    return {
        "HTTP_PROXY": url,
        "HTTPS_PROXY": url,
        "http_proxy": url,
        "https_proxy": url,
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }


class EgressProxy:
    def __init__(self, config: NetworkConfig, observer: Observer, slots: ConnectionSlots) -> None:
        self.config = config
        self._observer = observer
        self.slots = slots
        self._by_id: dict[str, _Attachment] = {}
        self._resolver = ThreadPoolExecutor(max_workers=RESOLVER_THREADS, thread_name_prefix="sandfleet-resolve")

    async def apply(self, sandbox_id: str, ns_path: str, policy: Policy) -> None:
        """Make `policy` the sandbox's, now: listen in its namespace if it allows anything (and did
        not), stop listening if it allows nothing, and close connections it no longer allows."""
        att = self._by_id.get(sandbox_id)
        if policy.none:
            self.detach(sandbox_id)
            return
        if att is None:
            sock = await netns.listen_loopback(ns_path, self.config.proxy_port)
            att = _Attachment(sandbox_id, policy, sock)
            self._by_id[sandbox_id] = att
            att.accepting = asyncio.get_running_loop().create_task(self._accept(att), name=f"egress-{sandbox_id}")
            return
        att.policy = policy
        for conn in list(att.conns):
            if policy.rule_for(conn.host, conn.port) is None:
                conn.task.cancel()

    def detach(self, sandbox_id: str) -> None:
        """Stop listening for the sandbox and cut its connections (it stopped, or allows nothing)."""
        att = self._by_id.pop(sandbox_id, None)
        if att is None:
            return
        if att.accepting is not None:
            att.accepting.cancel()  # closes the listener, and with it the namespace's last reference
        else:
            att.listener.close()
        for conn in list(att.conns):
            conn.task.cancel()

    async def close(self) -> None:
        for sid in list(self._by_id):
            self.detach(sid)
        self._resolver.shutdown(wait=False, cancel_futures=True)

    # ---- one connection --------------------------------------------------------------------

    async def _accept(self, att: _Attachment) -> None:
        """Every connection is bounded here, before anything is read from it: past the sandbox's
        `max_connections` or the node's slots it is answered 503 and closed at once."""
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[None]] = set()  # each accepted connection's task, until it ends
        try:
            while True:
                client = await accept_loop(att.listener, f"the egress proxy of sandbox {att.sandbox_id}")
                why = None
                if att.open >= self.config.max_connections:
                    why = f"this sandbox has {att.open} connections open to the proxy (the node allows that many)"
                elif not self.slots.take():
                    why = f"the node holds {self.slots.used} proxied connections, its most: try again later"
                try:
                    self._observer.accepted(att.sandbox_id, why is not None)
                except Exception:
                    log.exception("reporting a connection of sandbox %s failed", att.sandbox_id)
                if why is not None:
                    refuse_now(client, 503, why)
                    self._tell(att, {"allowed": False, "status": 503, "reason": f"refused at accept: {why}"})
                    continue
                att.open += 1
                task = loop.create_task(self._serve(att, client))
                pending.add(task)
                task.add_done_callback(functools.partial(self._closed, att, pending, client))
        except (asyncio.CancelledError, OSError):
            for task in pending:
                task.cancel()
            raise
        finally:
            att.listener.close()

    def _closed(
        self, att: _Attachment, pending: set[asyncio.Task[None]], client: socket.socket, task: asyncio.Task[None]
    ) -> None:
        """A connection's task is done (even one cancelled before it ran): its slot is free again."""
        pending.discard(task)
        client.close()
        att.open -= 1
        self.slots.give()

    def _tell(self, att: _Attachment, rec: dict[str, Any]) -> None:
        try:
            self._observer.connection(att.sandbox_id, rec)
        except Exception:
            log.exception("reporting a connection of sandbox %s failed", att.sandbox_id)

    async def _serve(self, att: _Attachment, client: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        started = time.monotonic()
        rec: dict[str, Any] = {}
        upstream: socket.socket | None = None
        conn: _Conn | None = None
        try:
            try:
                head, rest = await asyncio.wait_for(_read_head(loop, client), self.config.head_timeout)
            except TimeoutError:
                rec["reason"] = f"closed: no request within {self.config.head_timeout:g} s"
                raise
            method, host, port, head = _parse_head(head)
            rec.update(host=host, port=port, method=method)
            rule = att.policy.rule_for(host, port)
            if rule is None:
                raise Refused(
                    403, f"{host}:{port} is not allowed by this sandbox's network policy (allow: {att.policy.spec})"
                )
            rec["rule"] = rule.source
            upstream, ip = await self._connect(att, rule, host, port)
            rec["ip"] = str(ip)
            if att.sandbox_id not in self._by_id or att.policy.rule_for(host, port) is None:
                raise Refused(403, "the sandbox's network policy changed")
            task = asyncio.current_task()
            assert task is not None
            conn = _Conn(host, port, task)
            att.conns.add(conn)
            if method == "CONNECT":
                await loop.sock_sendall(client, b"HTTP/1.1 200 Connection established\r\n\r\n")
            await loop.sock_sendall(upstream, head + rest)
            rec["allowed"] = True
            counts = [len(head) + len(rest), 0]
            if await splice.both_ways(loop, client, upstream, counts, idle=self.config.idle_timeout):
                rec["reason"] = f"closed: idle for {self.config.idle_timeout:g} s"
            rec["bytes_up"], rec["bytes_down"] = counts
        except Refused as exc:
            rec.update(allowed=False, status=exc.status, reason=exc.reason)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    loop.sock_sendall(client, _answer(exc.status, f"sandfleet: {exc.reason}\n".encode())), 5
                )
        except asyncio.CancelledError:
            if "host" in rec:
                rec.setdefault("reason", "closed: the policy no longer allows it, or the sandbox stopped")
        except (TimeoutError, ConnectionError, OSError, EOFError):
            pass  # a client that went away, or never sent a request (reported below): nothing to tell it
        finally:
            if conn is not None:
                att.conns.discard(conn)
                rec.setdefault("bytes_up", 0)
            client.close()
            if upstream is not None:
                upstream.close()
            # Every request is reported, and a connection that sent none within the time allowed.
            if rec.get("host") is not None or "reason" in rec:
                rec.setdefault("allowed", False)
                rec["duration"] = round(time.monotonic() - started, 3)
                self._tell(att, rec)

    async def _connect(self, att: _Attachment, rule: Rule, host: str, port: int) -> tuple[socket.socket, IPAddress]:
        addrs = await self._resolve(att, host, port)
        refusals = []
        allowed = []
        for ip in addrs:
            why = att.policy.address_refusal(ip, rule)
            if why is None and netns.is_local_address(str(ip)):  # one bind(2): does not block
                why = f"{ip} is an address of this node"
            if why is None:
                allowed.append(ip)
            else:
                refusals.append(why)
        if not allowed:
            raise Refused(403, f"{host} resolves only to addresses no sandbox may reach ({'; '.join(refusals[:3])})")
        last: Exception | None = None
        loop = asyncio.get_running_loop()
        for ip in allowed:
            sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(sock, (str(ip), port)), self.config.connect_timeout)
                return sock, ip
            except (OSError, TimeoutError) as exc:
                sock.close()
                last = exc
        raise Refused(502, f"cannot connect to {host}:{port} ({type(last).__name__}: {last})")

    async def _resolve(self, att: _Attachment, host: str, port: int) -> list[IPAddress]:
        lit = ip_literal(host)
        if lit is not None:
            return [lit]
        static = self.config.hosts.get(host)
        if static is not None:
            return [a for a in (ip_literal(s) for s in static) if a is not None]
        lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
        try:
            async with att.lookups:
                infos = await asyncio.get_running_loop().run_in_executor(self._resolver, lookup)
        except socket.gaierror as exc:
            raise Refused(502, f"cannot resolve {host}: {exc.strerror}") from None
        out: list[IPAddress] = []
        for info in infos:
            ip = ip_literal(str(info[4][0]))
            if ip is not None and ip not in out:
                out.append(ip)
        return out


async def _read_head(loop: asyncio.AbstractEventLoop, client: socket.socket) -> tuple[bytes, bytes]:
    """The request head (through its blank line) and whatever came after it."""
    buf = b""
    while True:
        data = await loop.sock_recv(client, MAX_HEAD)
        if not data:
            raise EOFError("the client closed before its request")
        buf += data
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            return buf[: end + 4], buf[end + 4 :]
        if len(buf) > MAX_HEAD:
            raise Refused(400, f"request head larger than {MAX_HEAD} bytes")


_REASONS = {403: b"Forbidden", 400: b"Bad Request", 502: b"Bad Gateway", 503: b"Service Unavailable"}


def _parse_head(head: bytes) -> tuple[str, str, int, bytes]:
    """(method, host, port, the head to send upstream) of a proxy request."""
    line, _, rest = head.partition(b"\r\n")
    parts = line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        raise Refused(400, "not an HTTP proxy request")
    method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
    if method == "CONNECT":
        host, port = _host_port(target, None)
        return method, host, port, b""
    if not target.lower().startswith("http://"):
        raise Refused(400, f"the proxy takes CONNECT host:port or an http:// URL, not {target[:80]!r}")
    authority, slash, path = target[7:].partition("/")
    host, port = _host_port(authority.rpartition("@")[2], 80)
    # Upstream gets origin-form, one request per connection, no proxy headers.
    lines = [ln for ln in rest.split(b"\r\n") if ln and not ln.lower().startswith(_HOP_BY_HOP)]
    out = b"%s /%s HTTP/1.1\r\n" % (parts[0], (path if slash else "").encode("latin-1"))
    out += b"".join(ln + b"\r\n" for ln in lines) + b"Connection: close\r\n\r\n"
    return method, host, port, out


def _host_port(authority: str, default: int | None) -> tuple[str, int]:
    try:
        host, port = split_host_port(authority)
    except ValueError as exc:
        raise Refused(400, str(exc)) from None
    if port is None:
        if default is None:
            raise Refused(400, f"CONNECT needs host:port, got {authority[:80]!r}")
        port = default
    host = normalize_host(host)
    if not host:
        raise Refused(400, "no host")
    return host, port
