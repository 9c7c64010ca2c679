"""One entity of an embedding export, streamed in bounded blocks and verified as a whole.

`sealed.read` holds a whole file in memory, which a million 384-d vectors (1.5 GB) should not need.
`stream_export` walks the file in the same canonical order and encoding as `sealed`, so it computes
the same digest, but reads every large numeric dataset in blocks of at most ``block_bytes`` and hands
the chosen entity's vector blocks to a consumer as they are hashed. At the end the digest is checked
against the file's ``auth`` record (and its tag against the key, when one is given); a caller must
treat what it consumed as unverified until `stream_export` returns. The hostile-input bounds are
sealed's: no links, external or virtual datasets, only the usual filters and dtypes, and no dataset
declaring more than its stored bytes can expand to.

`read_header` is the cheap look: attributes and shapes only, no array data.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.store import sealed
from hpcfed.store.embeddings import FORMAT, ExportError

BLOCK_BYTES = 64 << 20  # default read budget: the export is read 64 MiB of vectors at a time
ENTITY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

Consumer = Callable[[int, np.ndarray], None]


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


@dataclass(frozen=True)
class StreamedExport:
    """The small parts of an export kept in memory after a streamed pass over it."""

    header: ExportHeader
    ids: list[str]
    labels: np.ndarray | None
    digest: str  # hex SHA-256 of the canonical encoding (equal to what `sealed.read` computes)
    verified: bool  # the tag checked out against the key given


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
                        size=size, mtime_ns=mtime_ns)


def stream_export(path: str | Path, entity: str | None, auth: sealed.FileAuth | None, consume: Consumer, *,
                  block_bytes: int = BLOCK_BYTES, progress: Callable[[int], None] | None = None) -> StreamedExport:
    """One bounded pass over the whole export: `consume(first_row, block)` gets the entity's vectors
    (float32, rows in order), `progress(rows)` the rows done; the digest (and tag) are checked at the end."""
    import h5py

    header = read_header(path, entity)
    path = header.path
    state = _Walk(path, f"{header.entity}/vectors", consume, max(1, block_bytes), progress)
    try:
        with h5py.File(path, "r") as f:
            state.group(f, "", 0)
    except (ExportError, sealed.SealError):
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise ExportError(f"{path} is not a readable HDF5 file ({sealed._brief(exc)})") from None
    verified = _check_tag(path, state.auth_record, state.digest.digest(), auth)
    ids_raw = state.kept.get(f"{header.entity}/ids")
    if ids_raw is None:
        raise ExportError(f"{path}: /{header.entity}/ids is missing")
    ids = [s.decode() if isinstance(s, bytes) else str(s) for s in ids_raw.reshape(-1)]
    labels = state.kept.get(f"{header.entity}/labels")
    if state.rows != header.num_rows or len(ids) != header.num_rows:
        raise ExportError(f"{path}: /{header.entity} has {state.rows} vectors and {len(ids)} ids")
    if labels is not None and labels.shape != (len(ids),):
        raise ExportError(f"{path}: /{header.entity}/labels shape {labels.shape} does not match {len(ids)} ids")
    return StreamedExport(header, ids, None if labels is None else labels.astype(np.int64), state.digest.hexdigest(),
                          verified)


def _check_tag(path: Path, record: str | None, digest: bytes, auth: sealed.FileAuth | None) -> bool:
    """sealed.read's rule: a recorded digest must match; with a key, the tag must verify."""
    import hmac

    if record is None:
        return False
    try:
        info = json.loads(record)
        alg, tag, purpose, recorded = str(info["alg"]), str(info["tag"]), str(info["purpose"]), str(info["digest"])
    except (ValueError, KeyError, TypeError):
        raise ExportError(f"{path}: malformed '{sealed.AUTH_ATTR}' attribute") from None
    if not hmac.compare_digest(recorded, digest.hex()):
        raise ExportError(f"{path}: checksum mismatch (the file is corrupt or was modified); re-export it")
    if auth is None:
        return False
    if alg != auth.alg or purpose != auth.purpose or not auth.check(digest, tag):
        raise ExportError(f"{path}: authentication failed (edited, or written with another key/job); refusing it")
    return True


