# ruff: noqa: T201
"""A stand-in for an internet service, for network-policy tests and the network benchmark (needs root).

    with Upstream() as up:                # netns sfup<pid>x0, veth: host 10.213.0.1/24 <-> 10.213.0.2/24
        up.url("/hello")                  # "http://10.213.0.2/hello"
        up.cert                           # self-signed PEM (CN/SAN upstream.test, IP 10.213.0.2): CA file for clients

One network namespace per upstream, named `sfup<pid>x<subnet>` (the host-side veth has the same
name), with a veth pair (host side 10.213.<subnet>.1/24, namespace side 10.213.<subnet>.2/24, named
`up0` there) and lo up. In it, one threaded Python process serves HTTP on port 80 and HTTPS on 443
(and a TCP echo on port 7):

    GET  /hello      -> "hello from upstream\\n"
    GET  /bytes/<n>  -> n bytes (zeros), streamed in 1 MiB writes, with Content-Length
    GET  /echo-ip    -> the peer's address and a newline
    POST /echo       -> the request body

The server exits by itself when the process that started it is gone (it polls its parent), and an
Upstream made later removes what dead processes left (`sfup<pid>...` netns and links whose pid is
gone), so a test killed mid-way leaves nothing behind for long. `close()` kills the server, deletes
the link and the namespace and checks nothing of it is left.

Pick `subnet` with `free_subnet()` when another upstream may run at the same time (the default, 0, is
what the network benchmark's daemon config names). `python3 tests/upstream.py` is a self-check with
curl from the host (prints setup and teardown times).
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

PREFIX = "sfup"
HOSTNAME = "upstream.test"
HELLO = b"hello from upstream\n"
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)x(\d+)$")

# The server, run as `python3 -c SERVER <owner pid> <cert> <key>` inside the namespace. It prints
# "ready" once all three sockets listen.
SERVER = r"""
import os, socket, socketserver, ssl, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

owner, cert, key = int(sys.argv[1]), sys.argv[2], sys.argv[3]
CHUNK = bytes(1 << 20)

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "sfupstream/1"

    def log_message(self, *a):
        pass

    def _send(self, body, ctype="text/plain"):
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        p = self.path.split("?", 1)[0]
        if p == "/hello":
            return self._send(b"hello from upstream\n")
        if p == "/echo-ip":
            return self._send(self.client_address[0].encode() + b"\n")
        if p.startswith("/bytes/") and p[7:].isdigit():
            n = int(p[7:])
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(n))
            self.end_headers()
            view = memoryview(CHUNK)
            while n > 0:
                k = min(n, len(CHUNK))
                self.wfile.write(view[:k])
                n -= k
            return
        self.send_error(404)

    def do_POST(self):
        if self.path.split("?", 1)[0] != "/echo":
            return self.send_error(404)
        n = int(self.headers.get("Content-Length") or 0)
        self._send(self.rfile.read(n), "application/octet-stream")

class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

class Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while True:
            b = self.request.recv(65536)
            if not b:
                return
            self.request.sendall(b)

class EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

http = Server(("0.0.0.0", 80), H)
https = Server(("0.0.0.0", 443), H)
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
https.socket = ctx.wrap_socket(https.socket, server_side=True)
echo = EchoServer(("0.0.0.0", 7), Echo)
for s in (http, https, echo):
    threading.Thread(target=s.serve_forever, daemon=True).start()
print("ready", flush=True)
while os.getppid() == owner:   # the owner is gone: so are we
    time.sleep(0.5)
