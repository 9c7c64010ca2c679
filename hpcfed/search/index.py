"""One site's searchable index over its embedding export, and the merge of per-site results.

SEEC global search (paper Alg. 2 GlobalSearch, Fig. 6/8; spec §4.4)::

    site j returns top-k (doc_id, cos(v_j, dv_j[doc])) over its own documents
    the initiator merges all lists, sorts by score (desc; ties -> doc id) and keeps the top k

That is ``merge="score"`` (the default; Fig. 8: "closest 3 to X among all responses"). Scores from
different vector spaces need not be comparable: a mapper's outputs score systematically higher
than the home site's own cosines, so with independently trained sites the score merge fills the
list with one site's answers. ``merge="interleave"`` takes the sites' answers rank by rank (home
site first, then the others by site id) — the paper's Table III, which shows the top-5 of each site
side by side; with N sites each contributes about k/N results. ``merge="zscore"`` calibrates
instead of interleaving: each site reports how far a hit's cosine lies above the mean of the
query's cosines over all that site's documents, in standard deviations (the CombZ normalisation
of metasearch), and the lists merge by that; a site with better answers still fills more of the
list, and a space whose scores run high gains nothing from it.

A query that is itself in the corpus is excluded from the results (as gensim ``most_similar(tag)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.search.columns import checked
from hpcfed.store.embeddings import read_export


@dataclass(frozen=True)
class Hit:
    """One search result: the site that returned it, the document id, its score and label (-1 unknown)."""

    site: str
    id: str
    score: float
    label: int = -1

    def as_dict(self) -> dict[str, str | float | int]:
        """The hit as JSON-ready values (score rounded to 6 decimals)."""
        return {"site": self.site, "id": self.id, "score": round(float(self.score), 6), "label": int(self.label)}


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """`x` as float32 with every row scaled to unit L2 length."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)
    unit: np.ndarray = x / np.maximum(norms, 1e-12)
    return unit  # a zero vector stays zero (cosine 0 with everything)


