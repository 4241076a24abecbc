"""Where trajectory logs live: `<root>/<project>/<id>.jsonl` (the root's in `_`), kept for their
retention; what a caller's id names; logs set aside.

Logs of the layout before ids were per project (all in `<root>`) are moved at start to their
sandbox's project. Back then an id was the node's, reachable by whoever saw its sandbox's project
(the root, that project and those above it); whether the root or the project opened it is not in
the log. So a moved log stays reachable by all of them (`moved.json`: id -> project), until it is
deleted or expires.

A log is set aside (renamed `<id>.jsonl.<why>-<time>`) when its node is fenced: nothing it held
answers again, and the file stays for whoever looks into what happened.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Container
from pathlib import Path
from typing import Any

from sandfleet.daemon.rl.steplog import Key, Scan, scan
from sandfleet.daemon.security.iam import within
from sandfleet.errors import InvalidArgumentError
from sandfleet.models import TRAJECTORY_ID, TrajectoryInfo

log = logging.getLogger(__name__)
_ID = re.compile(TRAJECTORY_ID)
_ROOT_DIR = "_"  # the root's logs (no project path can be "_": each part begins with [a-z0-9])
_MOVED = "moved.json"


class LogFolder:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.moved: dict[str, str] = {}  # id -> project: logs from before ids were per project

    def path(self, key: Key) -> Path:
        project, tid = key
        if not _ID.match(tid):
            raise InvalidArgumentError(f"invalid trajectory id {tid[:80]!r}: 1-117 characters of [A-Za-z0-9._:-]")
        return self.folder(project) / f"{tid}.jsonl"

    def folder(self, project: str | None) -> Path:
        """A project's logs ('/' in its path is '+', which no project path has)."""
        return self.root / (project.replace("/", "+") if project else _ROOT_DIR)

    def key(self, project: str | None, tid: str) -> Key:
        """What the caller's (`project`'s) id names: its project's trajectory, or a moved one it
        reached before ids were per project."""
        owner = self.moved.get(tid)
        if owner is not None and owner != project and within(owner, project):
            return owner, tid
        return project, tid

    def own(self, project: str | None) -> set[str]:
        """The ids of `project`'s own logs (blocking: a thread)."""
        return {p.stem for p in self.folder(project).glob("*.jsonl")}

    def reached(self, project: str | None) -> set[str]:
        """The moved ids `project` reaches besides its own."""
        return {t for t, owner in self.moved.items() if owner != project and within(owner, project)}

    def forget(self, key: Key) -> bool:
        """Its log is gone: a moved id is free again. Whether `moved` changed (then `save` it)."""
        return self.moved.get(key[1]) == key[0] and self.moved.pop(key[1], None) is not None

    def sweep(self, now: float, retention: float, busy: Container[Key], owner: Callable[[Scan], str | None]) -> None:
        """Make the folder, move logs of the layout before projects (to `owner`'s), drop logs and
        set-aside copies past their retention unless `busy` (blocking: a thread)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        with contextlib.suppress(OSError, ValueError):  # damaged: the moved logs answer to their project only
            saved = json.loads((self.root / _MOVED).read_bytes())
            if isinstance(saved, dict):
                self.moved = {t: p for t, p in saved.items() if isinstance(p, str) and _ID.match(t)}
        for tmp in self.root.glob(f"{_MOVED}.*.tmp"):  # a save a crash cut short
            tmp.unlink(missing_ok=True)
        moves: list[tuple[Path, Path]] = []
        for path in self.root.glob("*.jsonl"):
            with contextlib.suppress(OSError, InvalidArgumentError):
                project = owner(scan(path.read_bytes()))
                dest = self.path((project, path.stem))
                if dest.exists():
                    log.error("trajectory log %s: %s exists already: left where it is", path, dest)
                    continue
                moves.append((path, dest))
                if project is not None:
                    self.moved[path.stem] = project
        if moves:
            self.save()  # before the moves: a crash between leaves them reachable still
        for path, dest in moves:
            with contextlib.suppress(OSError):
                dest.parent.mkdir(exist_ok=True, mode=0o700)
                os.rename(path, dest)
        for path in self.root.glob("*/*"):
            if not (path.suffix == ".jsonl" or ".jsonl." in path.name):  # the logs, damaged copies, rewrites
                continue
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < now - retention and _key(path) not in busy:
                    path.unlink()
        gone = [t for t, project in self.moved.items() if not self.path((project, t)).exists()]
        for t in gone:
            del self.moved[t]
        if gone:
            self.save()

    def keys(self) -> list[Key]:
        """Every log's key (blocking)."""
        return [_key(p) for p in self.root.glob("*/*.jsonl")]

    def set_aside(self, key: Key, why: str) -> None:
        """Rename its log `<id>.jsonl.<why>-<time>`: no longer found, kept to look into (blocking)."""
        path = self.path(key)
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, path.with_name(f"{path.name}.{why}-{time.time_ns()}"))

    def save(self) -> None:
        """Write `moved` (blocking). Two at once may leave the older: what start prunes (ids whose
        log is gone) is all an older one can hold too many. Not written (a full disk): logged, and
        the moved logs a restart then reads answer to their project only."""
        tmp = self.root / f"{_MOVED}.{time.time_ns()}.tmp"
        try:
            tmp.write_text(json.dumps(dict(self.moved)))
            os.replace(tmp, self.root / _MOVED)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.error("%s could not be written: %s", self.root / _MOVED, exc)


