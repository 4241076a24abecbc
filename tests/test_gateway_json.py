"""The gateway's JSON (cluster/json_codec.py): the fast libraries, with the stdlib's meaning."""

from __future__ import annotations

import json
import math

import pytest

from sandfleet.cluster.json_codec import dumps, loads

pytestmark = pytest.mark.unit

VALUES = [
    {"a": 1, "b": [1.5, -0.0, 1e16, 2**63 - 1, -(2**63)], "c": None, "d": True, "e": 'ñ\n"\\\u2603\x00'},
    [],
    "plain",
    2**64 - 1,
]


@pytest.mark.parametrize("value", VALUES)
def test_what_is_written_reads_back_as_the_stdlib_reads_its_own(value: object) -> None:
    out = dumps(value)
    assert isinstance(out, bytes)
    assert json.loads(out) == json.loads(json.dumps(value)) == loads(out)
    assert b" " not in out.replace(b"\\", b"")  # compact, as the stdlib's separators
    assert "ñ".encode() in dumps("ñ")  # UTF-8, not \u escapes


def test_what_orjson_refuses_the_stdlib_writes() -> None:
    """Integers beyond 64 bits and keys that are not strings: written as the stdlib writes them."""
    for value in ({"n": 2**70}, {1: "a", 2.5: "b"}, [-(2**65)]):
        assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def test_reading_refuses_what_is_not_json_and_keeps_big_integers() -> None:
    for text in (b"NaN", b"[Infinity]", b'{"a": -Infinity}', b"{", b"", b"\xff", b"[1,]"):
        with pytest.raises(ValueError):
            loads(text)
    assert loads(b"123456789012345678901234567890") == 123456789012345678901234567890
    assert loads(bytearray(b'{"a": 1, "a": 2}')) == {"a": 2}  # the last of a repeated key, as the stdlib
    assert math.copysign(1, loads(b"-0.0")) == -1
