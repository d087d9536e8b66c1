"""crossdc.jsonbytes: orjson for the proxy's logs, the same JSON as the standard library."""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossdc import jsonbytes

# what the idempotency log and the outcome journal hold: strings, ints, None, lists, tuples
_leaf = st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1), st.text())
_values = st.recursive(_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.tuples(inner, inner),
    st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=20)


@given(_values)
def test_the_same_json_as_the_standard_library(value: object) -> None:
    out = jsonbytes.dumps(value)
    assert json.loads(out) == json.loads(json.dumps(value))
    assert jsonbytes.loads(out) == json.loads(json.dumps(value))


def test_ascii_log_entries_are_byte_for_byte_what_json_dumps_wrote() -> None:
    entry = [["bench-t", "0f9c7a2e-6f0b-4b9e-8d4f-0d2d5f3f1a10",
              ("d-1", "ordered", 7, "east", 3, 123456)],
             ["bench-t", "k2", None, [["west", 1, 9]]]]
    assert jsonbytes.dumps(entry) == json.dumps(entry, separators=(",", ":")).encode()


class _Write(NamedTuple):
    region: str
    partition: int


def test_what_orjson_refuses_is_written_by_the_standard_library() -> None:
    # a NamedTuple (orjson refuses it; json writes a list) and a lone surrogate (orjson
    # refuses to write it; json escapes it): the old encoder took both, so must this one
    value = [_Write("east", 3), "\ud800"]
    out = jsonbytes.dumps(value)
    assert out == b'[["east",3],"\\ud800"]'
    assert jsonbytes.loads(out) == [["east", 3], "\ud800"]


def test_invalid_json_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="line 1"):
        jsonbytes.loads(b"[1,")
    with pytest.raises(TypeError, match="object is not JSON serializable"):
        jsonbytes.dumps([object()])
