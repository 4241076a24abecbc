#!/usr/bin/env python3
"""E2B's SDK against `sandfleet e2b`, side by side with sandfleet's own SDK on the same node, in one
run (as root): `python3 bench/e2b_compat.py [--n 200] [--creates 30]`.

The node daemon listens on TCP with a token; `sandfleet e2b` serves E2B's API over it on another
port, in a process of its own (as it is deployed). Measured, interleaved round by round:

  a) a command: E2B's `sbx.commands.run("true")` against sandfleet's `sb.exec(["/bin/bash", "-l",
     "-c", "true"])`, the command E2B's SDK has run (a login bash: ~3.5 ms of its own here), over TCP
     with the same token, n each into one sandbox of the `python` image: the layer's cost per call;
  b) a sandbox: E2B's `Sandbox.create()` + `commands.run("true")` + `kill()` against sandfleet's
     `create(image="python")` + `exec("true")` + `stop()`, `creates` each.

Results: bench/results/e2b_compat.json and e2b_compat.md (the SPECIFICATION row names them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

import httpx  # noqa: E402
from e2b import Sandbox as E2BSandbox  # noqa: E402

from common import Daemon, remove_cgroup_tree, stats  # noqa: E402
from sandfleet import Client  # noqa: E402

RESULTS = HERE / "results"
TOKEN = "bench-e2b-token-000000000001"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--creates", type=int, default=30)
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="sfb-e2b-"))
    d = Daemon(root, "/sandfleet-bench-e2b")
    api = _port()
    text = d.config.read_text()
    d.config.write_text(f'tcp = "127.0.0.1:{api}"\ntoken = "{TOKEN}"\n' + text)
    listen = f"127.0.0.1:{_port()}"
    upstream = f"http://127.0.0.1:{api}"
    d.start()
    layer = subprocess.Popen(
        [sys.executable, "-m", "sandfleet", "e2b", "--upstream", upstream, "--listen", listen],
        env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
    )
    url = f"http://{listen}"
    opts = {"api_key": TOKEN, "api_url": url, "sandbox_url": url}
    res: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    res["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/templates", headers={"x-api-key": TOKEN}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the E2B layer did not come up")
            time.sleep(0.1)
        with Client(url=upstream, token=TOKEN, timeout=120) as fleet:
            sb = fleet.create(image="python")
            esb = E2BSandbox.create("base", timeout=600, **opts)
            own: list[float] = []
            theirs: list[float] = []
            same = ["/bin/bash", "-l", "-c", "true"]  # what commands.run("true") runs
            for _ in range(10):  # warm both paths
                sb.exec(same)
                esb.commands.run("true")
            for _ in range(a.n):
                t0 = time.perf_counter()
                sb.exec(same)
                own.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                esb.commands.run("true")
                theirs.append(time.perf_counter() - t0)
            res["command"] = {"sandfleet_exec": stats(own), "e2b_commands_run": stats(theirs)}
            sb.stop()
            esb.kill()
            own, theirs = [], []
            for _ in range(a.creates):
                t0 = time.perf_counter()
                s = fleet.create(image="python")
                s.exec("true")
                s.stop()
                own.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                e = E2BSandbox.create("base", **opts)
                e.commands.run("true")
                e.kill()
                theirs.append(time.perf_counter() - t0)
            res["sandbox"] = {"sandfleet": stats(own), "e2b": stats(theirs)}
    finally:
        layer.terminate()
        layer.wait(10)
        d.stop_sandboxes()
        d.stop()
        remove_cgroup_tree(d.cgroup_parent)
        shutil.rmtree(root, ignore_errors=True)
    a.results.mkdir(parents=True, exist_ok=True)
    (a.results / "e2b_compat.json").write_text(json.dumps(res, indent=2) + "\n")
    c, s = res["command"], res["sandbox"]
    added = c["e2b_commands_run"]["p50_ms"] - c["sandfleet_exec"]["p50_ms"]
    slower = s["e2b"]["p50_ms"] - s["sandfleet"]["p50_ms"]
    lines = [
        f"# E2B's SDK through `sandfleet e2b` against sandfleet's SDK ({res['when']}, {res['commit']})",
        "",
        "| figure | sandfleet SDK p50 / p99 | E2B SDK p50 / p99 | added p50 |",
        "|---|---|---|---|",
        f'| a command (`exec(["/bin/bash", "-l", "-c", "true"])` / `commands.run("true")`), n={a.n} | '
        f"{c['sandfleet_exec']['p50_ms']:.2f} / {c['sandfleet_exec']['p99_ms']:.2f} ms | "
        f"{c['e2b_commands_run']['p50_ms']:.2f} / {c['e2b_commands_run']['p99_ms']:.2f} ms | {added:.2f} ms |",
        f"| a sandbox (create, one command, kill), n={a.creates} | "
        f"{s['sandfleet']['p50_ms']:.1f} / {s['sandfleet']['p99_ms']:.1f} ms | "
        f"{s['e2b']['p50_ms']:.1f} / {s['e2b']['p99_ms']:.1f} ms | {slower:.1f} ms |",
    ]
    (a.results / "e2b_compat.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
