"""FedAsync / AFed (Xie et al. 2019, "Asynchronous Federated Optimization"), the FedDWA baseline.

On each upload x_new trained from server version τ, at server version t::

    α_t = α · s(t − τ)                    s: staleness function
    x_t = (1 − α_t) x_{t−1} + α_t x_new   (an exponential moving average)

``s`` is ``constant`` (1), ``polynomial`` ((t − τ + 1)^(−a)) or ``hinge`` (1 if t − τ <= b, else
1 / (a (t − τ − b) + 1)). Only the uploader gets the new model back. A non-finite upload is
rejected and changes nothing.

Memory on rank 0: streaming by nature: the global model and the one upload being folded,
2 x the model's float32 bytes, whatever K is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from hpcfed.privacy.buffered import StalenessRule
from hpcfed.strategies.base import AsyncStrategy, Update


def staleness_factor(staleness: int, kind: str, a: float, b: int) -> float:
    """s(t − τ) of FedAsync; staleness < 0 (a client ahead of the server) counts as 0
    (`hpcfed.privacy.buffered.StalenessRule`, which a site applies itself under secure aggregation)."""
    return StalenessRule(kind, a, b).weight(staleness)


class FedAsync(AsyncStrategy):
    """FedAsync / AFed: each upload mixed into the global model with a staleness-damped weight."""

    name = "fedasync"

    @dataclass(kw_only=True)
    class Config:
        alpha: float = 0.6  # mixing weight α
        staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
        a: float = 0.5
        b: int = 4

        def validate(self) -> None:
            if not 0.0 < self.alpha <= 1.0:
                raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
            if self.a < 0 or self.b < 0:
                raise ValueError("a and b must be >= 0")

    last_alpha = 0.0

    def on_update(self, update: Update) -> list[int]:
        w = np.asarray(update.flat, dtype=np.float32)
        if not np.isfinite(w).all():
            return [update.client_id]
        c = self.config
        alpha_t = c.alpha * staleness_factor(self.version - update.base_version, c.staleness, c.a, c.b)
        self.global_flat *= np.float32(1.0 - alpha_t)
        self.global_flat += np.float32(alpha_t) * w
        self.version += 1
        self.last_alpha = alpha_t
        return [update.client_id]

    def metrics(self) -> dict[str, float]:
        return {"fedasync_alpha": float(self.last_alpha)}
