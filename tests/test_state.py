"""The SQLite state store on its own: new columns and their migration, idempotency keys, typed
errors on a full disk (a real, small tmpfs), and a damaged database set aside at open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sqlite3
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from sandfleet.daemon.node.state import (
    SandboxRow,
    StateConflictError,
    StateDiskFullError,
    StateError,
    StateStorageError,
    StateStore,
)

pytestmark = pytest.mark.unit

# The schema before idempotency keys, acks and holds (what an existing node has on disk).
OLD_SCHEMA = """
CREATE TABLE sandboxes (
    id TEXT PRIMARY KEY, state TEXT NOT NULL, backend TEXT NOT NULL, spec TEXT NOT NULL,
    labels TEXT NOT NULL, runtime TEXT NOT NULL DEFAULT '{}', created_at REAL NOT NULL,
    last_active_at REAL NOT NULL, stopped_at REAL, stop_reason TEXT
);
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, sandbox_id TEXT NOT NULL, time REAL NOT NULL,
    kind TEXT NOT NULL, data TEXT NOT NULL
);
CREATE INDEX events_by_sandbox ON events (sandbox_id, seq);
"""


def row(sandbox_id: str, *, spec_bytes: int = 10, **kw: object) -> SandboxRow:
    now = time.time()
    return SandboxRow(
        sandbox_id, "running", "container", {"image": "busybox", "pad": "x" * spec_bytes}, {"job": "t"}, {"pid": 1},
        now, now, None, None, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


@contextlib.asynccontextmanager
async def opened(path: Path) -> AsyncIterator[StateStore]:
    store = StateStore(path)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


# --------------------------------------------------------------------------- columns, keys, migration


async def test_new_columns_round_trip_and_survive_a_restart(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    async with opened(db) as store:
        assert store.reset_from is None and store.reset_reason is None
        await store.insert(row("sb-plain"))  # the old constructor: defaults for the new fields
        await store.insert(row("sb-keyed", idempotency_key="k-1", acked=False))
        plain = await store.get("sb-plain")
        assert plain is not None and (plain.idempotency_key, plain.acked, plain.held) == (None, True, False)
        keyed = await store.by_idempotency_key("k-1")
        assert keyed is not None and keyed.id == "sb-keyed" and not keyed.acked
        assert await store.by_idempotency_key("k-2") is None
        # Unique where set; any number of rows without a key.
        with pytest.raises(StateConflictError):
            await store.insert(row("sb-other", idempotency_key="k-1"))
        with pytest.raises(StateConflictError):
            await store.insert(row("sb-plain"))
        await store.insert(row("sb-plain-2"))
        await store.set_acked(["sb-keyed"])
        await store.update("sb-plain", held=True, state="paused")
        with pytest.raises(ValueError, match="no such sandbox column"):
            await store.update("sb-plain", **{"state=state; --": 1})
    async with opened(db) as store:
        rows = {r.id: r for r in await store.all()}
        assert set(rows) == {"sb-plain", "sb-keyed", "sb-plain-2"}
        assert rows["sb-plain"].held and rows["sb-plain"].state == "paused"
        assert rows["sb-keyed"].acked and rows["sb-keyed"].idempotency_key == "k-1"
        await store.delete(["sb-keyed"])
        assert await store.by_idempotency_key("k-1") is None  # the key goes with its row


async def test_an_old_database_is_migrated_in_place(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.executescript(OLD_SCHEMA)
        con.execute(
            "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?)",
            ("sb-old", "running", "container", "{}", "{}", "{}", 1.0, 2.0, None, None),
        )
        con.execute("INSERT INTO events (sandbox_id, time, kind, data) VALUES ('sb-old', 1.0, 'created', '{}')")
        con.commit()
    async with opened(db) as store:
        assert store.reset_from is None
        old = await store.get("sb-old")
        assert old is not None and (old.idempotency_key, old.acked, old.held) == (None, True, False)
        assert [e["kind"] for e in await store.events("sb-old")] == ["created"]
        await store.insert(row("sb-new", idempotency_key="k", acked=False, held=True))
        await store.update("sb-old", held=True)
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == 3
        assert con.execute("SELECT id, acked, held FROM sandboxes ORDER BY id").fetchall() == [
            ("sb-new", 0, 1),
            ("sb-old", 1, 1),
        ]
        with pytest.raises(sqlite3.IntegrityError):
            con.execute("INSERT INTO sandboxes (id, state, backend, spec, labels, created_at, last_active_at,"
                        " idempotency_key) VALUES ('x', 's', 'b', '{}', '{}', 0, 0, 'k')")  # fmt: skip
    async with opened(db) as store:  # a second open finds nothing to migrate
        assert len(await store.all()) == 2


async def test_idempotency_keys_are_per_project_and_keep_their_fingerprint(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    async with opened(db) as store:
        await store.insert(row("sb-a", idempotency_key="k", project="acme/a", idempotency_fingerprint="fp-a"))
        await store.insert(row("sb-b", idempotency_key="k", project="acme/b", idempotency_fingerprint="fp-b"))
        await store.insert(row("sb-none", idempotency_key="k"))  # no project: a namespace of its own
        with pytest.raises(StateConflictError):  # within a project, a key is still unique
            await store.insert(row("sb-a2", idempotency_key="k", project="acme/a"))
        with pytest.raises(StateConflictError):
            await store.insert(row("sb-none2", idempotency_key="k"))
    async with opened(db) as store:
        for project, sandbox_id, fingerprint in (("acme/a", "sb-a", "fp-a"), ("acme/b", "sb-b", "fp-b")):
            got = await store.by_idempotency_key("k", project)
            assert got is not None and (got.id, got.project, got.idempotency_fingerprint) == (
                sandbox_id,
                project,
                fingerprint,
            )
        none = await store.by_idempotency_key("k")
        assert none is not None and none.id == "sb-none" and none.project is None
        assert await store.by_idempotency_key("k", "acme/c") is None


async def test_a_schema_2_database_gets_keys_per_project(tmp_path: Path) -> None:
    """Schema 2 had one key namespace (a unique index on the key) and a table of batch keys nothing
    read: the migration fills each row's project from its spec and drops that table."""
    db = tmp_path / "state.db"
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.executescript(
            OLD_SCHEMA
            + """
            ALTER TABLE sandboxes ADD COLUMN idempotency_key TEXT;
            ALTER TABLE sandboxes ADD COLUMN acked INTEGER NOT NULL DEFAULT 1;
            ALTER TABLE sandboxes ADD COLUMN held INTEGER NOT NULL DEFAULT 0;
            CREATE UNIQUE INDEX sandboxes_by_idempotency_key ON sandboxes (idempotency_key)
                WHERE idempotency_key IS NOT NULL;
            CREATE TABLE idempotency_batches (key TEXT PRIMARY KEY, kind TEXT NOT NULL, created_at REAL NOT NULL,
                sandbox_ids TEXT NOT NULL, result TEXT);
            CREATE INDEX idempotency_batches_by_time ON idempotency_batches (created_at);
            PRAGMA user_version=2;
            """
        )
        spec = json.dumps({"image": "busybox", "project": "acme/a"})
        con.execute(
            "INSERT INTO sandboxes (id, state, backend, spec, labels, created_at, last_active_at, idempotency_key)"
            " VALUES ('sb-old', 'running', 'container', ?, '{}', 1, 1, 'trajectory:t-1')",
            (spec,),
        )
        con.execute("INSERT INTO idempotency_batches VALUES ('fork-1', 'fork', 1.0, '[\"sb-old\"]', NULL)")
        con.commit()
    async with opened(db) as store:
        assert store.reset_from is None
        old = await store.by_idempotency_key("trajectory:t-1", "acme/a")
        assert old is not None and old.id == "sb-old" and old.idempotency_fingerprint is None
        assert await store.by_idempotency_key("trajectory:t-1", "acme/b") is None
        # Another project's sandbox may now carry the same key.
        await store.insert(row("sb-new", idempotency_key="trajectory:t-1", project="acme/b"))
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == 3
        indexes = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='index'")}
        assert "sandboxes_by_idempotency_key" not in indexes and "sandboxes_by_project_key" in indexes
        assert con.execute("SELECT name FROM sqlite_master WHERE name='idempotency_batches'").fetchone() is None
    async with opened(db) as store:  # a second open finds nothing to migrate
        assert len(await store.all()) == 2


