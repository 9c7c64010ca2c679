"""sealed's canonical walk over an HDF5 state file, reading large datasets without extra copies.

`sealed.read` frames each dataset's bytes into the digest through copies (``tobytes``, then the
length prefix joined to them), three copies of every byte at once. For files of gigabytes (embedding
exports, search indexes) this walk computes the *same* digest with none: a dataset is hashed as the
array h5py read (the length prefix hashed on its own), either whole and kept (`read_verified`), or
block by block and handed to a consumer (`hpcfed.store.vectors.stream_export`). The hostile-input
rules are sealed's: no links, external or virtual datasets, only the usual filters and dtypes, no
dataset declaring more than its stored bytes can expand to, bounded object count, depth and memory.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.store import sealed

Consumer = Callable[[int, np.ndarray], None]
HASH_SLICE_BYTES = 4 << 20  # a kept dataset is read and hashed this much at a time (stays in cache)


@dataclass
class Verified:
    """A file read whole by `read_verified`: attributes and arrays by path ("" is the root)."""

    attrs: dict[str, dict[str, Any]]
    datasets: dict[str, np.ndarray]
    verified: bool  # the tag checked out against the key given


def read_verified(path: str | Path, auth: sealed.FileAuth | None, *, require_auth: bool = True,
                  max_bytes: int = 64 << 30) -> Verified:
    """`sealed.read` with one copy of each dataset: every array read, hashed in place, and kept."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise sealed.SealError(f"{path}: cannot read ({exc.strerror or exc})") from None
    walk = CanonicalWalk(path, memory=min(max_bytes, size * sealed._MAX_EXPANSION + sealed._FILL_ONLY_BYTES))
    _walk_file(walk)
    if walk.auth_record is None and require_auth:
        raise sealed.SealError(f"{path}: not authenticated (no '{sealed.AUTH_ATTR}' tag); refusing it")
    verified = check_tag(path, walk.auth_record, walk.digest.digest(), auth)
    return Verified(walk.attrs, walk.kept, verified)


def seal_streamed(path: str | Path, auth: sealed.FileAuth, *, block_bytes: int = 64 << 20) -> bytes:
    """`sealed.seal` in one bounded pass: datasets over `block_bytes` are hashed block by block and
    dropped (`sealed.seal` holds the whole file, in three copies); returns the canonical digest."""
    import h5py

    path = Path(path)
    with h5py.File(path, "r+") as f:
        if sealed.AUTH_ATTR in f.attrs:
            del f.attrs[sealed.AUTH_ATTR]
    size = path.stat().st_size
    walk = CanonicalWalk(path, memory=size * sealed._MAX_EXPANSION + sealed._FILL_ONLY_BYTES,
                         consume=lambda first, block: None, block_bytes=block_bytes)  # no target: hash only
    _walk_file(walk)
    digest = walk.digest.digest()
    sealed.write_tag(path, auth, digest)
    return digest


def _walk_file(walk: CanonicalWalk) -> None:
    """Walk the whole file; anything HDF5 or numpy raises becomes a `SealError` naming the file."""
    import h5py

    try:
        with h5py.File(walk.path, "r") as f:
            walk.group(f, "", 0)
    except sealed.SealError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise sealed.SealError(f"{walk.path} is not a readable HDF5 file ({sealed._brief(exc)})") from None
    except MemoryError:
        raise sealed.SealError(f"{walk.path}: declares more data than fits in memory; refusing it") from None


def check_tag(path: Path, record: str | None, digest: bytes, auth: sealed.FileAuth | None) -> bool:
    """sealed.read's rule: a recorded digest must match; with a key, the tag must verify."""
    if record is None:
        return False
    try:
        info = json.loads(record)
        alg, tag, purpose, recorded = str(info["alg"]), str(info["tag"]), str(info["purpose"]), str(info["digest"])
    except (ValueError, KeyError, TypeError):
        raise sealed.SealError(f"{path}: malformed '{sealed.AUTH_ATTR}' attribute") from None
    if not hmac.compare_digest(recorded, digest.hex()):
        raise sealed.SealError(f"{path}: checksum mismatch (the file is corrupt or was modified)")
    if auth is None:
        return False
    if alg != auth.alg or purpose != auth.purpose or not auth.check(digest, tag):
        raise sealed.SealError(f"{path}: authentication failed (edited, or written with another key/job); "
                               f"refusing it")
    return True


