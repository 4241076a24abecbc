"""Helpers compiled at setup, found by the daemon instead of running a compiler when it starts.

`python3 -m sandfleet.runtime.prebuild` (scripts/setup.sh runs it) compiles the agent, the launcher
and criu's shim into `prebuilt_dir()`, under the same content keys the daemon's own caches use; the
daemon copies a prebuilt file into its cache the first time it needs one (runtime/agent.py
build_static, runtime/criu.py build_shim) and compiles only when none was prebuilt.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path


def prebuilt_dir() -> Path:
    """Where setup leaves the helpers it compiled (`python3 -m sandfleet.runtime.prebuild`), so the
    daemon copies them instead of running a compiler at start (a guest image needs a prebuilt agent
    anyway). `SANDFLEET_PREBUILT` overrides it."""
    return Path(os.environ.get("SANDFLEET_PREBUILT") or Path(sys.prefix) / "lib" / "sandfleet" / "prebuilt")


def install_prebuilt(key: str, name: str, target: Path) -> bool:
    """Copy the prebuilt `key/name` to `target` (atomically); whether there was one. The daemon's
    own copy keeps the path it always had: snapshots name the agent build by it."""
    source = prebuilt_dir() / key / name
    if not source.is_file():
        return False
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=target.parent)
    os.close(fd)
    try:
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return True
