"""Acknowledging creates to their nodes once the gateway's caller has the answer.

A node stops a sandbox whose create was never acknowledged after its `claim_window`: that is how a
create whose caller never got the id (a gateway or client that died mid-way) is reaped instead of
living until its TTL. A node acknowledges a create itself once its answer went out, except one a
gateway passed on (`x-sandfleet-forwarded`): that answer reached the gateway, not the caller. The
gateway acknowledges those here, after its own answer went out (a response's background task):
per node, ids gathered for GATHER seconds and sent in one `POST /v1/sandboxes/ack`, one such request
in flight per node (the ones that come meanwhile go in the next), on the node's control client (a
node whose connections are all held by callers' long calls still takes its acks). Gathering keeps
the cost low (a gateway placing hundreds of creates a second over many nodes sends a few acks per
node a second, not one per create); its price: a sandbox whose answer went out in the GATHER seconds
before the gateway died is acknowledged only by its caller's first call naming it. An ack the node
does not take is sent again, a second apart, for RETRY_FOR seconds (a daemon restarting), well
within a node's default claim window.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable

from sandfleet.cluster.forward import CONTROL_TIMEOUT, call_json
from sandfleet.cluster.membership import Membership
from sandfleet.errors import SandboxError
from sandfleet.ids import node_of

log = logging.getLogger("sandfleet.cluster")

FORWARDED = "x-sandfleet-forwarded"  # on a create passed on to a node: the gateway acknowledges it
GATHER = 0.25  # seconds ids wait for others to the same node
RETRY_FOR = 60.0  # seconds an ack a node does not take is sent again (1 s apart), then dropped
MAX_IDS = 1024  # per request (the node's limit)


class Acks:
    def __init__(self, membership: Membership, *, gather: float = GATHER) -> None:
        self.membership = membership
        self.gather = gather
        self._pending: dict[str, set[str]] = collections.defaultdict(set)
        self._senders: dict[str, asyncio.Task[None]] = {}
        self._closing = False  # a gateway stopping: what a node does not take now is not sent again

    async def add(self, sandbox_ids: Iterable[str]) -> None:
        """These sandboxes' create answers went out to the caller: acknowledge them to their nodes
        (soon: this returns at once)."""
        for sandbox_id in sandbox_ids:
            key = node_of(sandbox_id)
            if key is None:
                continue
            self._pending[key].add(sandbox_id)
            if key not in self._senders:
                self._senders[key] = asyncio.get_running_loop().create_task(self._send(key))

    async def _send(self, key: str) -> None:
        failing_since: float | None = None
        try:
            while self._pending.get(key):  # nothing comes between the last check and the end: no await
                await asyncio.sleep(self.gather if failing_since is None else 1.0)
                node = self.membership.nodes.get(key)
                if node is None or node.lost:
                    self._pending.pop(key, None)  # what it held is gone with it
                    return
                ids = sorted(self._pending.pop(key, set()))
                if len(ids) > MAX_IDS:  # the rest go in the next
                    ids, rest = ids[:MAX_IDS], ids[MAX_IDS:]
                    self._pending[key].update(rest)
                try:
                    body = {"sandboxes": ids}
                    await call_json(
                        node, "POST", "/v1/sandboxes/ack", json_body=body, timeout=CONTROL_TIMEOUT, control=True
                    )
                    failing_since = None
                except SandboxError as exc:
                    failing_since = failing_since or time.monotonic()
                    again = exc.retryable or exc.code == "internal"  # not the node refusing the request itself
                    if again and not self._closing and time.monotonic() - failing_since < RETRY_FOR:
                        self._pending[key].update(ids)
                    else:
                        log.error("node %s took no acks of %d creates (%s): it will reap them", key, len(ids), exc)
                        failing_since = None
        finally:
            self._senders.pop(key, None)

    async def close(self) -> None:
        """Send what is pending (a gateway stopping on purpose)."""
        self._closing = True
        while self._senders:
            await asyncio.gather(*self._senders.values(), return_exceptions=True)
