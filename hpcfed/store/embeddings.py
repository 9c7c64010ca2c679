"""Per-site embedding exports in HDF5.

Layout (one file per site, written by that site: raw data never leaves it)::

    /<entity>/vectors   float32 (n, d), chunked + gzip
    /<entity>/ids       UTF-8 strings (n,)
    /<entity>/labels    int64 (n,)          optional
    /<entity>/columns/<name>  (n,) numbers or UTF-8 strings, optional: per-row attributes the search
                        filters on and shows (DAMe: ``time``, seconds since the epoch, and ``text``)
    attrs on the file:  format="hpcfed-embeddings", format_version, hpcfed_version, created
    attrs on /<entity>: model, dim, metric, normalized, site, config_hash, version

Readable with plain h5py (``f["node/vectors"][:]``). Files are written to a temporary name and
``os.replace``d, so a reader never sees half a file. The writing site tags the file with a key from
the job's PSK (`seal_export`, file attribute ``auth``); `read_export` bounds every declared size,
refuses links/external/virtual datasets, and verifies the tag when the key is at hand.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpcfed.store import atomic, sealed

if TYPE_CHECKING:  # pandas is imported where a frame is made: `import hpcfed` stays light
    import pandas

FORMAT = "hpcfed-embeddings"
FORMAT_VERSION = 1


class ExportError(ValueError):
    """An embedding export is missing, corrupt or not in the hpcfed format."""


@dataclass
class EmbeddingSet:
    """One site's exported vectors with their ids, labels, per-row columns and attributes, as read
    from an embedding export (`verified`: its tag checked out against the job key)."""

    entity: str
    vectors: np.ndarray
    ids: list[str]
    labels: np.ndarray | None = None
    attrs: dict[str, Any] = field(default_factory=dict)
    verified: bool = False  # its tag checked out against the job key
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # per-row attributes (``/<entity>/columns``)


def write_export(
    path: str | Path,
    vectors: np.ndarray,
    ids: Sequence[Any],
    labels: np.ndarray | None = None,
    *,
    entity: str = "node",
    model: str,
    site: int | str,
    metric: str = "cosine",
    normalized: bool = False,
    config_hash: str = "",
    version: int = 0,
    extra: dict[str, Any] | None = None,
    append: bool = False,
    columns: dict[str, Any] | None = None,
) -> Path:
    """Write (or, with `append`, add an entity to) an embedding export atomically."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        raise ExportError(f"vectors must be 2-D (n, d), got shape {vectors.shape}")
    if len(ids) != vectors.shape[0]:
        raise ExportError(f"{len(ids)} ids for {vectors.shape[0]} vectors")
    if labels is not None and len(labels) != vectors.shape[0]:
        raise ExportError(f"{len(labels)} labels for {vectors.shape[0]} vectors")
    for name, values in (columns or {}).items():
        if len(values) != vectors.shape[0]:
            raise ExportError(f"column {name!r} has {len(values)} values for {vectors.shape[0]} vectors")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    appending = append and path.exists()
    with atomic.atomic_path(path) as tmp:
        if appending:
            shutil.copyfile(path, tmp)
        _write_entity(tmp, "a" if appending else "w", entity, vectors, ids, labels, model=model, metric=metric,
                      normalized=normalized, site=site, config_hash=config_hash, version=version, extra=extra,
                      columns=columns)
    return path


