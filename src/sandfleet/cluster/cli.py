"""`sandfleet cluster up|down|nodes|drain` and `sandfleet gateway`: cluster mode from the command line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

cluster_app = typer.Typer(help="Cluster mode on Ray: put this machine's node in, take it out, look.")

AddressOpt = Annotated[str, typer.Option("--address", envvar="RAY_ADDRESS", help="the Ray cluster (HEAD:PORT)")]
ConfigOpt = Annotated[Path, typer.Option("--config", help="the node daemon's TOML config")]


def _node_url(cfg_tcp: str | None, url: str | None) -> str:
    if url:
        return url
    if not cfg_tcp:
        raise typer.BadParameter("a cluster node listens on TCP: set `tcp` (and a token) in its config, or --url")
    host, _, port = cfg_tcp.rpartition(":")
    if host in ("", "0.0.0.0", "::"):
        raise typer.BadParameter(f"the node listens on {cfg_tcp}: say which address gateways reach it at (--url)")
    return f"http://{host}:{port}"


def _local_url(cfg_tcp: str | None, node_url: str) -> str:
    """Where this machine reaches its own daemon (the node actor's liveness probe): its listener, on
    loopback when it listens on every address; else the URL gateways use."""
    if not cfg_tcp:
        return node_url
    host, _, port = cfg_tcp.rpartition(":")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "[::1]"
    return f"http://{host}:{port}"


@cluster_app.command("up")
def up(
    address: AddressOpt,
    config: ConfigOpt,
    url: Annotated[str | None, typer.Option(help="the URL gateways reach this node at")] = None,
    namespace: Annotated[str, typer.Option(help="Ray namespace")] = "sandfleet",
    wait: Annotated[float, typer.Option(help="seconds to wait for the daemon")] = 120.0,
    ray_node: Annotated[
        str | None, typer.Option(help="the Ray node (name or id) to pin the node's actor to; default: this one")
    ] = None,
) -> None:
    """Start this machine's node daemon (as a service of its own, outside Ray's process tree) unless it
    runs, then register it with the Ray cluster at ADDRESS."""
    from sandfleet.client import Client
    from sandfleet.cluster import registry
    from sandfleet.daemon.config import DaemonConfig
    from sandfleet.errors import SandboxError

    cfg = DaemonConfig.load(config)
    node_url = _node_url(cfg.tcp, url)
    pid: int | None = None
    try:
        with Client(cfg.socket, timeout=5) as c:
            c.health()
        pid_file = cfg.state_dir / "daemon.pid"
        pid = int(pid_file.read_text()) if pid_file.exists() else None
    except (SandboxError, OSError, ValueError):
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(cfg.state_dir / "daemon.log", "ab")  # noqa: SIM115 (the daemon keeps it)
        ready = cfg.state_dir / "daemon.pid"
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [sys.executable, "-m", "sandfleet", "serve", "--config", str(config), "--ready-file", str(ready)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # its own session: no signal or hangup of ours reaches it
        )
        deadline = time.monotonic() + wait
        while not ready.exists():
            if proc.poll() is not None:
                typer.echo(f"the node daemon exited ({proc.returncode}): see {cfg.state_dir / 'daemon.log'}", err=True)
                raise typer.Exit(1) from None
            if time.monotonic() > deadline:
                typer.echo("the node daemon did not come up in time", err=True)
                raise typer.Exit(1) from None
            time.sleep(0.1)
        pid = proc.pid
    registry.connect(address, namespace)
    with Client(cfg.socket, timeout=30) as c:
        load = c.node_load()
        # A lost mark at or above the recorded generation: the cluster told callers what this node
        # held is lost. It is fenced (stops all it holds) under a higher generation before it joins;
        # again if a watcher marked it lost while it was registering (it read the old record).
        for _ in range(3):
            recorded, lost = registry.standing(load.key, namespace)
            generation = max(recorded, load.generation)
            if lost is not None and lost >= recorded:
                generation = max(generation, lost + 1)
            if generation > load.generation:
                load = c.fence(generation)
            registry.register_node(
                load.key, node_url, load.group, pid or 0, namespace, ray_node, generation, _local_url(cfg.tcp, node_url)
            )
            lost = registry.standing(load.key, namespace)[1]
            if lost is None or lost < generation:
                break
    typer.echo(
        json.dumps({"node": load.key, "url": node_url, "group": load.group, "pid": pid, "generation": generation})
    )


@cluster_app.command("down")
def down(
    address: AddressOpt,
    config: ConfigOpt,
    namespace: Annotated[str, typer.Option(help="Ray namespace")] = "sandfleet",
    stop_daemon: Annotated[bool, typer.Option(help="also stop the node daemon")] = True,
) -> None:
    """Take this machine's node out of the cluster (drain it first to let its work finish)."""
    from sandfleet.client import Client
    from sandfleet.cluster import registry
    from sandfleet.daemon.config import DaemonConfig

    cfg = DaemonConfig.load(config)
    with Client(cfg.socket, timeout=30) as c:
        key = c.node_load().key
    registry.connect(address, namespace)
    registry.deregister_node(key, namespace)
    pid_file = cfg.state_dir / "daemon.pid"
    if stop_daemon and pid_file.exists():
        try:
            os.kill(int(pid_file.read_text()), signal.SIGTERM)
        except (ProcessLookupError, ValueError):
            pass
    typer.echo(json.dumps({"node": key, "removed": True}))


def gateway(
    config: Annotated[Path, typer.Option("--config", help="the gateway's TOML config")],
) -> None:
    """Run a cluster gateway: the node's API over every node of the cluster."""
    import logging

    from sandfleet.cluster.config import load_gateway_config
    from sandfleet.cluster.server import serve_gateway

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per node call otherwise
    try:
        cfg = load_gateway_config(config)
    except (ValueError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from exc
    typer.echo(f"sandfleet gateway listening on {cfg.listen}")
    asyncio.run(serve_gateway(cfg))
