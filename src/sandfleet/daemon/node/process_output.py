"""Following a background process's output as it comes: what it printed so far, each chunk after,
then its exit (the same ExecEvent lines as a streamed exec)."""

from __future__ import annotations

import asyncio
import codecs
from collections.abc import AsyncGenerator

from sandfleet.daemon.node.core import EventStream, wire_text
from sandfleet.daemon.node.lifecycle import BackgroundProcess, Sandbox
from sandfleet.errors import WrongStateError
from sandfleet.models import ExecEvent


def follow(sb: Sandbox, bp: BackgroundProcess) -> EventStream[ExecEvent]:
    """Subscribed at once (no await before): no chunk falls between what was kept and what follows."""
    queue: asyncio.Queue[tuple[str, bytes] | None] = asyncio.Queue()
    kept = [(stream, bytes(buf)) for stream, buf in (("stdout", bp.stdout), ("stderr", bp.stderr)) if buf]
    finished = bp.done.is_set()
    if not finished:
        bp.followers.append(queue)

    def text(stream: str, data: bytes) -> str:
        if bp.encoding == "base64":
            return wire_text(data, "base64")
        return decoders[stream].decode(data)

    decoders = {s: codecs.getincrementaldecoder("utf-8")("replace") for s in ("stdout", "stderr")}

    async def events() -> AsyncGenerator[ExecEvent, None]:
        if finished:
            if bp.result is not None:  # its output is in its result now
                for stream in ("stdout", "stderr"):
                    if data := getattr(bp.result, stream):
                        yield ExecEvent(type=stream, data=data)
        else:
            for stream, data in kept:
                yield ExecEvent(type=stream, data=text(stream, data))
            while (item := await queue.get()) is not None:
                if data := text(*item):
                    yield ExecEvent(type=item[0], data=data)
            if bp.encoding != "base64":
                for stream, decoder in decoders.items():
                    if tail := decoder.decode(b"", final=True):  # a character cut at the end
                        yield ExecEvent(type=stream, data=tail)
        if bp.result is None:
            why = bp.lost or f"sandbox {sb.id} is {sb.state}"
            raise WrongStateError(f"process {bp.id} ended without an exit status: {why}")
        yield ExecEvent(type="exit", result=bp.result)

    async def release() -> None:
        if queue in bp.followers:
            bp.followers.remove(queue)

    return EventStream(events(), release)
