"""Triplet loss, GLECC, BOLA, temporal feature and clustering metrics (spec 1.10.7-12)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hpcfed.data.text_features import temporal_features
from hpcfed.models.gat import glecc_loss, glecc_weight, select_triplets, triplet_loss
from hpcfed.tasks.bola import bola, bola_reference, merge
from hpcfed.tasks.events import kmeans_metrics


def test_triplet_loss_hand_value():
    h = torch.tensor([[0.0], [1.0], [1.5]], requires_grad=True)
    labels = torch.tensor([0, 0, 1])
    triplets = select_triplets(h, labels, 3.0, torch.Generator().manual_seed(0))
    assert triplets.tolist() == [[0, 1, 2]]
    loss = triplet_loss(h, triplets, 3.0)
    assert float(loss.detach()) == pytest.approx(1.75)
    loss.backward()
    assert h.grad is not None and float(h.grad.abs().sum()) > 0


def test_triplet_loss_is_zero_without_pairs_or_negatives():
    h = torch.randn(4, 3, requires_grad=True)
    none = select_triplets(h, torch.tensor([0, 1, 2, 3]), 3.0, torch.Generator().manual_seed(0))
    assert none.shape == (0, 3)
    assert float(triplet_loss(h, none, 3.0).detach()) == 0.0
    one_class = select_triplets(h, torch.tensor([5, 5, 5, 5]), 3.0, torch.Generator().manual_seed(0))
    assert one_class.shape == (0, 3)


def test_triplet_mining_keeps_only_violating_negatives():
    h = torch.tensor([[0.0], [0.1], [10.0], [0.2]])
    labels = torch.tensor([0, 0, 1, 1])  # negative 2 is far (no violation), negative 3 is close
    t = select_triplets(h, labels, 1.0, torch.Generator().manual_seed(0))
    assert [0, 1, 3] in t.tolist() and [0, 1, 2] not in t.tolist()


def test_glecc_hand_values():
    h_l = torch.tensor([[0.0, 0.0], [2.0, 0.0], [3.0, 4.0]])
    h_g = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    labels = torch.tensor([0, 0, 1])
    lg = glecc_loss(h_l, h_g, labels)
    assert float(lg) == pytest.approx(3.0)
    a = glecc_weight(torch.tensor(2.0), torch.tensor(1.0))
    assert float(a) == pytest.approx(1.0)
    assert float(torch.tensor(2.0) + a * lg) == pytest.approx(5.0)
    a = glecc_weight(torch.tensor(1.0), torch.tensor(2.0))
    assert float(a) == pytest.approx(math.exp(-1))
    assert float(torch.tensor(1.0) + a * lg) == pytest.approx(2.103638, abs=1e-6)


def test_glecc_weight_gradient_follows_detach_switch():
    ll = torch.tensor(1.0, requires_grad=True)
    glecc_weight(ll, torch.tensor(2.0)).backward()  # α = exp(L_l − L_g) is not clamped here
    assert ll.grad is not None and float(ll.grad) == pytest.approx(math.exp(-1))
    ll2 = torch.tensor(1.0, requires_grad=True)
    assert not glecc_weight(ll2, torch.tensor(2.0), detach=True).requires_grad


def toy(lam: float) -> float:
    """A smooth objective on [0.6, 1] whose maximum is at λ = 0.8."""
    return 0.5 + 0.2 * math.exp(-((lam - 0.8) / 0.08) ** 2)


def test_bola_merge_and_toy_optimum():
    assert merge(np.array([2.0], np.float32), np.array([0.0], np.float32), 0.75)[0] == pytest.approx(1.5)
    lam, history = bola(toy, lo=0.6, hi=1.0, n_init=5, n_calls=10, seed=42)
    assert abs(lam - 0.8) < 0.03
    assert len(history) == 10 and all(0.6 <= lam_i <= 1.0 for lam_i, _ in history)


def test_bola_alpha_one_calls_nothing():
    calls = []
    lam, history = bola(lambda lam_i: calls.append(lam_i) or 0.0, lo=1.0, hi=1.0)
    assert lam == 1.0 and calls == [] and history == []


def test_bola_nan_objective_is_guarded():
    lam, history = bola(lambda lam_i: float("nan"), lo=0.6, hi=1.0, n_init=2, n_calls=3)
    assert 0.6 <= lam <= 1.0 and all(y == 0.0 for _, y in history)


def test_reference_bola_reproduces_its_bug():
    lam, _ = bola_reference(lambda w, best: toy(w), 0.0, 0.0, n_init=5, n_calls=8, seed=42)
    assert lam == pytest.approx(0.6)  # spec 1.5 [QUIRK] (b)+(c): the grid-EI never leaves 0.6


def test_temporal_feature():
    x = temporal_features(np.array(["2012-10-11T07:19:34"], dtype="datetime64[s]"))
    assert x[0] == pytest.approx([0.41193, 0.3052546], abs=1e-7)


def test_metrics():
    emb = np.array([[0.0], [0.1], [5.0], [5.1]])
    m = kmeans_metrics(emb, np.array([0, 0, 1, 1]))
    assert m == pytest.approx({"nmi": 1.0, "ami": 1.0, "ari": 1.0})
    from sklearn.metrics import normalized_mutual_info_score

    assert normalized_mutual_info_score([0, 0, 1, 1], [0, 0, 0, 0]) == 0.0
    # k = number of distinct labels in the evaluated subset: 3 labels -> 3 clusters -> perfect
    emb3 = np.array([[0.0], [0.1], [5.0], [5.1], [9.0], [9.1]])
    assert kmeans_metrics(emb3, np.array([0, 0, 1, 1, 7, 7]))["nmi"] == pytest.approx(1.0)
