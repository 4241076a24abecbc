"""The fncall tier: stateless calls forked from warm interpreters in pooled worker sandboxes.

Real daemon, real containers: each call must see none of what an earlier call wrote, left running
or changed in memory, and must keep the container tier's limits (time, output, memory, pids,
network).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from sandfleet import AsyncClient, Client, InvalidArgumentError, Resources, Sandbox
from sandfleet.errors import ResourceExhaustedError, UnavailableError

from conftest import Daemon, destroy_daemon, make_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the fncall tier needs root")

CALLS_OF_UID = """
import os
mine = []
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) != os.getpid():
        try:
            status = open(f'/proc/{p}/status').read()
        except OSError:
            continue
        if '\\nUid:\\t61000' in status:
            mine.append(p)
print(len(mine))
"""


@pytest.fixture(scope="module")
def node() -> Iterator[Daemon]:
    d = make_daemon("fncall")
    d.start()
    yield d
    destroy_daemon(d)


@pytest.fixture
def fleet(node: Daemon) -> Iterator[Client]:
    with node.client(timeout=120) as c:
        yield c


def test_run_code_basics(fleet: Client) -> None:
    r = fleet.run_code("print('hi', 6 * 7)")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "hi 42\n", "")
    r = fleet.run_code(
        "import os, sys; print(os.getuid(), open('a.txt').read(), open('d/b.bin','rb').read(), sys.stdin.read(), "
        "os.environ['X'])",
        files={"a.txt": "A", "d/b.bin": b"\x00\x01"},
        stdin="IN",
        env={"X": "y"},
    )
    assert r.stdout == "61000 A b'\\x00\\x01' IN y\n", r
    r = fleet.run_code("echo $((1+2)); exit 3", language="bash")
    assert (r.exit_code, r.stdout) == (3, "3\n")
    r = fleet.run_code("raise ValueError('boom')")
    assert r.exit_code == 1 and "ValueError: boom" in r.stderr
    r = fleet.run_code("def f(:\n  pass")
    assert r.exit_code == 1 and "SyntaxError" in r.stderr
    assert fleet.run_code("import sys; sys.exit(5)").exit_code == 5
    # A call says its exit status itself before it exits; one that never gets there (os._exit, its
    # descriptor closed, an exec) is reported from its exit.
    r = fleet.run_code("import os; print('out', flush=True); os._exit(4)")
    assert (r.exit_code, r.stdout) == (4, "out\n")
    r = fleet.run_code("import os; os.closerange(3, 65536); print('shut'); raise SystemExit(6)")
    assert (r.exit_code, r.stdout) == (6, "shut\n")
    r = fleet.run_code("import os; os.execv('/bin/sh', ['sh', '-c', 'echo sh; exit 7'])")
    assert (r.exit_code, r.stdout) == (7, "sh\n")
    # A process the call forked ends as the call would, first: not the call's status.
    r = fleet.run_code(
        "import os, sys\nif os.fork() == 0:\n    print('child', flush=True)\n    sys.exit(0)\n"
        "os.wait()\nprint('parent done')\nsys.exit(3)"
    )
    assert (r.exit_code, r.stdout) == (3, "child\nparent done\n"), r
    assert fleet.run_code("import os; os.kill(os.getpid(), 9)").signal == 9


def test_calls_leave_nothing_behind(fleet: Client) -> None:
    """Files, processes (background, double-forked, new session), memory and IPC objects of one
    call are gone before the next."""
    first = fleet.run_code(
        """
import os, subprocess, sys, ctypes
open('/tmp/leak', 'w').write('x'); open('/dev/shm/leak', 'w').write('x'); open('kept.txt', 'w').write('x')
subprocess.Popen(['sleep', '1000'], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        import time; time.sleep(1000)
    os._exit(0)
sys.modules['json'].LEAK = 1
libc = ctypes.CDLL(None)
print(libc.shmget(0, 4096, 0o1600) >= 0)
"""
    )
    assert first.exit_code == 0 and first.stdout == "True\n", first
    # The same pool serves the next call, on the same worker or another: nothing of the first.
    for _ in range(3):
        r = fleet.run_code(
            CALLS_OF_UID
            + """
import sys, json
print(os.path.exists('/tmp/leak'), os.path.exists('/dev/shm/leak'), os.listdir('.'), hasattr(json, 'LEAK'))
print(sum(1 for row in open('/proc/sysvipc/shm').read().splitlines()[1:] if row.split()[7] == '61000'))
"""
        )
        assert r.stdout.split("\n")[:3] == ["0", "False False [] False", "0"], r


def test_limits(fleet: Client) -> None:
    r = fleet.run_code("import time; time.sleep(30)", timeout=0.5)
    assert r.timed_out and r.duration < 5
    r = fleet.run_code("print('x' * 5000)", output_limit=100)
    assert r.stdout_truncated and len(r.stdout) == 100
    r = fleet.run_code("import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)")
    assert r.exit_code == 1 and "unreachable" in r.stderr.lower()
    small = Resources(memory="96MiB", pids=64)
    r = fleet.run_code("b = bytearray(400 * 1024 * 1024); print(len(b))", resources=small)
    assert r.exit_code != 0 and "419430400" not in r.stdout
    r = fleet.run_code(
        "import os\nfor _ in range(200):\n    try:\n        os.fork() or __import__('time').sleep(30)\n"
        "    except OSError:\n        print('limited'); break",
        resources=small,
        timeout=10,
    )
    assert "limited" in r.stdout, r
    # The pool's workers survived both and serve the next call.
    assert fleet.run_code("print('ok')", resources=small).stdout == "ok\n"


WARM = """
import os, signal, sys
mark = b'warm ' + b'worker'  # not in this program's own command line
parents = {}
for p in os.listdir('/proc'):
    try:
        if p.isdigit() and mark in open(f'/proc/{p}/cmdline', 'rb').read():
            parents[int(p)] = int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1])
    except OSError:
        pass
