#!/usr/bin/env python3
"""Terminals, in one run on one daemon: `python3 bench/terminal.py` (as root).

Measured through the async SDK over the daemon's unix socket, against a busybox sandbox:

  a) open: `sb.terminal("cat")` until the daemon's `started`, against `sb.exec("true")` (the plain
     request floor), interleaved, N each;
  b) keystroke echo: one byte sent, its echo back from the sandbox's line discipline (cooked mode:
     the kernel echoes), N in a row: what a person typing waits on;
  c) output throughput: 64 MiB written to the terminal (`head -c ... /dev/zero`) and read by the
     client, against the same bytes through `exec_stream` (pipes), interleaved, 3 rounds each.

    python3 bench/terminal.py [--n 200] [--mib 64] [--rounds 3]

Results: bench/results/terminal.json and terminal.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from common import Daemon, remove_cgroup_tree, stats  # noqa: E402
from sandfleet import AsyncClient, AsyncSandbox  # noqa: E402

RESULTS = HERE / "results"


async def opens(sb: AsyncSandbox, n: int) -> dict[str, Any]:
    term_s, exec_s = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        t = await sb.terminal("cat")
        term_s.append(time.perf_counter() - t0)
        await t.aclose()
        t0 = time.perf_counter()
        await sb.exec("true")
        exec_s.append(time.perf_counter() - t0)
    return {"terminal_open": stats(term_s), "exec_true": stats(exec_s)}


async def echoes(sb: AsyncSandbox, n: int) -> dict[str, Any]:
    rtts = []
    async with await sb.terminal("cat") as t:
        for i in range(n):
            ch = bytes([ord("a") + i % 26])
            t0 = time.perf_counter()
            await t.send(ch)
            await t.expect(ch, timeout=10)
            rtts.append(time.perf_counter() - t0)
    return {"keystroke_echo": stats(rtts)}


async def throughput(sb: AsyncSandbox, mib: int, rounds: int) -> dict[str, Any]:
    size = mib * 1024**2
    cmd = f"head -c {size} /dev/zero"
    term_rates, pipe_rates = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        got = 0
        async with await sb.terminal(["sh", "-c", cmd]) as t:
            while data := await t.read(timeout=60):
                got += len(data)
            await t.wait(60)
        term_rates.append(got / 1024**2 / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        got = 0
        async with sb.exec_stream(cmd, output_limit=size, binary=True) as events:
            async for ev in events:
                if ev.type == "stdout":
                    got += len(ev.data) * 3 // 4
        pipe_rates.append(got / 1024**2 / (time.perf_counter() - t0))
    return {
        "terminal_mib_s": sorted(term_rates)[len(term_rates) // 2],
        "exec_stream_mib_s": sorted(pipe_rates)[len(pipe_rates) // 2],
        "rounds": rounds,
        "mib": mib,
    }


async def run(sock: Path, n: int, mib: int, rounds: int) -> dict[str, Any]:
    async with AsyncClient(sock, timeout=300) as fleet:
        sb = await fleet.create(image="busybox", idle_ttl=3600)
        try:
            out: dict[str, Any] = {}
            out |= await opens(sb, n)
            out |= await echoes(sb, n)
            out |= await throughput(sb, mib, rounds)
            return out
        finally:
            await sb.stop()


def report(r: dict[str, Any]) -> str:
    def ms(s: dict[str, Any]) -> str:
        return f"{s['p50_ms']:.2f} ms (p99 {s['p99_ms']:.2f})"

    lines = [
        "# Terminals",
        "",
        f"`python3 bench/terminal.py --n {r['n']} --mib {r['mib']} --rounds {r['rounds']}`, {r['when']}, busybox,",
        "async SDK over the daemon's unix socket (a WebSocket per terminal).",
        "",
        "| figure | value | peer in the same run |",
        "|---|---|---|",
        f'| open: `sb.terminal("cat")` to `started`, p50 | {ms(r["terminal_open"])} '
        f'| `exec("true")` {ms(r["exec_true"])} |',
        f"| keystroke to its echo, p50 | {ms(r['keystroke_echo'])} | |",
        f"| output to the client, {r['mib']} MiB, median of {r['rounds']} | {r['terminal_mib_s']:.0f} MiB/s | "
        f"`exec_stream` (pipes, base64 over ndjson) {r['exec_stream_mib_s']:.0f} MiB/s |",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sandfleet-bench-term-"))
    tmp.chmod(0o755)
    cgroup_parent = f"/sandfleet-bench-term-{tmp.name}"
    d = Daemon(tmp / "daemon", cgroup_parent)
    try:
        d.start()
        r = asyncio.run(run(d.socket, args.n, args.mib, args.rounds))
    finally:
        d.stop()
        remove_cgroup_tree(cgroup_parent)
        shutil.rmtree(tmp, ignore_errors=True)
    r |= {"n": args.n, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    for key in ("terminal_open", "exec_true", "keystroke_echo"):
        r[key].pop("samples_ms", None)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "terminal.json").write_text(json.dumps(r, indent=2) + "\n")
    (RESULTS / "terminal.md").write_text(report(r))
    print(report(r))


if __name__ == "__main__":
    main()
