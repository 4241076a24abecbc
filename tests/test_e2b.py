"""E2B's own SDK (`e2b` from PyPI, sync and async) against sandfleet's E2B layer (`sandfleet e2b`)
over a real node with two projects: every call the mapping serves, and one project's key against
the other's sandboxes through every E2B route."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

e2b = pytest.importorskip("e2b")

from e2b import AsyncSandbox, CommandExitException, Sandbox  # noqa: E402

from sandfleet.e2b import TEMPLATE_RECIPES  # noqa: E402

from conftest import Daemon, destroy_daemon, make_daemon, wait_until  # noqa: E402

KEYS = {"a": "e2b-tenant-a-secret-00001", "b": "e2b-tenant-b-secret-00002"}
IAM_TOML = f"""
[[iam.projects]]
path = "ea"

[[iam.projects]]
path = "eb"

[[iam.tokens]]
name = "a"
token = "{KEYS["a"]}"
project = "ea"

[[iam.tokens]]
name = "b"
token = "{KEYS["b"]}"
project = "eb"
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Node:
    daemon: Daemon
    url: str  # the E2B layer's address (API and envd alike)
    layer_log: Path  # the layer's own output (uvicorn's: a traceback is a request it failed)

    def opts(self, who: str = "a") -> dict[str, str]:
        return {"api_key": KEYS[who], "api_url": self.url, "sandbox_url": self.url}


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    port = _free_port()
    d = make_daemon("e2b", f'tcp = "127.0.0.1:{port}"\n' + IAM_TOML)
    d.start()
    with d.client(timeout=900) as root:
        for recipe in TEMPLATE_RECIPES:  # E2B's templates (its user; the data stack): cache hits after the first
            root.build_recipe(recipe)
    listen = f"127.0.0.1:{_free_port()}"
    layer_log = d.root / "e2b-layer.log"
    with layer_log.open("wb") as out:  # the child has its own copy of the descriptor
        server = subprocess.Popen(
            [sys.executable, "-m", "sandfleet", "e2b", "--upstream", f"http://127.0.0.1:{port}", "--listen", listen],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://{listen}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/templates", headers={"x-api-key": KEYS["a"]}).status_code == 200
            except httpx.HTTPError:
                return False

        assert wait_until(up, timeout=30), "the E2B layer did not come up"
        yield Node(d, url, layer_log)
        # Every request the tests made was answered (a 4xx for a bad one), never failed by the layer.
        log = layer_log.read_text(errors="replace")
        assert "Traceback" not in log, log[max(0, log.index("Traceback") - 300) :][:3000]
    finally:
        server.terminate()
        try:
            server.wait(15)  # it gives open streams 5 s
        except subprocess.TimeoutExpired:
            server.kill()
            raise
        finally:
            destroy_daemon(d)


def test_the_sync_sdk_runs_commands_and_files(node: Node) -> None:
    """Create from a template with metadata and env, commands (output, exit codes, env, cwd,
    background with stdin, list, kill), files (write, read, list, stat, mkdir, rename, remove),
    timeout, info and list, kill."""
    sbx = Sandbox.create("base", timeout=120, metadata={"job": "e2b-sync"}, envs={"GREETING": "hi"}, **node.opts())
    try:
        r = sbx.commands.run("echo $GREETING; echo oops >&2")
        assert (r.stdout, r.stderr, r.exit_code) == ("hi\n", "oops\n", 0)
        with pytest.raises(CommandExitException) as failed:
            sbx.commands.run("echo partial; exit 3")
        assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
        assert sbx.commands.run("pwd; echo $X", cwd="/tmp", envs={"X": "y"}).stdout == "/tmp\ny\n"
        # E2B's user and home (the base template's), for commands and relative paths alike.
        assert sbx.commands.run("whoami; pwd").stdout == "user\n/home/user\n"
        assert sbx.commands.run("whoami", user="root").stdout == "root\n"
        sbx.files.write("rel.txt", "relative")
        assert sbx.commands.run("cat /home/user/rel.txt; stat -c %U rel.txt").stdout == "relativeuser\n"
        # Background with stdin: fed, closed, waited; and one killed.
        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "fed through stdin\n")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "fed through stdin\n"
        sleeper = sbx.commands.run("sleep 300", background=True)
        assert sleeper.pid in {p.pid for p in sbx.commands.list()}
        assert sbx.commands.kill(sleeper.pid)
        assert wait_until(lambda: sleeper.pid not in {p.pid for p in sbx.commands.list()}, timeout=10)
        assert not sbx.commands.kill(sleeper.pid)  # gone: False, as E2B's envd says
        # Files.
        info = sbx.files.write("/home/user/work/dir/a.txt", "content a")
        assert info.path == "/home/user/work/dir/a.txt"
        assert sbx.files.read("/home/user/work/dir/a.txt") == "content a"
        assert sbx.files.read("/home/user/work/dir/a.txt", format="bytes") == b"content a"
        assert sbx.files.exists("/home/user/work/dir/a.txt") and not sbx.files.exists("/home/user/work/nope")
        assert sbx.files.make_dir("/home/user/work/dir/sub") and not sbx.files.make_dir("/home/user/work/dir/sub")
        names = {e.name for e in sbx.files.list("/home/user/work/dir")}
        assert names == {"a.txt", "sub"}
        deep = {e.path for e in sbx.files.list("/home/user/work", depth=3)}
        assert {"/home/user/work/dir", "/home/user/work/dir/a.txt", "/home/user/work/dir/sub"} <= deep
        assert sbx.files.get_info("/home/user/work/dir/a.txt").size == len("content a")
        sbx.files.rename("/home/user/work/dir/a.txt", "/home/user/work/dir/b.txt")
        assert sbx.files.read("/home/user/work/dir/b.txt") == "content a" and not sbx.files.exists(
            "/home/user/work/dir/a.txt"
        )
        sbx.files.remove("/home/user/work/dir")
        assert not sbx.files.exists("/home/user/work/dir/b.txt")
        with pytest.raises(e2b.FileNotFoundException):
            sbx.files.read("/home/user/work/dir/b.txt")
        # Lifecycle.
        sbx.set_timeout(200)
        got = sbx.get_info()
        assert got.sandbox_id == sbx.sandbox_id and got.metadata == {"job": "e2b-sync"} and got.template_id == "base"
        listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"job": "e2b-sync"}), **node.opts()).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert sbx.is_running()
        again = Sandbox.connect(sbx.sandbox_id, **node.opts())
        assert again.commands.run("echo again").stdout == "again\n"
    finally:
        assert sbx.kill()
    assert not sbx.is_running()
    assert not Sandbox.kill(sbx.sandbox_id, **node.opts())  # already gone


