"""Generate src/sandfleet/client/sync/ from client/aio/ (the async client is the source of truth).

Like httpcore's unasync: the blocking client is the async one with the awaits taken out, so the two
can never drift. Each module of the async package becomes the module of the same name in the
blocking one. `python3 scripts/gen_sync_client.py` rewrites them; `--check` fails if one is stale
(or is in sync/ without an async source).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

CLIENT = Path(__file__).resolve().parent.parent / "src" / "sandfleet" / "client"
AIO, SYNC = CLIENT / "aio", CLIENT / "sync"

REPLACEMENTS = [
    (
        '"""`AsyncClient`: the asyncio SDK. Mirrors `sandfleet.client.sync` call for call.\n',
        '"""`Client`: the blocking SDK, generated from the asyncio one (client/aio/): do not edit.\n',
    ),
    ("sandfleet.client.aio", "sandfleet.client.sync"),
    ("_AsyncCalls", "_Calls"),
    ("AsyncIterator", "Iterator"),
    ("AsyncGenerator", "Generator"),
    ("AsyncHTTPTransport", "HTTPTransport"),
    ("httpx.AsyncBaseTransport", "httpx.BaseTransport"),
    ("httpx.AsyncClient", "httpx.Client"),
    ("AsyncClient", "Client"),
    ("AsyncEventStream", "EventStream"),
    ("b.AsyncConnection", "b.Connection"),
    ("await lane.call(", "lane.call_sync("),
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


def generate(source: Path) -> str:
    """The blocking twin of the async module `source`."""
    target = SYNC / source.name
    text = source.read_text()
    # What only an event loop can do (coalescing calls made in the same turn of it) has no blocking twin.
    text = re.sub(r"\n[ \t]*# async-only: begin\n.*?# async-only: end\n", "\n", text, flags=re.S)
    for old, new in REPLACEMENTS:
        text = text.replace(old, new)
    if "time.sleep(" in text and "\nimport time\n" not in text:  # was asyncio.sleep
        text = text.replace(
            "from __future__ import annotations\n", "from __future__ import annotations\n\nimport time\n", 1
        )
    text = f"# Generated from client/aio/{source.name} by scripts/gen_sync_client.py: do not edit.\n" + text
    # Renamed imports (AsyncGenerator -> Generator) may fall out of order, and those only the async
    # code used (asyncio's, what async-only blocks need) are left over: let isort and ruff fix them.
    text = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", "I,F401", "--fix", "--quiet", "--exit-zero"]
        + ["--stdin-filename", str(target), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Lines get shorter without `async`/`await`: let the formatter re-wrap them.
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--stdin-filename", str(target), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
    )
    return formatted.stdout


def main() -> int:
    wanted = {SYNC / source.name: generate(source) for source in sorted(AIO.glob("*.py"))}
    if "--check" in sys.argv:
        stale = [path for path, text in wanted.items() if not path.exists() or path.read_text() != text]
        stale += [path for path in SYNC.glob("*.py") if path not in wanted]
        for path in stale:
            rel = path.relative_to(CLIENT.parent.parent)
            sys.stderr.write(f"{rel} is stale: run python3 scripts/gen_sync_client.py\n")
        return 1 if stale else 0
    SYNC.mkdir(exist_ok=True)
    for path in SYNC.glob("*.py"):
        if path not in wanted:
            path.unlink()
    for path, text in wanted.items():
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
