"""Exact top-k by id for `bench_search.py`'s filter and append goals, one site at a time.

The bench's ground truth was ``hpcfed search query --exact``: at 1 M x 384 that process holds every
site's vectors at once (3.5-5.1 GB) and, for the append, a second copy of every export written only
to be searched. Here each export is read in turn and scored in blocks, so the peak is one site's
vectors plus a block of scores: the same answer (cosine over unit vectors, a query's own document
left out, merged over the sites by score) for a fraction of the memory.
``tests/search/test_bench_truth.py`` checks it against the library's exact search.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hpcfed.search.index import normalize_rows  # noqa: E402 (after the path is set)
from hpcfed.store.embeddings import export_path, read_export  # noqa: E402

BLOCK = 16384  # rows scored at once: queries x BLOCK float32 scores (64 MB for 1,000 queries)


def exact_answers(folders: Sequence[Path], sites: int, queries: Sequence[str], k: int,
                  labels: Sequence[int] | None = None) -> list[dict]:
    """For each query id (a document of one of the exports), its exact top-k over every site's rows
    in every folder of `folders` (a site's exports there taken together), restricted to `labels` when
    given, in the shape of ``hpcfed search query --jsonl``'s answers (``results``: site, id, score)."""
    want = {q: i for i, q in enumerate(queries)}
    qvec = np.zeros((len(queries), 0), np.float32)
    found = np.zeros(len(queries), bool)
    own: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (folder, site) -> (queries, their rows)
    for f, folder in enumerate(folders):  # the query vectors first: each is a document of some site
        for site in range(sites):
            exp = read_export(export_path(folder, site))
            rows = [(want[d], r) for r, d in enumerate(exp.ids) if d in want]
            if rows:
                if qvec.shape[1] == 0:
                    qvec = np.zeros((len(queries), exp.vectors.shape[1]), np.float32)
                at, r = (np.array(v) for v in zip(*rows))
                qvec[at] = normalize_rows(exp.vectors[r])
                found[at] = True
                own[f, site] = at, r
    if not found.all():
        raise ValueError(f"{int((~found).sum())} query ids are in no export")
    best = np.full((len(queries), k), -np.inf, np.float32)
    best_ref = np.full((len(queries), k, 2), -1, np.int64)  # (site, global row in that site's order)
    names: dict[int, list[str]] = {s: [] for s in range(sites)}
    for f, folder in enumerate(folders):
        for site in range(sites):
            exp = read_export(export_path(folder, site))
            keep = np.arange(len(exp.ids)) if labels is None else np.flatnonzero(np.isin(exp.labels, labels))
            offset = len(names[site])
            names[site] += exp.ids
            mine, mine_rows = own.get((f, site), (np.zeros(0, np.int64), np.zeros(0, np.int64)))
            for start in range(0, len(keep), BLOCK):
                rows = keep[start:start + BLOCK]
                scores = qvec @ normalize_rows(exp.vectors[rows]).T
                where = np.searchsorted(rows, mine_rows)  # a query's own document is not its neighbour
                inside = (where < len(rows)) & (rows[np.minimum(where, len(rows) - 1)] == mine_rows)
                scores[mine[inside], where[inside]] = -np.inf
                if scores.shape[1] > k:  # this block's own top k first: the merge stays small
                    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
                else:
                    part = np.broadcast_to(np.arange(scores.shape[1]), (len(queries), scores.shape[1]))
                ref = np.stack(np.broadcast_arrays(site, offset + rows[part]), axis=-1)
                merged = np.concatenate([best, np.take_along_axis(scores, part, axis=1)], axis=1)
                refs = np.concatenate([best_ref, ref], axis=1)
                top = np.argpartition(-merged, k - 1, axis=1)[:, :k]
                best = np.take_along_axis(merged, top, axis=1)
                best_ref = np.take_along_axis(refs, top[..., None], axis=1)
            del exp
    out = []
    for qi in range(len(queries)):
        order = np.argsort(-best[qi], kind="stable")
        out.append({"results": [{"site": str(int(best_ref[qi, j, 0])), "id": names[int(best_ref[qi, j, 0])][
            int(best_ref[qi, j, 1])], "score": round(float(best[qi, j]), 6)} for j in order if best[qi, j] > -np.inf]})
    return out