def _write_entity(path: Path, mode: str, entity: str, vectors: np.ndarray, ids: Sequence[Any],
                  labels: np.ndarray | None, *, model: str, metric: str, normalized: bool, site: int | str,
                  config_hash: str, version: int, extra: dict[str, Any] | None,
                  columns: dict[str, Any] | None = None) -> None:
    import h5py

    from hpcfed import __version__

    with h5py.File(path, mode) as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["hpcfed_version"] = __version__
        f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if entity in f:
            del f[entity]
        g = f.create_group(entity)
        n, d = vectors.shape
        chunk_rows = max(1, min(n, (256 << 10) // max(1, 4 * d)))
        g.create_dataset("vectors", data=vectors, chunks=(chunk_rows, d) if n else None,
                         compression="gzip" if n else None, compression_opts=4 if n else None)
        g.create_dataset("ids", data=np.array([str(i) for i in ids], dtype=object), dtype=h5py.string_dtype("utf-8"))
        if labels is not None:
            g.create_dataset("labels", data=np.asarray(labels, dtype=np.int64))
        for cname, values in (columns or {}).items():
            values = np.asarray(values)
            if values.dtype.kind in "OUS":
                g.create_dataset(f"columns/{cname}", data=np.array([str(v) for v in values], dtype=object),
                                 dtype=h5py.string_dtype("utf-8"))
            else:
                g.create_dataset(f"columns/{cname}", data=values)
        attrs = {"model": model, "dim": d, "metric": metric, "normalized": bool(normalized),
                 "site": str(site), "config_hash": config_hash, "version": int(version)}
        attrs.update(extra or {})
        for key, value in attrs.items():
            g.attrs[key] = value


def read_export(path: str | Path, entity: str | None = None, auth: sealed.FileAuth | None = None) -> EmbeddingSet:
    """Read one entity (default: the only/first one) from an export, bounded and checked.

    `auth` defaults to the key in ``$HPCFED_STATE_KEY`` (see `export_auth`); with a key the file's tag must
    verify, without one the result says ``verified=False``."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"embedding export {path} does not exist")
    if auth is None:
        auth = export_auth()
    try:
        tree = sealed.read(path, auth, require_auth=False)
    except sealed.SealError as exc:
        raise ExportError(f"{exc}; re-export it") from None
    root = tree.attrs.get("", {})
    if root.get("format") != FORMAT:
        raise ExportError(f"{path} is not an hpcfed embedding export (attribute format={root.get('format')!r})")
    groups = [g for g in tree.children("") if g in tree.groups]
    if not groups:
        raise ExportError(f"{path} holds no embedding group")
    name = entity or groups[0]
    if name not in groups:
        raise ExportError(f"{path} has no entity {name!r}; it has: {', '.join(groups)}")
    for key in ("vectors", "ids"):
        if f"{name}/{key}" not in tree.datasets:
            raise ExportError(f"{path}: /{name}/{key} is missing")
    vectors = np.asarray(tree.datasets[f"{name}/vectors"], dtype=np.float32)
    ids = [s.decode() if isinstance(s, bytes) else str(s) for s in np.asarray(tree.datasets[f"{name}/ids"]).reshape(-1)]
    labels = tree.datasets.get(f"{name}/labels")
    attrs = {k: (v.item() if hasattr(v, "item") else v) for k, v in tree.attrs.get(name, {}).items()}
    if vectors.ndim != 2 or vectors.shape[0] != len(ids):
        raise ExportError(f"{path}: /{name}/vectors shape {vectors.shape} does not match {len(ids)} ids")
    if labels is not None and np.asarray(labels).shape != (len(ids),):
        raise ExportError(f"{path}: /{name}/labels shape {np.asarray(labels).shape} does not match {len(ids)} ids")
    columns = {key.rsplit("/", 1)[1]: np.asarray(value) for key, value in tree.datasets.items()
               if key.startswith(f"{name}/columns/")}  # checked by whoever uses them (`hpcfed.search.columns`)
    return EmbeddingSet(name, vectors, ids, None if labels is None else np.asarray(labels), attrs,
                        verified=tree.verified, columns=columns)


def seal_export(path: str | Path, auth: sealed.FileAuth) -> None:
    """Tag a finished export with the site's key (the site calls this after its task exported)."""
    path = Path(path)
    with atomic.atomic_path(path) as tmp:
        shutil.copyfile(path, tmp)
        sealed.seal(tmp, auth)


def export_auth(purpose: str = "embeddings") -> sealed.FileAuth | None:
    """The key from ``$HPCFED_STATE_KEY`` (the PSK of the job that wrote the files), or None: readers
    then say 'not verified'. Not ``$HPCFED_PSK``: a reading job (live search) has a key of its own."""
    import os

    text = os.environ.get("HPCFED_STATE_KEY", "").strip()
    try:
        psk = bytes.fromhex(text)
    except ValueError:
        raise ExportError("$HPCFED_STATE_KEY is not hex; unset it or give the writing job's PSK") from None
    return sealed.FileAuth.from_psk(psk, purpose) if len(psk) >= 16 else None


def read_frame(path: str | Path, entity: str | None = None) -> pandas.DataFrame:
    """One entity of an export as a pandas DataFrame: index ``id``, an optional ``label`` column,
    then one float32 column per dimension (``dim_0`` ...); the group's attributes in ``df.attrs``.
    (``pd.read_hdf`` reads only PyTables' own layout, which these h5py files do not use.)"""
    import pandas as pd

    emb = read_export(path, entity)
    columns = {f"dim_{j}": emb.vectors[:, j] for j in range(emb.vectors.shape[1])}
    if emb.labels is not None:
        columns = {"label": emb.labels, **columns}
    frame = pd.DataFrame(columns, index=pd.Index(emb.ids, name="id"))
    frame.attrs.update({"entity": emb.entity, **emb.attrs})
    return frame


def export_path(out_dir: str | Path, client_id: int) -> Path:
    """Where site `client_id` writes its export inside a run directory."""
    return Path(out_dir) / "embeddings" / f"site{client_id}.h5"
