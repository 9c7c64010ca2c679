"""A bundle (small JSON header + named ndarrays) <-> bytes. No pickle, strict decoder.

Layout (all integers little-endian; offsets count from the first byte of the bundle)::

    offset  size  field
    0       4     magic b"HPCW"
    4       1     format version (1)
    5       1     flags (0; reserved)
    6       2     reserved (0)
    8       4     header_len: bytes of the UTF-8 JSON header
    12      4     num_tensors
    16      8     data_offset: where tensor data begins (multiple of 64)
    24      8     total_len: length of the whole bundle in bytes
    32      H     header: UTF-8 JSON object, then zero padding to a multiple of 8
    ..            tensor table, one entry per tensor, each a multiple of 8 bytes:
                    2  name_len        1  dtype code       1  ndim
                    4  reserved (0)    8  offset           8  nbytes
                    8*ndim shape       name_len  UTF-8 name, zero padding to 8
    ..            zero padding up to data_offset
    data_offset   tensor data in table order; each tensor starts at the next multiple of 64
                  after the end of the previous one (zero padding between); total_len is the end
                  of the last tensor (or data_offset when there are none).

The layout is canonical: the decoder recomputes every offset and requires the stored one to be
equal, so one bundle has exactly one encoding. Every length, offset, dtype, shape and name is
checked against `WireLimits` and the buffer *before* any tensor byte is touched; any malformed
input raises `WireError` (a `ValueError`) that says what and where, and nothing else: every
dimension (also of an empty tensor) is at most `max_total_bytes` and so is the product of the
non-zero ones; header numbers must be int64 integers or finite float64 values (a 10**400 or a
NaN/Infinity literal is refused while parsing, so nothing downstream can overflow on them); header
strings are bounded by `max_header_bytes` and nesting by `max_header_depth`.

Dtypes (`DTYPES`, and bfloat16): bool, int8/16/32/64, uint8/16/32/64, float16, bfloat16, float32,
float64, little-endian only. Big-endian input arrays are converted to little-endian on encode.
bfloat16 is `ml_dtypes.bfloat16` (the numpy dtype JAX and torch interop use; code 11), so a bf16
tensor travels in 2 bytes per value and decodes to a bf16 array. ml_dtypes is imported only when
a bf16 tensor is met (`bfloat16`): the import costs about 0.7 s of CPU, paid by every rank of
every run although most never carry bf16, and no bf16 array can exist before it is imported.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcfed.comm import bounded_json

MAGIC = b"HPCW"
VERSION = 1
ALIGN = 64  # tensor data alignment: enough for any dtype and for SIMD loads

_PRE = struct.Struct("<4sBBHIIQQ")  # 32 bytes
_ENT = struct.Struct("<HBBIQQ")  # 24 bytes + 8*ndim + name

DTYPES: dict[int, np.dtype] = {
    1: np.dtype("?"),
    2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"), 5: np.dtype("<i8"),
    6: np.dtype("<u1"), 7: np.dtype("<u2"), 8: np.dtype("<u4"), 9: np.dtype("<u8"),
    10: np.dtype("<f2"), 12: np.dtype("<f4"), 13: np.dtype("<f8"),
}
BFLOAT16_CODE = 11  # not in DTYPES: its dtype comes from ml_dtypes, imported on first use
# Keyed by the dtype itself, not its `.str`: bfloat16's is "<V2", which any 2-byte void shares.
_CODE = {dt: code for code, dt in DTYPES.items()}
_ZEROS = memoryview(bytes(ALIGN))
_FAST = frozenset(DTYPES.values()) if sys.byteorder == "little" else frozenset()


def bfloat16() -> np.dtype:
    """The numpy dtype `ml_dtypes.bfloat16` (imports ml_dtypes)."""
    import ml_dtypes

    dtype: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dtype


def loaded_bfloat16() -> np.dtype | None:
    """bfloat16's dtype when ml_dtypes is imported already, else None: until then no array can
    have that dtype, so nothing needs the 0.7 s import to tell a bf16 array from another."""
    return bfloat16() if "ml_dtypes" in sys.modules else None


def _code(dt: np.dtype) -> int | None:
    """The wire's code for `dt` (little-endian already), or None when the wire does not carry it."""
    code = _CODE.get(dt)
    if code is None and (bf16 := loaded_bfloat16()) is not None and dt == bf16:
        return BFLOAT16_CODE
    return code


class WireError(ValueError):
    """A bundle could not be encoded or decoded; the message says what was wrong and where."""


@dataclass(frozen=True)
class WireLimits:
    """Upper bounds the decoder enforces before allocating or touching anything."""

    max_header_bytes: int = 1 << 20
    max_tensors: int = 100_000
    max_ndim: int = 32
    max_total_bytes: int = 8 << 30
    max_name_bytes: int = 1024
    max_header_depth: int = 32


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


