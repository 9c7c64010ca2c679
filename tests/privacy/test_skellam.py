"""Distributed DP's discrete noise (`hpcfed.privacy.skellam`, Agarwal et al. 2021): the RDP bound
against hand-computed values, the Skellam variates' variance and closure under sums, unbiased
randomized rounding, the sites' integer encoding read back by the server's decoding, and the
accountant: never below the continuous analysis, and close to it at hpcfed's grid."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcfed.config import ConfigError, load
from hpcfed.privacy import skellam
from hpcfed.privacy.accountant import Accountant, epsilon
from hpcfed.privacy.requirements import Declared, check_privacy
from hpcfed.privacy.site_input import decode_sum, encode_discrete, encode_update, input_spec
from hpcfed.schema import InvalidValue


def test_the_rdp_bound_matches_hand_computed_values_on_both_branches_of_its_min():
    # α = 2, Δ1 = 3, Δ2 = 2, μ = 10: 2·4/20 + min((3·4 + 18)/400, 9/20) = 0.4 + 0.075
    assert skellam.rdp(2, 3.0, 2.0, 10.0) == pytest.approx(0.475)
    # μ = 1: 2·4/2 + min((3·4 + 18)/4, 9/2) = 4 + 4.5 (the second branch)
    assert skellam.rdp(2, 3.0, 2.0, 1.0) == pytest.approx(8.5)
    with pytest.raises(ValueError, match="integer order"):
        skellam.rdp(1, 3.0, 2.0, 1.0)


def test_skellam_variates_are_integers_of_the_asked_variance_and_shares_add_up():
    rng = np.random.default_rng(0)
    one = skellam.sample(1e6, 200_000, rng)
    assert one.dtype == np.int64 and abs(one.var() / 1e6 - 1) < 0.02 and abs(one.mean()) < 10  # 6 and 4.5 sigma
    total = sum(skellam.sample(1e6 / 4, 200_000, rng) for _ in range(4))  # four sites' shares
    assert abs(total.var() / 1e6 - 1) < 0.02
    with pytest.raises(ValueError, match="variance"):
        skellam.sample(4 * skellam.MAX_POISSON_MEAN, 1, rng)


def test_randomized_rounding_is_unbiased_and_moves_each_value_by_less_than_one():
    rng = np.random.default_rng(1)
    values = np.full(100_000, 2.3)
    rounded = skellam.randomized_round(values, rng)
    assert set(np.unique(rounded)) == {2, 3} and abs(rounded.mean() - 2.3) < 0.006  # 4 sigma
    spread = np.random.default_rng(2).normal(scale=50, size=10_000)
    assert np.all(np.abs(skellam.randomized_round(spread, rng) - spread) < 1)


def test_a_discrete_spec_has_an_even_grid_whose_poisson_means_stay_exact():
    for k, z in ((2, 0.3), (4, 1.0), (16, 5.0)):
        spec = input_spec(k, 1.0, 1, z, k, discrete=True)
        assert spec.discrete and spec.levels % 2 == 0 and spec.levels <= input_spec(k, 1.0, 1, z, k).levels
        assert (spec.noise_std / spec.step) ** 2 / 2 <= skellam.MAX_POISSON_MEAN
        assert spec.grid(100).clip_units == pytest.approx(1.0 / spec.step)


def test_the_sites_integer_inputs_decode_to_the_sum_plus_noise_of_the_central_std():
    k, d, z = 4, 20_000, 1.0
    spec = input_spec(k, 1.0, 1, z, k, discrete=True)
    rng = np.random.default_rng(3)
    deltas = [rng.normal(size=d) * 0.005 for _ in range(k)]  # ‖δ‖ ≈ 0.7 < C: not clipped
    codes = [encode_discrete(delta, 1.0, spec, rng) for delta in deltas]
    assert all(c.dtype == np.uint32 and c[-1] == 1 for c in codes)
    total = np.sum([c.astype(np.uint64) for c in codes], axis=0) % (1 << 32)
    weighted, count = decode_sum(total.astype(np.uint32), k, spec)
    error = weighted - np.sum(deltas, axis=0)
    assert count == k and abs(error.mean()) < 4 * z / math.sqrt(d)  # unbiased: rounding and noise
    assert abs(error.std() / (spec.noise_std * math.sqrt(k)) - 1) < 0.03  # k shares of std z·C/√k: z·C
    # encode_update takes the discrete path for a discrete spec, and clips first
    big = np.full(d, 1.0)  # ‖δ‖ = 141 > C
    clipped, within = encode_update(big, 37, spec)
    assert not within and clipped[-1] == 1
    with pytest.raises(ValueError, match="discrete spec"):
        encode_discrete(big, 1.0, input_spec(k, 1.0, 1, z, k))


def test_the_skellam_accountant_is_never_below_the_gaussian_and_close_to_it():
    for z, rounds in ((1.0, 1), (2.0, 50), (5.0, 100)):
        grid = input_spec(4, 1.0, 1, z, 4, discrete=True).grid(1_000_000)
        gaussian, discrete = epsilon(z, rounds, 1e-5), epsilon(z, rounds, 1e-5, grid=grid)
        assert gaussian < discrete < 1.05 * gaussian, (z, rounds, gaussian, discrete)
    grid = input_spec(4, 1.0, 1, 2.0, 4, discrete=True).grid(1000)
    acc = Accountant(2.0, 1e-5, max_epsilon=epsilon(2.0, 10, 1e-5))  # the Gaussian's budget for 10 rounds
    assert acc.rounds_allowed(100) == 10
    acc.grid = grid
    assert acc.rounds_allowed(100) < 10  # Skellam spends the same budget a little sooner
    acc.rounds = 3
    acc.step(released_at=1.0)  # a group round at a lower multiplier costs more
    assert acc.epsilon == pytest.approx(skellam.epsilon(grid, [(2.0, 3), (1.0, 1)], 1e-5))
    assert acc.epsilon > skellam.epsilon(grid, [(2.0, 4)], 1e-5)


def test_the_noise_key_is_checked_and_skellam_needs_secure_aggregation(tmp_path):
    base = "name: t\nrounds: 1\nstrategy: {name: fedavg}\ntask: {name: synthetic}\ninfluence: {enabled: false}\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text(base + "privacy: {dp: {noise: laplace}}\n")
    with pytest.raises((ConfigError, InvalidValue), match="skellam or gaussian"):
        load(bad)
    central = tmp_path / "central.yaml"
    central.write_text(base + "privacy: {dp: {noise: skellam}}\n")
    with pytest.raises(ConfigError, match=r"privacy\.dp\.noise.*secure_aggregation=true"):
        check_privacy(load(central), Declared("fedavg", True, "weighted_sum"))
