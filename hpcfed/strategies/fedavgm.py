"""FedAvgM: FedAvg with server momentum (Hsu, Qi and Brown 2019, "Measuring the Effects of
Non-Identical Data Distribution for Federated Visual Classification", §3 and Algorithm 1's server step).

Each round the server takes FedAvg's weighted mean of the sites' models, θ̄_r, as a step
Δ_r = θ̄_r - θ_r (the negated pseudo-gradient) and applies it with momentum β and server learning rate η:

    v_{r+1} = β·v_r + Δ_r,        θ_{r+1} = θ_r + η·v_{r+1}        (v_0 = 0)

β = 0, η = 1 is FedAvg. A round that folded nothing (every upload refused, a lost secure round)
leaves the model and the velocity as they were. Δ_r is a weighted mean, so FedAvgM declares
``aggregates = WEIGHTED_SUM`` (inherited from FedAvg): secure aggregation hands it Σ n_k δ_k and
Σ n_k, and the DP wrappers (`hpcfed.strategies.dp`) hand it their noised mean; it runs under both
with no line elsewhere. Memory on rank 0: FedAvg's plus the float32 velocity and a float64 copy of
θ_r during `end_round`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcfed.params import Params
from hpcfed.strategies.fedavg import FedAvg


class FedAvgM(FedAvg):
    """FedAvg's mean (or robust rule) as a step, applied with server momentum (see the module's docstring)."""

    name = "fedavgm"

    @dataclass(kw_only=True)
    class Config(FedAvg.Config):
        server_lr: float = 1.0  # η
        momentum: float = 0.9  # β (Hsu et al. 2019 use 0.9 and above)

        def validate(self) -> None:
            super().validate()
            if not (math.isfinite(self.server_lr) and self.server_lr > 0):
                raise ValueError(f"server_lr={self.server_lr!r}; give a finite number > 0 (1.0: FedAvg's step)")
            if not 0 <= self.momentum < 1:
                raise ValueError(f"momentum={self.momentum!r}; give a number in [0, 1) (0: no momentum)")

    def initialize(self, initial: Params) -> None:
        super().initialize(initial)
        self.velocity = np.zeros(self.layout.size, dtype=np.float32)

    def end_round(self, round: int) -> None:
        took = self._mean.count if self._mean is not None else len(self._held)
        before = self.global_flat.astype(np.float64)
        super().end_round(round)  # global_flat = FedAvg's mean of the round (θ̄_r)
        if not took:
            return
        step = self.global_flat.astype(np.float64) - before  # Δ_r
        step += self.config.momentum * self.velocity.astype(np.float64)  # v_{r+1} = β·v_r + Δ_r
        self.velocity[:] = step
        before += self.config.server_lr * step  # θ_{r+1} = θ_r + η·v_{r+1}
        self.global_flat[:] = before

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header, arrays = super().state_dict()
        return header, {**arrays, "velocity": self.velocity}

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        super().load_state_dict(state)
        velocity = state[1].get("velocity")
        shape = None if velocity is None else velocity.shape
        if shape != self.global_flat.shape:
            raise ValueError(f"checkpoint's FedAvgM velocity is missing or has shape {shape}, the model "
                             f"{self.global_flat.shape}; resume with the config that wrote it (strategy fedavgm)")
        self.velocity = np.array(velocity, dtype=np.float32)