# -- header (the JSON rules are `bounded_json`'s) ----------------------------------------------
def _encode_header(header: dict[str, Any], limits: WireLimits) -> bytes:
    if not isinstance(header, dict):
        raise WireError(f"the header must be a dict, got {type(header).__name__}")
    try:
        text = bounded_json.dumps(header, limits.max_header_depth)
    except bounded_json.JSONBoundError as exc:
        raise WireError(str(exc)) from None
    if len(text) > limits.max_header_bytes:
        raise WireError(f"header is {len(text)} bytes as JSON; the limit is {limits.max_header_bytes}")
    return text


# -- encoding -------------------------------------------------------------------------------------
def _as_wire_array(name: Any, value: Any) -> np.ndarray:
    if not isinstance(name, str):
        raise WireError(f"tensor name {name!r} is {type(name).__name__}; names must be str")
    try:
        arr = np.asarray(value)
    except Exception as exc:
        raise WireError(f"tensor {name!r} cannot be viewed as an array: {exc}") from None
    dt = arr.dtype
    if dt in _FAST:  # native little-endian whitelisted dtype: the common case
        return arr if arr.flags.c_contiguous else arr.copy(order="C")
    if dt.byteorder == ">" or (dt.byteorder == "=" and sys.byteorder == "big"):
        arr = arr.astype(dt.newbyteorder("<"))  # the wire is little-endian only
        dt = arr.dtype
    if _code(dt) is None:
        allowed = ", ".join([*(str(d) for d in DTYPES.values()), "bfloat16"])
        raise WireError(f"tensor {name!r} has dtype {dt}, which the wire does not carry; allowed: {allowed}")
    # (np.ascontiguousarray would turn a 0-d array into shape (1,))
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


class Encoded:
    """A bundle laid out for sending: a small `prefix` (preamble, header, table) plus the tensor
    buffers, without copying them. `pieces(start, end)` gives the bytes of any range as a list of
    memoryviews, so a sender can encrypt chunk by chunk straight from the tensors.

    The tensors are referenced, not copied: do not modify them until the bytes are sent."""

    __slots__ = ("prefix", "segments", "total")

    def __init__(self, prefix: bytes, segments: list[tuple[int, memoryview]], total: int) -> None:
        self.prefix = prefix
        self.segments = segments  # (offset, bytes) in increasing offset order
        self.total = total

    def pieces(self, start: int, end: int) -> list[memoryview]:
        """Memoryviews that together hold bytes [start, end) of the bundle, in order."""
        out: list[memoryview] = []
        pos = start
        if pos < len(self.prefix):
            stop = min(end, len(self.prefix))
            out.append(memoryview(self.prefix)[pos:stop])
            pos = stop
        if pos >= end:
            return out
        # first segment that ends after `pos` (segments are few or scanned once per chunk)
        lo, hi = 0, len(self.segments)
        while lo < hi:
            mid = (lo + hi) // 2
            off, mv = self.segments[mid]
            if off + len(mv) <= pos:
                lo = mid + 1
            else:
                hi = mid
        i = lo
        while pos < end:
            off, mv = self.segments[i] if i < len(self.segments) else (self.total, memoryview(b""))
            if pos < off:  # zero padding before this segment
                stop = min(end, off)
                out.append(_ZEROS[: stop - pos])
                pos = stop
                continue
            stop = min(end, off + len(mv))
            out.append(mv[pos - off: stop - off])
            pos = stop
            i += 1
        return out

    def write_into(self, out: memoryview) -> None:
        out = memoryview(out).cast("B") if not isinstance(out, memoryview) or out.format != "B" else out
        if len(out) < self.total:
            raise WireError(f"output buffer holds {len(out)} bytes; the bundle needs {self.total}")
        out[: len(self.prefix)] = self.prefix
        pos = len(self.prefix)
        for off, mv in self.segments:
            out[pos:off] = _ZEROS[: off - pos]
            out[off: off + len(mv)] = mv
            pos = off + len(mv)


