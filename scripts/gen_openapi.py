"""Write docs/openapi.json: the OpenAPI document FastAPI derives from `sandfleet.daemon.api.create_app`.

    python scripts/gen_openapi.py           # regenerate docs/openapi.json
    python scripts/gen_openapi.py --check   # exit 1 if the checked-in copy is stale

Building the schema calls nothing of the node: empty stand-ins for it and for its tenancy (no projects) do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from sandfleet.daemon.api import create_app
from sandfleet.daemon.node.metrics import Metrics

OUT = Path(__file__).resolve().parent.parent / "docs" / "openapi.json"


def openapi() -> dict[str, Any]:
    # The document depends on the routes only: no service is called while deriving it.
    return create_app(SimpleNamespace(), SimpleNamespace(iam=None), Metrics()).openapi()  # type: ignore[arg-type]


def render() -> str:
    return json.dumps(openapi(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            sys.stderr.write(f"{OUT} is stale: run `python scripts/gen_openapi.py`\n")
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    sys.stdout.write(f"wrote {OUT}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
