"""FedDWA: asynchronous dynamic (version-gap) weighted aggregation (FedAHE paper §4.2, spec section 3).

State: ``S_W[i]`` = client i's latest upload (initially w0), ``S_V[i]`` = the server version at that
upload (initially 1), and the server version ``t`` (initially 1, +1 per accepted upload). On an
upload from client c: ``t += 1; S_W[c] = w; S_V[c] = t``, then with ``gap_i = t − S_V[i]``::

    (9)  w_latest      = Σ_i (gap_i + 1)^(−a) · S_W[i]
    (10) w_latest_norm = w_latest / Σ_i (gap_i + 1)^(−a)          (the denominator is >= 1)

The exponent is unreadable in the paper: ``a = staleness_exponent`` (default 1). Algorithm 1: if
``max_i gap_i < threshold`` only the uploader gets the new model, else it is broadcast to all; the
broadcast changes no record. ``threshold`` defaults to n (the number of clients). A non-finite
upload is rejected: the records stay unchanged and the uploader gets the current model back.
``version_mode="client_counter"`` is the alternative reading (``v_latest`` = the uploader's own
counter, gaps clamped at 0).

Memory on rank 0: each upload is folded as it arrives (asynchronous by nature), but ``S_W`` keeps
one model per client by definition: (K + 2) x the model's float32 bytes (S_W, the global model,
the upload being received).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from hpcfed.params import Params
from hpcfed.strategies.aggregate import weighted_mean
from hpcfed.strategies.base import AsyncStrategy, Update
from hpcfed.strategies.fedbuff import buffer_size_for
from hpcfed.strategies.feddwa_buffers import BufferRecords


def dwa_weights(gaps: np.ndarray, a: float) -> np.ndarray:
    """ρ_i = (gap_i + 1)^(−a), the eq 9 factor; gaps must be >= 0."""
    gaps = np.asarray(gaps, dtype=np.float64)
    if (gaps < 0).any():
        raise ValueError(f"version gaps must be >= 0, got {gaps}")
    return (gaps + 1.0) ** (-a)


class FedDWA(AsyncStrategy):
    """FedDWA (FedAHE §4.2): every site's latest upload weighted by its version gap, broadcast when a
    site falls `threshold` versions behind."""

    name = "feddwa"
    # Under secure aggregation each buffer's sum is a record (`hpcfed.strategies.feddwa_buffers`): `fold_sum`.
    folds_buffers: ClassVar[bool] = True

    @dataclass(kw_only=True)
    class Config:
        staleness_exponent: float = 1.0  # a in (gap + 1)^(-a)
        threshold: int | None = None  # broadcast when max gap >= threshold; default n
        version_mode: Literal["server", "client_counter"] = "server"

        def validate(self) -> None:
            if self.staleness_exponent < 0:
                raise ValueError(f"staleness_exponent must be >= 0, got {self.staleness_exponent}")
            if self.threshold is not None and self.threshold < 1:
                raise ValueError(f"threshold must be >= 1, got {self.threshold}")

    def initialize(self, initial: Params) -> None:
        super().initialize(initial)
        n = self.context.num_clients
        self.s_w = np.tile(self.global_flat, (n, 1))  # (n, P) float32: S_W[i] = w0
        self.s_v = np.ones(n, dtype=np.int64)  # S_V[i] = 1
        self.num_rejected = 0
        self.last_broadcast = False
        self.last_max_gap = 0
        self.last_base_version = 1
        self.gone: set[int] = set()  # evicted sites: their records weigh nothing (`forget`)
        self.buffers = BufferRecords(self.global_flat, n, buffer_size_for(self.context.buffer_size, n))

    def fold_sum(self, delta_sum: np.ndarray, total_weight: float, count: int) -> None:
        """Under secure aggregation: one buffer's Σ δ_k and its count (each member weighs 1) as a record,
        and the model recomputed over the buffers' records (`hpcfed.strategies.feddwa_buffers`)."""
        self.version += 1
        self.last_max_gap = self.buffers.fold(self.global_flat, delta_sum, total_weight, self.version,
                                              self.config.staleness_exponent, self.global_flat)
        self.last_broadcast = False

    @property
    def threshold(self) -> int:
        return self.config.threshold if self.config.threshold is not None else self.context.num_clients

    def on_update(self, update: Update) -> list[int]:
        cid = update.client_id
        self.last_base_version = int(update.base_version)
        w = np.asarray(update.flat, dtype=np.float32)
        if not np.isfinite(w).all():
            self.num_rejected += 1  # NaN guard: records unchanged, the uploader gets the current model
            self.last_broadcast = False
            return [cid]
        self.version += 1  # t
        self.s_w[cid] = w
        if self.config.version_mode == "server":
            self.s_v[cid] = self.version
            gaps = self.version - self.s_v
        else:
            v_latest = int(update.client_version)
            self.s_v[cid] = v_latest
            gaps = np.maximum(0, v_latest - self.s_v)
        rho = self._weights(gaps)
        weighted_mean(self.s_w, rho, out=self.global_flat)  # eqs 9-10, accumulated in place
        self.last_max_gap = int(gaps.max())
        self.last_broadcast = self.last_max_gap >= self.threshold
        if self.last_broadcast:
            return list(range(self.context.num_clients))
        return [cid]

    def _weights(self, gaps: np.ndarray) -> np.ndarray:
        """Eq 9's factors, none for an evicted site."""
        rho = dwa_weights(gaps, self.config.staleness_exponent)
        rho[sorted(self.gone)] = 0.0
        return rho

    def forget(self, client_id: int) -> None:
        """An evicted site's record leaves S_W: the model is recomputed (eqs 9-10) from the others'."""
        self.gone.add(client_id)
        self.s_w[client_id] = 0.0
        if len(self.gone) < self.context.num_clients:
            gaps = self.version - self.s_v if self.config.version_mode == "server" else np.zeros_like(self.s_v)
            weighted_mean(self.s_w, self._weights(np.maximum(gaps, 0)), out=self.global_flat)

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header, arrays = super().state_dict()
        header["num_rejected"] = self.num_rejected
        header["gone"] = sorted(self.gone)
        return header, {**arrays, "s_w": self.s_w, "s_v": self.s_v, **self.buffers.state()}

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        super().load_state_dict(state)
        header, arrays = state
        self.s_w = np.array(arrays["s_w"], dtype=np.float32)
        self.s_v = np.array(arrays["s_v"], dtype=np.int64)
        self.buffers.load(arrays)
        self.num_rejected = int(header.get("num_rejected", 0))
        self.gone = {int(c) for c in header.get("gone", []) if 0 <= int(c) < self.context.num_clients}

    def metrics(self) -> dict[str, float]:
        # base_version (the server version of the model the upload was trained from) lets a reader
        # check from metrics.jsonl that a client never trains on a model older than its last answer.
        return {"max_version_gap": float(self.last_max_gap), "dwa_broadcast": float(self.last_broadcast),
                "base_version": float(self.last_base_version)}