def prepare(header: dict[str, Any], tensors: Mapping[str, Any] | None, limits: WireLimits = WireLimits()) -> Encoded:
    """Validate and lay out a bundle for sending (no tensor data is copied, except to make a
    non-contiguous or big-endian input contiguous little-endian)."""
    head = _encode_header(header, limits)
    tensors = tensors or {}
    if len(tensors) > limits.max_tensors:
        raise WireError(f"bundle has {len(tensors)} tensors; the limit is {limits.max_tensors}")
    entries = []
    table_len = 0
    for name, value in tensors.items():
        arr = _as_wire_array(name, value)
        raw = name.encode("utf-8")
        if len(raw) > limits.max_name_bytes or not raw:
            raise WireError(f"tensor name {name[:40]!r} is {len(raw)} bytes of UTF-8; "
                            f"names must be 1..{limits.max_name_bytes} bytes")
        if arr.ndim > limits.max_ndim:
            raise WireError(f"tensor {name!r} has {arr.ndim} dimensions; the limit is {limits.max_ndim}")
        entries.append((raw, arr))
        table_len += (_ENT.size + 8 * arr.ndim + len(raw) + 7) & ~7
    head_pad = ((len(head) + 7) & ~7) - len(head)
    table_at = _PRE.size + len(head) + head_pad
    data_offset = (table_at + table_len + ALIGN - 1) & ~(ALIGN - 1)
    parts = [b"", head, bytes(head_pad)]
    pos = data_offset
    segments: list[tuple[int, memoryview]] = []
    for raw, arr in entries:
        off = (pos + ALIGN - 1) & ~(ALIGN - 1)
        ndim = arr.ndim
        nbytes = arr.nbytes
        parts.append(_ENT.pack(len(raw), _code(arr.dtype), ndim, 0, off, nbytes))
        if ndim:
            parts.append(struct.pack(f"<{ndim}Q", *arr.shape))
        parts.append(raw)
        parts.append(bytes(((8 * ndim + len(raw) + 7) & ~7) - 8 * ndim - len(raw)))
        if nbytes:
            segments.append((off, arr.reshape(-1).view(np.uint8).data))
        pos = off + nbytes
    total = pos
    if total > limits.max_total_bytes:
        raise WireError(f"bundle is {total} bytes; the limit is {limits.max_total_bytes}")
    parts[0] = _PRE.pack(MAGIC, VERSION, 0, 0, len(head), len(entries), data_offset, total)
    parts.append(bytes(data_offset - table_at - table_len))
    return Encoded(b"".join(parts), segments, total)


def encoded_size(header: dict[str, Any], tensors: Mapping[str, Any] | None) -> int:
    """Bytes that `encode(header, tensors)` produces."""
    return prepare(header, tensors).total


def encode_into(header: dict[str, Any], tensors: Mapping[str, Any] | None, out: memoryview) -> int:
    """Write the bundle into `out` (at least `encoded_size` bytes); returns the bytes written."""
    enc = prepare(header, tensors)
    enc.write_into(out)
    return enc.total


def encode(header: dict[str, Any], tensors: Mapping[str, Any] | None = None) -> bytes:
    """The bundle as one bytes object (copies the tensors once)."""
    enc = prepare(header, tensors)
    out = bytearray(enc.total)
    enc.write_into(memoryview(out))
    return bytes(out)


