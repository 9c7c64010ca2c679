"""FedAvg (McMahan et al. 2017), synchronous: the global model is the example-weighted mean of the
round's updates, θ = Σ_k n_k θ_k / Σ_k n_k. With ``rule`` it becomes a robust aggregate
(coordinate median, trimmed mean, Krum) from `hpcfed.strategies.aggregate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpcfed.strategies.aggregate import ROBUST_RULES, robust_aggregate, weighted_mean
from hpcfed.strategies.base import Strategy, Update


class FedAvg(Strategy):
    name = "fedavg"
    synchronous = True

    @dataclass(kw_only=True)
    class Config:
        weighting: str = "num_examples"  # or "uniform"
        rule: str = "mean"  # mean | median | trimmed_mean | krum
        trim_ratio: float = 0.1
        num_byzantine: int = 1

        def validate(self) -> None:
            if self.weighting not in ("num_examples", "uniform"):
                raise ValueError(f"weighting={self.weighting!r}; choose num_examples or uniform")
            if self.rule not in ROBUST_RULES:
                raise ValueError(f"rule={self.rule!r}; choose one of: {', '.join(ROBUST_RULES)}")

    def aggregate(self, round: int, updates: list[Update]) -> None:
        if not updates:
            return
        vectors = [u.flat for u in updates]
        weights = None
        if self.config.weighting == "num_examples" and sum(u.num_examples for u in updates) > 0:
            weights = [u.num_examples for u in updates]
        if self.config.rule == "mean":
            weighted_mean(vectors, weights, out=self.global_flat)
        else:
            self.global_flat[:] = robust_aggregate(vectors, weights, self.config.rule,
                                                   self.config.trim_ratio, self.config.num_byzantine)
