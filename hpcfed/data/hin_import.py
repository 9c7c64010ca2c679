"""``hpcfed data import-hin``: users' own heterogeneous graphs -> the project's HIN file.

Input: a folder in the HeCo release layout (``xy.txt`` edge lists and ``labels.npy``: acm, aminer,
dblp, freebase; read by `hpcfed.data.heco`), or one folder of CSV files (UTF-8, a header line,
comma-separated; ``.tsv`` files are read tab-separated). Node types are named by one letter each
(``P``, ``A`` ...), so meta-paths are strings of those letters::

    nodes_<T>.csv    one per node type T; column ``id`` (unique string), any other columns are
                     attributes; attributes of the target type are kept (``attr/NAME``) and can
                     drive partitioning (``task.partition: attribute``)
    edges_<XY>.csv   one per relation between types X and Y; columns ``src,dst`` (src an id of X,
                     dst an id of Y); no duplicate edges
    labels.csv       required; columns ``id,label``: the labelled target nodes (labels are strings
                     or integers; they are numbered in sorted order)
    features.csv     optional; ``id`` then numeric columns, one row per target node
    splits.csv       optional; ``id,split`` (split names such as train, val, test, train_20); when
                     absent, a stratified random train/val/test split of the labelled nodes is drawn

    hpcfed data import-hin DIR --out graph.npz [--target P] [--metapaths PAP,PSP]
                           [--columns id=node_id,src=from,dst=to,label=class]
                           [--train-fraction 0.3] [--val-fraction 0.1] [--seed 0]

``--columns`` gives the files' own names for the columns ``id``, ``src``, ``dst``, ``label`` and
``split`` (the same mapping for every file).

Every problem is reported with the file and line (line 1 is the header): unknown node ids,
duplicate ids or edges, missing columns, a missing labels file, non-numeric features. The output
format is described in `hpcfed.data.hin`; use it as ``task.dataset: graph.npz``.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from hpcfed.data.corpus import label_order
from hpcfed.data.hin import HIN, stratified_split
from hpcfed.data.root import DataError

COLUMNS = ("id", "src", "dst", "label", "split")


def _tables(folder: Path, stem: str) -> list[Path]:
    """``<stem>.csv`` / ``<stem>.tsv`` files of `folder` (stem may hold a glob), sorted."""
    return sorted(p for p in folder.glob(stem + ".*") if p.suffix in (".csv", ".tsv"))


def _read_csv(path: Path, required: tuple[str, ...],
              columns: dict[str, str] | None = None) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """Header and (line number, row) pairs, the file's column names mapped to ours by `columns`;
    DataError names the file and the missing column."""
    theirs = {v: k for k, v in (columns or {}).items()}
    with open(path, newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh, delimiter="\t" if path.suffix == ".tsv" else ",")
        header = [theirs.get(h.strip(), h.strip()) for h in (reader.fieldnames or [])]
        missing = [c for c in required if c not in header]
        if missing:
            mapped = [f"{c}={columns[c]}" for c in missing if columns and c in columns]
            if mapped:
                raise DataError(f"{path}: line 1: --columns {mapped[0]}: no such column (found: "
                                f"{', '.join(reader.fieldnames or []) or 'nothing'})")
            raise DataError(f"{path}: line 1: missing column(s) {', '.join(missing)}; the header must have "
                            f"{', '.join(required)} (found: {', '.join(header) or 'nothing'})")
        reader.fieldnames = header
        rows = []
        for row in reader:
            if None in row or any(v is None for v in row.values()):
                raise DataError(f"{path}: line {reader.line_num}: expected {len(header)} fields")
            rows.append((reader.line_num, {k: v.strip() for k, v in row.items()}))
    return header, rows


def read_hin_folder(folder: str | Path, *, target: str | None = None, metapaths: list[str] | None = None,
                    train_fraction: float = 0.3, val_fraction: float = 0.1, seed: int = 0,
                    columns: dict[str, str] | None = None) -> HIN:
    """Parse and validate the CSV layout above into a `HIN`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder; import-hin reads nodes_*.csv, edges_*.csv and labels.csv from one")
    node_files = _tables(folder, "nodes_*")
    if not node_files:
        raise DataError(f"{folder}: no nodes_<T>.csv files; write one per node type (column id), "
                        f"or give a HeCo-layout folder (xy.txt edge lists, labels.npy)")
    ids: dict[str, list[str]] = {}
    index: dict[str, dict[str, int]] = {}
    attrs: dict[str, dict[str, list[str]]] = {}
    for path in node_files:
        t = path.stem[len("nodes_"):]
        if len(t) != 1 or not t.isalpha():
            raise DataError(f"{path}: node type {t!r} must be one letter (e.g. nodes_P.csv), so meta-paths read as PAP")
        header, rows = _read_csv(path, ("id",), columns)
        seen: dict[str, int] = {}
        for line, row in rows:
            nid = row["id"]
            if not nid:
                raise DataError(f"{path}: line {line}: empty id")
            if nid in seen:
                raise DataError(f"{path}: line {line}: duplicate id {nid!r} (first at line {seen[nid]})")
            seen[nid] = line
        ids[t] = [row["id"] for _, row in rows]
        index[t] = {nid: i for i, nid in enumerate(ids[t])}
        attrs[t] = {c: [row[c] for _, row in rows] for c in header if c != "id"}

    relations: dict[str, np.ndarray] = {}
    for path in _tables(folder, "edges_*"):
        key = path.stem[len("edges_"):]
        if len(key) != 2 or any(t not in index for t in key):
            raise DataError(f"{path}: relation {key!r} must be two node-type letters with nodes_<T>.csv files "
                            f"(types here: {', '.join(sorted(index))})")
        _, rows = _read_csv(path, ("src", "dst"), columns)
        edges = np.empty((len(rows), 2), dtype=np.int64)
        first: dict[tuple[int, int], int] = {}
        for k, (line, row) in enumerate(rows):
            for col, (field, t) in enumerate((("src", key[0]), ("dst", key[1]))):
                j = index[t].get(row[field])
                if j is None:
                    raise DataError(f"{path}: line {line}: {field} {row[field]!r} is not an id in nodes_{t}.csv")
                edges[k, col] = j
            pair = (int(edges[k, 0]), int(edges[k, 1]))
            if pair in first:
                raise DataError(f"{path}: line {line}: duplicate edge {row['src']!r} -> {row['dst']!r} "
                                f"(first at line {first[pair]})")
            first[pair] = line
        relations[key] = edges
    if not relations:
        raise DataError(f"{folder}: no edges_<XY>.csv files; write one per relation (columns src,dst)")

    labels_path = next(iter(_tables(folder, "labels")), folder / "labels.csv")
    if not labels_path.is_file():
        raise DataError(f"{labels_path}: missing; every HIN needs labels.csv (columns id,label) for its target nodes")
    _, label_rows = _read_csv(labels_path, ("id", "label"), columns)
    if not label_rows:
        raise DataError(f"{labels_path}: no labelled nodes")
    if target is None:
        owners = [t for t in index if all(row["id"] in index[t] for _, row in label_rows)]
        if len(owners) != 1:
            raise DataError(f"{labels_path}: cannot tell the target type from the ids "
                            f"({'several types match' if owners else 'no node table holds them all'}); pass --target")
        target = owners[0]
    if target not in index:
        raise DataError(f"--target {target!r}: no nodes_{target}.csv in {folder}")
    n = len(ids[target])
    label_text: dict[int, str] = {}
    for line, row in label_rows:
        j = index[target].get(row["id"])
        if j is None:
            raise DataError(f"{labels_path}: line {line}: id {row['id']!r} is not in nodes_{target}.csv")
        if row["label"] == "":
            raise DataError(f"{labels_path}: line {line}: empty label for {row['id']!r}")
        if j in label_text:
            raise DataError(f"{labels_path}: line {line}: {row['id']!r} is labelled twice")
        label_text[j] = row["label"]
    names = label_order(set(label_text.values()))
    code = {name: c for c, name in enumerate(names)}
    labels = np.full(n, -1, dtype=np.int64)
    for j, text in label_text.items():
        labels[j] = code[text]

    features = None
    feat_path = next(iter(_tables(folder, "features")), folder / "features.csv")
    if feat_path.is_file():
        header, rows = _read_csv(feat_path, ("id",), columns)
        cols = [c for c in header if c != "id"]
        features = np.zeros((n, len(cols)), dtype=np.float32)
        seen_rows: dict[int, int] = {}
        for line, row in rows:
            j = index[target].get(row["id"])
            if j is None:
                raise DataError(f"{feat_path}: line {line}: id {row['id']!r} is not in nodes_{target}.csv")
            if j in seen_rows:
                raise DataError(f"{feat_path}: line {line}: duplicate row for {row['id']!r}")
            seen_rows[j] = line
            try:
                features[j] = [float(row[c]) for c in cols]
            except ValueError:
                bad = next(c for c in cols if not _is_float(row[c]))
                raise DataError(f"{feat_path}: line {line}: column {bad!r} = {row[bad]!r} is not a number") from None

    split_path = next(iter(_tables(folder, "splits")), folder / "splits.csv")
    if split_path.is_file():
        _, rows = _read_csv(split_path, ("id", "split"), columns)
        split_lists: dict[str, list[int]] = {}
        for line, row in rows:
            j = index[target].get(row["id"])
            if j is None:
                raise DataError(f"{split_path}: line {line}: id {row['id']!r} is not in nodes_{target}.csv")
            if labels[j] < 0:
                raise DataError(f"{split_path}: line {line}: {row['id']!r} has no label in labels.csv")
            if not row["split"]:
                raise DataError(f"{split_path}: line {line}: empty split name")
            split_lists.setdefault(row["split"], []).append(j)
        splits = {k: np.array(sorted(v), dtype=np.int64) for k, v in split_lists.items()}
    else:
        splits = stratified_split(labels, train_fraction, val_fraction, seed)

    if metapaths is None:
        metapaths = [target + (k[1] if k[0] == target else k[0]) + target
                     for k in sorted(relations) if target in k and k != target + target]
    hin = HIN(counts={t: len(v) for t, v in ids.items()}, relations=relations, target=target, labels=labels,
              metapaths=list(metapaths), splits=splits, features=features,
              attributes={k: np.asarray(v, dtype=str) for k, v in attrs[target].items()},
              ids={t: np.asarray(v, dtype=str) for t, v in ids.items()},
              label_names=np.asarray(names, dtype=str), name=folder.name)
    try:
        hin.validate(str(folder))
    except ValueError as exc:
        raise DataError(f"{folder}: {exc}") from None
    return hin


def _is_float(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False
