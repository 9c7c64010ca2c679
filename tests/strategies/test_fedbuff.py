"""FedBuff (Nguyen et al. 2022): the buffer's staleness-weighted step by hand, the weighted-sum path
secure aggregation takes, checkpoints, ``federation.buffer_size`` refused outside 2..K, and one real
`mpiexec` run whose metrics show one server version per filled buffer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import NUMPY_SITES, run_cli

from hpcfed.config import ConfigError, from_mapping
from hpcfed.registry import resolve
from hpcfed.strategies.base import WEIGHTED_SUM, StrategyContext, Update
from hpcfed.strategies.fedbuff import FedBuff, buffer_size_for


def _fedbuff(buffer_size: int = 2, **options) -> FedBuff:
    strategy = FedBuff(FedBuff.Config(**options), StrategyContext(num_clients=3, seed=0, buffer_size=buffer_size))
    strategy.initialize({"w": np.zeros(2, dtype=np.float32)})
    return strategy


def _upload(cid: int, flat, base: int) -> Update:
    return Update(client_id=cid, flat=np.asarray(flat, dtype=np.float32), num_examples=10, base_version=base)


def test_a_buffer_applies_the_staleness_weighted_mean_of_its_deltas_once_full():
    fb = _fedbuff()
    assert FedBuff.aggregates == WEIGHTED_SUM and not FedBuff.synchronous
    for cid in range(3):
        fb.model_for(cid)  # every site trains from version 1 (the zero model)
    assert fb.on_update(_upload(0, [1.0, 0.0], 1)) == []  # buffered, not applied: answered with its buffer
    assert fb.version == 1 and not fb.global_flat.any() and FedBuff.defers_answers
    assert fb.on_update(_upload(1, [0.0, 2.0], 1)) == [0, 1]  # the buffer fills: one version, both answered
    np.testing.assert_allclose(fb.global_flat, [0.5, 1.0])
    assert fb.version == 2
    # site 2 trained from version 1 (τ = 1, weight 1/√2); site 0 from version 2 (τ = 0, weight 1)
    fb.model_for(0)
    fb.on_update(_upload(2, [2.0, 0.0], 1))
    fb.on_update(_upload(0, [0.5, 1.0 + 3.0], 2))
    s = 1 / np.sqrt(2)
    np.testing.assert_allclose(fb.global_flat, [0.5 + s * 2.0 / (s + 1), 1.0 + 3.0 / (s + 1)], rtol=1e-6)
    assert fb.version == 3 and fb.metrics()["fedbuff_weight_sum"] == pytest.approx(1 + s)


def test_count_normalisation_divides_by_the_buffer_size_and_fold_sum_is_the_secure_path():
    fb = _fedbuff(normalise="count", server_lr=0.5)
    fb.fold_sum(np.array([2.0, 4.0]), 1.5, 2)  # Σ s·δ of two uploads, Σ s = 1.5
    np.testing.assert_allclose(fb.global_flat, [0.5 * 2.0 / 2, 0.5 * 4.0 / 2])
    assert fb.version == 2


def test_a_buffer_that_cannot_fill_is_flushed_as_it_is():
    fb = _fedbuff(buffer_size=3)
    fb.model_for(0)
    assert fb.on_update(_upload(0, [1.0, 1.0], 1)) == [] and fb.flush() == [0]
    np.testing.assert_allclose(fb.global_flat, [1.0, 1.0])
    assert fb.version == 2 and fb.flush() == []


def test_an_upload_from_a_version_no_site_trains_from_or_not_finite_is_left_out():
    fb = _fedbuff()
    fb.model_for(0)
    assert fb.on_update(_upload(0, [np.nan, 0.0], 1)) == [0]
    assert fb.on_update(_upload(0, [1.0, 0.0], 7)) == [0]  # version 7 never existed
    assert fb.num_rejected == 2 and fb.members == [] and fb.version == 1


def test_the_buffer_in_progress_survives_a_checkpoint():
    fb = _fedbuff(buffer_size=3)
    for cid in range(3):
        fb.model_for(cid)
    fb.on_update(_upload(0, [1.0, 0.0], 1))
    header, arrays = fb.state_dict()
    json.dumps(header)
    twin = _fedbuff(buffer_size=3)
    twin.load_state_dict((header, arrays))
    for strategy in (fb, twin):
        strategy.on_update(_upload(1, [0.0, 1.0], 1))
        strategy.on_update(_upload(2, [1.0, 1.0], 1))
    np.testing.assert_array_equal(fb.global_flat, twin.global_flat)
    assert twin.version == 2 and buffer_size_for(None, 8) == 4 and buffer_size_for(None, 2) == 2


def test_buffer_size_below_two_is_refused_naming_the_key():
    cfg = {"name": "t", "task": {"name": "synthetic"}, "strategy": {"name": "fedbuff"},
           "federation": {"buffer_size": 1}}
    with pytest.raises(ConfigError, match=r"federation\.buffer_size must be at least 2"):
        resolve(from_mapping(cfg))


@pytest.mark.mpi
def test_fedbuff_under_mpiexec_applies_one_version_per_buffer_and_refuses_a_buffer_larger_than_k(tmp_path):
    """Three sites, buffer 2, 12 uploads: 6 buffers, so the server reaches version 7; every site
    contributed and the model learned."""
    out = tmp_path / "run"
    run_cli(["run", "configs/quickstart_fedbuff.yaml", NUMPY_SITES, "--out", str(out), "rounds=4", "checkpoint_every=0",
             "eval_every=0"], np=4, timeout=240)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    versions = [e["value"] for e in events if e["name"] == "fedbuff_version"]
    assert len(versions) == 12 and versions[-1] == 7.0 and versions == sorted(versions)
    summary = json.loads((out / "summary.json").read_text())
    assert all(p["contributed"] >= 2 for p in summary["participation"].values())
    assert summary["mean"]["accuracy"] > 0.5
    refused = run_cli(["run", "configs/quickstart_fedbuff.yaml", NUMPY_SITES, "--out", str(tmp_path / "big"),
                       "federation.buffer_size=4"], np=3, timeout=120, check=False)
    assert refused.returncode != 0
    assert "federation.buffer_size is 4, more than the 2 sites of this run" in refused.stderr + refused.stdout
