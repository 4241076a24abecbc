"""Stateless calls attacked: nothing of one call reaches a later one, nor another project's.

Real daemon with two projects, real workers: a call that scans its own memory (`/proc/self/mem`)
finds none of an earlier call's code, environment, stdin, files or output, neither in its project
nor in another (whose workers it never shares), also through SandboxFusion's route; what a call
leaves in files, System V and POSIX IPC, sockets and processes (a fork bomb) is gone before the
next call on the same worker starts.
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from sandfleet import AsyncClient, Client, Mount, Resources

from conftest import Daemon, destroy_daemon, make_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the fncall tier needs root")

TOKENS = {"alpha": "alpha-user-secret-000001", "beta": "beta-user-secret-0000002"}
IAM = "".join(
    f'[[iam.projects]]\npath = "{p}"\n\n[[iam.tokens]]\nname = "{p}"\ntoken = "{t}"\nproject = "{p}"\n\n'
    for p, t in TOKENS.items()
)
MARK = "SFLEAK"  # every secret starts with it; its base64 (of a secret at offset 0) with B64MARK
B64MARK = base64.b64encode(MARK.encode()).decode()

# Reads every readable mapping of its own process and prints the secrets (raw, or base64 as the
# worker's protocol carries files, stdin and output) it finds. Its own text matches neither pattern.
SCAN = rf"""
import ctypes, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its own /proc/self/mem
found = set()
pattern = re.compile(rb"{MARK}[0-9a-f]{{16}}|{B64MARK}[A-Za-z0-9+/]{{12}}")
with open('/proc/self/maps') as maps, open('/proc/self/mem', 'rb', 0) as mem:
    for line in maps:
        addr, perms = line.split()[:2]
        if 'r' not in perms:
            continue
        lo, hi = (int(x, 16) for x in addr.split('-'))
        try:
            mem.seek(lo)
            data = mem.read(hi - lo)
        except (OSError, ValueError, OverflowError):
            continue
        found.update(m.decode() for m in pattern.findall(data))
print(sorted(found))
"""


def _secret() -> str:
    return MARK + secrets.token_hex(8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def node() -> Iterator[Daemon]:
    port = _free_port()
    d = make_daemon("fncall-iso", f'tcp = "127.0.0.1:{port}"\n' + IAM)
    d.tcp_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    d.start()
    yield d
    destroy_daemon(d)


def _client(node: Daemon, project: str) -> Client:
    return Client(url=node.tcp_url, token=TOKENS[project], timeout=120)  # type: ignore[attr-defined]


def _auth(project: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TOKENS[project]}"}


def _leave_secrets(c: Client) -> list[str]:
    """A call whose code, environment, stdin, file and output each hold a secret of their own."""
    code, env, stdin, file, out = (_secret() for _ in range(5))
    r = c.run_code(
        f"import os\nprint({out[: len(MARK)]!r} + {out[len(MARK) :]!r}); x = {code!r}\n"
        "print(os.environ['K'], open('f').read(), input())",
        env={"K": env},
        files={"f": file},
        stdin=stdin + "\n",
    )
    assert r.stdout == f"{out}\n{env} {file} {stdin}\n", r
    return [code, env, stdin, file, out]


def _scan(c: Client) -> list[str]:
    r = c.run_code(SCAN)
    assert r.exit_code == 0, r
    found: list[str] = eval(r.stdout)  # noqa: S307 (a list of strings, printed by SCAN)
    return found


def test_a_call_finds_nothing_of_earlier_calls_in_its_memory(node: Daemon) -> None:
    """Within a project and across projects: the secrets of A's calls are in no later call's memory."""
    with _client(node, "alpha") as a, _client(node, "beta") as b:
        _leave_secrets(a)
        assert a.run_code("print(1)").stdout == "1\n"  # the secrets are no older than one call
        for c in (b, a, b, a):
            assert _scan(c) == []


def test_the_fusion_route_leaks_nothing_either(node: Daemon) -> None:
    secret = _secret()
    with httpx.Client(base_url=node.tcp_url, timeout=120) as http:  # type: ignore[attr-defined]

        def run(project: str, code: str, **body: object) -> dict[str, object]:
            r = http.post("/run_code", json={"language": "python", "code": code, **body}, headers=_auth(project))
            assert r.status_code == 200, r.text
            result: dict[str, object] = r.json()["run_result"]
            return result

        out = run("alpha", f"x = {secret!r}; print(input())", stdin=secret[::-1])
        assert out["stdout"] == secret[::-1] + "\n"
        for project in ("beta", "alpha"):
            assert run(project, SCAN)["stdout"] == "[]\n"


def test_projects_never_share_a_worker(node: Daemon) -> None:
    """No worker serves two projects; each project's workers are its own sandboxes (its token lists
    them, the other's does not)."""

    async def hosts(project: str) -> set[str]:
        async with AsyncClient(url=node.tcp_url, token=TOKENS[project], timeout=120) as c:  # type: ignore[attr-defined]
            rs = await asyncio.gather(*(c.run_code("import socket, time; time.sleep(0.2); print(socket.gethostname())")
                                        for _ in range(4)))  # fmt: skip
        return {r.stdout.strip() for r in rs}

    a = asyncio.run(hosts("alpha"))
    b = asyncio.run(hosts("beta"))  # A's workers are idle now: a shared pool would hand them out
    assert a and b and not a & b, (a, b)
    with _client(node, "alpha") as ca, _client(node, "beta") as cb:
        mine = {s.id: s.spec.project for s in ca.list(labels={"sandfleet.fncall-pool": "1"})}
        assert a <= set(mine) and set(mine.values()) == {"alpha"}, mine
        assert not b & set(mine)
        assert not a & {s.id for s in cb.list()}
    # A call placed in another project's pool by name: refused, as a create there would be.
    with httpx.Client(base_url=node.tcp_url, timeout=120) as http:  # type: ignore[attr-defined]
        r = http.post("/v1/run", json={"code": "print(1)", "project": "alpha"}, headers=_auth("beta"))
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text


