"""The PyTorch adapter in-process on the CPU: what travels, training, evaluation, export, and exact resume."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.registry import task_class
from hpcfed.schema import build
from hpcfed.store.embeddings import read_export
from hpcfed.tasks.base import Site

# The `plugin_root` / `plugin_path` fixtures: pytest loads them from the helper module by name (a
# conftest.py here would displace tests/conftest.py, which test modules import as `conftest`).
pytest_plugins = ["plugin_source"]


def _task(plugin_path, tmp_path, client_id=0, **options):
    cls = task_class("myplug.task:BlobTask")
    config = build(cls.Config, options, prefix="task.")
    return cls(config, Site(client_id=client_id, num_clients=2, seed=3, out_dir=tmp_path, device="cpu"))


def test_only_trainable_tensors_travel(plugin_path, tmp_path):
    task = _task(plugin_path, tmp_path)
    names = list(task.get_parameters())
    # the frozen first-layer weight and the BatchNorm buffers stay home; its bias and the rest travel
    assert "0.weight" not in names and "4.running_mean" not in names and "4.num_batches_tracked" not in names
    assert names == ["0.bias", "3.weight", "3.bias", "4.weight", "4.bias", "6.weight", "6.bias"]
    assert all(v.dtype == np.float32 for v in task.get_parameters().values())
    everything = _task(plugin_path, tmp_path, share="all")
    assert "0.weight" in everything.get_parameters() and "4.running_mean" in everything.get_parameters()
    assert "4.num_batches_tracked" not in everything.get_parameters()  # integer counters never travel
    picked = _task(plugin_path, tmp_path, share_patterns=["6.*"])
    assert list(picked.get_parameters()) == ["6.weight", "6.bias"]
    with pytest.raises(ValueError, match="no parameter is shared"):
        _task(plugin_path, tmp_path, share_patterns=["nothing*"])


def test_same_initial_model_on_every_site_and_set_parameters(plugin_path, tmp_path):
    a, b = _task(plugin_path, tmp_path, 0), _task(plugin_path, tmp_path, 1)
    pa, pb = a.get_parameters(), b.get_parameters()
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    a.fit(0)
    moved = a.get_parameters()
    assert not np.array_equal(moved["6.weight"], pa["6.weight"])
    b.set_parameters(moved)
    assert all(np.array_equal(moved[k], v) for k, v in b.get_parameters().items())
    with pytest.raises(ValueError, match="missing"):
        b.set_parameters({k: v for k, v in moved.items() if k != "6.bias"})


def test_training_improves_and_metrics_are_reported(plugin_path, tmp_path):
    task = _task(plugin_path, tmp_path, lr=0.02)
    before = task.evaluate(0)
    for r in range(6):
        result = task.fit(r)
    after = task.evaluate(5)
    assert result.num_examples == 120 and np.isfinite(result.metrics["train_loss"])
    assert set(after) == {"val_loss", "val_accuracy", "val_macro_f1"}
    assert after["val_loss"] < before["val_loss"]
    final = task.evaluate(5, final=True)
    assert set(final) == {"loss", "accuracy", "macro_f1"}
    path = task.export_embeddings(tmp_path)
    export = read_export(path)
    assert export.vectors.shape == (120, 16) and len(export.ids) == 120


def test_personalize_epochs_fine_tune_the_final_model_on_the_site_only(plugin_path, tmp_path):
    plain, personal = (_task(plugin_path, tmp_path, lr=0.02, **extra) for extra in ({}, {"personalize_epochs": 2}))
    for task in (plain, personal):
        task.fit(0)
    shared = plain.get_parameters()
    personal.set_parameters(shared)
    assert set(plain.evaluate(0)) == set(personal.evaluate(0))  # rounds: the federated model as it is
    assert all(np.array_equal(shared[k], v) for k, v in personal.get_parameters().items())
    final = personal.evaluate(1, final=True)
    moved = personal.get_parameters()
    assert not np.array_equal(moved["6.weight"], shared["6.weight"])  # trained on the site's data
    assert final["loss"] != plain.evaluate(1, final=True)["loss"]
    # fitted to the site's own label mix (its val split is skewed like its training data)
    assert personal.evaluate(1)["val_loss"] < plain.evaluate(1)["val_loss"]
    with pytest.raises(ValueError, match="personalize_epochs must be >= 0"):
        _task(plugin_path, tmp_path, personalize_epochs=-1)


@pytest.mark.parametrize("options, local", [
    ({}, {"local/4.running_mean", "local/4.num_batches_tracked"}),
    ({"share_patterns": ["6.*"]}, {"local/3.weight", "local/4.running_var"}),  # trainable, unshared: stays home
])
def test_state_dict_resume_is_bit_exact(plugin_path, tmp_path, options, local):
    """Round 2 after restoring round 1's state on a fresh site equals round 2 of the uninterrupted site."""
    straight = _task(plugin_path, tmp_path, max_steps=5, **options)
    straight.fit(0)
    straight.fit(1)
    shared, state = straight.get_parameters(), straight.state_dict()
    assert local <= set(state[1]) and "local/0.weight" not in state[1]  # frozen tensors are rebuilt, not saved
    assert any(k.startswith("opt/") for k in state[1]) and "rng/torch" in state[1]
    straight.fit(2)
    expected = straight.get_parameters()
    expected_local = straight.state_dict()[1]

    fresh = _task(plugin_path, tmp_path, max_steps=5, **options)
    fresh.load_state_dict(state)
    fresh.set_parameters(shared)
    fresh.fit(2)
    assert all(np.array_equal(expected[k], v) for k, v in fresh.get_parameters().items())
    got_local = fresh.state_dict()[1]
    assert all(np.array_equal(expected_local[k], got_local[k]) for k in expected_local if k.startswith("local/"))

    bad = (state[0], {**state[1], "local/4.running_mean": np.zeros((3, 3), np.float32)})
    with pytest.raises(ValueError, match="same task config"):
        fresh.load_state_dict(bad)


def test_fit_is_seeded_by_seed_client_and_round(plugin_path, tmp_path):
    a, b = _task(plugin_path, tmp_path), _task(plugin_path, tmp_path)
    a.fit(4)
    b.fit(4)
    assert all(np.array_equal(v, b.get_parameters()[k]) for k, v in a.get_parameters().items())


def test_label_skew_shares_cut_train_and_test_alike():
    from hpcfed.data.partition import label_skew_shares, split_by_shares

    shares = label_skew_shares(4, 3, 0.5, seed=1)
    assert shares.shape == (4, 3) and np.allclose(shares.sum(1), 1.0)
    labels = np.repeat(np.arange(4), 300)
    owners = split_by_shares(labels, shares, seed=2)
    for c in range(4):
        got = np.bincount(owners[labels == c], minlength=3) / 300
        assert np.abs(got - shares[c]).max() < 0.01
    assert np.array_equal(owners, split_by_shares(labels, shares, seed=2))
    with pytest.raises(ValueError, match="alpha must be > 0"):
        label_skew_shares(4, 3, 0.0, seed=1)