def test_file_metadata_is_kept_as_extended_attributes(node: Node) -> None:
    """`files.write(metadata=...)` keeps it as the file's `user.e2b.*` attributes, as envd does:
    seen by get_info, list and rename, set or read inside the sandbox too, gone when a write brings
    none; bad metadata refused by the layer itself."""
    sbx = Sandbox.create("base", timeout=120, **node.opts())
    try:
        info = sbx.files.write("m/a.txt", "x", metadata={"Author": "mish", "purpose": "upload"})
        assert info.metadata == {"author": "mish", "purpose": "upload"}  # keys lowercased
        assert sbx.files.get_info("m/a.txt").metadata == info.metadata
        getx = "python3 -c \"import os; print(os.getxattr('/home/user/m/a.txt', 'user.e2b.author').decode())\""
        assert sbx.commands.run(getx).stdout == "mish\n"
        sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/m/a.txt', 'user.e2b.tag', b'in')\"")
        assert [e.metadata for e in sbx.files.list("m")] == [{"author": "mish", "purpose": "upload", "tag": "in"}]
        assert sbx.files.rename("m/a.txt", "m/b.txt").metadata == {"author": "mish", "purpose": "upload", "tag": "in"}
        sbx.commands.run("python3 -c \"import os; os.setxattr('/home/user/m/b.txt', 'user.mine', b'kept')\"")
        assert sbx.files.write("m/b.txt", "y").metadata is None and sbx.files.get_info("m/b.txt").metadata is None
        mine = "python3 -c \"import os; print(os.getxattr('/home/user/m/b.txt', 'user.mine').decode())\""
        assert sbx.commands.run(mine).stdout == "kept\n"  # an upload replaces E2B's attributes only
        assert sbx.files.write("m/c.txt", "z", use_octet_stream=True, metadata={"k": "v"}).metadata == {"k": "v"}
        envd = {"e2b-sandbox-id": sbx.sandbox_id, "x-access-token": KEYS["a"]}
        for header in ({"x-metadata-": "v"}, {"x-metadata-k": "caf\u00e9"}):  # an empty key, not ASCII
            h = {**envd, **{k: v.encode() for k, v in header.items()}}  # type: ignore[dict-item]
            r = httpx.post(f"{node.url}/files", params={"path": "m/d.txt"}, content=b"d", headers=h)
            assert r.status_code == 400 and "metadata" in r.json()["message"], r.text
        assert not sbx.files.exists("m/d.txt")
    finally:
        sbx.kill()


