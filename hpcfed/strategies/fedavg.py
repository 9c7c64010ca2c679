"""FedAvg (McMahan et al. 2017), synchronous: the global model is the example-weighted mean of the
round's updates, θ = Σ_k n_k θ_k / Σ_k n_k. With ``rule`` it becomes a robust aggregate
(coordinate median, trimmed mean, Krum), computed by `hpcfed.strategies.robust.robust_rule`, the
rules' one home (the ``median``/``trimmed_mean``/``krum`` strategies use it too).

Memory on rank 0: the mean streams: each update is folded into a float64 running sum
(`RunningMean`) as it arrives and freed, so rank 0 holds the float32 global model, the float64 sum
and the update being received: about 4 x the model's float32 bytes, whatever the number of clients K.
The robust rules need every update at once: K + 1 models (median and trimmed mean also stack them,
2K + 1; Krum's Gram matrix is K^2 floats more).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcfed.strategies.aggregate import RunningMean
from hpcfed.strategies.base import EACH_UPLOAD, WEIGHTED_SUM, Aggregates, SyncStrategy, Update
from hpcfed.strategies.robust import RULES, robust_rule

MEAN_OR_ROBUST = ("mean", *RULES)


class FedAvg(SyncStrategy):
    """The example-weighted (or uniform) mean of the round's models; with a robust ``rule``, that rule."""

    name = "fedavg"
    aggregates = WEIGHTED_SUM  # the mean: secure aggregation and DP can carry it (a robust rule cannot)

    @dataclass(kw_only=True)
    class Config:
        weighting: str = "num_examples"  # or "uniform"
        rule: str = "mean"  # mean | median | trimmed_mean | krum
        trim_ratio: float = 0.1
        num_byzantine: int = 1

        def validate(self) -> None:
            if self.weighting not in ("num_examples", "uniform"):
                raise ValueError(f"weighting={self.weighting!r}; choose num_examples or uniform")
            if self.rule not in MEAN_OR_ROBUST:
                raise ValueError(f"rule={self.rule!r}; choose one of: {', '.join(MEAN_OR_ROBUST)}")

    @classmethod
    def aggregates_with(cls, config: Any) -> Aggregates:
        """The mean takes a weighted sum; a robust rule needs each upload."""
        return WEIGHTED_SUM if config.rule == "mean" else EACH_UPLOAD

    # -- streaming mean: fold each update on arrival ---------------------------------------------
    def begin_round(self, round: int) -> None:
        super().begin_round(round)
        self._mean = RunningMean(self.layout.size) if self.config.rule == "mean" else None

    def fold(self, update: Update) -> None:
        if self._mean is None:
            return super().fold(update)
        self._mean.add(update.vector, self._weight(update))
        update.flat = None  # the runtime holds no reference: the received message can be freed

    def end_round(self, round: int) -> None:
        if self._mean is None:
            return super().end_round(round)
        if self._mean.count:
            self._mean.result(out=self.global_flat)
        self._mean = None

    def fold_sum(self, delta_sum: np.ndarray, total_weight: float, count: int) -> None:
        """Fold the round's Σ w_k·δ_k (deltas from the global model; float64, taken over) and Σ w_k, as
        the weighted sum of the sites' models Σ w_k (g + δ_k) (`SyncStrategy.fold_sum`)."""
        if self._mean is None:
            raise RuntimeError(f"a weighted sum needs FedAvg's mean rule, not rule {self.config.rule!r}")
        block = RunningMean.BLOCK  # Σ w_k (g + δ_k) = W·g + Σ w_k δ_k, in place, a block at a time
        for start in range(0, delta_sum.size, block):
            delta_sum[start:start + block] += np.multiply(self.global_flat[start:start + block], float(total_weight),
                                                          dtype=np.float64)
        self._mean.add_sum(delta_sum, float(total_weight))

    def _weight(self, update: Update) -> float:
        return float(update.num_examples) if self.config.weighting == "num_examples" else 1.0

    def aggregate(self, round: int, updates: list[Update]) -> None:
        if not updates:
            return
        if self.config.rule == "mean":
            mean = RunningMean(self.layout.size)
            for u in updates:
                mean.add(u.vector, self._weight(u))
            mean.result(out=self.global_flat)
        else:
            c = self.config
            self.global_flat[:] = robust_rule(c.rule, [u.vector for u in updates], trim_ratio=c.trim_ratio,
                                              num_byzantine=c.num_byzantine)
