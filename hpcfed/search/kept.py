"""What one filter's mask gives a site's index search, worked out once per mask (`AnnIndex._search`):
how many rows it keeps, the bitmap FAISS's ID selector reads and, when it keeps few rows, their
stored vectors decoded, so that a narrow filter is scored exactly by one matrix product instead of
a bitmap test per vector in every IVF cell, or a graph walk through mostly rejected HNSW nodes.

A service is asked the same filter again and again, and `hpcfed.search.filters.MaskCache` hands
back the same mask object for it: each site's index keeps the `Kept` of the last mask it saw, so a
repeated filter costs the search alone, not a pass over the rows per query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# A filter keeping at most this many of a site's rows is scored exactly over them (their decoded
# vectors: at most 24 MB at 384 dims, held while the filter is the site's last one). Scanning them
# costs about what an unfiltered IVF query scans, and the answer is exact.
EXACT_ROWS = 16_384
# Query rows up to which scores are summed without BLAS: for a product this small OpenBLAS's threads
# cost far more than the work (2,500 rows x 384 dims, one query, 2 cores: 6 ms of CPU against 0.1 ms).
SMALL_BATCH = 8


def inner(q: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    """Inner products of each query row with each row of `vectors` (queries x rows)."""
    if len(q) <= SMALL_BATCH:
        return np.einsum("qd,nd->qn", q, vectors)
    return q @ vectors.T


def top_k(q: np.ndarray, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k (scores, row positions in `vectors`) by inner product for each query row, best first;
    k at most ``len(vectors)``. A few query rows go through FAISS's SIMD scan with its top-k heap on the
    calling thread (2,750 rows x 384 dims: 0.16 ms of CPU, against 0.36 ms for a product and an
    argpartition in numpy); more go through one matrix product."""
    if len(q) <= SMALL_BATCH:
        import faiss

        found: tuple[np.ndarray, np.ndarray] = faiss.knn(np.ascontiguousarray(q, np.float32),
                                                         np.ascontiguousarray(vectors, np.float32), k,
                                                         metric=faiss.METRIC_INNER_PRODUCT)
        return found
    scores = inner(q, vectors)
    if k < scores.shape[1]:
        part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
        order = np.take_along_axis(part, np.argsort(-np.take_along_axis(scores, part, axis=1), axis=1), axis=1)
    else:
        order = np.argsort(-scores, axis=1, kind="stable")
    return np.take_along_axis(scores, order, axis=1), order


@dataclass(frozen=True)
class Kept:
    """One mask's rows for the search: `vectors` (row-aligned with `rows`) when few enough to score exactly."""

    mask: np.ndarray
    count: int
    bits: np.ndarray  # the mask packed little-endian, as faiss.IDSelectorBitmap reads it
    rows: np.ndarray | None = None
    vectors: np.ndarray | None = None

    @classmethod
    def of(cls, mask: np.ndarray, index: Any, exact_rows: int | None = None) -> Kept:
        """The rows `mask` keeps of `index` (a FAISS index that reconstructs rows); decoded when at
        most `exact_rows` (default `EXACT_ROWS`)."""
        count = int(np.count_nonzero(mask))
        bits = np.packbits(mask, bitorder="little")
        if count > (EXACT_ROWS if exact_rows is None else exact_rows):
            return cls(mask, count, bits)
        rows = np.flatnonzero(mask)
        vectors = np.asarray(index.reconstruct_batch(rows), np.float32) if count else np.zeros((0, index.d), np.float32)
        return cls(mask, count, bits, rows, np.ascontiguousarray(vectors))

    def top(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k (scores, rows) of each query row over the kept rows, best first."""
        assert self.rows is not None and self.vectors is not None, "Kept.top needs the decoded rows"
        scores, order = top_k(q, self.vectors, min(k, len(self.rows)))
        return scores, self.rows[order]


class LastKept:
    """The `Kept` of the last mask an index searched with (by identity: the mask cache reuses its arrays)."""

    def __init__(self) -> None:
        self._last: Kept | None = None

    def get(self, mask: np.ndarray, index: Any) -> Kept:
        last = self._last  # one read: another thread may replace it meanwhile, ours stays whole
        if last is not None and last.mask is mask:
            return last
        kept = Kept.of(mask, index)
        self._last = kept
        return kept