COMMAND_LINES = (  # the sandbox's command lines (python:3.11 has no ps): "|sleep 301|..."
    "import os; '|' + '|'.join(open(f'/proc/{p}/cmdline', 'rb').read().rstrip(bytes(1)).replace(bytes(1), b' ')"
    ".decode(errors='replace') for p in os.listdir('/proc') if p.isdigit()) + '|'"
)


def _raw_status(url: str, target: str, headers: dict[str, str]) -> int:
    """The status of a GET of `target` sent as written (HTTP clients normalise `..` away)."""
    address, port = url.removeprefix("http://").split(":")
    with socket.create_connection((address, int(port)), timeout=30) as conn:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        conn.sendall(f"GET {target} HTTP/1.1\r\n{head}connection: close\r\n\r\n".encode())
        return int(conn.recv(65536).split(b" ", 2)[1])


ECHO_SERVER = """
import http.server, json, sys
class Echo(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Echo).serve_forever()
"""


def test_sandbox_hosts_reach_envd_and_the_sandboxs_ports(node: Node) -> None:
    """`<port>-<id>.<domain>` hosts (get_host, and envd's URL when only a domain is given), routed
    by the Host header as a wildcard name would bring them: envd's port is envd for that sandbox,
    another port the server on it, reached only with the sandbox's project's key."""
    sbx = Sandbox.create("base", timeout=120, **node.opts())
    try:
        sbx.files.write("site/index.html", "served from the sandbox")
        server = sbx.commands.run("cd site && python3 -m http.server 8001", background=True)
        sbx.files.write("echo.py", ECHO_SERVER)
        echo = sbx.commands.run("python3 echo.py 8002", background=True)
        envd = {"host": f"49983-{sbx.sandbox_id}.sandfleet.test", "x-access-token": KEYS["a"]}
        assert httpx.get(f"{node.url}/health", headers=envd).status_code == 204
        got = httpx.get(f"{node.url}/files", params={"path": "site/index.html"}, headers=envd)
        assert got.content == b"served from the sandbox"
        host = sbx.get_host(8001)
        assert host.startswith(f"8001-{sbx.sandbox_id}.")
        key = sbx.traffic_access_token or KEYS["a"]

        def page(token: str | None, path: str = "/index.html", method: str = "GET") -> httpx.Response:
            headers = {"host": host, **({"e2b-traffic-access-token": token} if token else {})}
            return httpx.request(method, f"{node.url}{path}", headers=headers, timeout=30)

        assert wait_until(lambda: page(key).status_code == 200, timeout=20)
        assert page(key).text == "served from the sandbox"
        assert page(key, "/nope").status_code == 404  # the server's own answers pass through
        assert page(key, "/", "POST").status_code == 501
        assert page(None).status_code == 401  # no key: the layer holds none of its own
        assert page(KEYS["b"]).status_code == 502  # another project's key: not found, as E2B's edge
        # What the sandbox's server gets: the path and query as sent, no credential, no encoding asked.
        host = sbx.get_host(8002)
        assert wait_until(lambda: page(key, "/x").status_code == 200, timeout=20)
        got = page(key, "/a%20b/c?flag&q=%20x;y")
        seen = got.json()
        assert seen["path"] == "/a%20b/c?flag&q=%20x;y"
        assert not {"authorization", "x-access-token", "e2b-traffic-access-token"} & set(seen["headers"])
        assert seen["headers"]["accept-encoding"] == "gzip, deflate, br"  # the caller's, as it asked
        # No way out of the port's route into the rest of sandfleet's API, however it is spelled.
        for climb in ("/../../../exec", "/%2e%2e/%2e%2e/exec", "/a/..%2F..%2Fexec", "/.%2e/x"):
            status = _raw_status(node.url, climb, {"host": host, "e2b-traffic-access-token": key})
            assert status == 400, (climb, status)
        echo.kill()
        server.kill()
    finally:
        sbx.kill()


