"""Authenticated, bounded HDF5 state files (checkpoints, manifests, site shards, exports).

Anyone who can write a run directory must not be able to make a resumed job train from a model
they chose. So a state file carries a tag (file attribute ``auth``) over a canonical encoding of
*everything* in it — every group, dataset, attribute, in sorted path order, with dtypes, shapes and
bytes — made with a key the run directory does not hold:

- ``hmac-sha256``: HMAC keyed by HKDF-SHA256(job PSK, info="hpcfed state file v1/<purpose>"), so a
  checkpoint key is never a message key and a site shard is never taken for a manifest;
- ``ed25519``: in ``security.mode: keys`` the writer signs the canonical digest with its identity key.

Reading is hostile-input safe before anything is allocated: soft/external links, external storage,
virtual datasets, committed datatypes and unknown filters are refused; every dataset's declared size
is bounded by the bytes the file really stores (and an overall budget) before it is read; object
count and depth are bounded. A file is read once into memory, verified, and only then interpreted,
so what is used is exactly what was verified.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

AUTH_ATTR = "auth"
MAX_OBJECTS = 200_000
MAX_DEPTH = 32
MAX_ATTR_BYTES = 64 << 20  # sum over all attributes (configs, JSON headers)
MAX_STRING_ELEMENTS = 50_000_000
# gzip cannot expand more than ~1032:1; a chunked dataset declaring more than this many times the
# bytes it stores is a lie (or a bomb) and is refused before reading.
_MAX_EXPANSION = 1100
_FILL_ONLY_BYTES = 1 << 20  # an unwritten dataset may declare at most this much (fill value)
_ALLOWED_FILTERS = {1, 2, 3, 32000}  # deflate, shuffle, fletcher32, lzf
_KINDS = set("biuf")


class SealError(ValueError):
    """A state file is unreadable, hostile, oversize or fails authentication."""


@dataclass
class FileAuth:
    """How state files of one purpose are tagged and checked; `verify_only` holds just a public key."""

    purpose: str
    alg: str  # "hmac-sha256" | "ed25519"
    _key: bytes | None = field(default=None, repr=False)
    _private: Any = field(default=None, repr=False)
    _public: Any = field(default=None, repr=False)

    @classmethod
    def from_psk(cls, psk: bytes, purpose: str) -> FileAuth:
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF

        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                   info=b"hpcfed state file v1/" + purpose.encode()).derive(psk)
        return cls(purpose=purpose, alg="hmac-sha256", _key=key)

    @classmethod
    def from_identity(cls, identity: Any, purpose: str) -> FileAuth:
        return cls(purpose=purpose, alg="ed25519", _private=identity, _public=identity.public_key())

    @classmethod
    def from_public_key(cls, public: Any, purpose: str) -> FileAuth:
        return cls(purpose=purpose, alg="ed25519", _public=public)

    def for_purpose(self, purpose: str) -> FileAuth:
        """The same key material for another purpose (re-derived for HMAC)."""
        if self.alg == "ed25519":
            return FileAuth(purpose=purpose, alg=self.alg, _private=self._private, _public=self._public)
        raise SealError("derive HMAC file keys with FileAuth.from_psk")

    def tag(self, digest: bytes) -> str:
        msg = self._message(digest)
        if self.alg == "hmac-sha256":
            return hmac.new(self._hmac_key(), msg, hashlib.sha256).hexdigest()
        if self._private is None:
            raise SealError("this key can only verify, not sign")
        signature: bytes = self._private.sign(msg)
        return signature.hex()

    def check(self, digest: bytes, tag: str) -> bool:
        msg = self._message(digest)
        if self.alg == "hmac-sha256":
            return hmac.compare_digest(hmac.new(self._hmac_key(), msg, hashlib.sha256).hexdigest(), tag)
        try:
            self._public.verify(bytes.fromhex(tag), msg)
            return True
        except Exception:  # InvalidSignature or a malformed tag: both mean "not authentic"
            return False

    def _hmac_key(self) -> bytes:
        if self._key is None:  # only `from_psk` makes an HMAC FileAuth, and it always sets the key
            raise SealError(f"no HMAC key for {self.purpose} files; derive it with FileAuth.from_psk")
        return self._key

    def _message(self, digest: bytes) -> bytes:
        return b"hpcfed state file v1\0" + self.purpose.encode() + b"\0" + digest


@dataclass
class Tree:
    """A verified (or bounded-but-unverified) file: attributes and arrays by path ("" is the root)."""

    path: Path
    attrs: dict[str, dict[str, Any]]  # object path -> {attr name: value}
    datasets: dict[str, np.ndarray]  # dataset path -> array
    groups: list[str]
    digest: bytes  # SHA-256 of the canonical encoding
    verified: bool  # the tag checked out against the key given
    signed_alg: str | None  # the algorithm named in the file's tag, if any

    def children(self, group: str) -> list[str]:
        prefix = f"{group}/" if group else ""
        names = {p[len(prefix):].split("/", 1)[0] for p in (*self.datasets, *self.groups)
                 if p.startswith(prefix) and p != group}
        return sorted(n for n in names if n)


def read(path: str | Path, auth: FileAuth | None, *, max_bytes: int = 64 << 30,
         require_auth: bool = True) -> Tree:
    """Read a whole state file with every bound checked; verify its tag when `auth` is given.

    A wrong tag is always an error, and so is a missing one with `require_auth`. Without a key the
    recorded digest still catches corruption, and the tree comes back with ``verified=False`` (for
    `hpcfed inspect`/`search` run without the job key)."""
    import h5py

    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise SealError(f"{path}: cannot read ({exc.strerror or exc})") from None
    budget = [max(0, min(max_bytes, size * _MAX_EXPANSION + _FILL_ONLY_BYTES)), MAX_ATTR_BYTES]
    try:
        with h5py.File(path, "r") as f:
            attrs: dict[str, dict[str, Any]] = {}
            datasets: dict[str, np.ndarray] = {}
            groups: list[str] = []
            digest = hashlib.sha256()
            _walk(f, "", 0, [0], budget, attrs, datasets, groups, digest, path)
    except SealError:
        raise
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise SealError(f"{path} is not a readable HDF5 file ({_brief(exc)})") from None
    except MemoryError:
        raise SealError(f"{path}: declares more data than fits in memory; refusing it") from None
    stored = attrs.get("", {}).pop(AUTH_ATTR, None)
    signed_alg, verified = None, False
    if stored is not None:
        try:
            info = json.loads(stored)
            signed_alg, tag, purpose = str(info["alg"]), str(info["tag"]), str(info["purpose"])
            recorded = str(info["digest"])
        except (ValueError, KeyError, TypeError):
            raise SealError(f"{path}: malformed '{AUTH_ATTR}' attribute") from None
        if not hmac.compare_digest(recorded, digest.hexdigest()):
            # Without the key this still catches corruption (a torn or bit-flipped file).
            raise SealError(f"{path}: checksum mismatch (the file is corrupt or was modified)")
        if auth is not None:
            if signed_alg != auth.alg or purpose != auth.purpose or not auth.check(digest.digest(), tag):
                raise SealError(f"{path}: authentication failed (edited, or written with another key/job); "
                                f"refusing it")
            verified = True
    elif require_auth:
        raise SealError(f"{path}: not authenticated (no '{AUTH_ATTR}' tag); refusing it")
    return Tree(path=path, attrs=attrs, datasets=datasets, groups=groups, digest=digest.digest(),
                verified=verified, signed_alg=signed_alg)


def seal(path: str | Path, auth: FileAuth) -> bytes:
    """Tag an HDF5 file written by us (still at its temporary path); returns its canonical digest."""
    import h5py

    path = Path(path)
    with h5py.File(path, "r+") as f:
        if AUTH_ATTR in f.attrs:
            del f.attrs[AUTH_ATTR]
    tree = read(path, None, require_auth=False)
    write_tag(path, auth, tree.digest)
    return tree.digest


def write_tag(path: str | Path, auth: FileAuth, digest: bytes) -> None:
    """Record the canonical digest of a file written by us, and its tag, in the ``auth`` attribute."""
    import h5py

    with h5py.File(path, "r+") as f:
        f.attrs[AUTH_ATTR] = json.dumps({"alg": auth.alg, "purpose": auth.purpose, "digest": digest.hex(),
                                         "tag": auth.tag(digest)}, sort_keys=True)


# ----------------------------------------------------------------------------------------------


def _walk(obj: Any, name: str, depth: int, count: list[int], budget: list[int], attrs: dict[str, dict[str, Any]],
          datasets: dict[str, np.ndarray], groups: list[str], digest: Any, path: Path) -> None:
    import h5py

    if depth > MAX_DEPTH:
        raise SealError(f"{path}: groups nested deeper than {MAX_DEPTH} at /{name}")
    count[0] += 1
    if count[0] > MAX_OBJECTS:
        raise SealError(f"{path}: more than {MAX_OBJECTS} objects")
    _frame(digest, b"G" + name.encode())
    attrs[name] = _read_attrs(obj, name, budget, digest, path)
    groups.append(name)
    for key in sorted(obj.keys()):
        child = f"{name}/{key}" if name else key
        link = obj.get(key, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise SealError(f"{path}: /{child} is a {type(link).__name__}; links are not allowed in state files")
        item = obj.get(key)
        if isinstance(item, h5py.Group):
            _walk(item, child, depth + 1, count, budget, attrs, datasets, groups, digest, path)
        elif isinstance(item, h5py.Dataset):
            count[0] += 1
            if count[0] > MAX_OBJECTS:
                raise SealError(f"{path}: more than {MAX_OBJECTS} objects")
            _frame(digest, b"D" + child.encode())
            attrs[child] = _read_attrs(item, child, budget, digest, path)
            datasets[child] = _read_dataset(item, child, budget, digest, path)
        else:
            raise SealError(f"{path}: /{child} is a {type(item).__name__}; not allowed in state files")


def _read_dataset(ds: Any, name: str, budget: list[int], digest: Any, path: Path) -> np.ndarray:
    import h5py

    if ds.is_virtual:
        raise SealError(f"{path}: /{name} is a virtual dataset; not allowed in state files")
    if ds.external:
        raise SealError(f"{path}: /{name} uses external storage; not allowed in state files")
    plist = ds.id.get_create_plist()
    for i in range(plist.get_nfilters()):
        fid = plist.get_filter(i)[0]
        if fid not in _ALLOWED_FILTERS:
            raise SealError(f"{path}: /{name} uses HDF5 filter {fid}; only gzip/shuffle/fletcher32/lzf are allowed")
    dtype, shape = ds.dtype, ds.shape
    if shape is None:
        raise SealError(f"{path}: /{name} has a null dataspace")
    n = int(np.prod(shape, dtype=np.float64)) if shape else 1
    strings = h5py.check_string_dtype(dtype) is not None and dtype.kind == "O"
    if not strings and dtype.kind not in _KINDS and dtype.kind != "S":
        raise SealError(f"{path}: /{name} has unsupported dtype {dtype}")
    declared = n * (16 if strings else dtype.itemsize)
    stored = int(ds.id.get_storage_size())
    limit = stored * (_MAX_EXPANSION if plist.get_nfilters() else 1) + _FILL_ONLY_BYTES
    if declared > limit or declared > budget[0] or (strings and n > MAX_STRING_ELEMENTS):
        raise SealError(f"{path}: /{name} declares {shape} {dtype} ({declared} bytes) but the file stores "
                        f"{stored}; refusing it (corrupt or hostile)")
    budget[0] -= declared
    if strings:
        raw = ds.asstr()[()]
        arr = np.array(raw, dtype=object)
        data = b"".join(_frame_bytes(str(s).encode()) for s in arr.reshape(-1))
        budget[0] -= len(data)
        if budget[0] < 0:
            raise SealError(f"{path}: /{name}: strings exceed the size budget")
    else:
        arr = np.asarray(ds[()])
        data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
    _frame(digest, f"{'str' if strings else arr.dtype.newbyteorder('<').str}|{tuple(shape)}".encode())
    _frame(digest, data)
    return arr


def _read_attrs(obj: Any, name: str, budget: list[int], digest: Any, path: Path) -> dict[str, Any]:
    import h5py

    out: dict[str, Any] = {}
    for key in sorted(obj.attrs.keys()):
        aid = h5py.h5a.open(obj.id, key.encode())
        space, dtype = aid.shape, aid.dtype
        n = int(np.prod(space, dtype=np.float64)) if space else 1
        if dtype.kind not in _KINDS and dtype.kind not in "SOU":
            raise SealError(f"{path}: attribute {key!r} of /{name} has unsupported dtype {dtype}")
        declared = n * max(16, dtype.itemsize)
        budget[1] -= declared
        if budget[1] < 0:
            raise SealError(f"{path}: attributes of /{name} declare more than {MAX_ATTR_BYTES} bytes")
        value = obj.attrs[key]
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if name == "" and key == AUTH_ATTR:
            out[key] = value
            continue
        _frame(digest, b"A" + key.encode())
        if isinstance(value, str):
            _frame(digest, b"str")
            _frame(digest, value.encode())
        else:
            arr = np.asarray(value)
            if arr.dtype.kind == "O":
                _frame(digest, b"strs" + str(arr.shape).encode())
                for s in arr.reshape(-1):
                    _frame(digest, (s.decode() if isinstance(s, bytes) else str(s)).encode())
            else:
                le = arr.dtype.newbyteorder("<")
                _frame(digest, f"{le.str}|{arr.shape}".encode())
                _frame(digest, np.ascontiguousarray(arr).astype(le, copy=False).tobytes())
        out[key] = value.item() if isinstance(value, np.generic) else value
    return out


def _frame(digest: Any, data: bytes) -> None:
    digest.update(_frame_bytes(data))


def _frame_bytes(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data


def _brief(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
