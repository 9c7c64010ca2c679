"""Robust FedAvg variants against a poisoning site: coordinate median, trimmed mean, Krum.

Thin strategies over the pure rules in `hpcfed.strategies.aggregate`:

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

from dataclasses import dataclass

import numpy as np

from hpcfed.strategies.aggregate import coordinate_median, krum, trimmed_mean
from hpcfed.strategies.base import Strategy, Update


class _Robust(Strategy):
    synchronous = True

    def _finite(self, updates: list[Update]) -> list[np.ndarray]:
        kept = []
        for u in updates:
            if np.isfinite(u.flat).all():
                kept.append(u.flat)
            else:
                self.context.log(f"{self.name}: rejected client {u.client_id}'s upload (NaN/Inf)")
        return kept

    def aggregate(self, round: int, updates: list[Update]) -> None:
        vectors = self._finite(updates)
        if vectors:
            self.global_flat[:] = self._rule(vectors)
            self.version += 1

    def _rule(self, vectors: list[np.ndarray]) -> np.ndarray:
        raise NotImplementedError


class Median(_Robust):
    name = "median"

    @dataclass(kw_only=True)
    class Config:
        pass

    def _rule(self, vectors: list[np.ndarray]) -> np.ndarray:
        return coordinate_median(vectors)


class TrimmedMean(_Robust):
    name = "trimmed_mean"

    @dataclass(kw_only=True)
    class Config:
        trim_ratio: float = 0.25

        def validate(self) -> None:
            if not 0.0 <= self.trim_ratio < 0.5:
                raise ValueError(f"trim_ratio must be in [0, 0.5), got {self.trim_ratio}")

    def _rule(self, vectors: list[np.ndarray]) -> np.ndarray:
        return trimmed_mean(vectors, self.config.trim_ratio)


class Krum(_Robust):
    name = "krum"

    @dataclass(kw_only=True)
    class Config:
        num_byzantine: int = 1
        multi: int = 1  # Multi-Krum: average the `multi` best-scored uploads

        def validate(self) -> None:
            if self.num_byzantine < 0 or self.multi < 1:
                raise ValueError(f"need num_byzantine >= 0 and multi >= 1, got {self.num_byzantine}, {self.multi}")

    def _rule(self, vectors: list[np.ndarray]) -> np.ndarray:
        if len(vectors) < self.config.num_byzantine + 3:
            raise ValueError(f"krum needs at least num_byzantine + 3 = {self.config.num_byzantine + 3} clients, "
                             f"got {len(vectors)}; lower strategy.num_byzantine or use median")
        return krum(vectors, self.config.num_byzantine, self.config.multi)