LEAVE = r"""
import ctypes, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
for path in ('/run/lock/left', '/var/lock/left2', '/srv/drop/inner/left', '/srv/open/left', '/dev/shm/left'):
    open(path, 'w').write('left')
for path in ('/srv/mine/left', '/srv/pub.txt'):
    try:
        open(path, 'a').write('left')
        print('wrote', path)
    except PermissionError:
        pass
os.mkdir('/tmp/deep')
os.chdir('/tmp/deep')
for _ in range(2500):  # deeper than PATH_MAX (and than Python's recursion limit)
    os.mkdir('d')
    os.chdir('d')
os.mkdir('closed', 0)
# System V: a segment with a secret, its owner changed to root (its creator stays the call's uid)
shm = libc.shmget(0x5F1EEE, 4096, 0o1666)
libc.shmat.restype = ctypes.c_void_p
ctypes.memmove(libc.shmat(shm, None, 0), b'SFLEFT', 6)
buf = ctypes.create_string_buffer(256)
assert libc.shmctl(shm, 2, buf) == 0  # IPC_STAT
ctypes.c_uint32.from_buffer(buf, 4).value = 0  # shm_perm.uid
assert libc.shmctl(shm, 1, buf) == 0, ctypes.get_errno()  # IPC_SET
assert libc.mq_open(b'/sfleft', os.O_CREAT | os.O_RDWR, 0o666, None) >= 0
key = libc.syscall(248, b'user', b'sfleft', b'x', 1, -4)  # add_key into the user keyring
print('key', key, ctypes.get_errno())
if os.fork() == 0:  # a listener on an abstract socket, in a session of its own
    os.setsid()
    s = socket.socket(socket.AF_UNIX)
    s.bind('\0sfleft')
    s.listen()
    time.sleep(100)
time.sleep(0.2)
"""

CHECK = r"""
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
seen = [p for p in ('/run/lock/left', '/var/lock/left2', '/srv/drop/inner/left', '/srv/open/left', '/dev/shm/left',
                    '/srv/mine/left', '/tmp/deep') if os.path.lexists(p)]
seen += ['pub.txt: ' + open('/srv/pub.txt').read()] if open('/srv/pub.txt').read() != 'orig' else []
seen += ['shm'] if libc.shmget(0x5F1EEE, 0, 0) >= 0 or open('/proc/sysvipc/shm').read().count('\n') > 1 else []
seen += ['mq: ' + n for n in os.listdir('/dev/mqueue')]
try:
    socket.socket(socket.AF_UNIX).connect('\0sfleft')
    seen.append('abstract socket')
except ConnectionRefusedError:
    pass
print(seen)
"""


