"""FedBuff: buffered asynchronous aggregation (Nguyen et al., AISTATS 2022, "Federated Learning with
Buffered Asynchronous Aggregation", Algorithm 1).

Sites train asynchronously; the server keeps a buffer of uploads and applies it once it holds
``federation.buffer_size`` (B) of them. Each upload is a delta δ_k = (site's model) − (the model it
trained from, server version v_k), weighed by its staleness τ_k = t − v_k at server version t::

    s(τ) = (1 + τ)^(−a)                     a = 0.5: FedBuff's 1/√(1+τ)  (FedAsync's ``polynomial``)
    x_{t+1} = x_t + η · Σ_k s(τ_k)·δ_k / N   N = Σ_k s(τ_k) (``normalise: weight``) or B (``count``)

One buffer is one server version. FedBuff's paper divides by the buffer's size (``count``: stale
buffers move the model less); the default ``weight`` divides by the weight sum (a staleness-weighted
mean), which is what secure aggregation hands rank 0 with the masked weight coordinate
(`hpcfed.server.secagg_buffer`). A site is answered with the new model once its buffer is applied
(``defers_answers``), so it never waits beyond the buffer it lands in and never trains twice from a
model its own last step is missing; plain and secure runs answer alike. When sites leave so that
fewer are live than a buffer holds, the loop applies the buffer as it is (`flush`).

Under ``privacy.secure_aggregation`` the sites apply s(τ) before masking and rank 0 sees only each
buffer's sum: `fold_sum` (``aggregates = WEIGHTED_SUM``), never `on_update`.

Memory on rank 0 (plain): the global model, the buffer's float64 sum, and the model of each version
some site still trains from (to measure its delta): at most K + 1 float32 models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from hpcfed.params import Params
from hpcfed.privacy.buffered import StalenessRule
from hpcfed.strategies.base import WEIGHTED_SUM, Aggregates, AsyncStrategy, Update


def buffer_size_for(configured: int | None, num_sites: int) -> int:
    """`federation.buffer_size`, or by default half the sites (at least 2, at most K)."""
    return configured if configured is not None else min(num_sites, max(2, math.ceil(num_sites / 2)))


class FedBuff(AsyncStrategy):
    """Buffered asynchronous aggregation (see the module's docstring)."""

    name = "fedbuff"
    aggregates: ClassVar[Aggregates] = WEIGHTED_SUM
    defers_answers: ClassVar[bool] = True  # a site is answered once its buffer is applied

    @dataclass(kw_only=True)
    class Config:
        server_lr: float = 1.0  # η
        staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
        a: float = 0.5  # polynomial (1 + τ)^(−a): 0.5 is FedBuff's 1/√(1+τ)
        b: int = 4  # hinge: no discount up to b versions
        normalise: Literal["weight", "count"] = "weight"

        def validate(self) -> None:
            if not (math.isfinite(self.server_lr) and self.server_lr > 0):
                raise ValueError(f"server_lr={self.server_lr!r}; give a finite number > 0 (1.0: the buffer's mean)")
            if self.a < 0 or self.b < 0:
                raise ValueError("a and b must be >= 0")

    def initialize(self, initial: Params) -> None:
        super().initialize(initial)
        self.buffer_size = buffer_size_for(self.context.buffer_size, self.context.num_clients)
        self.models: dict[int, np.ndarray] = {self.version: self.global_flat.copy()}  # version -> model
        self.sent: dict[int, int] = {}  # site -> the version it was last sent
        self._clear()
        self.last_weight_sum = 0.0
        self.num_rejected = 0

    def _clear(self) -> None:
        self.delta_sum = np.zeros(self.global_flat.size, dtype=np.float64)
        self.weight_sum = 0.0
        self.members: list[int] = []

    def weight(self, staleness: int) -> float:
        """s(τ): the weight of an upload trained `staleness` versions ago."""
        return self.rule.weight(staleness)

    @property
    def rule(self) -> StalenessRule:
        """s(τ) as configured; under secure aggregation each site applies it to its own delta."""
        c = self.config
        return StalenessRule(c.staleness, c.a, c.b)

    def model_for(self, client_id: int) -> np.ndarray:
        self.sent[client_id] = self.version  # its next upload is measured from this version's model
        return self.global_flat

    def on_update(self, update: Update) -> list[int]:
        """Add one upload's weighted delta to the buffer; apply the buffer when it holds B uploads.
        The uploader is answered at once with the current model (the loop answers it)."""
        cid, base = update.client_id, self.models.get(int(update.base_version))
        w = np.asarray(update.flat, dtype=np.float32)
        if base is None or not np.isfinite(w).all():
            self.num_rejected += 1  # from a version no site trains from any more, or not finite: left out
            return [cid]
        s = self.weight(self.version - int(update.base_version))
        delta = np.subtract(w, base, dtype=np.float64)
        delta *= s
        self.delta_sum += delta
        self.weight_sum += s
        self.members.append(cid)
        return self.flush() if len(self.members) >= self.buffer_size else []

    def flush(self) -> list[int]:
        """Apply the buffer as it is (full, or every live site waits on it) and return its members."""
        members = sorted(set(self.members))
        if members:
            self.fold_sum(self.delta_sum, self.weight_sum, len(self.members))
            self._clear()
        return members

    def fold_sum(self, delta_sum: np.ndarray, total_weight: float, count: int) -> None:
        """Apply one buffer: `delta_sum` = Σ s_k·δ_k, `total_weight` = Σ s_k > 0, from `count`
        uploads (under secure aggregation, the unmasked sum of the buffer's members)."""
        norm = total_weight if self.config.normalise == "weight" else float(self.buffer_size)
        step = np.multiply(delta_sum, self.config.server_lr / norm)
        self.global_flat += step.astype(np.float32)
        self.version += 1
        self.last_weight_sum = float(total_weight)
        in_use = set(self.sent.values()) | {self.version}
        self.models = {v: m for v, m in self.models.items() if v in in_use}
        self.models[self.version] = self.global_flat.copy()

    def forget(self, client_id: int) -> None:
        """An evicted site trains from nothing any more (its buffered upload, if any, stays folded)."""
        self.sent.pop(client_id, None)

    def metrics(self) -> dict[str, float]:
        return {"fedbuff_version": float(self.version), "fedbuff_buffered": float(len(self.members)),
                "fedbuff_weight_sum": self.last_weight_sum}

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header = {"version": self.version, "weight_sum": self.weight_sum, "members": self.members,
                  "sent": {str(k): v for k, v in self.sent.items()}, "models": sorted(self.models)}
        arrays = {"global": self.global_flat, "delta_sum": self.delta_sum,
                  **{f"model_v{v}": m for v, m in self.models.items()}}
        return header, arrays

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        super().load_state_dict(state)
        header, arrays = state
        self.weight_sum = float(header.get("weight_sum", 0.0))
        self.members = [int(c) for c in header.get("members", [])]
        self.sent = {int(k): int(v) for k, v in header.get("sent", {}).items()}
        self.delta_sum = np.array(arrays.get("delta_sum", np.zeros(self.global_flat.size)), dtype=np.float64)
        self.models = {int(v): np.array(arrays[f"model_v{v}"], dtype=np.float32) for v in header.get("models", [])
                       if f"model_v{v}" in arrays}
        self.models[self.version] = self.global_flat.copy()
