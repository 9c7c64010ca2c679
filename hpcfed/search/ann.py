"""An approximate nearest-neighbour index of one site's export (FAISS), kept beside the export.

    RUN/embeddings/site<k>.h5            the export (written and tagged by site k)
    RUN/embeddings/site<k>.<entity>.ann  its index: HDF5, tagged like the export

The index holds the L2-normalised vectors in a FAISS index with inner-product metric (so its scores
are cosines), the ids, labels and norms (``vector_of`` gives back the raw vector a mapper expects),
and the first two moments of the unit vectors, mean μ = Σu/n and C = Σuuᵀ/n. The moments make
``merge=zscore`` exact without scoring every document: over all n documents the query's cosines
s_i = q·u_i have mean q·μ and variance qᵀCq − (q·μ)²; leaving the query's own document e out,
mean' = (n·q·μ − s_e)/(n − 1) and E'[s²] = (n·qᵀCq − s_e²)/(n − 1).

A loaded index is refused (`SearchIndexError`) when its tag does not verify, or when it does not
describe the export beside it: another entity, count, dimension, export format version, or another
export's fingerprint/digest (an index copied from another site or job). FAISS parses the index only
after its tag checked out, so it never reads bytes that a key we hold did not vouch for: the key is
the job key (``$HPCFED_STATE_KEY``, as for exports) or, without one, a key of this user's
(``$HPCFED_KEYS_DIR``/search-index.key, default ``~/.hpcfed/keys``, made on first use, mode 0600).
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from hpcfed.search import columns as cols
from hpcfed.search.columns import Columns
from hpcfed.search.index import Hit, SiteIndex, normalize_rows
from hpcfed.search.kept import LastKept, top_k
from hpcfed.store import sealed
from hpcfed.store.embeddings import ExportError, export_auth
from hpcfed.store.vectors import ExportHeader, read_header
from hpcfed.store.walk import Verified, read_verified

FORMAT = "hpcfed-search-index"
FORMAT_VERSION = 3  # 3: /columns (per-row attributes); 2: the FAISS index is one chunked dataset /faiss
PURPOSE = "search-index"
FAISS_CHUNK = 1 << 20  # HDF5 chunk of /faiss: written as FAISS serializes, read straight into one buffer
SUFFIX = ".ann"
HNSW_EXACT_BELOW = 0.1  # share of rows a filter keeps under which HNSW scores them exactly (`AnnIndex._search`)


class SearchIndexError(ValueError):
    """A search index is missing, stale, forged, or does not belong to the export beside it."""


class SiteSearcher(Protocol):
    """What global and live search need of one site: its ids, query vectors and top-k hits."""

    site: str
    ids: list[str]
    position: dict[str, int]
    labels: np.ndarray
    columns: Columns

    @property
    def dim(self) -> int: ...

    def vector_of(self, doc_id: str) -> np.ndarray: ...

    def hits(self, queries: np.ndarray, k: int, exclude: Sequence[str | None] | None = None,
             standardize: bool = False, allowed: np.ndarray | None = None) -> list[list[Hit]]: ...


def index_path(export: str | Path, entity: str) -> Path:
    """Where the index of `entity` of an export lives: beside it, ``site<k>.<entity>.ann``."""
    export = Path(export)
    return export.with_name(f"{export.stem}.{entity}{SUFFIX}")


def index_auth() -> sealed.FileAuth:
    """The key that tags indexes: the job's (``$HPCFED_STATE_KEY``), else this user's own."""
    job = export_auth(PURPOSE)
    if job is not None:
        return job
    keys = Path(os.environ.get("HPCFED_KEYS_DIR") or Path.home() / ".hpcfed" / "keys").expanduser()
    path = keys / "search-index.key"
    if not path.is_file():
        keys.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
        if not path.exists():  # another process may have made it meanwhile: keep the first
            os.replace(tmp, path)
        else:
            tmp.unlink()
    try:
        psk = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise SearchIndexError(f"{path}: the search-index key is not hex; delete it and rebuild the indexes") from None
    if len(psk) < 16:
        raise SearchIndexError(f"{path}: the search-index key is too short; delete it and rebuild the indexes")
    return sealed.FileAuth.from_psk(psk, PURPOSE)


class AnnIndex:
    """Top-k by cosine over one site's export through its FAISS index (same answers as `SiteIndex`,
    approximately: exactly for kind ``flat``)."""

    def __init__(self, site: str, ids: list[str], labels: np.ndarray, norms: np.ndarray, index: Any,
                 mean: np.ndarray, second: np.ndarray, attrs: dict[str, Any], columns: Columns | None = None) -> None:
        self.site = str(site)
        self.ids = ids
        self.position = dict(zip(ids, range(len(ids))))  # twice as fast as a comprehension over enumerate
        if len(self.position) != len(ids):
            raise SearchIndexError(f"site {site}: the index lists an id twice")
        self.labels = labels
        self.norms = norms
        self.index = index
        self.mean = mean
        self.second = second
        self.attrs = attrs
        self.columns = columns or {}
        self.kept = LastKept()  # the last filter's rows, worked out once (a service repeats its filters)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def kind(self) -> str:
        return str(self.attrs.get("factory", "?"))

    def set_search_effort(self, nprobe: int | None = None, ef_search: int | None = None) -> None:
        """IVF lists probed / HNSW candidates kept per query (more: slower, better recall)."""
        import faiss

        space = faiss.ParameterSpace()
        if nprobe and "IVF" in self.kind:
            space.set_index_parameter(self.index, "nprobe", int(nprobe))
        if ef_search and "HNSW" in self.kind:
            space.set_index_parameter(self.index, "efSearch", int(ef_search))

    def vector_of(self, doc_id: str) -> np.ndarray:
        """The document's vector as exported (unit vector × stored norm; approximate if compressed)."""
        if doc_id not in self.position:
            raise ValueError(f"id {doc_id!r} is not in site {self.site}'s export")
        row = self.position[doc_id]
        raw: np.ndarray = np.asarray(self.index.reconstruct(row), np.float32) * self.norms[row]
        return raw

    def hits(self, queries: np.ndarray, k: int, exclude: Sequence[str | None] | None = None,
             standardize: bool = False, allowed: np.ndarray | None = None) -> list[list[Hit]]:
        """Best-first hits per query row; the excluded id of each row (the query itself) is left out, and
        with `allowed` (a mask over the rows, `hpcfed.search.filters`) only the rows it keeps are searched."""
        q = normalize_rows(np.atleast_2d(queries))
        if q.shape[1] != self.dim:
            raise ValueError(f"site {self.site}: query vectors have {q.shape[1]} dims, the index has {self.dim}; "
                             f"vectors from another model need a mapper (mode=mapping)")
        n = len(self.ids)
        kept = n if allowed is None else self.kept.get(allowed, self.index).count
        if kept == 0 or len(q) == 0:
            return [[] for _ in range(len(q))]
        kk = min(kept, k + (1 if exclude is not None else 0))
        scores, rows = self._search(np.ascontiguousarray(q, np.float32), kk, allowed if kept < n else None)
        out = []
        for r in range(len(q)):
            ex = exclude[r] if exclude is not None else None
            ex_row = self.position.get(ex) if ex is not None else None
            cand = [(float(s), int(i)) for s, i in zip(scores[r], rows[r]) if i >= 0 and i != ex_row]
            cand.sort(key=lambda c: (-c[0], self.ids[c[1]]))  # ties by id, as the exact search
            cand = cand[:k]
            if standardize:
                mean, std = self._moments(q[r], ex_row)
                cand = [((s - mean) / std, i) for s, i in cand]
            out.append([Hit(self.site, self.ids[i], s, int(self.labels[i])) for s, i in cand])
        return out

    def _search(self, q: np.ndarray, k: int, allowed: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """FAISS's top-k; under a filter, only the kept rows are scored. Few kept rows (`kept.EXACT_ROWS`)
        are scored exactly, their decoded vectors kept with the filter. Otherwise an ID selector works
        inside the search, and an IVF index probes `nprobe / share kept` cells, so that as many kept
        vectors are scanned as an unfiltered query scans vectors (the selector makes that a bitmap test
        per vector, a distance per kept one). HNSW under a narrow filter (under 10 % kept) would walk a
        graph mostly of rejected nodes: the kept rows are scored exactly instead."""
        import faiss

        if allowed is None:
            return self.index.search(q, k)
        kept = self.kept.get(allowed, self.index)
        if kept.vectors is not None:
            return kept.top(q, k)
        swig: Any = faiss  # faiss's stubs lack the search parameters' keyword constructors
        share = kept.count / max(1, len(allowed))
        bits = kept.bits  # held by this frame until FAISS is done with the bitmap it points into
        selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bits))
        ivf = faiss.try_extract_index_ivf(self.index)
        if ivf is not None:
            nprobe = min(ivf.nlist, math.ceil(ivf.nprobe / share))
            params: Any = swig.SearchParametersIVF(sel=selector, nprobe=nprobe)
        elif "HNSW" in self.kind and share < HNSW_EXACT_BELOW:
            return self._search_rows(q, k, np.flatnonzero(allowed))
        elif "HNSW" in self.kind:
            hnsw: Any = faiss.downcast_index(self.index)
            params = swig.SearchParametersHNSW(sel=selector, efSearch=math.ceil(hnsw.hnsw.efSearch / share))
        else:
            params = swig.SearchParameters(sel=selector)
        found: tuple[np.ndarray, np.ndarray] = self.index.search(q, k, params=params)
        del bits
        return found

    def _search_rows(self, q: np.ndarray, k: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the stored (decoded) vectors of `rows` only."""
        vectors = np.asarray(self.index.reconstruct_batch(rows), np.float32)
        scores, order = top_k(q, vectors, min(k, len(rows)))
        return scores, rows[order]

    def _moments(self, q: np.ndarray, ex_row: int | None) -> tuple[float, float]:
        """Mean and std of the query's cosines over the site's documents, the excluded one left out."""
        qd = q.astype(np.float64)
        n = len(self.ids)
        mean = float(qd @ self.mean)
        e2 = float(qd @ self.second @ qd)
        if ex_row is not None and n > 1:
            s_e = float(qd @ np.asarray(self.index.reconstruct(ex_row), np.float64))
            mean, e2 = (n * mean - s_e) / (n - 1), (n * e2 - s_e * s_e) / (n - 1)
        return mean, max(float(np.sqrt(max(e2 - mean * mean, 0.0))), 1e-12)

    @classmethod
    def load(cls, export: str | Path, entity: str | None = None, site: str | None = None) -> AnnIndex:
        """The verified index beside `export`, checked against the export's header."""
        header = read_header(export, entity)
        path = index_path(header.path, header.entity)
        if not path.is_file():
            raise SearchIndexError(f"{header.path} has no search index ({path.name}); "
                                   f"build it with `hpcfed search index {header.path.parent}`")
        try:
            tree = read_verified(path, index_auth(), require_auth=True)
        except sealed.SealError as exc:
            raise SearchIndexError(f"{exc}; rebuild it with `hpcfed search index {header.path.parent}` "
                                   f"(same $HPCFED_STATE_KEY as when it was built)") from None
        attrs = dict(tree.attrs.get("", {}))
        check_matches(path, attrs, header)
        rows = check_appended(path, attrs, header)
        ids, labels, norms, mean, second = _arrays(path, tree, header, rows)
        try:
            columns = cols.read(tree.datasets, rows, str(path))
        except cols.ColumnError as exc:
            raise SearchIndexError(str(exc)) from None
        index = _deserialize(path, tree, header, rows)
        del tree
        return cls(site if site is not None else header.site, ids, labels, norms, index, mean, second, attrs,
                   columns)


def check_matches(path: Path, attrs: dict[str, Any], header: ExportHeader) -> None:
    """Refuse an index whose attributes do not describe this export (the error names what differs)."""
    rebuild = f"rebuild it with `hpcfed search index {header.path.parent}`"
    if attrs.get("format") != FORMAT:
        raise SearchIndexError(f"{path} is not an hpcfed search index (format={attrs.get('format')!r})")
    if attrs.get("format_version") != FORMAT_VERSION:
        raise SearchIndexError(f"{path}: index format version {attrs.get('format_version')!r}, this hpcfed reads "
                               f"{FORMAT_VERSION}; {rebuild}")
    checks = (("export_entity", header.entity, "is for entity"), ("num_rows", header.num_rows, "holds"),
              ("dim", header.dim, "has dimension"), ("export_format_version", header.format_version,
                                                      "was built from an export of format version"))
    for key, want, what in checks:
        if attrs.get(key) != want:
            raise SearchIndexError(f"{path} {what} {attrs.get(key)!r} but the export {header.path.name} has "
                                   f"{want!r}; {rebuild}")
    if header.recorded_digest is not None:  # a sealed export: its recorded digest covers every byte
        same = attrs.get("export_digest") == header.recorded_digest
    else:  # unsealed: its attributes, size and modification time must be those the index was built from
        same = (attrs.get("export_size"), attrs.get("export_mtime_ns")) == (header.size, header.mtime_ns)
    if attrs.get("export_fingerprint") != header.fingerprint or not same:
        raise SearchIndexError(f"{path} was built from another export than {header.path} (or the export was "
                               f"rewritten since); {rebuild}")


def appended(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    """The exports appended to an index after its build (``hpcfed search index --append``), in order."""
    raw = attrs.get("appended", "[]")
    try:
        segments = json.loads(str(raw))
    except ValueError:
        segments = None
    if not isinstance(segments, list) or not all(isinstance(s, dict) for s in segments):
        raise SearchIndexError(f"malformed 'appended' attribute {str(raw)[:100]!r}")
    return segments


def check_appended(path: Path, attrs: dict[str, Any], header: ExportHeader) -> int:
    """Rows the index holds: the export's and every appended export's, each of which must still be the
    file it was (a changed or removed one is named); returns the total."""
    rows = header.num_rows
    for segment in appended(attrs):
        source = Path(str(segment.get("export", "")))
        try:
            now = read_header(source, str(segment.get("entity")))
        except ExportError as exc:
            raise SearchIndexError(f"{path} holds vectors appended from {source}, which is gone or unreadable "
                                   f"({exc}); rebuild: `hpcfed search index {header.path.parent} --force`") from None
        same = (now.recorded_digest == segment.get("digest") if now.recorded_digest is not None
                else [now.size, now.mtime_ns] == [segment.get("size"), segment.get("mtime_ns")])
        if now.fingerprint != segment.get("fingerprint") or now.num_rows != segment.get("num_rows") or not same:
            raise SearchIndexError(f"{source} changed since it was appended to {path}; rebuild it with "
                                   f"`hpcfed search index {header.path.parent} --force`")
        rows += now.num_rows
    return rows


def _arrays(path: Path, tree: Verified, header: ExportHeader,
            n: int) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    d = header.dim
    want = {"ids/offsets": (n + 1,), "labels": (n,), "norms": (n,), "moments/mean": (d,), "moments/second": (d, d)}
    for name, shape in want.items():
        if name not in tree.datasets or tree.datasets[name].shape != shape:
            got = tree.datasets[name].shape if name in tree.datasets else "missing"
            raise SearchIndexError(f"{path}: /{name} should have shape {shape}, has {got}")
    ids = _unpack_ids(path, tree.datasets.get("ids/utf8"), tree.datasets["ids/offsets"])
    return (ids, tree.datasets["labels"].astype(np.int64), tree.datasets["norms"].astype(np.float32),
            tree.datasets["moments/mean"].astype(np.float64), tree.datasets["moments/second"].astype(np.float64))


def _unpack_ids(path: Path, blob: np.ndarray | None, offsets: np.ndarray) -> list[str]:
    """The ids from their UTF-8 blob and offsets (`ann_build.pack_ids`), every bound checked."""
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1 or offsets.dtype.kind not in "iu":
        raise SearchIndexError(f"{path}: /ids/utf8 and /ids/offsets are missing or of the wrong type")
    ends = offsets.astype(np.int64)
    if len(ends) == 0 or ends[0] != 0 or ends[-1] != len(blob) or np.any(np.diff(ends) < 0):
        raise SearchIndexError(f"{path}: /ids/offsets do not partition /ids/utf8")
    try:
        text = blob.tobytes().decode("utf-8")
    except UnicodeDecodeError:
        raise SearchIndexError(f"{path}: /ids/utf8 is not UTF-8") from None
    if len(text) == len(blob):  # ASCII ids: character offsets are the byte offsets
        return [text[a:b] for a, b in zip(ends[:-1].tolist(), ends[1:].tolist())]
    raw = blob.tobytes()
    return [raw[a:b].decode("utf-8") for a, b in zip(ends[:-1].tolist(), ends[1:].tolist())]


def _deserialize(path: Path, tree: Verified, header: ExportHeader, rows: int) -> Any:
    """The FAISS index from its verified bytes (taken out of the tree: FAISS copies them once, into the
    index, and the buffer is dropped as soon as it has)."""
    import faiss

    blob = tree.datasets.pop("faiss", None)
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise SearchIndexError(f"{path}: /faiss is missing or not a byte array")
    reader = faiss.VectorIOReader()
    faiss.copy_array_to_vector(blob, reader.data)
    del blob  # at most two copies at once: FAISS's reader buffer, then the index
    try:
        index = faiss.read_index(reader)
    except RuntimeError as exc:
        raise SearchIndexError(f"{path}: the FAISS index does not load ({str(exc).splitlines()[0][:200]})") from None
    del reader
    if index.ntotal != rows or index.d != header.dim or index.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise SearchIndexError(f"{path}: the FAISS index holds {index.ntotal} x {index.d} vectors, the export "
                               f"(and what was appended) {rows} x {header.dim}")
    ivf = faiss.try_extract_index_ivf(index)
    if ivf is not None:
        ivf.make_direct_map()  # reconstruct(row): the query vector of a query by id
    return index


def open_site(export: str | Path, entity: str | None, site: str, *, exact: bool = False,
              nprobe: int | None = None, ef_search: int | None = None) -> SiteSearcher:
    """The site's index when one is beside its export (and `exact` is not asked), else exact search."""
    if not exact:
        try:
            header = read_header(export, entity)
        except ExportError:
            header = None  # let the exact reader give its own, fuller error
        if header is not None and index_path(header.path, header.entity).is_file():
            ann = AnnIndex.load(export, entity, site)
            ann.set_search_effort(nprobe, ef_search)
            return ann
    return SiteIndex.from_export(export, entity, site=site)
