"""What the run's ``privacy`` section asks of its strategy, checked against what the strategy declares.

Secure aggregation gives rank 0 one sum per round (asynchronously, per buffer: FedBuff), and DP
(`hpcfed.strategies.dp`) hands the wrapped strategy one noised mean: both need a strategy that declares
``aggregates = "weighted_sum"`` (`hpcfed.strategies.base`), DP a synchronous one; an async strategy
may instead declare ``folds_buffers`` (FedDWA: each secure buffer's sum a record). They read that
declaration, never the strategy's class, so a new weighted-mean strategy (FedAvgM) runs under either
with no line here. Each refusal is one line naming the key and the fix (a `ConfigError`);
`hpcfed.registry.resolve` calls `check_privacy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcfed.config import Config, ConfigError
from hpcfed.schema import locate

WEIGHTED_SUM = "weighted_sum"  # hpcfed.strategies.base.WEIGHTED_SUM (privacy imports no strategy)


@dataclass(frozen=True)
class Declared:
    """What a strategy declares, as the checks read it (from its class and its built options)."""

    name: str  # strategy.name, as configured
    synchronous: bool  # `Strategy.synchronous`
    aggregates: str  # `Strategy.aggregates_with(config)`: "weighted_sum" or "each_upload"
    folds_buffers: bool = False  # `Strategy.folds_buffers`: an async strategy that can fold a secure buffer's sum
    options: dict[str, Any] = field(default_factory=dict)  # strategy options, to name them in an error

    def describe(self) -> str:
        """``'fedavg' (rule 'median')``: the strategy and the options that were set."""
        opts = ", ".join(f"{k} {v!r}" for k, v in self.options.items())
        return f"{self.name!r}" + (f" ({opts})" if opts else "")


def check_privacy(cfg: Config, strategy: Declared) -> None:
    """Refuse a ``privacy`` section the run cannot honour with `strategy`, in one line naming the key and the fix."""
    if cfg.privacy.secure_aggregation:
        check_secure_aggregation(cfg, strategy)
    dp = cfg.privacy.dp
    if dp is None:
        return
    key = locate(cfg.source, "privacy.dp")
    if dp.noise == "skellam" and not cfg.privacy.secure_aggregation:
        raise ConfigError(f"{locate(cfg.source, 'privacy.dp.noise')} = skellam is the sites' integer noise under "
                          f"secure aggregation; without it the server adds Gaussian noise itself: set "
                          f"privacy.secure_aggregation=true, or remove privacy.dp.noise")
    if not strategy.synchronous:
        raise ConfigError(f"{key}: differential privacy runs in synchronous rounds only, and strategy "
                          f"{strategy.name!r} is asynchronous; choose strategy fedavg, or remove privacy.dp")
    if strategy.aggregates != WEIGHTED_SUM:
        raise ConfigError(f"{key}: DP-FedAvg wraps a strategy that averages clipped updates (one that declares "
                          f"aggregates={WEIGHTED_SUM!r}); strategy {strategy.describe()} needs each upload and cannot "
                          f"carry it: choose strategy fedavg (rule mean) or fedavgm, or remove privacy.dp")
    if cfg.influence.enabled and not cfg.privacy.secure_aggregation:
        raise ConfigError(f"{locate(cfg.source, 'influence.enabled')} = true with privacy.dp: the guard clips each "
                          f"site by the median of the others, so one site changes what the others add and DP's bound "
                          f"on one site breaks; set influence.enabled=false (the clip to privacy.dp.clip_norm "
                          f"bounds every site)")
    from hpcfed.privacy.accountant import epsilon  # dp-accounting loads only for a run with DP

    first = epsilon(dp.noise_multiplier, 1, dp.delta)
    if dp.max_epsilon is not None and first > dp.max_epsilon:
        raise ConfigError(f"{locate(cfg.source, 'privacy.dp.max_epsilon')} = {dp.max_epsilon:g} is below the ε of a "
                          f"single round ({first:.3g} at δ={dp.delta:g}, z={dp.noise_multiplier:g}); raise it or "
                          f"the noise_multiplier")


def check_secure_aggregation(cfg: Config, strategy: Declared) -> None:
    """Secure aggregation gives rank 0 one sum per round (per buffer, asynchronously): only a weighted mean
    can use it, or an async strategy that folds a buffer's sum in its own way (FedDWA's buffer records)."""
    key = locate(cfg.source, "privacy.secure_aggregation")
    if not strategy.synchronous and strategy.aggregates != WEIGHTED_SUM and not strategy.folds_buffers:
        raise ConfigError(f"{key} = true: rank 0 learns only each buffer's sum, and asynchronous strategy "
                          f"{strategy.describe()} applies each upload on its own, so that sum would be one site's "
                          f"update; choose strategy fedbuff (buffers summed securely) or feddwa (each buffer a "
                          f"record), or remove privacy.secure_aggregation")
    if strategy.synchronous and strategy.aggregates != WEIGHTED_SUM:
        raise ConfigError(f"{key} = true: rank 0 learns only the sum of the updates, which a weighted mean needs "
                          f"(aggregates={WEIGHTED_SUM!r}) and strategy {strategy.describe()} cannot work from; "
                          f"choose strategy fedavg (rule mean) or fedavgm, or remove privacy.secure_aggregation")
    dp = cfg.privacy.dp
    if dp is not None and dp.adaptive is not None:
        raise ConfigError(f"{locate(cfg.source, 'privacy.dp.adaptive')} with secure aggregation: the clipped count "
                          f"is not masked yet; use a fixed privacy.dp.clip_norm, or remove one of the two")
    if cfg.security.mode == "keys" and not cfg.security.authorized_keys:
        raise ConfigError(f"{key} = true in keys mode: every site checks its peers' signed agreement keys against "
                          f"security.authorized_keys (the site public keys, rank=N); set it on every rank")