class SiteIndex:
    """Cosine top-k over one site's vectors (rows L2-normalised once, queries in batches)."""

    def __init__(self, site: str, ids: Sequence[str], vectors: np.ndarray, labels: np.ndarray | None = None,
                 attrs: Mapping[str, Any] | None = None, columns: Mapping[str, np.ndarray] | None = None) -> None:
        if len(ids) != len(vectors):
            raise ValueError(f"site {site}: {len(ids)} ids for {len(vectors)} vectors")
        self.site = str(site)
        self.ids = [str(i) for i in ids]
        self.position = {doc_id: i for i, doc_id in enumerate(self.ids)}
        self.raw = np.asarray(vectors, dtype=np.float32)
        self.unit = normalize_rows(self.raw)
        self.labels = np.full(len(ids), -1, dtype=np.int64) if labels is None else np.asarray(labels, dtype=np.int64)
        self.attrs = dict(attrs or {})
        self.columns = checked(dict(columns or {}), len(self.ids), f"site {site}")

    @property
    def dim(self) -> int:
        """Length of this site's vectors."""
        return int(self.raw.shape[1])

    @classmethod
    def from_export(cls, path: str | Path, entity: str | None = None, site: str | None = None) -> SiteIndex:
        """The index over one embedding export (site name from the file unless given)."""
        es = read_export(path, entity)
        return cls(site if site is not None else str(es.attrs.get("site", Path(path).stem)), es.ids, es.vectors,
                   es.labels, es.attrs, es.columns)

    def vector_of(self, doc_id: str) -> np.ndarray:
        """The raw (not normalised) vector of document `doc_id`; ValueError if this site lacks it."""
        if doc_id not in self.position:
            raise ValueError(f"id {doc_id!r} is not in site {self.site}'s export")
        vector: np.ndarray = self.raw[self.position[doc_id]]
        return vector

    def topk(self, queries: np.ndarray, k: int, exclude: Sequence[str | None] | None = None,
             block: int = 1024, standardize: bool = False,
             allowed: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Indices and cosine scores (m, k') of the nearest rows to each query, best first, k' = min(k, n).

        ``standardize``: scores become z-scores against the query's cosines over this site's other
        documents (the excluded one left out), so that sites in different vector spaces compare.
        ``allowed``: a mask of the rows a filter keeps; the others score -inf (after standardizing, so
        that z-scores are over all the site's documents, as the index's are).
        """
        q = normalize_rows(np.atleast_2d(queries))
        if q.shape[1] != self.dim:
            raise ValueError(f"site {self.site}: query vectors have {q.shape[1]} dims, the index has {self.dim}; "
                             f"vectors from another model need a mapper (mode=mapping)")
        n = len(self.ids)
        kk = min(k, n)
        idx_out = np.zeros((len(q), kk), dtype=np.int64)
        score_out = np.zeros((len(q), kk), dtype=np.float32)
        for s in range(0, len(q), block):
            scores = q[s:s + block] @ self.unit.T
            if exclude is not None:
                for row, doc_id in enumerate(exclude[s:s + block]):
                    pos = self.position.get(doc_id) if doc_id is not None else None
                    if pos is not None:
                        scores[row, pos] = -np.inf
            if standardize:
                scores = _zscores(scores)
            if allowed is not None:
                scores[:, ~allowed] = -np.inf
            if kk < n:
                part = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
            else:
                part = np.tile(np.arange(n), (len(scores), 1))
            part_scores = np.take_along_axis(scores, part, axis=1)
            # best first; ties broken by id so results do not depend on the partition
            for row in range(len(part)):
                order = sorted(range(kk), key=lambda c: (-part_scores[row, c], self.ids[part[row, c]]))
                idx_out[s + row] = part[row, order]
                score_out[s + row] = part_scores[row, order]
        return idx_out, score_out

    def hits(self, queries: np.ndarray, k: int, exclude: Sequence[str | None] | None = None,
             standardize: bool = False, allowed: np.ndarray | None = None) -> list[list[Hit]]:
        """Per query, the top-k as Hits, best first (excluded documents, and rows `allowed` drops, left out)."""
        idx, scores = self.topk(queries, k, exclude, standardize=standardize, allowed=allowed)
        return [[Hit(self.site, self.ids[i], float(sc), int(self.labels[i])) for i, sc in zip(ri, rs)
                 if np.isfinite(sc)] for ri, rs in zip(idx, scores)]


def _zscores(scores: np.ndarray) -> np.ndarray:
    """(s − mean) / std per row over the finite entries; −inf (excluded) stays −inf."""
    finite = np.isfinite(scores)
    count = np.maximum(finite.sum(axis=1, keepdims=True), 1)
    values = np.where(finite, scores, 0.0)
    mean = values.sum(axis=1, keepdims=True) / count
    var = (np.where(finite, scores - mean, 0.0) ** 2).sum(axis=1, keepdims=True) / count
    z = (scores - mean) / np.maximum(np.sqrt(var), 1e-12)  # one document (std 0): its z-score is 0
    return np.where(finite, z, -np.inf).astype(np.float32)


MERGES = ("score", "interleave", "zscore")
STANDARDIZED_MERGES = ("zscore",)  # the sites report z-scores (SiteIndex.hits(standardize=True))
MERGE_HELP = ("score: by cosine over all sites (spec 4.4); interleave: rank by rank, home site first; "
              "zscore: by each site's standardized cosine (sites in different vector spaces)")


def merge_results(per_site: Sequence[Sequence[Hit]], k: int, how: str = "score",
                  home: str | None = None) -> list[Hit]:
    """Merge the sites' lists and keep k.

    ``score`` (spec §4.4): score descending, ties by id (then site); ``zscore`` is the same over
    standardized scores. ``interleave``: rank by rank over the sites, the `home` site's list first,
    then the others by site id; every list must be best-first already (as `SiteIndex.hits` returns them).
    """
    if how == "score" or how in STANDARDIZED_MERGES:
        merged = [h for hits in per_site for h in hits]
        merged.sort(key=lambda h: (-h.score, h.id, h.site))
        return merged[:k]
    if how != "interleave":
        raise ValueError(f"merge={how!r}; choose one of: {', '.join(MERGES)}")
    lists = sorted((hits for hits in per_site if hits),
                   key=lambda hits: (hits[0].site != home, _site_key(hits[0].site)))
    out: list[Hit] = []
    for rank in range(max((len(hits) for hits in lists), default=0)):
        out += [hits[rank] for hits in lists if rank < len(hits)]
    return out[:k]


def _site_key(site: str) -> tuple[int, str]:
    return (int(site), "") if site.isdigit() else (1 << 30, site)
