"""How snapshots and checkpoints lie on the node's disk: a directory each, with the tier's images
and a JSON record (written whole or not at all), and the sizes of the image files as they were taken,
checked before anything is restored from them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandfleet.daemon.node.core import lenient_spec
from sandfleet.errors import DataLossError
from sandfleet.models import SandboxSpec, SnapshotInfo


@dataclass
class SnapshotRecord:
    info: SnapshotInfo
    path: Path
    spec: SandboxSpec  # of the sandbox it was taken from: what a restore starts
    meta: dict[str, Any]  # the backend's, for restore
    restoring: int = 0
    deleted: bool = False  # asked to go; its files go once no restore reads them


def load_snapshot(path: Path, now: float) -> SnapshotRecord | None:
    """A snapshot from its directory (its snapshot.json), unless unreadable or expired."""
    try:
        record = json.loads((path / "snapshot.json").read_text())
        info = SnapshotInfo.model_validate(record["info"])
        if info.id != path.name or (info.expires_at is not None and info.expires_at <= now):
            return None
        spec = lenient_spec(record["spec"])
        return None if spec is None else SnapshotRecord(info, path, spec, dict(record["meta"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def image_sizes(path: Path) -> dict[str, int]:
    """The sizes of a snapshot's image files (those in `path` and its `img/`), for `check_intact`."""
    files = [p for d in (path, path / "img") if d.is_dir() for p in d.iterdir() if p.is_file()]
    return {str(p.relative_to(path)): p.stat().st_size for p in files}


def check_intact(path: Path, meta: dict[str, Any]) -> None:
    """Refuse images that are not as they were taken (truncated, emptied, gone: a full disk, a
    partial copy) before anything is restored from them: criu may hang on such images rather than
    fail. Snapshots taken before sizes were kept are not checked."""
    for rel, size in dict(meta.get("sizes") or {}).items():
        try:
            now = (path / rel).stat().st_size
        except OSError:
            now = -1
        if now != size:
            raise DataLossError(f"the images are damaged: {rel} is {now} bytes, it was {size} when taken")


def write_json(path: Path, record: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
