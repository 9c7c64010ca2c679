"""A client's header numbers are bounded before any arithmetic: a huge JSON integer cannot end the server."""

from __future__ import annotations

import json
import math

from hypothesis import given
from hypothesis import strategies as st

from hpcfed.server.server import HEADER_INT_MAX, _is_int, _is_number


def test_a_huge_json_integer_is_refused_not_overflowed():
    huge = json.loads("1" + "0" * 400)  # what json.loads gives for a header num_examples of 10**400
    assert not _is_int(huge) and not _is_number(huge)
    assert not _is_number(float("nan")) and not _is_number(float("inf")) and not _is_number(True)


@given(st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text()))
def test_every_accepted_number_converts_to_a_finite_float(v):
    if _is_number(v):
        assert math.isfinite(float(v))
    if _is_int(v):
        assert abs(v) <= HEADER_INT_MAX and math.isfinite(float(v) * 1e6)


def test_a_failed_clients_error_text_is_bounded():
    from hpcfed.server.server import _error_text
    assert len(_error_text({"error": "x" * 10**6})) == 500
    assert _error_text({}) == "unknown error" and _error_text({"error": 10**400}) == "unknown error"
