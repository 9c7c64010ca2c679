"""`hpcfed.server.validation`: what a site sends is bounded and checked before any of it is used.

Pure functions, so these tests build no channel: every hostile value a peer can put in a JSON
header or a tensor bundle goes straight in, and the answer is a parsed value or a `Rejection`,
never an exception that would end the server.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpcfed.params import ParamLayout
from hpcfed.server.validation import (
    HEADER_INT_MAX,
    MAX_METRICS,
    MAX_SHARD_REPORTS,
    Rejection,
    error_text,
    held_shards,
    is_int,
    is_number,
    metrics_ok,
    parse_result,
    parse_update,
    shard_ref,
    short,
    task_header,
)

INT64 = 2**63 - 1
DIGEST = "ab" * 32
SIZE = 6
LAYOUT = ParamLayout.of({"w": np.zeros((2, 3), dtype=np.float32)})
HONEST = {"num_examples": 10, "metrics": {"loss": 0.5}, "version": 3, "client_version": 2}


def _params(value: float = 1.0, dtype: str = "float32", size: int = SIZE) -> dict[str, np.ndarray]:
    return {"params": np.full(size, value, dtype=dtype)}


# -- numbers ------------------------------------------------------------------------------------------
def test_a_huge_json_integer_is_refused_not_overflowed():
    huge = json.loads("1" + "0" * 400)  # what json.loads gives for a header num_examples of 10**400
    assert not is_int(huge) and not is_number(huge)
    assert not is_int(INT64) and not is_int(-INT64) and not is_int(HEADER_INT_MAX + 1)
    assert is_int(HEADER_INT_MAX) and is_int(-HEADER_INT_MAX) and is_int(0)
    assert not is_number(float("nan")) and not is_number(float("inf")) and not is_number(-float("inf"))
    assert not is_number(True) and not is_int(False) and not is_number("3") and not is_number(None)


@given(st.one_of(st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text()))
def test_every_accepted_number_converts_to_a_finite_float(v):
    if is_number(v):
        assert math.isfinite(float(v))
    if is_int(v):
        assert abs(v) <= HEADER_INT_MAX and math.isfinite(float(v) * 1e6)


# -- texts --------------------------------------------------------------------------------------------
def test_a_failed_clients_error_text_is_bounded():
    assert len(error_text({"error": "x" * 10**6})) == 500
    assert error_text({"error": "disk\nfull\t now"}) == "disk full now"
    assert error_text({}) == "unknown error" and error_text({"error": 10**400}) == "unknown error"
    assert error_text({"error": ["a list"]}) == "unknown error"


def test_a_peers_text_is_one_bounded_line():
    assert short("a\nb\r\nc") == "a b c"
    cut = short("y" * 10_000)
    assert cut.startswith("y" * 300) and cut.endswith("... (10000 characters)") and len(cut) < 330
    assert short({"nested": [1, 2]}) == "{'nested': [1, 2]}"


# -- metrics ------------------------------------------------------------------------------------------
def test_metrics_are_a_bounded_mapping_of_short_names_to_finite_numbers():
    assert metrics_ok({}) and metrics_ok({"loss": 0.5, "n": 3, "missing": None})
    assert metrics_ok({f"m{i}": 1.0 for i in range(MAX_METRICS)})
    assert not metrics_ok({f"m{i}": 1.0 for i in range(MAX_METRICS + 1)})  # oversized
    assert not metrics_ok({"loss": float("nan")}) and not metrics_ok({"loss": float("inf")})
    assert not metrics_ok({"n": 10**400}) and not metrics_ok({"n": INT64})
    assert not metrics_ok({"x" * 129: 1.0}) and metrics_ok({"x" * 128: 1.0})
    assert not metrics_ok({"loss": "0.5"}) and not metrics_ok({"loss": [0.5]}) and not metrics_ok({"ok": True})
    assert not metrics_ok([("loss", 0.5)]) and not metrics_ok(None) and not metrics_ok("loss")


# -- checkpoint shards ----------------------------------------------------------------------------------
def test_a_shard_report_must_name_a_round_a_sha256_digest_and_a_bounded_path():
    assert shard_ref({"round": 4, "digest": DIGEST, "path": "site0/r4.h5"}) == \
        {"round": 4, "digest": DIGEST, "path": "site0/r4.h5"}
    for bad in ({"round": -1, "digest": DIGEST, "path": ""}, {"round": 10**400, "digest": DIGEST, "path": ""},
                {"round": 1.0, "digest": DIGEST, "path": ""}, {"round": True, "digest": DIGEST, "path": ""},
                {"round": 1, "digest": DIGEST.upper(), "path": ""}, {"round": 1, "digest": DIGEST[:-1], "path": ""},
                {"round": 1, "digest": "g" * 64, "path": ""}, {"round": 1, "digest": DIGEST, "path": "p" * 4097},
                {"round": 1, "digest": DIGEST, "path": None}, {"round": 1, "digest": DIGEST}, [1, DIGEST, ""], None):
        assert shard_ref(bad) is None, bad


def test_a_resume_report_of_held_shards_is_bounded_and_drops_what_is_malformed():
    assert held_shards([[3, DIGEST], [2, "cd" * 32]]) == {(3, DIGEST), (2, "cd" * 32)}
    assert held_shards([[3, DIGEST, "extra"], [-1, DIGEST], [3, "x"], "3", None, [10**400, DIGEST]]) == set()
    many = [[i, DIGEST] for i in range(10_000)]
    assert len(held_shards(many)) == MAX_SHARD_REPORTS
    assert held_shards({"3": DIGEST}) == set() and held_shards(None) == set()


# -- setup and result headers ---------------------------------------------------------------------------
def test_a_setup_task_header_is_a_mapping():
    assert task_header({"task": {"vocab": 3}}) == {"vocab": 3}
    assert task_header({}) == {}
    assert task_header({"task": [1, 2]}) == Rejection("malformed header", "SETUP task header is not a mapping")


def test_a_result_keeps_finite_metrics_and_refuses_a_malformed_cost_or_oversized_metrics():
    metrics, cost = parse_result({"metrics": {"accuracy": 0.75, "n": 3, "skipped": None}})
    assert metrics == {"accuracy": 0.75, "n": 3.0} and cost is None
    oversized = parse_result({"metrics": {f"m{i}": 0.0 for i in range(MAX_METRICS + 1)}})
    assert isinstance(oversized, Rejection) and oversized.category == "malformed header"
    assert isinstance(parse_result({"metrics": {"accuracy": float("nan")}}), Rejection)
    bad_cost = parse_result({"metrics": {}, "cost": {"peak_rss_bytes": -1}})
    assert bad_cost == Rejection("malformed header", "RESULT cost is not bounded counters and seconds")


# -- uploads ------------------------------------------------------------------------------------------
def test_an_honest_upload_is_parsed_with_its_header_numbers():
    upd, shard = parse_update(2, HONEST, _params(0.5), LAYOUT, allow_state=False)
    assert upd.client_id == 2 and upd.num_examples == 10 and upd.base_version == 3 and upd.client_version == 2
    assert upd.metrics == {"loss": 0.5} and shard is None
    np.testing.assert_array_equal(upd.flat, np.full(SIZE, 0.5, dtype=np.float32))
    ref = {"round": 1, "digest": DIGEST, "path": "s.h5"}
    assert parse_update(2, {**HONEST, "shard": ref}, _params(), LAYOUT, allow_state=True)[1] == ref
    assert parse_update(2, {**HONEST, "shard": ref}, _params(), LAYOUT, allow_state=False)[1] is None


def test_version_counters_beyond_the_bound_read_as_zero_and_a_missing_metric_as_nan():
    upd, _ = parse_update(0, {**HONEST, "version": 10**400, "client_version": "7", "metrics": {"loss": None}},
                          _params(), LAYOUT, allow_state=False)
    assert upd.base_version == 0 and upd.client_version == 0 and math.isnan(upd.metrics["loss"])


@pytest.mark.parametrize(("header", "tensors", "category"), [
    (HONEST, {"params": np.ones(SIZE, np.float32), "state/opt": np.ones(2, np.float32)}, "unknown tensor name"),
    (HONEST, {"x": np.ones(SIZE, np.float32)}, "unknown tensor name"),
    (HONEST, {"params:bfloat16": np.ones(SIZE, np.float32)}, "unknown tensor name"),
    (HONEST, {}, "wrong dtype or shape"),  # no parameters at all
    (HONEST, _params(size=SIZE - 1), "wrong dtype or shape"),  # truncated
    (HONEST, _params(size=SIZE + 1), "wrong dtype or shape"),
    (HONEST, {"params": np.ones((2, 3), np.float32)}, "wrong dtype or shape"),  # not flat
    (HONEST, _params(dtype="float64"), "wrong dtype or shape"),
    (HONEST, _params(dtype="int8"), "wrong dtype or shape"),
    (HONEST, _params(float("nan")), "non-finite parameters"),
    (HONEST, _params(float("-inf")), "non-finite parameters"),
    ({**HONEST, "num_examples": -1}, _params(), "malformed header"),
    ({**HONEST, "num_examples": INT64}, _params(), "malformed header"),
    ({**HONEST, "num_examples": 10**400}, _params(), "malformed header"),
    ({**HONEST, "num_examples": 3.0}, _params(), "malformed header"),
    ({**HONEST, "num_examples": True}, _params(), "malformed header"),
    ({"metrics": {}}, _params(), "malformed header"),  # no num_examples
    ({**HONEST, "metrics": {f"m{i}": 1.0 for i in range(MAX_METRICS + 1)}}, _params(), "malformed header"),
    ({**HONEST, "metrics": {"loss": float("nan")}}, _params(), "malformed header"),
    ({**HONEST, "metrics": [["loss", 0.5]]}, _params(), "malformed header"),
])
def test_a_hostile_upload_is_refused_under_a_fixed_category(header, tensors, category):
    got = parse_update(1, header, tensors, LAYOUT, allow_state=True)
    assert isinstance(got, Rejection) and got.category == category, got
    assert len(got.detail) < 400  # the detail goes to the log: bounded, whatever was sent


def test_a_mixed_precision_layout_takes_each_group_in_its_own_dtype():
    layout = ParamLayout.of({"w": np.zeros(4, np.float32), "steps": np.zeros(1, np.int64)})
    good = {"params": np.ones(4, np.float32), f"params:{layout.dtypes[1].name}": np.array([7], layout.dtypes[1])}
    upd, _ = parse_update(0, HONEST, good, layout, allow_state=False)
    np.testing.assert_array_equal(upd.flat, [1, 1, 1, 1, 7])
    missing = parse_update(0, HONEST, {"params": np.ones(4, np.float32)}, layout, allow_state=False)
    assert isinstance(missing, Rejection) and missing.category == "wrong dtype or shape"


def test_a_sites_throughput_in_its_result_cost_is_bounded():
    from hpcfed.cost import rank_cost
    from hpcfed.server.validation import Rejection

    class _Stats:
        pass

    cost = rank_cost(_Stats())
    ok = parse_result({"metrics": {"accuracy": 0.5}, "cost": {**cost, "examples_per_s": 1234.5}})
    assert not isinstance(ok, Rejection) and ok[1] is not None and ok[1]["examples_per_s"] == 1234.5
    for bad in (-1.0, math.nan, math.inf, 1e12, "fast", True):
        refused = parse_result({"metrics": {}, "cost": {**cost, "examples_per_s": bad}})
        assert isinstance(refused, Rejection) and "cost" in refused.detail, bad
    assert isinstance(parse_result({"metrics": {}, "cost": {**cost, "examples_per_hour": 1.0}}), Rejection)


def test_a_sites_loop_cpu_in_its_result_cost_is_bounded():
    """A site's CPU of its loop (what bench_privacy --async reads per buffer) is hostile like the rest."""
    from hpcfed.cost import rank_cost
    from hpcfed.server.validation import Rejection

    class _Stats:
        pass

    cost = rank_cost(_Stats(), loop_cpu_s=2.5)
    assert cost["loop_cpu_s"] == 2.5 and "loop_cpu_s" not in rank_cost(_Stats())
    ok = parse_result({"metrics": {"accuracy": 0.5}, "cost": cost})
    assert not isinstance(ok, Rejection) and ok[1] is not None and ok[1]["loop_cpu_s"] == 2.5
    for bad in (-1.0, math.nan, math.inf, 1e12, "slow", False, None):
        refused = parse_result({"metrics": {}, "cost": {**cost, "loop_cpu_s": bad}})
        assert isinstance(refused, Rejection) and "cost" in refused.detail, bad
