"""Parameters keep their dtypes on the wire; the mean streams; peers' cost reports are bounded."""

from __future__ import annotations

import itertools
import re

import ml_dtypes
import numpy as np
import pytest

from hpcfed import protocol as P
from hpcfed.cost import parse_cost, rank_cost
from hpcfed.params import ParamLayout
from hpcfed.strategies.aggregate import RunningMean, weighted_mean
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.fedavg import FedAvg
from hpcfed.strategies.robust import Median

BF16 = np.dtype(ml_dtypes.bfloat16)


def _mixed() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"emb": rng.standard_normal((4, 3)).astype(BF16), "w": rng.standard_normal(5).astype(np.float32),
            "half": rng.standard_normal(2).astype(np.float16), "q": np.array([-3, 7], np.int8),
            "steps": np.array(12, np.int64), "mask": np.array([True, False]), "f64": np.ones(2)}


def test_mixed_model_packs_each_dtype_into_one_buffer_and_unpacks_bit_for_bit():
    params = _mixed()
    layout = ParamLayout.of(params)
    assert layout.groups == {"bfloat16": 12, "float32": 7, "float16": 2, "int8": 2, "int64": 1, "bool": 2}
    assert layout.dtypes[-1] == np.float32  # float64 travels and aggregates as float32, as before
    packed = layout.pack(params)
    assert layout.check_packed(packed) is None
    tensors = P.params_tensors(packed)
    assert set(tensors) == {"params", "params:bfloat16", "params:float16", "params:int8", "params:int64", "params:bool"}
    back = layout.unpack(P.params_groups(tensors, layout.groups))
    for name, value in params.items():
        want = value.astype(np.float32) if name == "f64" else value
        assert back[name].dtype == want.dtype and back[name].shape == want.shape
        assert back[name].tobytes() == want.tobytes(), name
    assert layout.nbytes == 12 * 2 + 7 * 4 + 2 * 2 + 2 + 8 + 2


def test_float32_aggregate_goes_back_to_each_dtype_with_integers_rounded():
    layout = ParamLayout.of(_mixed())
    flat = layout.flatten(_mixed())
    flat[layout.offsets[layout.names.index("steps")]] = 12.6
    flat[layout.offsets[layout.names.index("q")]] = -300.0  # clipped to int8's range
    flat[layout.offsets[layout.names.index("mask")] + 1] = 0.5
    back = layout.unpack(layout.pack_flat(flat))
    assert back["steps"] == 13 and back["q"][0] == -128 and back["mask"].tolist() == [True, True]
    np.testing.assert_array_equal(back["emb"], _mixed()["emb"])


def test_all_float32_model_is_sent_as_the_aggregation_vector_itself():
    params = {"a": np.ones((2, 2), np.float32), "b": np.zeros(3, np.float32)}
    layout = ParamLayout.of(params)
    flat = layout.flatten(params)
    assert layout.pack_flat(flat)["float32"] is flat  # no copy, same bits as before dtypes were kept
    assert P.params_tensors(layout.pack_flat(flat)) == {"params": flat}
    assert layout.unpack_flat({"float32": flat}) is flat


@pytest.mark.parametrize("groups, fragment", [
    ({"float32": np.zeros(7, BF16)}, "float32 group is bfloat16"),  # bf16 where the layout says f32
    ({"float32": np.zeros(6, np.float32)}, r"expected float32 \(7,\)"),
    ({"float32": np.zeros((7, 1), np.float32)}, "expected float32"),
    ({"float32": np.zeros(7, np.float32), "bfloat16": np.zeros(7, BF16)}, "dtype groups"),
    ({}, "dtype groups"),
])
def test_a_packed_model_of_the_wrong_form_is_named(groups, fragment):
    layout = ParamLayout.of({"w": np.zeros(7, np.float32)})
    assert layout.check_packed(groups) is not None
    assert re.search(fragment, layout.check_packed(groups))


