"""Exec round trips into one running sandbox."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common import daemon_metrics, metrics_delta, stats


def bench_exec(fleet: Any, n: int, labels: dict[str, str], sock: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with fleet.create(image="busybox", labels=labels) as sb:
        for name, cmd, want in (
            ('exec("true")', "true", ""),
            ('exec("echo hi")', "echo hi", "hi\n"),
            ('exec(["true"]) (argv, no shell)', ["true"], ""),
        ):
            for _ in range(20):
                sb.exec(cmd)
            m0 = daemon_metrics(sock)
            xs = []
            for _ in range(n):
                t0 = time.perf_counter()
                r = sb.exec(cmd)
                xs.append(time.perf_counter() - t0)
                if r.exit_code != 0 or r.stdout != want:
                    raise RuntimeError(f"exec {cmd!r} gave {r}")
            m1 = daemon_metrics(sock)
            out[name] = {"stats": stats(xs), "daemon_side_mean_ms": metrics_delta(m0, m1, "exec")}
    return out
