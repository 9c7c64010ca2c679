"""Model parameters as named arrays, their flat float32 view for aggregation, and their wire form.

Tasks speak `Params` (an ordered ``dict[str, np.ndarray]``, each in its own dtype); strategies
aggregate flat float32 vectors laid out by a `ParamLayout`, so aggregation is a handful of vector
operations with no Python loop over layers; the channel carries one flat buffer per dtype group.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from hpcfed.comm.wire import loaded_bfloat16

Params = dict[str, np.ndarray]


# Dtypes a parameter keeps on the wire and back in the task, with bfloat16 (`is_bfloat16`: its
# dtype is ml_dtypes', imported only once some array has it); any other (float64, ...) travels
# and is aggregated as float32, as every parameter did before dtypes were kept.
WIRE_DTYPES: tuple[np.dtype, ...] = tuple(np.dtype(d) for d in (
    np.float32, np.float16, np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_))
FLOAT32 = np.dtype(np.float32)


def is_bfloat16(dtype: np.dtype) -> bool:
    """True for `ml_dtypes.bfloat16`, without importing ml_dtypes (no array has its dtype before)."""
    bf16 = loaded_bfloat16()
    return bf16 is not None and np.dtype(dtype) == bf16


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a parameter of `dtype` crosses the channel in."""
    dtype = np.dtype(dtype)
    return dtype if dtype in WIRE_DTYPES or is_bfloat16(dtype) else FLOAT32


