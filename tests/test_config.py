"""The daemon's configuration: tiers as a list of typed tables, the one-tier `[container]` form,
and the errors of a config that cannot be served (no root, no daemon)."""

from __future__ import annotations

import tomllib

import pytest
from pydantic import ValidationError

from sandfleet.backends.config import ContainerBackendConfig, FncallBackendConfig, VMBackendConfig
from sandfleet.daemon.config import DaemonConfig

pytestmark = pytest.mark.unit


def _load(text: str) -> DaemonConfig:
    return DaemonConfig.model_validate(tomllib.loads(text))


def test_the_default_is_the_container_tier_and_its_calls() -> None:
    cfg = DaemonConfig()
    assert [b.type for b in cfg.backends] == ["container", "fncall"]
    assert cfg.container == ContainerBackendConfig()


def test_backends_tables_with_a_type() -> None:
    cfg = _load('[[backends]]\ntype = "container"\nruntime = "crun"\nuid_base = 200000\n')
    assert isinstance(cfg.backends[0], ContainerBackendConfig)
    assert (cfg.container.runtime, cfg.container.uid_base) == ("crun", 200000)


def test_a_container_table_is_the_container_tier() -> None:
    cfg = _load('[container]\nruntime = "runc"\n')
    assert [b.type for b in cfg.backends] == ["container", "fncall"]
    assert cfg.container.runtime == "runc"


def test_every_tier_has_a_table() -> None:
    cfg = _load(
        '[[backends]]\ntype = "microvm"\naccel = "tcg"\n[[backends]]\ntype = "vm"\n'
        '[[backends]]\ntype = "fncall"\nmax_workers = 8\npreload = ["json"]\n'
    )
    assert [b.type for b in cfg.backends] == ["microvm", "vm", "fncall"]
    assert isinstance(cfg.backends[0], VMBackendConfig) and cfg.backends[0].accel == "tcg"
    assert isinstance(cfg.backends[2], FncallBackendConfig) and cfg.backends[2].preload == ["json"]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('[[backends]]\ntype = "quantum"\n', "does not match any of the expected tags"),
        ('[[backends]]\nruntime = "crun"\n', "Unable to extract tag"),
        ('[[backends]]\ntype = "container"\n[[backends]]\ntype = "container"\n', "each tier may be configured once"),
        ('[container]\n[[backends]]\ntype = "container"\n', "not both"),
        ('[[backends]]\ntype = "container"\nbogus = 1\n', "Extra inputs are not permitted"),
        ("backends = []\n", "at least 1 item"),
        ('[[backends]]\ntype = "microvm"\naccel = "hvf"\n', "Input should be"),
        ('[[backends]]\ntype = "fncall"\nmax_workers = 0\n', "greater than or equal to 1"),
    ],
)
def test_configs_that_cannot_be_served(text: str, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        _load(text)
