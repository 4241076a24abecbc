"""SQLite state store: sandboxes (with their runtime handles, idempotency keys and request
fingerprints) and the per-sandbox event log.

One connection, used from one dedicated worker thread, so the event loop never blocks on disk and
SQLite never sees concurrent use. WAL mode: a crash loses at most the last unsynced transaction.

Failures are typed (all `StateError`): `StateDiskFullError` when the state directory's filesystem
is full, `StateConflictError` when a uniqueness constraint refuses a write (a taken sandbox id or
idempotency key), `StateCorruptError` when SQLite finds the file damaged while running, and
`StateStorageError` for any other failure of the storage. An operation that raised wrote nothing.

`open()` checks the database (it opens, `PRAGMA quick_check`, the schema, every sandbox row
decodes). A damaged file is moved aside as ``state.db.corrupt-<unix time>`` (with its -wal and
-shm) and a fresh database is started; `reset_from` and `reset_reason` then say so, and `salvaged`
holds the sandbox rows that could still be read from the damaged file (best effort).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

SCHEMA_VERSION = 3

# Tables as a fresh database gets them. Databases made before a column existed get it from
# `_ADDED_COLUMNS` (ALTER TABLE ADD COLUMN) when opened; indexes on such columns come after that.
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
    stop_reason TEXT,
    idempotency_key TEXT,
    acked INTEGER NOT NULL DEFAULT 1,
    held INTEGER NOT NULL DEFAULT 0,
    project TEXT,
    idempotency_fingerprint TEXT
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    sandbox_id TEXT NOT NULL,
    time REAL NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL
);
-- Batch keys were kept here until schema 3 (never read), children's keys (`key#i`) are in their rows.
DROP TABLE IF EXISTS idempotency_batches;
"""
INDEXES = """
CREATE INDEX IF NOT EXISTS events_by_sandbox ON events (sandbox_id, seq);
DROP INDEX IF EXISTS sandboxes_by_idempotency_key;
CREATE UNIQUE INDEX IF NOT EXISTS sandboxes_by_project_key ON sandboxes (COALESCE(project, ''), idempotency_key)
    WHERE idempotency_key IS NOT NULL;
"""
_BASE_COLUMNS = {
    "sandboxes": (
        "id", "state", "backend", "spec", "labels", "runtime", "created_at", "last_active_at", "stopped_at",
        "stop_reason",
    ),
    "events": ("seq", "sandbox_id", "time", "kind", "data"),
}  # fmt: skip
_ADDED_COLUMNS = (
    ("idempotency_key", "TEXT"),
    ("acked", "INTEGER NOT NULL DEFAULT 1"),
    ("held", "INTEGER NOT NULL DEFAULT 0"),
    ("project", "TEXT"),  # the spec's, as a column: idempotency keys are unique per project
    ("idempotency_fingerprint", "TEXT"),
)
SANDBOX_COLUMNS = _BASE_COLUMNS["sandboxes"] + tuple(name for name, _ in _ADDED_COLUMNS)
_JSON_COLUMNS = ("spec", "labels", "runtime")
_BOOL_COLUMNS = ("acked", "held")

# The filesystem counts as full below this much free space (SQLite writes pages of 4 KiB, and
# grows the WAL index by 32 KiB): an I/O error then is the full disk's doing.
_FULL_BELOW = 1024**2

# SQLite primary result codes (sqlite3.h) the store tells apart.
_SQLITE_ERROR, _SQLITE_IOERR, _SQLITE_CORRUPT, _SQLITE_FULL, _SQLITE_CANTOPEN, _SQLITE_NOTADB = 1, 10, 11, 13, 14, 26


# --------------------------------------------------------------------------- errors


class StateError(Exception):
    """The state store failed. `__cause__` is the sqlite3 or OS error underneath."""


class StateDiskFullError(StateError):
    """The state directory's filesystem is full (SQLITE_FULL, ENOSPC, EDQUOT, or an I/O error with no
    space left). Nothing of the failed operation was written; reads still work, and writes work
    again once space is freed."""


class StateStorageError(StateError):
    """Any other failure of the state's storage: an I/O error, a read-only or locked database, a
    file that cannot be opened."""


class StateCorruptError(StateStorageError):
    """SQLite found the database file damaged while running (the next `open()` sets it aside)."""


class StateConflictError(StateError):
    """A uniqueness constraint refused the write: the sandbox id or idempotency key is taken."""


