"""The gateway's JSON. Every call it places or passes on reads and writes some (a batch of 64 creates:
~150 us with the stdlib), so pydantic-core's parser reads it and orjson writes it, with the stdlib's
meaning kept: what is read refuses NaN and the infinities (not JSON, RFC 8259 6) and keeps integers
of any size; what is written is compact UTF-8, and a value orjson refuses (an integer beyond 64 bits,
a key that is not a string) is written by the stdlib instead. orjson would write a NaN as null where
the stdlib refuses it: what the gateway writes is what `loads` read, or models whose floats are
bounded, so none reaches it."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pydantic_core


def loads(raw: bytes | bytearray | str) -> Any:
    """JSON text as Python values; ValueError if it is not JSON."""
    return pydantic_core.from_json(raw, allow_inf_nan=False)


def dumps(data: Any) -> bytes:
    try:
        return orjson.dumps(data)
    except TypeError:
        return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
