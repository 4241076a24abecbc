"""Per-tier options in a sandbox's spec: one model per tier, told apart by `type`, which must be the
sandbox's own tier (no root: validation, the wire form, and which specs a warm pool may serve)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandfleet import ContainerOptions, SandboxSpec
from sandfleet.daemon.node.pool import pool_key

pytestmark = pytest.mark.unit


def test_container_options_on_a_container_sandbox() -> None:
    spec = SandboxSpec.model_validate({"image": "busybox", "options": {"type": "container", "nofile": 512}})
    assert spec.options == ContainerOptions(nofile=512)
    assert SandboxSpec.model_validate_json(spec.model_dump_json()) == spec
    # The SDK sends what was set: the tag goes too, or the node could not tell the tier's model.
    sent = SandboxSpec(image="busybox", options=ContainerOptions(nofile=256)).model_dump(
        mode="json", exclude_unset=True
    )
    assert sent["options"] == {"type": "container", "nofile": 256}


@pytest.mark.parametrize(
    ("data", "error"),
    [
        ({"backend": "microvm", "options": {"type": "container"}}, "options are for the container tier"),
        ({"options": {"type": "quantum"}}, "does not match any of the expected tags"),
        ({"options": {"type": "container", "nofile": 1}}, "greater than or equal to 64"),
        ({"options": {"type": "container", "bogus": 1}}, "Extra inputs are not permitted"),
    ],
)
def test_options_that_do_not_fit(data: dict[str, object], error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        SandboxSpec.model_validate({"image": "busybox", **data})


def test_a_warm_pool_never_serves_a_spec_with_options() -> None:
    assert pool_key(SandboxSpec(image="busybox")) is not None
    assert pool_key(SandboxSpec(image="busybox", options=ContainerOptions(nofile=256))) is None
