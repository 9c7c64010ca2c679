"""Record-level differential privacy: the plan of one site's DP-SGD and the site's own accountant.

The unit is one record of one site (a patient, a document), not the site: each site runs DP-SGD
(Abadi et al. 2016) on its own data (`hpcfed.privacy.dp_sgd` does the steps) and keeps its own
accountant. What the accountant assumes, exactly:

- each local step draws its batch by Poisson sampling: every one of the site's n records is in the
  batch independently with probability q = batch_size / n (so batches vary in size);
- each step releases Σ clip(g_i, C) + N(0, (z·C)²) over the batch, i.e. a sampled Gaussian mechanism
  of noise multiplier z and sensitivity C under add/remove-one-record adjacency;
- a run is `rounds` x `steps_per_round` such steps, composed adaptively; everything a site uploads is
  post-processing of them.

ε is `dp-accounting`'s RDP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019 for the sampled
Gaussian) over that composition. Without `noise_multiplier` in the config, z is the smallest that
keeps the whole run within the target ε (`dp_accounting.calibrate_dp_mechanism`). The state to
checkpoint is the steps taken and the plan (q, z, δ, C): ε is a pure function of them, so a resumed
site reports the very ε its uninterrupted twin does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcfed.config import ConfigError, RecordDPConfig
from hpcfed.privacy import load_on_first_use
from hpcfed.schema import locate

if TYPE_CHECKING:
    import dp_accounting
else:
    dp_accounting = load_on_first_use("dp_accounting")  # scipy loads only for a run with record DP

DEFAULT_DELTA = 1e-5
_EPS_SLACK = 1e-9  # ε computed twice from the same numbers may differ in the last bits
# RDP orders: dp-accounting's default set without those below 2, where its series for the sampled
# Gaussian does not converge at small q (it drops them with a warning); they never give the best ε here.
ORDERS = (2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 4.5, *range(5, 64), 128.0, 256.0, 512.0)


def default_delta(records: int) -> float:
    """δ when the config gives none: 1 / (10 n) or 1e-5, whichever is smaller."""
    return min(1.0 / (10 * max(records, 1)), DEFAULT_DELTA)


def _event(sample_rate: float, noise_multiplier: float, steps: int) -> dp_accounting.DpEvent:
    step: dp_accounting.DpEvent = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sample_rate < 1.0:
        step = dp_accounting.PoissonSampledDpEvent(sample_rate, step)
    return dp_accounting.SelfComposedDpEvent(step, steps)


@lru_cache(maxsize=64)
def _step_rdp(noise_multiplier: float, sample_rate: float) -> tuple[float, ...]:
    """The RDP of one step at each of `ORDERS`: the costly part (a series per order), computed once per plan."""
    acc = dp_accounting.rdp.RdpAccountant(list(ORDERS))
    acc.compose(_event(sample_rate, noise_multiplier, 1))
    return tuple(float(v) for v in acc.rdp)


@lru_cache(maxsize=256)  # a round asks for ε after its steps, the next for ε before its own: the same call
def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
    """ε at `delta` after `steps` Poisson-sampled Gaussian steps (rate `sample_rate`, multiplier z); 0 for none.

    RDP composes by adding, so `steps` steps cost `steps` x one step's RDP, as `RdpAccountant` composes a
    `SelfComposedDpEvent`; the conversion to ε is its own (`compute_epsilon`). One step's RDP is cached:
    the accountant's per-round check then costs microseconds, not a series per order each round."""
    if steps < 0 or not noise_multiplier > 0 or not 0 < sample_rate <= 1 or not 0 < delta < 1:
        raise ValueError(f"record-DP accountant needs steps >= 0, z > 0, 0 < q <= 1, 0 < δ < 1; got "
                         f"{steps}, {noise_multiplier}, {sample_rate}, {delta}")
    if steps == 0:
        return 0.0
    rdp = np.asarray(_step_rdp(noise_multiplier, sample_rate)) * steps
    eps, _ = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(ORDERS, rdp, delta)
    return float(eps)


