"""DP-FedAvg (McMahan et al. 2018), central mode: FedAvg over clipped update deltas plus Gaussian noise,
with an RDP accountant. Selected by the run's ``privacy.dp`` section on top of ``strategy: fedavg``
(rule mean), never by name: `hpcfed.registry.check_privacy` refuses every other combination.

θ_{r+1} = θ_r + (Σ_k clip_C(θ_k - θ_r) + N(0, (z·C)² I)) / K, K the number of sites (a fixed
denominator: sites are weighted alike, whatever they claim to hold). The mechanism is
`hpcfed.privacy.dp`, the accountant `hpcfed.privacy.accountant`; this file holds the state between
rounds: the clip norm (adaptive or not) and the rounds released. It streams like FedAvg's mean: rank 0
holds the model, the float64 sum and the update being received.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcfed.config import DPConfig
from hpcfed.privacy.accountant import Accountant
from hpcfed.privacy.dp import CentralDP, adapt_clip, update_noise_multiplier
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.fedavg import FedAvg


class DPFedAvg(FedAvg):
    name = "fedavg+dp"

    def __init__(self, config: Any, context: StrategyContext) -> None:
        super().__init__(config, context)
        if context.dp is None:
            raise ValueError("DPFedAvg needs the run's privacy.dp section (StrategyContext.dp)")
        if config.rule != "mean":
            raise ValueError(f"DP-FedAvg averages: strategy.rule must be mean, got {config.rule!r}")
        self.dp: DPConfig = context.dp
        # The noise must not be reproducible from the config's seed, which summary.json publishes:
        # the runtime passes a seed derived from the job's key (in-process tests pass the run seed).
        self.noise_seed = context.secret_seed if context.secret_seed is not None else context.seed
        self.accountant = Accountant(self.dp.noise_multiplier, self.dp.delta, self.dp.max_epsilon)
        self.clip_norm = self.dp.clip_norm
        adaptive = self.dp.adaptive
        self.z_update = update_noise_multiplier(self.dp.noise_multiplier, adaptive.count_stddev if adaptive else None)
        self._sum: CentralDP | None = None

    def begin_round(self, round: int) -> None:
        self._held = []
        self._sum = CentralDP(self.layout.size, self.context.num_clients, self.clip_norm, self.z_update)

    def fold(self, update: Update) -> None:
        if self._sum is None:
            raise RuntimeError(f"client {update.client_id}'s update folded outside a round")
        # The delta from the model this site was sent; the global model holds still until end_round.
        self._sum.add(update.vector.astype(np.float64) - self.model_for(update.client_id))
        update.flat = None

    def end_round(self, round: int) -> None:
        if self._sum is None:
            raise RuntimeError(f"round {round} ended before it began")
        total, self._sum = self._sum, None
        step = total.noisy_mean(self.noise_seed, round)
        self.global_flat[:] = (self.global_flat.astype(np.float64) + step).astype(np.float32)
        adaptive = self.dp.adaptive
        if adaptive is not None:
            self.clip_norm = adapt_clip(self.clip_norm, total.unclipped, self.context.num_clients,
                                        adaptive.count_stddev, adaptive.target_quantile, adaptive.learning_rate,
                                        self.noise_seed, round)
        self.accountant.step()

    def aggregate(self, round: int, updates: list[Update]) -> None:
        self.begin_round(round)
        for upd in updates:
            self.fold(upd)
        self.end_round(round)

    def round_limit(self, rounds: int) -> int:
        return self.accountant.rounds_allowed(rounds)

    def metrics(self) -> dict[str, float]:
        return {"epsilon": self.accountant.epsilon, "delta": self.dp.delta, "clip_norm": self.clip_norm}

    def report(self) -> dict[str, Any]:
        return {"privacy": {"secure_aggregation": False, "epsilon": self.accountant.epsilon, "delta": self.dp.delta,
                            "noise_multiplier": self.dp.noise_multiplier, "clip_norm": self.clip_norm,
                            "rounds": self.accountant.rounds, "max_epsilon": self.dp.max_epsilon,
                            "accountant": "rdp (dp-accounting)"}}

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header, arrays = super().state_dict()
        return {**header, "dp_rounds": self.accountant.rounds, "dp_clip_norm": self.clip_norm}, arrays

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        super().load_state_dict(state)
        header = state[0]
        rounds, clip_norm = header.get("dp_rounds"), header.get("dp_clip_norm")
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0 or \
                not isinstance(clip_norm, float) or not clip_norm > 0:
            raise ValueError(f"checkpoint's DP state is missing or malformed (dp_rounds={rounds!r}, "
                             f"dp_clip_norm={clip_norm!r}); resume with the config that wrote it")
        self.accountant.rounds, self.clip_norm = rounds, clip_norm


class DistributedDPFedAvg(DPFedAvg):
    """DP-FedAvg with secure aggregation (distributed mode): each site clips its delta to C and adds
    its share of the noise before masking (`hpcfed.privacy.site_input`); rank 0 gets only the noised
    sum Σ_k (clip_C(δ_k) + N(0, (zC)²/m)) and divides it by K. It adds no noise of its own."""

    name = "fedavg+dp+secagg"

    def begin_round(self, round: int) -> None:
        self._secure_sum: np.ndarray | None = None

    def fold(self, update: Update) -> None:
        raise RuntimeError(f"client {update.client_id}: a plain update reached distributed DP-FedAvg; under secure "
                           f"aggregation rank 0 receives masked inputs only")

    def fold_secure_sum(self, weighted_sum: np.ndarray, total_weight: int, count: int) -> None:
        """The round's noised sum of clipped deltas (every site weighs 1: total_weight is the count)."""
        self._secure_sum = weighted_sum

    def end_round(self, round: int) -> None:
        if self._secure_sum is not None:
            step = self._secure_sum / self.context.num_clients  # the fixed denominator K, as in central mode
            self.global_flat[:] = (self.global_flat.astype(np.float64) + step).astype(np.float32)
        self._secure_sum = None
        self.accountant.step()  # a round released (even one whose sum was refused: the sites sent noise)

    def report(self) -> dict[str, Any]:
        out = super().report()
        out["privacy"].update(secure_aggregation=True, noise="distributed (each site adds z*C/sqrt(m))")
        return out