def test_network_options_become_the_sandboxs_egress_policy(node: Node) -> None:
    """E2B's allowOut / denyOut / allow_internet_access as sandfleet's allow list (what it cannot
    say refused, never dropped), at create and by update_network."""

    def allowed(sandbox_id: str) -> list[str]:
        with node.daemon.client() as root:
            return list(root.get(sandbox_id).info.spec.network.allow)

    only = {"allow_out": ["example.com", "203.0.113.7/32", "*.pypi.org"], "deny_out": ["0.0.0.0/0"]}
    sbx = Sandbox.create("base", timeout=60, network=only, **node.opts())  # type: ignore[arg-type]
    closed = Sandbox.create("base", timeout=60, allow_internet_access=False, **node.opts())
    try:
        assert allowed(sbx.sandbox_id) == ["example.com", "203.0.113.7", "*.pypi.org"]
        assert allowed(closed.sandbox_id) == []
        # Not in the list: the node's egress proxy refuses it.
        probe = sbx.commands.run("curl -sS -o /dev/null -w '%{http_code}' https://example.org || true")
        assert "200" not in probe.stdout
        sbx.update_network({"allow_out": ["example.org"], "deny_out": ["0.0.0.0/0"]})  # type: ignore[typeddict-item]
        assert allowed(sbx.sandbox_id) == ["example.org"]
        for refused in ({"deny_out": ["8.8.8.8"]}, {"allow_out": ["8.8.8.0/24"]}):
            with pytest.raises(e2b.SandboxException, match="allow"):
                Sandbox.create("base", timeout=60, network=refused, **node.opts())  # type: ignore[arg-type]
        with pytest.raises(e2b.SandboxException, match="allow all"):
            sbx.update_network({})  # type: ignore[typeddict-item]
    finally:
        sbx.kill()
        closed.kill()


def test_a_sandbox_that_pauses_at_its_timeout(node: Node) -> None:
    """`lifecycle={"on_timeout": "pause"}`: paused (memory kept) after its timeout's seconds without
    a request instead of stopped, and the next request resumes it with its processes as they were."""
    sbx = Sandbox.create("base", timeout=3, lifecycle={"on_timeout": "pause"}, **node.opts())
    try:
        sleeper = sbx.commands.run("sleep 600", background=True)
        sbx.files.write("kept.txt", "in memory")
        assert wait_until(lambda: sbx.get_info().state.value == "paused", timeout=30)
        assert sbx.commands.run("cat kept.txt").stdout == "in memory"  # a request resumes it
        assert sbx.get_info().state.value == "running"
        assert sleeper.pid in {p.pid for p in sbx.commands.list()}  # its processes went on
        sbx.set_timeout(600)  # now 600 idle seconds before it pauses
        with node.daemon.client() as root:
            spec = root.get(sbx.sandbox_id).info.spec
            assert (spec.pause_after, spec.max_lifetime) == (600, None)
    finally:
        sbx.kill()


def test_the_async_sdk_runs_commands_and_files(node: Node) -> None:
    async def go() -> None:
        sbx = await AsyncSandbox.create("base", timeout=120, **node.opts())
        try:
            r = await sbx.commands.run("echo async; printf 'x%.0s' $(seq 1 100000)")
            assert r.stdout.startswith("async\n") and r.stdout.count("x") == 100000
            await sbx.files.write("/tmp/f", b"\x00\x01binary")
            assert await sbx.files.read("/tmp/f", format="bytes") == b"\x00\x01binary"
            # Output streams as it comes: the first line is seen while the command waits for a file
            # only this test writes once it has seen that line.
            seen: list[str] = []
            first = asyncio.Event()

            def out(text: str) -> None:
                seen.append(text)
                first.set()

            h = await sbx.commands.run(
                "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second", background=True, on_stdout=out
            )
            await asyncio.wait_for(first.wait(), 30)
            assert "".join(seen) == "first\n"
            await sbx.files.write("/tmp/go", b"")
            assert (await h.wait()).stdout == "first\nsecond\n" and "".join(seen) == "first\nsecond\n"
        finally:
            await sbx.kill()

    asyncio.run(go())


