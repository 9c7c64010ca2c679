"""Header JSON within bounds: int64 integers, finite floats, unique keys, bounded nesting, an object."""

from __future__ import annotations

import pytest

from hpcfed.comm import bounded_json, wire
from hpcfed.comm.bounded_json import JSONBoundError


def test_a_header_round_trips_compactly():
    value = {"round": 3, "lr": 0.5, "ok": True, "none": None, "names": ["a", "é"], "nested": {"k": [1, 2]}}
    raw = bounded_json.dumps(value, 32)
    assert raw == '{"round":3,"lr":0.5,"ok":true,"none":null,"names":["a","é"],"nested":{"k":[1,2]}}'.encode()
    assert bounded_json.loads_object(memoryview(raw), 32) == value


@pytest.mark.parametrize("value, words", [
    ({"n": 1 << 63}, "outside int64"),
    ({"x": float("nan")}, "NaN/Inf"),
    ({"x": float("inf")}, "NaN/Inf"),
    ({1: 2}, "keys must be str"),
    ({"t": b"bytes"}, "has type bytes"),
    ({"deep": [[[[1]]]]}, "nests deeper than 3 levels at header.deep[0][0]"),
])
def test_what_json_cannot_carry_is_refused_on_the_way_out(value, words):
    with pytest.raises(JSONBoundError, match=words.replace("[", r"\[").replace("]", r"\]")):
        bounded_json.dumps(value, 3)


@pytest.mark.parametrize("text, words", [
    (b'{"n": 99999999999999999999999}', "digits; integers must fit int64"),
    (b'{"n": 9223372036854775808}', "outside int64"),
    (b'{"x": 1e400}', "finite float64"),
    (b'{"x": NaN}', "NaN/Infinity"),
    (b'{"x": -Infinity}', "NaN/Infinity"),
    (b'{"a": 1, "a": 2}', "twice"),
    (b"[1, 2]", "must be a JSON object"),
    (b'{"a": [[[[[]]]]]}', "nests deeper than 4 levels"),
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper|must be a JSON object|not valid JSON"),
    (b'{"a": 1', "not valid JSON"),
    (b'{"a": "\xff"}', "not valid UTF-8"),
])
def test_hostile_header_bytes_are_refused_while_parsing(text, words):
    with pytest.raises(JSONBoundError, match=words):
        bounded_json.loads_object(text, 4)


def test_the_wire_reports_a_bound_as_a_wire_error():
    with pytest.raises(wire.WireError, match="outside int64"):
        wire.encode({"n": -(1 << 63) - 1})
