"""Real `mpiexec -n 3` federations of the synthetic task in float32 and in bfloat16: the bf16 model
trains, finishes, and moves half the bytes; summary.json records each rank's cost."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli

pytestmark = pytest.mark.mpi

BALLAST = 300_000  # values of an unused parameter: the model's bytes dominate every message
COMMON = ["rounds=2", "checkpoint_every=0", "eval_every=1", f"task.ballast={BALLAST}", "task.samples_per_site=200"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for dtype in ("float32", "bfloat16"):
        d = tmp_path_factory.mktemp(dtype)
        run_cli(["run", "configs/quickstart.yaml", "--out", str(d), *COMMON, f"task.dtype={dtype}"], np=3, timeout=300)
        out[dtype] = json.loads((d / "summary.json").read_text())
    return out


def test_summary_records_each_ranks_cost(runs):
    cost = runs["float32"]["cost"]
    assert set(cost) == {"0", "1", "2"}
    for rank, c in cost.items():
        assert c["peak_rss_bytes"] > 50 << 20, (rank, c)  # a Python process with numpy and MPI
        assert c["bytes_sent"] > 2 * 4 * BALLAST and c["bytes_received"] > 4 * BALLAST, (rank, c)
        assert c["seal_s"] > 0 and c["open_s"] > 0
    # what the server sent is what the clients received (both count frame bytes), but for the STOP
    # messages sent after the clients took their figures
    assert 0 < cost["0"]["bytes_sent"] - (cost["1"]["bytes_received"] + cost["2"]["bytes_received"]) < 2048


def test_a_bfloat16_model_trains_and_its_updates_are_half_the_bytes(runs):
    f32, bf16 = runs["float32"], runs["bfloat16"]
    assert bf16["missing_clients"] == [] and sum(bf16["rejected"]["runtime"].values()) == 0
    assert 0.0 <= bf16["accuracy"] <= 1.0
    for rank in ("1", "2"):
        ratio = bf16["cost"][rank]["bytes_sent"] / f32["cost"][rank]["bytes_sent"]
        assert 0.49 < ratio < 0.52, (rank, ratio)  # 2 of 4 bytes per value, plus headers and tags
    ratio = bf16["cost"]["0"]["bytes_sent"] / f32["cost"]["0"]["bytes_sent"]
    assert 0.49 < ratio < 0.52, ratio
