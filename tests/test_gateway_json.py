"""The gateway's JSON (cluster/json_codec.py): pydantic-core's reader and writer, with the stdlib's
meaning."""

from __future__ import annotations

import enum
import json
import math

import pytest

from sandfleet.cluster.json_codec import dumps, finite, loads

pytestmark = pytest.mark.unit


class Kind(enum.StrEnum):
    A = "a"


VALUES = [
    {"a": 1, "b": [1.5, -0.0, 1e16, 1e-7, 2**63 - 1, -(2**63), 2**70], "c": None, "d": True, "e": 'ñ\n"\\\u2603\x00'},
    {1: "int key", 2.5: "float key", Kind.A: Kind.A},
    (1, "tuple"),
    [],
    "plain",
    "\ud800 a lone surrogate",
    "NaN and Infinity in a string",
]


@pytest.mark.parametrize("value", VALUES)
def test_what_is_written_is_what_the_stdlib_writes(value: object) -> None:
    out = dumps(value)
    assert json.loads(out) == json.loads(json.dumps(value, separators=(",", ":"), allow_nan=False))
    assert b", " not in out and b": " not in out.replace(b'": "', b"")  # compact


def test_nan_and_infinities_are_refused_or_written_as_the_stdlib_does() -> None:
    for value in (float("nan"), [1.0, float("inf")], {"ttl": -float("inf")}, {"big": 10**400, "x": float("nan")}):
        with pytest.raises(ValueError):
            dumps(value)
        assert dumps(value, allow_nan=True) == json.dumps(value, separators=(",", ":")).encode()
    assert "ñ".encode() in dumps("ñ")  # UTF-8, not \u escapes


def test_reading_refuses_what_is_not_json_and_keeps_big_integers() -> None:
    for text in (b"NaN", b"[Infinity]", b'{"a": -Infinity}', b"{", b"", b"\xff", b"[1,]"):
        with pytest.raises(ValueError):
            loads(text)
    assert loads(b"123456789012345678901234567890") == 123456789012345678901234567890
    assert loads(bytearray(b'{"a": 1, "a": 2}')) == {"a": 2}  # the last of a repeated key, as the stdlib
    assert math.copysign(1, loads(b"-0.0")) == -1


def test_a_number_past_a_floats_range_is_found() -> None:
    assert finite(loads(b'{"a": [1, 2.5, {"b": 1e308}], "c": "1e400"}'))
    for text in (b'{"max_lifetime": 1e400}', b'{"a": [{"b": [-1e999]}]}'):
        assert not finite(loads(text))