def _disk_full(path: Path) -> bool:
    """Whether the filesystem holding `path` has (almost) no space or no inodes left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    free = st.f_bfree if os.geteuid() == 0 else st.f_bavail  # root may use the reserved blocks
    return free * st.f_frsize < _FULL_BELOW or (st.f_files > 0 and st.f_ffree == 0)


def _sqlite_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def classify_error(exc: BaseException, path: Path) -> BaseException:
    """The `StateError` for a storage failure (sqlite3 or OS error) of the database at `path`;
    anything else (a bug, a cancellation) is returned as it is."""
    if isinstance(exc, StateError):
        return exc
    if isinstance(exc, sqlite3.IntegrityError):
        return _chain(StateConflictError(str(exc)), exc)
    if isinstance(exc, sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return exc  # a misuse of the API (a bug), not the storage failing
    if isinstance(exc, sqlite3.Error):
        code = _sqlite_code(exc)
        name = getattr(exc, "sqlite_errorname", None) or "sqlite error"
        message = f"state database {path}: {exc} ({name})"
        if code == _SQLITE_FULL or (code is None and "disk is full" in str(exc)):
            return _chain(StateDiskFullError(message), exc)
        if code in (_SQLITE_IOERR, _SQLITE_CANTOPEN) and _disk_full(path.parent):
            return _chain(StateDiskFullError(message + ": no space left on the state filesystem"), exc)
        if code in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
            return _chain(StateCorruptError(message), exc)
        return _chain(StateStorageError(message), exc)
    if isinstance(exc, OSError):
        message = f"state database {path}: {exc}"
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return _chain(StateDiskFullError(message), exc)
        return _chain(StateStorageError(message), exc)
    return exc


def _chain(new: StateError, cause: BaseException) -> StateError:
    new.__cause__ = cause
    return new


class _Damaged(Exception):
    """open(): the database file is damaged (reason in args[0]); it is set aside."""


class _TransactionLost(Exception):
    """_drain(): SQLite rolled the whole transaction back after an operation failed."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


# --------------------------------------------------------------------------- rows


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
    # The create request's idempotency key (unique among the rows of its project), if it had one.
    idempotency_key: str | None = None
    # False while the answer to the create has not been handed to its client.
    acked: bool = True
    # Paused on request (not by the idle policy): survives restarts.
    held: bool = False
    # The spec's project (None: none): the namespace of its idempotency key.
    project: str | None = None
    # What the keyed request was (its fingerprint): a retry after a restart is checked against it.
    # None for rows made before it was kept.
    idempotency_fingerprint: str | None = None


def _row(r: sqlite3.Row) -> SandboxRow:
    keys = r.keys()  # (columns added since the first schema may be absent: `_salvage` reads old files)
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
        idempotency_key=r["idempotency_key"] if "idempotency_key" in keys else None,
        acked=bool(r["acked"]) if "acked" in keys else True,
        held=bool(r["held"]) if "held" in keys else False,
        project=r["project"] if "project" in keys else None,
        idempotency_fingerprint=r["idempotency_fingerprint"] if "idempotency_fingerprint" in keys else None,
    )