class _Walk:
    """The state of one pass: sealed's canonical walk, with large datasets hashed block by block."""

    def __init__(self, path: Path, target: str, consume: Consumer, block_bytes: int,
                 progress: Callable[[int], None] | None) -> None:
        self.path, self.target, self.consume = path, target, consume
        self.block_bytes, self.progress = block_bytes, progress
        self.digest = hashlib.sha256()
        self.count = [0]
        self.budget = [0, sealed.MAX_ATTR_BYTES]
        self.auth_record: str | None = None
        self.kept: dict[str, np.ndarray] = {}
        self.rows = 0
        self.small_budget = [1 << 31]  # strings and other small datasets held in memory at once (ids, labels)

    def group(self, obj: Any, name: str, depth: int) -> None:
        import h5py

        if depth > sealed.MAX_DEPTH:
            raise ExportError(f"{self.path}: groups nested deeper than {sealed.MAX_DEPTH} at /{name}")
        self._count()
        sealed._frame(self.digest, b"G" + name.encode())
        attrs = sealed._read_attrs(obj, name, self.budget, self.digest, self.path)
        if name == "" and sealed.AUTH_ATTR in attrs:
            self.auth_record = str(attrs[sealed.AUTH_ATTR])
        for key in sorted(obj.keys()):
            child = f"{name}/{key}" if name else key
            link = obj.get(key, getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise ExportError(f"{self.path}: /{child} is a {type(link).__name__}; links are not allowed in exports")
            item = obj.get(key)
            if isinstance(item, h5py.Group):
                self.group(item, child, depth + 1)
            elif isinstance(item, h5py.Dataset):
                self._count()
                sealed._frame(self.digest, b"D" + child.encode())
                sealed._read_attrs(item, child, self.budget, self.digest, self.path)
                self.dataset(item, child)
            else:
                raise ExportError(f"{self.path}: /{child} is a {type(item).__name__}; not allowed in exports")

    def dataset(self, ds: Any, name: str) -> None:
        shape, dtype, strings = _checked(ds, name, self.path)
        streamed = not strings and len(shape) >= 1 and (name == self.target or _nbytes(shape, dtype) > self.block_bytes)
        if not streamed:
            budget = [self.small_budget[0], sealed.MAX_ATTR_BYTES]
            arr = sealed._read_dataset(ds, name, budget, self.digest, self.path)
            self.small_budget[0] = budget[0]
            if name == self.target:
                raise ExportError(f"{self.path}: /{name} must be a 2-D float array")
            self.kept[name] = arr
            return
        if name == self.target and (len(shape) != 2 or dtype.kind not in "fiu"):
            raise ExportError(f"{self.path}: /{name} must be a 2-D float array, not {dtype} {shape}")
        le = dtype.newbyteorder("<")
        sealed._frame(self.digest, f"{le.str}|{tuple(shape)}".encode())
        self.digest.update(_nbytes(shape, dtype).to_bytes(8, "little"))
        row_bytes = max(1, _nbytes(shape[1:], dtype))
        step = max(1, self.block_bytes // row_bytes)
        chunks = ds.chunks[0] if ds.chunks else 1
        step = max(chunks, step - step % chunks)  # whole HDF5 chunks: each is decompressed once
        for start in range(0, shape[0], step):
            block = np.asarray(ds[start:start + step])
            if block.dtype != dtype or block.shape[1:] != shape[1:]:
                raise ExportError(f"{self.path}: /{name} changed while it was read")
            self.digest.update(np.ascontiguousarray(block).astype(le, copy=False).tobytes())
            if name == self.target:
                self.consume(start, block.astype(np.float32, copy=False))
                self.rows += len(block)
                if self.progress is not None:
                    self.progress(len(block))

    def _count(self) -> None:
        self.count[0] += 1
        if self.count[0] > sealed.MAX_OBJECTS:
            raise ExportError(f"{self.path}: more than {sealed.MAX_OBJECTS} objects")


def _checked(ds: Any, name: str, path: Path) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
    """sealed's dataset rules, applied before anything is read."""
    import h5py

    if ds.is_virtual:
        raise ExportError(f"{path}: /{name} is a virtual dataset; not allowed in exports")
    if ds.external:
        raise ExportError(f"{path}: /{name} uses external storage; not allowed in exports")
    plist = ds.id.get_create_plist()
    filters = plist.get_nfilters()
    for i in range(filters):
        fid = plist.get_filter(i)[0]
        if fid not in sealed._ALLOWED_FILTERS:
            raise ExportError(f"{path}: /{name} uses HDF5 filter {fid}; only gzip/shuffle/fletcher32/lzf are allowed")
    if ds.shape is None:
        raise ExportError(f"{path}: /{name} has a null dataspace")
    shape = tuple(int(s) for s in ds.shape)
    dtype = np.dtype(ds.dtype)
    strings = h5py.check_string_dtype(dtype) is not None and dtype.kind == "O"
    if not strings and dtype.kind not in sealed._KINDS and dtype.kind != "S":
        raise ExportError(f"{path}: /{name} has unsupported dtype {dtype}")
    declared = _nbytes(shape, np.dtype("V16") if strings else dtype)
    stored = int(ds.id.get_storage_size())
    if declared > stored * (sealed._MAX_EXPANSION if filters else 1) + sealed._FILL_ONLY_BYTES:
        raise ExportError(f"{path}: /{name} declares {shape} {dtype} ({declared} bytes) but the file stores "
                          f"{stored}; refusing it (corrupt or hostile)")
    return shape, dtype, strings


def _nbytes(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _int(value: object, path: Path, what: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ExportError(f"{path}: attribute {what}={value!r} is not an integer") from None
