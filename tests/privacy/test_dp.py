"""DP-FedAvg's mechanism: clipping, reproducible noise, adaptive clipping, on hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcfed.privacy import dp


def test_clip_leaves_a_short_delta_and_scales_a_long_one_to_the_norm():
    short, within = dp.clip(np.array([0.3, 0.4]), 1.0)
    assert within and short.tolist() == [0.3, 0.4]
    long, within = dp.clip(np.array([3.0, 4.0], dtype=np.float32), 1.0)
    assert not within and long.dtype == np.float64
    assert long == pytest.approx([0.6, 0.8])


def test_clip_refuses_a_non_finite_delta():
    with pytest.raises(ValueError, match="non-finite"):
        dp.clip(np.array([np.inf, 0.0]), 1.0)


def test_noise_is_reproducible_from_seed_and_round_and_differs_across_rounds():
    a = dp.gaussian_noise(1000, 2.0, seed=7, round=3)
    assert a.tobytes() == dp.gaussian_noise(1000, 2.0, seed=7, round=3).tobytes()
    assert not np.array_equal(a, dp.gaussian_noise(1000, 2.0, seed=7, round=4))
    assert not np.array_equal(a, dp.gaussian_noise(1000, 2.0, seed=8, round=3))
    assert np.std(dp.gaussian_noise(200_000, 2.0, seed=1, round=0)) == pytest.approx(2.0, rel=0.01)


def test_noisy_mean_is_the_clipped_sum_plus_noise_over_the_fixed_denominator():
    s = dp.CentralDP(size=2, num_sites=4, clip_norm=1.0, noise_multiplier=0.5)
    s.add(np.array([3.0, 4.0]))  # clipped to (0.6, 0.8)
    s.add(np.array([0.0, 0.5]))  # within
    assert (s.added, s.unclipped) == (2, 1)
    noise = dp.gaussian_noise(2, 0.5 * 1.0, seed=0, round=5)
    got = s.noisy_mean(seed=0, round=5)
    assert got == pytest.approx((np.array([0.6, 1.3]) + noise) / 4)  # K = 4 sites, though 2 answered


def test_central_dp_refuses_a_delta_of_the_wrong_shape():
    s = dp.CentralDP(size=3, num_sites=2, clip_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="shape"):
        s.add(np.zeros(2))


def test_update_noise_multiplier_leaves_the_count_its_share():
    # z = 1, σ_b = 1: z_Δ = (1 - 1/4)^(-1/2)
    assert dp.update_noise_multiplier(1.0, 1.0) == pytest.approx(1 / math.sqrt(0.75))
    assert dp.update_noise_multiplier(1.0, None) == 1.0
    with pytest.raises(ValueError, match="count_stddev"):
        dp.update_noise_multiplier(1.0, 0.5)


def test_adaptive_clip_moves_geometrically_toward_the_quantile():
    noise = dp.noise_rng(3, 2, dp._COUNT_STREAM).normal(0.0, 0.1)
    got = dp.adapt_clip(2.0, unclipped=4, num_sites=4, count_stddev=0.1, target_quantile=0.5,
                        learning_rate=0.2, seed=3, round=2)
    assert got == pytest.approx(2.0 * math.exp(-0.2 * ((4 + noise) / 4 - 0.5)))
    assert got < 2.0  # every site unclipped: C shrinks
    assert dp.adapt_clip(2.0, 0, 4, 0.01, 0.5, 0.2, 3, 2) > 2.0  # every site clipped: C grows
