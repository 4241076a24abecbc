"""Generate the protobuf modules of sandfleet/e2b/_proto/ from the .proto files beside them.

The .proto files are the source of truth (E2B's envd services, as its SDKs call them); protoc
(grpcio-tools) writes `<name>_pb2.py` and `<name>_pb2.pyi`. `python3 scripts/gen_e2b_proto.py`
rewrites them; `--check` fails if one is stale.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc  # type: ignore[import-untyped]

PROTO = Path(__file__).resolve().parent.parent / "src" / "sandfleet" / "e2b" / "_proto"


def generate(out: Path) -> None:
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    sources = sorted(p.name for p in PROTO.glob("*.proto"))
    argv = ["protoc", f"-I{PROTO}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", *sources]
    if protoc.main(argv) != 0:
        raise SystemExit("protoc failed")


def main() -> int:
    check = "--check" in sys.argv[1:]
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for made in sorted(Path(tmp).iterdir()):
            target = PROTO / made.name
            if check:
                if not target.exists() or target.read_text() != made.read_text():
                    stale.append(made.name)
            else:
                target.write_text(made.read_text())
    if stale:
        sys.exit(f"stale generated modules in {PROTO}: {', '.join(stale)} (run scripts/gen_e2b_proto.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
