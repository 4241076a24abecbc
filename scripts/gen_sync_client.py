"""Generate src/sandfleet/client/sync.py from aio.py (the async client is the source of truth).

Like httpcore's unasync: the blocking client is the async one with the awaits taken out, so the two
can never drift. `python3 scripts/gen_sync_client.py` rewrites the file; `--check` fails if stale.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parent.parent / "src" / "sandfleet" / "client"

REPLACEMENTS = [
    (
        '"""`AsyncClient`: the asyncio SDK. Mirrors `sandfleet.client.sync` call for call."""',
        '"""`Client`: the blocking SDK. Generated from aio.py by scripts/gen_sync_client.py: do not edit."""',
    ),
    ("AsyncIterator", "Iterator"),
    ("AsyncGenerator", "Generator"),
    ("AsyncHTTPTransport", "HTTPTransport"),
    ("httpx.AsyncBaseTransport", "httpx.BaseTransport"),
    ("httpx.AsyncClient", "httpx.Client"),
    ("AsyncClient", "Client"),
    ("AsyncEventStream", "EventStream"),
    ("__aiter__", "__iter__"),
    ("__anext__", "__next__"),
    ("await anext(", "next("),
    ("await self._items.aclose()", "self._items.close()"),
    ("`aclose()`", "`close()`"),
    ("AsyncSandbox", "Sandbox"),
    ("AsyncProcess", "Process"),
    ("AsyncSession", "Session"),
    ("AsyncFiles", "Files"),
    ("AsyncTrajectory", "Trajectory"),
    ("AsyncTerminal", "Terminal"),
    ("AsyncWebSocketSession", "WebSocketSession"),
    ("aconnect_ws", "connect_ws"),
    ("contextlib.AsyncExitStack()", "contextlib.ExitStack()"),
    ("self._stack.enter_async_context(", "self._stack.enter_context("),
    ("await self._stack.aclose()", "self._stack.close()"),
    ("async def __aenter__", "def __enter__"),
    ("async def __aexit__", "def __exit__"),
    ("async def aclose", "def close"),
    ("await self.aclose()", "self.close()"),
    ("await self._http.aclose()", "self._http.close()"),
    ("async with self._http.stream", "with self._http.stream"),
    ("await resp.aread()", "resp.read()"),
    ("resp.aiter_lines()", "resp.iter_lines()"),
    ("await b.next_line(", "b.next_line_sync("),
    ("await asyncio.to_thread(b.local_tar, Path(local))", "b.local_tar(Path(local))"),
    ("await asyncio.to_thread(b.extract_tar, data, Path(local))", "b.extract_tar(data, Path(local))"),
    ("await asyncio.to_thread(b.recipe_source, recipe, base_dir)", "b.recipe_source(recipe, base_dir)"),
    ("await b.gather_bounded(", "b.gather_bounded_sync("),
    ("await asyncio.sleep(", "time.sleep("),
    ("await self._run_pooled(body)", "self._run_one(body)"),
    ("async for", "for"),
    ("async def", "def"),
    ("async with", "with"),
    ("await ", ""),
    ("import asyncio\n", ""),
    (
        "`async with Client() as fleet: sb = await fleet.create(...)`",
        "`with Client() as fleet: sb = fleet.create(...)`",
    ),
]


def generate() -> str:
    text = (CLIENT / "aio.py").read_text()
    # What only an event loop can do (coalescing calls made in the same turn of it) has no blocking twin.
    text = re.sub(r"\n[ \t]*# async-only: begin\n.*?# async-only: end\n", "\n", text, flags=re.S)
    for old, new in REPLACEMENTS:
        text = text.replace(old, new)
    # Renamed imports (AsyncGenerator -> Generator) may fall out of order: let isort put them back.
    text = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "I", "--fix", "--quiet", "--exit-zero"]
        + ["--stdin-filename", str(CLIENT / "sync.py"), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Lines get shorter without `async`/`await`: let the formatter re-wrap them.
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(CLIENT / "sync.py"), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    )
    return formatted.stdout


def main() -> int:
    target = CLIENT / "sync.py"
    text = generate()
    if "--check" in sys.argv:
        if target.read_text() != text:
            sys.stderr.write("src/sandfleet/client/sync.py is stale: run python3 scripts/gen_sync_client.py\n")
            return 1
        return 0
    target.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
