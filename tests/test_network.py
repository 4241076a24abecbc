"""Network by policy, against a real upstream (an HTTP/HTTPS server in a network namespace of its own,
tests/upstream.py) and, for one test, the real Python package index."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from sandfleet import Client
from sandfleet.daemon.node.process import DaemonStartError
from sandfleet.errors import InvalidArgumentError, NotFoundError, SandboxError, UnsupportedError, WrongStateError
from upstream import Upstream, free_subnet

from conftest import EXPECT, Daemon, agent_pid, destroy_daemon, make_daemon, wait_until

TOKEN = "net-test-token"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
FETCH = (
    "import sys, urllib.request, urllib.error\n"
    "try:\n"
    "    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(), end='')\n"
    "except urllib.error.HTTPError as e:\n"
    "    print(e.code, e.read().decode(), end='', file=sys.stderr); sys.exit(3)\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    up = Upstream(free_subnet(40))
    yield up
    up.close()


def net_config(upstream: Upstream) -> str:
    return (
        "[network]\n"
        f'hosts = {{ "upstream.test" = "{upstream.ip}", "rebind.test" = "127.0.0.1", '
        f'"private.test" = "{upstream.ip}", "node.test" = "{upstream.host_ip}" }}\n'
        "[network.services.upstream]\n"
        f'hosts = ["upstream.test", "{upstream.ip}", "node.test"]\nports = [80, 443, 7]\ncidrs = ["{upstream.cidr}"]\n'
        "[network.services.tricks]\n"
        'hosts = ["rebind.test", "private.test", "169.254.169.254"]\nports = [80]\n'
    )


@pytest.fixture(scope="module")
def netd(upstream: Upstream) -> Iterator[Daemon]:
    port = _free_port()
    d = make_daemon("net", f'tcp = "127.0.0.1:{port}"\ntoken = "{TOKEN}"\n' + net_config(upstream))
    d.tcp_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    d.start()
    yield d
    destroy_daemon(d)


@pytest.fixture()
def fleet(netd: Daemon) -> Iterator[Client]:
    with netd.client(timeout=120) as c:
        yield c


def fetch(sb: object, url: str, timeout: float = 30) -> tuple[int, str, str, float]:
    t0 = time.perf_counter()
    r = sb.exec(["python3", "-c", FETCH, url], timeout=timeout)  # type: ignore[attr-defined]
    return r.exit_code, r.stdout, r.stderr, time.perf_counter() - t0


def connections(fleet: Client, sandbox_id: str) -> list[dict[str, object]]:
    return [dict(r.data) for r in fleet.audit(kinds=["connection"], sandbox_id=sandbox_id).records]


def test_allowed_service_answers_through_the_policy(fleet: Client, upstream: Upstream) -> None:
    with fleet.create(image="python", network=["upstream"]) as sb:
        assert fetch(sb, "http://upstream.test/hello")[:2] == (0, "hello from upstream\n")
        # TLS end to end (the proxy tunnels it): the sandbox checks the upstream's own certificate.
        assert upstream.cert is not None
        sb.files.write("/tmp/ca.pem", upstream.cert.read_bytes())
        code = (
            "import ssl, urllib.request; c = ssl.create_default_context(cafile='/tmp/ca.pem'); "
            "u = urllib.request.urlopen('https://upstream.test/hello', context=c, timeout=10); "
            "print(u.read().decode(), end='')"
        )
        r = sb.exec(["python3", "-c", code], timeout=30)
        assert (r.exit_code, r.stdout) == (0, "hello from upstream\n"), r.stderr
        # A large body streams through whole.
        r = sb.exec(["python3", "-c", FETCH + "", "http://upstream.test/bytes/5000000"], timeout=60)
        assert r.exit_code == 0
        seen = connections(fleet, sb.id)
        tls = [c for c in seen if c["port"] == 443]
        assert tls and tls[0]["allowed"] is True and tls[0]["method"] == "CONNECT" and int(tls[0]["bytes_down"]) > 0
        assert any(int(c.get("bytes_down", 0)) >= 5_000_000 for c in seen)


def test_denied_host_fails_fast_with_a_clear_error_inside_and_a_record_outside(fleet: Client) -> None:
    with fleet.create(image="python", network=["upstream"]) as sb:
        code, out, err, took = fetch(sb, "http://example.com/")
        assert code == 3 and err.startswith("403") and "not allowed by this sandbox's network policy" in err, err
        assert took < 5
        # HTTPS (CONNECT) is refused the same way: curl/pip/urllib see "Tunnel connection failed: 403".
        r = sb.exec(["python3", "-c", FETCH, "https://pypi.org/simple/"], timeout=30)
        assert r.exit_code != 0 and "403" in r.stderr
        # A tool ignoring the proxy variables finds no route, at once.
        t0 = time.perf_counter()
        r = sb.exec(["python3", "-c", "import socket; socket.create_connection(('93.184.216.34', 80), timeout=10)"])
        assert r.exit_code != 0 and "Network is unreachable" in r.stderr and time.perf_counter() - t0 < 5
        denied = [c for c in connections(fleet, sb.id) if c["allowed"] is False]
        hosts = {(c["host"], c["port"]) for c in denied}
        assert ("example.com", 80) in hosts and ("pypi.org", 443) in hosts
        assert all("not allowed" in str(c["reason"]) for c in denied)


def test_ip_literals_private_ranges_and_the_node_are_refused(fleet: Client, upstream: Upstream) -> None:
    allow = ["upstream", "tricks", "10.1.2.3:80", "127.0.0.1:80", "169.254.169.254:80"]
    with fleet.create(image="python", network=allow) as sb:
        for url, why in [
            ("http://10.1.2.3/", "private address no allowed service names"),  # an explicit private IP
            ("http://127.0.0.1:80/", None),  # NO_PROXY: the sandbox's own loopback (nothing there)
            ("http://169.254.169.254/latest/meta-data/", "link-local"),  # cloud metadata, even when named
            ("http://node.test/hello", "address of this node"),  # a name for the host's own address
            (f"http://{upstream.host_ip}/", "not allowed"),  # the host-side veth, as a literal
            ("http://[::1]/", None),
        ]:
            code, _out, err, took = fetch(sb, url)
            assert code != 0 and took < 5, (url, err)
            if why:
                assert why in err, (url, err)
        # Through the proxy on purpose (no NO_PROXY): loopback is never a destination.
        r = sb.exec(["python3", "-c", FETCH, "http://127.0.0.1:80/"], env={"NO_PROXY": "", "no_proxy": ""}, timeout=30)
        assert r.exit_code == 3 and "loopback" in r.stderr


def test_dns_answers_are_checked_after_resolution(fleet: Client) -> None:
    """A name the policy allows that resolves to loopback or to a private address no service names
    (DNS rebinding) is refused; the proxy connects only to an address it checked."""
    with fleet.create(image="python", network=["tricks"]) as sb:
        code, _, err, _ = fetch(sb, "http://rebind.test/")
        assert code == 3 and "resolves only to addresses no sandbox may reach" in err and "loopback" in err
        code, _, err, _ = fetch(sb, "http://private.test/hello")
        assert code == 3 and "private address" in err


def test_policy_changes_take_effect_at_once(fleet: Client, upstream: Upstream) -> None:
    with fleet.create(image="python") as sb:
        code, _, err, took = fetch(sb, "http://upstream.test/hello")
        assert code != 0 and took < 5  # none: no proxy, no route, no DNS
        info = sb.set_network(["upstream"])
        assert info.spec.network.allow == ["upstream"]
        assert fetch(sb, "http://upstream.test/hello")[:2] == (0, "hello from upstream\n")
        # A transfer under way is cut when the policy no longer allows it.
        slow = sb.start(
            "python3 -c \"import urllib.request as u; r = u.urlopen('http://upstream.test/bytes/400000000000'); "
            'n = 0\nwhile (b := r.read(65536)): n += len(b)\nprint(n)"',
        )
        time.sleep(1.5)  # the transfer is under way
        t0 = time.perf_counter()
        sb.set_network("none")
        done = slow.wait(timeout=30)
        # Cut short (urllib sees the end of the stream; the upstream would have sent 400 GB: a fast
        # host moves 4 GB over the veth in under the second and a half waited above).
        assert done.result is not None and time.perf_counter() - t0 < 10
        assert done.result.exit_code != 0 or int(done.result.stdout) < 400_000_000_000
        code, _, _, took = fetch(sb, "http://upstream.test/hello")
        assert code != 0 and took < 5
        events = [e.kind for e in sb.events()]
        assert events.count("network_policy") == 2
    assert [r.data["allow"] for r in fleet.audit(kinds=["network_policy"], sandbox_id=sb.id).records] == [
        ["upstream"],
        [],
    ]


def test_policy_by_labels_and_bad_policies(fleet: Client) -> None:
    job = {"job": f"net-{os.getpid()}-{time.time_ns()}"}
    a = fleet.create(image="python", labels=job)
    b = fleet.create(image="python", labels=job)
    try:
        assert sorted(fleet.set_network(job, {"upstream": True})) == sorted([a.id, b.id])
        assert fetch(b, "http://upstream.test/hello")[0] == 0
        with pytest.raises(InvalidArgumentError, match="unknown network service 'nope'"):
            a.set_network(["nope"])
        with pytest.raises(InvalidArgumentError):
            fleet.create(image="python", network=["bad host!"])
        with pytest.raises(InvalidArgumentError, match="unknown network service"):
            fleet.create(image="python", network=["nope"])
    finally:
        a.stop()
        b.stop()


def test_two_sandboxes_cannot_reach_each_other(fleet: Client) -> None:
    with (
        fleet.create(image="python", network=["upstream"]) as a,
        fleet.create(image="python", network=["upstream"]) as b,
    ):
        a.start("python3 -m http.server 8000 --bind 127.0.0.1")
        assert wait_until(lambda: fetch(a, "http://127.0.0.1:8000/")[0] == 0, 15)
        # b's loopback is its own; through the proxy, loopback is refused; a has no other address.
        assert fetch(b, "http://127.0.0.1:8000/")[0] != 0
        r = b.exec(["python3", "-c", FETCH, "http://127.0.0.1:8000/"], env={"NO_PROXY": "", "no_proxy": ""})
        assert r.exit_code == 3
        # Nor the daemon's API (on the host's loopback).
        r = b.exec(["python3", "-c", FETCH, "http://localhost.localdomain:1/"], env={"NO_PROXY": ""})
        assert r.exit_code != 0


def test_expose_a_port(fleet: Client, netd: Daemon) -> None:
    url_base: str = netd.tcp_url  # type: ignore[attr-defined]
    with fleet.create(image="python") as sb:
        sb.files.write("/srv/index.txt", b"served from inside\n")
        sb.start("cd /srv && python3 -m http.server 8000 --bind 127.0.0.1")
        auth = {"authorization": f"Bearer {TOKEN}"}
        early = httpx.get(f"{url_base}/v1/sandboxes/{sb.id}/ports/8000/index.txt", headers=auth)
        assert early.status_code == 404 and "expose it first" in early.json()["error"]["message"]
        port = sb.expose(8000)
        assert port.port == 8000 and port.path == f"/v1/sandboxes/{sb.id}/ports/8000/" and port.socket
        assert sb.ports() == [port]

        def get() -> httpx.Response:
            return httpx.get(f"{url_base}{port.path}index.txt", headers={"authorization": f"Bearer {TOKEN}"})

        assert wait_until(lambda: get().status_code == 200, 15)
        r = get()
        assert r.text == "served from inside\n" and r.headers["content-length"] == "19"
        # Nobody without the token; the token never reaches the sandbox's server.
        assert httpx.get(f"{url_base}{port.path}index.txt").status_code == 401
        assert httpx.get(f"{url_base}{port.path}index.txt", headers={"authorization": "Bearer nope"}).status_code == 401
        # The unix socket: a byte stream to the same server, root's only.
        st = os.stat(port.socket)
        assert st.st_mode & 0o777 == 0o600 and st.st_uid == 0
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(port.socket)
            s.sendall(b"GET /index.txt HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200") and data.endswith(b"served from inside\n")
        # A port nothing listens on answers a typed error, not a hang.
        sb.expose(8001)
        bad = httpx.get(f"{url_base}/v1/sandboxes/{sb.id}/ports/8001/", headers={"authorization": f"Bearer {TOKEN}"})
        assert bad.status_code == 409 and bad.json()["error"]["code"] == "wrong_state"
        sb.unexpose(8001)
        with pytest.raises(NotFoundError):
            sb.unexpose(8001)
        sock_path = port.socket
    # Gone with the sandbox.
    assert not os.path.exists(sock_path)
    r = httpx.get(f"{url_base}{port.path}index.txt", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code in (400, 404, 409)


def test_vm_and_fncall_tiers_refuse_a_policy(fleet: Client) -> None:
    with pytest.raises((UnsupportedError, InvalidArgumentError)):
        fleet.create(image="python", backend="fncall", network=["upstream"])


def test_audit_stream_records_api_calls_and_follows(fleet: Client, netd: Daemon) -> None:
    start = fleet.audit(kinds=["api"], limit=1).last_seq
    with fleet.follow_audit(since=fleet.audit(limit=10000).last_seq, kinds=["api"]) as stream:
        sb = fleet.create(image="busybox", labels={"who": "audit-test"})
        sb.exec("true")
        sb.stop()
        got = []
        for rec in stream:
            if str(rec.data.get("path", "")).startswith("/v1/sandboxes"):
                got.append(rec)
            if rec.data.get("method") == "DELETE":
                break
    assert [r.data["method"] for r in got][:3] == ["POST", "POST", "DELETE"]
    assert got[1].sandbox_id == sb.id and got[1].labels == {"who": "audit-test"} and got[1].actor == "unix"
    assert all(r.seq > start for r in got)
    # Over TCP: the actor is the token holder's address; a refused token is recorded too.
    url_base: str = netd.tcp_url  # type: ignore[attr-defined]
    assert httpx.get(f"{url_base}/v1/health", headers={"authorization": "Bearer wrong"}).status_code == 401
    recs = fleet.audit(kinds=["api"], since=start).records
    refused = [r for r in recs if r.data["status"] == 401]
    assert refused and refused[-1].actor == "token@127.0.0.1"
    with pytest.raises(InvalidArgumentError):
        fleet.audit(limit=0)
    r = httpx.get(f"{url_base}/v1/audit?since=-1", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 400


def test_pip_install_through_the_policy(fleet: Client) -> None:
    """The real Python package index, allowed by name; the same command fails under `none`."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as exc:
        pytest.skip(f"this host cannot reach pypi.org ({exc})")
    cmd = "pip install --no-cache-dir --retries 0 --timeout 15 --disable-pip-version-check six==1.16.0"
    with fleet.create(image="python", network=["pypi"]) as sb:
        # The host's CA bundle: a site may reach the index through a TLS-inspecting gateway whose
        # CA only the host trusts (this one does). TLS is end to end through the proxy either way.
        sb.files.write("/tmp/host-ca.pem", HOST_CA.read_bytes())
        r = sb.exec(cmd, env={"PIP_CERT": "/tmp/host-ca.pem"}, timeout=180)
        assert r.exit_code == 0, r.stderr[-2000:]
        assert sb.exec("python3 -c 'import six; print(six.__version__)'").stdout.strip() == "1.16.0"
        hosts = {c["host"] for c in connections(fleet, sb.id) if c["allowed"]}
        assert "pypi.org" in hosts or "files.pythonhosted.org" in hosts
    with fleet.create(image="python") as sb:
        t0 = time.perf_counter()
        r = sb.exec(cmd, timeout=180)
        assert r.exit_code != 0 and time.perf_counter() - t0 < 60
        assert "six" not in sb.exec("pip list 2>/dev/null").stdout


