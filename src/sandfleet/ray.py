"""Finding a sandfleet cluster from inside Ray: `fleet = sandfleet.ray.connect()`.

A trainer (verl, SkyRL, OpenRLHF, ...) runs as a Ray driver or in Ray tasks and actors: the cluster's
gateways register in that same Ray cluster, so no address needs passing around. Calls then go to a
gateway over HTTP, never through Ray; the client knows every gateway registered, and moves on to
another when its gateway fails.
"""

from __future__ import annotations

import os
import random

from sandfleet.client import AsyncClient, Client
from sandfleet.errors import UnavailableError

NAMESPACE = "sandfleet"


def gateways(namespace: str = NAMESPACE, address: str | None = None) -> list[str]:
    """The URLs of the gateways registered in the Ray cluster this process is connected to (or joins
    at `address`, default: the one `ray.init()` finds)."""
    import ray

    from sandfleet.cluster import registry

    if not ray.is_initialized():
        registry.connect(address or os.environ.get("RAY_ADDRESS", "auto"), namespace)
    return registry.gateway_urls(namespace)


def _shuffled(namespace: str, address: str | None) -> list[str]:
    urls = gateways(namespace, address)
    if not urls:
        raise UnavailableError("no sandfleet gateway is registered in this Ray cluster (sandfleet gateway ...)")
    random.shuffle(urls)  # spreads a trainer's workers over the gateways; the others are its fail-overs
    return urls


def connect(
    *, token: str | None = None, namespace: str = NAMESPACE, address: str | None = None, timeout: float = 60.0
) -> Client:
    """A `Client` of the cluster through its gateways (token: `SANDFLEET_TOKEN` by default): calls go
    to one, and move on to the next when it fails (docs/cluster.md, "Membership and failure")."""
    return Client(url=_shuffled(namespace, address), token=token, timeout=timeout)


def connect_async(
    *, token: str | None = None, namespace: str = NAMESPACE, address: str | None = None, timeout: float = 60.0
) -> AsyncClient:
    """The same as `connect`, an `AsyncClient`."""
    return AsyncClient(url=_shuffled(namespace, address), token=token, timeout=timeout)
