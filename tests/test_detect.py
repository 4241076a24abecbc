"""The red-team part: each misbehaviour detector fires on its behaviour in a real sandbox, with the
action the node's policy gives it (record, pause, kill), as a typed finding in the sandbox's events
and the audit stream; a normal workload gives none."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from sandfleet import Client
from sandfleet.errors import NotFoundError

from conftest import Daemon, destroy_daemon, make_daemon, wait_until

PROXY_TRIES = (
    "import sys, urllib.request\n"
    "for i in range(int(sys.argv[1])):\n"
    "    port = int(sys.argv[2]) + (i if sys.argv[3] == 'scan' else 0)\n"
    "    try: urllib.request.urlopen(f'http://scanme.example:{port}/', timeout=5)\n"
    "    except Exception: pass\n"
)


@pytest.fixture(scope="module")
def detd() -> Iterator[Daemon]:
    d = make_daemon(
        "detect",
        "monitor_interval = 0.3\n"
        "[detectors.connection_flood]\nthreshold = 60\n"
        '[detectors.fork_flood]\naction = "kill"\nthreshold = 20\n'
        '[detectors.output_flood]\naction = "pause"\nthreshold = 3\n'
        "[detectors.oom_repeat]\nthreshold = 2\n"
        "[detectors.cpu_mining]\nwindow = 3.0\nratio = 0.8\n",
    )
    d.start()
    yield d
    destroy_daemon(d)


@pytest.fixture()
def fleet(detd: Daemon) -> Iterator[Client]:
    with detd.client(timeout=120) as c:
        yield c


def findings(fleet: Client, sandbox_id: str) -> list[dict[str, Any]]:
    return [dict(e.data) for e in fleet.get(sandbox_id).events() if e.kind == "finding"]


def wait_finding(fleet: Client, sandbox_id: str, detector: str, timeout: float = 20) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    def seen() -> bool:
        found[:] = [f for f in findings(fleet, sandbox_id) if f["detector"] == detector]
        return bool(found)

    assert wait_until(seen, timeout), f"no {detector} finding; got {findings(fleet, sandbox_id)}"
    return found[0]


def audited(fleet: Client, sandbox_id: str, detector: str) -> bool:
    recs = fleet.audit(kinds=["finding"], sandbox_id=sandbox_id).records
    return any(r.data.get("detector") == detector for r in recs)


def test_port_scan(fleet: Client) -> None:
    with fleet.create(image="python", network=["pypi"], labels={"job": "scan"}) as sb:
        sb.exec(["python3", "-c", PROXY_TRIES, "25", "1000", "scan"], timeout=120)
        f = wait_finding(fleet, sb.id, "port_scan")
        assert f["action"] == "record" and f["evidence"]["count"] >= 20 and f["sandbox_id"] == sb.id
        assert any("scanme.example:10" in s for s in f["evidence"]["sample"])
        assert audited(fleet, sb.id, "port_scan")
        recs = fleet.audit(kinds=["finding"], sandbox_id=sb.id).records
        assert recs[0].labels == {"job": "scan"}
        assert sb.exec("true").exit_code == 0  # record: it keeps running


def test_connection_flood(fleet: Client) -> None:
    with fleet.create(image="python", network=["pypi"]) as sb:
        sb.exec(["python3", "-c", PROXY_TRIES, "70", "81", "same"], timeout=120)
        f = wait_finding(fleet, sb.id, "connection_flood")
        assert f["evidence"]["count"] >= 60
        assert not [x for x in findings(fleet, sb.id) if x["detector"] == "port_scan"]  # one destination


def test_fork_flood_is_killed(fleet: Client) -> None:
    sb = fleet.create(image="python", resources={"pids": 16})
    bomb = (
        "import os, time\n"
        "for i in range(300):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(30); os._exit(0)\n"
        "    except OSError:\n"
        "        pass\n"
    )
    sb.start(["python3", "-c", bomb])

    def gone() -> bool:
        try:
            return fleet.get(sb.id).info.state in ("stopped", "stopping")
        except NotFoundError:  # this daemon keeps no stopped sandboxes (stopped_retention = 0)
            return True

    assert wait_until(gone, 20)
    recs = [r for r in fleet.audit(kinds=["finding"], sandbox_id=sb.id).records if r.data["detector"] == "fork_flood"]
    assert recs and recs[0].data["action"] == "kill" and recs[0].data["evidence"]["count"] >= 20
    stops = [r for r in fleet.audit(kinds=["api"], sandbox_id=sb.id).records if r.data["method"] == "DELETE"]
    assert not stops  # the node stopped it, nobody asked


def test_output_flood_is_paused(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        for _ in range(3):
            r = sb.exec("yes | head -c 100000", output_limit=1000)
            assert r.stdout_truncated
        f = wait_finding(fleet, sb.id, "output_flood")
        assert f["action"] == "pause"
        assert wait_until(lambda: fleet.get(sb.id).info.state == "paused", 10)


def test_repeated_oom(fleet: Client) -> None:
    with fleet.create(image="python", resources={"memory": "96MiB"}) as sb:
        for _ in range(2):
            r = sb.exec("python3 -c 'x = bytearray(400 * 2**20)'", timeout=60)
            assert r.exit_code != 0
        f = wait_finding(fleet, sb.id, "oom_repeat")
        assert f["evidence"]["count"] >= 2


def test_cpu_at_its_limit(fleet: Client) -> None:
    with fleet.create(image="busybox", resources={"cpu": 0.5}) as sb:
        sb.start("while :; do :; done")
        f = wait_finding(fleet, sb.id, "cpu_mining", timeout=30)
        assert f["evidence"]["cpu_limit"] == 0.5


def test_system_binary_replaced(fleet: Client) -> None:
    with fleet.create(image="python") as sb:
        sb.exec("printf '#!/bin/sh\\necho pwned\\n' > /usr/bin/env && chmod +x /usr/bin/env && rm -f /usr/bin/tr")
        f = wait_finding(fleet, sb.id, "system_binaries")
        assert set(f["evidence"]["paths"]) >= {"/usr/bin/env", "/usr/bin/tr"}


def test_attempts_on_the_agent(fleet: Client) -> None:
    with fleet.create(image="busybox") as sb:
        r = sb.exec("kill -TERM 1; echo rc=$?")
        assert "rc=1" in r.stdout or "rc=" in r.stdout
        f = wait_finding(fleet, sb.id, "agent_attack")
        assert f["evidence"]["count"] >= 1
        assert sb.exec("echo alive").stdout == "alive\n"
        assert any(e.kind == "agent_attack" for e in sb.events())


def test_normal_work_is_silent(fleet: Client) -> None:
    """Creates, commands, files, a compile-sized CPU burst, a package index fetch: no finding."""
    with fleet.create(image="python", network=["pypi"], resources={"cpu": 1}) as sb:
        sb.files.write("/work/a.py", b"print(sum(range(10**6)))\n")
        for _ in range(10):
            assert sb.exec("python3 /work/a.py").exit_code == 0
        sb.exec("python3 -c 'import time; t = time.time()\nwhile time.time() - t < 1.5: pass'")
        sb.exec("for i in 1 2 3 4 5 6 7 8; do sleep 0.2 & done; wait")
        sb.exec("pip download --no-deps -d /tmp/dl --retries 0 --timeout 10 six 2>/dev/null; true", timeout=120)
        time.sleep(1.0)  # a few monitor sweeps
        assert findings(fleet, sb.id) == []
