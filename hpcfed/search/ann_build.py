"""Build a site's search index (`hpcfed.search.ann`) from its export, reading the export in blocks.

    hpcfed search index RUN [--kind auto|flat|ivf|hnsw] [--compress auto|none|int8|pq] [--read-mib 64]

Kinds (FAISS factory strings, inner product over unit vectors = cosine):

    flat   Flat            exact, brute force in FAISS; `auto` for up to 20,000 vectors
    ivf    IVF<nlist>,SQ8  k-means cells, `nprobe` of them searched; `auto` above 20,000
    hnsw   HNSW32,SQ8      graph; the fastest queries, but the slowest build on few cores

Compression (``--compress auto``: int8 for ivf and hnsw, none for flat): ``int8`` stores each
dimension of a unit vector in a byte (SQ8: 4x smaller than float32, and on 88k real MiniLM vectors
within .01 of the uncompressed index's recall, docs/search.md), so an index loads, verifies and scans
4x fewer bytes; ``none`` keeps float32 (scores exact to the float); ``pq`` product codes of d/8 bytes
per vector (IVF-PQ, 32x smaller for d = 384; much lower recall) for collections that do not fit in
memory. The export is read twice for trained kinds (a sample to train, then every vector), never more
than ``--read-mib`` of vectors at a time; both passes must see the same digest.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.search import columns
from hpcfed.search.ann import (
    FAISS_CHUNK,
    FORMAT,
    FORMAT_VERSION,
    SearchIndexError,
    check_matches,
    index_auth,
    index_path,
)
from hpcfed.search.calibrate import ExactSample, choose_nprobe
from hpcfed.search.index import normalize_rows
from hpcfed.store import atomic, sealed
from hpcfed.store.embeddings import export_auth
from hpcfed.store.vectors import BLOCK_BYTES, ExportHeader, StreamedExport, read_header, stream_export
from hpcfed.store.walk import read_verified, seal_streamed

KINDS = ("auto", "flat", "ivf", "hnsw")
COMPRESSIONS = ("auto", "none", "int8", "pq")
FLAT_UP_TO = 20_000  # `auto`: brute force is exact and fast enough below this many vectors
SCAN_ROWS = 20_000  # IVF: vectors a query scans by default (`auto_nprobe`)


@dataclass(frozen=True)
class IndexSpec:
    """How to index: kind, compression and their knobs (0 = chosen from the collection's size)."""

    kind: str = "auto"
    compress: str = "auto"
    nlist: int = 0
    nprobe: int = 0
    hnsw_m: int = 32
    ef_construction: int = 40
    ef_search: int = 0

    def factory(self, n: int, d: int) -> tuple[str, dict[str, int]]:
        """The FAISS factory string and the search parameters for n vectors of d dims."""
        if self.kind not in KINDS or self.compress not in COMPRESSIONS:
            raise ValueError(f"index kind {self.kind!r} / compress {self.compress!r}; choose a kind of "
                             f"{', '.join(KINDS)} and a compression of {', '.join(COMPRESSIONS)}")
        kind = self.kind if self.kind != "auto" else ("flat" if n <= FLAT_UP_TO else "ivf")
        compress = self.compress if self.compress != "auto" else ("none" if kind == "flat" else "int8")
        codes = {"none": "Flat", "int8": "SQ8", "pq": _pq(n, d)}[compress]
        if kind == "flat":
            return codes, {}
        if kind == "hnsw":
            if compress == "pq":
                raise ValueError("--compress pq goes with --kind ivf (IVF-PQ); HNSW takes none or int8")
            return f"HNSW{self.hnsw_m},{codes}", {"efSearch": self.ef_search or 64}
        nlist = self.nlist or auto_nlist(n)
        return f"IVF{nlist},{codes}", {"nprobe": min(nlist, self.nprobe or auto_nprobe(nlist, n))}


def auto_nlist(n: int) -> int:
    """IVF cells: about 2·√n, a power of two, with at least 39 training points per cell."""
    target = max(1.0, 2.0 * math.sqrt(max(n, 1)))
    nlist = 1 << max(0, round(math.log2(target)))
    return max(1, min(nlist, n // 39 if n >= 39 else 1))


def auto_nprobe(nlist: int, n: int) -> int:
    """Cells searched per query: those holding about `SCAN_ROWS` vectors, at least 64 (every cell of a
    small index). A query costs about the same whatever the collection's size, and a denser collection
    keeps its neighbours in fewer cells: on 88,015 real MiniLM tweet vectors (one index, 512 cells)
    recall@10 is .919 at 1/16 of the cells, .946 at 1/8, .961 at 1/4 (this rule: 117, .23); for a
    250,000-vector site (1,024 cells) the rule gives 82. The build then raises it where the index's own
    recall is short (`hpcfed.search.calibrate`). See docs/search.md."""
    return min(nlist, max(64, math.ceil(SCAN_ROWS * nlist / max(n, 1))))


def _pq(n: int, d: int) -> str:
    """PQ codes of about d/8 bytes (each sub-vector of ~8 dims in one code of up to 8 bits)."""
    m = max(1, d // 8)
    while d % m:
        m -= 1
    nbits = max(1, min(8, int(math.log2(max(2, n // 39)))))  # 2^nbits centroids need ~39 points each
    return f"PQ{m}x{nbits}"


def build_index(export: str | Path, *, entity: str | None = None, spec: IndexSpec = IndexSpec(),
                site: str | None = None, block_bytes: int = BLOCK_BYTES, progress: bool = True,
                seed: int = 0) -> dict[str, Any]:
    """Build and write the index beside `export`; returns what was built (for the CLI's report)."""
    import faiss

    start = time.perf_counter()
    header = read_header(export, entity)
    site = site if site is not None else header.site
    factory, params = spec.factory(header.num_rows, header.dim)
    index = faiss.index_factory(header.dim, factory, faiss.METRIC_INNER_PRODUCT)
    if "HNSW" in factory:
        hnsw: Any = faiss.downcast_index(index)  # faiss's stubs type it as the base Index
        hnsw.hnsw.efConstruction = spec.ef_construction
    for name, value in params.items():  # stored in the serialized index: loading restores them
        faiss.ParameterSpace().set_index_parameter(index, name, value)
    passes = 1 if index.is_trained else 2
    bar = _bar(header.num_rows * passes, f"site{site} {factory}", progress and header.num_rows > 0)
    auth = export_auth()
    try:
        first = None if index.is_trained else _train(index, header, auth, block_bytes, bar.update, seed)
        stats = _Stats(header.num_rows, header.dim)
        exact = first[2] if first is not None and "IVF" in factory and not spec.nprobe else None

        def add(row: int, block: np.ndarray) -> None:
            unit = stats.add(row, block)
            if exact is not None:
                exact.add(row, unit)
            index.add(unit)

        streamed = stream_export(header.path, header.entity, auth, add, block_bytes=block_bytes, progress=bar.update)
    finally:
        bar.close()
    if first is not None and first[0] != streamed.digest:
        raise SearchIndexError(f"{header.path} changed while its index was built; build it again")
    measured: dict[str, Any] = {}
    if exact is not None:  # nprobe from the index's own recall (`hpcfed.search.calibrate`)
        params["nprobe"], recall = choose_nprobe(index, exact, params["nprobe"])
        faiss.ParameterSpace().set_index_parameter(index, "nprobe", params["nprobe"])
        measured = {"calibrated_recall": recall} if recall is not None else {}
    path = index_path(header.path, header.entity)
    n = max(1, stats.n)
    labels = streamed.labels if streamed.labels is not None else np.full(header.num_rows, -1, np.int64)
    contents = IndexContents(streamed.ids, labels, stats.norms, stats.sum / n, stats.outer / n,
                             columns.checked(streamed.columns, header.num_rows, str(header.path)))
    attrs = {**build_attrs(streamed, factory, params, site), **measured,
             **({"coarse_residual": first[1]} if first else {})}
    size, faiss_bytes = write_index(path, index, attrs, contents)
    return {"site": site, "entity": header.entity, "index": str(path), "factory": factory, **params, **measured,
            "num_rows": header.num_rows, "dim": header.dim, "export_verified": streamed.verified,
            "bytes": size, "faiss_bytes": faiss_bytes, "seconds": round(time.perf_counter() - start, 2)}


def _train(index: Any, header: ExportHeader, auth: sealed.FileAuth | None, block_bytes: int,
           progress: Callable[[int], None], seed: int) -> tuple[str, float, ExactSample]:
    """First pass: a uniform random sample of rows trains the quantizer; returns the export's digest,
    how far the sample lies from its cells' centres (`coarse_residual`, what appends are compared to),
    and some of the sample as queries whose exact neighbours the second pass gathers."""

    n = header.num_rows
    want = training_rows(index, n)
    rows = np.sort(np.random.default_rng(seed).choice(n, size=want, replace=False))
    sample = np.zeros((want, header.dim), np.float32)

    def take(first: int, block: np.ndarray) -> None:
        lo, hi = np.searchsorted(rows, [first, first + len(block)])
        sample[lo:hi] = normalize_rows(block[rows[lo:hi] - first])

    digest = stream_export(header.path, header.entity, auth, take, block_bytes=block_bytes, progress=progress).digest
    train(index, sample)
    residual = float(coarse_residuals(index, sample)[1].mean()) if len(sample) else 0.0
    return digest, residual, ExactSample.of(rows, sample)


def coarse_residuals(index: Any, unit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each unit vector's IVF cell and squared distance to the cell's centre (zeros without IVF): the
    quantiser's fit, which appended vectors from a drifted distribution lose."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is None:
        return np.zeros(len(unit), np.int64), np.zeros(len(unit), np.float32)
    ip, cell = ivf.quantizer.search(np.ascontiguousarray(unit, np.float32), 1)
    centres = ivf.quantizer.reconstruct_n(0, ivf.nlist)
    squared = 1.0 - 2.0 * ip[:, 0] + np.einsum("ij,ij->i", centres[cell[:, 0]], centres[cell[:, 0]])
    return cell[:, 0].astype(np.int64), np.maximum(squared, 0.0).astype(np.float32)


def training_rows(index: Any, n: int) -> int:
    """How many of n vectors train `index`: 64 per IVF cell, and at least 256 x 64 for SQ/PQ codebooks."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    want = 64 * ivf.nlist if ivf is not None else 0
    return min(n, max(want, 256 * 64))


def train(index: Any, sample: np.ndarray) -> None:
    """Train `index` on unit vectors (a `training_rows` sample), as `build_index` does."""
    import faiss

    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.cp.max_points_per_centroid = 64  # the sample is already the size k-means needs
    index.train(np.ascontiguousarray(sample, np.float32))


class _Stats:
    """Norms and the first two moments of the unit vectors, gathered block by block."""

    def __init__(self, n: int, d: int) -> None:
        self.n = n
        self.norms = np.zeros(n, np.float32)
        self.sum = np.zeros(d, np.float64)
        self.outer = np.zeros((d, d), np.float64)

    def add(self, row: int, block: np.ndarray) -> np.ndarray:
        self.norms[row:row + len(block)] = np.linalg.norm(block, axis=1)
        unit = np.ascontiguousarray(normalize_rows(block))
        self.sum += unit.sum(axis=0, dtype=np.float64)
        self.outer += (unit.T @ unit).astype(np.float64)  # float32 products, float64 sums over blocks
        return unit


@dataclass
class IndexContents:
    """What an index file holds beside the FAISS index: one entry per indexed vector, and the moments."""

    ids: list[str]
    labels: np.ndarray
    norms: np.ndarray
    mean: np.ndarray
    second: np.ndarray
    columns: dict[str, np.ndarray]


def build_attrs(streamed: StreamedExport, factory: str, params: dict[str, int], site: str) -> dict[str, Any]:
    """The index file's attributes: what it is and which export it describes (`ann.check_matches`)."""
    import faiss

    from hpcfed import __version__

    h = streamed.header
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "hpcfed_version": __version__,
            "library": f"faiss-cpu {faiss.__version__}", "factory": factory, "site": str(site),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "export": h.path.name,
            "export_entity": h.entity, "export_format_version": h.format_version,
            "export_digest": streamed.digest, "export_fingerprint": h.fingerprint,
            "export_verified": streamed.verified, "export_size": h.size, "export_mtime_ns": h.mtime_ns,
            "num_rows": h.num_rows, "dim": h.dim, **params}


def write_index(path: Path, index: Any, attrs: dict[str, Any], contents: IndexContents) -> tuple[int, int]:
    """Write the index file atomically and tag it (and empties `index`); returns the file's size and the
    FAISS index's, in bytes."""
    import h5py

    with atomic.atomic_path(path) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs.update(attrs)
            blob, offsets = pack_ids(contents.ids)
            f.create_dataset("ids/utf8", data=blob)
            f.create_dataset("ids/offsets", data=offsets)
            f.create_dataset("labels", data=contents.labels)
            f.create_dataset("norms", data=contents.norms)
            f.create_dataset("moments/mean", data=contents.mean)
            f.create_dataset("moments/second", data=contents.second)
            columns.write(f, contents.columns)
            faiss_bytes = _write_faiss(f, index)
        index.reset()
        seal_streamed(tmp, index_auth())
    return path.stat().st_size, faiss_bytes


def pack_ids(ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Ids as one UTF-8 blob and n+1 offsets: hashed and read as two arrays, not n Python strings."""
    encoded = [i.encode("utf-8") for i in ids]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(e) for e in encoded], out=offsets[1:])
    return np.frombuffer(b"".join(encoded), np.uint8), offsets


def _write_faiss(f: Any, index: Any) -> int:
    """Serialize the FAISS index straight into one chunked dataset, `FAISS_CHUNK` bytes at a time (the
    serialized index is never held whole beside the index); returns its size in bytes."""
    import faiss

    ds = f.create_dataset("faiss", shape=(0,), maxshape=(None,), dtype=np.uint8, chunks=(FAISS_CHUNK,))
    buf = bytearray()

    def flush(final: bool) -> None:
        while len(buf) >= FAISS_CHUNK or (final and buf):
            part = np.frombuffer(bytes(buf[:FAISS_CHUNK]), np.uint8)
            del buf[:FAISS_CHUNK]
            ds.resize((ds.shape[0] + len(part),))
            ds[-len(part):] = part

    def write(data: bytes) -> int:
        buf.extend(data)
        flush(False)
        return len(data)

    swig: Any = faiss  # faiss's stubs lack the Python-callback writer
    writer = swig.PyCallbackIOWriter(write)
    faiss.write_index(index, writer)
    del writer
    flush(True)
    return int(ds.shape[0])


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="vec", unit_scale=True, disable=not enabled, file=sys.stderr,
                mininterval=1.0, smoothing=0.1)


def index_is_current(export: str | Path, entity: str | None, spec: IndexSpec) -> bool:
    """Whether the index beside `export` verifies with today's key, describes the export and was built
    with this spec (reads the index once, not the export)."""
    header = read_header(export, entity)
    path = index_path(header.path, header.entity)
    if not path.is_file():
        return False
    try:
        attrs = read_verified(path, index_auth(), require_auth=True).attrs.get("", {})
        check_matches(path, attrs, header)
    except (sealed.SealError, SearchIndexError):
        return False
    return bool(attrs.get("factory") == spec.factory(header.num_rows, header.dim)[0])