def test_non_finite_check_covers_float_groups_only():
    layout = ParamLayout.of({"w": np.zeros(2, BF16), "n": np.zeros(1, np.int64)})
    good = {"bfloat16": np.zeros(2, BF16), "int64": np.array([-5])}
    assert layout.packed_finite(good)
    assert not layout.packed_finite({**good, "bfloat16": np.array([0, np.nan], BF16)})


def test_running_mean_matches_weighted_mean_and_two_updates_commute_bitwise():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
    ws = [17, 4, 250]
    m = RunningMean(3000)
    m.BLOCK = 1000  # several blocks
    for x, w in zip(xs, ws):
        m.add(x, w)
    np.testing.assert_allclose(m.result(), weighted_mean(xs, ws), rtol=1e-6, atol=1e-7)
    for a, b in itertools.permutations(range(2)):
        pair = RunningMean(3000)
        pair.add(xs[a], ws[a])
        pair.add(xs[b], ws[b])
        first = RunningMean(3000)
        first.add(xs[0], ws[0])
        first.add(xs[1], ws[1])
        assert pair.result().tobytes() == first.result().tobytes()


def test_running_mean_is_uniform_when_every_weight_is_zero_and_ignores_zero_weights_otherwise():
    m = RunningMean(2)
    m.add(np.array([1, 2], np.float32), 0)
    m.add(np.array([3, 4], np.float32), 0)
    np.testing.assert_array_equal(m.result(), [2, 3])
    m.add(np.array([10, 10], np.float32), 5)
    np.testing.assert_array_equal(m.result(), [10, 10])
    with pytest.raises(ValueError, match="weight"):
        m.add(np.zeros(2, np.float32), float("nan"))
    with pytest.raises(ValueError, match="zero updates"):
        RunningMean(2).result()


def test_streaming_fedavg_frees_each_update_and_equals_the_batch_rule():
    ctx = StrategyContext(num_clients=3, seed=0)
    rng = np.random.default_rng(2)
    flats = [rng.standard_normal(6).astype(np.float32) for _ in range(3)]
    s = FedAvg(FedAvg.Config(), ctx)
    s.initialize({"w": np.zeros(6, np.float32)})
    s.begin_round(0)
    updates = [Update(c, flats[c].copy(), 10 * (c + 1)) for c in (2, 0, 1)]  # arrival order != id order
    for u in updates:
        s.fold(u)
        assert u.flat is None  # the strategy keeps no reference to the update
    s.end_round(0)
    np.testing.assert_allclose(s.global_flat, weighted_mean(flats, [10, 20, 30]), rtol=1e-6)
    # A rule that needs every update keeps them until the round ends (its memory grows with K).
    m = Median(Median.Config(), ctx)
    m.initialize({"w": np.zeros(6, np.float32)})
    m.begin_round(0)
    kept = [Update(c, flats[c], 1) for c in range(3)]
    for u in kept:
        m.fold(u)
    assert all(u.flat is not None for u in kept)
    m.end_round(0)
    np.testing.assert_allclose(m.global_flat, np.median(np.stack(flats), axis=0))


class _Stats:
    messages_sent = messages_received = 3
    bytes_sent, bytes_received, seal_s, open_s = 100, 200, 0.5, 0.25


def test_a_peers_cost_report_is_bounded_or_refused():
    good = rank_cost(_Stats())
    assert good["peak_rss_bytes"] > 0 and good["bytes_received"] == 200
    assert parse_cost(good) == good
    for bad in ({**good, "bytes_sent": -1}, {**good, "bytes_sent": 1 << 70}, {**good, "bytes_sent": True},
                {**good, "bytes_sent": 1.5}, {**good, "seal_s": float("inf")}, {**good, "open_s": -0.1},
                {**good, "open_s": "0.1"}, {**good, "extra": 1}, {k: v for k, v in good.items() if k != "seal_s"},
                [good], None, "x"):
        assert parse_cost(bad) is None, bad
