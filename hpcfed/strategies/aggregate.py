"""Pure aggregation functions over flat float32 vectors.

Each takes a stacked matrix ``X`` of shape (n_clients, P) (or a list of vectors) and returns one
vector of shape (P,). No Python loop runs over parameters; Krum's pairwise distances come from one
Gram matrix. These are the functions the strategies call and the unit tests check by hand.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def stack(vectors: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """The uploads as one float32 (K, n) matrix for the coordinate-wise rules; refuses an empty round."""
    if len(vectors) == 0:
        raise ValueError("cannot aggregate zero updates")
    return np.stack([np.asarray(v, dtype=np.float32) for v in vectors])


def weighted_mean(vectors: Sequence[np.ndarray] | np.ndarray, weights: Sequence[float] | np.ndarray | None = None,
                  out: np.ndarray | None = None) -> np.ndarray:
    """Σ w_i x_i / Σ w_i, accumulated in place into `out` (float32) without a K-fold copy."""
    n = len(vectors)
    if n == 0:
        raise ValueError("cannot aggregate zero updates")
    w = np.ones(n, dtype=np.float64) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (n,) or not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"aggregation weights must be {n} finite non-negative numbers with a positive sum, got {w}")
    w = w / w.sum()
    acc = np.zeros(np.shape(vectors[0]), dtype=np.float32) if out is None else out
    if out is not None:
        acc.fill(0.0)
    for wi, x in zip(w, vectors):
        if wi:
            acc += np.float32(wi) * np.asarray(x, dtype=np.float32)
    return acc


class RunningMean:
    """Σ w_i x_i / Σ w_i over vectors that arrive one at a time (streaming FedAvg).

    The sum is kept in float64 (2 x the float32 model's bytes) and updated in blocks of `BLOCK`
    values, so no temporary larger than a block exists. Each w_i x_i is exact in float64 (w an
    integer below 2^29, x float32), so the mean of two updates does not depend on which arrived
    first; with more, arrival order can change the float64 sum in its last bits and so, rarely, a
    float32 result bit. If every weight is 0 the mean is uniform (as `weighted_mean` with no weights).
    """

    BLOCK = 1 << 20

    def __init__(self, size: int) -> None:
        self.size = size
        self.acc: np.ndarray | None = None
        self.weighted = False  # a positive weight has arrived: zero-weight vectors no longer count
        self.denominator = 0.0
        self.count = 0

    def add(self, x: np.ndarray, weight: float = 1.0) -> None:
        w = float(weight)
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"aggregation weight must be a finite non-negative number, got {weight}")
        if x.shape != (self.size,):
            raise ValueError(f"update has shape {x.shape}, expected ({self.size},)")
        if self.acc is None:
            self.acc = np.zeros(self.size, dtype=np.float64)
        self.count += 1
        if w > 0 and not self.weighted:  # the uniform sum of zero-weight vectors so far is dropped
            self.weighted, self.denominator = True, 0.0
            self.acc.fill(0.0)
        if self.weighted and w == 0:
            return
        scale = w if self.weighted else 1.0
        self.denominator += scale
        block = self.BLOCK
        for start in range(0, self.size, block):
            part = x[start: start + block]
            self.acc[start: start + block] += part if scale == 1.0 else np.multiply(part, scale, dtype=np.float64)

    def add_sum(self, weighted_sum: np.ndarray, weight: float) -> None:
        """Add Σ w_i x_i of vectors summed elsewhere, of total weight `weight` > 0 (secure aggregation
        hands rank 0 only the sum). `weighted_sum` (float64) is taken over, not copied."""
        w = float(weight)
        if not math.isfinite(w) or w <= 0 or weighted_sum.shape != (self.size,) or weighted_sum.dtype != np.float64:
            raise ValueError(f"a weighted sum needs a positive weight and float64 ({self.size},), got {weight}, "
                             f"{weighted_sum.dtype} {weighted_sum.shape}")
        if not self.weighted:  # as in `add`: zero-weight vectors stop counting once a weight arrives
            self.weighted, self.denominator, self.acc = True, 0.0, None
        if self.acc is None:
            self.acc = weighted_sum
        else:
            self.acc += weighted_sum
        self.count += 1
        self.denominator += w

    def result(self, out: np.ndarray | None = None) -> np.ndarray:
        """The mean as float32, written into `out` when given."""
        if self.acc is None or self.denominator <= 0:
            raise ValueError("cannot aggregate zero updates")
        out = np.empty(self.size, dtype=np.float32) if out is None else out
        for start in range(0, self.size, self.BLOCK):
            out[start: start + self.BLOCK] = self.acc[start: start + self.BLOCK] / self.denominator
        return out


def coordinate_median(vectors: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """Element-wise median (Yin et al. 2018)."""
    median: np.ndarray = np.median(stack(vectors), axis=0).astype(np.float32)
    return median


def trimmed_mean(vectors: Sequence[np.ndarray] | np.ndarray, trim_ratio: float = 0.1) -> np.ndarray:
    """Element-wise mean after dropping the `trim_ratio` largest and smallest values per coordinate."""
    x = stack(vectors)
    n = x.shape[0]
    k = int(np.floor(trim_ratio * n))
    if not 0 <= trim_ratio < 0.5:
        raise ValueError(f"trim_ratio must be in [0, 0.5), got {trim_ratio}")
    kept = x if k == 0 else np.partition(x, (k, n - k - 1), axis=0)[k : n - k]
    mean: np.ndarray = kept.mean(axis=0, dtype=np.float64).astype(np.float32)
    return mean


def pairwise_sq_distances(x: np.ndarray) -> np.ndarray:
    """||x_i - x_j||² for all pairs, from one Gram matrix (float64 for stability)."""
    x64 = x.astype(np.float64)
    sq = np.einsum("ij,ij->i", x64, x64)
    gram = x64 @ x64.T
    d: np.ndarray = sq[:, None] + sq[None, :] - 2.0 * gram
    np.maximum(d, 0.0, out=d)
    np.fill_diagonal(d, 0.0)
    return d


def krum_scores(vectors: Sequence[np.ndarray] | np.ndarray, num_byzantine: int) -> np.ndarray:
    """Krum score of each client: sum of squared distances to its n - f - 2 nearest others."""
    x = stack(vectors)
    n = x.shape[0]
    m = n - num_byzantine - 2
    if m < 1:
        raise ValueError(f"Krum needs n > f + 2 clients; got n={n}, f={num_byzantine}")
    d = pairwise_sq_distances(x)
    np.fill_diagonal(d, np.inf)
    nearest = np.sort(d, axis=1)[:, :m]
    scores: np.ndarray = nearest.sum(axis=1)
    return scores


def krum(vectors: Sequence[np.ndarray] | np.ndarray, num_byzantine: int, multi: int = 1) -> np.ndarray:
    """(Multi-)Krum (Blanchard et al. 2017): mean of the `multi` updates with the lowest scores."""
    x = stack(vectors)
    scores = krum_scores(x, num_byzantine)
    chosen = np.argsort(scores, kind="stable")[: max(1, multi)]
    mean: np.ndarray = x[chosen].mean(axis=0, dtype=np.float64).astype(np.float32)
    return mean

