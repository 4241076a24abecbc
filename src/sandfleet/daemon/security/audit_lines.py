"""Reading the audit stream's files: a line's seq (without parsing the rest), a record of a line,
a segment's complete lines forwards and backwards (the newest records without reading a whole
segment), and the readers' filters. Blocking: for the stream's worker threads."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEQ_PREFIX = b'{"seq":'

Record = dict[str, Any]


def line_seq(line: bytes) -> int | None:
    """The seq of a line as written here, without parsing the rest of it (None: parse it)."""
    if line.startswith(SEQ_PREFIX):
        end = line.find(b",", len(SEQ_PREFIX))
        if end > 0:
            try:
                return int(line[len(SEQ_PREFIX) : end])
            except ValueError:
                return None
    return None


def complete_lines(path: Path) -> Iterator[bytes]:
    """A segment's lines, up to one still being written; none when rotation deleted it meanwhile."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return
    with f:
        for line in f:
            if not line.endswith(b"\n"):
                return  # being written
            yield line


def lines_backwards(path: Path, block: int = 256 * 1024) -> Iterator[bytes]:
    """A segment's complete lines, the last first (after the last newline: a line being written, left
    out), reading it from its end a block at a time; none when rotation deleted it meanwhile."""
    try:
        f = open(path, "rb")  # noqa: SIM115
    except FileNotFoundError:
        return
    with f:
        pos = f.seek(0, os.SEEK_END)
        carry = b""  # the end of a line whose start is in the block before (up to its newline)
        ended = False  # the last newline found: what follows it is not a line yet
        while pos > 0:
            start = max(0, pos - block)
            f.seek(start)
            data = f.read(pos - start)
            pos = start
            if not ended:
                cut = data.rfind(b"\n")
                if cut < 0:
                    continue
                data, ended = data[: cut + 1], True
            data += carry
            if start > 0:
                nl = data.find(b"\n")
                if nl < 0:
                    carry = data  # one line longer than a block: read on
                    continue
                carry, data = data[: nl + 1], data[nl + 1 :]
            else:
                carry = b""
            for line in reversed(data.split(b"\n")[:-1]):
                yield line + b"\n"


def matches(rec: Record, kinds: frozenset[str] | None, sandbox_id: str | None, since_time: float | None) -> bool:
    return (
        (kinds is None or rec.get("kind") in kinds)
        and (sandbox_id is None or rec.get("sandbox_id") == sandbox_id)
        and (since_time is None or rec.get("ts", 0) >= since_time)
    )


def parse(line: bytes) -> Record | None:
    """A record of a complete line, or None for a line that is not one (damaged)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if isinstance(rec, dict) and type(rec.get("seq")) is int:
        return rec
    return None
