"""A trajectory's log on disk: one record per line, each with its checksum; appends that are whole
or not there at all; reading that tells a torn tail from damage.

A record is its JSON, a tab, the CRC-32 of the JSON (8 hex digits) and a newline. Lines of logs
written before checksums (JSON alone) still read; a changed byte in one of them may go unnoticed.

What reading finds, and what the caller (daemon/rl/trajectories.py) makes of it:

- a torn tail: bytes after the last newline, the one write a dying process or a full disk left
  unfinished. Cut on disk before anything is appended, so no record is ever glued onto a fragment;
  unless the bytes are a whole record that lacks only its newline: then it is kept (completed), as
  it may stand for something that happened (a step begun);
- damage: a whole line whose checksum or JSON does not hold (a changed byte, a fragment an older
  daemon glued a record onto). Nothing at or after it can be trusted, so the caller rewrites the
  log as its readable part plus a `lost` record (`rewrite`: the damaged file is kept beside it).

A write that fails (a full disk, EIO) or is short is undone at once: the file is cut back to its
last whole record (`StepLog.append`). If even that fails the log is `broken` and takes nothing more.

`replay` makes a `Trajectory` (its state in memory) of the records: open, sandbox, then each step's
begin and done, verifying (its checks began) and verify, close, lost. A record that does not follow
from those before it (a step that skips one, a result for another step) is damage like a changed byte.

A step's action and a verification's request are logged with their digest (`identity`), which a
retried request must match. It leaves out fields at their default, so a field added later (at its
default) changes nothing; digests of logs written before that (`earlier_identities`) still match.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from sandfleet.errors import DataLossError
from sandfleet.models import (
    ExecAction,
    SandboxInfo,
    StepResult,
    TrajectoryInfo,
    TrajectoryOpen,
    VerifyRequest,
    VerifyResult,
)

log = logging.getLogger(__name__)

Record = dict[str, Any]
Key = tuple[str | None, str]  # (project, trajectory id): a project's ids are its own


def encode(record: Record | str) -> bytes:
    """A record (or its JSON) as a line of the log."""
    body = (record if isinstance(record, str) else json.dumps(record, separators=(",", ":"))).encode()
    return b"%s\t%08x\n" % (body, zlib.crc32(body))


def decode(line: bytes) -> Record | None:
    """A line's record (without its newline), or None if its checksum or JSON does not hold."""
    body = line
    if len(line) > 9 and line[-9] == 0x09:  # \t: a record with its checksum
        body = line[:-9]
        try:
            if int(line[-8:], 16) != zlib.crc32(body):
                return None
        except ValueError:
            return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


@dataclass
class Line:
    record: Record | None  # None: unreadable
    start: int  # where the line begins in the file


@dataclass
class Scan:
    """A log as read: its lines in order, and what is past the last one."""

    lines: list[Line] = field(default_factory=list)
    end: int = 0  # where the last line ends (its newline included)
    size: int = 0  # the file's size: more than `end` if it has a torn tail
    whole_tail: bool = False  # the tail is a whole record without its newline (the last of `lines`)


def scan(data: bytes) -> Scan:
    out = Scan(size=len(data))
    pos = 0
    while (nl := data.find(b"\n", pos)) >= 0:
        out.lines.append(Line(decode(data[pos:nl]), pos))
        pos = nl + 1
    out.end = pos
    if pos < len(data) and (record := decode(data[pos:])) is not None:
        out.lines.append(Line(record, pos))
        out.whole_tail = True
    return out


def mend_tail(path: Path, found: Scan, sync: bool) -> int:
    """Cut a torn tail off the file, or complete a whole record's missing newline; the new size."""
    if found.size == found.end:
        return found.size
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if found.whole_tail:
            size = found.size + os.pwrite(fd, b"\n", found.size)
        else:
            os.ftruncate(fd, found.end)
            size = found.end
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    log.warning("%s: a torn last record was %s", path, "completed" if found.whole_tail else "cut off")
    return size


