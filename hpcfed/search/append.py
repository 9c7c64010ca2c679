"""Grow a site's index without a rebuild: ``hpcfed search index RUN --append NEW_RUN``.

The vectors of a later export of the same site and model (new documents, a later export of the same
run) are added to the index built beside RUN's export: an IVF index files them under its trained
cells (no k-means again), HNSW links them into its graph, flat appends them. Ids, labels, norms,
the moments and the per-row columns grow with them, and the index records each appended export
(path, digest, fingerprint, rows), so that a load refuses the index when one of them changed.

Refused, naming the file: another dimension; vectors of another space (another model, dataset, mode,
label names or site); an export not tagged by the job key when the index's own export was; one
already in the index, or holding an id it has. A site new to RUN gets an index of its own
(copy its export into RUN and run ``hpcfed search index RUN``: only the new site is built).

When a rebuild is due: appended vectors that lie further from their IVF cells' centres than the
training sample did (`DRIFT_LIMIT`) mean the coarse quantiser no longer fits the collection, and more
appended rows than the export's own mean its cells were sized for a smaller collection.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.search import columns
from hpcfed.search.ann import AnnIndex, SearchIndexError, appended, index_path
from hpcfed.search.ann_build import IndexContents, coarse_residuals, write_index
from hpcfed.search.index import normalize_rows
from hpcfed.store.embeddings import export_auth
from hpcfed.store.vectors import BLOCK_BYTES, ExportHeader, read_header, stream_export

SAME_SPACE = ("model", "dataset", "mode", "shared_space", "metric", "normalized", "kind", "label_names", "events",
              "site")
DRIFT_LIMIT = 1.25  # appended vectors this much further (squared) from their cells' centres: retrain


def append_run(run: str | Path, new_run: str | Path, *, entity: str | None = None,
               block_bytes: int = BLOCK_BYTES) -> list[dict[str, Any]]:
    """Append every site export of `new_run` to the index of the same site in `run`."""
    from hpcfed.search.global_search import site_exports

    have, new = site_exports(run), site_exports(new_run)
    for site, path in new.items():
        if site not in have:
            raise SearchIndexError(f"{path}: site {site} has no export in {run} to append to; a new site gets an "
                                   f"index of its own: copy the export into {run} and run `hpcfed search index {run}`")
    return [append_export(have[site], path, entity=entity, block_bytes=block_bytes) for site, path in new.items()]


def append_export(export: str | Path, new_export: str | Path, *, entity: str | None = None,
                  block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Add the vectors of `new_export` to the index beside `export`; returns what was done, with the drift."""
    start = time.perf_counter()
    header = read_header(export, entity)
    ann = AnnIndex.load(export, header.entity)
    new = read_header(new_export, header.entity)
    _check_appendable(ann, header, new)
    index = ann.index
    _drop_direct_map(index)
    n0, d = len(ann.ids), ann.dim
    norms, sums, outer, residual = [], np.zeros(d), np.zeros((d, d)), [0.0]

    def add(row: int, block: np.ndarray) -> None:
        unit = np.ascontiguousarray(normalize_rows(block))
        norms.append(np.linalg.norm(block, axis=1).astype(np.float32))
        np.add(sums, unit.sum(axis=0, dtype=np.float64), out=sums)
        np.add(outer, unit.T @ unit, out=outer)
        residual[0] += float(coarse_residuals(index, unit)[1].sum())
        index.add(unit)

    auth = export_auth()
    streamed = stream_export(new.path, new.entity, auth, add, block_bytes=block_bytes)
    if auth is not None and not streamed.verified:
        raise SearchIndexError(f"{new.path} is not tagged by this job's key ($HPCFED_STATE_KEY): an export of "
                               f"another run is not appended")
    clash = next((i for i in streamed.ids if i in ann.position), None)
    if clash is not None:
        raise SearchIndexError(f"{new.path}: id {clash!r} is already in {header.path.name}'s index; append only "
                               f"new documents")
    m = new.num_rows
    labels = streamed.labels if streamed.labels is not None else np.full(m, -1, np.int64)
    new_columns = columns.checked(streamed.columns, m, str(new.path))
    contents = IndexContents(
        ann.ids + streamed.ids, np.concatenate([ann.labels, labels]), np.concatenate([ann.norms, *norms]),
        (ann.mean * n0 + sums) / max(1, n0 + m), (ann.second * n0 + outer) / max(1, n0 + m),
        columns.concat([ann.columns, new_columns], [n0, m], str(new.path)))
    segments = [*appended(ann.attrs), {
        "export": str(new.path.resolve()), "entity": new.entity, "digest": streamed.digest,
        "fingerprint": new.fingerprint, "num_rows": m, "size": new.size, "mtime_ns": new.mtime_ns,
        "residual": residual[0] / max(1, m)}]
    attrs = {**ann.attrs, "appended": json.dumps(segments), "total_rows": n0 + m}
    size, _ = write_index(index_path(header.path, header.entity), index, attrs, contents)
    return {"site": ann.site, "index": str(index_path(header.path, header.entity)), "appended": str(new.path),
            "rows": m, "total_rows": n0 + m, "bytes": size, **rebuild_due(attrs, header.num_rows),
            "seconds": round(time.perf_counter() - start, 2), "status": "appended"}


