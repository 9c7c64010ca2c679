"""One entity of an embedding export, streamed in bounded blocks and verified as a whole.

`sealed.read` holds a whole file in memory, which a million 384-d vectors (1.5 GB) should not need.
`stream_export` walks the file in sealed's canonical order and encoding (`hpcfed.store.walk`), so it
computes the same digest, but reads every large numeric dataset in blocks of at most ``block_bytes``
and hands the chosen entity's vector blocks to a consumer as they are hashed. At the end the digest
is checked against the file's ``auth`` record (and its tag against the key, when one is given); a
caller must treat what it consumed as unverified until `stream_export` returns.

`read_header` is the cheap look: attributes and shapes only, no array data.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.store import sealed
from hpcfed.store.embeddings import FORMAT, ExportError
from hpcfed.store.walk import CanonicalWalk, Consumer, check_tag

BLOCK_BYTES = 64 << 20  # default read budget: the export is read 64 MiB of vectors at a time
ENTITY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ExportHeader:
    """What an export declares, read without its arrays."""

    path: Path
    entity: str
    num_rows: int
    dim: int
    format_version: int
    site: str
    recorded_digest: str | None  # from the file's ``auth`` record; None when the file is not sealed
    fingerprint: str  # SHA-256 over the root's and the entity's attributes and the vectors' shape
    size: int  # bytes and modification time: what tells an unsealed export's rewrite without reading it
    mtime_ns: int
    attrs: dict[str, Any] = field(default_factory=dict)  # the entity's attributes (model, mode, label_names ...)


@dataclass(frozen=True)
class StreamedExport:
    """The small parts of an export kept in memory after a streamed pass over it."""

    header: ExportHeader
    ids: list[str]
    labels: np.ndarray | None
    digest: str  # hex SHA-256 of the canonical encoding (equal to what `sealed.read` computes)
    verified: bool  # the tag checked out against the key given
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # ``/<entity>/columns/<name>``, unchecked


def read_header(path: str | Path, entity: str | None = None) -> ExportHeader:
    """Attributes and shapes of one entity of an export; no array is read."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"embedding export {path} does not exist")
    try:
        stat = path.stat()
        with h5py.File(path, "r") as f:
            return _header(f, path, entity, stat.st_size, stat.st_mtime_ns)
    except (ExportError, sealed.SealError):
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise ExportError(f"{path} is not a readable HDF5 file ({sealed._brief(exc)})") from None


def _header(f: Any, path: Path, entity: str | None, size: int, mtime_ns: int) -> ExportHeader:
    import h5py

    budget = [0, sealed.MAX_ATTR_BYTES]
    fp = hashlib.sha256()
    root = sealed._read_attrs(f, "", budget, fp, path)
    if root.get("format") != FORMAT:
        raise ExportError(f"{path} is not an hpcfed embedding export (attribute format={root.get('format')!r})")
    groups = sorted(k for k in f if isinstance(f.get(k, getlink=True), h5py.HardLink) and isinstance(f[k], h5py.Group))
    if not groups:
        raise ExportError(f"{path} holds no embedding group")
    name = entity or groups[0]
    if name not in groups:
        raise ExportError(f"{path} has no entity {name!r}; it has: {', '.join(groups)}")
    if not ENTITY_NAME.fullmatch(name):
        raise ExportError(f"{path}: entity name {name!r} is not plain (letters, digits, . _ -)")
    group = f[name]
    attrs = sealed._read_attrs(group, name, budget, fp, path)
    shapes = {}
    for key in ("vectors", "ids"):
        link = group.get(key, getlink=True)
        if not isinstance(link, h5py.HardLink) or not isinstance(group[key], h5py.Dataset):
            raise ExportError(f"{path}: /{name}/{key} is missing")
        shapes[key] = tuple(int(s) for s in (group[key].shape or ()))
    vshape = shapes["vectors"]
    if len(vshape) != 2 or shapes["ids"] != (vshape[0],):
        raise ExportError(f"{path}: /{name}/vectors shape {vshape} does not match ids shape {shapes['ids']}")
    fp.update(json.dumps({"entity": name, "vectors": vshape}).encode())
    recorded = None
    if sealed.AUTH_ATTR in root:
        try:
            recorded = str(json.loads(str(root[sealed.AUTH_ATTR]))["digest"])
        except (ValueError, KeyError, TypeError):
            raise ExportError(f"{path}: malformed '{sealed.AUTH_ATTR}' attribute") from None
    return ExportHeader(path=path, entity=name, num_rows=vshape[0], dim=vshape[1],
                        format_version=_int(root.get("format_version"), path, "format_version"),
                        site=str(attrs.get("site", "")), recorded_digest=recorded, fingerprint=fp.hexdigest(),
                        size=size, mtime_ns=mtime_ns, attrs=dict(attrs))


def stream_export(path: str | Path, entity: str | None, auth: sealed.FileAuth | None, consume: Consumer, *,
                  block_bytes: int = BLOCK_BYTES, progress: Callable[[int], None] | None = None) -> StreamedExport:
    """One bounded pass over the whole export: `consume(first_row, block)` gets the entity's vectors
    (float32, rows in order), `progress(rows)` the rows done; the digest (and tag) are checked at the end."""
    import h5py

    header = read_header(path, entity)
    path = header.path
    target = f"{header.entity}/vectors"
    small = 1 << 31  # ids, labels and other small datasets are held whole; vectors never are
    walk = CanonicalWalk(path, memory=small, target=target, consume=consume, block_bytes=block_bytes,
                         progress=progress)
    try:
        with h5py.File(path, "r") as f:
            walk.group(f, "", 0)
        verified = check_tag(path, walk.auth_record, walk.digest.digest(), auth)
    except sealed.SealError as exc:
        raise ExportError(f"{exc}; re-export it" if "authentication" not in str(exc) else str(exc)) from None
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise ExportError(f"{path} is not a readable HDF5 file ({sealed._brief(exc)})") from None
    if target in walk.kept:
        raise ExportError(f"{path}: /{target} must be a 2-D float array")
    ids_raw = walk.kept.get(f"{header.entity}/ids")
    if ids_raw is None:
        raise ExportError(f"{path}: /{header.entity}/ids is missing")
    ids = [s.decode() if isinstance(s, bytes) else str(s) for s in ids_raw.reshape(-1)]
    labels = walk.kept.get(f"{header.entity}/labels")
    if walk.rows != header.num_rows or len(ids) != header.num_rows:
        raise ExportError(f"{path}: /{header.entity} has {walk.rows} vectors and {len(ids)} ids")
    if labels is not None and labels.shape != (len(ids),):
        raise ExportError(f"{path}: /{header.entity}/labels shape {labels.shape} does not match {len(ids)} ids")
    prefix = f"{header.entity}/columns/"
    columns = {key[len(prefix):]: value for key, value in walk.kept.items() if key.startswith(prefix)}
    return StreamedExport(header, ids, None if labels is None else labels.astype(np.int64), walk.digest.hexdigest(),
                          verified, columns)


def _int(value: object, path: Path, what: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ExportError(f"{path}: attribute {what}={value!r} is not an integer") from None
