"""Robust FedAvg variants against a poisoning site: coordinate median, trimmed mean, Krum.

Thin strategies over the pure rules in `hpcfed.strategies.aggregate`, dispatched by `robust_rule`
(which FedAvg's ``rule`` option uses too, so each rule has one home):

- ``median``: θ = coordinate-wise median of the uploads (Yin et al. 2018);
- ``trimmed_mean``: per coordinate, drop the ``trim_ratio``·K largest and smallest values, average the rest;
- ``krum``: the upload with the smallest sum of squared distances to its K − f − 2 nearest others
  (Blanchard et al. 2017), ``num_byzantine`` = f.

Uploads holding NaN/Inf are rejected before aggregation (logged); if none is left the model stays.

Memory on rank 0: these rules need every update of the round at once (no streaming): the K
uploads, their stacked copy and the global model, about (2K + 1) x the model's float32 bytes;
Krum adds a K x K Gram matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from hpcfed.strategies.aggregate import coordinate_median, krum, trimmed_mean
from hpcfed.strategies.base import SyncStrategy, Update

RULES = ("median", "trimmed_mean", "krum")


def robust_rule(rule: str, vectors: Sequence[np.ndarray], *, trim_ratio: float = 0.1, num_byzantine: int = 1,
                multi: int = 1) -> np.ndarray:
    """The one home of the robust rules: `rule` (one of `RULES`) over a round's uploads. The
    strategies below and FedAvg's ``rule`` option both aggregate through it."""
    if rule == "median":
        return coordinate_median(vectors)
    if rule == "trimmed_mean":
        return trimmed_mean(vectors, trim_ratio)
    if rule == "krum":
        if len(vectors) < num_byzantine + 3:
            raise ValueError(f"krum needs at least num_byzantine + 3 = {num_byzantine + 3} clients, "
                             f"got {len(vectors)}; lower strategy.num_byzantine or use median")
        return krum(vectors, num_byzantine, multi)
    raise ValueError(f"unknown robust rule {rule!r}; choose one of: {', '.join(RULES)}")


class _Robust(SyncStrategy):
    """A robust rule as a strategy: non-finite uploads are dropped (logged), the rule takes the rest."""

    def _finite(self, updates: list[Update]) -> list[np.ndarray]:
        kept = []
        for u in updates:
            if np.isfinite(u.vector).all():
                kept.append(u.vector)
            else:
                self.context.log(f"{self.name}: rejected client {u.client_id}'s upload (NaN/Inf)")
        return kept

    def aggregate(self, round: int, updates: list[Update]) -> None:
        vectors = self._finite(updates)
        if vectors:
            self.global_flat[:] = robust_rule(self.name, vectors, **asdict(self.config))
            self.version += 1


class Median(_Robust):
    """Coordinate-wise median of the uploads (Yin et al. 2018)."""

    name = "median"

    @dataclass(kw_only=True)
    class Config:
        pass


class TrimmedMean(_Robust):
    """Per coordinate, the mean after dropping the `trim_ratio` share of largest and smallest values."""

    name = "trimmed_mean"

    @dataclass(kw_only=True)
    class Config:
        trim_ratio: float = 0.25

        def validate(self) -> None:
            if not 0.0 <= self.trim_ratio < 0.5:
                raise ValueError(f"trim_ratio must be in [0, 0.5), got {self.trim_ratio}")


class Krum(_Robust):
    """The upload(s) closest to their nearest others (Blanchard et al. 2017), with `num_byzantine` assumed hostile."""

    name = "krum"

    @dataclass(kw_only=True)
    class Config:
        num_byzantine: int = 1
        multi: int = 1  # Multi-Krum: average the `multi` best-scored uploads

        def validate(self) -> None:
            if self.num_byzantine < 0 or self.multi < 1:
                raise ValueError(f"need num_byzantine >= 0 and multi >= 1, got {self.num_byzantine}, {self.multi}")
