"""What a site masks under secure aggregation, and what the server reads back from the sum.

A site's input is its update delta (the model it trained minus the model it was sent), clipped to
L2 norm C, weighted by w = n / max_examples, in fixed point, followed by n itself (`masking.encode`),
so that the weight travels masked too. The fixed-point range R is C (no coordinate of a clipped
delta exceeds its norm), widened under distributed DP to hold the noise.

Distributed DP (DP-FedAvg with secure aggregation): every site weighs 1 and adds Gaussian noise of
std z·C/√m to its clipped delta before fixed point, m being the fewest sites whose inputs a round
may be summed from (the quorum): any m of them add up to noise of std ≥ z·C on the sum, the central
mechanism's, so the accountant counts as in central mode, and no party ever sees a less noised sum.
With ``privacy.dp.noise: skellam`` (the default under secure aggregation) the noise is discrete:
each site rounds its clipped delta to the fixed-point grid at random and adds integer Skellam noise
of the same variance there (`hpcfed.privacy.skellam`), so the sum the server unmasks carries exactly
the mechanism the accountant counts. With ``gaussian`` each site adds continuous noise, then rounds
to fixed point, which moves each value by at most R / levels (~1e-8·R): the continuous analysis
ignores that, and is not exact (Kairouz et al. 2021).
The noise comes from a generator seeded with 256 fresh bits from the OS: nobody else can regenerate it.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hpcfed.privacy import masking, skellam
from hpcfed.privacy.dp import clip_factor, l2_norm

if TYPE_CHECKING:
    from hpcfed.config import PrivacyConfig

NOISE_TAIL = 10.0  # R holds C plus this many noise stds: a coordinate clipped by R has odds below 1e-23


@dataclass(frozen=True)
class InputSpec:
    """The encoding every rank of a run agrees on (all from the config and K)."""

    clip_norm: float  # C
    value_range: float  # R
    max_examples: int  # n / max_examples is the weight; 1 under DP (sites weigh alike)
    levels: int  # fixed-point levels: K inputs sum below 2^32
    noise_std: float  # each site's share of the DP noise; 0 without DP
    discrete: bool = False  # the noise is integer Skellam noise on the grid (`encode_discrete`)

    @property
    def step(self) -> float:
        """One fixed-point step: the round trip moves a value by at most half of it."""
        return 2 * self.value_range / self.levels

    def grid(self, dim: int) -> skellam.Grid:
        """C in grid units and the model's size: what the discrete mechanism's accountant needs."""
        return skellam.Grid(self.clip_norm / self.step, dim)


def input_spec(num_sites: int, clip_norm: float, max_examples: int, noise_multiplier: float | None = None,
               sites_needed: int | None = None, discrete: bool = False) -> InputSpec:
    """The spec for `num_sites` sites; with `noise_multiplier` z, distributed DP over at least
    `sites_needed` sites per sum (default all), its noise `discrete` (Skellam) or continuous."""
    if noise_multiplier is None:
        return InputSpec(clip_norm, clip_norm, max_examples, masking.levels_for(num_sites), 0.0)
    m = sites_needed or num_sites
    if not 1 <= m <= num_sites:
        raise ValueError(f"sites_needed must be in 1..{num_sites}, got {m}")
    std = noise_multiplier * clip_norm / math.sqrt(m)
    value_range = clip_norm + NOISE_TAIL * std
    levels = masking.levels_for(num_sites)
    if discrete:
        # A site's Poisson mean (s·std)²/2 at most 2^50, s = levels / 2R: exact integers in numpy's
        # sampler; and levels even, so that the grid's zero (levels / 2) is a whole code.
        cap = int(2 * value_range * math.sqrt(2 * skellam.MAX_POISSON_MEAN) / std)
        levels = min(levels, cap) & ~1
    return InputSpec(clip_norm, value_range, 1, levels, std, discrete)


def encode_update(delta: np.ndarray, num_examples: int, spec: InputSpec) -> tuple[np.ndarray, bool]:
    """A site's fixed-point input (uint32, size + 1) and whether its delta was within C. The clip's
    factor is folded into the fixed-point pass: one float64 temporary, `delta` left as it is."""
    factor, within = clip_factor(delta, spec.clip_norm)
    if spec.discrete:
        return encode_discrete(delta, factor, spec), within
    if spec.noise_std > 0:
        return masking.encode(noised(delta, factor, spec.noise_std), 1, spec.max_examples, spec.value_range,
                              spec.levels), within
    return masking.encode(delta, num_examples, spec.max_examples, spec.value_range, spec.levels, factor), within


def noised(delta: np.ndarray, factor: float, noise_std: float) -> np.ndarray:
    """factor·delta plus N(0, noise_std²) per coordinate, float64: a site's share of distributed DP's
    noise, from a generator seeded with 256 fresh bits from the OS (nobody else can regenerate it)."""
    rng = np.random.default_rng(secrets.randbits(256))
    out = np.multiply(delta, factor, dtype=np.float64)
    out += rng.normal(0.0, noise_std, out.shape)
    return out


def encode_discrete(delta: np.ndarray, factor: float, spec: InputSpec, rng: np.random.Generator | None = None
                    ) -> np.ndarray:
    """A site's input under discrete distributed DP (uint32, size + 1, weight 1): factor·delta on the
    grid, rounded at random, plus Skellam noise of variance (noise_std in grid units)², offset by
    levels / 2 (so that `masking.dequantise_sum` reads it back). A noised value beyond ±R, odds
    below 1e-23 (`NOISE_TAIL`), is held at the edge as the continuous encoding does."""
    if not spec.discrete or spec.levels % 2:
        raise ValueError("encode_discrete needs a discrete spec (input_spec(..., discrete=True))")
    scale = 1.0 / spec.step
    rng = rng or np.random.default_rng(secrets.randbits(256))
    units = skellam.randomized_round(np.multiply(delta, factor * scale, dtype=np.float64), rng)
    units += skellam.sample((spec.noise_std * scale) ** 2, units.size, rng)
    half = spec.levels // 2
    np.clip(units, -half, half, out=units)
    out = np.empty(units.size + 1, dtype=np.uint32)
    np.add(units, half, out=out[:-1], casting="unsafe")
    out[-1] = 1
    return out


def decode_sum(total: np.ndarray, count: int, spec: InputSpec) -> tuple[np.ndarray, int]:
    """(Σ n_k·δ_k, Σ n_k) from the unmasked sum of `count` inputs (the sites encoded w_k·δ_k with
    w_k = n_k / max_examples); the first over the second is the example-weighted mean delta."""
    examples = int(total[-1])
    if not 1 <= examples <= count * spec.max_examples:
        raise ValueError(f"the masked weights sum to {examples}, outside 1..{count * spec.max_examples} for "
                         f"{count} sites: a site sent an input outside the encoding")
    weighted = masking.dequantise_sum(total[:-1], count, spec.value_range, spec.levels)
    weighted *= spec.max_examples
    return weighted, examples


def judge_sum(total: np.ndarray, count: int, spec: InputSpec) -> tuple[np.ndarray, int]:
    """`decode_sum`, then the norm check: honest sites clipped to C, so ‖Σ n_k δ_k‖ ≤ C·Σ n_k (plus
    the noise's 4 stds under DP). ValueError, saying why, when some site sent an input outside the
    encoding: honest inputs, each within it, always pass, so a refusal is evidence against the set."""
    weighted_sum, examples = decode_sum(total, count, spec)
    norm = l2_norm(weighted_sum)
    bound = spec.clip_norm * examples + 4 * spec.noise_std * math.sqrt(count * weighted_sum.size)
    if not (math.isfinite(norm) and norm <= bound):
        raise ValueError(f"its norm {norm:.4g} is above what {count} sites clipped to {spec.clip_norm:g} can make "
                         f"({bound:.4g})")
    return weighted_sum, examples


def sites_needed(num_sites: int, quorum: float) -> int:
    """The fewest sites whose inputs a round may be summed from: the quorum's count of K."""
    return max(1, math.ceil(quorum * num_sites))


def spec_for(privacy: PrivacyConfig, num_sites: int, quorum: float) -> InputSpec:
    """The run's encoding from its ``privacy`` section (every rank computes the same one)."""
    dp = privacy.dp
    if dp is None:
        return input_spec(num_sites, privacy.secagg.clip_norm, privacy.secagg.max_examples)
    return input_spec(num_sites, dp.clip_norm, 1, dp.noise_multiplier, sites_needed(num_sites, quorum),
                      discrete=dp.discrete(privacy.secure_aggregation))
