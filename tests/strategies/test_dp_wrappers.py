"""DP-FedAvg as a wrapper around a weighted-mean strategy (`hpcfed.strategies.dp`): one round by hand,
the budget, the checkpointed accountant; and the config checks that select it (hostile values, async,
other rules, the influence guard), which read the strategy's declaration (`hpcfed.privacy.requirements`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from hpcfed.config import AdaptiveClipConfig, ConfigError, DPConfig, from_mapping
from hpcfed.privacy import dp, requirements
from hpcfed.privacy.accountant import epsilon
from hpcfed.registry import resolve
from hpcfed.strategies import base
from hpcfed.strategies.base import StrategyContext, Update
from hpcfed.strategies.dp import CentralDP, DistributedDP, with_privacy
from hpcfed.strategies.fedavg import FedAvg
from hpcfed.strategies.robust import Median


def _strategy(dp_cfg: DPConfig, k: int = 3) -> CentralDP:
    ctx = StrategyContext(num_clients=k, seed=11, dp=dp_cfg)
    s = CentralDP(FedAvg(FedAvg.Config(), ctx), ctx)
    s.initialize({"w": np.array([1.0, 1.0], dtype=np.float32)})
    return s


def test_one_round_adds_the_clipped_mean_and_the_seeded_noise():
    s = _strategy(DPConfig(clip_norm=1.0, noise_multiplier=0.5))
    s.begin_round(0)
    s.fold(Update(0, np.array([4.0, 5.0], dtype=np.float32), 10))  # delta (3, 4) -> (0.6, 0.8)
    s.fold(Update(1, np.array([1.0, 1.5], dtype=np.float32), 999))  # delta (0, 0.5); its claim is ignored
    s.end_round(0)
    want = np.array([1.0, 1.0]) + (np.array([0.6, 1.3]) + dp.gaussian_noise(2, 0.5, 11, 0)) / 3
    assert s.global_flat == pytest.approx(want.astype(np.float32))
    assert s.metrics()["epsilon"] == pytest.approx(epsilon(0.5, 1, 1e-5))


def test_budget_limits_rounds_and_resume_restores_epsilon_and_clip():
    cfg = DPConfig(clip_norm=1.0, noise_multiplier=2.0, max_epsilon=epsilon(2.0, 4, 1e-5) + 1e-9,
                   adaptive=AdaptiveClipConfig(count_stddev=1.5))
    s = _strategy(cfg)
    assert s.round_limit(10) == 4 and s.round_limit(3) == 3
    for r in range(2):
        s.begin_round(r)
        s.fold(Update(0, np.array([9.0, 9.0], dtype=np.float32), 1))
        s.end_round(r)
    assert s.clip_norm != 1.0  # adaptive
    twin = _strategy(cfg)
    twin.load_state_dict(s.state_dict())
    assert (twin.accountant.rounds, twin.clip_norm, twin.report()) == (2, s.clip_norm, s.report())
    assert twin.report()["privacy"]["epsilon"] == pytest.approx(epsilon(2.0, 2, 1e-5))


def test_a_group_round_is_counted_at_its_groups_multiplier_and_resumed_so():
    """Group testing tells distributed DP the multiplier its smallest group is released at; the
    accountant composes the round at it, and a resumed twin reports the same ε."""
    ctx = StrategyContext(num_clients=4, seed=3, dp=DPConfig(clip_norm=1.0, noise_multiplier=2.0))
    s = DistributedDP(FedAvg(FedAvg.Config(), ctx), ctx)
    s.initialize({"w": np.zeros(2, dtype=np.float32)})
    for r, lowered in enumerate([None, 2.0 * (2 / 4) ** 0.5, None]):
        s.begin_round(r)
        if lowered is not None:
            s.release_at(lowered)
        s.fold_sum(np.array([0.1, 0.2]), 4.0, 4)
        s.end_round(r)
    assert s.accountant.lowered == [pytest.approx(2.0 ** 0.5)]
    assert s.report()["privacy"]["epsilon"] == pytest.approx(epsilon(2.0, 3, 1e-5, [2.0 ** 0.5]))
    twin = DistributedDP(FedAvg(FedAvg.Config(), ctx), ctx)
    twin.initialize({"w": np.zeros(2, dtype=np.float32)})
    twin.load_state_dict(s.state_dict())
    assert twin.report()["privacy"]["epsilon"] == s.report()["privacy"]["epsilon"]
    header, arrays = s.state_dict()
    with pytest.raises(ValueError, match="DP state"):  # a hostile or corrupt checkpoint: z above the run's
        twin.load_state_dict(({**header, "dp_lowered": [5.0]}, arrays))


def test_a_checkpoint_without_dp_state_is_refused():
    s = _strategy(DPConfig())
    with pytest.raises(ValueError, match="DP state"):
        s.load_state_dict(({"version": 3}, {"global": np.zeros(2, np.float32)}))  # plain FedAvg's checkpoint


QUICKSTART = yaml.safe_load(Path("configs/quickstart.yaml").read_text())
DP_OK = ["influence.enabled=false", "privacy.dp.clip_norm=1"]


@pytest.mark.parametrize(("override", "says"), [
    ("privacy.dp.clip_norm=-1", "clip_norm must be > 0"),
    ("privacy.dp.noise_multiplier=0", "noise_multiplier must be > 0"),
    ("privacy.dp.noise_multiplier=.nan", "noise_multiplier must be > 0"),
    ("privacy.dp.clip_norm=.inf", "clip_norm must be a finite number"),
    ("privacy.dp.delta=1", "delta must be in (0, 1)"),
    ("privacy.dp.delta=-0.1", "delta must be in (0, 1)"),
    ("privacy.dp.max_epsilon=-3", "max_epsilon must be > 0"),
    ("privacy.dp.max_epsilon=0.5", "below the ε of a single round"),
    ("privacy.dp.adaptive.count_stddev=0.2", "count_stddev must be > noise_multiplier / 2"),
    ("privacy.dp.adaptive={count_stddev: 2, target_quantile: 1.5}", "target_quantile must be in (0, 1)"),
    ("privacy.dp.sigma=1", "unknown key"),
    ("privacy.secagg.clip_norm=0", "clip_norm must be > 0"),
    ("privacy.secagg.min_group=1", "privacy.secagg.min_group must be >= 2 (a sum over one site is that site's input)"),
    ("privacy.secagg.max_hostile=0", "privacy.secagg.max_hostile must be > 0"),
    ("strategy.rule=median", "rule 'median'"),
    ("influence.enabled=true", "influence.enabled"),
])
def test_hostile_or_unsupported_privacy_configs_are_refused_naming_the_key(override, says):
    with pytest.raises(ConfigError) as err:
        resolve(from_mapping(QUICKSTART, [*DP_OK, override], source="configs/quickstart.yaml"))
    assert says in str(err.value)


def test_privacy_dp_in_an_async_federation_is_refused():
    raw = {**QUICKSTART, "strategy": {"name": "fedasync"}}
    with pytest.raises(ConfigError, match="synchronous rounds only"):
        resolve(from_mapping(raw, DP_OK, source="q.yaml"))


def _fedavg(cfg, k: int = 3) -> FedAvg:
    s = FedAvg(FedAvg.Config(), StrategyContext(num_clients=k, seed=1, dp=cfg.privacy.dp))
    s.initialize({"w": np.array([1.0, 1.0], dtype=np.float32)})
    return s


def test_privacy_dp_wraps_the_strategy_and_nothing_else_does():
    plain = from_mapping(QUICKSTART, [], source="q.yaml")
    private = from_mapping(QUICKSTART, DP_OK, source="q.yaml")
    resolve(private)
    inner = _fedavg(plain)
    assert with_privacy(inner, plain.privacy, inner.context) is inner
    wrapped = with_privacy(inner, private.privacy, StrategyContext(num_clients=3, seed=1, dp=private.privacy.dp))
    assert isinstance(wrapped, CentralDP) and not isinstance(wrapped, DistributedDP) and wrapped.inner is inner
    assert wrapped.global_flat is inner.global_flat and wrapped.version == inner.version == 1


def test_the_wrapper_refuses_a_strategy_that_needs_each_upload_by_its_declaration():
    ctx = StrategyContext(num_clients=3, seed=1, dp=DPConfig())
    robust = FedAvg(FedAvg.Config(rule="median"), ctx)
    assert FedAvg.aggregates_with(robust.config) == base.EACH_UPLOAD and Median.aggregates == base.EACH_UPLOAD
    with pytest.raises(TypeError, match="aggregates='weighted_sum'"):
        CentralDP(robust, ctx)
    with pytest.raises(TypeError, match="cannot fold a weighted sum"):
        Median(Median.Config(), ctx).fold_sum(np.zeros(2), 1.0, 1)
    assert requirements.WEIGHTED_SUM == base.WEIGHTED_SUM  # privacy reads the declaration without importing strategies


def test_a_central_dp_round_moves_the_model_as_the_unwrapped_formula_does_to_the_bit():
    """θ + (Σ clip + noise) / K, in float64 then float32: the wrapper hands FedAvg (step, weight 1.0)."""
    s = _strategy(DPConfig(clip_norm=1.0, noise_multiplier=0.5))
    g = s.global_flat.copy()
    s.begin_round(0)
    s.fold(Update(0, np.array([4.0, 5.0], dtype=np.float32), 10))
    s.end_round(0)
    step = (np.array([0.6, 0.8]) + dp.gaussian_noise(2, 0.5, 11, 0)) / 3
    assert s.global_flat.tobytes() == (g.astype(np.float64) + step).astype(np.float32).tobytes()


SECAGG = ["privacy.secure_aggregation=true"]


@pytest.mark.parametrize(("raw", "override", "says"), [
    ({"strategy": {"name": "fedasync"}}, [], "asynchronous strategy 'fedasync' applies each upload on its own"),
    ({}, ["strategy.rule=krum"], "rule 'krum'"),
    ({}, [*DP_OK, "privacy.dp.adaptive={count_stddev: 2}"], "clipped count is not masked"),
    ({"security": {"mode": "keys", "identity": "k{rank}"}}, [], "security.authorized_keys"),
    ({}, ["privacy.secagg.max_examples=4294967296"], "below 2**31"),
])
def test_secure_aggregation_configs_it_cannot_honour_are_refused_naming_the_key(raw, override, says):
    with pytest.raises(ConfigError, match=r"privacy|max_examples") as err:
        resolve(from_mapping({**QUICKSTART, **raw}, [*SECAGG, *override], source="q.yaml"))
    assert says in str(err.value)


def test_distributed_dp_adds_no_noise_of_its_own_and_divides_the_sites_noised_sum_by_k():
    cfg = from_mapping(QUICKSTART, [*SECAGG, "privacy.dp.clip_norm=1"], source="q.yaml")
    resolve(cfg)  # the influence guard may stay on: secure aggregation replaces it
    ctx = StrategyContext(num_clients=4, seed=1, dp=DPConfig(clip_norm=1.0))
    s = with_privacy(FedAvg(FedAvg.Config(), ctx), cfg.privacy, ctx)
    assert isinstance(s, DistributedDP) and s.aggregates == base.WEIGHTED_SUM
    s.initialize({"w": np.array([1.0, 1.0], dtype=np.float32)})
    s.begin_round(0)
    s.fold_sum(np.array([2.0, -1.0]), 3, 3)  # three sites answered; the denominator stays K = 4
    s.end_round(0)
    assert s.global_flat.tolist() == [1.5, 0.75] and s.accountant.rounds == 1
    assert s.report()["privacy"]["secure_aggregation"] is True