def test_pty_and_watch(node: Node) -> None:
    """A PTY (create, input, resize, output, kill) and directory watches: the async SDK's stream and
    the sync SDK's polled watcher, each seeing a file made, written and removed."""

    async def go() -> None:
        sbx = await AsyncSandbox.create("base", timeout=120, **node.opts())
        try:
            out = bytearray()
            pty = await sbx.pty.create(e2b.PtySize(rows=24, cols=80), on_data=out.extend)
            await sbx.pty.send_stdin(pty.pid, b"stty size; echo pty-$((6*7))\n")
            assert await _until(lambda: b"pty-42" in out), bytes(out)
            assert b"24 80" in out
            await sbx.pty.resize(pty.pid, e2b.PtySize(rows=30, cols=100))
            await sbx.pty.send_stdin(pty.pid, b"stty size\n")
            assert await _until(lambda: b"30 100" in out), bytes(out)
            assert pty.pid in {p.pid for p in await sbx.pty.list()} if hasattr(sbx.pty, "list") else True
            assert pty.pid in {p.pid for p in await sbx.commands.list()}
            # Left and followed again (the PTY's command runs on meanwhile, its output kept).
            await pty.disconnect()
            await sbx.pty.send_stdin(pty.pid, b"echo again-$((2*21))\n")
            again = bytearray()
            pty = await sbx.pty.connect(pty.pid, on_data=again.extend)
            assert await _until(lambda: b"again-42" in again), bytes(again)
            assert await sbx.pty.kill(pty.pid)
            with pytest.raises(CommandExitException):
                await pty.wait()
            # A streamed watch.
            await sbx.files.make_dir("/home/user/watched")
            seen: list[e2b.FilesystemEvent] = []
            handle = await sbx.files.watch_dir("/home/user/watched", on_event=seen.append)
            await sbx.files.write("/home/user/watched/new.txt", "x")
            await sbx.files.remove("/home/user/watched/new.txt")
            assert await _until(lambda: {e.type for e in seen} >= {e2b.FilesystemEventType.CREATE,
                                                                    e2b.FilesystemEventType.REMOVE}), seen  # fmt: skip
            assert {e.name for e in seen} == {"new.txt"}
            await handle.stop()
        finally:
            await sbx.kill()

    asyncio.run(go())
    sbx = Sandbox.create("base", timeout=120, **node.opts())
    try:
        sbx.files.make_dir("polled")
        watcher = sbx.files.watch_dir("polled")
        sbx.files.write("polled/a.txt", "a")
        events: list[e2b.FilesystemEvent] = []
        assert wait_until(lambda: events.extend(watcher.get_new_events()) or any(e.name == "a.txt" for e in events))
        watcher.stop()
        with pytest.raises(e2b.SandboxException):
            watcher.get_new_events()  # removed
    finally:
        sbx.kill()


async def _until(predicate: object, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.05)
    return False


