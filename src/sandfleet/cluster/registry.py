"""Nodes and gateways in Ray: the only module of sandfleet that imports Ray.

A node daemon runs as its own service, never as a Ray worker's child (Ray kills a dead worker's
children). What Ray holds of a node is small:
- a detached actor `node:<key>` (namespace "sandfleet") pinned to the node's Ray node: Ray keeps
  it alive exactly as long as that node is in the cluster, so its death is the node's death. It also
  asks its daemon, from the node's own machine, whether it answers HTTP: a daemon that died (or
  hangs) while its Ray node lives on is given up on after the gateways' `lost_after`, as a dead node
  is (otherwise a trajectory it might hold would keep every new one of that id from opening);
- a record `node:<key>` in Ray's key-value store (GCS): its URL, group and generation. It outlives
  the actor, so a gateway started after a node died still answers `sandbox_lost` for that node's ids;
- a mark `lost:<key>` (the generation given up on), written by a gateway's watcher before any
  gateway answers `sandbox_lost` for the node: a node registering again after that is fenced first
  (daemon/node/fencing.py: it stops what it held) and joins under a higher generation.
Gateways put `gateway:<id>` records there too (refreshed every second), which is how a trainer's
`sandfleet.ray.connect()` finds them and how gateways count each other for quota shares.

Nodes are keyed by their own key (sandfleet.ids), never by Ray node id or IP: both change when Ray
restarts on a machine, and every node of a one-machine test cluster shares one IP.
"""

from __future__ import annotations

import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

log = logging.getLogger("sandfleet.cluster")

NAMESPACE = "sandfleet"
GATEWAY_TTL = 10.0  # seconds a gateway's record counts after its last refresh
REREGISTER_GRACE = 30.0  # seconds after a node's (re-)registration its missing actor is not yet its death


PROBE_EVERY = 1.0  # seconds between a node actor's questions to its daemon
PROBE_TIMEOUT = 2.0


def answers(url: str) -> bool:
    """Whether an HTTP server answers at `url` (any status: an unauthenticated 401 proves the
    daemon's event loop runs; a dead daemon refuses, a hung one says nothing). Never through a proxy
    of the environment: a proxy's answer would hide a dead daemon."""
    context = ssl._create_unverified_context()  # any answer will do, whoever signed it
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(url.rstrip("/") + "/v1/health", timeout=PROBE_TIMEOUT):
            return True
    except urllib.error.HTTPError:
        return True
    except Exception:  # noqa: BLE001 (refused, timed out, a reply that is no HTTP: no answer)
        return False


@ray.remote(num_cpus=0, max_restarts=0)
class NodeAgent:
    """A node's stand-in in Ray: answers liveness for the node, says where its daemon is, and for
    how long that daemon has not answered (asked every PROBE_EVERY seconds on a thread of its own,
    so `info` answers at once)."""

    def __init__(self, key: str, url: str, group: str, pid: int, probe: str | None = None) -> None:
        self.record: dict[str, Any] = {"key": key, "url": url, "group": group, "pid": pid}
        self.probe = probe or url  # the daemon's own address on this machine (the URL may be a NAT's)
        self.answered = time.monotonic()
        threading.Thread(target=self._probe, daemon=True).start()

    def _probe(self) -> None:
        while True:
            if answers(self.probe):
                self.answered = time.monotonic()
            time.sleep(PROBE_EVERY)

    def info(self) -> dict[str, Any]:
        return {**self.record, "silent_for": time.monotonic() - self.answered}


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


def _kv_get(key: str, namespace: str) -> dict[str, Any] | None:
    raw = internal_kv._internal_kv_get(key, namespace=namespace)
    return json.loads(raw) if raw else None


def standing(key: str, namespace: str = NAMESPACE) -> tuple[int, int | None]:
    """The generation the cluster records for node `key` (0: none yet), and the generation a
    watcher declared lost (None: never). A lost mark at or above the recorded generation means the
    cluster gave up on what the node holds: it must be fenced before it joins again."""
    record = _kv_get(f"node:{key}", namespace) or {}
    mark = _kv_get(f"lost:{key}", namespace)
    return int(record.get("generation", 0)), (int(mark["generation"]) if mark else None)


