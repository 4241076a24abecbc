"""The service's bottom layer on its own (no root, no sandboxes): the transition table, typed errors
for a move the table forbids, per-instance state counts, stop hooks, and the event journal."""

from __future__ import annotations

import asyncio
import time
import typing
from pathlib import Path

import pytest

from sandfleet.daemon.node.lifecycle import (
    CREATING,
    FAILED,
    PAUSED,
    RUNNING,
    STOPPED,
    STOPPING,
    TRANSITIONS,
    EventJournal,
    Sandbox,
    SandboxTable,
)
from sandfleet.daemon.node.state import StateStore
from sandfleet.errors import SandboxNotFoundError, WrongStateError
from sandfleet.models import SandboxSpec, SandboxState

pytestmark = pytest.mark.unit

SPEC = SandboxSpec(image="busybox", labels={"job": "a"})


def _sandbox(sid: str, state: str = CREATING, spec: SandboxSpec = SPEC) -> Sandbox:
    now = time.time()
    return Sandbox(sid, spec, state, now, now)


def test_every_wire_state_has_a_row_and_only_those() -> None:
    assert set(TRANSITIONS) == set(typing.get_args(SandboxState))
    for targets in TRANSITIONS.values():
        assert targets <= set(TRANSITIONS)
    assert TRANSITIONS[STOPPED] == frozenset()  # terminal


def test_the_whole_life_of_a_sandbox_moves_the_counts() -> None:
    table = SandboxTable()
    sb = _sandbox("sb-1")
    table.add(sb)
    assert table.count(CREATING) == 1
    for state in (RUNNING, PAUSED, RUNNING, STOPPING, STOPPED):
        table.move(sb, state)
        assert sb.state == state
        assert table.count(state) == 1
        assert sum(table.count(s) for s in TRANSITIONS) == 1


@pytest.mark.parametrize(
    ("start", "to"), [(CREATING, PAUSED), (STOPPED, RUNNING), (STOPPING, PAUSED), (PAUSED, PAUSED)]
)
def test_a_move_the_table_forbids_is_wrong_state_and_changes_nothing(start: str, to: str) -> None:
    table = SandboxTable()
    sb = _sandbox("sb-1", start)
    table.add(sb)
    with pytest.raises(WrongStateError, match=f"sb-1 is {start}: it cannot become {to}"):
        table.move(sb, to)
    assert sb.state == start
    assert table.count(start) == 1 and table.count(to) == (1 if to == start else 0)


def test_a_stop_during_a_pause_wins() -> None:
    """The race the table closes: a pause that finishes after a stop began must not set it paused."""
    table = SandboxTable()
    sb = _sandbox("sb-1", RUNNING)
    table.add(sb)
    table.move(sb, STOPPING)  # the stop took it while the backend was freezing it
    with pytest.raises(WrongStateError):
        table.move(sb, PAUSED)
    assert sb.state == STOPPING


def test_counts_belong_to_one_table() -> None:
    """Two services in one process (two tiers, a test's second daemon) do not share their counts."""
    a, b = SandboxTable(), SandboxTable()
    x, y = _sandbox("sb-x", RUNNING), _sandbox("sb-y", RUNNING)
    a.add(x)
    b.add(y)
    a.move(x, PAUSED)
    assert (a.count(RUNNING), a.count(PAUSED)) == (0, 1)
    assert (b.count(RUNNING), b.count(PAUSED)) == (1, 0)


def test_a_sandbox_out_of_the_table_moves_without_counting() -> None:
    table = SandboxTable()
    sb = _sandbox("sb-1")
    table.add(sb)
    assert table.discard(sb) and not table.discard(sb)
    table.move(sb, FAILED)
    assert sum(table.count(s) for s in TRANSITIONS) == 0
    with pytest.raises(SandboxNotFoundError):
        table.get("sb-1")
    assert table.find("sb-1") is None


def test_add_refuses_a_duplicate_and_an_unknown_state() -> None:
    table = SandboxTable()
    table.add(_sandbox("sb-1"))
    with pytest.raises(ValueError, match="already"):
        table.add(_sandbox("sb-1"))
    with pytest.raises(ValueError, match="unknown state"):
        table.add(_sandbox("sb-2", "zombie"))


def test_stop_hooks_run_once_on_stopped_only() -> None:
    table = SandboxTable()
    seen: list[tuple[str, str]] = []
    table.on_stopped(lambda sb: seen.append((sb.id, sb.state)))
    ok, bad = _sandbox("sb-ok", RUNNING), _sandbox("sb-bad", RUNNING)
    for sb in (ok, bad):
        table.add(sb)
        table.move(sb, STOPPING)
    table.move(bad, FAILED)  # its stop failed: it may still hold processes
    table.move(ok, STOPPED)
    assert seen == [("sb-ok", STOPPED)]


def test_require_names_the_states_a_call_needs() -> None:
    sb = _sandbox("sb-1", PAUSED)
    SandboxTable.require(sb, (RUNNING, PAUSED), "exec")
    with pytest.raises(WrongStateError, match="sb-1 is paused: snapshot needs it running"):
        SandboxTable.require(sb, (RUNNING,), "snapshot")


def test_matching_by_labels_and_state() -> None:
    table = SandboxTable()
    other = SandboxSpec(image="busybox", labels={"job": "b"})
    for sid, state, spec in (("sb-1", RUNNING, SPEC), ("sb-2", PAUSED, SPEC), ("sb-3", RUNNING, other)):
        table.add(_sandbox(sid, state, spec))
    assert [sb.id for sb in table.matching({"job": "a"}, (RUNNING,))] == ["sb-1"]
    assert {sb.id for sb in table.matching({}, (RUNNING, PAUSED))} == {"sb-1", "sb-2", "sb-3"}
    assert len(table) == 3 and {sb.id for sb in table} == {"sb-1", "sb-2", "sb-3"}


def test_journal_batches_and_reads_back(tmp_path: Path) -> None:
    async def main() -> None:
        store = StateStore(tmp_path / "state.db")
        await store.open()
        try:
            journal = EventJournal(store)
            journal.record("sb-1", "created", {"image": "busybox"})
            journal.record("sb-2", "created")
            journal.record("sb-1", "stopped", {"reason": "user"})
            events = await journal.read("sb-1", 0, 10)  # reading flushes first
            assert [(e.kind, e.data) for e in events] == [
                ("created", {"image": "busybox"}),
                ("stopped", {"reason": "user"}),
            ]
            assert [e.kind for e in await journal.read("sb-1", events[0].seq, 10)] == ["stopped"]
        finally:
            await store.close()

    asyncio.run(main())