def test_the_code_interpreter_keeps_its_state(node: Node) -> None:
    """e2b_code_interpreter's run_code: state kept between executions, the last expression as the
    main result, streamed stdout, an error with its traceback, env vars per execution, a context of
    its own (its namespace apart from the default one), restarted and removed."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(timeout=120, **node.opts())
    try:
        first = sbx.run_code("x = 6 * 7\nprint('hello'); x")
        assert first.logs.stdout == ["hello\n"] and first.text == "42" and first.error is None
        assert first.execution_count == 1
        streamed: list[str] = []
        again = sbx.run_code("import os; print(x + 1); os.environ['FROM_E2B']", envs={"FROM_E2B": "v"},
                             on_stdout=lambda m: streamed.append(m.line))  # fmt: skip
        assert again.text == "v" and streamed == ["43\n"] and again.execution_count == 2  # E2B drops the quotes
        failed = sbx.run_code("1 / 0")
        assert failed.error is not None and failed.error.name == "ZeroDivisionError"
        assert "1 / 0" in failed.error.traceback
        # IPython's shell forms (agents send `!pip install ...`): output in stdout, never raising.
        shell = sbx.run_code("!pwd; echo {x + 1}\nlisted = !ls /home/user/.bashrc /nonexistent\nlisted")
        assert shell.logs.stdout == ["/home/user\n", "43\n"] and shell.error is None
        assert "/home/user/.bashrc" in shell.text and "No such file" in shell.text
        assert "".join(sbx.run_code("%%bash\nfor i in 1 2; do echo $((i * 10)); done").logs.stdout) == "10\n20\n"
        # The code-interpreter template's data stack: a DataFrame's HTML, a figure as a PNG.
        frame = sbx.run_code("import pandas as pd; pd.DataFrame({'a': [1, 2]})")
        assert frame.results[0].html and "<table" in frame.results[0].html
        chart = sbx.run_code("import matplotlib.pyplot as plt; plt.plot([1, 2], [3, 4]); plt.show()")
        assert chart.error is None and [r.png[:8] for r in chart.results] == ["iVBORw0K"]  # PNG's magic, base64
        # IPython's display() and a cell written indented, as E2B's Jupyter kernel takes them.
        shown = sbx.run_code("    from IPython.display import display\n    display({'text/latex': 'x'}, raw=True)")
        assert [r.formats() for r in shown.results] == [["latex"]]
        ctx = sbx.create_code_context(cwd="/tmp")
        listed = sbx.list_code_contexts()  # the default context first, then those made, in order
        assert [(c.id, c.cwd) for c in listed] == [("default", "/home/user"), (ctx.id, "/tmp")]
        own = sbx.run_code("import os; y = 1; os.getcwd()", context=ctx)
        assert own.text == "/tmp"
        assert sbx.run_code("'y' in globals()").text == "False"  # the default context's namespace
        sbx.restart_code_context(ctx)
        assert sbx.run_code("'y' in globals()", context=ctx).text == "False"
        assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "/tmp"  # kept by a restart
        sbx.remove_code_context(ctx)
        assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
        # A client that gives up interrupts its execution: the next one is not queued behind it.
        with pytest.raises(e2b.TimeoutException):
            sbx.run_code("import time; time.sleep(300)", timeout=2)
        t0 = time.monotonic()
        assert sbx.run_code("x + 1", timeout=20).text == "43" and time.monotonic() - t0 < 15
        with pytest.raises(e2b.TimeoutException):  # a shell command's too: it goes with its cell
            sbx.run_code("!sleep 301", timeout=2)
        probe = sbx.commands.run("sleep 303", background=True)  # the probe sees a command that runs
        assert "|sleep 303|" in sbx.run_code(COMMAND_LINES).text
        probe.kill()
        assert wait_until(lambda: "|sleep 301|" not in sbx.run_code(COMMAND_LINES).text, timeout=15)
        assert sbx.run_code("x", timeout=20).text == "42"
    finally:
        sbx.kill()
    # An image without IPython (E2B's base template): the kernel's own engine, the same forms.
    plain = CodeSandbox.create("base", timeout=60, **node.opts())
    try:
        run = plain.run_code("    import os\n    !pwd\n    listed = !echo {6 * 7}\n    os.getcwd(), listed")
        assert run.logs.stdout == ["/home/user\n"] and run.text == "('/home/user', ['42'])", run
        assert plain.run_code("'quoted'").text == "quoted"
        # A bash context: each cell a script in the home, the execution's env vars its own.
        bash = plain.run_code("echo $FOO; pwd; echo oops >&2", language="bash", envs={"FOO": "bar"})
        assert "".join(bash.logs.stdout) == "bar\n/home/user\noops\n"
        assert [c.language for c in plain.list_code_contexts()] == ["python", "bash"]
    finally:
        plain.kill()


def test_snapshots_forks_and_metrics(node: Node) -> None:
    """E2B's snapshots (named, listed, a template to create from, deleted), forks and metrics over
    sandfleet's; another project's key reaches none of them."""
    sbx = Sandbox.create("base", timeout=120, **node.opts())
    try:
        sbx.files.write("state.txt", "before")
        snap = sbx.create_snapshot(name="e2b-test-snap")
        assert snap.names == ["e2b-test-snap"]
        listed = Sandbox.list_snapshots(name="e2b-test-snap", **node.opts()).next_items()
        assert [s.snapshot_id for s in listed] == [snap.snapshot_id]
        assert not Sandbox.list_snapshots(name="e2b-test-snap", **node.opts("b")).next_items()
        with pytest.raises(e2b.SandboxException):
            Sandbox.create(snap.snapshot_id, **node.opts("b"))
        assert not Sandbox.delete_snapshot(snap.snapshot_id, **node.opts("b"))
        restored = Sandbox.create(snap.snapshot_id, timeout=60, **node.opts())
        try:
            assert restored.files.read("state.txt") == "before" and restored.sandbox_id != sbx.sandbox_id
        finally:
            restored.kill()
        assert Sandbox.delete_snapshot(snap.snapshot_id, **node.opts())
        assert not Sandbox.delete_snapshot(snap.snapshot_id, **node.opts())
        forks = sbx.fork(count=2, timeout=60)
        try:
            assert len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 3
            forks[0].files.write("state.txt", "fork 0")
            assert forks[1].files.read("state.txt") == "before" and sbx.files.read("state.txt") == "before"
        finally:
            for f in forks:
                f.kill()
        with pytest.raises(e2b.SandboxException):
            Sandbox.fork(sbx.sandbox_id, **node.opts("b"))
        metric = sbx.get_metrics()[0]
        assert metric.mem_used > 0 and metric.mem_total == 1 << 30 and metric.cpu_count >= 1
    finally:
        sbx.kill()


JS = Path(__file__).parent / "js"


def test_the_js_sdk_runs_too(node: Node) -> None:
    """E2B's JS SDK (npm `e2b`, pinned by tests/js/package-lock.json; setup.sh installs it) through
    the same layer: create, a command as E2B's user in its home, files, a background command
    killed, an exit code, info, kill."""
    if not (JS / "node_modules" / "e2b").is_dir() or shutil.which("node") is None:
        pytest.skip("E2B's JS SDK is not installed (scripts/setup.sh: npm ci in tests/js)")
    env = {**os.environ, "E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url, "E2B_API_KEY": KEYS["a"]}
    env.pop("E2B_DEBUG", None)
    run = subprocess.run(["node", "e2b_probe.mjs"], cwd=JS, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    steps = {line["step"]: line["value"] for line in map(json.loads, run.stdout.splitlines())}
    assert steps["run"] == ["hello from js\nuser\n/home/user\n", 0]
    assert steps["read"] == "written by js" and "js.txt" in steps["list"]
    assert steps["killed"] is True and steps["exit"] == [True, 3]
    assert steps["info"] == ["base", "running"] and steps["kill"] is True


def test_one_projects_key_cannot_reach_anothers_sandboxes(node: Node) -> None:
    """B's key against A's sandbox through every E2B route: not found, the same as an id nobody has;
    B's list holds none of A's; A's sandbox is untouched."""
    sbx = Sandbox.create("base", timeout=120, metadata={"owner": "a"}, **node.opts("a"))
    try:
        sbx.files.write("/tmp/secret", "a's secret")
        for sandbox_id in (sbx.sandbox_id, "sb-doesnotexist"):
            with pytest.raises(e2b.SandboxException):
                Sandbox.connect(sandbox_id, **node.opts("b"))
            with pytest.raises(e2b.SandboxException):
                Sandbox.get_info(sandbox_id, **node.opts("b"))
            assert not Sandbox.kill(sandbox_id, **node.opts("b"))
            with pytest.raises(e2b.SandboxException):
                Sandbox.set_timeout(sandbox_id, 10, **node.opts("b"))
        assert sbx.sandbox_id not in {s.sandbox_id for s in Sandbox.list(**node.opts("b")).next_items()}
        # envd with B's key as the access token and A's sandbox id.
        headers = {"e2b-sandbox-id": sbx.sandbox_id, "x-access-token": KEYS["b"]}
        got = httpx.get(f"{node.url}/files", params={"path": "/tmp/secret"}, headers=headers)
        assert got.status_code == 502 and "a's secret" not in got.text
        run = httpx.post(
            f"{node.url}/process.Process/List", json={}, headers={**headers, "content-type": "application/json"}
        )
        assert run.status_code != 200 and "secret" not in run.text
        put = httpx.post(f"{node.url}/files", params={"path": "/tmp/secret"}, content=b"b was here",
                         headers={**headers, "content-type": "application/octet-stream"})  # fmt: skip
        assert put.status_code == 502
        assert sbx.files.read("/tmp/secret") == "a's secret" and sbx.is_running()
        # Without a key: refused.
        assert httpx.get(f"{node.url}/sandboxes/{sbx.sandbox_id}").status_code == 401
    finally:
        sbx.kill()


