"""Compile the node's helpers once, at setup: `python3 -m sandfleet.runtime.prebuild [DIR]`.

The agent (static, musl when musl-gcc is installed), the launcher (static) and criu's preload shim
go to DIR (default: `prebuilt.prebuilt_dir()`), each under its content key, so a daemon copies them
instead of compiling when it starts.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sandfleet.runtime import agent_build, criu


def prebuild(target: Path) -> list[Path]:
    target.mkdir(parents=True, exist_ok=True)
    os.environ["SANDFLEET_PREBUILT"] = str(target / "none")  # build here; never copy from an older set
    try:
        return [agent_build.build_agent(target), agent_build.build_launcher(target), criu.build_shim(target)]
    finally:
        del os.environ["SANDFLEET_PREBUILT"]


def main() -> None:
    from sandfleet.runtime.prebuilt import prebuilt_dir

    target = Path(sys.argv[1]) if len(sys.argv) > 1 else prebuilt_dir()
    for path in prebuild(target):
        sys.stdout.write(f"{path}\n")


if __name__ == "__main__":
    main()
