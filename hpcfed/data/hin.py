"""Heterogeneous information networks (HINs): the in-memory graph, its file format, loaders, meta-paths.

A `HIN` has node types named by one letter (``P`` paper, ``A`` author, ``S`` subject ...), so a
meta-path is a string of letters (``PAP``, ``APCPA``). Relations are edge lists between two types,
keyed by the two letters (``PA``: column 0 is a paper index, column 1 an author index; indices are
0-based within each type). One type is the *target* type: it carries the labels, the optional
features, the splits and the node attributes used for partitioning.

The project's HIN file (``.npz``, written by `save_hin` and `hpcfed data import-hin`, read with
``np.load(path, allow_pickle=False)``) holds::

    format          "hpcfed-hin"          format_version  1
    types           str (T,)  one letter per node type        counts  int64 (T,) nodes per type
    target          str       the labelled type               metapaths str (M,) default meta-paths
    rel/XY          int64 (E, 2)  edges of relation XY (row = [index in X, index in Y])
    labels          int64 (N,)    class of each target node, -1 = unlabelled
    label_names     str (C,)      optional class names (label c is label_names[c])
    ids/X           str (n_X,)    optional original node ids of type X
    features        float32 (N, F) optional dense target features, or the CSR triple
    features_csr/{data,indices,indptr,shape}
    split/NAME      int64         target-node indices of a split (train, val, test, train_20 ...)
    attr/NAME       str or int64 (N,)  per-target-node attribute (e.g. institution), for partitioning

Meta-path adjacency (spec section 2, HAHE ``utils.get_adj``): the product of the relation matrices
along the path, binarised, **with self-loops** (diag = 1); `row_normalize` L2-normalises rows for the
model input ``A_i^π``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from hpcfed.data.root import DataError

FORMAT = "hpcfed-hin"
FORMAT_VERSION = 1


@dataclass
class HIN:
    """A heterogeneous graph over a fixed node index (see the module docstring for the fields)."""

    counts: dict[str, int]
    relations: dict[str, np.ndarray]
    target: str
    labels: np.ndarray
    metapaths: list[str] = field(default_factory=list)
    splits: dict[str, np.ndarray] = field(default_factory=dict)
    features: Any = None  # np.ndarray (N, F) or scipy.sparse.csr_matrix, or None
    attributes: dict[str, np.ndarray] = field(default_factory=dict)
    ids: dict[str, np.ndarray] = field(default_factory=dict)
    label_names: np.ndarray | None = None
    name: str = ""

    @property
    def num_targets(self) -> int:
        """How many nodes of the target (labelled) type the graph has."""
        return self.counts[self.target]

    @property
    def num_classes(self) -> int:
        """Number of classes: the largest label + 1 (0 when no node is labelled)."""
        labelled = self.labels[self.labels >= 0]
        return int(labelled.max()) + 1 if labelled.size else 0

    def with_relations(self, relations: dict[str, np.ndarray]) -> HIN:
        """The same node index, labels and splits with other relation instances (a site's view)."""
        return replace(self, relations=relations)

    def validate(self, where: str = "") -> None:
        """Raise DataError naming the first inconsistency (index out of range, bad shape)."""
        at = f"{where}: " if where else ""
        for key, edges in self.relations.items():
            if len(key) != 2 or key[0] not in self.counts or key[1] not in self.counts:
                raise DataError(f"{at}relation {key!r} must name two node types from {sorted(self.counts)}")
            if edges.ndim != 2 or edges.shape[1] != 2:
                raise DataError(f"{at}relation {key} has shape {edges.shape}, expected (E, 2)")
            for col, t in enumerate(key):
                if edges.size and (edges[:, col].min() < 0 or edges[:, col].max() >= self.counts[t]):
                    raise DataError(f"{at}relation {key} column {col} has an index outside 0..{self.counts[t] - 1}")
        if self.labels.shape != (self.num_targets,):
            raise DataError(f"{at}labels have shape {self.labels.shape}, expected ({self.num_targets},)")
        for name, idx in self.splits.items():
            if idx.size and (idx.min() < 0 or idx.max() >= self.num_targets):
                raise DataError(f"{at}split {name!r} has a node index outside 0..{self.num_targets - 1}")
        for mp in self.metapaths:
            parse_metapath(mp, self)


# ------------------------------------------------------------------------------------------------
# meta-paths


def parse_metapath(metapath: str, hin: HIN) -> list[tuple[str, bool]]:
    """``"PAP"`` -> [("PA", False), ("PA", True)]: the relation per hop and whether it is transposed."""
    if len(metapath) < 2 or metapath[0] != metapath[-1]:
        raise ValueError(f"meta-path {metapath!r} must start and end at the same node type (e.g. PAP)")
    if metapath[0] != hin.target:
        raise ValueError(f"meta-path {metapath!r} must start at the target type {hin.target!r}")
    hops = []
    for a, b in pairwise(metapath):
        if a + b in hin.relations:
            hops.append((a + b, False))
        elif b + a in hin.relations:
            hops.append((b + a, True))
        else:
            raise ValueError(f"meta-path {metapath!r}: no relation between types {a} and {b}; "
                             f"relations: {', '.join(sorted(hin.relations))}")
    return hops


def relation_matrix(hin: HIN, key: str) -> sp.csr_matrix:
    """Binary (n_X, n_Y) matrix of relation XY."""
    edges = hin.relations[key]
    shape = (hin.counts[key[0]], hin.counts[key[1]])
    m = sp.csr_matrix((np.ones(len(edges), dtype=np.float32), (edges[:, 0], edges[:, 1])), shape=shape)
    m.sum_duplicates()
    m.data[:] = 1.0
    return m


def metapath_adjacency(hin: HIN, metapath: str, self_loops: bool = True) -> sp.csr_matrix:
    """Binary symmetric meta-path adjacency over the target nodes (sparse products), diag set to 1."""
    out: sp.csr_matrix | None = None
    for key, transposed in parse_metapath(metapath, hin):
        m = relation_matrix(hin, key)
        m = m.T.tocsr() if transposed else m
        out = m if out is None else (out @ m).tocsr()
        out.data[:] = 1.0  # binarise after every hop so counts cannot overflow float32 precision
    assert out is not None
    if self_loops:
        out = (out + sp.identity(out.shape[0], dtype=np.float32, format="csr")).tocsr()
        out.data[:] = 1.0
    out.eliminate_zeros()
    out.sort_indices()
    return out.astype(np.float32)


def row_normalize(adj: sp.csr_matrix) -> sp.csr_matrix:
    """Rows scaled to unit L2 norm (``F.normalize(adj, p=2, dim=1)``); empty rows stay zero."""
    norms = np.sqrt(np.asarray(adj.multiply(adj).sum(axis=1)).ravel())
    norms[norms == 0] = 1.0
    return sp.diags(1.0 / norms).astype(np.float32) @ adj


def metapath_instances(hin: HIN, metapath: str) -> int:
    """Number of meta-path-connected node pairs (i != j) in this graph: off-diagonal non-zeros."""
    adj = metapath_adjacency(hin, metapath, self_loops=False)
    return int(adj.nnz - np.count_nonzero(adj.diagonal()))


# ------------------------------------------------------------------------------------------------
# loaders


def save_hin(hin: HIN, path: str | Path) -> Path:
    """Write the project's HIN file (format in the module docstring); atomic via a temporary name."""
    path = Path(path)
    types = sorted(hin.counts)
    arrays: dict[str, np.ndarray] = {
        "format": np.array(FORMAT), "format_version": np.array(FORMAT_VERSION),
        "types": np.array(types), "counts": np.array([hin.counts[t] for t in types], dtype=np.int64),
        "target": np.array(hin.target), "metapaths": np.array(hin.metapaths, dtype=str),
        "labels": np.asarray(hin.labels, dtype=np.int64), "name": np.array(hin.name),
    }
    for key, edges in hin.relations.items():
        arrays[f"rel/{key}"] = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    for name, idx in hin.splits.items():
        arrays[f"split/{name}"] = np.asarray(idx, dtype=np.int64)
    for name, values in hin.attributes.items():
        arrays[f"attr/{name}"] = np.asarray(values)
    for t, ids in hin.ids.items():
        arrays[f"ids/{t}"] = np.asarray(ids, dtype=str)
    if hin.label_names is not None:
        arrays["label_names"] = np.asarray(hin.label_names, dtype=str)
    if hin.features is not None:
        if sp.issparse(hin.features):
            f = sp.csr_matrix(hin.features, dtype=np.float32)
            arrays.update({"features_csr/data": f.data, "features_csr/indices": f.indices.astype(np.int64),
                           "features_csr/indptr": f.indptr.astype(np.int64),
                           "features_csr/shape": np.array(f.shape, dtype=np.int64)})
        else:
            arrays["features"] = np.asarray(hin.features, dtype=np.float32)
    tmp = path.with_name(path.name + ".tmp.npz")
    path.parent.mkdir(parents=True, exist_ok=True)
    # numpy's stub matches **arrays against its `allow_pickle: bool` too; no key here has that name
    np.savez_compressed(tmp, **arrays)  # type: ignore[arg-type]  # numpy's stub matches **arrays against allow_pickle: no key has that name
    tmp.replace(path)
    return path


def load_hin_file(path: str | Path) -> HIN:
    """Read a file written by `save_hin` / `hpcfed data import-hin` (no pickle)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"HIN file {path} does not exist; create one with `hpcfed data import-hin`")
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable .npz file ({exc})") from None
    with z:
        if "format" not in z.files or str(z["format"]) != FORMAT:
            raise DataError(f"{path}: not an hpcfed HIN file (no format={FORMAT!r}); "
                            f"write it with `hpcfed data import-hin`")
        if int(z["format_version"]) > FORMAT_VERSION:
            raise DataError(f"{path}: HIN format version {int(z['format_version'])} is newer than this hpcfed reads")
        counts = {str(t): int(c) for t, c in zip(z["types"], z["counts"])}
        features = None
        if "features" in z.files:
            features = z["features"].astype(np.float32)
        elif "features_csr/data" in z.files:
            features = sp.csr_matrix((z["features_csr/data"], z["features_csr/indices"], z["features_csr/indptr"]),
                                     shape=tuple(int(s) for s in z["features_csr/shape"]), dtype=np.float32)
        hin = HIN(
            counts=counts,
            relations={k[4:]: z[k].astype(np.int64) for k in z.files if k.startswith("rel/")},
            target=str(z["target"]), labels=z["labels"].astype(np.int64),
            metapaths=[str(m) for m in z["metapaths"]],
            splits={k[6:]: z[k].astype(np.int64) for k in z.files if k.startswith("split/")},
            features=features,
            attributes={k[5:]: z[k] for k in z.files if k.startswith("attr/")},
            ids={k[4:]: z[k] for k in z.files if k.startswith("ids/")},
            label_names=z["label_names"] if "label_names" in z.files else None,
            name=str(z["name"]) if "name" in z.files else path.stem,
        )
    hin.validate(str(path))
    return hin


def stratified_split(labels: np.ndarray, train_fraction: float, val_fraction: float,
                     seed: int) -> dict[str, np.ndarray]:
    """Per class: `train_fraction` of the labelled nodes to train, `val_fraction` to val, the rest to test."""
    if not (0 < train_fraction < 1 and 0 <= val_fraction < 1 and train_fraction + val_fraction < 1):
        raise ValueError("train/val fractions must be in (0, 1) and sum to less than 1")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 9173]))
    out: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for c in np.unique(labels[labels >= 0]):
        members = rng.permutation(np.flatnonzero(labels == c))
        n_tr = max(1, round(train_fraction * len(members)))
        n_va = round(val_fraction * len(members))
        out["train"] += members[:n_tr].tolist()
        out["val"] += members[n_tr:n_tr + n_va].tolist()
        out["test"] += members[n_tr + n_va:].tolist()
    return {k: np.array(sorted(v), dtype=np.int64) for k, v in out.items()}


# ------------------------------------------------------------------------------------------------
# synthetic graph with planted labelled communities


def synthetic_hin(num_classes: int = 3, papers_per_class: int = 60, authors_per_class: int = 40,
                  subjects_per_class: int = 3, authors_per_paper: int = 3, purity: float = 0.85,
                  num_institutions: int = 3, train_per_class: int = 10, val_per_class: int = 10,
                  seed: int = 0) -> HIN:
    """Papers (target, labelled) linked to authors and subjects that mostly belong to the paper's class.

    Each author and subject is planted in one class community; a paper picks `authors_per_paper`
    authors and one subject, each from its own class with probability `purity` (else uniformly).
    So the PAP and PSP meta-paths carry the label signal, noisily. Every paper also has an
    ``institution`` attribute (uniform), for attribute partitioning.
    """
    if not 0.0 <= purity <= 1.0:
        raise ValueError(f"purity must be in [0, 1], got {purity}")
    if train_per_class + val_per_class >= papers_per_class:
        raise ValueError("train_per_class + val_per_class must leave test papers in every class")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 3571]))
    n_p = num_classes * papers_per_class
    n_a = num_classes * authors_per_class
    n_s = num_classes * subjects_per_class
    labels = np.repeat(np.arange(num_classes), papers_per_class).astype(np.int64)
    pa, ps = [], []

    def pick(cls: int, per_class: int) -> int:
        c = cls if rng.random() < purity else int(rng.integers(num_classes))
        return c * per_class + int(rng.integers(per_class))

    for p in range(n_p):
        authors = {pick(int(labels[p]), authors_per_class) for _ in range(authors_per_paper)}
        pa += [(p, a) for a in sorted(authors)]
        ps.append((p, pick(int(labels[p]), subjects_per_class)))
    splits: dict[str, list[int]] = {"train": [], "val": [], "test": []}
    for c in range(num_classes):
        members = rng.permutation(np.flatnonzero(labels == c))
        splits["train"] += members[:train_per_class].tolist()
        splits["val"] += members[train_per_class:train_per_class + val_per_class].tolist()
        splits["test"] += members[train_per_class + val_per_class:].tolist()
    hin = HIN(counts={"P": n_p, "A": n_a, "S": n_s},
              relations={"PA": np.array(pa, dtype=np.int64), "PS": np.array(ps, dtype=np.int64)},
              target="P", labels=labels, metapaths=["PAP", "PSP"],
              splits={k: np.sort(np.array(v, dtype=np.int64)) for k, v in splits.items()},
              attributes={"institution": rng.integers(num_institutions, size=n_p).astype(np.int64)},
              name="synthetic")
    hin.validate("synthetic")
    return hin
