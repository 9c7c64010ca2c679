"""FedDWA (spec section 3 hand values), FedAsync and Local-only strategies."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.config import ConfigError
from hpcfed.schema import build
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.fedasync import FedAsync, staleness_factor
from hpcfed.strategies.feddwa import FedDWA, dwa_weights
from hpcfed.strategies.local import Local


def _dwa(n: int = 3, **options) -> FedDWA:
    s = FedDWA(build(FedDWA.Config, options), StrategyContext(num_clients=n, seed=0))
    s.initialize({"w": np.zeros(1, dtype=np.float32)})
    return s


def _up(cid: int, value: float, **kw) -> Update:
    return Update(client_id=cid, flat=np.array([value], dtype=np.float32), num_examples=1, **kw)


def test_spec_sequence_1_5_then_45_over_11() -> None:
    s = _dwa(threshold=3)
    assert s.on_update(_up(0, 3.0)) == [0]  # t = 2, gaps [0,1,1], ρ = [1, ½, ½]
    assert s.version == 2 and list(s.s_v) == [2, 1, 1]
    assert float(s.global_flat[0]) == pytest.approx(1.5)
    targets = s.on_update(_up(1, 6.0))  # t = 3, gaps [1,0,2], ρ = [½, 1, ⅓]
    assert float(s.global_flat[0]) == pytest.approx(45 / 11, abs=1e-6)
    assert s.last_max_gap == 2 and targets == [1]  # max gap 2 < threshold 3: reply to the uploader only


def test_threshold_reached_broadcasts_without_touching_records() -> None:
    s = _dwa(threshold=2)
    s.on_update(_up(0, 3.0))
    s_w, s_v = s.s_w.copy(), s.s_v.copy()
    assert s.on_update(_up(1, 6.0)) == [0, 1, 2]  # max gap 2 >= 2: broadcast
    assert float(s.global_flat[0]) == pytest.approx(45 / 11, abs=1e-6)
    assert list(s.s_v) == [2, 3, 1] and s_v[1] == 1  # only the uploader's record changed
    assert s.s_w[0, 0] == s_w[0, 0] and s.s_w[2, 0] == 0.0


def test_default_threshold_is_the_number_of_clients() -> None:
    s = _dwa()
    assert s.threshold == 3
    s.on_update(_up(0, 3.0))
    assert s.on_update(_up(1, 6.0)) == [1]
    # t = 4: S_V = [4, 3, 1] -> gaps [0, 1, 3]: client 2 is a full round behind -> broadcast
    assert s.on_update(_up(0, 1.0)) == [0, 1, 2]
    assert s.last_max_gap == 3 and s.last_broadcast


def test_nan_upload_is_rejected_and_records_unchanged() -> None:
    s = _dwa()
    s.on_update(_up(0, 3.0))
    before = (s.version, s.s_w.copy(), s.s_v.copy(), s.global_flat.copy())
    assert s.on_update(_up(2, float("nan"))) == [2]
    assert s.version == before[0] and s.num_rejected == 1
    np.testing.assert_array_equal(s.s_w, before[1])
    np.testing.assert_array_equal(s.s_v, before[2])
    np.testing.assert_array_equal(s.global_flat, before[3])


def test_equal_versions_give_the_plain_mean_and_n1_is_identity() -> None:
    gaps = np.array([2, 2, 2])
    rho = dwa_weights(gaps, 1.0)
    s_w = np.array([1.0, 2.0, 6.0])
    assert float(rho @ s_w / rho.sum()) == pytest.approx(3.0)
    one = _dwa(n=1)
    one.on_update(_up(0, 7.25))
    assert float(one.global_flat[0]) == 7.25


def test_client_counter_mode_clamps_negative_gaps() -> None:
    s = _dwa(version_mode="client_counter")
    s.on_update(_up(0, 3.0, client_version=5))  # S_V = [5, 1, 1]
    s.on_update(_up(1, 6.0, client_version=2))  # gaps clamp: max(0, 2 - [5,2,1]) = [0, 0, 1]
    rho = np.array([1.0, 1.0, 0.5])
    assert float(s.global_flat[0]) == pytest.approx(float(rho @ np.array([3.0, 6.0, 0.0]) / rho.sum()))
    with pytest.raises(ValueError):
        dwa_weights(np.array([-1]), 1.0)


def test_feddwa_state_round_trip() -> None:
    s = _dwa()
    s.on_update(_up(0, 3.0))
    restored = _dwa()
    restored.load_state_dict(s.state_dict())
    s.on_update(_up(1, 6.0))
    restored.on_update(_up(1, 6.0))
    assert float(restored.global_flat[0]) == float(s.global_flat[0]) == pytest.approx(45 / 11, abs=1e-6)


def test_feddwa_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        build(FedDWA.Config, {"threshold": 0}, prefix="strategy.")


def test_fedasync_ema_and_staleness() -> None:
    s = FedAsync(build(FedAsync.Config, {"alpha": 0.5, "staleness": "polynomial", "a": 1.0}),
                 StrategyContext(num_clients=2, seed=0))
    s.initialize({"w": np.zeros(1, dtype=np.float32)})
    assert s.on_update(_up(0, 4.0, base_version=1)) == [0]  # fresh: α_t = 0.5 -> 2.0
    assert float(s.global_flat[0]) == pytest.approx(2.0)
    s.on_update(_up(1, 8.0, base_version=1))  # staleness 1: α_t = 0.5 / 2 = 0.25 -> 0.75*2 + 0.25*8 = 3.5
    assert float(s.global_flat[0]) == pytest.approx(3.5)
    s.on_update(_up(1, float("inf"), base_version=3))
    assert float(s.global_flat[0]) == pytest.approx(3.5) and s.version == 3
    assert staleness_factor(0, "hinge", 1.0, 2) == 1.0 and staleness_factor(4, "hinge", 1.0, 2) == pytest.approx(1 / 3)


def test_local_keeps_each_clients_model() -> None:
    s = Local(Local.Config(), StrategyContext(num_clients=2, seed=0))
    s.initialize({"w": np.zeros(2, dtype=np.float32)})
    s.aggregate(0, [Update(0, np.array([1, 1], np.float32), 5), Update(1, np.array([2, 2], np.float32), 5)])
    assert list(s.model_for(0)) == [1, 1] and list(s.final_model_for(1)) == [2, 2]
    r = Local(Local.Config(), StrategyContext(num_clients=2, seed=0))
    r.initialize({"w": np.zeros(2, dtype=np.float32)})
    r.load_state_dict(s.state_dict())
    assert list(r.model_for(1)) == [2, 2]


def test_under_secure_aggregation_each_buffers_sum_is_a_record_weighed_by_its_own_gap() -> None:
    """K = 4, buffers of 2: two records (⌈4/2⌉), both the initial model at version 1. A buffer whose
    two deltas sum to 2·[1, 0] is recorded as x + [1, 0] at version 2, replacing the oldest record;
    the model is eqs (9)-(10) over the records: gaps 0 and 1, weights 1 and 1/2."""
    s = FedDWA(build(FedDWA.Config, {}), StrategyContext(num_clients=4, seed=0, buffer_size=2))
    s.initialize({"w": np.zeros(2, dtype=np.float32)})
    assert FedDWA.folds_buffers and s.buffers.models.shape == (2, 2)
    s.fold_sum(np.array([2.0, 0.0]), 2.0, 2)
    np.testing.assert_allclose(s.global_flat, [1.0 / 1.5, 0.0], rtol=1e-6)
    assert s.version == 2 and s.last_max_gap == 1
    s.fold_sum(np.array([0.0, 3.0]), 1.0, 1)  # recorded as x_2 + [0, 3], replacing the version-1 record
    r2, r3 = np.array([1.0, 0.0]), np.array([1.0 / 1.5, 3.0])
    np.testing.assert_allclose(s.global_flat, (0.5 * r2 + r3) / 1.5, rtol=1e-6)
    twin = FedDWA(build(FedDWA.Config, {}), StrategyContext(num_clients=4, seed=0, buffer_size=2))
    twin.initialize({"w": np.zeros(2, dtype=np.float32)})
    twin.load_state_dict(s.state_dict())
    np.testing.assert_array_equal(twin.buffers.versions, [2, 3])
