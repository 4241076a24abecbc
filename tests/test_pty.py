"""Terminals: `exec(pty=True)`, `sb.terminal()` over the WebSocket, `sandfleet shell` on a real
terminal; real sandboxes, real pseudo-terminals in them."""

from __future__ import annotations

import asyncio
import base64
import fcntl
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from httpx_ws import WebSocketDisconnect, aconnect_ws

from sandfleet import AsyncClient, Client
from sandfleet.client import _base as b
from sandfleet.errors import (
    InvalidArgumentError,
    PermissionDeniedError,
    SandboxTimeoutError,
    UnauthenticatedError,
    WrongStateError,
)
from sandfleet.models import ProcessInfo, TerminalSize

from conftest import Daemon, destroy_daemon, make_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="real sandboxes need root")

VIM_IMAGE = "test-pty/vim:1"
PROMPT = re.compile(rb"[#$] $")


@pytest.fixture
async def afleet(daemon: Daemon) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(daemon.socket, timeout=120) as c:
        yield c


def test_exec_pty_is_a_terminal_of_the_size_asked(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        r = sb.exec(
            "stty size; tty; test -t 0 && test -t 1 && test -t 2 && echo all-tty; echo $TERM",
            pty=TerminalSize(rows=40, cols=132),
        )
        assert r.exit_code == 0, r
        lines = r.stdout.split("\r\n")
        assert lines[0] == "40 132"
        assert re.fullmatch(r"/dev/pts/\d+", lines[1])
        assert lines[2:4] == ["all-tty", "xterm-256color"]
        assert sb.exec("test -t 1 || echo not-a-tty").stdout == "not-a-tty\n"  # without pty: pipes, as before
        # stdin is typed into the terminal (it echoes); ^D ends a read
        r = sb.exec("read x; echo got=$x", pty=True, stdin="abc\n")
        assert "got=abc" in r.stdout


def test_exec_pty_output_cap_and_timeout_hold(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        r = sb.exec("yes | head -c 200000", pty=True, output_limit=500)
        assert len(r.stdout) <= 500 and r.stdout_truncated, (len(r.stdout), r)
        r = sb.exec("sleep 100", pty=True, timeout=1)
        assert r.timed_out and r.duration < 10


async def test_terminal_resize_is_seen_by_stty(afleet: AsyncClient) -> None:
    async with await afleet.create(image="busybox") as sb, await sb.terminal("sh", rows=30, cols=100) as t:
        assert t.pid > 0
        await t.send("stty size\r")
        await t.expect(b"30 100\r\n")
        await t.resize(50, 120)
        await t.send("stty size\r")
        await t.expect(b"50 120\r\n")
        # a full-screen program hears of it: SIGWINCH to the foreground job
        await t.send("trap 'echo winch-$(stty size)' WINCH; sleep 5 & wait\r")
        await asyncio.sleep(0.3)
        await t.resize(33, 77)
        await t.expect(b"winch-33 77")
        await t.send("\x03exit 5\r")
        assert (await t.wait(10)).exit_code == 5


async def test_ctrl_c_interrupts_the_foreground_job(afleet: AsyncClient) -> None:
    async with await afleet.create(image="busybox") as sb, await sb.terminal("sh") as t:
        await t.send("sleep 100\r")
        await asyncio.sleep(0.5)
        t0 = time.monotonic()
        await t.send("\x03")  # the line discipline's SIGINT to the foreground job; the shell lives on
        await t.expect(b"^C")
        await t.send("echo after=$?\r")
        await t.expect(b"after=130", timeout=5)  # the shell lives on; sleep died of SIGINT
        assert time.monotonic() - t0 < 3
        await t.send("echo alive\r")
        await t.expect(b"alive\r\n")
        # the terminal itself is still the shell's
        await t.send("exit\r")
        assert (await t.wait(10)).exit_code == 0


async def test_default_terminal_is_a_login_shell_in_home(afleet: AsyncClient) -> None:
    async with await afleet.create(image="python:3.11") as sb, await sb.terminal() as t:
        await t.send("echo shell=$0 home=$(pwd) user=$USER\r")
        await t.expect(b"\r\n")  # the echo of what we typed
        out = await t.expect(re.compile(rb"shell=[^$\s]+ home=[^$\s]+ user=[^$\s]+"))
        assert re.search(rb"shell=-?\S*bash home=/root user=root", out), out


@pytest.fixture(scope="module")
def vim_image(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with Client(daemon.socket, timeout=600) as c:
        recipe = f'ref = "{VIM_IMAGE}"\nbase = "debian:bookworm"\n[[step]]\napt = ["vim-tiny", "less", "procps"]\n'
        c.build_recipe(recipe, base_dir=tmp_path_factory.mktemp("vim"))
        yield VIM_IMAGE
        c.delete_image(VIM_IMAGE)


@pytest.mark.slow  # its image is built with apt at every run (13 s of setup)
async def test_full_screen_programs_vim_less_top(afleet: AsyncClient, vim_image: str) -> None:
    async with await afleet.create(image=vim_image) as sb, await sb.terminal("bash", rows=24, cols=80) as t:
        await t.expect(PROMPT)
        await t.send("vim.tiny /tmp/note.txt\r")
        screen = await t.expect(b'"/tmp/note.txt"', timeout=15)  # its status line: the file is new
        assert b"\x1b[" in screen  # it drives the screen with escape sequences
        await t.send("ihello from vim\x1b:wq\r")
        await t.expect(PROMPT, timeout=15)
        await t.send("cat /tmp/note.txt\r")
        await t.expect(b"hello from vim\r\n")
        # less pages and quits on q; top draws and quits on q
        await t.send("seq 1 500 | less\r")
        await t.expect(b"\r\n23", timeout=10)
        await t.send("q")
        await t.expect(PROMPT, timeout=10)  # typed ahead, it would be flushed as less restores the terminal
        await t.send("echo less-done\r")
        await t.expect(b"less-done\r\n")
        await t.send("top\r")
        await t.expect(b"load average", timeout=10)
        await t.send("q")
        await t.expect(PROMPT, timeout=10)
        await t.send("echo top-done\r")
        await t.expect(b"top-done\r\n")
        await t.send("exit\r")
        assert (await t.wait(10)).exit_code == 0


async def test_terminal_output_cap_and_timeout(afleet: AsyncClient) -> None:
    async with await afleet.create(image="busybox") as sb:
        async with await sb.terminal(["sh", "-c", "yes | head -c 300000; sleep 1"], output_limit=2000) as t:
            got = b""
            while data := await t.read(timeout=20):
                got += data
            result = await t.wait(10)
        assert 1000 < len(got) <= 2000 and result.stdout_truncated, (len(got), result)
        async with await sb.terminal("sleep 100", timeout=1) as t:
            result = await t.wait(15)
        assert result.timed_out


async def test_leaving_a_terminal_kills_what_runs_on_it(afleet: AsyncClient) -> None:
    mark = uuid.uuid4().hex[:8]
    async with await afleet.create(image="busybox") as sb:
        t = await sb.terminal(f"sleep 1000 & echo started-{mark}; wait")
        await t.expect(f"started-{mark}".encode())
        await t.aclose()

        async def gone() -> bool:
            return "sleep 1000" not in (await sb.exec("ps -o args")).stdout

        for _ in range(100):
            if await gone():
                break
            await asyncio.sleep(0.1)
        assert await gone()
        events = [e.kind for e in await sb.events()]
        assert "terminal_opened" in events and "terminal_closed" in events
        info = await sb.refresh()
        assert info.state == "running"


async def test_terminal_errors_are_typed(afleet: AsyncClient, daemon: Daemon) -> None:
    sb = await afleet.create(image="busybox")
    try:
        with pytest.raises(InvalidArgumentError):
            await sb.terminal(rows=0)  # checked before connecting
        # the daemon checks too: a raw client with a bad start message, then a bad frame
        transport = httpx.AsyncHTTPTransport(uds=str(daemon.socket))
        async with httpx.AsyncClient(transport=transport, base_url="http://sandfleet") as raw:
            for start, code in (('{"type": "start", "rows": 0}', "invalid_argument"), ("not json", "invalid_argument")):
                async with aconnect_ws(
                    f"/v1/sandboxes/{sb.id}/terminal", raw, subprotocols=["sandfleet.terminal"]
                ) as ws:
                    await ws.send_text(start)
                    msg = json.loads(await ws.receive_text(timeout=10))
                    assert msg["type"] == "error" and msg["error"]["code"] == code, msg
                    with pytest.raises(WebSocketDisconnect) as closed:
                        await ws.receive(timeout=10)
                    assert closed.value.code == 4400
            async with aconnect_ws("/v1/sandboxes/sb-00000000000000ff/terminal", raw) as ws:
                await ws.send_text('{"type": "start"}')
                msg = json.loads(await ws.receive_text(timeout=10))
                assert msg["error"]["code"] == "not_found"
                with pytest.raises(WebSocketDisconnect) as closed:
                    await ws.receive(timeout=10)
                assert closed.value.code == 4404
            async with aconnect_ws(f"/v1/sandboxes/{sb.id}/terminal", raw) as ws:
                await ws.send_text('{"type": "start", "command": "sh"}')
                assert json.loads(await ws.receive_text(timeout=10))["type"] == "started"
                await ws.send_text('{"type": "resize", "rows": 99999, "cols": 1}')
                msg = None
                while msg is None or msg.get("type") != "error":
                    event = await ws.receive(timeout=10)
                    if hasattr(event, "data") and isinstance(event.data, str):
                        msg = json.loads(event.data)
                assert msg["error"]["code"] == "invalid_argument"
    finally:
        await sb.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_terminal_needs_a_token_that_may_write() -> None:
    port = _free_port()
    d = make_daemon(
        "ptyiam",
        f'tcp = "127.0.0.1:{port}"\n'
        '[[iam.tokens]]\nname = "admin"\ntoken = "admin-secret-1234567890"\nrole = "admin"\n'
        '[[iam.tokens]]\nname = "viewer"\ntoken = "viewer-secret-123456789"\nrole = "read-only"\n',
    )
    try:
        d.start()
        url = f"http://127.0.0.1:{port}"
        with Client(url=url, token="admin-secret-1234567890") as admin:
            sb = admin.create(image="busybox")
            with sb.terminal("sh") as t:
                t.send("echo via-tcp\r")
                t.expect(b"via-tcp\r\n")
            with Client(url=url, token="viewer-secret-123456789") as viewer, pytest.raises(PermissionDeniedError):
                viewer.get(sb.id).terminal("sh")
            with Client(url=url) as nobody, pytest.raises(UnauthenticatedError):
                nobody.get(sb.id).terminal("sh")

            # a browser's way: the token as a subprotocol
            async def browser(token: str) -> dict[str, object]:
                proto = "sandfleet.bearer." + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")
                async with (
                    httpx.AsyncClient(base_url=url) as raw,
                    aconnect_ws(
                        f"/v1/sandboxes/{sb.id}/terminal", raw, subprotocols=["sandfleet.terminal", proto]
                    ) as ws,
                ):
                    assert ws.subprotocol == "sandfleet.terminal"
                    await ws.send_text('{"type": "start", "command": "echo hi-browser"}')
                    out = b""
                    while True:
                        event = await ws.receive(timeout=10)
                        if isinstance(getattr(event, "data", None), str):
                            msg = json.loads(event.data)
                            if msg["type"] in ("exit", "error"):
                                return {**msg, "out": out}
                        elif isinstance(getattr(event, "data", None), (bytes, bytearray)):
                            out += bytes(event.data)

            ok = asyncio.run(browser("admin-secret-1234567890"))
            assert ok["type"] == "exit" and b"hi-browser" in ok["out"]  # type: ignore[operator]
            refused = asyncio.run(browser("viewer-secret-123456789"))
            assert refused["type"] == "error" and refused["error"]["code"] == "permission_denied"  # type: ignore[index]
            assert admin.get(sb.id).refresh().state == "running"
            sb.stop()
    finally:
        destroy_daemon(d)


def _read_until(fd: int, pattern: bytes, timeout: float = 15.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while pattern not in out:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SandboxTimeoutError(f"{pattern!r} not seen: {out[-500:]!r}")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_cli_shell_is_a_real_terminal(fleet: Client, daemon: Daemon) -> None:
    sb = fleet.create(image="busybox")
    try:
        pid, fd = pty.fork()
        if pid == 0:  # the child: `sandfleet shell` on a terminal of 25x90
            os.execvp(
                sys.executable,
                [sys.executable, "-m", "sandfleet", "shell", sb.id, "-c", "sh", "--socket", str(daemon.socket)],
            )
        try:
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 25, 90, 0, 0))
            _read_until(fd, b"/ # ")  # the sandbox's prompt: our terminal is raw by now (typed-ahead would be flushed)
            os.write(fd, b"stty size\r")
            _read_until(fd, b"25 90")
            fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 41, 101, 0, 0))  # SIGWINCH to the CLI
            time.sleep(0.5)
            os.write(fd, b"stty size\r")
            _read_until(fd, b"41 101")
            os.write(fd, b"sleep 100\r")
            time.sleep(0.5)
            os.write(fd, b"\x03")  # our terminal is raw: ^C travels to the sandbox's terminal
            _read_until(fd, b"^C")
            os.write(fd, b"echo after=$?\r")
            _read_until(fd, b"after=130")
            os.write(fd, b"exit 3\r")
            _read_until(fd, b"\n", timeout=5)
        finally:
            for _ in range(100):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                time.sleep(0.1)
            else:
                os.kill(pid, 9)
                _, status = os.waitpid(pid, 0)
            os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 3
        # not a terminal: the line-by-line session reads commands from stdin
        r = subprocess.run(
            [sys.executable, "-m", "sandfleet", "shell", sb.id, "--socket", str(daemon.socket)],
            input="cd /tmp\npwd\n",
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0 and "/tmp\n" in r.stdout, r
    finally:
        sb.stop()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def test_a_client_that_does_not_read_holds_the_command_back_not_the_daemons_memory(
    afleet: AsyncClient, daemon: Daemon
) -> None:
    async with await afleet.create(image="busybox") as sb:
        transport = httpx.AsyncHTTPTransport(uds=str(daemon.socket))
        async with httpx.AsyncClient(transport=transport, base_url="http://sandfleet") as raw:
            before = _rss_kib(daemon.pid)
            path = f"/v1/sandboxes/{sb.id}/terminal"
            async with aconnect_ws(path, raw, queue_size=1, max_message_size_bytes=1 << 20) as ws:
                await ws.send_text('{"type": "start", "command": "yes"}')
                await asyncio.sleep(4)  # reading nothing: at 30+ MiB/s this would be 100+ MiB
                grown = _rss_kib(daemon.pid) - before
                ps = (await sb.exec("ps -o stat,args")).stdout
                assert grown < 40 * 1024, f"the daemon grew by {grown} KiB"
                # `yes` is blocked writing to its terminal (S), not running flat out (R)
                assert any(line.split()[0].startswith("S") for line in ps.splitlines() if line.endswith(" yes")), ps
        # no lifetime cap by default: past 64 MiB a terminal still shows what comes next
        async with await sb.terminal("sh") as t:
            await t.send("head -c 80000000 /dev/zero | tr '\\0' x; echo; echo MARK$((40+2))\r")
            await t.expect(b"MARK42", timeout=60)


async def test_terminal_open_blocks_snapshot_and_odd_requests_are_typed(afleet: AsyncClient, daemon: Daemon) -> None:
    async with await afleet.create(image="busybox") as sb:
        async with await sb.terminal(cwd="/tmp") as t:
            await t.send("pwd\r")
            await t.expect(b"/tmp\r\n")
            with pytest.raises(WrongStateError, match="terminal"):
                await sb.snapshot()
        for _ in range(50):  # the daemon sees the client leave, then closes the terminal: soon, not at once
            try:
                snap = await sb.snapshot()  # closed: fine again
                break
            except WrongStateError:
                await asyncio.sleep(0.1)
        await afleet.delete_snapshot(snap.id)
        with pytest.raises(InvalidArgumentError, match="background"):
            call = b.Call("POST", f"/v1/sandboxes/{sb.id}/processes", json={"command": "sleep 1", "pty": {}})
            await afleet._model(ProcessInfo, call)
        transport = httpx.AsyncHTTPTransport(uds=str(daemon.socket))
        async with httpx.AsyncClient(transport=transport, base_url="http://sandfleet") as raw:
            path = f"/v1/sandboxes/{sb.id}/terminal"
            for start in ('{"type": "start", "timeout": 100000}', '{"type": "start", "command": "a\\u0000b"}'):
                async with aconnect_ws(path, raw) as ws:
                    await ws.send_text(start)
                    msg = json.loads(await ws.receive_text(timeout=10))
                assert msg["error"]["code"] == "invalid_argument", msg
            async with aconnect_ws(path, raw, headers={"origin": "http://evil.example"}) as ws:
                await ws.send_text('{"type": "start"}')
                msg = json.loads(await ws.receive_text(timeout=10))
            assert msg["error"]["code"] == "permission_denied" and "another site" in msg["error"]["message"]