def _db_value(key: str, value: Any) -> Any:
    if key in _JSON_COLUMNS:
        return json.dumps(value)
    if key in _BOOL_COLUMNS:
        return int(bool(value))
    return value


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
        self.full = False  # the last batch found the disk full (creates wait for their rows; any success clears it)
        # Set by open() when it found the database damaged and started a fresh one: where the
        # damaged file went, why, and the sandbox rows that could still be read from it.
        self.reset_from: Path | None = None
        self.reset_reason: str | None = None
        self.salvaged: list[SandboxRow] = []

    def _run(self, fn: Callable[[sqlite3.Connection], T]) -> asyncio.Future[T]:
        """Queue `fn` for the state thread now, in call order with every other operation; its outcome."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        with self._lock:
            self._queue.append((fn, fut))
            if self._draining is None:
                self._draining = loop.run_in_executor(self._pool, self._drain, loop)
        return fut

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
                if db.in_transaction:  # left open by a failure whose ROLLBACK failed too
                    db.execute("ROLLBACK")
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
                        if not db.in_transaction:
                            # SQLite rolled the whole transaction back (a full disk, an I/O error):
                            # the operations before this one are undone too.
                            raise _TransactionLost(exc) from exc
                        db.execute("ROLLBACK TO op")
                        db.execute("RELEASE op")
                        outcomes.append((fut, None, classify_error(exc, self.path)))
                db.execute("COMMIT")
            except BaseException as exc:  # the transaction itself failed: every operation in it did
                with contextlib.suppress(sqlite3.Error):
                    if self._db is not None and self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                cause = exc.cause if isinstance(exc, _TransactionLost) else exc
                failure = classify_error(cause, self.path)
                outcomes = [(fut, None, failure) for _fn, fut in batch]
            self.full = any(isinstance(error, StateDiskFullError) for _f, _r, error in outcomes)
            for fut, result, error in outcomes:
                loop.call_soon_threadsafe(_settle, fut, result, error)

    # ------------------------------------------------------------------ open, checks, reset

    async def open(self) -> None:
        """Open (creating or migrating) the database. A damaged one is set aside and replaced by a
        fresh one (see `reset_from`); other failures raise `StateError`."""
        self._db = await asyncio.get_running_loop().run_in_executor(self._pool, self._open_sync)

    def _open_sync(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            existed = self.path.exists()
            try:
                return self._connect_checked()
            except _Damaged as damage:
                reason = str(damage)
            except BaseException:
                if not existed:  # a file this attempt made (empty): it must not look damaged next time
                    for suffix in ("", "-wal", "-shm", "-journal"):
                        with contextlib.suppress(OSError):
                            os.unlink(f"{self.path}{suffix}")
                raise
            aside = self._set_aside()
            self.reset_from, self.reset_reason = aside, reason
            self.salvaged = _salvage(aside)
            log.error(
                "state database %s is damaged (%s): moved aside to %s, starting a fresh one (%d sandbox rows "
                "could be read from the damaged file)",
                self.path,
                reason,
                aside,
                len(self.salvaged),
            )
            try:
                return self._connect_checked()
            except _Damaged as damage:  # a fresh file cannot be damaged: the storage is at fault
                raise StateStorageError(
                    f"state database {self.path}: a fresh database fails its check: {damage}"
                ) from damage
        except (sqlite3.Error, OSError) as exc:
            raise classify_error(exc, self.path) from exc

    def _connect_checked(self) -> sqlite3.Connection:
        """Connect, check and migrate; raises _Damaged for a damaged file, sqlite3/OS errors otherwise."""
        wal = self.path.with_name(self.path.name + "-wal")
        with contextlib.suppress(FileNotFoundError):
            if self.path.stat().st_size == 0 and not (wal.exists() and wal.stat().st_size > 0):
                # sqlite would take it for a new database; but a database this store made is never
                # empty, so its content was lost (a crash of the filesystem, a truncation).
                raise _Damaged("the database file is empty (0 bytes)")
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                problems = [str(r[0]) for r in db.execute("PRAGMA quick_check(20)")]
                if problems != ["ok"]:
                    raise _Damaged("quick_check: " + "; ".join(problems)[:1000])
                self._migrate(db)
                self._check_rows(db)
            except sqlite3.DatabaseError as exc:
                if _sqlite_code(exc) in (_SQLITE_CORRUPT, _SQLITE_NOTADB):
                    raise _Damaged(f"{exc} ({getattr(exc, 'sqlite_errorname', 'corrupt')})") from exc
                raise
        except BaseException:
            db.close()
            raise
        return db  # autocommit mode: _drain opens and commits its transactions explicitly

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        """Create missing tables, add columns older databases lack, create indexes; a table whose
        columns cannot be what this store expects is damage."""

        def columns(table: str) -> list[str]:
            return [str(r["name"]) for r in db.execute(f"PRAGMA table_info({table})")]

        try:
            db.execute("BEGIN")
            for statement in SCHEMA.split(";"):
                if statement.strip():
                    db.execute(statement)
            have = columns("sandboxes")
            for name, decl in _ADDED_COLUMNS:
                if name not in have:
                    db.execute(f"ALTER TABLE sandboxes ADD COLUMN {name} {decl}")
            if "project" not in have:  # rows of schema 2: their key's project is their spec's
                db.execute("UPDATE sandboxes SET project = json_extract(spec, '$.project')")
            for table, expected in _BASE_COLUMNS.items():
                missing = [c for c in expected if c not in columns(table)]
                if missing:
                    raise _Damaged(f"schema: table {table} lacks columns {', '.join(missing)}")
            for statement in INDEXES.split(";"):
                if statement.strip():
                    db.execute(statement)
            if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA_VERSION:
                db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("COMMIT")
        except BaseException as exc:
            with contextlib.suppress(sqlite3.Error):
                if db.in_transaction:
                    db.execute("ROLLBACK")
            if isinstance(exc, sqlite3.OperationalError) and _sqlite_code(exc) == _SQLITE_ERROR:
                # "no such column", "table ... has no column named ...": not a schema this store made
                raise _Damaged(f"schema: {exc}") from exc
            if isinstance(exc, sqlite3.IntegrityError):  # e.g. the unique index over duplicate keys
                raise _Damaged(f"schema: {exc}") from exc
            raise

    @staticmethod
    def _check_rows(db: sqlite3.Connection) -> None:
        """Every sandbox row must decode: the daemon's recovery reads them all at start."""
        for r in db.execute("SELECT * FROM sandboxes"):
            try:
                _row(r)
            except (ValueError, TypeError, KeyError) as exc:
                raise _Damaged(f"sandbox row {r['id']!r} does not decode: {exc}") from exc

    def _set_aside(self) -> Path:
        """Move the damaged database (and its -wal, -shm, -journal) to ``<name>.corrupt-<unix time>``."""
        stamp = int(time.time())
        aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 0
        while any(Path(f"{aside}{s}").exists() for s in ("", "-wal", "-shm", "-journal")):
            n += 1
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}.{n}")
        for suffix in ("", "-wal", "-shm", "-journal"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{self.path}{suffix}", f"{aside}{suffix}")
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return aside

    async def close(self) -> None:
        draining = self._draining
        if draining is not None:
            await draining
        if self._db is not None:
            db = self._db
            await asyncio.get_running_loop().run_in_executor(self._pool, db.close)
            self._db = None
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ sandboxes

    def insert(self, row: SandboxRow) -> asyncio.Future[Any]:
        """Add a row: queued at once (an operation asked for after this call runs after it), so a
        create can launch its sandbox while the row is written. Its outcome: None, or
        StateConflictError if the row's id or idempotency key is taken."""
        values = tuple(_db_value(c, getattr(row, c)) for c in SANDBOX_COLUMNS)
        sql = f"INSERT INTO sandboxes ({', '.join(SANDBOX_COLUMNS)}) VALUES ({', '.join('?' * len(values))})"
        return self._run(lambda db: db.execute(sql, values))

    async def update(self, sandbox_id: str, **fields: Any) -> None:
        """Set columns of a row (`held=True`, `runtime={...}`, ...); unknown names are a ValueError."""
        cols = []
        vals: list[Any] = []
        for key, value in fields.items():
            if key not in SANDBOX_COLUMNS or key == "id":
                raise ValueError(f"no such sandbox column: {key}")
            cols.append(f"{key}=?")
            vals.append(_db_value(key, value))
        if not cols:
            return
        vals.append(sandbox_id)
        sql = f"UPDATE sandboxes SET {', '.join(cols)} WHERE id=?"
        await self._run(lambda db: db.execute(sql, vals))

    async def set_acked(self, sandbox_ids: Iterable[str], acked: bool = True) -> None:
        """Mark rows whose create answer was (or was not) handed to the client, in one operation."""
        items = [(int(acked), i) for i in sandbox_ids]
        if items:
            await self._run(lambda db: db.executemany("UPDATE sandboxes SET acked=? WHERE id=?", items))

    async def touch_many(self, stamps: dict[str, float]) -> None:
        if stamps:
            items = [(t, i) for i, t in stamps.items()]
            await self._run(lambda db: db.executemany("UPDATE sandboxes SET last_active_at=? WHERE id=?", items))

    async def get(self, sandbox_id: str) -> SandboxRow | None:
        def q(db: sqlite3.Connection) -> SandboxRow | None:
            r = db.execute("SELECT * FROM sandboxes WHERE id=?", (sandbox_id,)).fetchone()
            return _row(r) if r else None

        return await self._run(q)

    async def by_idempotency_key(self, key: str, project: str | None = None) -> SandboxRow | None:
        """The row of `project` (None: none) created with this idempotency key, if any."""

        def q(db: sqlite3.Connection) -> SandboxRow | None:
            r = db.execute(
                "SELECT * FROM sandboxes WHERE idempotency_key=? AND COALESCE(project, '')=?", (key, project or "")
            ).fetchone()
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

    # ------------------------------------------------------------------ events

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


def _salvage(path: Path) -> list[SandboxRow]:
    """The sandbox rows that can still be read from a damaged database file (best effort: stops at
    the first error; never writes to the file)."""
    out: list[SandboxRow] = []
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error:
        return out
    try:
        db.row_factory = sqlite3.Row
        for r in db.execute("SELECT * FROM sandboxes"):
            with contextlib.suppress(ValueError, TypeError, KeyError, IndexError):
                out.append(_row(r))
    except sqlite3.Error:
        pass
    finally:
        db.close()
    return out


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