# --------------------------------------------------------------------------- a full disk


@contextlib.contextmanager
def small_tmpfs(size: str) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = Path(tempfile.mkdtemp(prefix="sandfleet-state-full-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "sandfleet-test", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)
        where.rmdir()


def fill(directory: Path) -> Path:
    """Write a file until the filesystem is full; return it."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
    assert os.statvfs(directory).f_bfree == 0
    return filler


async def test_a_full_state_disk_is_a_typed_error_and_heals_when_space_is_freed() -> None:
    with small_tmpfs("2m") as mnt:
        db = mnt / "state.db"
        async with opened(db) as store:
            for i in range(5):
                await store.insert(row(f"sb-{i}"))
            filler = fill(mnt)
            # Each write of a group commit fails alike, typed; nothing of them is written.
            results = await asyncio.gather(
                *(store.insert(row(f"sb-big-{i}", spec_bytes=50_000)) for i in range(10)),
                store.add_events([("sb-0", time.time(), "exec", {"pad": "y" * 200_000})]),
                return_exceptions=True,
            )
            assert results and all(isinstance(r, StateDiskFullError) for r in results), results
            assert store.full  # (a create then waits for its row before launching anything)
            assert all(isinstance(r, StateError) and not isinstance(r, StateStorageError) for r in results)
            with pytest.raises(StateDiskFullError, match="full"):
                await store.insert(row("sb-big-x", spec_bytes=300_000))
            # Reads still work, and show only what was committed.
            assert (await store.count_rows())["sandboxes"] == 5
            assert (await store.get("sb-3")) is not None
            filler.unlink()
            await asyncio.gather(*(store.insert(row(f"sb-big-{i}", spec_bytes=50_000)) for i in range(10)))
            await store.update("sb-0", held=True)
            assert (await store.count_rows())["sandboxes"] == 15 and not store.full
        async with opened(db) as store:  # nothing was damaged by it
            assert store.reset_from is None
            assert len(await store.all()) == 15
            assert (await store.get("sb-0")) is not None and (await store.get("sb-0")).held  # type: ignore[union-attr]


async def test_opening_on_a_full_disk_is_a_typed_error_and_leaves_nothing_that_looks_damaged() -> None:
    with small_tmpfs("1m") as mnt:
        filler = fill(mnt)
        store = StateStore(mnt / "state.db")
        with pytest.raises(StateDiskFullError):
            await store.open()
        await store.close()
        assert sorted(p.name for p in mnt.iterdir()) == ["filler"]
        filler.unlink()
        async with opened(mnt / "state.db") as store:
            assert store.reset_from is None  # a fresh database, not a "damaged" empty one
            await store.insert(row("sb-1"))


# --------------------------------------------------------------------------- a damaged database


async def _populated(db: Path, n: int = 300) -> None:
    async with opened(db) as store:
        for i in range(n):
            await store.insert(row(f"sb-{i:04d}", spec_bytes=1500, idempotency_key=f"k-{i}"))
        await store.add_events([(f"sb-{i:04d}", 1.0, "created", {}) for i in range(n)])


def _aside(db: Path) -> list[Path]:
    return sorted(p for p in db.parent.iterdir() if p.name.startswith(db.name + ".corrupt-"))


async def _assert_reset(db: Path, reason: str) -> StateStore:
    store = StateStore(db)
    await store.open()
    try:
        assert store.reset_from is not None and store.reset_from in _aside(db)
        assert store.reset_from.name.startswith("state.db.corrupt-")
        assert int(store.reset_from.name.removeprefix("state.db.corrupt-")) == pytest.approx(time.time(), abs=60)
        assert store.reset_reason is not None and reason in store.reset_reason, store.reset_reason
        # A fresh, working database in its place.
        assert await store.all() == []
        await store.insert(row("sb-fresh", idempotency_key="k-0"))
        assert (await store.by_idempotency_key("k-0")) is not None
    except BaseException:
        await store.close()
        raise
    return store


async def test_garbage_in_the_database_file_is_set_aside(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    garbage = os.urandom(64 * 1024)
    db.write_bytes(garbage)
    store = await _assert_reset(db, "not a database")
    await store.close()
    assert store.reset_from is not None and store.reset_from.read_bytes() == garbage  # kept, as it was
    async with opened(db) as again:  # and the fresh one is fine next time
        assert again.reset_from is None and [r.id for r in await again.all()] == ["sb-fresh"]


async def test_a_truncated_database_is_set_aside_with_its_wal(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    await _populated(db)
    size = db.stat().st_size
    os.truncate(db, size // 2)
    store = await _assert_reset(db, "malformed")
    await store.close()
    assert store.reset_from is not None and store.reset_from.stat().st_size == size // 2
    assert len(_aside(db)) >= 1


async def test_a_damaged_page_is_set_aside_and_the_rows_before_it_are_salvaged(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    await _populated(db)
    fd = os.open(db, os.O_WRONLY)  # one page of the table in the middle overwritten
    try:
        os.pwrite(fd, os.urandom(4096), 40 * 4096)
    finally:
        os.close(fd)
    store = await _assert_reset(db, "malformed")
    await store.close()
    ids = [r.id for r in store.salvaged]
    assert 0 < len(ids) < 300 and len(set(ids)) == len(ids)
    assert all(r.spec["image"] == "busybox" for r in store.salvaged)


async def test_an_empty_database_file_is_reported_as_lost(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    await _populated(db, 3)
    os.truncate(db, 0)
    store = await _assert_reset(db, "empty")
    await store.close()


async def test_a_foreign_schema_is_set_aside(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("CREATE TABLE sandboxes (id TEXT PRIMARY KEY, whatever BLOB)")
        con.execute("INSERT INTO sandboxes VALUES ('sb-x', x'00')")
        con.commit()
    store = await _assert_reset(db, "schema")
    await store.close()


async def test_an_undecodable_row_is_damage_and_the_rest_is_salvaged(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    await _populated(db, 5)
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("UPDATE sandboxes SET spec='{not json' WHERE id='sb-0002'")
        con.commit()
    store = await _assert_reset(db, "sb-0002")
    await store.close()
    # Rows that still decode are handed to the caller (it decides what to make of them).
    assert sorted(r.id for r in store.salvaged) == ["sb-0000", "sb-0001", "sb-0003", "sb-0004"]
    assert {r.idempotency_key for r in store.salvaged} == {"k-0", "k-1", "k-3", "k-4"}
    assert json.loads(json.dumps(store.salvaged[0].spec))["image"] == "busybox"


async def test_a_database_that_cannot_be_opened_is_not_mistaken_for_damage(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    db.mkdir()  # not a file at all: an operator's mistake, not damage to set aside
    store = StateStore(db)
    with pytest.raises(StateStorageError):
        await store.open()
    await store.close()
    assert db.is_dir() and _aside(db) == []
