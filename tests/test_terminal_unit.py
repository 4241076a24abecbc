"""Terminals and list pages without root: the SDK's I/O-free pieces, the shared page cutter, and the
WebSocket route end to end on the fake tier (whose agent has no terminals: a typed refusal)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import httpx
import pytest
from httpx_ws import aconnect_ws
from httpx_ws.transport import ASGIWebSocketTransport

from sandfleet.client import _base as b
from sandfleet.errors import InvalidArgumentError, PermissionDeniedError
from sandfleet.models import ExecRequest, SandboxList, TerminalRequest, list_page
from sandfleet.testing import InProcessNode

pytestmark = pytest.mark.unit


def test_credentials_come_from_the_header_or_a_browsers_subprotocol() -> None:
    assert b.terminal_credentials([], "Bearer abc") == "Bearer abc"
    token = "tok/with+odd=chars"
    proto = b.TERMINAL_BEARER + base64.urlsafe_b64encode(token.encode()).decode().rstrip("=")
    assert b.terminal_credentials(["sandfleet.terminal", proto], "Bearer other") == f"Bearer {token}"
    assert b.terminal_credentials([b.TERMINAL_BEARER + "%%%"], "") == "Bearer \0"  # refused like a wrong token
    assert b.terminal_credentials(["sandfleet.terminal"], "") == ""


def test_terminal_requests_are_checked_before_connecting() -> None:
    start = json.loads(b.terminal_start("vim", b.CommandOptions(timeout=None), rows=50, cols=160))
    assert start == {"type": "start", "command": "vim", "rows": 50, "cols": 160, "timeout": None}
    for bad in ({"rows": 0}, {"cols": 1001}, {"timeout": -1}, {"output_limit": 2 * 1024**3}):
        fields = {"rows": 24, "cols": 80, "timeout": None, "output_limit": None} | bad
        options = b.CommandOptions(timeout=fields.pop("timeout"), output_limit=fields.pop("output_limit"))
        with pytest.raises(InvalidArgumentError):
            b.terminal_start("sh", options, **fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        b.terminal_resize(0, 80)
    # a terminal runs the login shell by default, on a pty, with no deadline and a large cap
    req = TerminalRequest().exec_request()
    assert req.pty is not None and (req.pty.rows, req.pty.cols) == (24, 80)
    assert req.timeout is None and isinstance(req.command, list)
    assert ExecRequest(command="ls", pty={"rows": 5, "cols": 9}).pty.cols == 9  # type: ignore[arg-type, union-attr]


def test_the_daemons_messages_become_results_or_typed_errors() -> None:
    with pytest.raises(PermissionDeniedError, match="read-only"):
        b.terminal_message(
            json.dumps(
                {
                    "type": "error",
                    "error": {"code": "permission_denied", "message": "token r is read-only", "retryable": False},
                }
            )
        )
    msg = b.terminal_message('{"type": "exit", "result": {"exit_code": 3, "stdout": "", "stderr": "", "duration": 1}}')
    assert b.terminal_result(msg).exit_code == 3
    with pytest.raises(Exception, match="malformed"):
        b.terminal_message("[1, 2]")


def test_list_pages_are_newest_first_and_survive_a_removed_cursor() -> None:
    items = [(float(i), f"sb-{i:02d}") for i in range(10)]
    stamp = lambda it: it  # noqa: E731
    page, cursor, total = list_page(items, 4, None, stamp)
    assert [i for _, i in page] == ["sb-09", "sb-08", "sb-07", "sb-06"] and total == 10 and cursor
    rest = [it for it in items if it[1] != "sb-06"]  # the cursor's own item is gone
    page2, cursor2, total2 = list_page(rest, 4, cursor, stamp)
    assert [i for _, i in page2] == ["sb-05", "sb-04", "sb-03", "sb-02"] and total2 == 9
    page3, cursor3, _ = list_page(rest, 4, cursor2, stamp)
    assert [i for _, i in page3] == ["sb-01", "sb-00"] and cursor3 is None
    # same created_at: the id breaks the tie, so no item is skipped or repeated
    ties = [(1.0, f"sb-{c}") for c in "abcdef"]
    seen, after = [], None
    while True:
        part, after, _ = list_page(ties, 4, after, stamp)
        seen += [i for _, i in part]
        if after is None:
            break
    assert sorted(seen) == sorted(i for _, i in ties) and len(seen) == len(set(seen))
    with pytest.raises(ValueError, match="not a cursor"):
        list_page(items, 4, "yesterday:sb-1", stamp)


async def test_routes_on_the_fake_tier(tmp_path: Path) -> None:
    async with InProcessNode(tmp_path) as node, node.client() as fleet:
        made = [await fleet.create(image="busybox", labels={"job": "p"}) for _ in range(5)]
        raw = fleet._http
        page = SandboxList.model_validate_json((await raw.get("/v1/sandboxes", params={"limit": 2})).content)
        assert page.total == 5 and len(page.sandboxes) == 2 and page.next
        ids = [s.id for s in page.sandboxes]
        while page.next:
            page = SandboxList.model_validate_json(
                (await raw.get("/v1/sandboxes", params={"limit": 2, "after": page.next})).content
            )
            ids += [s.id for s in page.sandboxes]
        assert sorted(ids) == sorted(s.id for s in made) and len(ids) == 5
        bad = await raw.get("/v1/sandboxes", params={"limit": 2, "after": "x:y"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        assert (await raw.get("/v1/sandboxes")).json().keys() == {"sandboxes"}  # without limit: as before
        who = (await raw.get("/v1/whoami")).json()
        assert who["can_write"] is True
        # a plain GET of the terminal is a typed 400; the WebSocket reaches the agent, which refuses
        plain = await raw.get(f"/v1/sandboxes/{made[0].id}/terminal")
        assert plain.status_code == 400 and "WebSocket" in plain.json()["error"]["message"]
        transport = ASGIWebSocketTransport(app=node.app)  # the SDK's in-process transport has no WebSockets
        async with transport, httpx.AsyncClient(transport=transport, base_url="http://in-process") as ws_client:
            async with aconnect_ws(f"/v1/sandboxes/{made[0].id}/terminal", ws_client) as ws:
                await ws.send_text('{"type": "start", "command": "sh"}')
                msg = json.loads(await ws.receive_text(timeout=10))
            assert msg["error"]["code"] == "unsupported" and "real tier" in msg["error"]["message"], msg
        assert (await made[0].exec("echo still")).stdout == "still\n"


async def test_jobs_are_counted_by_label_value_and_state(tmp_path: Path) -> None:
    async with InProcessNode(tmp_path) as node, node.client() as fleet:
        made = [await fleet.create(image="busybox", labels={"job": f"j{i % 2}", "team": "a"}) for i in range(5)]
        plain = await fleet.create(image="busybox")
        await made[0].pause()
        jobs = await fleet.jobs()
        assert jobs.total == 6 and [(j.value, j.count) for j in jobs.jobs] == [("j0", 3), ("j1", 2), (None, 1)]
        assert jobs.jobs[0].states == {"paused": 1, "running": 2}
        assert [(j.value, j.count) for j in (await fleet.jobs("team", labels={"job": "j1"})).jobs] == [("a", 2)]
        bad = await fleet._http.get("/v1/jobs", params={"key": "no spaces"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_argument"
        await plain.stop()