os._exit(0)
"""


class UpstreamError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise UpstreamError(f"ip {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()}")
    return r


def _netns_names() -> list[str]:
    # `ip netns list` prints "name" or "name (id: N)"
    return [ln.split()[0] for ln in _ip("netns", "list").stdout.splitlines() if ln.strip()]


def _link_names() -> list[str]:
    return [ln.split()[0].split("@")[0] for ln in _ip("-br", "link").stdout.splitlines() if ln.strip()]


def ours(names: list[str]) -> list[str]:
    return [n for n in names if n.startswith(PREFIX)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_netns_pids(name: str) -> None:
    r = _ip("netns", "pids", name, check=False)
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def cleanup_stale() -> list[str]:
    """Remove the netns and links of upstreams whose process is gone; return what was removed."""
    removed = []
    for name in ours(_netns_names()):
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_netns_pids(name)
            _ip("link", "del", name, check=False)
            _ip("netns", "del", name, check=False)
            removed.append(f"netns {name}")
    for name in ours(_link_names()):
        m = _NAME_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("link", "del", name, check=False)
            removed.append(f"link {name}")
    return removed


def _subnets_in_use() -> set[int]:
    used = set()
    for m in re.finditer(r"inet 10\.213\.(\d+)\.\d+/", _ip("-4", "addr").stdout):
        used.add(int(m.group(1)))
    for m in re.finditer(r"^10\.213\.(\d+)\.", _ip("-4", "route").stdout, re.M):
        used.add(int(m.group(1)))
    return used


def free_subnet(start: int = 0) -> int:
    """The first N >= start whose 10.213.N.0/24 no host address or route uses."""
    cleanup_stale()
    used = _subnets_in_use()
    for n in range(start, 256):
        if n not in used:
            return n
    raise UpstreamError("no free 10.213.N.0/24")


def make_cert(directory: Path, ip: str, hostname: str = HOSTNAME) -> tuple[Path, Path]:
    """A self-signed certificate (usable as its own CA file) for `hostname` and `ip`."""
    cert, key = directory / "upstream.pem", directory / "upstream.key"
    r = subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-keyout", str(key), "-out", str(cert), "-subj", f"/CN={hostname}",
            "-addext", f"subjectAltName=DNS:{hostname},IP:{ip}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,digitalSignature,keyCertSign",
            "-addext", "extendedKeyUsage=serverAuth",
        ],
        capture_output=True, text=True,
    )  # fmt: skip
    if r.returncode != 0:
        raise UpstreamError(f"openssl req: {r.stderr.strip()[-800:]}")
    return cert, key


class Upstream:
    """An HTTP/HTTPS service in its own network namespace, reachable from the host at `ip`."""

    def __init__(self, subnet: int = 0, *, start: bool = True, timeout: float = 10.0) -> None:
        if not 0 <= subnet <= 255:
            raise ValueError("subnet must be 0..255")
        self.subnet = subnet
        self.name = f"{PREFIX}{os.getpid()}x{subnet}"  # netns and host-side link (<= 15 chars)
        self.host_ip = f"10.213.{subnet}.1"
        self.ip = f"10.213.{subnet}.2"
        self.cidr = f"10.213.{subnet}.0/24"
        self.hostname = HOSTNAME
        self.dir: Path | None = None
        self.cert: Path | None = None
        self.key: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.setup_s: float | None = None
        self.teardown_s: float | None = None
        self.timeout = timeout
        if start:
            self.start()

    # -- addresses
    def url(self, path: str = "/", *, https: bool = False, host: str | None = None) -> str:
        return f"{'https' if https else 'http'}://{host or self.ip}{path}"

    def __repr__(self) -> str:
        return f"Upstream({self.name}, {self.ip})"

    # -- lifecycle
    def start(self) -> Upstream:
        t0 = time.perf_counter()
        cleanup_stale()
        if self.name in _netns_names() or self.name in _link_names():
            raise UpstreamError(f"{self.name} exists already (this process made it and did not close it)")
        if self.subnet in _subnets_in_use():
            raise UpstreamError(f"10.213.{self.subnet}.0/24 is in use on this host; pick free_subnet()")
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.name}-"))
            self.cert, self.key = make_cert(self.dir, self.ip)
            _ip("netns", "add", self.name)
            _ip("link", "add", self.name, "type", "veth", "peer", "name", "up0", "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.name)
            _ip("link", "set", self.name, "up")
            ns = ["-n", self.name]
            _ip(*ns, "addr", "add", f"{self.ip}/24", "dev", "up0")
            _ip(*ns, "link", "set", "up0", "up")
            _ip(*ns, "link", "set", "lo", "up")
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.name, sys.executable, "-c", SERVER,
                 str(os.getpid()), str(self.cert), str(self.key)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            self._wait_ready(time.monotonic() + self.timeout)
        except BaseException:
            self.close(check=False)
            raise
        self.setup_s = time.perf_counter() - t0
        return self

    def _wait_ready(self, deadline: float) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            line = self.proc.stdout.readline()
            if line.strip() == b"ready":
                break
            if not line:  # exited
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise UpstreamError(f"upstream server exited {self.proc.wait()}: {err[-1500:]}")
        else:
            raise UpstreamError("upstream server did not start in time")
        # and from the host, over the veth
        for port in (80, 443, 7):
            while True:
                try:
                    socket.create_connection((self.ip, port), timeout=1).close()
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise UpstreamError(f"{self.ip}:{port} does not answer from the host: {exc}") from exc
                    time.sleep(0.01)

    def close(self, check: bool = True) -> None:
        t0 = time.perf_counter()
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(10)
            for f in (self.proc.stdout, self.proc.stderr):
                if f is not None:
                    f.close()
            self.proc = None
        if self.name in _netns_names():
            _kill_netns_pids(self.name)
        # Deleting the link first is synchronous (both ends go); a deleted netns frees its devices later.
        _ip("link", "del", self.name, check=False)
        _ip("netns", "del", self.name, check=False)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.teardown_s = time.perf_counter() - t0
        if check:
            left = [f"netns {n}" for n in _netns_names() if n == self.name]
            left += [f"link {n}" for n in _link_names() if n == self.name]
            if left:
                raise UpstreamError(f"left behind: {left}")

    def __enter__(self) -> Upstream:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close(check=et is None)


def _self_check() -> int:
    if os.geteuid() != 0:
        print("needs root")
        return 2
    for tool in ("ip", "openssl", "curl"):
        if shutil.which(tool) is None:
            print(f"needs {tool}")
            return 2
    print("stale removed:", cleanup_stale() or "nothing")
    setups, teardowns = [], []

    def curl(*args: str) -> bytes:
        r = subprocess.run(["curl", "-sS", "--fail", "--max-time", "10", *args], capture_output=True)
        if r.returncode != 0:
            raise SystemExit(f"curl {args}: exit {r.returncode}: {r.stderr.decode(errors='replace')}")
        return r.stdout

    for round_ in range(5):
        with Upstream() as up:
            a = Upstream(free_subnet(1)) if round_ == 0 else None  # two at once
            try:
                assert curl(up.url("/hello")) == HELLO
                assert curl("--cacert", str(up.cert), up.url("/hello", https=True)) == HELLO
                res = f"{HOSTNAME}:443:{up.ip}"
                assert curl("--cacert", str(up.cert), "--resolve", res, f"https://{HOSTNAME}/hello") == HELLO
                assert curl(up.url("/echo-ip")).strip() == up.host_ip.encode()
                body = bytes(range(256)) * 1000
                (up.dir / "body").write_bytes(body)  # type: ignore[operator]
                assert curl("--data-binary", f"@{up.dir}/body", up.url("/echo")) == body
                assert len(curl(up.url("/bytes/3000000"))) == 3000000
                r = subprocess.run(
                    ["curl", "-sS", "--max-time", "5", up.url("/hello", https=True)], capture_output=True
                )
                assert r.returncode == 60, f"an unknown CA must fail verification: {r}"  # SSL certificate problem
                with socket.create_connection((up.ip, 7), timeout=5) as s:
                    s.sendall(b"ping")
                    assert s.recv(16) == b"ping"
                if a is not None:
                    assert curl(a.url("/hello")) == HELLO and a.ip != up.ip
                    assert curl("--cacert", str(a.cert), a.url("/hello", https=True)) == HELLO
                if round_ == 0:
                    t = time.perf_counter()
                    out = subprocess.run(
                        ["curl", "-sS", "-o", "/dev/null", "-w", "%{speed_download}", up.url(f"/bytes/{256 << 20}")],
                        capture_output=True, text=True, check=True,
                    ).stdout  # fmt: skip
                    print(f"256 MiB over http from the host with curl: {float(out) / 2**20:.0f} MiB/s "
                          f"({time.perf_counter() - t:.2f} s)")  # fmt: skip
            finally:
                if a is not None:
                    a.close()
            setups.append(up.setup_s)
        teardowns.append(up.teardown_s)
    left = ours(_netns_names()) + ours(_link_names())
    assert not left, f"left behind: {left}"

    # killed mid-way: a child process makes an upstream and is SIGKILLed; the next one cleans up
    child = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
         "import upstream, time; u = upstream.Upstream(7); print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == b"up"
    child.kill()
    child.wait()
    name = f"{PREFIX}{child.pid}x7"
    assert name in _netns_names(), "the killed child's netns should still be there"
    time.sleep(1.2)  # its server notices its owner is gone
    removed = cleanup_stale()
    assert f"netns {name}" in removed, removed
    left = ours(_netns_names()) + ours(_link_names())
    assert not left, f"left behind after cleanup_stale: {left}"
    print("killed-owner cleanup: removed", removed)

    ms = lambda xs: ", ".join(f"{x * 1000:.0f}" for x in xs)  # noqa: E731
    print(f"setup ms: {ms(setups)}")
    print(f"teardown ms: {ms(teardowns)}")
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(_self_check())
