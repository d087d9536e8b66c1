"""Compact JSON as bytes for the proxy's per-call logs (the idempotency log, the outcome
journal): orjson, about 20 times cheaper than `json.dumps` per entry on those lists
(bench/results/profile.md, part 5), and the same bytes for what the logs hold (strings,
ints, None, lists and tuples). What orjson refuses (a NamedTuple, a string with a lone
surrogate) is written by the standard library instead, so a log never stops on a value the
old encoder took."""

from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["dumps", "loads"]

def dumps(obj: Any) -> bytes:
    """`obj` as compact JSON bytes (no spaces; UTF-8, not \\u-escaped)."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes | str) -> Any:
    """JSON text to Python; a ValueError when it is not JSON. Text orjson refuses but the
    standard library reads (a lone surrogate's escape, as `dumps` may write it) is read by
    the latter."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)

