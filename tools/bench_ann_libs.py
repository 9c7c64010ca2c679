"""ANN libraries side by side on one collection: faiss (the kinds `hpcfed search index` builds) against
hnswlib and usearch where they are installed (``pip install hnswlib usearch``; absent ones are skipped).

    python tools/bench_ann_libs.py --vectors FILE.npy [--queries 1000] [--k 10] [--json]
    python tools/bench_ann_libs.py --n 200000          # synthetic vectors (tools/bench_search.py)

For each index: build time (all cores), the median time of one query at a time on one thread (what
the service does per request), recall@10 against exact cosine search (each query is a row of the
collection, itself left out, as a query by id), and the serialized size. Ratios are to the index
`hpcfed search index` builds by default (``auto``), all measured in this one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_search import synthetic  # noqa: E402 (after the path is set)

from hpcfed.search.ann_build import IndexSpec, train, training_rows  # noqa: E402

HNSW_M, EF_CONSTRUCTION, EF_SEARCH = 32, 40, 64  # the same graph settings for every HNSW library


def faiss_index(spec: IndexSpec) -> Callable[[np.ndarray], tuple[Any, Callable[[np.ndarray, int], np.ndarray], int]]:
    """A builder of the index `hpcfed search index` makes for `spec` (same factory, training and params)."""
    def build(x: np.ndarray) -> tuple[Any, Callable[[np.ndarray, int], np.ndarray], int]:
        import faiss

        factory, params = spec.factory(*x.shape)
        index = faiss.index_factory(x.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        if "HNSW" in factory:
            faiss.downcast_index(index).hnsw.efConstruction = EF_CONSTRUCTION
        if not index.is_trained:
            rows = np.random.default_rng(0).choice(len(x), training_rows(index, len(x)), replace=False)
            train(index, x[np.sort(rows)])
        index.add(x)
        for name, value in params.items():
            faiss.ParameterSpace().set_index_parameter(index, name, value)

        def search(q: np.ndarray, k: int) -> np.ndarray:
            return np.asarray(index.search(q, k)[1])
        return index, search, int(faiss.serialize_index(index).nbytes)
    return build


def hnswlib_index(x: np.ndarray) -> tuple[Any, Callable[[np.ndarray, int], np.ndarray], int]:
    import hnswlib

    index = hnswlib.Index(space="ip", dim=x.shape[1])
    index.init_index(max_elements=len(x), M=HNSW_M, ef_construction=EF_CONSTRUCTION)
    index.add_items(x, np.arange(len(x)), num_threads=os.cpu_count() or 1)
    index.set_ef(EF_SEARCH)
    with tempfile.TemporaryDirectory() as tmp:
        index.save_index(f"{tmp}/i.bin")
        size = os.path.getsize(f"{tmp}/i.bin")

    def search(q: np.ndarray, k: int) -> np.ndarray:
        return np.asarray(index.knn_query(q, k=k, num_threads=1)[0]).astype(np.int64)
    return index, search, size


def usearch_index(dtype: str) -> Callable[[np.ndarray], tuple[Any, Callable[[np.ndarray, int], np.ndarray], int]]:
    def build(x: np.ndarray) -> tuple[Any, Callable[[np.ndarray, int], np.ndarray], int]:
        from usearch.index import Index

        index = Index(ndim=x.shape[1], metric="ip", dtype=dtype, connectivity=HNSW_M,
                      expansion_add=EF_CONSTRUCTION, expansion_search=EF_SEARCH)
        index.add(np.arange(len(x)), x, threads=os.cpu_count() or 1)

        def search(q: np.ndarray, k: int) -> np.ndarray:
            return np.asarray(index.search(q, k, threads=1).keys).reshape(len(q), -1).astype(np.int64)
        return index, search, len(index.save())
    return build


CANDIDATES: dict[str, Callable[[np.ndarray], tuple[Any, Callable[[np.ndarray, int], np.ndarray], int]]] = {
    "faiss auto (hpcfed default)": faiss_index(IndexSpec()),
    "faiss IVF, flat": faiss_index(IndexSpec(kind="ivf", compress="none")),
    "faiss IVF-PQ": faiss_index(IndexSpec(kind="ivf", compress="pq")),
    "faiss HNSW, flat": faiss_index(IndexSpec(kind="hnsw", compress="none")),
    "faiss HNSW, int8": faiss_index(IndexSpec(kind="hnsw", compress="int8")),
    "hnswlib": hnswlib_index,
    "usearch, f32": usearch_index("f32"),
    "usearch, int8": usearch_index("i8"),
}


def measure(name: str, x: np.ndarray, queries: np.ndarray, truth: np.ndarray, k: int) -> dict[str, Any]:
    """Build one candidate and measure it; {"skipped": why} when its library is not installed."""
    import faiss

    faiss.omp_set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    try:
        _, search, size = CANDIDATES[name](x)
    except ImportError as exc:
        return {"index": name, "skipped": f"not installed ({exc.name})"}
    built = time.perf_counter() - start
    faiss.omp_set_num_threads(1)
    found, times = [], []
    for r in range(len(queries)):
        t = time.perf_counter()
        found.append(search(queries[r:r + 1], k + 1)[0])
        times.append(time.perf_counter() - t)
    hits = [len(set(_drop(f, int(truth[r, 0]), k)) & set(truth[r, 1:].tolist())) / k for r, f in enumerate(found)]
    return {"index": name, "build_s": round(built, 1), "median_query_ms": round(1000 * statistics.median(times), 3),
            "recall_at_k": round(float(np.mean(hits)), 3), "size_mb": round(size / 2**20, 1)}


def _drop(row: np.ndarray, own: int, k: int) -> list[int]:
    """The k best of a k+1 answer with the query's own row left out."""
    return [int(i) for i in row if i != own and i >= 0][:k]


