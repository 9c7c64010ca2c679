"""2DSE and SEGA against the spec's hand-computed values (spec 1.10.1-6, 1.9)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hpcfed.strategies.entropy import merge_delta, minimize_2dse, structural_entropy
from hpcfed.strategies.sega import client_similarity, dispatch_weights, similarity_graph


def graph(k: int, edges: dict[tuple[int, int], float]) -> np.ndarray:
    """Symmetric (k, k) weight matrix with the given edge weights, zero elsewhere."""
    w = np.zeros((k, k))
    for (i, j), v in edges.items():
        w[i, j] = w[j, i] = v
    return w


def test_two_disjoint_edges():
    w = graph(4, {(0, 1): 1.0, (2, 3): 1.0})
    assert structural_entropy(w, [[0], [1], [2], [3]]) == pytest.approx(2.0)
    assert merge_delta(w, [0], [1]) == pytest.approx(-0.5)
    assert merge_delta(w, [0, 1], [2, 3]) == pytest.approx(1.0)
    parts = minimize_2dse(w)
    assert parts == [[0, 1], [2, 3]]
    assert structural_entropy(w, parts) == pytest.approx(1.0)


def test_weighted_k4_client_graph_and_softmax_weights():
    w = graph(4, {(0, 1): 0.9, (2, 3): 0.9, (0, 2): 0.1, (0, 3): 0.1, (1, 2): 0.1, (1, 3): 0.1})
    assert structural_entropy(w, [[0], [1], [2], [3]]) == pytest.approx(2.0)
    assert merge_delta(w, [0], [1]) == pytest.approx(-0.409091, abs=1e-6)
    assert merge_delta(w, [0], [2]) == pytest.approx(-0.045455, abs=1e-6)
    assert merge_delta(w, [0, 1], [2]) == pytest.approx(0.201572, abs=1e-6)
    parts = minimize_2dse(w)
    assert parts == [[0, 1], [2, 3]]
    assert structural_entropy(w, parts) == pytest.approx(1.181818, abs=1e-6)
    sim = w + np.eye(4)
    for u, v in ((0, 1), (1, 0), (2, 3), (3, 2)):
        alpha = dispatch_weights(sim, [min(u, v), max(u, v)], u)
        assert alpha[u] == pytest.approx(0.524979, abs=1e-6)
        assert alpha[v] == pytest.approx(0.475021, abs=1e-6)


def test_hisevent_graph():
    w = graph(3, {(0, 1): 2.0, (0, 2): 4.0})  # HISEvent nodes 1, 2, 3 -> 0, 1, 2
    assert structural_entropy(w, [[0], [1], [2]]) == pytest.approx(1.459148, abs=1e-6)
    assert merge_delta(w, [0], [1]) == pytest.approx(-0.194988, abs=1e-6)
    assert merge_delta(w, [0], [2]) == pytest.approx(-0.175356, abs=1e-6)
    assert merge_delta(w, [1], [2]) == pytest.approx(0.0, abs=1e-12)
    parts = minimize_2dse(w)
    assert parts == [[0, 1], [2]]
    assert structural_entropy(w, parts) == pytest.approx(1.264160, abs=1e-6)


def test_uniform_k4_and_tie_order():
    w = np.full((4, 4), 0.5)
    np.fill_diagonal(w, 0)
    assert merge_delta(w, [0], [1]) == pytest.approx(-0.166667, abs=1e-6)
    parts = minimize_2dse(w)
    assert parts == [[0, 1], [2, 3]]
    assert structural_entropy(w, parts) == pytest.approx(1.666667, abs=1e-6)
    for k, expected in ((3, [[0, 1], [2]]), (6, [[0, 1, 2, 3], [4, 5]])):
        u = np.full((k, k), 0.5)
        np.fill_diagonal(u, 0)
        assert minimize_2dse(u) == expected


def test_two_clients_never_merge_and_isolated_clients_stay_alone():
    sim = client_similarity([np.ones((3, 4)), np.ones((3, 4))])
    assert sim[0, 1] == pytest.approx(1.0)
    assert minimize_2dse(similarity_graph(sim)) == [[0], [1]]
    assert dispatch_weights(sim, [0], 0) == {0: 1.0}
    assert minimize_2dse(np.zeros((1, 1))) == [[0]]
    w = graph(3, {(0, 1): 1.0})  # client 2 has no positive-similarity edge
    assert minimize_2dse(w) == [[0], [1], [2]]  # K=2-like pair: ΔSE = 0, and no KeyError for client 2


def test_similarity_modes_and_negative_or_nan_similarity():
    hu = np.array([[1.0, 0.0], [0.0, 1.0]])
    hv = np.array([[1.0, 0.0], [1.0, 0.0]])
    assert client_similarity([hu, hv], "node_mean")[0, 1] == pytest.approx(0.5)
    assert client_similarity([hu, hv], "pooled")[0, 1] == pytest.approx(0.707107, abs=1e-6)
    assert client_similarity([hu, hu])[0, 1] == pytest.approx(1.0)
    neg = client_similarity([hu, -hu])
    assert neg[0, 1] == pytest.approx(-1.0)
    assert similarity_graph(neg)[0, 1] == 0.0
    nan = client_similarity([hu, np.full((2, 2), np.nan)])
    assert math.isnan(nan[0, 1]) and similarity_graph(nan)[0, 1] == 0.0
    # a non-positive similarity inside a cluster counts as s = 0 in the softmax (eq. 13)
    alpha = dispatch_weights(neg, [0, 1], 0)
    assert alpha[0] == pytest.approx(math.e / (math.e + 1.0))


def test_bad_weight_matrix_is_rejected():
    with pytest.raises(ValueError, match="symmetric"):
        minimize_2dse(np.array([[0.0, 1.0], [0.0, 0.0]]))
    with pytest.raises(ValueError, match="non-negative"):
        minimize_2dse(np.array([[0.0, -1.0], [-1.0, 0.0]]))
