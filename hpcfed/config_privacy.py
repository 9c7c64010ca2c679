"""The ``privacy`` section of the run configuration (README "Which protection when"): site-level DP
(DP-FedAvg, with adaptive clipping), record-level DP (DP-SGD inside each site), secure aggregation
and its input encoding. `hpcfed.config.Config` holds them under ``privacy``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hpcfed.schema import InvalidValue
from hpcfed.schema import positive as _positive


@dataclass(kw_only=True)
class AdaptiveClipConfig:
    """Adaptive clipping (Andrew et al. 2021): C follows a quantile of the sites' update norms,
    steered by a noisy count of the sites that were not clipped."""

    target_quantile: float = 0.5  # the fraction of sites whose update should pass unclipped
    learning_rate: float = 0.2  # geometric step: C <- C * exp(-lr * (noisy fraction - quantile))
    count_stddev: float  # std of the Gaussian noise on the unclipped count; must be > noise_multiplier / 2

    def validate(self) -> None:
        if not 0.0 < self.target_quantile < 1.0:
            raise InvalidValue("target_quantile", f"must be in (0, 1), got {self.target_quantile!r}")
        _positive(self, "learning_rate", "count_stddev")


@dataclass(kw_only=True)
class DPConfig:
    """Site-level differential privacy, DP-FedAvg (McMahan et al. 2018), central mode: the server
    clips each site's update to L2 norm `clip_norm`, adds Gaussian noise of std
    `noise_multiplier` x `clip_norm` to the sum, and an RDP accountant tracks ε at `delta`."""

    clip_norm: float = 1.0  # C; with `adaptive`, the starting value
    noise_multiplier: float = 1.0  # z: noise std over C, as the accountant counts it
    delta: float = 1e-5
    max_epsilon: float | None = None  # the run stops before a round would take ε past this
    adaptive: AdaptiveClipConfig | None = None
    # With secure aggregation, the sites' noise: "skellam" (integer noise on the fixed-point grid, the
    # exact distributed mechanism: hpcfed.privacy.skellam) or "gaussian" (continuous, then rounded).
    # Unset: skellam with secure aggregation; central mode's noise is the server's Gaussian.
    noise: str | None = None

    def discrete(self, secure_aggregation: bool) -> bool:
        """Whether the sites add integer (Skellam) noise: under secure aggregation, unless gaussian is asked."""
        return secure_aggregation and self.noise != "gaussian"

    def validate(self) -> None:
        if self.noise not in (None, "skellam", "gaussian"):
            raise InvalidValue("noise", f"must be skellam or gaussian (the sites' noise under secure aggregation), "
                                        f"got {self.noise!r}")
        _positive(self, "clip_norm", "noise_multiplier", "max_epsilon")
        for name in ("clip_norm", "noise_multiplier", "delta", "max_epsilon"):
            value = getattr(self, name)
            if value is not None and not math.isfinite(value):
                raise InvalidValue(name, f"must be a finite number, got {value!r}")
        if not 0.0 < self.delta < 1.0:
            raise InvalidValue("delta", f"must be in (0, 1) (typically below 1 / number of sites), got {self.delta!r}")
        if self.adaptive is not None and not self.adaptive.count_stddev > self.noise_multiplier / 2:
            raise InvalidValue("adaptive.count_stddev",
                               f"must be > noise_multiplier / 2 = {self.noise_multiplier / 2:g} (the count's noise "
                               f"takes a share of the budget: Andrew et al. 2021), got {self.adaptive.count_stddev!r}")


@dataclass(kw_only=True)
class SecAggConfig:
    """How a site bounds and encodes its update before masking it (secure aggregation)."""

    clip_norm: float = 10.0  # L2 bound on a site's update delta (privacy.dp.clip_norm replaces it with DP)
    max_examples: int = 65536  # the masked weight is n / max_examples: a site claiming more is refused
    degree: int | None = None  # SecAgg+ neighbours per site (default 2*ceil(log2 K), all when K is small)
    min_group: int = 2  # the fewest sites a sum rank 0 sees may cover, in group testing too (docs/threats.md)
    max_hostile: int = 1  # the most hostile sites group testing assumes: its proofs hold up to this many

    def validate(self) -> None:
        _positive(self, "clip_norm", "max_examples", "degree", "max_hostile")
        if self.min_group < 2:
            raise InvalidValue("min_group", f"must be >= 2 (a sum over one site is that site's input), got "
                                            f"{self.min_group!r}")
        if not math.isfinite(self.clip_norm):
            raise InvalidValue("clip_norm", f"must be a finite number, got {self.clip_norm!r}")
        if self.max_examples >= 1 << 31:
            raise InvalidValue("max_examples", f"must be below 2**31 (it travels as uint32), got {self.max_examples}")
        if self.degree is not None and self.degree < 2:
            # threshold_for(1) = 1: one neighbour alone (colluding with the server) would hold a site's seed
            raise InvalidValue("degree", f"{self.degree} gives a Shamir threshold of 1, so one neighbour colluding "
                                         f"with the server could unmask a site; set it to 2 or more, or leave it "
                                         f"unset for 2*ceil(log2 K)")


@dataclass(kw_only=True)
class RecordDPConfig:
    """Record-level differential privacy: DP-SGD inside each site (hpcfed.privacy.record_dp). Each
    site clips every example's gradient to `clip_norm`, adds Gaussian noise and samples its batches
    by Poisson sampling; its own accountant holds ε at `delta` over every local step of the run."""

    epsilon: float  # the target for the whole run, per site (required)
    delta: float | None = None  # default min(1 / (10 n_site), 1e-5); must be < 1 / n_site
    clip_norm: float = 1.0  # per-example gradient L2 bound
    noise_multiplier: float | None = None  # None: computed from epsilon, the sampling rate, the steps and rounds
    site_epsilon: dict[int, float] = field(default_factory=dict)  # client_id -> its own target, over `epsilon`

    def validate(self) -> None:
        checks = {name: getattr(self, name) for name in ("epsilon", "delta", "clip_norm", "noise_multiplier")}
        checks.update({f"site_epsilon.{cid}": eps for cid, eps in self.site_epsilon.items()})
        for name, value in checks.items():
            if value is not None and not math.isfinite(value):
                raise InvalidValue(name, f"must be a finite number, got {value!r}")
            if value is not None and name != "delta" and not value > 0:
                raise InvalidValue(name, f"must be > 0, got {value!r}")
        if self.delta is not None and not 0.0 < self.delta < 1.0:
            raise InvalidValue("delta", f"must be in (0, 1) and below 1 / (records per site), got {self.delta!r}")

    def target(self, client_id: int) -> float:
        """Site `client_id`'s target ε: its own in `site_epsilon`, else `epsilon`."""
        return self.site_epsilon.get(client_id, self.epsilon)


@dataclass(kw_only=True)
class PrivacyConfig:
    """What the server may learn of each site (README, "What the server sees")."""

    secure_aggregation: bool = False
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    dp: DPConfig | None = None
    record_dp: RecordDPConfig | None = None
