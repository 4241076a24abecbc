"""The gateway's JSON. Every call it places or passes on reads and writes some (a batch of 64 creates'
answers: ~150 us to write with the stdlib, ~30 us with pydantic-core), so pydantic-core reads and
writes it, with the stdlib's meaning kept:

- `loads` refuses the words NaN and Infinity (not JSON, RFC 8259 6) and keeps integers of any
  size; a number beyond a float's range still reads as an infinity, so a caller's body is also
  checked with `finite` (core.json_object).
- `dumps` writes JSON values (what `loads` returns, models dumped in JSON mode, dicts of str keys)
  as compact UTF-8 with the values `json.dumps(data, separators=(",", ":"), allow_nan=...)` would
  write: with `allow_nan`, NaN and infinities as the stdlib's words; without, a ValueError. What
  pydantic-core cannot write (a lone surrogate, nesting past its limit) the stdlib writes. Given
  anything else (bytes, datetimes, sets, non-string keys) pydantic-core is more lenient than the
  stdlib: the gateway never gives it any."""

from __future__ import annotations

import json
import math
from typing import Any

import pydantic_core


def loads(raw: bytes | bytearray | str) -> Any:
    """JSON text as Python values; ValueError if it is not JSON."""
    return pydantic_core.from_json(raw, allow_inf_nan=False)


def dumps(data: Any, *, allow_nan: bool = False) -> bytes:
    try:
        out: bytes | None = pydantic_core.to_json(data, inf_nan_mode="constants")
    except ValueError:
        out = None
    # (the words may be inside a string too: then the stdlib writes it, and says no only if it must)
    if out is None or (not allow_nan and (b"NaN" in out or b"Infinity" in out)):
        return json.dumps(data, separators=(",", ":"), allow_nan=allow_nan).encode()
    return out


def finite(data: Any) -> bool:
    """Whether every number in `data` (JSON values) is finite."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True
