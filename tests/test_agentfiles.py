"""Unit checks of the host-side halves of files through a VM's agent (daemon/node/agentfiles.py): the
filter that leaves special files out of a guest's tar, and the cut of an upload into the parts the
guest's tar extracts one after the other. The real guests' tars run in tests/conformance."""

from __future__ import annotations

import asyncio
import io
import tarfile
from collections.abc import AsyncIterator

import pytest

from sandfleet.daemon.node.agentfiles import _checked_parts, _tar_stream, _without_special
from sandfleet.runtime.sandboxfs.results import FileOpError


def _member(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", link: str = "") -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.linkname, ti.mode = kind, len(data), link, 0o4755
    return ti


def _tar(members: list[tuple[tarfile.TarInfo, bytes]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for ti, data in members:
            t.addfile(ti, io.BytesIO(data) if ti.isreg() else None)
    return buf.getvalue()


def _filtered(blob: bytes, step: int) -> list[str]:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(blob), step):
            yield blob[i : i + step]

    async def run() -> bytes:
        return b"".join([c async for c in _without_special(chunks())])

    with tarfile.open(fileobj=io.BytesIO(asyncio.run(run()))) as t:
        return [m.name for m in t]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
@pytest.mark.parametrize("step", [1, 511, 4096, 1 << 20])
def test_special_members_are_left_out_of_a_download(fmt: int, step: int) -> None:
    long = "d/" + "x" * 300  # a pax or GNU long-name record before it
    members = [
        (_member("a", data=b"A" * 700), b"A" * 700),
        (_member("p", tarfile.FIFOTYPE), b""),
        (_member("c", tarfile.CHRTYPE), b""),
        (_member("q" * 200 + "/fifo", tarfile.FIFOTYPE), b""),  # its long name goes with it
        (_member(long, data=b"L"), b"L"),
        (_member("b", tarfile.BLKTYPE), b""),
        (_member("s", tarfile.SYMTYPE, link="a"), b""),
    ]
    assert _filtered(_tar(members, fmt), step) == ["a", long, "s"]


def test_a_special_member_with_data_is_dropped_whole() -> None:
    """A sandbox's own tar could say a FIFO carries data: the filter drops it and stays in step."""
    fifo = bytearray(_member("p", tarfile.FIFOTYPE).tobuf(tarfile.USTAR_FORMAT))
    fifo[124:136] = b"%011o\0" % 1000
    fifo[148:156] = b" " * 8
    fifo[148:156] = b"%06o\0 " % sum(fifo)
    blob = bytes(fifo) + b"Z" * 1024 + _tar([(_member("after", data=b"ok"), b"ok")], tarfile.USTAR_FORMAT)
    assert _filtered(blob, 100) == ["after"]


def test_an_upload_is_cut_where_a_member_lies_under_its_own_symlink() -> None:
    members = [
        (_member("d", tarfile.DIRTYPE), b""),
        (_member("link", tarfile.SYMTYPE, link="/etc"), b""),
        (_member("f", data=b"x"), b"x"),
        (_member("link/pwned", data=b"y"), b"y"),  # the guest's tar must have made "link" first
        (_member("h", tarfile.LNKTYPE, link="f"), b""),
        (_member("s", tarfile.SYMTYPE, link="f"), b""),
        (_member("s", data=b"z"), b"z"),  # replaces its own symlink: a part of its own too
    ]
    with tarfile.open(fileobj=io.BytesIO(_tar(members, tarfile.PAX_FORMAT))) as src:
        parts = _checked_parts(src, "/up", 1 << 20)
        assert [[m.name for m in p] for p in parts] == [["d", "link", "f"], ["link/pwned", "h", "s"], ["s"]]
        rewritten = b"".join(_tar_stream(src, parts[0] + parts[1], 1000, 1001, 1 << 20))
    with tarfile.open(fileobj=io.BytesIO(rewritten)) as out:
        got = {m.name: (m.uid, m.gid, m.mode) for m in out}
    assert got["f"] == (1000, 1001, 0o755)  # owned by the caller, setuid dropped
    assert got["h"][:2] == (1000, 1001)


def test_an_upload_checked_on_the_host_refuses_at_once() -> None:
    hard = _tar([(_member("h", tarfile.LNKTYPE, link="/etc/passwd"), b"")], tarfile.PAX_FORMAT)
    big = _tar([(_member("big", data=b"x" * 4096), b"x" * 4096)], tarfile.PAX_FORMAT)
    for blob, kind in ((hard, "invalid_path"), (big, "too_large")):
        with tarfile.open(fileobj=io.BytesIO(blob)) as src, pytest.raises(FileOpError) as exc:
            _checked_parts(src, "/up", 1024)
        assert exc.value.kind == kind
