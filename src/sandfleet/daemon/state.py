"""SQLite state store: sandboxes (with their runtime handles) and the per-sandbox event log.

One connection, used from one dedicated worker thread, so the event loop never blocks on disk and
SQLite never sees concurrent use. WAL mode: a crash loses at most the last unsynced transaction.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
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

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            assert self._db is not None
            with self._db:
                result = fn(self._db)
            if isinstance(result, sqlite3.Cursor):
                # A cursor must die on this thread: freeing it on the loop thread while this one
                # uses the connection is an SQLite API misuse.
                result.close()
                return None  # type: ignore[return-value]
            return result

        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    async def open(self) -> None:
        def connect() -> sqlite3.Connection:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            db.row_factory = sqlite3.Row
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.executescript(SCHEMA)
            db.isolation_level = "DEFERRED"  # implicit transactions again, committed by `with db`
            return db

        self._db = await asyncio.get_running_loop().run_in_executor(self._pool, connect)

    async def close(self) -> None:
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