supervisors = {p for p, parent in parents.items() if parent not in parents}
zygotes = {p for p, parent in parents.items() if parent in supervisors}
spares = {p for p, parent in parents.items() if parent in zygotes}  # the next call, forked ahead
print(sorted(supervisors), sorted(zygotes), len(os.listdir(f'/proc/{min(supervisors)}/fd')))
for p in parents:
    if sys.argv[1] == 'all' or (sys.argv[1] == 'zygote' and p in zygotes) or (sys.argv[1] == 'spare' and p in spares):
        os.kill(p, signal.SIGKILL)
"""


def _warm(w: Sandbox, which: str = "all") -> tuple[list[int], list[int], int]:
    """The pids of a worker's supervisor and zygote and the supervisor's open descriptors (killing
    both, or the zygote, or the spare call, or none)."""
    r = w.exec(["python3", "-c", WARM, which])
    sups, zygs, fds = r.stdout.split("] ")
    supervisors, zygotes = json.loads(sups + "]"), json.loads(zygs + "]")
    assert len(supervisors) == len(zygotes) == 1, r
    return supervisors, zygotes, int(fds)


def test_worker_sandbox(fleet: Client) -> None:
    """A worker set up through exec and files; calls read that state and cannot change it."""
    with fleet.create(backend="fncall", image="python") as w:
        w.exec("mkdir -p /srv && echo data > /srv/input.txt")
        assert w.run_code("print(open('/srv/input.txt').read().strip())").stdout == "data\n"
        r = w.run_code("open('/srv/input.txt', 'w').write('changed')")
        assert r.exit_code == 1 and "PermissionError" in r.stderr
        assert w.files.read("/srv/input.txt") == b"data\n"
        # The warm interpreter killed from inside the worker: the next call starts another.
        killed, _, _ = _warm(w)
        assert w.run_code("print(2)").stdout == "2\n"
        # Its zygote alone: the supervisor starts afresh in the same process (a new program).
        supervisor, zygote, _ = _warm(w, "zygote")
        assert supervisor != killed
        assert w.run_code("print(3)").stdout == "3\n"
        again, fresh, fds = _warm(w, "none")
        assert again == supervisor and fresh != zygote
        # The call forked ahead, killed before its order: the next is forked, nothing kept of it.
        for i in range(3):
            _warm(w, "spare")
            assert w.run_code(f"print({i})").stdout == f"{i}\n"
        assert _warm(w, "none") == (supervisor, fresh, fds)
        # The worker is clean when a call on it returns (the cleanup is not left for later).
        for _ in range(3):
            w.run_code("open('/tmp/left', 'w').write('x'); open('/dev/shm/left', 'w').write('x')")
            assert w.exec("ls /tmp /dev/shm").stdout.count("left") == 0
    with fleet.create(image="busybox") as plain, pytest.raises(InvalidArgumentError):
        plain.run_code("print(1)")


def test_bad_requests(fleet: Client, node: Daemon) -> None:
    with pytest.raises(InvalidArgumentError):
        fleet.run_code("print(1)", files={"/etc/passwd": "x"})
    with pytest.raises(InvalidArgumentError):
        fleet.run_code("print(1)", files={"../up": "x"})
    for files in ({"a": "1", "a/b": "2"}, {"a": "1", "./a": "2"}, {"x" * 256: "1"}, {".": "1"}):
        with pytest.raises(InvalidArgumentError):  # never reaches a worker (the scratch could not hold it)
            fleet.run_code("print(1)", files=files)
    with pytest.raises(InvalidArgumentError):
        fleet.run_code("echo", language="bash", image="busybox")  # no python3 for the warm worker
    transport = httpx.HTTPTransport(uds=str(node.socket))
    with httpx.Client(transport=transport, base_url="http://sandfleet") as h:
        for body in ({"code": 1}, {"code": "x", "language": "perl"}, {"code": "x", "timeout": -1}, {}):
            resp = h.post("/v1/run", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_argument", (body, resp.text)


def test_a_call_its_worker_cannot_prepare_fails_alone(fleet: Client) -> None:
    """Files that do not fit the worker's disk: that call fails, and the next runs at once."""
    with fleet.create(backend="fncall", image="python", resources=Resources(disk="4MiB")) as w:
        with pytest.raises(UnavailableError, match="could not run the call"):
            w.run_code("print(1)", files={"big.bin": b"x" * 6 * 1024**2})
        t = time.monotonic()
        assert w.run_code("import os; print(os.listdir())").stdout == "[]\n"
        assert time.monotonic() - t < 10