# -- decoding -------------------------------------------------------------------------------------
def decode(buf: bytes | bytearray | memoryview | np.ndarray,
           limits: WireLimits = WireLimits()) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Parse a bundle. Returns (header, tensors).

    The arrays are zero-copy views into `buf` whenever their data is aligned for their dtype
    (always, when `buf` itself is 8-byte aligned, as numpy and bytearray allocations are), so `buf`
    must stay alive and unmodified while they are used; they are read-only when `buf` is
    (`bytes`). Unaligned data is copied. Raises `WireError` for any malformed input.
    """
    try:
        return _decode(buf, limits)
    except WireError:
        raise
    except Exception as exc:
        raise WireError(f"malformed bundle ({type(exc).__name__}: {str(exc)[:200]})") from None


def _decode(buf: bytes | bytearray | memoryview | np.ndarray,
            limits: WireLimits) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    try:
        mv = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    except TypeError:
        raise WireError(f"decode needs a bytes-like object, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise WireError("decode needs a contiguous buffer")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    n = len(mv)
    if n < _PRE.size:
        raise WireError(f"bundle is {n} bytes, shorter than the {_PRE.size}-byte preamble")
    magic, version, flags, reserved, head_len, num, data_offset, total = _PRE.unpack_from(mv, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} at byte 0 (expected {MAGIC!r}): not an hpcfed bundle")
    if version != VERSION:
        raise WireError(f"bundle format version {version}; this hpcfed reads version {VERSION}")
    if flags or reserved:
        raise WireError(f"reserved preamble bits are set (flags={flags}, reserved={reserved})")
    if total != n:
        raise WireError(f"preamble says the bundle is {total} bytes but the buffer holds {n} (truncated or padded)")
    if total > limits.max_total_bytes:
        raise WireError(f"bundle is {total} bytes; the limit is {limits.max_total_bytes}")
    if head_len > limits.max_header_bytes:
        raise WireError(f"header length {head_len} exceeds the limit {limits.max_header_bytes}")
    if num > limits.max_tensors:
        raise WireError(f"bundle declares {num} tensors; the limit is {limits.max_tensors}")
    pos = _PRE.size + _pad(head_len, 8)
    if pos > n:
        raise WireError(f"header ({head_len} bytes at offset {_PRE.size}) runs past the end of the {n}-byte bundle")
    if any(mv[_PRE.size + head_len: pos]):
        raise WireError(f"non-zero padding after the header at offset {_PRE.size + head_len}")
    try:
        header = bounded_json.loads_object(mv[_PRE.size: _PRE.size + head_len], limits.max_header_depth)
    except bounded_json.JSONBoundError as exc:
        raise WireError(str(exc)) from None

    # Pass 1: the table, checked completely before any data is viewed.
    entries: list[tuple[str, np.dtype, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    data_pos = data_offset
    for i in range(num):
        where = f"tensor table entry {i} (offset {pos})"
        if pos + _ENT.size > n:
            raise WireError(f"{where} runs past the end of the {n}-byte bundle")
        name_len, code, ndim, res, off, nbytes = _ENT.unpack_from(mv, pos)
        if res:
            raise WireError(f"{where}: reserved field is {res}, expected 0")
        if code not in DTYPES and code != BFLOAT16_CODE:
            raise WireError(f"{where}: unknown dtype code {code}")
        if ndim > limits.max_ndim:
            raise WireError(f"{where}: {ndim} dimensions; the limit is {limits.max_ndim}")
        if name_len == 0 or name_len > limits.max_name_bytes:
            raise WireError(f"{where}: name length {name_len}; names must be 1..{limits.max_name_bytes} bytes")
        ent_len = _pad(_ENT.size + 8 * ndim + name_len, 8)
        if pos + ent_len > n:
            raise WireError(f"{where} ({ent_len} bytes) runs past the end of the {n}-byte bundle")
        shape = struct.unpack_from(f"<{ndim}Q", mv, pos + _ENT.size)
        name_at = pos + _ENT.size + 8 * ndim
        try:
            name = bytes(mv[name_at: name_at + name_len]).decode("utf-8")
        except UnicodeDecodeError:
            raise WireError(f"{where}: tensor name is not valid UTF-8") from None
        if name in names:
            raise WireError(f"{where}: tensor name {name!r} appears twice")
        if any(mv[name_at + name_len: pos + ent_len]):
            raise WireError(f"{where}: non-zero padding after the name")
        names.add(name)
        dt = bfloat16() if code == BFLOAT16_CODE else DTYPES[code]
        big = max(shape, default=0)
        if big > limits.max_total_bytes or math.prod(d for d in shape if d) > limits.max_total_bytes:
            raise WireError(f"tensor {name!r}: shape {shape} has more elements than the "
                            f"{limits.max_total_bytes}-byte limit allows (also when a dimension is 0)")
        count = math.prod(shape)
        if count * dt.itemsize != nbytes:
            raise WireError(f"tensor {name!r}: shape {shape} x {dt.itemsize} bytes != declared {nbytes} bytes")
        want = _pad(data_pos, ALIGN)
        if off != want:
            raise WireError(f"tensor {name!r}: data offset {off}, expected {want} "
                            f"(non-canonical or overlapping layout)")
        if off + nbytes > n:
            raise WireError(f"tensor {name!r}: {nbytes} bytes at offset {off} run past the end of the {n}-byte bundle")
        entries.append((name, dt, shape, off, nbytes))
        data_pos = off + nbytes
        pos += ent_len
    want_data = _pad(pos, ALIGN)
    if data_offset != want_data:
        raise WireError(f"data offset {data_offset}, expected {want_data} (end of the table, aligned to {ALIGN})")
    if data_offset > n:
        raise WireError(f"data offset {data_offset} is past the end of the {n}-byte bundle")
    if any(mv[pos:data_offset]):
        raise WireError(f"non-zero padding between the table and the data at offset {pos}")
    if data_pos != total:
        raise WireError(f"the tensors end at byte {data_pos} but the bundle is {total} bytes")

    # Pass 2: views.
    tensors: dict[str, np.ndarray] = {}
    base = np.frombuffer(mv, dtype=np.uint8)
    for name, dt, shape, off, nbytes in entries:
        if nbytes == 0:
            tensors[name] = np.zeros(shape, dtype=dt)
            continue
        arr = base[off: off + nbytes].view(dt)
        if not arr.flags.aligned:  # only when `buf` itself starts at an odd address
            arr = base[off: off + nbytes].copy().view(dt)
        tensors[name] = arr.reshape(shape)
    return header, tensors
