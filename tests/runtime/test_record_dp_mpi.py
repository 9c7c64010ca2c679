"""Record-level DP under mpiexec: ε per site each round in metrics.jsonl and in summary.json, a
halted-then-resumed twin that reports the same ε and ends bit-identical, and the budget stop (one
site stops, the other goes on, the run ends when none can).

Record DP with secure aggregation, and under an asynchronous strategy (FedDWA), run in
tests/ops/test_site_ranks.py, whose federations carry them beside the sites of two ranks: every
launch imports torch afresh on each site rank, most of a small run's CPU."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import pytest
from conftest import run_cli

from hpcfed.privacy.record_dp import epsilon
from hpcfed.store import checkpoint as ck

pytestmark = pytest.mark.mpi

QUICK = ["influence.enabled=false", "privacy.record_dp.delta=1e-5"]


def _events(out: Path, name: str) -> dict[tuple[int, int], float]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return {(e["round"], e["client"]): e["value"] for e in map(json.loads, lines) if e["name"] == name}


def _global(out: Path) -> bytes:
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:
        return f["strategy/global"][()].tobytes()


def test_record_dp_reports_epsilon_per_site_and_a_resumed_twin_reports_the_same(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    args = [*QUICK, "privacy.record_dp.epsilon=4", "rounds=3", "checkpoint_every=1"]
    run_cli(["run", "configs/quickstart.yaml", "--out", str(full), *args], np=3, timeout=400)
    eps = _events(full, "record_dp_epsilon")
    assert set(eps) == {(r, c) for r in range(3) for c in range(2)}
    assert all(eps[(0, c)] < eps[(1, c)] < eps[(2, c)] <= 4.0 + 1e-6 for c in range(2))
    assert eps[(2, 0)] > 3.9  # the noise was set to spend the target over the whole run
    summary = json.loads((full / "summary.json").read_text())
    record = summary["privacy"]["record_dp"]
    assert record["sites"] == {"0": pytest.approx(eps[(2, 0)]), "1": pytest.approx(eps[(2, 1)])}
    assert record["epsilon"] == max(record["sites"].values()) and record["delta"] == 1e-5
    assert "train_loss" not in json.dumps(summary["mean"])  # not released under record DP

    run_cli(["run", "configs/quickstart.yaml", "--out", str(part), *args, "halt_after_round=0"], np=3, timeout=400)
    run_cli(["run", "configs/quickstart.yaml", "--out", str(part), *args, "--resume"], np=3, timeout=400)
    resumed = json.loads((part / "summary.json").read_text())
    assert resumed["privacy"]["record_dp"] == record
    assert _global(full) == _global(part) and resumed["clients"] == summary["clients"]
    # a resume under other record_dp settings is refused, naming the key
    proc = run_cli(["run", "configs/quickstart.yaml", "--out", str(part), *args, "privacy.record_dp.epsilon=2",
                    "--resume"], np=3, timeout=400, check=False)
    assert proc.returncode != 0 and "privacy.record_dp.epsilon" in proc.stderr


def test_a_site_at_its_budget_stops_the_other_goes_on_and_the_run_ends_when_none_can(tmp_path):
    # z = 1.5, q = 32/500, 16 steps a round: ε 1.20, 1.51, 1.77, 2.01 after rounds 0..3 (δ = 1e-5)
    out = tmp_path / "run"
    run_cli(["run", "configs/quickstart.yaml", "--out", str(out), *QUICK, "rounds=6", "checkpoint_every=0",
             "privacy.record_dp.epsilon=1.9", "privacy.record_dp.noise_multiplier=1.5",
             "privacy.record_dp.site_epsilon={1: 1.3}"], np=3, timeout=400)
    stopped, eps = _events(out, "record_dp_stopped"), _events(out, "record_dp_epsilon")
    assert [stopped[(r, 1)] for r in range(4)] == [0.0, 1.0, 1.0, 1.0]  # site 1 stops after round 0
    assert [stopped[(r, 0)] for r in range(4)] == [0.0, 0.0, 0.0, 1.0]  # site 0 trains on to round 2
    assert max(r for r, _ in eps) == 3  # then neither can go on: the run ends after round 3, not 5
    sites = json.loads((out / "summary.json").read_text())["privacy"]["record_dp"]["sites"]
    assert sites["1"] == pytest.approx(epsilon(1.5, 32 / 500, 16, 1e-5)) and sites["1"] <= 1.3
    assert sites["0"] == pytest.approx(epsilon(1.5, 32 / 500, 48, 1e-5)) and sites["0"] <= 1.9