def test_what_a_call_leaves_is_gone_before_the_next(node: Daemon) -> None:
    """Files in every directory the call's uid could write (nested, reached through a symlink, made
    its own by the worker's setup, very deep), System V objects whose owner it changed, message
    queues, keys, listening sockets: the next call on the same worker finds none."""
    vol = node.root / "shared" / "vol"
    vol.mkdir()
    (vol / "theirs.txt").write_text("host")
    os.chown(vol / "theirs.txt", 61000, 61000)
    os.chmod(vol, 0o777)
    volume = Mount(source=str(vol), target="/mnt/vol", read_only=False)
    with (
        node.client(timeout=120) as fleet,
        fleet.create(backend="fncall", image="python", mounts=[volume]) as w,
    ):
        w.exec(
            "mkdir -p /srv/drop/inner /srv/open /srv/mine && chmod 1777 /srv/drop/inner && chmod 777 /srv/open"
            " && chown 61000:61000 /srv/mine && echo -n orig > /srv/pub.txt && chmod 666 /srv/pub.txt"
        )
        for _ in range(2):
            left = w.run_code(LEAVE, timeout=60)
            assert left.exit_code == 0, left
            assert "wrote" not in left.stdout  # the worker's own files are not the calls'
            assert "key -1 1\n" in left.stdout  # add_key: EPERM (seccomp)
            assert w.run_code(CHECK).stdout == "[]\n"
    # A volume is shared storage: the worker's setup leaves it as it is.
    st = (vol / "theirs.txt").stat()
    assert (st.st_uid, oct(os.stat(vol).st_mode & 0o7777)) == (61000, "0o777")


# Its processes leave the call's output pipes (so waiting for their end waits for nothing), hold
# memory and spin: dying takes them a while.
BOMB = """
import os
try:
    while True:
        if os.fork() == 0:
            os.closerange(0, 3)
            b = b'x' * (2 << 20)
            while True:
                try:
                    os.fork()
                except OSError:
                    while True:
                        pass
except OSError:
    print('limited')
"""

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


def test_a_fork_bomb_is_gone_before_the_next_call(node: Daemon) -> None:
    small = Resources(pids=64, memory="256MiB")
    with node.client(timeout=120) as fleet, fleet.create(backend="fncall", image="python", resources=small) as w:
        for _ in range(4):
            assert "limited" in w.run_code(BOMB, timeout=30).stdout
            assert w.run_code(CALLS_OF_UID).stdout == "0\n"


def test_a_call_that_says_its_own_status_early_still_ends_at_its_deadline(node: Daemon) -> None:
    """Its status pipe (fd 1023) is the call's own to write: a call that writes it early and runs
    on, or closes its output and stops itself, still ends at its timeout, and the worker's next call
    finds none of it (the supervisor kills at the deadline, not only when the call is reaped)."""
    early = "import os, time\nos.write(1023, bytes([0]))\n"
    with node.client(timeout=120) as fleet, fleet.create(backend="fncall", image="python") as w:
        for tail in ("time.sleep(1000)", "import signal; os.closerange(0, 3); os.kill(os.getpid(), signal.SIGSTOP)"):
            t0 = time.monotonic()
            w.run_code(early + tail, timeout=1)
            assert w.run_code(CALLS_OF_UID).stdout == "0\n"
            assert time.monotonic() - t0 < 10


def test_a_call_out_of_time_before_it_began_is_ended_all_the_same(node: Daemon) -> None:
    """A timeout that runs out while the call is still being handed its order (still root, not yet
    of CALL_UID: a kill then misses it): its order is cut short and it is killed until reaped, so it
    is answered as timed out at once, not left running until the daemon gives up on the worker."""
    with node.client(timeout=120) as fleet, fleet.create(backend="fncall", image="python") as w:
        for timeout in (1e-6, 1e-4, 1e-3, 1e-2):
            t0 = time.monotonic()
            r = w.run_code("import time; time.sleep(30)", timeout=timeout)
            assert r.timed_out and time.monotonic() - t0 < 3, (timeout, r)
            assert w.run_code(CALLS_OF_UID).stdout == "0\n"


HOST = "import socket; print(socket.gethostname())"
WARM = """
import os
mark = b'warm ' + b'worker'  # not in this program's own command line
parents = {}
for p in os.listdir('/proc'):
    if p.isdigit() and mark in open(f'/proc/{p}/cmdline', 'rb').read():
        parents[p] = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1]
supervisors = {p for p, parent in parents.items() if parent not in parents}
print(len(supervisors), sum(parent in supervisors for parent in parents.values()))
"""


def test_a_restarted_daemon_adopts_each_worker_into_its_projects_pool(node: Daemon) -> None:
    """The workers carry their project: after a crash of the daemon each goes back to its own
    project's pool, and the interpreter the old daemon left running in it is ended, not doubled."""
    pool = {"sandfleet.fncall-pool": "1"}
    with _client(node, "alpha") as a:
        a.run_code("print(1)")
        before = {s.id for s in a.list(labels=pool)}
    node.kill()
    node.start()
    with _client(node, "alpha") as a, _client(node, "beta") as b, node.client(timeout=120) as root:
        assert b.run_code(HOST).stdout.strip() not in before
        used = a.run_code(HOST).stdout.strip()
        assert used in before
        assert root.get(used).exec(["python3", "-c", WARM]).stdout == "1 1\n"  # its supervisor and zygote, once