def exact_truth(x: np.ndarray, rows: np.ndarray, k: int) -> np.ndarray:
    """Per query row: the row itself, then its k nearest others by cosine (brute force)."""
    import faiss

    flat = faiss.IndexFlatIP(x.shape[1])
    flat.add(x)
    ids = flat.search(x[rows], k + 1)[1]
    return np.stack([np.concatenate([[r], _drop(i, int(r), k)]) for r, i in zip(rows, ids)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vectors", default=None, help=".npy of real vectors (rows)")
    p.add_argument("--n", type=int, default=100_000, help="synthetic vectors when no --vectors")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--only", action="append", default=[], help="only these candidates (repeatable)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    raw = np.load(args.vectors) if args.vectors else np.concatenate(list(synthetic(args.n, args.dim, seed=0)))
    x = np.ascontiguousarray(raw / np.maximum(np.linalg.norm(raw, axis=1, keepdims=True), 1e-12), np.float32)
    rows = np.random.default_rng(1).choice(len(x), min(args.queries, len(x)), replace=False)
    truth = exact_truth(x, rows, args.k)
    results = [measure(name, x, x[rows], truth, args.k) for name in CANDIDATES if not args.only or name in args.only]
    base = results[0] if "skipped" not in results[0] else None
    for r in results:
        if base is not None and "skipped" not in r:
            r["build_vs_default"] = round(r["build_s"] / max(base["build_s"], 1e-9), 2)
            r["query_vs_default"] = round(r["median_query_ms"] / max(base["median_query_ms"], 1e-9), 2)
    report = {"vectors": args.vectors or "synthetic", "n": len(x), "dim": x.shape[1], "queries": len(rows),
              "k": args.k, "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(), "results": results}
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


def _table(r: dict[str, Any]) -> str:
    lines = [f"{r['n']:,} x {r['dim']} {r['vectors']} vectors, {r['queries']} queries, k={r['k']}, "
             f"{r['cpu_count']} cores, load average {r['load_avg'][0]:.1f}",
             "| library, index | build | median query | recall@k | size | build, query vs default |",
             "|---|---|---|---|---|---|"]
    for x in r["results"]:
        if "skipped" in x:
            lines.append(f"| {x['index']} | {x['skipped']} | | | | |")
            continue
        lines.append(f"| {x['index']} | {x['build_s']} s | {x['median_query_ms']} ms | {x['recall_at_k']} | "
                     f"{x['size_mb']} MB | {x.get('build_vs_default', '-')}x, {x.get('query_vs_default', '-')}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