def test_bad_requests_get_typed_4xx(node: Node) -> None:
    h = {"x-api-key": KEYS["a"], "content-type": "application/json"}
    bodies = [b"not json", b"[1]", b'{"templateID": 5}', b'{"templateID": "base", "timeout": -1}']
    bodies += [b'{"templateID": "base", "metadata": {"bad key!": "x"}}', b'{"templateID": "no-such-image"}']
    for body in bodies:
        r = httpx.post(f"{node.url}/v2/sandboxes", content=body, headers=h, timeout=60)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert set(r.json()) == {"code", "message"} and r.json()["code"] == r.status_code
    # An SDK of a major version the layer is not checked against: a clear refusal, not a hang.
    old_sdk = httpx.post(f"{node.url}/sandboxes", json={"templateID": "base"},
                         headers={**h, "user-agent": "e2b-python-sdk/1.9.0"})  # fmt: skip
    assert old_sdk.status_code == 400 and "not supported" in old_sdk.json()["message"]
    for query in ("limit=0", "limit=x", "nextToken=-1", "nextToken=abc"):
        r = httpx.get(f"{node.url}/v2/sandboxes?{query}", headers=h)
        assert r.status_code == 400 and r.json()["code"] == 400, (query, r.text)
    # Uploads: refused past 256 MiB before they are held, a gzip bomb too, a broken gzip typed.
    sbx = Sandbox.create("base", timeout=60, **node.opts())
    try:
        envd = {"e2b-sandbox-id": sbx.sandbox_id, "x-access-token": KEYS["a"]}
        octet = {**envd, "content-type": "application/octet-stream"}
        host, port = node.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as conn:  # a length declared, not sent
            head = "".join(f"{k}: {v}\r\n" for k, v in octet.items())
            conn.sendall(
                f"POST /files?path=big HTTP/1.1\r\nhost: x\r\n{head}content-length: {257 << 20}\r\n\r\nx".encode()
            )
            answer = ""
            while "}" not in answer and (chunk := conn.recv(65536)):  # the head, then the JSON body
                answer += chunk.decode(errors="replace")
        assert answer.startswith("HTTP/1.1 400") and "at most" in answer, answer[:300]
        bomb = gzip.compress(bytes(257 << 20), compresslevel=1)
        r = httpx.post(f"{node.url}/files", params={"path": "bomb"}, content=bomb,
                       headers={**octet, "content-encoding": "gzip"}, timeout=120)  # fmt: skip
        assert r.status_code == 400 and "inflated" in r.json()["message"], r.text
        r = httpx.post(f"{node.url}/files", params={"path": "cut"}, content=gzip.compress(b"abc" * 1000)[:20],
                       headers={**octet, "content-encoding": "gzip"})  # fmt: skip
        assert r.status_code == 400, r.text
        assert not sbx.files.exists("bomb") and not sbx.files.exists("cut")
    finally:
        sbx.kill()
    t0 = time.monotonic()
    r = httpx.post(f"{node.url}/process.Process/Start", content=b"{", headers={**h, "e2b-sandbox-id": "x"})
    assert 400 <= r.status_code < 500 and time.monotonic() - t0 < 10