class CanonicalWalk:
    """One pass in sealed's order. Numeric datasets are read whole and kept, except `target` and any
    larger than `block_bytes` when `consume` is given: those are read in blocks (target's to `consume`)."""

    def __init__(self, path: Path, *, memory: int, target: str | None = None, consume: Consumer | None = None,
                 block_bytes: int = 64 << 20, progress: Callable[[int], None] | None = None) -> None:
        self.path, self.target, self.consume = path, target, consume
        self.block_bytes, self.progress = max(1, block_bytes), progress
        self.digest = hashlib.sha256()
        self.count = 0
        self.budget = [0, sealed.MAX_ATTR_BYTES]
        self.memory = memory  # bytes of arrays that may be kept in memory at once
        self.auth_record: str | None = None
        self.attrs: dict[str, dict[str, Any]] = {}
        self.kept: dict[str, np.ndarray] = {}
        self.rows = 0

    def group(self, obj: Any, name: str, depth: int) -> None:
        """Walk a group: its attributes, then its members in sorted order."""
        import h5py

        if depth > sealed.MAX_DEPTH:
            raise sealed.SealError(f"{self.path}: groups nested deeper than {sealed.MAX_DEPTH} at /{name}")
        self._count()
        sealed._frame(self.digest, b"G" + name.encode())
        attrs = sealed._read_attrs(obj, name, self.budget, self.digest, self.path)
        if name == "" and sealed.AUTH_ATTR in attrs:
            self.auth_record = str(attrs.pop(sealed.AUTH_ATTR))
        self.attrs[name] = attrs
        for key in sorted(obj.keys()):
            child = f"{name}/{key}" if name else key
            link = obj.get(key, getlink=True)
            if not isinstance(link, h5py.HardLink):
                raise sealed.SealError(f"{self.path}: /{child} is a {type(link).__name__}; links are not allowed")
            item = obj.get(key)
            if isinstance(item, h5py.Group):
                self.group(item, child, depth + 1)
            elif isinstance(item, h5py.Dataset):
                self._count()
                sealed._frame(self.digest, b"D" + child.encode())
                self.attrs[child] = sealed._read_attrs(item, child, self.budget, self.digest, self.path)
                self.dataset(item, child)
            else:
                raise sealed.SealError(f"{self.path}: /{child} is a {type(item).__name__}; not allowed")

    def dataset(self, ds: Any, name: str) -> None:
        """Hash one dataset exactly as sealed does; keep it, or stream it."""
        shape, dtype, strings = _checked(ds, name, self.path)
        if strings:
            budget = [self.memory, sealed.MAX_ATTR_BYTES]
            self.kept[name] = sealed._read_dataset(ds, name, budget, self.digest, self.path)
            self.memory = budget[0]
            return
        nbytes = _nbytes(shape, dtype)
        if name == self.target and (len(shape) != 2 or dtype.kind not in "fiu"):
            raise sealed.SealError(f"{self.path}: /{name} must be a 2-D float array, not {dtype} {shape}")
        streamed = self.consume is not None and len(shape) >= 1 and (name == self.target or nbytes > self.block_bytes)
        le = dtype.newbyteorder("<")
        sealed._frame(self.digest, f"{le.str}|{tuple(shape)}".encode())
        self.digest.update(nbytes.to_bytes(8, "little"))
        if not streamed:
            self.memory -= nbytes
            if self.memory < 0:
                raise sealed.SealError(f"{self.path}: /{name}: the file's arrays exceed the memory budget")
            self.kept[name] = self._read_hashed(ds, shape, le)
            return
        self._stream(ds, name, shape, dtype, le)

    def _read_hashed(self, ds: Any, shape: tuple[int, ...], le: np.dtype[Any]) -> np.ndarray:
        """Read a kept dataset into its array a slice of rows at a time, hashing each slice as it lands:
        the bytes are hashed while still in cache, not in a second pass over the whole array."""
        arr = np.empty(shape, le)
        if arr.ndim == 0 or arr.size == 0:
            arr[...] = ds[()]
        else:
            step = max(1, HASH_SLICE_BYTES // max(1, arr[0].nbytes))
            for start in range(0, shape[0], step):
                rows = np.s_[start:start + step]
                ds.read_direct(arr, rows, rows)
                self.digest.update(arr[rows].reshape(-1).view(np.uint8).data)
            return arr
        self.digest.update(arr.reshape(-1).view(np.uint8).data)
        return arr

    def _stream(self, ds: Any, name: str, shape: tuple[int, ...], dtype: np.dtype[Any], le: np.dtype[Any]) -> None:
        row_bytes = max(1, _nbytes(shape[1:], dtype))
        step = max(1, self.block_bytes // row_bytes)
        chunks = ds.chunks[0] if ds.chunks else 1
        step = max(chunks, step - step % chunks)  # whole HDF5 chunks: each is decompressed once
        for start in range(0, shape[0], step):
            block = np.ascontiguousarray(np.asarray(ds[start:start + step]).astype(le, copy=False))
            if block.shape[1:] != shape[1:]:
                raise sealed.SealError(f"{self.path}: /{name} changed while it was read")
            self.digest.update(block.reshape(-1).view(np.uint8).data)
            if name == self.target and self.consume is not None:
                self.consume(start, block.astype(np.float32, copy=False))
                self.rows += len(block)
                if self.progress is not None:
                    self.progress(len(block))

    def _count(self) -> None:
        self.count += 1
        if self.count > sealed.MAX_OBJECTS:
            raise sealed.SealError(f"{self.path}: more than {sealed.MAX_OBJECTS} objects")


def _checked(ds: Any, name: str, path: Path) -> tuple[tuple[int, ...], np.dtype[Any], bool]:
    """sealed's dataset rules, applied before anything is read."""
    import h5py

    if ds.is_virtual:
        raise sealed.SealError(f"{path}: /{name} is a virtual dataset; not allowed")
    if ds.external:
        raise sealed.SealError(f"{path}: /{name} uses external storage; not allowed")
    plist = ds.id.get_create_plist()
    filters = plist.get_nfilters()
    for i in range(filters):
        fid = plist.get_filter(i)[0]
        if fid not in sealed._ALLOWED_FILTERS:
            raise sealed.SealError(f"{path}: /{name} uses HDF5 filter {fid}; "
                                   f"only gzip/shuffle/fletcher32/lzf are allowed")
    if ds.shape is None:
        raise sealed.SealError(f"{path}: /{name} has a null dataspace")
    shape = tuple(int(s) for s in ds.shape)
    dtype = np.dtype(ds.dtype)
    strings = h5py.check_string_dtype(dtype) is not None and dtype.kind == "O"
    if not strings and dtype.kind not in sealed._KINDS and dtype.kind != "S":
        raise sealed.SealError(f"{path}: /{name} has unsupported dtype {dtype}")
    declared = _nbytes(shape, np.dtype("V16") if strings else dtype)
    stored = int(ds.id.get_storage_size())
    if declared > stored * (sealed._MAX_EXPANSION if filters else 1) + sealed._FILL_ONLY_BYTES:
        raise sealed.SealError(f"{path}: /{name} declares {shape} {dtype} ({declared} bytes) but the file stores "
                          f"{stored}; refusing it (corrupt or hostile)")
    return shape, dtype, strings


def _nbytes(shape: tuple[int, ...], dtype: np.dtype[Any]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize
