"""sim_k on hand cases (spec 4.5 test 5) and the MLP mapper (test 4)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcfed.models.mapper import MapperConfig, cosine_loss, load_mapper, mean_cosine, save_mapper, train_mapper
from hpcfed.search.metrics import label_precision_at_k, mean_sim_k, sim_k


def test_sim_k_hand_cases() -> None:
    assert sim_k(["a", "b", "c"], ["a", "c", "d"], 3) == pytest.approx(2 / 3)
    assert sim_k(["a", "b", "c"], ["c", "b", "a"], 3) == 1.0
    assert sim_k(["a", "b", "c"], ["x", "y", "z"], 3) == 0.0
    assert sim_k(["a", "b"], ["a", "z"], 10) == pytest.approx(1 / 2)  # k' = min(k, #candidates)
    assert math.isnan(sim_k([], [], 3))
    assert mean_sim_k([["a", "b", "c"], ["a", "b", "c"]], [["a", "c", "d"], ["x", "y", "z"]], 3) == pytest.approx(1 / 3)


def test_label_precision() -> None:
    assert label_precision_at_k([1, 2, -1], [[1, 1, 0], [2, 0, 0], [5]], 3) == pytest.approx((2 / 3 + 1 / 3) / 2)


def test_cosine_loss_hand_values() -> None:
    import torch

    one = cosine_loss(torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]))
    assert float(one) == pytest.approx(1.0)
    half = cosine_loss(torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.0]]))
    assert float(half) == pytest.approx(1 - 1 / math.sqrt(2), abs=1e-6)  # 0.292893
    zero = cosine_loss(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 0.0]]))
    assert float(zero) == pytest.approx(1.0)


def test_mapper_learns_a_rotation_and_shrinks_the_loss(tmp_path) -> None:
    rng = np.random.default_rng(0)
    r, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = (x @ r.T).astype(np.float32)
    m = train_mapper(x, y, MapperConfig(hidden=64, lr=1e-3, epochs=40, batch_size=64), src="0", dst="1")
    assert m.history[-1] < m.history[0] / 3
    assert mean_cosine(m(x), y) > 0.9
    path = save_mapper(tmp_path / "m.h5", m)
    again = load_mapper(path)
    np.testing.assert_allclose(again(x[:5]), m(x[:5]), rtol=1e-6)
    assert again.history == pytest.approx(m.history)


def test_mapper_output_dim_and_small_corpus() -> None:
    rng = np.random.default_rng(1)
    m = train_mapper(rng.normal(size=(10, 6)), rng.normal(size=(10, 4)),
                     MapperConfig(hidden=16, epochs=2, batch_size=64))  # |D_p| < batch: one batch
    assert m.dims == (6, 4) and m(np.zeros((3, 6))).shape == (3, 4)
    with pytest.raises(ValueError, match="takes 6-d"):
        m(np.zeros((1, 5)))


def test_mapper_rejects_nan_input() -> None:
    x = np.ones((4, 3), np.float32)
    x[0, 0] = np.nan
    with pytest.raises(ValueError, match="loss became nan"):
        train_mapper(x, np.ones((4, 3)), MapperConfig(hidden=4, epochs=1))


def test_train_mappers_reports_held_out_cosine(tmp_path) -> None:
    from hpcfed.search.mapping import train_mappers
    from hpcfed.store.embeddings import export_path, write_export

    rng = np.random.default_rng(2)
    r, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    public = rng.normal(size=(200, 8)).astype(np.float32)
    ids = [f"p{i}" for i in range(200)]
    for site, vectors in ((0, public), (1, public @ r.T)):
        write_export(export_path(tmp_path, site), vectors.astype(np.float32), ids, entity="public", model="t",
                     site=site)
    cfg = MapperConfig(hidden=64, lr=1e-3, epochs=40)
    report = train_mappers(tmp_path, tmp_path / "mappers", cfg, holdout=0.2)
    for pair in ("0->1", "1->0"):
        assert report[pair]["num_public"] == 160 and report[pair]["num_heldout"] == 40
        assert report[pair]["heldout_mean_cosine"] > 0.8  # a rotation generalises to unseen documents
    assert "heldout_mean_cosine" not in train_mappers(tmp_path, tmp_path / "all", cfg)["0->1"]
    with pytest.raises(ValueError, match="holdout must be in"):
        train_mappers(tmp_path, tmp_path / "bad", cfg, holdout=1.0)
