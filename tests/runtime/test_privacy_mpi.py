"""DP-FedAvg under `mpiexec`: ε per round in metrics.jsonl and summary.json, the max_epsilon stop
(checkpoint + summary), a halted-then-resumed twin that ends bit-identical with the same ε, and the
distributed mode under secure aggregation with its discrete (Skellam) noise."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import NUMPY_SITES, run_cli

from hpcfed.privacy import skellam
from hpcfed.privacy.accountant import epsilon
from hpcfed.privacy.site_input import input_spec
from hpcfed.store import checkpoint as ck

pytestmark = pytest.mark.mpi

# z = 2, δ = 1e-5: rounds 1..4 cost ε 2.17, 3.19, 4.01, 4.73; a budget of 4.5 allows 3 of 6 rounds.
DP = ["influence.enabled=false", "privacy.dp.clip_norm=1.0", "privacy.dp.noise_multiplier=2.0",
      "privacy.dp.max_epsilon=4.5", "rounds=6", "checkpoint_every=1"]


def _global(out: Path) -> bytes:
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:
        return f["strategy/global"][()].tobytes()


def test_dp_run_reports_epsilon_stops_at_the_budget_and_resumes_identically(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES, "--out", str(full), *DP], np=3, timeout=300)
    events = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    eps = {e["round"]: e["value"] for e in events if e["name"] == "epsilon"}
    assert eps == pytest.approx({r: epsilon(2.0, r + 1, 1e-5) for r in range(3)})
    summary = json.loads((full / "summary.json").read_text())
    assert summary["privacy"]["rounds"] == 3 and summary["privacy"]["epsilon"] == pytest.approx(eps[2])
    assert summary["privacy"]["epsilon"] <= 4.5 and summary["privacy"]["secure_aggregation"] is False
    assert (summary["privacy"]["delta"], summary["privacy"]["noise_multiplier"]) == (1e-5, 2.0)
    assert ck.latest_valid(full / "checkpoints").round == 2  # the budget's last round was checkpointed

    run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES,
             "--out", str(part), *DP, "halt_after_round=0"], np=3, timeout=300)
    assert not (part / "summary.json").exists()
    run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES, "--out", str(part), *DP, "--resume"], np=3, timeout=300)
    assert _global(full) == _global(part)
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["privacy"] == summary["privacy"] and resumed["clients"] == summary["clients"]


def test_distributed_dp_under_secure_aggregation_adds_skellam_noise_and_counts_it(tmp_path):
    """Secure aggregation with privacy.dp: each site adds integer Skellam noise on the grid (the default),
    and ε per round is the Skellam mechanism's for that grid and the model's size, a little above the
    continuous Gaussian analysis's."""
    out = tmp_path / "dist"
    run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES, "--out", str(out), "influence.enabled=false",
             "privacy.secure_aggregation=true", "privacy.dp.clip_norm=1.0", "privacy.dp.noise_multiplier=2.0",
             "rounds=3"], np=4, timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    privacy = summary["privacy"]
    assert privacy["secure_aggregation"] is True and privacy["noise"].startswith("distributed skellam")
    assert "skellam" in privacy["accountant"] and privacy["rounds"] == 3
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:
        size = f["strategy/global"].size
        assert np.isfinite(f["strategy/global"][()]).all()
    grid = input_spec(3, 1.0, 1, 2.0, 3, discrete=True).grid(size)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    eps = {e["round"]: e["value"] for e in events if e["name"] == "epsilon"}
    assert eps == pytest.approx({r: skellam.epsilon(grid, [(2.0, r + 1)], 1e-5) for r in range(3)})
    assert all(eps[r] > epsilon(2.0, r + 1, 1e-5) for r in range(3))
