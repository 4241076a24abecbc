"""Nodes and gateways in Ray: the only module of sandfleet that imports Ray.

A node daemon runs as its own service, never as a Ray worker's child (Ray kills a dead worker's
children). What Ray holds of a node is small:
- a detached actor `node:<key>` (namespace "sandfleet") pinned to the node's Ray node: Ray keeps
  it alive exactly as long as that node is in the cluster, so its death is the node's death;
- a record `node:<key>` in Ray's key-value store (GCS): its URL and group. It outlives the actor,
  so a gateway started after a node died still answers `sandbox_lost` for that node's ids.
Gateways put `gateway:<id>` records there too (refreshed every second), which is how a trainer's
`sandfleet.ray.connect()` finds them and how gateways count each other for quota shares.

Nodes are keyed by their own key (sandfleet.ids), never by Ray node id or IP: both change when Ray
restarts on a machine, and every node of a one-machine test cluster shares one IP.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "sandfleet"
GATEWAY_TTL = 10.0  # seconds a gateway's record counts after its last refresh
REREGISTER_GRACE = 30.0  # seconds after a node's (re-)registration its missing actor is not yet its death


@ray.remote(num_cpus=0, max_restarts=0)
class NodeAgent:
    """A node's stand-in in Ray: answers liveness for the node and says where its daemon is."""

    def __init__(self, key: str, url: str, group: str, pid: int) -> None:
        self.record: dict[str, Any] = {"key": key, "url": url, "group": group, "pid": pid}
        self.pid = pid

    def info(self) -> dict[str, Any]:
        pid = self.pid
        try:
            os.kill(pid, 0)
            daemon = True
        except OSError:
            daemon = False
        return {**self.record, "daemon_running": daemon}


def connect(address: str, namespace: str = NAMESPACE) -> None:
    if not ray.is_initialized():
        ray.init(
            address=address,
            namespace=namespace,
            logging_level=logging.ERROR,
            log_to_driver=False,
            configure_logging=False,
        )


def _kv_put(key: str, value: dict[str, Any], namespace: str) -> None:
    internal_kv._internal_kv_put(key, json.dumps(value), overwrite=True, namespace=namespace)


def _kv_records(prefix: str, namespace: str) -> dict[str, dict[str, Any]]:
    out = {}
    for k in internal_kv._internal_kv_list(prefix, namespace=namespace):
        raw = internal_kv._internal_kv_get(k, namespace=namespace)
        if raw:
            name = k.decode() if isinstance(k, bytes) else k
            out[name] = json.loads(raw)
    return out


def ray_node_id(name: str | None) -> str:
    """The Ray node the node's actor lives on: the one named `name` (`ray start --node-name`; several
    Ray nodes share a machine in tests), or the one this process is connected through."""
    if name is None:
        return str(ray.get_runtime_context().get_node_id())
    for n in ray.nodes():  # type: ignore[no-untyped-call]
        if n.get("Alive") and name in (n.get("NodeName"), n.get("NodeID")):
            return str(n["NodeID"])
    raise LookupError(f"no live Ray node named {name}")


def register_node(
    key: str, url: str, group: str, pid: int, namespace: str = NAMESPACE, ray_node: str | None = None
) -> None:
    """Put a node into the cluster: its actor on its Ray node, its record in Ray's store."""
    name = f"node:{key}"
    here = ray_node_id(ray_node)
    record = {"key": key, "url": url, "group": group, "ray_node": here, "at": time.time()}
    _kv_put(name, record, namespace)  # first: watchers give a node re-registering a grace period
    try:
        old = ray.get_actor(name, namespace=namespace)
        ray.kill(old)  # a node registering again (its daemon restarted): a fresh record
        time.sleep(0.2)
    except ValueError:
        pass
    agent = NodeAgent.options(  # type: ignore[attr-defined]
        name=name,
        namespace=namespace,
        lifetime="detached",
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
    ).remote(key, url, group, pid)
    ray.get(agent.info.remote(), timeout=60)
    _kv_put(name, record | {"at": time.time()}, namespace)


def deregister_node(key: str, namespace: str = NAMESPACE) -> None:
    """Take a node out of the cluster on purpose (its ids then answer not_found, not sandbox_lost)."""
    name = f"node:{key}"
    internal_kv._internal_kv_del(name, namespace=namespace)
    try:
        ray.kill(ray.get_actor(name, namespace=namespace))
    except ValueError:
        pass


@dataclass
class Seen:
    key: str
    url: str
    group: str
    alive: bool | None  # None: no answer in time (keep what was known)


class Watcher:
    """What a gateway's watcher process reads from Ray, once per call of `poll`."""

    def __init__(self, namespace: str = NAMESPACE, timeout: float = 2.0) -> None:
        self.namespace = namespace
        self.timeout = timeout
        self._handles: dict[str, Any] = {}

    def nodes(self) -> list[Seen]:
        records = _kv_records("node:", self.namespace)
        refs: dict[Any, str] = {}
        dead: set[str] = set()
        now = time.time()
        for name, rec in records.items():
            handle = self._handles.get(name)
            if handle is None:
                try:
                    handle = self._handles[name] = ray.get_actor(name, namespace=self.namespace)
                except ValueError:  # no such actor: it died (a detached actor's name goes with it)
                    if now - float(rec.get("at", 0)) > REREGISTER_GRACE:  # not one being replaced
                        dead.add(name)
                    continue
            refs[handle.info.remote()] = name
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout) if refs else ([], [])
        answered: set[str] = set()
        for ref in ready:
            name = refs[ref]
            try:
                ray.get(ref)
                answered.add(name)
            except ray.exceptions.RayActorError:
                self._handles.pop(name, None)
                try:  # a node registering again replaces its actor: that one answers next time
                    ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    if now - float(records[name].get("at", 0)) > REREGISTER_GRACE:
                        dead.add(name)
        out = []
        for name, rec in records.items():
            alive = False if name in dead else True if name in answered else None
            out.append(Seen(rec["key"], rec["url"], rec.get("group", "default"), alive))
        return out

    def beat(self, gateway_id: str, url: str) -> None:
        _kv_put(f"gateway:{gateway_id}", {"url": url, "at": time.time()}, self.namespace)

    def gateways(self) -> list[str]:
        return gateway_urls(self.namespace)


def gateway_urls(namespace: str = NAMESPACE) -> list[str]:
    """The URLs of the gateways that refreshed their record lately."""
    now = time.time()
    recs = _kv_records("gateway:", namespace)
    return sorted({r["url"] for r in recs.values() if now - float(r.get("at", 0)) < GATEWAY_TTL})
