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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sandfleet.daemon.network import IPAddress, NetworkConfig, Policy, Rule, ip_literal, normalize_host
from sandfleet.runtime import netns

log = logging.getLogger(__name__)

MAX_HEAD = 16 * 1024
HEAD_TIMEOUT = 30.0
CHUNK = 256 * 1024
_HOP_BY_HOP = (b"proxy-connection:", b"proxy-authorization:", b"connection:", b"keep-alive:")

# (sandbox_id, record): one per connection attempt, refused at once or allowed when it ends.
Reporter = Callable[[str, dict[str, Any]], None]


class Refused(Exception):
    """A request the proxy answers itself (status, reason)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(eq=False)  # kept in a set, by identity
class _Conn:
    host: str
    port: int
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    def close(self) -> None:
        for w in self.writers:
            with contextlib.suppress(Exception):
                w.transport.abort()


@dataclass
class _Attachment:
    sandbox_id: str
    policy: Policy
    server: asyncio.Server
    conns: set[_Conn] = field(default_factory=set)


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
    def __init__(self, config: NetworkConfig, report: Reporter) -> None:
        self.config = config
        self._report = report
        self._by_id: dict[str, _Attachment] = {}

    def attached(self, sandbox_id: str) -> bool:
        return sandbox_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    async def apply(self, sandbox_id: str, ns_path: str, policy: Policy) -> None:
        """Make `policy` the sandbox's, now: listen in its namespace if it allows anything (and did
        not), stop listening if it allows nothing, and close connections it no longer allows."""
        att = self._by_id.get(sandbox_id)
        if policy.none:
            self.detach(sandbox_id)
            return
        if att is None:
            sock = await asyncio.to_thread(netns.listen_loopback, ns_path, self.config.proxy_port)
            try:
                server = await asyncio.start_server(
                    lambda r, w: self._serve(sandbox_id, r, w), sock=sock, limit=MAX_HEAD
                )
            except BaseException:
                sock.close()
                raise
            self._by_id[sandbox_id] = _Attachment(sandbox_id, policy, server)
            return
        att.policy = policy
        for conn in list(att.conns):
            if policy.rule_for(conn.host, conn.port) is None:
                conn.close()

    def detach(self, sandbox_id: str) -> None:
        """Stop listening for the sandbox and cut its connections (it stopped, or allows nothing)."""
        att = self._by_id.pop(sandbox_id, None)
        if att is None:
            return
        att.server.close()
        for conn in list(att.conns):
            conn.close()

    async def close(self) -> None:
        for sid in list(self._by_id):
            self.detach(sid)

    # ---- one connection --------------------------------------------------------------------

    async def _serve(self, sandbox_id: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        att = self._by_id.get(sandbox_id)
        if att is None:
            writer.transport.abort()
            return
        started = time.monotonic()
        rec: dict[str, Any] = {}
        conn: _Conn | None = None
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
            method, host, port, head = _parse_head(head)
            rec.update(host=host, port=port, method=method)
            if len(att.conns) >= self.config.max_connections:
                raise Refused(503, f"this sandbox has {len(att.conns)} connections open (the node allows that many)")
            rule = att.policy.rule_for(host, port)
            if rule is None:
                raise Refused(
                    403, f"{host}:{port} is not allowed by this sandbox's network policy (allow: {att.policy.spec})"
                )
            rec["rule"] = rule.source
            up_reader, up_writer, ip = await self._connect(att.policy, rule, host, port)
            rec["ip"] = str(ip)
            conn = _Conn(host, port, [writer, up_writer])
            att.conns.add(conn)
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up_writer.write(head)
            rec["allowed"] = True
            up, down = await asyncio.gather(
                self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
            )
            rec["bytes_up"] = (up if isinstance(up, int) else 0) + len(head)
            rec["bytes_down"] = down if isinstance(down, int) else 0
        except Refused as exc:
            rec.update(allowed=False, status=exc.status, reason=exc.reason)
            with contextlib.suppress(Exception):
                body = f"sandfleet: {exc.reason}\n".encode()
                writer.write(
                    b"HTTP/1.1 %d %s\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                    b"X-Sandfleet-Egress: refused\r\nConnection: close\r\n\r\n%s"
                    % (exc.status, _REASONS.get(exc.status, b"Refused"), len(body), body)
                )
                await asyncio.wait_for(writer.drain(), 5)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, OSError):
            pass  # a client that went away or never sent a request: nothing to tell it
        finally:
            if conn is not None:
                att.conns.discard(conn)
                conn.close()
            writer.transport.abort()
            if rec.get("host") is not None:
                rec.setdefault("allowed", False)
                rec["duration"] = round(time.monotonic() - started, 3)
                try:
                    self._report(sandbox_id, rec)
                except Exception:
                    log.exception("reporting a connection of sandbox %s failed", sandbox_id)

    async def _connect(
        self, policy: Policy, rule: Rule, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, IPAddress]:
        addrs = await self._resolve(host, port)
        refusals = []
        allowed = []
        for ip in addrs:
            why = policy.address_refusal(ip, rule)
            if why is None and await asyncio.to_thread(netns.is_local_address, str(ip)):
                why = f"{ip} is an address of this node"
            if why is None:
                allowed.append(ip)
            else:
                refusals.append(why)
        if not allowed:
            raise Refused(403, f"{host} resolves only to addresses no sandbox may reach ({'; '.join(refusals[:3])})")
        last: Exception | None = None
        for ip in allowed:
            try:
                r, w = await asyncio.wait_for(
                    asyncio.open_connection(str(ip), port, limit=CHUNK), self.config.connect_timeout
                )
                return r, w, ip
            except (OSError, TimeoutError) as exc:
                last = exc
        raise Refused(502, f"cannot connect to {host}:{port} ({type(last).__name__}: {last})")

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        lit = ip_literal(host)
        if lit is not None:
            return [lit]
        static = self.config.hosts.get(host)
        if static is not None:
            return [a for a in (ip_literal(s) for s in static) if a is not None]
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise Refused(502, f"cannot resolve {host}: {exc.strerror}") from None
        out: list[IPAddress] = []
        for info in infos:
            ip = ip_literal(str(info[4][0]))
            if ip is not None and ip not in out:
                out.append(ip)
        return out

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> int:
        n = 0
        idle = self.config.idle_timeout
        try:
            while True:
                data = await asyncio.wait_for(src.read(CHUNK), idle)
                if not data:
                    break
                n += len(data)
                dst.write(data)
                await dst.drain()
            if dst.can_write_eof():
                dst.write_eof()
        except (TimeoutError, ConnectionError, OSError):
            dst.transport.abort()
        return n


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
    if authority.startswith("["):
        host, _, rest = authority[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ""
    else:
        host, sep, port_s = authority.rpartition(":")
        if not sep:
            host, port_s = authority, ""
    if not port_s:
        if default is None:
            raise Refused(400, f"CONNECT needs host:port, got {authority[:80]!r}")
        port = default
    elif port_s.isdigit() and 0 < int(port_s) < 65536:
        port = int(port_s)
    else:
        raise Refused(400, f"bad port in {authority[:80]!r}")
    host = normalize_host(host)
    if not host:
        raise Refused(400, "no host")
    return host, port