def test_concurrent_calls(node: Daemon) -> None:
    async def main() -> list[str]:
        async with AsyncClient(str(node.socket), timeout=120) as c:
            results = await asyncio.gather(*(c.run_code(f"print({i} * 2)") for i in range(24)))
            return [r.stdout for r in results]

    assert asyncio.run(main()) == [f"{i * 2}\n" for i in range(24)]


def test_batched_calls_keep_their_own_outcomes(node: Daemon) -> None:
    """Calls made at once travel as one batch, each with its own result or typed error."""

    async def main() -> list[object]:
        async with AsyncClient(str(node.socket), timeout=120) as c:
            return await asyncio.gather(
                c.run_code("print('a')"),
                c.run_code("import sys; sys.exit(3)"),
                c.run_code("echo", language="bash", image="busybox"),  # no python3 there: its own error
                c.run_code("print('b')"),
                return_exceptions=True,
            )

    a, exit3, err, b = asyncio.run(main())
    assert getattr(a, "stdout", None) == "a\n" and getattr(b, "stdout", None) == "b\n"
    assert getattr(exit3, "exit_code", None) == 3
    assert isinstance(err, InvalidArgumentError)


def test_a_full_node_makes_room_for_a_new_pool() -> None:
    """With the node at its sandbox limit, a call for a new (image, resources) stops an idle worker
    of another pool instead of failing."""
    d = make_daemon("fncall-full", extra="max_sandboxes = 2\n")
    d.config.write_text(d.config.read_text().replace("stopped_retention = 0\n", "stopped_retention = 60\n"))
    d.start()
    try:
        with d.client(timeout=120) as c:
            for mem in ("200MiB", "210MiB", "220MiB"):
                r = c.run_code("print('ok')", resources=Resources(memory=mem))
                assert r.stdout == "ok\n", (mem, r)
            assert len(c.list()) <= 2
            assert "evicted" in {s.stop_reason for s in c.list(state="stopped")}
    finally:
        destroy_daemon(d)


@pytest.mark.slow
def test_a_call_waits_for_a_busy_pool_only_as_long_as_its_timeout() -> None:
    """Every worker of the pool busy: the next call waits for one to be freed, but never past its own
    timeout (it used to wait without bound), then fails as retryable, and the pool serves again."""
    d = make_daemon("fncall-busy")
    tiers = d.config.read_text().replace("[container]\n", '[[backends]]\ntype = "container"\n')
    d.config.write_text(tiers + '[[backends]]\ntype = "fncall"\nmax_workers = 1\n')
    d.start()
    try:
        with d.client(timeout=120) as c:
            assert c.run_code("print('warm')").stdout == "warm\n"
            with ThreadPoolExecutor(1) as pool:
                busy = pool.submit(c.run_code, "import time; time.sleep(8); print('slow')", timeout=20)
                time.sleep(1)
                t0 = time.monotonic()
                with pytest.raises(ResourceExhaustedError):
                    c.run_code("print('quick')", timeout=2)
                assert time.monotonic() - t0 < 5
                assert busy.result().stdout == "slow\n"
            assert c.run_code("print('again')", timeout=2).stdout == "again\n"
    finally:
        destroy_daemon(d)


@pytest.mark.slow
def test_a_burst_into_an_empty_pool_makes_no_more_than_max_workers() -> None:
    """Workers being made count toward `max_workers`: eight calls at once into an empty pool of at
    most two make two workers (each made one before), and every call is served."""
    d = make_daemon("fncall-burst")
    tiers = d.config.read_text().replace("[container]\n", '[[backends]]\ntype = "container"\n')
    d.config.write_text(tiers + '[[backends]]\ntype = "fncall"\nworkers = 1\nmax_workers = 2\n')
    d.start()
    try:

        async def main() -> list[str]:
            async with AsyncClient(str(d.socket), timeout=120) as c:
                results = await asyncio.gather(*(c.run_code(f"print({i})") for i in range(8)))
                return [r.stdout for r in results]

        assert asyncio.run(main()) == [f"{i}\n" for i in range(8)]
        with d.client(timeout=60) as c:
            assert len(c.list(labels={"sandfleet.fncall-pool": "1"})) == 2
    finally:
        destroy_daemon(d)
