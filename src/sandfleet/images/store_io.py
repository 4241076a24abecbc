"""A layer store's files: their names, digests, verification stamps, atomic and publish-once writes, ref locks."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from .models import (
    LayerCorruptError,
)


def _digest_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return "sha256:" + h.hexdigest(), size


def _file_version(st: os.stat_result) -> str:
    """What a layer file's verification stamp records. Of these, the ctime is the one no writer can
    restore (see `LayerStore.verified_layer_path`). The leading tag retires stamps of older formats."""
    return f"v2 {st.st_dev} {st.st_ino} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns}"


def _hash_unchanging(path: Path, digest: str) -> str:
    """Hash a layer file and check it against `digest`; return the `_file_version` of what was hashed.
    A file changed while it was hashed is hashed again (the stamp must describe the bytes hashed)."""
    for _ in range(3):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            before = _file_version(os.fstat(f.fileno()))
            while chunk := f.read(1 << 20):
                h.update(chunk)
            after = _file_version(os.fstat(f.fileno()))
        if before == after:
            break
    else:
        raise LayerCorruptError(f"layer {digest} keeps changing while it is hashed ({path})")
    actual = "sha256:" + h.hexdigest()
    if actual != digest:
        raise LayerCorruptError(f"layer {digest} is corrupt: its content hashes to {actual}")
    return after


def _atomic_write(path: Path, data: bytes, *, sync: bool = True) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


# Chunk index granularity of on-demand layers. File data is still packed at 4 KiB alignment in the
# blob (small files are not padded to a chunk) and read page by page; a large chunk keeps the local
# metadata image small (8 bytes of index per chunk).
BLOB_CHUNK = 1 << 20


def _layer_name(digest: str) -> str:
    return "sha256-" + digest.removeprefix("sha256:") + ".erofs"


def _blob_name(digest: str) -> str:
    return "sha256-" + digest.removeprefix("sha256:") + ".blob"


def _publish_once(src: Path, dest: Path) -> None:
    """Put a finished file into the shared store unless an identical one (same digest, so same
    name) is already there: replacing it would pull a file other nodes have mounted from under them
    (NFS answers ESTALE to the old handle). link() fails if the name exists, atomically, where
    rename() would replace it."""
    os.chmod(src, 0o444)
    with contextlib.suppress(FileExistsError):
        os.link(src, dest)
    src.unlink()


@contextlib.asynccontextmanager
async def file_lock(root: Path, name: str, tag: str) -> AsyncIterator[None]:
    """Hold the store's lock file of a ref (an flock), across processes building it."""
    # Per ref (not per name) so a recipe may depend on another tag of the same name
    # without deadlocking on its own flock. Polled so waiting stays cancellable.
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    fd = os.open(root / f".lock-{safe}@{tag}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(0.2)
        yield
    finally:
        os.close(fd)  # releases the flock