def rewrite(path: Path, data: bytes) -> None:
    """Replace the log by `data` at once (a crash leaves the old file or the new one); the old file
    stays beside it as `<name>.damaged-<time>` for whoever looks into what happened."""
    aside = path.with_name(f"{path.name}.damaged-{time.time_ns()}")
    tmp = path.with_name(f"{path.name}.tmp")
    os.link(path, aside)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        for leftover in (tmp, aside):
            leftover.unlink(missing_ok=True)
        raise
    dirfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class StepLog:
    """One trajectory's log file, open for appending while the trajectory is loaded.

    `append` writes a record with one write(2) on an O_APPEND descriptor, and knows where the last
    whole record ends (`size`): a write that fails or is short is cut back to there, so the next
    record never lands on a fragment. A record the caller has answered already (a step's result)
    can be `held` when its write fails: it goes out first with the next append (whose write it
    then shares), so the log keeps the order things happened in."""

    def __init__(self, path: Path, size: int, sync: bool) -> None:
        self.path = path
        self.size = size
        self.sync = sync  # fsync each append (in a thread: the caller's loop goes on meanwhile)
        self.fd: int | None = None
        self.held: list[bytes] = []
        self.broken = False
        self.retired: str | None = None  # why it takes nothing more (its file was deleted or set aside)
        self._lock = asyncio.Lock()  # one append at a time in a thread (sync only)

    async def append(self, line: bytes | None, *, hold: bool = False) -> None:
        """Write `line` (None: only what is held) after the held records; OSError if the disk would
        not take them all (then none is in the file). `hold`: keep `line` to go out with the next
        append if this one fails. Without fsync the write only reaches the page cache: it is made
        on the loop (microseconds; a thread hop would cost more than the write)."""
        if not self.sync:
            self._append(line, hold)
            return
        async with self._lock:
            write = asyncio.ensure_future(asyncio.to_thread(self._append, line, hold))
            try:
                await asyncio.shield(write)
            except asyncio.CancelledError:
                # The thread writes on: the lock is held until it has (no append beside it, no
                # close under it), then the caller's cancellation goes on.
                with contextlib.suppress(Exception):
                    await write
                raise

    def _append(self, line: bytes | None, hold: bool) -> None:
        if self.retired is not None:  # opened again by name, it would be a file without its open record
            raise OSError(errno.ENOENT, f"the log {self.path.name} was {self.retired}")
        if self.broken:
            raise OSError(errno.EIO, f"the log {self.path.name} could not be cut back after a failed write")
        lines = [*self.held, line] if line is not None else self.held
        if not lines:
            return
        data = b"".join(lines) if len(lines) > 1 else lines[0]
        try:
            if self.fd is None:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            if os.write(self.fd, data) != len(data):  # a full disk took part of it
                raise OSError(errno.ENOSPC, "the disk took only part of a record")
            if self.sync:
                os.fsync(self.fd)
        except OSError:
            self._cut_back()
            if hold and line is not None:
                self.held.append(line)
            raise
        self.size += len(data)
        self.held.clear()

    def _cut_back(self) -> None:
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, self.size)
        except OSError as exc:
            self.broken = True
            log.error("%s: a failed write could not be cut back (%s): the log takes nothing more", self.path, exc)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    async def retire(self, why: str) -> None:
        """Close it for good: its file was deleted or set aside (`why`), and an append is an OSError.
        After an append in a thread (sync): its descriptor is never closed under a write."""
        async with self._lock:
            self.close()
            self.retired = why


# -- what identifies a request in the log -----------------------------------------------------


def digest(dumped: str) -> str:
    return hashlib.sha256(dumped.encode()).hexdigest()[:32]


def identity(req: BaseModel) -> str:
    """The digest of a step's action or a verification's request: its JSON without the fields at
    their default (a field added to the model later, left at its default, changes nothing)."""
    return digest(req.model_dump_json(exclude_defaults=True))


# Daemons before `identity` logged the digest of the whole JSON, as the models were then: without
# the fields added since (at their default: a request setting one cannot be from then), and with
# the defaults of then where one changed (a request that does not set the field means that one).
_ADDED_EXEC = {"cpu_time"}
_ADDED_VERIFY = {"allow", "cpu_time", "queue_timeout"}
_DEFAULTS_THEN: dict[str, Any] = {"agent_exit_codes": [1]}


def earlier_identities(req: BaseModel) -> set[str]:
    """The digests a daemon before `identity` may have logged for `req`."""
    if isinstance(req, ExecAction):
        if req.exec.cpu_time is not None:
            return set()
        return {digest(req.model_dump_json(exclude={"exec": _ADDED_EXEC}))}
    if isinstance(req, VerifyRequest):
        fields = VerifyRequest.model_fields
        if any(getattr(req, f) != fields[f].get_default(call_default_factory=True) for f in _ADDED_VERIFY):
            return set()
        forms = [req]
        for name, then in _DEFAULTS_THEN.items():  # unset, or sent as today's default: either meaning
            if getattr(req, name) == fields[name].get_default(call_default_factory=True):
                forms.append(req.model_copy(update={name: then}))
        return {digest(r.model_dump_json(exclude=_ADDED_VERIFY)) for r in forms}
    return {digest(req.model_dump_json())}  # the other actions are as they were