def rebuild_due(attrs: dict[str, Any], base_rows: int) -> dict[str, Any]:
    """Whether the index wants a rebuild, and why: the appended vectors' drift from the coarse cells
    (mean squared distance to their cell's centre over the training sample's), and how much was added."""
    segments = appended(attrs)
    added = sum(int(s.get("num_rows", 0)) for s in segments)
    trained = float(attrs.get("coarse_residual", 0.0) or 0.0)
    drift = (sum(float(s.get("residual", 0.0)) * int(s.get("num_rows", 0)) for s in segments) / max(1, added)
             / trained) if trained > 0 and added else None
    why = []
    if drift is not None and drift > DRIFT_LIMIT:
        why.append(f"the appended vectors lie {drift:.2f}x as far from their IVF cells as the trained ones "
                   f"(limit {DRIFT_LIMIT})")
    if added > base_rows and trained > 0:
        why.append(f"{added} appended rows outnumber the {base_rows} the cells were sized for")
    out: dict[str, Any] = {"drift": None if drift is None else round(drift, 3), "rebuild_due": bool(why)}
    if why:
        out["why"] = "; ".join(why) + ": rebuild with `hpcfed search index RUN --force`, then append again"
    return out


def _check_appendable(ann: AnnIndex, header: ExportHeader, new: ExportHeader) -> None:
    if new.dim != header.dim:
        raise SearchIndexError(f"{new.path}: vectors of dimension {new.dim}, the index of {header.path.name} holds "
                               f"{header.dim}; vectors of another model are not appended")
    for key in SAME_SPACE:
        if new.attrs.get(key) != header.attrs.get(key):
            raise SearchIndexError(f"{new.path}: {key} {new.attrs.get(key)!r}, the index's export "
                                   f"{header.path.name} has {header.attrs.get(key)!r}: vectors of another run, "
                                   f"model or site are in another space and are not appended")
    if new.path.resolve() == header.path.resolve() or any(
            s.get("fingerprint") == new.fingerprint and s.get("num_rows") == new.num_rows for s in appended(ann.attrs)):
        raise SearchIndexError(f"{new.path} is already in the index of {header.path.name}")


def _drop_direct_map(index: Any) -> None:
    """An IVF index loaded for queries by id keeps a row -> code map, which `add` does not extend: drop it
    (the next load makes it again)."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        swig: Any = faiss  # faiss's stubs lack DirectMap
        ivf.set_direct_map_type(swig.DirectMap.NoMap)
