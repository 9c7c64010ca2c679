"""The privacy accountant: ε after T rounds of DP-FedAvg at δ, from `dp-accounting`'s RDP accountant
(Mironov 2017). Every site takes part in every round (no sampling), so T rounds are T compositions of a
Gaussian mechanism of noise multiplier z. ε is a pure function of (z, T, δ): the checkpointed state
is the number of rounds done, and a resumed run reports the very same ε.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from hpcfed.privacy import load_on_first_use

if TYPE_CHECKING:
    import dp_accounting
else:
    dp_accounting = load_on_first_use("dp_accounting")  # scipy loads only for a run with DP


def epsilon(noise_multiplier: float, rounds: int, delta: float) -> float:
    """ε at `delta` after `rounds` full-participation rounds of noise multiplier `noise_multiplier` (0 rounds: 0)."""
    if rounds < 0 or not noise_multiplier > 0 or not 0 < delta < 1:
        raise ValueError(f"accountant needs rounds >= 0, z > 0, 0 < δ < 1; got {rounds}, {noise_multiplier}, {delta}")
    if rounds == 0:
        return 0.0
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(noise_multiplier), rounds))
    return float(acc.get_epsilon(delta))


def rounds_within(noise_multiplier: float, delta: float, max_epsilon: float, limit: int) -> int:
    """The most rounds T <= `limit` whose ε stays <= `max_epsilon` (ε grows with T: bisection)."""
    if epsilon(noise_multiplier, limit, delta) <= max_epsilon:
        return limit
    lo, hi = 0, limit  # ε(lo) <= max, ε(hi) > max
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if epsilon(noise_multiplier, mid, delta) <= max_epsilon:
            lo = mid
        else:
            hi = mid
    return lo


class Accountant:
    """ε of a run so far: the rounds done under (z, δ), and the budget `max_epsilon`."""

    def __init__(self, noise_multiplier: float, delta: float, max_epsilon: float | None = None) -> None:
        self.noise_multiplier, self.delta, self.max_epsilon = noise_multiplier, delta, max_epsilon
        self.rounds = 0

    @property
    def epsilon(self) -> float:
        """ε at δ after the rounds done."""
        return epsilon(self.noise_multiplier, self.rounds, self.delta)

    def step(self) -> None:
        """One more round was released."""
        self.rounds += 1

    def rounds_allowed(self, total: int) -> int:
        """How many of `total` rounds the budget allows (all when there is none)."""
        if self.max_epsilon is None or not math.isfinite(self.max_epsilon):
            return total
        return rounds_within(self.noise_multiplier, self.delta, self.max_epsilon, total)
