import numpy as np
import pytest

from hpcfed.strategies import aggregate as agg
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.fedavg import FedAvg


def test_weighted_mean_by_hand():
    out = agg.weighted_mean([np.array([1.0, 2.0]), np.array([3.0, 6.0])], [1, 3])
    np.testing.assert_allclose(out, [2.5, 5.0])
    np.testing.assert_allclose(agg.weighted_mean([np.array([1.0, 2.0]), np.array([3.0, 6.0])]), [2.0, 4.0])
    with pytest.raises(ValueError, match="weights"):
        agg.weighted_mean([np.zeros(2)], [-1])


def test_median_trimmed_krum_resist_an_outlier():
    honest = [np.array([1.0, 1.0]), np.array([1.2, 0.8]), np.array([0.9, 1.1]), np.array([1.1, 1.0])]
    evil = np.array([100.0, -100.0])
    xs = [*honest, evil]
    np.testing.assert_allclose(agg.coordinate_median(xs), [1.1, 1.0])
    # by hand: middle three per coordinate
    np.testing.assert_allclose(agg.trimmed_mean(xs, 0.2), [1.1, 2.8 / 3], atol=1e-6)
    k = agg.krum(xs, num_byzantine=1)
    assert np.abs(k - 1.0).max() < 0.25
    scores = agg.krum_scores(xs, 1)
    assert scores.argmax() == 4


def test_pairwise_distances_match_direct():
    x = np.random.default_rng(1).normal(size=(5, 7)).astype(np.float32)
    d = agg.pairwise_sq_distances(x)
    direct = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(d, direct, rtol=1e-5, atol=1e-5)


def test_fedavg_strategy_weights_by_examples():
    s = FedAvg(FedAvg.Config(), StrategyContext(num_clients=2, seed=0))
    s.initialize({"w": np.zeros((1, 2), np.float32)})
    s.aggregate(0, [Update(0, np.array([1, 2], np.float32), 1), Update(1, np.array([3, 6], np.float32), 3)])
    np.testing.assert_allclose(s.global_flat, [2.5, 5.0])
    header, arrays = s.state_dict()
    t = FedAvg(FedAvg.Config(rule="median"), StrategyContext(num_clients=2, seed=0))
    t.initialize({"w": np.zeros((1, 2), np.float32)})
    t.load_state_dict((header, arrays))
    np.testing.assert_array_equal(t.global_flat, s.global_flat)


def test_synthetic_macro_f1_matches_sklearn():
    from sklearn.metrics import f1_score

    from hpcfed.tasks.synthetic import macro_f1

    rng = np.random.default_rng(3)
    y, p = rng.integers(0, 5, 200), rng.integers(0, 4, 200)
    assert macro_f1(y, p, 5) == pytest.approx(f1_score(y, p, average="macro", zero_division=0))
