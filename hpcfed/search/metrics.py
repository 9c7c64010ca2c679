"""SEEC evaluation metrics (paper §V.A.3, spec §4.5).

    sim_k(d) = |top_k^central(d) ∩ top_k^fed(d)| / k

the overlap between the k nearest documents that a centralized model (trained on the union of
the sites' data) finds for d and those the federated search finds, averaged over documents.
When fewer than k candidates exist the denominator is k' = min(k, #candidates) [RECON, a logged
deviation from the paper, which always has more than k].

Label precision@k: the fraction of the k results that carry the query's label (20 Newsgroups
group, Cora class) — a ground-truth check that the paper's sim_k lacks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


def sim_k(central: Sequence[Hashable], federated: Sequence[Hashable], k: int) -> float:
    """|top_k^central ∩ top_k^fed| / min(k, len(top_k^central)); 0 neighbours -> NaN."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    c, f = list(central)[:k], list(federated)[:k]
    denom = min(k, len(c))
    if denom == 0:
        return float("nan")
    return len(set(c) & set(f)) / denom


def mean_sim_k(central: Sequence[Sequence[Hashable]], federated: Sequence[Sequence[Hashable]], k: int) -> float:
    """Mean of `sim_k` over documents (NaN entries, i.e. queries with no candidates, are skipped)."""
    if len(central) != len(federated):
        raise ValueError(f"{len(central)} centralized result lists but {len(federated)} federated ones")
    values = np.array([sim_k(c, f, k) for c, f in zip(central, federated)], dtype=np.float64)
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else float("nan")


def label_precision_at_k(query_labels: Sequence[Hashable], result_labels: Sequence[Sequence[Hashable]],
                         k: int) -> float:
    """Mean fraction of the top-k results whose label equals the query's (unlabelled queries, -1 or None,
    skipped). Labels from several sites are compared by name (`hpcfed.search.evaluate`): each site
    numbers its own events or classes from 0."""
    scores = []
    for q, res in zip(query_labels, result_labels):
        res = list(res)[:k]
        if q is None or (isinstance(q, (int, np.integer)) and q < 0) or not res:
            continue
        scores.append(sum(1 for r in res if r == q) / len(res))
    return float(np.mean(scores)) if scores else float("nan")
