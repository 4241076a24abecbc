"""Failpoints: named places where a daemon started with `SANDFLEET_FAILPOINTS=name,...` in its
environment kills itself with SIGKILL, so tests can put a crash exactly where one hurts (between a
create's commit and its answer, say). Unset, each check is one frozenset lookup."""

from __future__ import annotations

import os
import signal

ACTIVE = frozenset(filter(None, os.environ.get("SANDFLEET_FAILPOINTS", "").split(",")))


def hit(name: str) -> None:
    """Die here, as a crash would, if the failpoint `name` is active."""
    if name in ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
