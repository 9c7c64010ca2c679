"""Distributed DP with discrete noise: the Skellam mechanism (Agarwal, Kairouz and Liu, "The Skellam
Mechanism for Differentially Private Federated Learning", NeurIPS 2021).

Secure aggregation sums integers mod 2^32. Continuous Gaussian noise rounded to fixed point is not
exactly a Gaussian mechanism (Kairouz, Liu and Steinke 2021); integer noise added to integer values is
exactly what the analysis counts. A symmetric Skellam variate of variance μ is the difference of two
independent Poisson(μ/2) variates, and a sum of independent Skellams is a Skellam: m sites that each
add variance μ/m put exactly Skellam(μ) on their sum, the distributed mechanism with no trusted party.

Each site, in the fixed-point grid of `hpcfed.privacy.site_input` (one unit = 2R/levels):

    x = randomized_round(s·clip_C(δ))          unbiased, ‖x − s·clip_C(δ)‖₂ < √d
    x + Skellam(variance (s·z·C)² / m)         per coordinate, from 256 fresh bits of the OS

so a site's integer vector has ℓ2 norm Δ2 < s·C + √d and ℓ1 norm Δ1 ≤ min(√d·Δ2, Δ2²) (an integer
vector's ℓ1 norm is at most its squared ℓ2 norm). Theorem 3.5 of the paper (integer order α > 1,
μ the per-coordinate variance of the noise on the sum):

    ε_RDP(α) ≤ α·Δ2²/(2μ) + min( ((2α − 1)·Δ2² + 6·Δ1) / (4μ²),  3·Δ1/(2μ) )

With μ = (s·z·C)² the leading term is the Gaussian mechanism's α/(2z²), widened by (1 + √d/(sC))²,
which at hpcfed's grid (s·C ≈ 10^7..10^8) is nothing; the bound holds at integer orders α only, and
that costs 0.5–4 % more ε than the continuous analysis at ε 5–57 (tests/privacy/test_skellam.py).
In exchange it is exact. Rounds compose by adding RDP; the conversion
to (ε, δ) is dp-accounting's (`compute_epsilon`).

numpy's Poisson sampler (PTRS, Hörmann 1993) is exact up to floating-point rounding in its
acceptance test while its variates stay below 2^53: `site_input.input_spec` caps the grid so that a
site's Poisson mean is at most 2^50 (`MAX_POISSON_MEAN`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hpcfed.privacy import load_on_first_use

if TYPE_CHECKING:
    import dp_accounting
else:
    dp_accounting = load_on_first_use("dp_accounting")  # scipy loads only for a run with DP

MAX_POISSON_MEAN = float(2**50)  # a site's Poisson(μ/2) variates stay exact integers in float64
ORDERS = (*range(2, 257), 320, 384, 512, 768, 1024)  # integer orders: the theorem needs them


def sample(variance: float, size: int, rng: np.random.Generator | None = None) -> np.ndarray:
    """`size` symmetric Skellam variates of `variance` (int64): Poisson(variance/2) − Poisson(variance/2),
    from a generator seeded with 256 fresh bits of the OS unless `rng` is given (tests)."""
    if not 0 <= variance / 2 <= MAX_POISSON_MEAN:
        raise ValueError(f"Skellam variance {variance!r} outside 0..{2 * MAX_POISSON_MEAN:g}")
    rng = rng or np.random.default_rng(secrets.randbits(256))
    return rng.poisson(variance / 2, size).astype(np.int64) - rng.poisson(variance / 2, size).astype(np.int64)


def randomized_round(values: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
    """Each value rounded down or up to an integer (int64), up with probability its fractional part:
    unbiased, and each coordinate moves by less than 1 (so the vector by less than √d)."""
    rng = rng or np.random.default_rng(secrets.randbits(256))
    low = np.floor(values)
    up = rng.random(values.shape) < (values - low)
    return low.astype(np.int64) + up


@dataclass(frozen=True)
class Grid:
    """What the accountant needs of the sites' integer grid: C in grid units (s·C) and the model's size d."""

    clip_units: float
    dim: int

    def sensitivities(self) -> tuple[float, float]:
        """(Δ1, Δ2) of one site's rounded integer vector (see the module's docstring)."""
        l2 = self.clip_units + math.sqrt(self.dim)
        return min(math.sqrt(self.dim) * l2, l2 * l2), l2


def rdp(order: int, l1: float, l2: float, variance: float) -> float:
    """Theorem 3.5's RDP bound at integer `order` for sensitivities (Δ1, Δ2) and noise `variance` μ."""
    if order < 2 or not variance > 0:
        raise ValueError(f"Skellam RDP needs an integer order >= 2 and a positive variance; got {order}, {variance}")
    return (order * l2 * l2 / (2 * variance)
            + min(((2 * order - 1) * l2 * l2 + 6 * l1) / (4 * variance * variance), 3 * l1 / (2 * variance)))


def epsilon(grid: Grid, multipliers: Sequence[tuple[float, int]], delta: float) -> float:
    """ε at `delta` after releases at noise multipliers z, given as (z, how many rounds) pairs: each
    round's sum carries Skellam noise of variance (z·s·C)² (0 rounds: 0)."""
    l1, l2 = grid.sensitivities()
    total = np.zeros(len(ORDERS))
    for z, rounds in multipliers:
        if rounds:
            variance = (z * grid.clip_units) ** 2
            total += rounds * np.array([rdp(a, l1, l2, variance) for a in ORDERS])
    if not total.any():
        return 0.0
    eps, _ = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(ORDERS, total, delta)
    return float(eps)
