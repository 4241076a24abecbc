"""A layer blob's stream: digested as it is read, decompressed by sniffing (gzip, zstd or plain tar)."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import importlib
import io
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Protocol, cast

from .oci_errors import _CHUNK, OciImportError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# After a layer tar's end-of-archive marker only padding follows (tools pad to a 10 KiB record);
# more than this is junk, and draining it unbounded would let a blob stream on forever.
_MAX_TRAILING = 1 << 20


class _Reader(Protocol):
    def read(self, size: int, /) -> bytes: ...


class _Digesting(io.RawIOBase):
    """Passes a stream through, hashing (sha256) and counting what is read; with a ``limit``,
    raises OciImportError(``too_big``) as soon as more than that many bytes come through."""

    def __init__(self, src: _Reader, limit: int | None = None, too_big: str = "") -> None:
        super().__init__()
        self._src = src
        self._sha = hashlib.sha256()
        self.size = 0
        self._limit = limit
        self._too_big = too_big

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        view = memoryview(buffer).cast("B")
        want = len(view)
        if self._limit is not None:
            want = min(want, self._limit - self.size + 1)  # one byte past the limit tells it is exceeded
        data = self._src.read(want)
        if self._limit is not None and self.size + len(data) > self._limit:
            raise OciImportError(self._too_big)
        view[: len(data)] = data
        self._sha.update(data)
        self.size += len(data)
        return len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self._sha.hexdigest()


def _drain(stream: _Reader, what: str) -> None:
    """Read what follows the tar's end: it counts towards the digests, but only padding belongs there."""
    left = _MAX_TRAILING
    while data := stream.read(min(_CHUNK, left + 1)):
        left -= len(data)
        if left < 0:
            raise OciImportError(f"{what}: more than {_MAX_TRAILING} bytes of data after the end of the tar archive")


@contextlib.contextmanager
def _zstd_tool(exe: str, stream: _Reader) -> Iterator[_Reader]:
    """Decompress through the zstd tool; a thread feeds it, since the blob may be a tar member, not a file."""
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen([exe, "-d", "-c", "-q"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
        stdin, stdout = cast(IO[bytes], proc.stdin), cast(IO[bytes], proc.stdout)
        failed: list[BaseException] = []

        def feed() -> None:
            try:
                while chunk := stream.read(_CHUNK):
                    stdin.write(chunk)
            except BrokenPipeError:
                pass  # zstd exited (bad input, or killed below); its exit status tells
            except BaseException as exc:
                failed.append(exc)
            finally:
                with contextlib.suppress(BrokenPipeError):
                    stdin.close()

        feeder = threading.Thread(target=feed, name="zstd-feed", daemon=True)
        feeder.start()
        done = False
        try:
            yield stdout
            done = True
        finally:
            if not done:
                proc.kill()
            stdout.close()
            feeder.join()
            status = proc.wait()
        if failed:
            raise failed[0]
        if status != 0:
            errors.seek(0)
            detail = errors.read().decode(errors="replace").strip()
            raise OciImportError(f"zstd failed (exit {status}): {detail}")


@contextlib.contextmanager
def _zstd(stream: _Reader, what: str) -> Iterator[_Reader]:
    try:
        zstandard = importlib.import_module("zstandard")
    except ImportError:
        exe = shutil.which("zstd")
        if exe is None:
            raise OciImportError(
                f"{what} is zstd-compressed: install the zstandard Python module or the zstd tool"
            ) from None
        with _zstd_tool(exe, stream) as out:
            yield out
        return
    with zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True, closefd=False) as reader:
        try:
            yield cast(_Reader, reader)
        except zstandard.ZstdError as exc:  # a corrupt blob: the archive's fault, like a gzip error
            raise OciImportError(f"{what}: {exc}") from exc


@contextlib.contextmanager
def _decompressed(stream: io.BufferedReader[_Digesting], what: str) -> Iterator[_Reader]:
    """The uncompressed tar stream of a layer blob, by its magic bytes (docker save names no media type)."""
    magic = stream.peek(6)[:6]
    if magic.startswith(b"\x1f\x8b"):
        with gzip.GzipFile(fileobj=stream, mode="rb") as gz:
            yield gz
    elif magic.startswith(_ZSTD_MAGIC):
        with _zstd(stream, what) as out:
            yield out
    elif magic.startswith((b"BZh", b"\xfd7zXZ\x00")):
        raise OciImportError(f"{what} is bzip2- or xz-compressed, which is not supported (gzip, zstd or plain tar)")
    else:
        yield stream
