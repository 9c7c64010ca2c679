"""DP-FedAvg under `mpiexec -n 3`: ε per round in metrics.jsonl and summary.json, the max_epsilon stop
(checkpoint + summary), and a halted-then-resumed twin that ends bit-identical with the same ε."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
from conftest import run_cli

from hpcfed.privacy.accountant import epsilon
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
    run_cli(["run", "configs/quickstart.yaml", "--out", str(full), *DP], np=3, timeout=300)
    events = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    eps = {e["round"]: e["value"] for e in events if e["name"] == "epsilon"}
    assert eps == pytest.approx({r: epsilon(2.0, r + 1, 1e-5) for r in range(3)})
    summary = json.loads((full / "summary.json").read_text())
    assert summary["privacy"]["rounds"] == 3 and summary["privacy"]["epsilon"] == pytest.approx(eps[2])
    assert summary["privacy"]["epsilon"] <= 4.5 and summary["privacy"]["secure_aggregation"] is False
    assert (summary["privacy"]["delta"], summary["privacy"]["noise_multiplier"]) == (1e-5, 2.0)
    assert ck.latest_valid(full / "checkpoints").round == 2  # the budget's last round was checkpointed

    run_cli(["run", "configs/quickstart.yaml", "--out", str(part), *DP, "halt_after_round=0"], np=3, timeout=300)
    assert not (part / "summary.json").exists()
    run_cli(["run", "configs/quickstart.yaml", "--out", str(part), *DP, "--resume"], np=3, timeout=300)
    assert _global(full) == _global(part)
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["privacy"] == summary["privacy"] and resumed["clients"] == summary["clients"]