# -- a trajectory, as its log says -------------------------------------------------------------


@dataclass
class Trajectory:
    id: str
    project: str | None
    opened: TrajectoryOpen
    created_at: float
    log: StepLog
    sandbox: SandboxInfo | None = None
    steps: list[StepResult] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # each step's action, as the JSON logged
    running: tuple[int, str, asyncio.Future[StepResult]] | None = None
    verification: VerifyResult | None = None
    verify_digest: str | None = None
    verifying: asyncio.Future[VerifyResult] | None = None
    verify_begun: str | None = None  # the digest of a verification whose checks began (logged), verdict or not
    closed_at: float | None = None
    reward: float | None = None
    lost_from: int | None = None  # the log is damaged from this step on: it and every later one are data_loss
    touched: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def key(self) -> Key:
        return self.project, self.id

    def info(self) -> TrajectoryInfo:
        failures: dict[str, int] = {}
        for s in self.steps:
            if s.cause is not None:
                failures[s.cause] = failures.get(s.cause, 0) + 1
        return TrajectoryInfo(
            id=self.id,
            sandbox_id=self.sandbox.id if self.sandbox else None,
            state="closed" if self.closed_at is not None else "open",
            steps=len(self.steps),
            seed=self.opened.seed,
            labels=self.opened.labels,
            metadata=self.opened.metadata,
            source_snapshot=self.opened.snapshot_id,
            created_at=self.created_at,
            closed_at=self.closed_at,
            reward=self.reward,
            verification=self.verification,
            failures=failures,
            lost_from=self.lost_from,
        )

    def lost(self, what: str) -> DataLossError:
        return DataLossError(
            f"the log of trajectory {self.id} is damaged from step {self.lost_from} on: {what} may have "
            "been done, so it is not done again"
        )


def _take(t: Trajectory, rec: dict[str, Any]) -> None:
    """Replay one record of `t`'s log; ValueError if it does not follow from those before it (a log
    that skips or repeats a record is damaged like one with a changed byte)."""
    kind = rec["k"]
    if kind == "sandbox" and t.sandbox is None:
        t.sandbox = SandboxInfo.model_validate(rec["sandbox"])
    elif kind == "begin" and t.running is None and t.closed_at is None and t.lost_from is None:
        if rec["step"] != len(t.steps) or t.sandbox is None:
            raise ValueError(f"step {rec['step']} begins at step {len(t.steps)}")
        t.actions.append(json.dumps(rec["action"]))
        t.running = (rec["step"], rec["digest"], asyncio.get_running_loop().create_future())
    elif kind == "done" and t.running is not None and (rec["step"], rec["digest"]) == t.running[:2]:
        t.steps.append(StepResult.model_validate(rec["result"]))
        t.digests.append(rec["digest"])
        t.running = None
    elif kind == "verifying" and t.verification is None:
        t.verify_begun = rec["digest"]
    elif kind == "verify" and t.verification is None:
        t.verification = VerifyResult.model_validate(rec["result"])
        t.verify_digest = rec["digest"]
    elif kind == "close" and t.closed_at is None and t.running is None:
        t.closed_at, t.reward = rec["t"], rec.get("reward")
    elif kind == "lost" and t.lost_from is None and rec["step"] == len(t.steps):
        t.lost_from, t.running = rec["step"], None
    else:
        raise ValueError(f"a {kind!r} record out of place")


def replay(key: Key, path: Path, found: Scan, sync: bool) -> tuple[Trajectory | None, int | None]:
    """The trajectory its log's records make, and the index of the first record that is damaged
    (None: none is). Records from there on are not trusted: every step not logged before it is lost."""
    t: Trajectory | None = None
    for i, line in enumerate(found.lines):
        rec = line.record
        try:
            if rec is None:
                raise ValueError("its checksum or JSON does not hold")
            if t is None:
                if rec["k"] != "open":
                    raise ValueError("the log does not begin with its open record")
                opened = TrajectoryOpen.model_validate(rec["request"])
                t = Trajectory(key[1], key[0], opened, rec["t"], StepLog(path, 0, sync))
            else:
                _take(t, rec)
        except (ValueError, KeyError, TypeError, ValidationError) as exc:
            if t is None:
                raise DataLossError(f"the log of trajectory {key[1]} is unreadable from its start") from exc
            t.lost_from, t.running = len(t.steps), None
            log.error(
                "trajectory %s (project %s): its log is damaged at byte %d (%s): steps from %d on are lost",
                t.id, t.project, line.start, exc, t.lost_from,
            )  # fmt: skip
            t.touched = time.time()
            return t, i
    if t is not None:
        t.touched = time.time()
    return t, None
