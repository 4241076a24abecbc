"""`sandfleet serve`: process setup, then the API on a unix socket (and optionally TCP).

Order matters: private mount namespace and subreaper status first (before any thread exists, since
unshare(CLONE_NEWNS) needs a single-threaded process), then state, backend and manager, then the
listeners. SIGTERM/SIGINT stop the daemon but never the sandboxes: a restarted daemon adopts them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import resource
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from sandfleet.backends.base import TierBackend
from sandfleet.backends.tiers import build_backend
from sandfleet.client import AsyncClient
from sandfleet.collector import Collector
from sandfleet.daemon.api import create_app
from sandfleet.daemon.config import DaemonConfig
from sandfleet.daemon.node.admission import Admission, AdmissionPolicy
from sandfleet.daemon.node.lifecycle import new_sandbox_id
from sandfleet.daemon.node.metrics import Metrics
from sandfleet.daemon.node.pool import WarmPools
from sandfleet.daemon.node.state import StateError, StateStore
from sandfleet.daemon.security.audit import AuditLog
from sandfleet.daemon.security.iam import ROOT, Iam
from sandfleet.daemon.security.tenancy import Tenancy
from sandfleet.daemon.service import SandboxManager
from sandfleet.ids import is_node_key, new_node_key
from sandfleet.images import LayerStore
from sandfleet.runtime import cgroups, mounts, proc, swap

log = logging.getLogger("sandfleet.daemon")


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: the daemon owns SIGTERM/SIGINT for all listeners."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def prepare_process(config: DaemonConfig) -> None:
    if os.geteuid() != 0:
        raise SystemExit("sandfleet serve must run as root (it creates namespaces, mounts and cgroups)")
    hybrid = cgroups.detect() == "hybrid" and config.container.runtime == "crun"
    cgroup2 = cgroups.root_options()  # as the host has them: the namespace may hide cgroup2
    mounts.enter_private_namespace(hide_hybrid_cgroup2=hybrid)
    if config.cgroup_favordynmods and not cgroups.favor_moves(cgroup2):
        log.warning(
            "cgroup2's root could not be given favordynmods (%s): a create after an idle spell may wait ~10 ms longer",
            "no cgroup2 mount in view" if cgroup2 is None else "Linux < 6.0, or not the host's cgroup namespace",
        )
    proc.become_subreaper()
    _raise_file_max()
    # One channel fd per sandbox (plus transient ones): lift the soft limit to the hard one.
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


KSM = Path("/sys/kernel/mm/ksm")
# ksmd's own tuning (kernel >= 6.8): aim at a full scan of mergeable memory every 30 s, never above
# a quarter of a core; older kernels get a fixed rate instead.
KSM_SETTINGS = (("advisor_mode", "scan-time"), ("advisor_target_scan_time", "30"), ("advisor_max_cpu", "25"),
                ("smart_scan", "1"), ("run", "1"))  # fmt: skip
KSM_FALLBACK = (("pages_to_scan", "1000"), ("sleep_millisecs", "20"), ("run", "1"))


def enable_ksm() -> bool:
    """Start the kernel's same-page merging. Only memory that asks for it is scanned: restored
    sandboxes (the launcher marks criu's tree with PR_SET_MEMORY_MERGE), so fresh ones cost nothing."""
    settings = KSM_SETTINGS if (KSM / "advisor_mode").exists() else KSM_FALLBACK
    try:
        for name, value in settings:
            (KSM / name).write_text(value)
    except OSError as exc:
        log.warning("KSM is not available (forked sandboxes will not share memory): %s", exc)
        return False
    return True


def _raise_file_max() -> None:
    """Make memory, not the host's file table, what bounds the files sandboxes keep open: every open
    file is charged to its sandbox's memory cgroup (~200 bytes), so file-max is raised (never
    lowered) to one file per 256 bytes of RAM, as systemd hosts do (they set it to the maximum)."""
    want = _mem_total() // 256
    path = "/proc/sys/fs/file-max"
    try:
        with open(path) as f:
            current = int(f.read())
        if current < want:
            with open(path, "w") as f:
                f.write(str(want))
            log.info("fs.file-max raised from %d to %d", current, want)
    except (OSError, ValueError) as exc:
        log.warning("could not raise fs.file-max: %s", exc)


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def _unix_listener(path: Path) -> socket.socket:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is root's alone: mode 0600 from the moment it exists
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(1024)
    return sock


def _tcp_listener(addr: str) -> socket.socket:
    host, _, port = addr.rpartition(":")
    sock = socket.create_server((host or "127.0.0.1", int(port)), backlog=1024, reuse_port=False)
    # Accepted sockets inherit it. asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP,
    # and these report 0: without it an answer's body waited on the client's delayed ACK of its
    # headers, 40 ms on every call over TCP.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def load_node_key(state_dir: Path) -> str:
    """The node's key, made on its first start and kept: ids made before a restart still name it."""
    path = state_dir / "node_key"
    try:
        key = path.read_text().strip()
        if is_node_key(key):
            return key
    except FileNotFoundError:
        pass
    key = new_node_key()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(key + "\n")
    os.replace(tmp, path)
    return key


async def serve(config: DaemonConfig, *, ready_file: Path | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT. Call `prepare_process` first."""
    config.state_dir.mkdir(parents=True, exist_ok=True)
    config.run_dir.mkdir(parents=True, exist_ok=True)
    state = StateStore(config.state_dir / "state.db")
    try:
        await state.open()
    except StateError as exc:
        raise SystemExit(f"sandfleet: cannot open the state database {state.path}: {exc}") from exc
    store = LayerStore(
        config.images_root,
        uid_base=config.container.uid_base,
        shared=config.shared_image_dir,
        cache_max=config.image_cache_max,
    )
    built: dict[str, TierBackend] = {}
    for tier in sorted(config.backends, key=lambda t: t.type == "fncall"):  # fncall shares the container tier's
        built[tier.type] = build_backend(
            tier, state_dir=config.state_dir, run_dir=config.run_dir, store=store, built=built
        )
    backends = [built[tier.type] for tier in config.backends]
    for backend in backends:
        await backend.start()
    if config.ksm:
        await asyncio.to_thread(enable_ksm)
    zram = config.zram_size if config.zram_size is not None else _mem_total() // 4
    try:
        log.info("%s", await asyncio.to_thread(swap.ensure_compressed_swap, zram))
    except (OSError, swap.SwapSetupError) as exc:
        log.warning("no compressed swap (paused sandboxes keep their anonymous memory): %s", exc)
    metrics = Metrics()
    node_key = config.node_key
    if node_key is None:
        node_key = await asyncio.to_thread(load_node_key, config.state_dir)
    admission = Admission(
        AdmissionPolicy(
            max_sandboxes=config.max_sandboxes,
            cpu_overcommit=config.cpu_overcommit,
            max_cpu_load=config.max_cpu_load,
            memory_overcommit=config.memory_overcommit,
            min_available_memory=config.min_available_memory,
            max_task_fraction=config.max_task_fraction,
        )
    )
    manager = SandboxManager(
        backends=backends,
        store=store,
        state=state,
        metrics=metrics,
        admission=admission,
        stopped_retention=config.stopped_retention,
        reaper_interval=config.reaper_interval,
        build_missing_images=config.build_missing_images,
        snapshot_dir=config.snapshot_dir or config.state_dir / "snapshots",
        snapshot_retention=config.snapshot_retention,
        snapshot_max_bytes=config.snapshot_max_bytes,
        checkpoint_standbys=config.checkpoint_standbys,
        import_dirs=config.import_dirs,
        client_factory=functools.partial(AsyncClient, config.socket),  # recipe builds' own sandboxes
        network=config.network,
        detectors=config.detectors,
        audit=AuditLog(config.audit.dir or config.state_dir / "audit", max_bytes=config.audit.max_bytes)
        if config.audit.enabled
        else None,
        run_dir=config.run_dir,
        monitor_interval=config.monitor_interval,
        trajectories=config.trajectories,
        trajectory_dir=config.state_dir / "trajectories",
        verify=config.verify,
        node_key=node_key,
        node_group=config.node_group,
        node_labels=config.node_labels,
        job_label=config.jobs.label,
        alerts=config.jobs.alerts,
        metrics_per_sandbox=config.metrics_per_sandbox,
    )
    manager.core.claim_window = config.claim_window
    await manager.fencing.load()  # the generation it serves under (cluster mode)
    if config.pools or config.pool_adaptive_max:
        manager.pools = WarmPools(
            backend=backends[0],  # warm pools hold sandboxes of the default tier
            admission=admission,
            resolve_environment=manager.resolve_environment,
            new_id=functools.partial(new_sandbox_id, node_key),
            sandbox_count=manager.node_count,
            configured=config.pools,
            adaptive_max=config.pool_adaptive_max,
            refill_concurrency=config.pool_refill_concurrency,
        )
    servers: list[tuple[_Server, socket.socket]] = []
    # ws: the WebSocket implementation the dependencies pin (wsproto), whatever else is installed
    ucfg = {"log_level": "warning", "lifespan": "off", "access_log": False, "timeout_keep_alive": 300, "ws": "wsproto"}
    uds = _unix_listener(config.socket)
    iam = Iam(config.iam, config.token)
    socket_auth = None
    # Projects or scoped tokens: each request sees its principal's share of the node.
    tenancy = Tenancy(manager, iam if iam.scoped else None)
    manager.alerts.quotas = tenancy.quota_uses
    if iam.scoped:
        socket_auth = functools.partial(iam.enter, anonymous=ROOT)  # no header on root's socket: root
    app = create_app(manager, tenancy, metrics, auth=socket_auth)
    servers.append((_Server(uvicorn.Config(app, **ucfg)), uds))  # type: ignore[arg-type]
    if config.tcp:
        tcp = _tcp_listener(config.tcp)
        app = create_app(manager, tenancy, metrics, auth=iam.enter)
        servers.append((_Server(uvicorn.Config(app, **ucfg)), tcp))  # type: ignore[arg-type]

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    collector = Collector(loop)  # full collections scan what is new, not every sandbox's objects
    collector.install()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The runtime's detached helpers exit a moment after `crun run` returns; reap them as they go
    # rather than leaving zombies until the next sweep.
    loop.add_signal_handler(signal.SIGCHLD, proc.reap_orphans)
    # A burst of exits (stop_many of thousands) fills the loop's wakeup pipe: that only coalesces
    # wakeups, so it must not print a traceback per signal.
    signal.set_wakeup_fd(signal.set_wakeup_fd(-1), warn_on_full_buffer=False)

    async def run_servers() -> None:
        async with asyncio.TaskGroup() as tg:
            for server, sock in servers:
                tg.create_task(server.serve(sockets=[sock]))
            if ready_file is not None:
                ready_file.write_text(str(os.getpid()))  # noqa: ASYNC240 (a few bytes, once)
            await stop.wait()
            for server, _sock in servers:
                server.should_exit = True

    try:
        await manager.run(run_servers)
    finally:
        collector.uninstall()
        for _server, sock in servers:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            config.socket.unlink()
        for backend in backends:
            await backend.close()
        await state.close()
