"""The gateway's acks (cluster/acks.py) against a fake node (`httpx.MockTransport`): what a node
does not take is sent again, and nothing is kept for a node that is lost. The real thing (a node
whose connections callers hold) is tests/test_gateway.py."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from sandfleet.cluster.acks import MAX_IDS, Acks
from sandfleet.cluster.membership import Registration

pytestmark = pytest.mark.unit

KEY = "a10001"


class Node:
    """A node's ack endpoint: refuses connections while `down`, records what it took."""

    def __init__(self) -> None:
        self.down = False
        self.took: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("refused", request=request)
        self.took += httpx.Response(200, content=request.content).json()["sandboxes"]
        return httpx.Response(200, json={"ok": True})


async def _acks(node: Node, monkeypatch: pytest.MonkeyPatch) -> Acks:
    from sandfleet.cluster.membership import Membership

    membership = Membership("t")
    monkeypatch.setattr(
        Membership,
        "_client",
        lambda self, url, *_: httpx.AsyncClient(base_url=url, transport=httpx.MockTransport(node)),
    )
    membership.apply([Registration(KEY, "http://node:1")])
    return Acks(membership, gather=0.01)


async def test_an_ack_a_node_did_not_take_is_sent_again(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node()
    a = await _acks(node, monkeypatch)
    node.down = True
    await a.add([f"sb-{KEY}0000000001"])
    await asyncio.sleep(1.5)  # refused, then again a second later
    node.down = False
    await asyncio.sleep(1.5)
    assert node.took == [f"sb-{KEY}0000000001"]
    await a.close()
    await a.membership.close()


async def test_nothing_is_kept_for_a_lost_node(monkeypatch: pytest.MonkeyPatch) -> None:
    node = Node()
    a = await _acks(node, monkeypatch)
    a.membership.apply([Registration(KEY, "http://node:1", alive=False)])  # the cluster gave it up
    await a.add([f"sb-{KEY}{i:010x}" for i in range(MAX_IDS + 100)])  # more than one request holds
    await asyncio.sleep(0.5)
    assert not a._senders and not a._pending.get(KEY) and not node.took
    await a.close()
    await a.membership.close()
