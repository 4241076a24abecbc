"""Running a gateway: its HTTP server, its reads of node loads, and its discovery of nodes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import sys

import uvicorn

from sandfleet.cluster.config import GatewayConfig
from sandfleet.cluster.gateway import Gateway, create_gateway_app
from sandfleet.cluster.membership import Registration
from sandfleet.collector import Collector

log = logging.getLogger("sandfleet.cluster")


async def watch_ray(gw: Gateway, config: GatewayConfig, gateway_id: str) -> None:
    """Membership from Ray, through a watcher child process restarted whenever it exits."""
    assert config.ray_address is not None
    while True:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sandfleet.cluster.watcher",
            "--address",
            config.ray_address,
            "--namespace",
            config.ray_namespace,
            "--gateway-id",
            gateway_id,
            "--gateway-url",
            config.url,
            "--lost-after",
            str(config.lost_after),
            stdout=asyncio.subprocess.PIPE,
            limit=16 * 1024**2,
        )
        try:
            assert proc.stdout is not None
            async for line in proc.stdout:
                try:
                    seen = json.loads(line)
                except ValueError:
                    continue
                gw.membership.apply(
                    Registration(n["key"], n["url"], n.get("group", "default"), n.get("alive"), n.get("generation", 0))
                    for n in seen.get("nodes", [])
                )
                gw.membership.gateways = list(seen.get("gateways", []))
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            await proc.wait()
        log.warning("Ray watcher exited (%s): serving on the membership known, retrying", proc.returncode)
        await asyncio.sleep(2.0)


async def serve_gateway(config: GatewayConfig, *, ready: asyncio.Event | None = None) -> None:
    gw = Gateway(config)
    gateway_id = secrets.token_hex(4)
    if config.nodes:
        gw.membership.apply(Registration(n.key, n.url, n.group, True) for n in config.nodes)
        gw.membership.gateways = [config.url]
    host, _, port = config.listen.rpartition(":")
    server = uvicorn.Server(
        uvicorn.Config(
            create_gateway_app(gw),
            host=host or "127.0.0.1",
            port=int(port),
            log_level="warning",
            lifespan="off",
            access_log=False,
            timeout_keep_alive=300,
            ws="wsproto",  # the WebSocket implementation the dependencies pin (terminals relayed)
        )
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    collector = Collector(loop)  # full collections scan what is new, not every table's objects
    collector.install()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(gw.membership.run()), tg.create_task(gw.run_placement_updates())]
            if config.ray_address:
                tasks.append(tg.create_task(watch_ray(gw, config, gateway_id)))
            await gw.membership.refresh()
            gw.refresh_placement()
            serving = tg.create_task(server.serve())
            if ready is not None:
                ready.set()
            await stop.wait()
            server.should_exit = True
            await serving
            for t in tasks:
                t.cancel()
    finally:
        collector.uninstall()
        await gw.acks.close()  # creates answered, not yet acknowledged to their nodes
        await gw.membership.close()
