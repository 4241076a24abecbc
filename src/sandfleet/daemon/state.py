"""SQLite state store: sandboxes (with their runtime handles) and the per-sandbox event log.

One connection, used from one dedicated worker thread, so the event loop never blocks on disk and
SQLite never sees concurrent use. WAL mode: a crash loses at most the last unsynced transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    backend TEXT NOT NULL,
    spec TEXT NOT NULL,
    labels TEXT NOT NULL,
    runtime TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    last_active_at REAL NOT NULL,
    stopped_at REAL,
    stop_reason TEXT
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_sandbox ON events (sandbox_id, seq);
"""


@dataclass
class SandboxRow:
    id: str
    state: str
    backend: str
    spec: dict[str, Any]
    labels: dict[str, str]
    runtime: dict[str, Any]
    created_at: float
    last_active_at: float
    stopped_at: float | None
    stop_reason: str | None


def _row(r: sqlite3.Row) -> SandboxRow:
    return SandboxRow(
        id=r["id"],
        state=r["state"],
        backend=r["backend"],
        spec=json.loads(r["spec"]),
        labels=json.loads(r["labels"]),
        runtime=json.loads(r["runtime"]),
        created_at=r["created_at"],
        last_active_at=r["last_active_at"],
        stopped_at=r["stopped_at"],
        stop_reason=r["stop_reason"],
    )


class StateStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sandfleet-state")
        self._db: sqlite3.Connection | None = None
        # Group commit: operations queue here and the state thread runs all that have queued in one
        # transaction (each in a savepoint of its own), so a burst of creates costs a handful of
        # commits and thread hand-offs instead of two per sandbox.
        self._lock = threading.Lock()
        self._queue: list[tuple[Callable[[sqlite3.Connection], Any], asyncio.Future[Any]]] = []
        self._draining: asyncio.Future[None] | None = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._queue.append((fn, fut))
            start = self._draining is None
            if start:
                self._draining = loop.run_in_executor(self._pool, self._drain, loop)
        return await fut

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the state thread: run queued operations, a batch per transaction, until none are left."""
        while True:
            with self._lock:
                batch, self._queue = self._queue, []
                if not batch:
                    self._draining = None
                    return
            outcomes: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
            try:
                db = self._db
                assert db is not None
                db.execute("BEGIN")
                for fn, fut in batch:
                    db.execute("SAVEPOINT op")
                    try:
                        result = fn(db)
                        if isinstance(result, sqlite3.Cursor):
                            # A cursor must die on this thread: freeing it on the loop thread while
                            # this one uses the connection is an SQLite API misuse.
                            result.close()
                            result = None
                        db.execute("RELEASE op")
                        outcomes.append((fut, result, None))
                    except Exception as exc:  # noqa: BLE001 (one operation's failure is its caller's)
                        db.execute("ROLLBACK TO op")
                        db.execute("RELEASE op")
                        outcomes.append((fut, None, exc))
                db.execute("COMMIT")
            except BaseException as exc:  # the transaction itself failed: every operation in it did
                with contextlib.suppress(sqlite3.Error):
                    if self._db is not None and self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                outcomes = [(fut, None, exc) for _fn, fut in batch]
            for fut, result, error in outcomes:
                loop.call_soon_threadsafe(_settle, fut, result, error)

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            return db  # autocommit mode: _drain opens and commits its transactions explicitly

        self._db = await asyncio.get_running_loop().run_in_executor(self._pool, connect)

    async def close(self) -> None:
        draining = self._draining
        if draining is not None:
            await draining
        if self._db is not None:
            db = self._db
            await asyncio.get_running_loop().run_in_executor(self._pool, db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    async def insert(self, row: SandboxRow) -> None:
        await self._run(
            lambda db: db.execute(
                "INSERT INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    row.id,
                    row.state,
                    row.backend,
                    json.dumps(row.spec),
                    json.dumps(row.labels),
                    json.dumps(row.runtime),
                    row.created_at,
                    row.last_active_at,
                    row.stopped_at,
                    row.stop_reason,
                ),
            )
        )

    async def update(self, sandbox_id: str, **fields: Any) -> None:
        cols = []
        vals: list[Any] = []
        for key, value in fields.items():
            cols.append(f"{key}=?")
            vals.append(json.dumps(value) if key in ("runtime", "spec", "labels") else value)
        vals.append(sandbox_id)
        sql = f"UPDATE sandboxes SET {', '.join(cols)} WHERE id=?"
        await self._run(lambda db: db.execute(sql, vals))

    async def touch_many(self, stamps: dict[str, float]) -> None:
        if stamps:
            items = [(t, i) for i, t in stamps.items()]
            await self._run(lambda db: db.executemany("UPDATE sandboxes SET last_active_at=? WHERE id=?", items))

    async def get(self, sandbox_id: str) -> SandboxRow | None:
        def q(db: sqlite3.Connection) -> SandboxRow | None:
            r = db.execute("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
            return _row(r) if r else None

        return await self._run(q)

    async def all(self) -> list[SandboxRow]:
        return await self._run(lambda db: [_row(r) for r in db.execute("SELECT * FROM sandboxes ORDER BY created_at")])

    async def delete(self, sandbox_ids: Iterable[str]) -> None:
        ids = [(i,) for i in sandbox_ids]
        if not ids:
            return

        def q(db: sqlite3.Connection) -> None:
            db.executemany("DELETE FROM sandboxes WHERE id=?", ids)
            db.executemany("DELETE FROM events WHERE sandbox_id=?", ids)

        await self._run(q)

    async def add_events(self, events: list[tuple[str, float, str, dict[str, Any]]]) -> None:
        if events:
            rows = [(sid, t, kind, json.dumps(data)) for sid, t, kind, data in events]
            await self._run(
                lambda db: db.executemany("INSERT INTO events (sandbox_id, time, kind, data) VALUES (?,?,?,?)", rows)
            )

    async def events(self, sandbox_id: str, after: int = 0, limit: int = 1000) -> list[dict[str, Any]]:
        def q(db: sqlite3.Connection) -> list[dict[str, Any]]:
            cur = db.execute(
                "SELECT seq, sandbox_id, time, kind, data FROM events"
                " WHERE sandbox_id=? AND seq>? ORDER BY seq LIMIT ?",
                (sandbox_id, after, limit),
            )
            return [
                {
                    "seq": r["seq"],
                    "sandbox_id": r["sandbox_id"],
                    "time": r["time"],
                    "kind": r["kind"],
                    "data": json.loads(r["data"]),
                }
                for r in cur
            ]

        return await self._run(q)

    async def count_rows(self) -> dict[str, int]:
        def q(db: sqlite3.Connection) -> dict[str, int]:
            return {
                "sandboxes": db.execute("SELECT COUNT(*) FROM sandboxes").fetchone()[0],
                "events": db.execute("SELECT COUNT(*) FROM events").fetchone()[0],
            }

        return await self._run(q)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
