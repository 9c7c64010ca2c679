"""The privacy accountant: ε after T rounds of DP-FedAvg at δ, from `dp-accounting`'s RDP accountant
(Mironov 2017). Every site takes part in every round (no sampling), so T rounds are T compositions of a
Gaussian mechanism of noise multiplier z -- or, when the sites add integer noise under secure
aggregation, of the Skellam mechanism at the same variance (`hpcfed.privacy.skellam`, given the grid).
A round released at a lower multiplier (a group round of secure aggregation's group testing, whose
sums each carry only their group's noise: docs/threats.md, "The DP noise in a group sum") composes
at its own multiplier. ε is a pure function of (z, T, δ, the grid and the lowered rounds'
multipliers): that is the checkpointed state, and a resumed run reports the very same ε.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hpcfed.privacy import load_on_first_use, skellam

if TYPE_CHECKING:
    import dp_accounting
else:
    dp_accounting = load_on_first_use("dp_accounting")  # scipy loads only for a run with DP


def epsilon(noise_multiplier: float, rounds: int, delta: float, lowered: Sequence[float] = (),
            grid: skellam.Grid | None = None) -> float:
    """ε at `delta` after `rounds` full-participation rounds (0 rounds: 0): each at noise multiplier
    `noise_multiplier`, except those released at the multipliers in `lowered` (one entry a round);
    Skellam noise on `grid` when it is given, else Gaussian."""
    if rounds < len(lowered) or not noise_multiplier > 0 or not 0 < delta < 1 or \
            not all(0 < z <= noise_multiplier for z in lowered):
        raise ValueError(f"accountant needs rounds >= its lowered rounds, 0 < each lowered z <= z, 0 < δ < 1; "
                         f"got {rounds}, {noise_multiplier}, {list(lowered)}, {delta}")
    if rounds == 0:
        return 0.0
    if grid is not None:
        return skellam.epsilon(grid, [(noise_multiplier, rounds - len(lowered)), *((z, 1) for z in lowered)], delta)
    acc = dp_accounting.rdp.RdpAccountant()
    if rounds > len(lowered):
        acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier),
                                                      rounds - len(lowered)))
    for z in lowered:
        acc.compose(dp_accounting.GaussianDpEvent(z))
    return float(acc.get_epsilon(delta))


def rounds_within(noise_multiplier: float, delta: float, max_epsilon: float, limit: int,
                  lowered: Sequence[float] = (), grid: skellam.Grid | None = None) -> int:
    """The most rounds T <= `limit` whose ε stays <= `max_epsilon`, the rounds in `lowered` among them
    (ε grows with T: bisection)."""
    def within(t: int) -> bool:
        return epsilon(noise_multiplier, max(t, len(lowered)), delta, lowered, grid) <= max_epsilon
    if within(limit):
        return limit
    lo, hi = 0, limit  # within(lo), not within(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if within(mid):
            lo = mid
        else:
            hi = mid
    return lo


class Accountant:
    """ε of a run so far: the rounds done under (z, δ), the multipliers of those released below z
    (`lowered`), and the budget `max_epsilon`."""

    def __init__(self, noise_multiplier: float, delta: float, max_epsilon: float | None = None) -> None:
        self.noise_multiplier, self.delta, self.max_epsilon = noise_multiplier, delta, max_epsilon
        self.rounds = 0
        self.lowered: list[float] = []
        self.grid: skellam.Grid | None = None  # the sites' integer grid, when their noise is Skellam

    @property
    def epsilon(self) -> float:
        """ε at δ after the rounds done."""
        return epsilon(self.noise_multiplier, self.rounds, self.delta, self.lowered, self.grid)

    def step(self, released_at: float | None = None) -> None:
        """One more round was released, at `released_at` when that is below the run's multiplier."""
        self.rounds += 1
        if released_at is not None and released_at < self.noise_multiplier:
            self.lowered.append(released_at)

    def rounds_allowed(self, total: int) -> int:
        """How many of `total` rounds the budget allows (all when there is none)."""
        if self.max_epsilon is None or not math.isfinite(self.max_epsilon):
            return total
        return rounds_within(self.noise_multiplier, self.delta, self.max_epsilon, total, self.lowered, self.grid)