def register_node(
    key: str,
    url: str,
    group: str,
    pid: int,
    namespace: str = NAMESPACE,
    ray_node: str | None = None,
    generation: int = 0,
    probe: str | None = None,
) -> None:
    """Put a node into the cluster under `generation`: its actor on its Ray node, its record in Ray's
    store (fencing first is the caller's: `sandfleet cluster up`). `probe`: where the actor asks the
    daemon whether it answers (its own address on that machine; default `url`)."""
    name = f"node:{key}"
    here = ray_node_id(ray_node)
    record = {"key": key, "url": url, "group": group, "ray_node": here, "at": time.time(), "generation": generation}
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
    ).remote(key, url, group, pid, probe)
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
    generation: int = 0


class Watcher:
    """What a gateway's watcher process reads from Ray, once per call of `poll`. A node is dead when
    its actor is (its Ray node left), or when the actor says its daemon has not answered for
    `lost_after` seconds; either way the lost mark is written first, and a node with a lost mark at
    or above its recorded generation stays dead until it registers again (fenced) above it."""

    def __init__(self, namespace: str = NAMESPACE, timeout: float = 2.0, lost_after: float = 60.0) -> None:
        self.namespace = namespace
        self.timeout = timeout
        self.lost_after = lost_after
        self._handles: dict[str, Any] = {}
        self._marked: set[tuple[str, int]] = set()  # lost marks this watcher wrote

    def nodes(self) -> list[Seen]:
        records = _kv_records("node:", self.namespace)
        marks = _kv_records("lost:", self.namespace)
        refs: dict[Any, str] = {}
        dead: set[str] = set()
        now = time.time()
        for name in records:
            handle = self._handles.get(name)
            if handle is None:
                try:
                    handle = self._handles[name] = ray.get_actor(name, namespace=self.namespace)
                except ValueError:  # no such actor: it died (a detached actor's name goes with it)
                    if self._gone(name, now):  # not one being replaced
                        dead.add(name)
                    continue
            refs[handle.info.remote()] = name
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.timeout) if refs else ([], [])
        answered: set[str] = set()
        for ref in ready:
            name = refs[ref]
            try:
                info = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._handles.pop(name, None)
                try:  # a node registering again replaces its actor: that one answers next time
                    ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    if self._gone(name, now):
                        dead.add(name)
                continue
            if float(info.get("silent_for", 0.0)) > self.lost_after and self._gone(name, now):
                log.warning("node %s: its daemon has not answered for %.0f s: lost", name, info["silent_for"])
                dead.add(name)
            else:
                answered.add(name)
        out = []
        for name, rec in records.items():
            generation = int(rec.get("generation", 0))
            mark = marks.get("lost:" + str(rec["key"]))
            if mark is not None and int(mark.get("generation", -1)) >= generation:
                dead.add(name)  # given up on: dead until it registers again, fenced, above the mark
            alive = False if name in dead else True if name in answered else None
            out.append(Seen(rec["key"], rec["url"], rec.get("group", "default"), alive, generation))
        return out

    def _gone(self, name: str, now: float) -> bool:
        """Whether the node whose actor is missing (or whose daemon is silent) is lost: its record
        (read again now: a node registering again writes it first) is older than the grace. If so,
        the lost mark is written before anyone is told: what callers hear is `sandbox_lost` is never
        served again."""
        rec = _kv_get(name, self.namespace)
        if rec is None or now - float(rec.get("at", 0)) <= REREGISTER_GRACE:
            return False
        mark = (rec["key"], int(rec.get("generation", 0)))
        if mark not in self._marked:
            _kv_put(f"lost:{mark[0]}", {"generation": mark[1], "at": now}, self.namespace)
            self._marked.add(mark)
        return True

    def beat(self, gateway_id: str, url: str) -> None:
        _kv_put(f"gateway:{gateway_id}", {"url": url, "at": time.time()}, self.namespace)

    def gateways(self) -> list[str]:
        return gateway_urls(self.namespace)


def gateway_urls(namespace: str = NAMESPACE) -> list[str]:
    """The URLs of the gateways that refreshed their record lately."""
    now = time.time()
    recs = _kv_records("gateway:", namespace)
    return sorted({r["url"] for r in recs.values() if now - float(r.get("at", 0)) < GATEWAY_TTL})