def test_errors_leak_nothing(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        with pytest.raises(SandboxError):
            sb.expose(0)
        with pytest.raises(NotFoundError):
            fleet.get("sb-0000000000000000").set_network("none")


def socket_fds(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n


def test_nothing_left_behind_after_stop_failed_create_and_daemon_kill(upstream: Upstream) -> None:
    """No proxy listener, connection, exposure socket or namespace reference outlives a sandbox, a
    failed create, or a daemon SIGKILL (the restarted daemon enforces the adopted sandbox's policy
    again and removes the dead daemon's exposure sockets)."""
    d = make_daemon("netleak", net_config(upstream))
    d.start()
    try:
        with d.client(timeout=120) as fleet:
            with fleet.create(image="python") as warm:  # image built, connection pool warm
                fetch(warm, "http://upstream.test/hello")
            base = socket_fds(d.pid)
            for _ in range(5):
                with fleet.create(image="python", network=["upstream"]) as sb:
                    sb.start("python3 -m http.server 8000 --bind 127.0.0.1")
                    assert fetch(sb, "http://upstream.test/hello")[0] == 0
                    sb.expose(8000)
                    assert socket_fds(d.pid) > base
            with pytest.raises(SandboxError):
                fleet.create(image="no-such-image-here", network=["upstream"])
            assert wait_until(lambda: socket_fds(d.pid) <= base, 10), (socket_fds(d.pid), base)
            assert list((d.run_dir / "ports").iterdir()) == []

            sb = fleet.create(image="python", network=["upstream"])
            port = sb.expose(8000)
            assert port.socket is not None and os.path.exists(port.socket)
        d.kill()
        d.start()
        with d.client(timeout=120) as fleet:
            again = fleet.get(sb.id)
            assert again.info.state == "running"
            assert fetch(again, "http://upstream.test/hello")[:2] == (0, "hello from upstream\n")
            assert not os.path.exists(port.socket) and again.ports() == []  # exposures end with their daemon
            again.stop()
            assert wait_until(lambda: socket_fds(d.pid) <= base + 2, 10)
    finally:
        destroy_daemon(d)


def test_command_line(netd: Daemon) -> None:
    from test_cli import sf

    created = sf(netd, "create", "--image", "python", "--network", "upstream", "--label", "cli=net")
    assert created.returncode == 0, created.stderr
    sid = created.stdout.strip()
    with netd.client() as fleet:
        sb = fleet.get(sid)
        assert sb.info.spec.network.allow == ["upstream"]
        assert fetch(sb, "http://upstream.test/hello")[0] == 0
        r = sf(netd, "network", "--label", "cli=net")  # no --allow: none
        assert r.returncode == 0 and r.stdout.split() == [sid]
        assert fleet.get(sid).info.spec.network.none
        r = sf(netd, "audit", "--kind", "network_policy", "--sandbox", sid)
        lines = [json.loads(x) for x in r.stdout.splitlines()]
        assert r.returncode == 0 and [x["data"]["allow"] for x in lines] == [[]]
        r = sf(netd, "network", sid, "--allow", "nope")
        assert r.returncode != 0 and "unknown network service" in r.stderr + r.stdout
        sb.stop()


def test_a_sandbox_holding_the_proxy_port_gets_a_clear_error(fleet: Client) -> None:
    with fleet.create(image="python") as sb:
        sb.start("python3 -m http.server 3128 --bind 127.0.0.1")
        assert wait_until(
            lambda: (
                sb.exec("python3 -c \"import socket; socket.create_connection(('127.0.0.1', 3128))\"").exit_code == 0
            ),
            15,
        )
        with pytest.raises(WrongStateError, match="listens on 127.0.0.1:3128, where the egress proxy must"):
            sb.set_network(["upstream"])
        assert sb.info.spec.network.none and fleet.get(sb.id).info.spec.network.none


# -- what a sandbox can make the daemon hold ---------------------------------------------------------------

FLOOD = (
    "import resource, socket, sys, time\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)\n"
    "n, hold = int(sys.argv[1]), float(sys.argv[2])\n"
    "socks, errors, refused = [], 0, 0\n"
    "for _ in range(n):\n"
    "    s = socket.socket()\n"
    "    try:\n"
    "        s.connect(('127.0.0.1', 3128))\n"
    "        socks.append(s)\n"
    "    except OSError:\n"
    "        errors += 1\n"
    "        s.close()\n"
    "time.sleep(0.5)\n"
    "for s in socks:\n"
    "    s.setblocking(False)\n"
    "    try:\n"
    "        refused += s.recv(4096).startswith(b'HTTP/1.1 503')\n"
    "    except OSError:\n"
    "        pass\n"
    "print(len(socks), refused, errors, flush=True)\n"
    "time.sleep(hold)\n"
)
HANG = (
    "import socket\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 9000)); s.listen(1024); held = []\n"
    "while True: held.append(s.accept())\n"  # answers nothing, closes nothing
)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture(scope="module")
def floodd(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A node with [network] settings of its own: small limits, so that a flood reaches them in
    seconds, and a CA bundle: the host's trust store plus the upstream's own certificate."""
    assert upstream.cert is not None
    bundle = tmp_path_factory.mktemp("ca") / "bundle.pem"
    bundle.write_bytes(HOST_CA.read_bytes() + upstream.cert.read_bytes())
    limits = "max_connections = 64\nmax_node_connections = 100\nhead_timeout = 2\nidle_timeout = 3\n"
    limits += f'ca_bundle = "{bundle}"\n'
    cfg = net_config(upstream).replace("[network]\n", "[network]\n" + limits)
    d = make_daemon("netflood", "monitor_interval = 0.5\n" + cfg)
    d.start()
    yield d
    destroy_daemon(d)


@pytest.mark.slow
def test_silent_connections_to_the_proxy_are_bounded_audited_and_detected(floodd: Daemon) -> None:
    """2,000 connections that send nothing: the sandbox holds at most `max_connections` of them (the
    rest are answered 503 at accept), the daemon's open files stay bounded, every one is accounted for
    in the audit stream at a bounded rate, `connection_flood` fires, and another sandbox's egress
    works throughout. Several flooding sandboxes together stay within the node's cap."""
    with floodd.client(timeout=120) as fleet:
        with fleet.create(image="python", network=["upstream"]) as warm:
            assert fetch(warm, "http://upstream.test/hello")[0] == 0
        base = open_fds(floodd.pid)
        a = fleet.create(image="python", network=["upstream"], labels={EXPECT: "connection_flood"})
        b = fleet.create(image="python", network=["upstream"])
        try:
            t0 = time.monotonic()
            flood = a.start(["python3", "-c", FLOOD, "2000", "4"])
            peak = base
            while time.monotonic() - t0 < 2.5:
                peak = max(peak, open_fds(floodd.pid))
                time.sleep(0.05)
            assert fetch(b, "http://upstream.test/hello")[:2] == (0, "hello from upstream\n")
            done = flood.wait(timeout=60).result
            assert done is not None and done.exit_code == 0, done
            held, refused, errors = map(int, done.stdout.split())
            # (Silent ones free their place after head_timeout: a slow connect loop gets a few more in.)
            assert held + errors == 2000 and refused >= 1000, done.stdout
            assert peak <= base + 64 + 16, (base, peak)
            # Silent ones are closed after head_timeout; each connection is one record or in a count.
            assert wait_until(lambda: open_fds(floodd.pid) <= base + 16, 10)

            def accounted() -> int:  # a record is one connection, and carries a count of those not written
                return sum(int("allowed" in r) + int(r.get("suppressed", 0)) for r in connections(fleet, a.id))

            assert wait_until(lambda: accounted() == held, 10), (accounted(), held)
            recs = connections(fleet, a.id)
            assert len(recs) <= 200 + 20 * (time.monotonic() - t0) + 16  # the audit's burst and rate, then counts
            assert any("no request within 2 s" in str(r.get("reason")) for r in recs)
            assert any(str(r.get("reason", "")).startswith("refused at accept") for r in recs)
            assert any(int(r.get("suppressed", 0)) > 0 for r in recs)
            findings = [e for e in a.events() if e.kind == "finding" and e.data["detector"] == "connection_flood"]
            assert findings and findings[0].data["evidence"]["refused"] > 0

            # Three sandboxes flooding at once hold at most the node's 100 connections.
            c = fleet.create(image="python", network=["upstream"], labels={EXPECT: "connection_flood"})
            try:
                procs = [x.start(["python3", "-c", FLOOD, "300", "3"]) for x in (a, c, b)]
                t0 = time.monotonic()
                peak = base
                while time.monotonic() - t0 < 2:
                    peak = max(peak, open_fds(floodd.pid))
                    time.sleep(0.05)
                assert peak <= base + 100 + 16, (base, peak)
                for p in procs:
                    assert p.wait(timeout=60).result.exit_code == 0  # type: ignore[union-attr]
            finally:
                c.stop()
            assert wait_until(lambda: open_fds(floodd.pid) <= base + 16, 10)
            assert fetch(b, "http://upstream.test/hello")[0] == 0
        finally:
            a.stop()
            b.stop()


def test_connections_to_an_exposed_port_are_bounded_and_end_when_idle(floodd: Daemon) -> None:
    """A sandbox server that accepts and then neither answers nor closes: connections to its exposed
    port hold at most `max_connections` relays, and each ends after `idle_timeout`."""
    with floodd.client(timeout=120) as fleet, fleet.create(image="python") as sb:
        sb.start(["python3", "-c", HANG])
        port = sb.expose(9000)
        assert port.socket is not None
        base = open_fds(floodd.pid)
        clients = []
        try:
            for _ in range(150):
                s = socket.socket(socket.AF_UNIX)
                s.connect(port.socket)
                clients.append(s)
            time.sleep(1)
            assert open_fds(floodd.pid) <= base + 64 * 6 + 16, (base, open_fds(floodd.pid))
            ended = 0
            for s in clients:  # the ones over the limit were closed at once
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    ended += s.recv(1) == b""
            assert ended >= 150 - 64
            assert wait_until(lambda: open_fds(floodd.pid) <= base + 16, 10)  # idle_timeout: 3 s
        finally:
            for s in clients:
                s.close()


# -- the node's CA bundle ----------------------------------------------------------------------------------

HTTPS = (
    "import sys, urllib.request\n"
    "try:\n"
    "    print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode(), end='')\n"
    "except Exception as e:\n"
    "    print(e, file=sys.stderr); sys.exit(3)\n"
)
PIP_UPSTREAM = (
    "pip download --no-deps --retries 0 --timeout 10 --disable-pip-version-check -d /tmp/dl "
    "--index-url https://upstream.test/simple/ nothing-here"
)


def test_the_node_ca_bundle_is_what_networked_sandboxes_trust(fleet: Client, floodd: Daemon) -> None:
    """A TLS-inspecting egress's CA (here: the stand-in upstream's own certificate) is trusted by
    Python, pip (and curl, git, npm through their variables) in a sandbox only on a node whose
    `[network] ca_bundle` holds it; the bundle is in no layer, not even the sandbox's writable one."""
    url = "https://upstream.test/hello"
    with fleet.create(image="python", network=["upstream"]) as sb:  # a node without a bundle
        r = sb.exec(["python3", "-c", HTTPS, url], timeout=30)
        assert r.exit_code == 3 and "CERTIFICATE_VERIFY_FAILED" in r.stderr, r.stderr
        r = sb.exec(PIP_UPSTREAM, timeout=60)
        assert r.exit_code != 0 and "CERTIFICATE_VERIFY_FAILED" in r.stdout + r.stderr
        assert sb.exec("echo ${SSL_CERT_FILE:-unset}").stdout == "unset\n"
    with floodd.client(timeout=120) as tuned:
        with tuned.create(image="python", network=["upstream"]) as sb:
            r = sb.exec(["python3", "-c", HTTPS, url], timeout=30)
            assert (r.exit_code, r.stdout) == (0, "hello from upstream\n"), r.stderr
            r = sb.exec(PIP_UPSTREAM, timeout=60)  # past TLS: the stand-in is no package index
            assert r.exit_code != 0 and "CERTIFICATE_VERIFY_FAILED" not in r.stdout + r.stderr
            assert "404" in r.stdout + r.stderr or "No matching distribution" in r.stdout + r.stderr, r.stderr
            env = sb.exec("env").stdout
            for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "NODE_EXTRA_CA_CERTS", "CURL_CA_BUNDLE"):
                assert f"{var}=/dev/sandfleet-ca.pem" in env, var
            # Outside the writable layer: never packed, never one of the agent's changes.
            upper = Path(f"/proc/{agent_pid(floodd, sb.id)}/root/dev/.sandfleet/upper")
            assert not [f for _, _, files in os.walk(upper) for f in files if f.endswith(".pem")]
            assert sb.exec("test -f /dev/sandfleet-ca.pem").exit_code == 0
        # No policy, no bundle; a policy set later brings it.
        with tuned.create(image="python") as sb:
            assert sb.exec("test -e /dev/sandfleet-ca.pem").exit_code == 1
            assert sb.exec("echo ${SSL_CERT_FILE:-unset}").stdout == "unset\n"
            sb.set_network(["upstream"])
            r = sb.exec(["python3", "-c", HTTPS, url], timeout=30)
            assert (r.exit_code, r.stdout) == (0, "hello from upstream\n"), r.stderr


def test_pip_install_from_pypi_behind_this_hosts_tls_inspection(floodd: Daemon) -> None:
    """This host's egress inspects TLS with a CA only its trust store has: with that store as the
    node's bundle, a plain `pip install` under ["pypi"] works (no PIP_CERT of the user's)."""
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
    except OSError as exc:
        pytest.skip(f"this host cannot reach pypi.org ({exc})")
    cmd = "pip install --no-cache-dir --retries 0 --timeout 15 --disable-pip-version-check six==1.16.0"
    with floodd.client(timeout=120) as fleet, fleet.create(image="python", network=["pypi"]) as sb:
        r = sb.exec(cmd, timeout=180)
        assert r.exit_code == 0, r.stderr[-2000:]
        assert sb.exec("python3 -c 'import six; print(six.__version__)'").stdout.strip() == "1.16.0"


def test_a_ca_bundle_that_is_not_one_stops_the_daemon_at_start(tmp_path: Path) -> None:
    bad = tmp_path / "not-a-bundle.pem"
    bad.write_text("hello\n")
    for path, why in ((tmp_path / "missing.pem", "No such file"), (bad, "no PEM certificate")):
        d = make_daemon("badca", f'[network]\nca_bundle = "{path}"\n')
        try:
            with pytest.raises(DaemonStartError):
                d.start(timeout=30)
            assert why in d.log(), d.log()[-2000:]
        finally:
            destroy_daemon(d)


def test_a_full_file_table_does_not_end_a_sandboxs_proxy() -> None:
    """accept(2) failing with EMFILE (the daemon's file table full for a moment) used to end the
    sandbox's accept loop and close its listener for good: its egress was gone until a restart."""
    from sandfleet.daemon.net.egress import ConnectionSlots, EgressProxy
    from sandfleet.daemon.net.policy import NetworkConfig, compile_policy
    from sandfleet.models import NetworkPolicy

    class Heard:
        def __init__(self) -> None:
            self.records: list[dict[str, object]] = []

        def accepted(self, sandbox_id: str, refused: bool) -> None:
            pass

        def connection(self, sandbox_id: str, rec: dict[str, object]) -> None:
            self.records.append(rec)

    async def go() -> bytes:
        loop = asyncio.get_running_loop()
        config = NetworkConfig(proxy_port=_free_port())
        heard = Heard()
        proxy = EgressProxy(config, heard, ConnectionSlots(100))
        real, failures = loop.sock_accept, [OSError(errno.EMFILE, "Too many open files")]

        async def flaky(sock: socket.socket) -> tuple[socket.socket, object]:
            if failures:
                raise failures.pop()
            return await real(sock)

        loop.sock_accept = flaky  # type: ignore[method-assign]
        await proxy.apply("sb-test", "/proc/self/ns/net", compile_policy(NetworkPolicy(allow=["example.com"]), config))
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", config.proxy_port)
            writer.write(b"CONNECT denied.test:443 HTTP/1.1\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return answer
        finally:
            await proxy.close()

    answer = asyncio.run(go())
    assert answer.startswith(b"HTTP/1.1 403") and b"not allowed" in answer, answer


SLOW_LOOKUPS = (
    "import threading, urllib.request as u\n"
    "def one(i):\n"
    "    try: u.urlopen(f'https://n{i}.slow.test/', timeout=60)\n"
    "    except Exception: pass\n"
    "ts = [threading.Thread(target=one, args=(i,)) for i in range(50)]\n"
    "[t.start() for t in ts]; [t.join() for t in ts]\n"
)


@pytest.mark.slow
def test_names_that_resolve_slowly_stall_nothing_but_their_own_requests(floodd: Daemon) -> None:
    """A resolver that does not answer (here: the daemon's /etc/resolv.conf names a server that keeps
    silent, bound over in the daemon's own mount namespace only) and a sandbox asking the proxy for
    50 such names at once: the lookups used to fill the daemon's shared worker threads, stalling
    every other sandbox's file operations and creates for many seconds. They wait among themselves."""
    quiet = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    quiet.bind(("127.0.0.77", 53))  # receives queries, answers none
    conf = Path(tempfile.mkdtemp()) / "resolv.conf"
    conf.write_text("nameserver 127.0.0.77\noptions timeout:3 attempts:1\n")
    mount = ["nsenter", "-t", str(floodd.pid), "-m", "mount", "--bind", str(conf), "/etc/resolv.conf"]
    subprocess.run(mount, check=True)
    try:
        with (
            floodd.client(timeout=120) as fleet,
            fleet.create(image="python", network=["*.slow.test:443"], labels={EXPECT: "connection_flood"}) as a,
            fleet.create(image="busybox") as b,
        ):
            lookups = a.start(["python3", "-c", SLOW_LOOKUPS])
            worst, t_end = 0.0, time.monotonic() + 8  # while its 50 requests wait for their names
            while time.monotonic() < t_end:
                t0 = time.perf_counter()
                b.files.write("/tmp/f", b"x" * 1000)  # a worker-thread operation of the daemon
                worst = max(worst, time.perf_counter() - t0)
                time.sleep(0.2)
            assert worst < 2, worst
            lookups.kill()
    finally:
        subprocess.run(["nsenter", "-t", str(floodd.pid), "-m", "umount", "/etc/resolv.conf"], check=False)
        quiet.close()
        shutil.rmtree(conf.parent, ignore_errors=True)
