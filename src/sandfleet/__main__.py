"""`sandfleet` / `python -m sandfleet`: the command line, with a clear word when its extra is missing."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from sandfleet.cli import main as cli
    except ModuleNotFoundError as exc:  # an SDK-only install: pydantic and httpx, no typer/rich/fastapi
        sys.stderr.write(f"sandfleet: the command line needs {exc.name!r}: pip install 'sandfleet[node]'\n")
        raise SystemExit(1) from exc
    cli()


if __name__ == "__main__":
    main()