def noise_for(target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The smallest z whose `steps` steps at rate `sample_rate` stay within `target_epsilon` at `delta`."""
    z = dp_accounting.calibrate_dp_mechanism(
        lambda: dp_accounting.rdp.RdpAccountant(list(ORDERS)), lambda z: _event(sample_rate, z, steps),
        target_epsilon, delta, dp_accounting.LowerEndpointAndGuess(1e-3, 1.0), tol=1e-4)
    return float(z)


@dataclass(frozen=True)
class Plan:
    """One site's DP-SGD for the whole run: what the accountant counts with."""

    records: int  # n: the site's training records
    sample_rate: float  # q: each record's chance to be in a step's batch
    noise_multiplier: float  # z: the noise std over clip_norm
    clip_norm: float  # C: the bound on one record's gradient
    delta: float
    target_epsilon: float
    steps_per_round: int

    @property
    def expected_batch(self) -> float:
        """q·n: the batch size the noisy sum is divided by (a fixed denominator, as DP needs)."""
        return self.sample_rate * self.records

    def header(self) -> dict[str, Any]:
        """The plan as JSON numbers (for the site's shard)."""
        return asdict(self)


def plan(settings: RecordDPConfig, *, client_id: int, records: int, batch_size: int, steps_per_round: int,
         rounds: int, where: str = "") -> Plan:
    """The site's plan: q = batch_size / n, δ (default or checked < 1/n), z (given or from the target over
    `rounds` x `steps_per_round` steps). Raises a one-line `ConfigError` naming the key."""
    if records < 1:
        raise ConfigError(f"{locate(where, 'privacy.record_dp')}: this site has no training records")
    delta = settings.delta if settings.delta is not None else default_delta(records)
    if delta >= 1.0 / records:
        raise ConfigError(f"{locate(where, 'privacy.record_dp.delta')} = {delta:g} is >= 1 / {records} (this site's "
                          f"records): a mechanism that publishes one record outright would meet it; set it below "
                          f"{1.0 / (10 * records):.3g}, or leave it out for the default")
    q = min(1.0, batch_size / records)
    target = settings.target(client_id)
    z = settings.noise_multiplier
    if z is None:
        z = noise_for(target, delta, q, rounds * steps_per_round)
    return Plan(records=records, sample_rate=q, noise_multiplier=float(z), clip_norm=settings.clip_norm, delta=delta,
                target_epsilon=target, steps_per_round=steps_per_round)


class SiteAccountant:
    """ε of one site so far: the DP-SGD steps it took under its `Plan`, checkpointed with the site."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.steps = 0

    def epsilon_after(self, steps: int) -> float:
        """ε at the plan's δ after `steps` steps."""
        p = self.plan
        return epsilon(p.noise_multiplier, p.sample_rate, steps, p.delta)

    @property
    def epsilon(self) -> float:
        """ε at δ after the steps taken."""
        return self.epsilon_after(self.steps)

    def can_take_round(self) -> bool:
        """Whether one more round of local steps stays within the target ε."""
        return self.epsilon_after(self.steps + self.plan.steps_per_round) <= self.plan.target_epsilon + _EPS_SLACK

    def spend(self, steps: int) -> None:
        """`steps` more DP-SGD steps were taken."""
        self.steps += steps

    def state(self) -> dict[str, Any]:
        """What the site's shard keeps: the steps and the plan they were taken under."""
        return {"steps": self.steps, "plan": self.plan.header()}

    def load(self, state: Any) -> None:
        """Continue from a shard's `state`; refused when its plan is not this run's (other settings or data)."""
        if not isinstance(state, dict) or not isinstance(state.get("steps"), int) or state["steps"] < 0:
            raise ValueError("saved site state has no valid record_dp accountant (steps); resume with the config "
                             "the checkpoint was made with")
        saved = state.get("plan")
        if saved != self.plan.header():
            raise ValueError(f"saved site state's record_dp plan {saved} differs from this run's "
                             f"{self.plan.header()}; resume with the privacy.record_dp settings, rounds and data "
                             f"the checkpoint was made with")
        self.steps = state["steps"]


def check_task(task_name: str, refusal: str, source: str = "") -> None:
    """Refuse `privacy.record_dp` for a task whose examples are not independent records (`refusal` says why)."""
    if refusal:
        raise ConfigError(f"{locate(source, 'privacy.record_dp')}: task {task_name!r} cannot take record-level DP: "
                          f"{refusal}; remove privacy.record_dp (site-level privacy.dp protects a whole site)")



@dataclass(frozen=True)
class SiteSettings:
    """What a site needs to plan its record-level DP: the config section, the run's rounds, the site's
    secret seed (batches and noise) and where the config came from (for error messages)."""

    settings: RecordDPConfig
    rounds: int
    secret_seed: int
    source: str = ""