class KeyLocks:
    """A lock per key, kept only while someone holds or awaits it (one per rollout would pile up)."""

    def __init__(self) -> None:
        self._locks: dict[Key, list[Any]] = {}  # key -> [lock, how many hold or await it]

    @contextlib.asynccontextmanager
    async def hold(self, key: Key) -> AsyncIterator[None]:
        entry = self._locks.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                self._locks.pop(key, None)


class Infos:
    """Closed trajectories' infos as they left memory, the least recently used dropped past `MAX` of
    them or `MAX_BYTES` (a verdict holds the checks' output: one over `MAX_BYTES // 64` is not kept): a
    closed log changes only through this daemon (loaded again first: its info is then the loaded
    one's, and remembered again as it leaves), is deleted through it (`forget`), or expires (no longer
    listed), so a list need not read it again. Cleared when the node is fenced."""

    MAX = 10_000
    MAX_BYTES = 64 * 2**20

    def __init__(self) -> None:
        self._infos: collections.OrderedDict[Key, tuple[TrajectoryInfo, int]] = collections.OrderedDict()
        self._bytes = 0

    def remember(self, key: Key, info: TrajectoryInfo) -> None:
        self.forget(key)
        size = _size(info)
        if size > self.MAX_BYTES // 64:
            return
        self._infos[key] = (info, size)
        self._bytes += size
        while len(self._infos) > self.MAX or self._bytes > self.MAX_BYTES:
            self._bytes -= self._infos.popitem(last=False)[1][1]

    def get(self, key: Key) -> TrajectoryInfo | None:
        got = self._infos.get(key)
        if got is None:
            return None
        self._infos.move_to_end(key)
        return got[0]

    def forget(self, key: Key) -> None:
        got = self._infos.pop(key, None)
        if got is not None:
            self._bytes -= got[1]

    def clear(self) -> None:
        self._infos.clear()
        self._bytes = 0


def _size(info: TrajectoryInfo) -> int:
    """About the bytes an info holds: what grows with the rollout (its verdict's output and files)."""
    v = info.verification
    if v is None:
        return 1024
    out = len(v.result.stdout) + len(v.result.stderr) if v.result is not None else 0
    return 2048 + out + 160 * len(v.changed) + 80 * len(v.dropped)


def _key(path: Path) -> Key:
    """The key of a log (or of a copy beside it) in a project's folder."""
    return None if path.parent.name == _ROOT_DIR else path.parent.name.replace("+", "/"), path.stem
