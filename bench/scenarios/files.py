"""The files API's round trips into one running sandbox: a stat, and a list of a directory of 1,000
files (each entry's metadata, its extended attributes included where the tree reads them)."""

from __future__ import annotations

import time
from typing import Any

from common import stats


def bench_files(fleet: Any, n: int, labels: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with fleet.create(image="busybox", labels=labels) as sb:
        made = sb.exec("mkdir -p /work/d && cd /work/d && for i in $(seq 1 1000); do echo x > f$i; done")
        if made.exit_code != 0:
            raise RuntimeError(f"setup failed: {made}")
        for name, call, count in (
            ("stat", lambda: sb.files.stat("/work/d/f1"), n),
            ("list of 1000", lambda: sb.files.list("/work/d"), max(1, n // 10)),
        ):
            for _ in range(5):
                call()
            xs = []
            for _ in range(count):
                t0 = time.perf_counter()
                call()
                xs.append(time.perf_counter() - t0)
            out[name] = stats(xs)
    return out
