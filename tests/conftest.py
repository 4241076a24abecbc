"""Shared fixtures: a real daemon (`sandfleet serve` as a subprocess, as root) and clients to it.

Every test talks to the daemon the way users do: over its unix socket through the SDK. The layer
store is shared across runs (/var/lib/sandfleet/images) so the Debian/Python images build once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import tomllib
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sandfleet import Client
from sandfleet.client.sync import Sandbox
from sandfleet.daemon.node.process import DaemonProcess, DaemonStartError
from sandfleet.errors import SandboxError

IMAGES = Path(os.environ.get("SANDFLEET_TEST_IMAGES", "/var/lib/sandfleet/images"))
CGROUP_ROOT = Path("/sys/fs/cgroup")

# -- lanes ------------------------------------------------------------------------------------------
# Every test is in one lane (a marker): `unit` (no root, seconds; marked in its module), `vm` (boots
# QEMU guests; marked), `slow` (soak, load, stress, crash-restart and deadline tests of 7 s and more
# on an idle node, image builds from scratch; marked), `browser` (a real Chromium), `cluster` (a real
# Ray cluster), `fuzz` (schemathesis), `node` (real sandboxes, as root: the rest). A plain `pytest`
# runs unit and node, the lanes a change is tried on; `--every-lane` (the README's, and CI's,
# command), any `-m`, or tests named on the command line run the rest.
AWAY_LANES = ("vm", "slow", "browser", "cluster", "fuzz")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--every-lane", action="store_true", help=f"run every lane (by default {', '.join(AWAY_LANES)} are left out)"
    )


def _lane(item: pytest.Item) -> str:
    if item.get_closest_marker("unit"):
        return "unit"
    if item.get_closest_marker("vm"):
        return "vm"
    if item.get_closest_marker("slow"):
        return "slow"
    names = set(getattr(item, "fixturenames", ()))
    if "browser" in names:
        return "browser"
    if "cluster" in names:
        return "cluster"
    if item.path.name in FUZZ_MODULES:
        return "fuzz"
    return "node"


FUZZ_MODULES = ("test_fuzz_api.py", "test_e2b_fuzz.py")  # schemathesis: sandfleet's API, the E2B layer's


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fuzz lane's module is not even collected when no fuzz test can run: schemathesis builds
    its tests (a hypothesis strategy per operation) as it collects them, seconds of every run."""
    if collection_path.name not in FUZZ_MODULES or config.getoption("every_lane"):
        return None
    if config.option.markexpr:
        try:
            from _pytest.mark.expression import Expression

            selects_fuzz = Expression.compile(config.option.markexpr).evaluate(lambda name, **kw: name == "fuzz")
        except Exception:  # noqa: BLE001 (pytest's own parser: it reports a bad expression itself)
            return None
        return None if selects_fuzz else True
    return True if not config.option.file_or_dir else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    away = []
    for item in items:
        lane = _lane(item)
        if lane not in ("unit", "vm", "slow"):
            item.add_marker(lane)
        if lane in AWAY_LANES:
            away.append(item)
    chosen = config.getoption("every_lane") or config.option.markexpr or config.option.file_or_dir
    if away and not chosen:  # tests named on the command line run whatever their lane
        config.hook.pytest_deselected(items=away)
        kept = set(map(id, away))
        items[:] = [i for i in items if id(i) not in kept]


@dataclass
class Daemon:
    root: Path
    socket: Path
    state_dir: Path
    run_dir: Path
    config: Path

    def __post_init__(self) -> None:
        self.process = DaemonProcess(["--config", str(self.config)], workdir=self.root, log=self.root / "daemon.log")

    def start(self, timeout: float = 60.0) -> None:
        self.process.start(timeout)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def cgroup_parent(self) -> str:
        """The `container.cgroup_parent` of its config, without slashes at either end."""
        cfg = tomllib.loads(self.config.read_text())
        table = cfg.get("container") or next(b for b in cfg["backends"] if b["type"] == "container")
        return str(table["cgroup_parent"]).strip("/")

    def vm_cgroup_dirs(self) -> list[Path]:
        """The cgroups of the QEMU tiers' VMs (under each VM tier's `cgroup_parent`/<tier>/)."""
        cfg = tomllib.loads(self.config.read_text())
        out = []
        for b in cfg.get("backends", []):
            if b["type"] in ("microvm", "vm"):
                parent = str(b.get("cgroup_parent", "/sandfleet-vm")).strip("/") + "/" + b["type"]
                out += [c for ctrl in Path("/sys/fs/cgroup").iterdir() if (ctrl / parent).is_dir()
                        for c in (ctrl / parent).iterdir() if c.is_dir()]  # fmt: skip
        return out

    def client(self, **kw: object) -> Client:
        return Client(self.socket, **kw)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()

    def mountinfo(self) -> str:
        return Path(f"/proc/{self.pid}/mountinfo").read_text()

    def log(self) -> str:
        return self.process.log()


def agent_pid(d: Daemon, sandbox_id: str) -> int:
    """The host pid of a sandbox's init, its agent: the process of its pids cgroup whose parent is
    outside that cgroup (the launcher's worker may still be in it for a moment after a create)."""
    hierarchy = CGROUP_ROOT / "pids" if (CGROUP_ROOT / "pids").is_dir() else CGROUP_ROOT
    members = {int(p) for p in (hierarchy / d.cgroup_parent / sandbox_id / "cgroup.procs").read_text().split()}
    for pid in members:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # exited since the cgroup was read (ESRCH): not the agent
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        if ppid not in members and stat[stat.find("(") + 1 : stat.rfind(")")] == "sandfleet-agent":
            return pid
    raise LookupError(f"no agent in the cgroup of {sandbox_id}")


