"""FedAvgM (FedAvg with server momentum, Hsu et al. 2019): the server step by hand, FedAvg at β = 0,
the weighted-sum path secure aggregation and DP take, resume, hostile options and checkpoints; and a
real `mpiexec` run under ``privacy.secure_aggregation=true`` whose models follow the momentum formula
from what each site fed the protocol (the spy of tests/runtime/test_secagg_mpi.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import yaml
from conftest import NUMPY_SITES, REPO, mpiexec

from hpcfed.config import ConfigError, DPConfig, from_mapping
from hpcfed.privacy import dp
from hpcfed.registry import resolve, strategy_class
from hpcfed.store import checkpoint as ck
from hpcfed.strategies.base import WEIGHTED_SUM, StrategyContext, Update
from hpcfed.strategies.dp import CentralDP
from hpcfed.strategies.fedavg import FedAvg
from hpcfed.strategies.fedavgm import FedAvgM

CONTEXT = StrategyContext(num_clients=2, seed=0)


def _fedavgm(momentum: float = 0.5, server_lr: float = 1.0, start=(1.0, 1.0)) -> FedAvgM:
    s = FedAvgM(FedAvgM.Config(momentum=momentum, server_lr=server_lr), CONTEXT)
    s.initialize({"w": np.array(start, dtype=np.float32)})
    return s


def _round(s, rnd: int, models: list[tuple[float, float]], weights=(1, 1)) -> None:
    s.begin_round(rnd)
    for cid, (model, n) in enumerate(zip(models, weights)):
        s.fold(Update(cid, np.array(model, dtype=np.float32), n))
    s.end_round(rnd)


def test_the_server_step_by_hand():
    s = _fedavgm(momentum=0.5, server_lr=2.0)  # θ_0 = (1, 1)
    _round(s, 0, [(3, 1), (1, 3)])  # mean (2, 2): Δ = (1, 1), v = (1, 1), θ = (1, 1) + 2·(1, 1)
    assert s.global_flat.tolist() == [3.0, 3.0] and s.velocity.tolist() == [1.0, 1.0]
    _round(s, 1, [(3, 3), (3, 3)], weights=(5, 1))  # mean (3, 3): Δ = 0, v = (0.5, 0.5), θ = (4, 4)
    assert s.global_flat.tolist() == [4.0, 4.0] and s.velocity.tolist() == [0.5, 0.5]
    _round(s, 2, [(6, 4), (4, 4)], weights=(1, 3))  # mean (4.5, 4): Δ = (.5, 0), v = (.75, .25), θ = (5.5, 4.5)
    assert s.global_flat.tolist() == [5.5, 4.5] and s.velocity.tolist() == [0.75, 0.25]


def test_a_round_that_folded_nothing_leaves_model_and_velocity():
    s = _fedavgm()
    _round(s, 0, [(3, 1), (1, 3)])
    before = (s.global_flat.copy(), s.velocity.copy())
    _round(s, 1, [])
    assert s.global_flat.tolist() == before[0].tolist() and s.velocity.tolist() == before[1].tolist()


def test_without_momentum_at_server_lr_1_it_is_fedavg_to_the_bit():
    rng = np.random.default_rng(5)
    start = rng.normal(size=64).astype(np.float32)
    a, b = FedAvgM(FedAvgM.Config(momentum=0.0), CONTEXT), FedAvg(FedAvg.Config(), CONTEXT)
    for s in (a, b):
        s.initialize({"w": start.copy()})
    for rnd in range(3):
        models = [start + rng.normal(scale=0.1, size=64).astype(np.float32) for _ in range(3)]
        for s in (a, b):
            s.begin_round(rnd)
            for cid, m in enumerate(models):
                s.fold(Update(cid, m.copy(), 10 + cid))
            s.end_round(rnd)
    assert a.global_flat.tobytes() == b.global_flat.tobytes()


def test_the_weighted_sum_secure_aggregation_hands_it_moves_the_model_as_the_uploads_do():
    plain, secure = _fedavgm(), _fedavgm()
    _round(plain, 0, [(3, 1), (1, 5)], weights=(1, 3))
    secure.begin_round(0)  # Σ n_k δ_k = 1·(2, 0) + 3·(0, 4), Σ n_k = 4
    secure.fold_sum(np.array([2.0, 12.0]), 4.0, 2)
    secure.end_round(0)
    assert secure.global_flat.tolist() == plain.global_flat.tolist() == [1.5, 4.0]
    assert FedAvgM.aggregates == WEIGHTED_SUM == FedAvgM.aggregates_with(FedAvgM.Config())


def test_under_central_dp_the_noised_mean_is_its_pseudo_gradient():
    ctx = StrategyContext(num_clients=2, seed=11, dp=DPConfig(clip_norm=1.0, noise_multiplier=0.5))
    s = CentralDP(FedAvgM(FedAvgM.Config(momentum=0.5, server_lr=2.0), ctx), ctx)
    s.initialize({"w": np.array([1.0, 1.0], dtype=np.float32)})
    for rnd in range(2):
        s.begin_round(rnd)
        s.fold(Update(0, np.array([4.0, 5.0], dtype=np.float32), 1))  # delta (3, 4) -> clipped (0.6, 0.8)
        s.end_round(rnd)
    def step(theta: np.ndarray, rnd: int) -> np.ndarray:  # (clip_1(model - θ) + noise) / K
        delta = np.array([4.0, 5.0]) - theta
        return (delta * min(1.0, 1.0 / np.linalg.norm(delta)) + dp.gaussian_noise(2, 0.5, 11, rnd)) / 2

    theta0 = np.array([1.0, 1.0])
    v1 = step(theta0, 0)
    theta1 = (theta0 + 2.0 * v1).astype(np.float32).astype(np.float64)
    v2 = 0.5 * v1 + step(theta1, 1)
    assert s.global_flat == pytest.approx(theta1 + 2.0 * v2, rel=1e-5)
    assert s.accountant.rounds == 2 and s.inner.velocity == pytest.approx(v2, rel=1e-5)


def test_resume_continues_the_momentum_and_a_checkpoint_without_it_is_refused():
    s = _fedavgm()
    _round(s, 0, [(3, 1), (1, 3)])
    twin = _fedavgm()
    twin.load_state_dict(s.state_dict())
    for t in (s, twin):
        _round(t, 1, [(2, 5), (4, 1)])
    assert twin.global_flat.tobytes() == s.global_flat.tobytes() and twin.velocity.tobytes() == s.velocity.tobytes()
    header, arrays = s.state_dict()
    with pytest.raises(ValueError, match="velocity is missing"):  # FedAvg's checkpoint
        twin.load_state_dict((header, {"global": arrays["global"]}))
    with pytest.raises(ValueError, match=r"velocity is missing or has shape \(3,\)"):  # a hostile one
        twin.load_state_dict((header, {**arrays, "velocity": np.zeros(3, np.float32)}))


QUICKSTART = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())


@pytest.mark.parametrize(("override", "says"), [
    ("strategy.momentum=1", "momentum=1"),
    ("strategy.momentum=-0.1", "momentum=-0.1"),
    ("strategy.momentum=.nan", "momentum=nan"),
    ("strategy.server_lr=0", "server_lr=0"),
    ("strategy.server_lr=.inf", "server_lr"),
    ("strategy.server_lr=fast", "server_lr"),
])
def test_hostile_options_are_refused_naming_the_key(override, says):
    with pytest.raises(ConfigError, match="strategy") as err:
        resolve(from_mapping(QUICKSTART, ["strategy.name=fedavgm", override], source="q.yaml"))
    assert says in str(err.value)


def test_it_is_registered_and_secure_aggregation_and_dp_take_it_by_its_declaration():
    assert strategy_class("fedavgm") is FedAvgM
    for extra in (["privacy.secure_aggregation=true"], ["privacy.dp.clip_norm=1", "influence.enabled=false"],
                  ["privacy.secure_aggregation=true", "privacy.dp.clip_norm=1"]):
        resolve(from_mapping(QUICKSTART, ["strategy.name=fedavgm", *extra], source="q.yaml"))
    with pytest.raises(ConfigError, match="rule 'median'"):  # a robust rule needs each upload
        resolve(from_mapping(QUICKSTART, ["strategy.name=fedavgm", "strategy.rule=median",
                                          "privacy.secure_aggregation=true"], source="q.yaml"))


# -- under mpiexec, with secure aggregation -------------------------------------------------------
SPY = REPO / "tests" / "privacy" / "secagg_spy.py"
BETA, ETA = 0.5, 1.5


@pytest.mark.mpi
def test_under_secure_aggregation_each_round_model_follows_the_momentum_formula(tmp_path):
    """3 sites, 3 rounds of fedavgm with privacy.secure_aggregation=true under `mpiexec -n 4`. Rank 0
    learns each round's sum only; the model each site is sent next is θ + η(β v + Δ) of the weighted
    mean delta Δ of what the sites fed the protocol (within fixed point), and it is not FedAvg's."""
    out, spy = tmp_path / "run", tmp_path / "spy"
    cmd = [mpiexec(), "-n", "4", sys.executable, str(SPY), str(spy), "-1", "run", "configs/quickstart.yaml",
           NUMPY_SITES, "--out", str(out), "rounds=3", "checkpoint_every=1", "strategy.name=fedavgm",
           f"strategy.momentum={BETA}", f"strategy.server_lr={ETA}", "privacy.secure_aggregation=true",
           "influence.enabled=false", "federation.round_deadline_s=60"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HPCFED_PSK": "00" * 32}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["secure_aggregation"] is True and set(summary["clients"]) == {"0", "1", "2"}
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [e["value"] for e in events if e["name"] == "num_updates"] == [3, 3, 3]
    assert not [e for e in events if e["name"] in ("secagg_sum_refused", "secagg_round_lost", "straggler")]
    assert not [p for p in (spy / "rank0").glob("*.json") if json.loads(p.read_text())["kind"] == 4]  # no UPDATE

    sites = {(c, r): np.load(spy / f"site{c}-r{r}.npz") for c in range(3) for r in range(3)}
    theta, velocity = sites[0, 0]["sent"].astype(np.float64), 0.0
    for rnd in range(3):
        assert all(np.array_equal(sites[c, rnd]["sent"], sites[0, rnd]["sent"]) for c in range(3))
        assert np.abs(sites[0, rnd]["sent"] - theta).max() < 1e-5
        w = np.array([float(sites[c, rnd]["weight"]) for c in range(3)])
        mean_delta = (w[:, None] * np.stack([sites[c, rnd]["delta"] for c in range(3)])).sum(0) / w.sum()
        fedavg = sites[0, rnd]["sent"] + mean_delta
        velocity = BETA * velocity + mean_delta
        theta = sites[0, rnd]["sent"] + ETA * velocity
        assert np.abs(theta - fedavg).max() > 1e-3  # the momentum shows: not FedAvg's model
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:  # the newest: round 2's
        final, saved_velocity = f["strategy/global"][()], f["strategy/velocity"][()]
    assert np.abs(final - theta).max() < 1e-5 and np.abs(saved_velocity - velocity).max() < 1e-5