def is_float(dtype: np.dtype) -> bool:
    """True for floating-point dtypes, bfloat16 included (numpy does not count it as kind "f")."""
    return np.dtype(dtype).kind == "f" or is_bfloat16(dtype)


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes, dtypes and offsets of parameters inside one flat float32 vector.

    The flat float32 vector is what strategies aggregate. On the wire a model travels as one flat
    buffer per dtype group (`pack`/`unpack`), each parameter in its own dtype: a bf16 model moves
    half the bytes of the same model in fp32. Integer and bool parameters (e.g. BatchNorm's
    ``num_batches_tracked``) are aggregated like the rest in float32 and rounded to the nearest
    integer (bool: >= 0.5) when packed back into their dtype.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    size: int
    dtypes: tuple[np.dtype, ...] = ()  # per parameter; empty = all float32
    # Derived in __post_init__: values per dtype group, and each parameter's start inside its group.
    _groups: dict[np.dtype, int] = field(init=False, repr=False, compare=False)
    _slots: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.dtypes:
            object.__setattr__(self, "dtypes", (FLOAT32,) * len(self.names))
        groups: dict[np.dtype, int] = {}
        slots: list[int] = []
        for shape, dt in zip(self.shapes, self.dtypes):
            at = groups.get(dt, 0)
            slots.append(at)
            groups[dt] = at + int(np.prod(shape, dtype=np.int64))
        object.__setattr__(self, "_groups", groups)
        object.__setattr__(self, "_slots", tuple(slots))

    @classmethod
    def of(cls, params: Mapping[str, np.ndarray]) -> ParamLayout:
        """The layout of `params`, in their order (each dtype as it will cross the channel)."""
        names: list[str] = []
        shapes: list[tuple[int, ...]] = []
        offsets: list[int] = []
        dtypes: list[np.dtype] = []
        pos = 0
        for name, value in params.items():
            arr = np.asarray(value)
            names.append(name)
            shapes.append(tuple(int(s) for s in arr.shape))
            offsets.append(pos)
            dtypes.append(wire_dtype(arr.dtype))
            pos += int(arr.size)
        return cls(tuple(names), tuple(shapes), tuple(offsets), pos, tuple(dtypes))

    # -- dtype groups (the wire form) -----------------------------------------------------------
    @property
    def groups(self) -> dict[str, int]:
        """dtype name -> number of values of that dtype, in the order of first appearance."""
        return {dt.name: n for dt, n in self._groups.items()}

    @property
    def nbytes(self) -> int:
        """Bytes of one model in its own dtypes (what crosses the channel)."""
        return sum(dt.itemsize * n for dt, n in self._groups.items())

    def describe(self) -> list[list[object]]:
        """[[name, shape, dtype name], ...]: what server and client compare at setup."""
        return [[n, list(s), dt.name] for n, s, dt in zip(self.names, self.shapes, self.dtypes)]

    def pack(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One flat buffer per dtype group (dtype name -> array), each parameter in its dtype."""
        self.check(params)
        if len(self._groups) == 1 and self.dtypes[0] == FLOAT32:
            return {"float32": self.flatten(params)}
        out = {dt.name: np.empty(n, dtype=dt) for dt, n in self._groups.items()}
        for name, shape, dt, slot in zip(self.names, self.shapes, self.dtypes, self._slots):
            n = int(np.prod(shape, dtype=np.int64))
            out[dt.name][slot: slot + n] = np.asarray(params[name]).reshape(-1).astype(dt, copy=False)
        return out

    def pack_flat(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The float32 aggregation vector as per-dtype wire buffers (no copy for an all-fp32 model).
        Integers are rounded to nearest and clipped to their dtype's range; bools are >= 0.5."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat parameter vector has shape {flat.shape}, expected ({self.size},)")
        if len(self._groups) == 1 and self.dtypes[0] == FLOAT32:
            return {"float32": flat}
        out = {dt.name: np.empty(n, dtype=dt) for dt, n in self._groups.items()}
        for shape, offset, dt, slot in zip(self.shapes, self.offsets, self.dtypes, self._slots):
            n = int(np.prod(shape, dtype=np.int64))
            out[dt.name][slot: slot + n] = _cast(flat[offset: offset + n], dt)
        return out

    def check_packed(self, groups: Mapping[str, np.ndarray]) -> str | None:
        """Why `groups` (dtype name -> array) is not this layout's wire form, or None if it is."""
        want = self._groups
        if set(groups) != {dt.name for dt in want}:
            return f"dtype groups {sorted(groups)}, expected {sorted(dt.name for dt in want)}"
        for dt, n in want.items():
            got = groups[dt.name]
            if not isinstance(got, np.ndarray) or got.dtype != dt or got.shape != (n,):
                what = f"{got.dtype} {got.shape}" if isinstance(got, np.ndarray) else type(got).__name__
                return f"{dt.name} group is {what}, expected {dt.name} ({n},)"
        return None

    def packed_finite(self, groups: Mapping[str, np.ndarray]) -> bool:
        """True when no float group holds NaN or Inf (integer groups always are)."""
        return all(bool(np.isfinite(v).all()) for v in groups.values() if is_float(v.dtype))

    def unpack(self, groups: Mapping[str, np.ndarray]) -> Params:
        """Views of the wire buffers shaped as the parameters, each in its dtype (call `check_packed` first)."""
        out: Params = {}
        for name, shape, dt, slot in zip(self.names, self.shapes, self.dtypes, self._slots):
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = groups[dt.name][slot: slot + n].reshape(shape)
        return out

    def unpack_flat(self, groups: Mapping[str, np.ndarray]) -> np.ndarray:
        """The float32 aggregation vector of a packed model (the buffer itself for an all-fp32 one)."""
        if len(self._groups) == 1 and self.dtypes[0] == FLOAT32:
            return groups["float32"]
        flat = np.empty(self.size, dtype=np.float32)
        for shape, offset, dt, slot in zip(self.shapes, self.offsets, self.dtypes, self._slots):
            n = int(np.prod(shape, dtype=np.int64))
            flat[offset: offset + n] = groups[dt.name][slot: slot + n]
        return flat

    # -- the float32 aggregation vector ---------------------------------------------------------
    def flatten(self, params: Mapping[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Copy `params` into one float32 vector; raises ValueError naming any mismatch."""
        self.check(params)
        flat = np.empty(self.size, dtype=np.float32) if out is None else out
        for name, span in self._spans():
            flat[span] = np.asarray(params[name], dtype=np.float32).reshape(-1)
        return flat

    def difference(self, params: Mapping[str, np.ndarray], base: np.ndarray) -> np.ndarray:
        """params − base in float64 (`base`: a float32 vector of this layout), parameter by parameter:
        the values of ``np.subtract(flatten(params), base, dtype=np.float64)`` without the float32 copy
        of `params` first; raises ValueError naming any mismatch."""
        self.check(params)
        out = np.empty(self.size, dtype=np.float64)
        for name, span in self._spans():
            np.subtract(np.asarray(params[name], dtype=np.float32).reshape(-1), base[span], out=out[span],
                        dtype=np.float64)
        return out

    def _spans(self) -> Iterator[tuple[str, slice]]:
        """Each parameter's name and its slice of the flat vector."""
        for name, shape, offset in zip(self.names, self.shapes, self.offsets):
            yield name, slice(offset, offset + int(np.prod(shape, dtype=np.int64)))

    def unflatten(self, flat: np.ndarray) -> Params:
        """Views (no copy) of `flat` shaped as the parameters."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat parameter vector has shape {flat.shape}, expected ({self.size},)")
        return {name: flat[span].reshape(shape) for (name, span), shape in zip(self._spans(), self.shapes)}

    def check(self, params: Mapping[str, np.ndarray]) -> None:
        """Raise ValueError if `params` does not have exactly this layout's names and shapes."""
        missing = [n for n in self.names if n not in params]
        unknown = [n for n in params if n not in set(self.names)]
        if missing or unknown:
            raise ValueError(
                f"parameter names differ from the model's: missing {missing[:5]}, unknown {unknown[:5]}"
            )
        for name, shape in zip(self.names, self.shapes):
            got = tuple(np.shape(params[name]))
            if got != shape:
                raise ValueError(f"parameter {name!r} has shape {got}, expected {shape}")


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return values >= 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        clipped: np.ndarray = np.clip(np.rint(values), info.min, info.max)
        return clipped.astype(dtype)
    return values.astype(dtype)


def all_finite(params: Mapping[str, np.ndarray]) -> bool:
    """True when no parameter holds NaN or Inf."""
    return all(bool(np.isfinite(np.asarray(v)).all()) for v in params.values())