def wait_until(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy or `timeout` seconds pass; whether it became truthy."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


def make_daemon(name: str, extra: str = "", *, images: Path | None = None) -> Daemon:
    """A daemon of its own in a temp dir (not started). `images`: a layer store of its own instead of
    the shared one; `extra`: more top-level config lines."""
    root = Path(tempfile.mkdtemp(prefix=f"sandfleet-{name}-"))
    os.chmod(root, 0o755)
    d = Daemon(root, root / "sandfleet.sock", root / "state", root / "run", root / "config.toml")
    (root / "shared").mkdir()
    # A cgroup parent of its own: daemons clean up unknown cgroups under their parent at start.
    d.config.write_text(
        f'socket = "{d.socket}"\nstate_dir = "{d.state_dir}"\nrun_dir = "{d.run_dir}"\n'
        f'image_dir = "{images or IMAGES}"\nstopped_retention = 0\nreaper_interval = 0.2\n'
        + extra
        + f'[container]\ncgroup_parent = "/sandfleet-test-{root.name}"\nmount_allowlist = ["{root / "shared"}"]\n'
    )
    return d


def destroy_daemon(d: Daemon) -> None:
    """Stop every sandbox through the API so nothing outlives the test run, then the daemon.

    A daemon that died during the test is started again first: it adopts its orphaned sandboxes,
    so they can be stopped the normal way instead of leaking past the session.
    """
    try:
        if d.process.started and not d.process.alive():
            d.start()
        if d.process.started:
            with d.client(timeout=120) as c:
                for s in c.list():  # live ones: running, paused (frozen, they would outlive us), ...
                    c.get(s.id).stop()
    except (SandboxError, DaemonStartError):
        pass
    finally:
        d.stop()
        _remove_cgroup_parent(d)
        shutil.rmtree(d.root, ignore_errors=True)


def _remove_cgroup_parent(d: Daemon) -> None:
    """The test's own cgroup parent, in every hierarchy: a daemon that stops cleanly removes it, one
    killed (and not started again) leaves it. A sandbox cgroup still under it is a leak: warned."""
    try:
        parent = d.cgroup_parent
    except (OSError, KeyError, StopIteration):
        return
    for top in [CGROUP_ROOT, *(c for c in CGROUP_ROOT.iterdir() if c.is_dir())]:
        where = top / parent
        if not where.is_dir():
            continue
        left = sorted(c.name for c in where.iterdir() if c.is_dir())
        if left:
            warnings.warn(f"cgroups left under {where}: {left}", stacklevel=2)
            continue
        with contextlib.suppress(OSError):
            where.rmdir()


@pytest.fixture(scope="session")
def daemon() -> Iterator[Daemon]:
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    d = make_daemon("main")
    d.start()
    yield d
    try:
        unexpected = unexpected_findings(d)
    finally:
        destroy_daemon(d)
    assert not unexpected, f"misbehaviour detectors fired during the normal test suite: {unexpected}"


EXPECT = "sandfleet.test/expect"  # label of a sandbox a test abuses on purpose: the detectors it should trip


def unexpected_findings(d: Daemon) -> list[dict[str, object]]:
    """Findings of the shared daemon's detectors on sandboxes no test meant to trip them."""
    if not d.process.started or not d.process.alive():
        return []
    with d.client(timeout=60) as c:
        recs = c.audit(kinds=["finding"], limit=10000).records
    return [
        {"sandbox": r.sandbox_id, "labels": r.labels, **r.data}
        for r in recs
        if str(r.data.get("detector")) not in (r.labels or {}).get(EXPECT, "").split(",")
    ]


@pytest.fixture
def fleet(daemon: Daemon) -> Iterator[Client]:
    with daemon.client() as c:
        yield c


@pytest.fixture
def sandbox(fleet: Client) -> Iterator[object]:
    with fleet.create(image="busybox", idle_ttl=300) as sb:
        yield sb


@pytest.fixture
def own_daemon() -> Iterator[Daemon]:
    """A daemon of the test's own, for tests that kill or restart it."""
    if os.geteuid() != 0:
        pytest.skip("the container tier needs root")
    d = make_daemon("own")
    yield d
    destroy_daemon(d)


# -- an HTTP server in a sandbox, on an exposed port --------------------------------------------------

HTTP_SERVER = """
import http.server, sys
class H(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        for line in open("/srv/headers.txt").read().splitlines():
            k, _, v = line.partition(": ")
            if k:
                self.send_header(k, v)
        super().end_headers()
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(repr(sorted(self.headers.items())).encode() + b"\\n" + body)
    do_PUT = do_PATCH = do_DELETE = do_POST
    def do_GET(self):
        if self.path.startswith("/echo"):
            return self.do_POST()
        return super().do_GET()
http.server.test(HandlerClass=H, port=int(sys.argv[1]), bind="127.0.0.1")
"""


def serve_http(sb: Sandbox, port: int, page: str, headers: str = "") -> None:
    """Start an HTTP server on `port` of `sb` (a `python` image sandbox): /srv as it is (`page` its
    index.html), /srv/headers.txt's lines (`Name: value`, read at each request) on every answer, and
    /echo* answering the request's headers and body; then expose the port."""
    sb.files.write("/srv/index.html", page.encode())
    sb.files.write("/srv/headers.txt", headers.encode())
    sb.files.write("/opt/server.py", HTTP_SERVER.encode())
    sb.start(f"cd /srv && exec python3 /opt/server.py {port}")
    sb.expose(port)
    up = f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/index.html', timeout=5)"
    assert wait_until(lambda: sb.exec(["python3", "-c", up]).exit_code == 0, 30)
