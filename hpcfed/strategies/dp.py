"""DP-FedAvg (McMahan et al. 2018) as a wrapper around any strategy that declares a weighted mean
(``aggregates = WEIGHTED_SUM``: FedAvg's mean, FedAvgM), the way Flower wraps a strategy in
``DifferentialPrivacyServerSideFixedClipping``: clip, delegate, add noise. The wrapped strategy
never knows; the run's ``privacy.dp`` section installs the wrapper (`with_privacy`), never a name.

Central mode (`CentralDP`): each site's delta from the model it was sent is clipped to C and summed;
at the round's end the wrapper adds Gaussian noise and hands the wrapped strategy the noised mean

    step_r = (Σ_k clip_C(θ_k - θ_r) + N(0, (z·C)² I)) / K

as a weighted sum of total weight 1 (`SyncStrategy.fold_sum(step_r, 1.0, count)`); FedAvg then
sets θ_{r+1} = θ_r + step_r, FedAvgM takes step_r as its pseudo-gradient. K is the number of sites
(a fixed denominator: sites are weighted alike, whatever they claim to hold).

Distributed mode (`DistributedDP`, with secure aggregation): each site clips and adds its share of
the noise before masking (`hpcfed.privacy.site_input`); rank 0 gets only the noised sum, divides it
by K and hands it on the same way. It adds no noise of its own.

The mechanism is `hpcfed.privacy.dp`, the accountant `hpcfed.privacy.accountant`; this file holds the
state between rounds: the clip norm (adaptive or not) and the rounds released. It streams: rank 0
holds the model, the float64 sum and the update being received.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcfed.config import DPConfig, PrivacyConfig
from hpcfed.params import ParamLayout, Params
from hpcfed.privacy.accountant import Accountant
from hpcfed.privacy.dp import CentralDP as CentralSum
from hpcfed.privacy.dp import adapt_clip, update_noise_multiplier
from hpcfed.privacy.site_input import InputSpec, spec_for
from hpcfed.strategies.base import WEIGHTED_SUM, Strategy, StrategyContext, SyncStrategy, Update


class CentralDP(SyncStrategy):
    """`inner` (a strategy that declares WEIGHTED_SUM) under central DP: clip each delta, add the noise
    to the round's sum, hand `inner` the noised mean (see the module's docstring)."""

    name = "dp"  # the wrapper's own (class-level, as every strategy's); the wrapped one is `inner.name`

    def __init__(self, inner: SyncStrategy, context: StrategyContext) -> None:
        if inner.aggregates_with(inner.config) != WEIGHTED_SUM:
            raise TypeError(f"DP wraps a strategy that declares aggregates={WEIGHTED_SUM!r}; {inner.name!r} "
                            f"declares {inner.aggregates_with(inner.config)!r}")
        if context.dp is None:
            raise ValueError("a DP wrapper needs the run's privacy.dp section (StrategyContext.dp)")
        self.inner = inner
        super().__init__(inner.config, context)
        self.dp: DPConfig = context.dp
        # The noise must not be reproducible from the config's seed, which summary.json publishes:
        # the runtime passes a seed derived from the job's key (in-process tests pass the run seed).
        self.noise_seed = context.secret_seed if context.secret_seed is not None else context.seed
        self.accountant = Accountant(self.dp.noise_multiplier, self.dp.delta, self.dp.max_epsilon)
        self.clip_norm = self.dp.clip_norm
        adaptive = self.dp.adaptive
        self.z_update = update_noise_multiplier(self.dp.noise_multiplier, adaptive.count_stddev if adaptive else None)
        self._sum: CentralSum | None = None

    # -- the wrapped strategy's state, seen through the wrapper ------------------------------------
    @property  # the base declares a plain attribute; the wrapper shows the wrapped one's
    def version(self) -> int:
        """The wrapped strategy's model version."""
        return self.inner.version

    @version.setter
    def version(self, value: int) -> None:
        self.inner.version = value

    @property
    def global_flat(self) -> np.ndarray:
        """The wrapped strategy's global model."""
        return self.inner.global_flat

    @global_flat.setter
    def global_flat(self, value: np.ndarray) -> None:
        self.inner.global_flat = value

    @property
    def layout(self) -> ParamLayout:
        """The wrapped strategy's parameter layout."""
        return self.inner.layout

    @layout.setter
    def layout(self, value: ParamLayout) -> None:
        self.inner.layout = value

    def initialize(self, initial: Params) -> None:
        self.inner.initialize(initial)

    def model_for(self, client_id: int) -> np.ndarray:
        return self.inner.model_for(client_id)

    def final_model_for(self, client_id: int) -> np.ndarray:
        return self.inner.final_model_for(client_id)

    # -- a round -------------------------------------------------------------------------------------
    def begin_round(self, round: int) -> None:
        self.inner.begin_round(round)
        self._sum = CentralSum(self.layout.size, self.context.num_clients, self.clip_norm, self.z_update)

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
        self.inner.fold_sum(total.noisy_mean(self.noise_seed, round), 1.0, total.added)
        self.inner.end_round(round)
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
        return min(self.inner.round_limit(rounds), self.accountant.rounds_allowed(rounds))

    # -- what it reports and saves -------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        return {**self.inner.metrics(), "epsilon": self.accountant.epsilon, "delta": self.dp.delta,
                "clip_norm": self.clip_norm}

    def report(self) -> dict[str, Any]:
        return {**self.inner.report(), "privacy": {
            "secure_aggregation": False, "epsilon": self.accountant.epsilon, "delta": self.dp.delta,
            "noise_multiplier": self.dp.noise_multiplier, "clip_norm": self.clip_norm,
            "rounds": self.accountant.rounds, "max_epsilon": self.dp.max_epsilon, "accountant": "rdp (dp-accounting)"}}

    def state_dict(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        header, arrays = self.inner.state_dict()
        return {**header, "dp_rounds": self.accountant.rounds, "dp_lowered": list(self.accountant.lowered),
                "dp_clip_norm": self.clip_norm}, arrays

    def load_state_dict(self, state: tuple[dict[str, Any], dict[str, np.ndarray]]) -> None:
        header = state[0]
        rounds, clip_norm = header.get("dp_rounds"), header.get("dp_clip_norm")
        lowered = header.get("dp_lowered", [])  # absent in checkpoints from before group rounds counted
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0 or \
                not isinstance(clip_norm, float) or not clip_norm > 0 or not _lowered_ok(lowered, rounds, self.dp):
            raise ValueError(f"checkpoint's DP state is missing or malformed (dp_rounds={rounds!r}, "
                             f"dp_lowered={str(lowered)[:80]}, dp_clip_norm={clip_norm!r}); resume with the "
                             f"config that wrote it")
        self.inner.load_state_dict(state)
        self.accountant.rounds, self.accountant.lowered, self.clip_norm = rounds, list(lowered), clip_norm


def _lowered_ok(lowered: Any, rounds: int, dp: DPConfig) -> bool:
    """Whether a checkpoint's lowered multipliers are a list of at most `rounds` floats in (0, z]."""
    return isinstance(lowered, list) and len(lowered) <= rounds and all(
        isinstance(z, float) and 0 < z <= dp.noise_multiplier for z in lowered)


class DistributedDP(CentralDP):
    """`inner` under DP with secure aggregation (distributed mode): each site clips its delta to C and
    adds its share of the noise before masking (`hpcfed.privacy.site_input`); rank 0 gets only the
    noised sum Σ_k (clip_C(δ_k) + N(0, (zC)²/m)), divides it by K and hands it to `inner`."""

    name = "dp+secagg"
    aggregates = WEIGHTED_SUM  # it takes the round's secure sum (central DP needs each upload, to clip it)

    def __init__(self, inner: SyncStrategy, context: StrategyContext, spec: InputSpec | None = None) -> None:
        super().__init__(inner, context)
        self.spec = spec  # the sites' encoding: with Skellam noise, the accountant needs its grid
        self._secure_sum: np.ndarray | None = None
        self._count = 0
        self._released_at: float | None = None  # this round's multiplier, where group testing lowers it

    def release_at(self, noise_multiplier: float) -> None:
        """This round's sums are released at `noise_multiplier` (group testing's smallest group): the
        accountant composes the round at it (docs/threats.md, "The DP noise in a group sum")."""
        self._released_at = noise_multiplier

    def initialize(self, initial: Params) -> None:
        super().initialize(initial)
        if self.spec is not None and self.spec.discrete:
            self.accountant.grid = self.spec.grid(self.layout.size)

    def begin_round(self, round: int) -> None:
        self.inner.begin_round(round)
        self._secure_sum = None

    def fold(self, update: Update) -> None:
        raise RuntimeError(f"client {update.client_id}: a plain update reached distributed DP; under secure "
                           f"aggregation rank 0 receives masked inputs only")

    def fold_sum(self, delta_sum: np.ndarray, total_weight: float, count: int) -> None:
        """The round's noised sum of clipped deltas (every site weighs 1: `total_weight` is the count)."""
        self._secure_sum, self._count = delta_sum, count

    def end_round(self, round: int) -> None:
        if self._secure_sum is not None:
            step = self._secure_sum / self.context.num_clients  # the fixed denominator K, as in central mode
            self.inner.fold_sum(step, 1.0, self._count)
        self.inner.end_round(round)
        self._secure_sum = None
        # A round released (even one whose sum was refused: the sites sent noise), at its own multiplier.
        self.accountant.step(self._released_at)
        self._released_at = None

    def report(self) -> dict[str, Any]:
        out = super().report()
        discrete = self.accountant.grid is not None
        out["privacy"].update(secure_aggregation=True, noise=(
            "distributed skellam (each site adds integer noise of std z*C/sqrt(m) on the fixed-point grid)"
            if discrete else "distributed gaussian (each site adds z*C/sqrt(m), then rounds to fixed point)"))
        if discrete:
            out["privacy"]["accountant"] = "rdp, skellam (Agarwal et al. 2021; dp-accounting's conversion)"
        return out


def with_privacy(strategy: Strategy, privacy: PrivacyConfig, context: StrategyContext, quorum: float = 1.0
                 ) -> Strategy:
    """`strategy` as the run's ``privacy`` section asks (checked by `hpcfed.privacy.requirements`):
    wrapped in `DistributedDP` (secure aggregation; the sites' encoding from `quorum`) or `CentralDP`
    when it has ``dp``, else as it is."""
    if privacy.dp is None:
        return strategy
    if not isinstance(strategy, SyncStrategy):  # the base, not a strategy: the config check refuses async + DP
        raise TypeError(f"DP runs in synchronous rounds only; strategy {strategy.name!r} is asynchronous")
    if privacy.secure_aggregation:
        return DistributedDP(strategy, context, spec_for(privacy, context.num_clients, quorum))
    return CentralDP(strategy, context)
