"""HINs in the HeCo release layout (acm, aminer, dblp, freebase), read from any folder by path.

A HeCo folder holds, for node types named by one lower-case letter each::

    xy.txt          edge list of relation XY: two integer columns, 0-based ids within X and Y
                    (acm: pa.txt ps.txt; aminer: pa.txt pr.txt; dblp: pa.txt pc.txt pt.txt;
                    freebase: ma.txt md.txt mw.txt)
    labels.npy      class of each target node (float or int)
    <t>_feat.npz    optional scipy.sparse features of the target type t (acm: p_feat.npz)
    train_20.npy    optional splits (train/val/test_<n>): target-node indices
    (pap.npz, nei_*.npy, pos.npz: HeCo's own derived files; not read: they are rebuilt from the edges)

The target type is the one whose node count (from the edge files) equals the number of labels, or
the one with a feature file; ``target=`` decides when neither tells. Default meta-paths go from the
target to each neighbour type and back (``PAP``), and for a neighbour type with relations of its own
one hop further (dblp: ``APA``, ``APCPA``, ``APTPA``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TypedDict

import numpy as np
import scipy.sparse as sp

from hpcfed.data.hin import HIN
from hpcfed.data.root import DataError, dataset_dir


class HecoSpec(TypedDict):
    """One HeCo release's node counts per type letter (isolated nodes included) and meta-paths."""

    types: dict[str, int]
    metapaths: list[str]


# The two releases in the shared data root, by name (their node counts include isolated nodes).
HECO: dict[str, HecoSpec] = {
    "hin/acm": {"types": {"P": 4019, "A": 7167, "S": 60}, "metapaths": ["PAP", "PSP"]},
    "hin/aminer": {"types": {"P": 6564, "A": 13329, "R": 35890}, "metapaths": ["PAP", "PRP"]},
}

_EDGE_FILE = re.compile(r"^([a-z])([a-z])\.txt$")


def is_heco_folder(folder: str | Path) -> bool:
    """A folder with labels.npy and at least one ``xy.txt`` edge file."""
    folder = Path(folder)
    return (folder / "labels.npy").is_file() and any(_EDGE_FILE.match(p.name) for p in folder.glob("*.txt"))


def load_heco(name: str, data_root: str | Path | None = None) -> HIN:
    """A HeCo release of the data root by name (``hin/acm``, ``hin/aminer``)."""
    if name not in HECO:
        raise DataError(f"unknown HeCo dataset {name!r}; choose one of: {', '.join(sorted(HECO))}, "
                        f"or give the path of a HeCo-layout folder")
    spec = HECO[name]
    return read_heco_folder(dataset_dir(name, data_root), target="P", counts=spec["types"],
                            metapaths=spec["metapaths"], name=name)


def read_heco_folder(folder: str | Path, *, target: str | None = None, counts: dict[str, int] | None = None,
                     metapaths: list[str] | None = None, name: str | None = None) -> HIN:
    """The HIN of a HeCo-layout folder (module docstring); DataError names the file at fault."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder; a HeCo-layout HIN is a folder of xy.txt edge lists and labels.npy")
    relations = {}
    for path in sorted(folder.glob("*.txt")):
        m = _EDGE_FILE.match(path.name)
        if m:
            relations[(m[1] + m[2]).upper()] = _edges(path)
    if not relations:
        raise DataError(f"{folder}: no edge files; HeCo names them by two type letters (pa.txt: paper-author)")
    labels = _labels(folder / "labels.npy")
    sizes = dict(counts or {})
    for key, edges in relations.items():
        for col, t in enumerate(key):  # trust the files over a table if they hold more nodes
            sizes[t] = max(sizes.get(t, 0), int(edges[:, col].max()) + 1 if len(edges) else 0)
    target = _target(folder, sizes, len(labels), target)
    if sizes[target] > len(labels):
        raise DataError(f"{folder / 'labels.npy'}: {len(labels)} labels, but the edge files name "
                        f"{sizes[target]} nodes of the target type {target}")
    sizes[target] = len(labels)
    splits = {}
    for path in sorted(folder.glob("*_[0-9]*.npy")):
        if path.stem.split("_")[0] in ("train", "val", "test"):
            splits[path.stem] = np.load(path, allow_pickle=False).astype(np.int64).ravel()
    features = None
    feat = folder / f"{target.lower()}_feat.npz"
    if feat.is_file():
        features = sp.load_npz(feat).tocsr().astype(np.float32)
        if features.shape[0] != len(labels):
            raise DataError(f"{feat}: {features.shape[0]} rows for {len(labels)} target nodes")
    hin = HIN(counts=sizes, relations=relations, target=target, labels=labels,
              metapaths=list(metapaths or default_metapaths(target, relations)), splits=splits,
              features=features, name=name or folder.name)
    hin.validate(str(folder))
    return hin


def default_metapaths(target: str, relations: dict[str, np.ndarray]) -> list[str]:
    """``TXT`` per neighbour type X of the target, ``TXYXT`` per further relation XY (dblp: APCPA)."""
    def neighbours(t: str) -> list[str]:
        return sorted({k[1] if k[0] == t else k[0] for k in relations if t in k and k != t + t})

    paths = []
    for x in neighbours(target):
        paths.append(target + x + target)
        paths += [target + x + y + x + target for y in neighbours(x) if y != target]
    return paths


def _edges(path: Path) -> np.ndarray:
    try:
        edges = np.loadtxt(path, dtype=np.int64, ndmin=2)
    except ValueError as exc:
        raise DataError(f"{path}: not two integer columns per line ({exc})") from None
    if edges.size and (edges.shape[1] != 2 or edges.min() < 0):
        raise DataError(f"{path}: expected two non-negative integer columns (src dst), got shape {edges.shape}")
    return edges.reshape(-1, 2)


def _labels(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path} is missing; a HeCo folder has labels.npy (one class per target node)")
    try:
        raw = np.load(path, allow_pickle=False)
    except ValueError as exc:
        raise DataError(f"{path}: not a numeric array ({exc})") from None
    raw = np.asarray(raw).ravel()
    if raw.dtype.kind not in "iuf" or not np.all(np.isfinite(raw)) or np.any(raw != np.round(raw)):
        raise DataError(f"{path}: labels must be whole numbers (class ids), got {raw.dtype}")
    return raw.astype(np.int64)


def _target(folder: Path, sizes: dict[str, int], num_labels: int, target: str | None) -> str:
    if target is not None:
        target = target.upper()
        if target not in sizes:
            raise DataError(f"--target {target}: no edge file of {folder} names type {target.lower()} "
                            f"(types: {', '.join(sorted(sizes))})")
        return target
    exact = [t for t, n in sizes.items() if n == num_labels]
    featured = [t for t in sizes if (folder / f"{t.lower()}_feat.npz").is_file() and sizes[t] <= num_labels]
    for found in (exact, featured):
        if len(found) == 1:
            return found[0]
    raise DataError(f"{folder}: cannot tell the labelled type from labels.npy ({num_labels} labels; node counts "
                    f"{', '.join(f'{t}={n}' for t, n in sorted(sizes.items()))}); pass --target")
