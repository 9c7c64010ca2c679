"""Two-dimensional structural entropy (2DSE) of a weighted graph and its greedy minimisation.

Used by SEGA (DAMe paper §4.3, spec section 1.4) to partition the client-similarity graph. Pure numpy;
the graph is a symmetric (K, K) weight matrix ``W`` with ``W[i, j] > 0`` for an edge and a zero diagonal
(self-loops do not count in degrees). Every client is a node, even one with no edge: the reference
code (`FL_SE.py`) builds its graph from the edge list only and crashes with KeyError on an isolated
client or K = 1 (spec 1.4 [QUIRK], 1.9); here an isolated node simply stays a singleton.

Notation: ``d_i = Σ_j w_ij``, ``vol(G) = Σ_i d_i``, ``vol(X) = Σ_{i∈X} d_i``, ``g_X = cut(X, V∖X)``.

2DSE of a partition P (paper eq. 10)::

    H^P(G) = Σ_{X∈P} [ −(g_X/vol(G))·log2(vol(X)/vol(G))                (if vol(X) > 0)
                       + Σ_{i∈X, d_i>0} −(d_i/vol(G))·log2(d_i/vol(X)) ]

Merge delta (paper eq. 11): ``ΔSE(X_i, X_j) = H_{X_i∪X_j} − H_{X_i} − H_{X_j}``, where ``H_X`` is the
bracketed per-community term; a pair with an empty-volume side has ΔSE = 0 and is never merged.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def _check_weights(weights: np.ndarray) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != w.shape[1]:
        raise ValueError(f"weight matrix must be square (K, K), got shape {w.shape}")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weight matrix must hold finite non-negative weights (drop NaN/negative similarities first)")
    if not np.allclose(w, w.T):
        raise ValueError("weight matrix must be symmetric")
    w = w.copy()
    np.fill_diagonal(w, 0.0)  # self-loops do not count in degrees (spec 1.4)
    return w


def community_entropy(weights: np.ndarray, members: Sequence[int]) -> float:
    """The per-community term ``H_X`` of eq. 10 for community ``X = members``."""
    w = _check_weights(weights)
    return _community_term(w, w.sum(axis=1), float(w.sum()), list(members))


def _community_term(w: np.ndarray, degree: np.ndarray, vol_g: float, members: list[int]) -> float:
    if vol_g <= 0:
        return 0.0
    idx = np.asarray(members, dtype=np.int64)
    d = degree[idx]
    vol_x = float(d.sum())
    if vol_x <= 0:
        return 0.0
    inside = np.zeros(len(degree), dtype=bool)
    inside[idx] = True
    cut = float(w[np.ix_(inside, ~inside)].sum())
    h = -(cut / vol_g) * np.log2(vol_x / vol_g)
    pos = d[d > 0]
    h += float(np.sum(-(pos / vol_g) * np.log2(pos / vol_x)))
    return float(h)


def structural_entropy(weights: np.ndarray, partition: Sequence[Sequence[int]]) -> float:
    """``H^P(G)`` of eq. 10 for `partition` (a list of communities covering every node once)."""
    w = _check_weights(weights)
    covered = sorted(i for part in partition for i in part)
    if covered != list(range(w.shape[0])):
        raise ValueError(f"partition must cover nodes 0..{w.shape[0] - 1} exactly once, got {partition}")
    degree, vol_g = w.sum(axis=1), float(w.sum())
    return float(sum(_community_term(w, degree, vol_g, list(p)) for p in partition))


def merge_delta(weights: np.ndarray, a: Sequence[int], b: Sequence[int]) -> float:
    """ΔSE of merging communities `a` and `b` (eq. 11); 0 when either has zero volume."""
    w = _check_weights(weights)
    return _delta(w, w.sum(axis=1), float(w.sum()), list(a), list(b), {})


def _delta(w: np.ndarray, degree: np.ndarray, vol_g: float, a: list[int], b: list[int],
           cache: dict[tuple[int, ...], float]) -> float:
    if degree[a].sum() <= 0 or degree[b].sum() <= 0:
        return 0.0  # the reference sets H_{a∪b} = H_a + H_b here, so such pairs never merge

    def term(x: list[int]) -> float:
        key = tuple(sorted(x))
        if key not in cache:
            cache[key] = _community_term(w, degree, vol_g, list(key))
        return cache[key]

    return term(a + b) - term(a) - term(b)


def minimize_2dse(weights: np.ndarray) -> list[list[int]]:
    """Greedy 2DSE minimisation (reference ``update_division_MinSE``), all pairs considered.

    Start from singletons in key order 0..K-1; repeatedly merge the pair with the most negative ΔSE
    (strict ``<``, so ties go to the first pair in key order; the second community is merged into the
    first, which keeps its position) until no pair has ΔSE < 0. Returns the communities in key order,
    members sorted.
    """
    w = _check_weights(weights)
    k = w.shape[0]
    if k == 0:
        return []
    degree, vol_g = w.sum(axis=1), float(w.sum())
    division: dict[int, list[int]] = {i: [i] for i in range(k)}
    cache: dict[tuple[int, ...], float] = {}
    while len(division) > 1:
        keys = list(division)
        best, pair = 99999.0, None
        for i in range(len(keys)):
            for j in range(i + 1, len(keys)):
                d = _delta(w, degree, vol_g, division[keys[i]], division[keys[j]], cache)
                if d < best:
                    best, pair = d, (keys[i], keys[j])
        if pair is None or not best < 0:
            break
        division[pair[0]] = division[pair[0]] + division.pop(pair[1])
    parts = [sorted(v) for v in division.values()]
    assert all(parts), "a 2DSE community became empty"
    return parts
