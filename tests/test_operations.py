"""The operations' declarations (sandfleet/operations.py) against the API they make: one declaration per
operation of docs/openapi.json and one operation per declaration, each scoped as its path and method say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sandfleet.operations import OPERATIONS

pytestmark = pytest.mark.unit

SPEC = json.loads((Path(__file__).resolve().parent.parent / "docs" / "openapi.json").read_text())
SPEC_OPS = sorted(
    (m.upper(), path)
    for path, ops in SPEC["paths"].items()
    for m in ops
    if m in ("get", "post", "put", "patch", "delete", "head", "options")
)


def _bare(path: str) -> str:
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", path)


def test_each_operation_of_the_api_is_declared_once() -> None:
    declared = sorted((m, _bare(op.path)) for op in OPERATIONS for m in op.methods)
    assert len(set(declared)) == len(declared), "declared twice"
    assert declared == SPEC_OPS
    assert len({op.name for op in OPERATIONS}) == len(OPERATIONS)


def test_a_scope_names_what_the_path_names() -> None:
    for op in OPERATIONS:
        wanted = {"sandbox": "{sandbox_id}", "snapshot": "{snapshot_id}", "trajectory": "{trajectory_id}"}.get(op.scope)
        if wanted is not None:
            assert wanted in op.path, op.name
        elif op.path.startswith(("/v1/sandboxes/{", "/v1/snapshots/{", "/v1/trajectories/{")):
            pytest.fail(f"{op.name} names an object in its path but is scoped {op.scope}")


def test_access_follows_the_method() -> None:
    for op in OPERATIONS:
        if op.name == "to_port":  # what the sandbox's server answers: acting or reading as its method says
            continue
        if op.name == "terminal_doc":  # a WebSocket's GET: the terminal it opens acts
            assert op.access == "write"
            continue
        if op.methods == ("GET",):
            assert op.access in ("read", "root"), op.name
        else:
            assert op.access in ("write", "admin"), op.name
        if op.access in ("root", "admin"):
            assert op.needs, f"{op.name}: the refusal says what needs the root"
        if op.gateway == "node_only":
            assert op.why, f"{op.name}: why a gateway does not pass it on"
