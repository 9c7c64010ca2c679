"""Model parameters as named float arrays, and their flat float32 view for aggregation.

Tasks speak `Params` (an ordered ``dict[str, np.ndarray]``); strategies aggregate flat float32
vectors laid out by a `ParamLayout`, so aggregation is a handful of vector operations with no
Python loop over layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

Params = dict[str, np.ndarray]


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of parameters inside one flat float32 vector."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    size: int

    @classmethod
    def of(cls, params: Mapping[str, np.ndarray]) -> "ParamLayout":
        names, shapes, offsets, pos = [], [], [], 0
        for name, value in params.items():
            arr = np.asarray(value)
            names.append(name)
            shapes.append(tuple(int(s) for s in arr.shape))
            offsets.append(pos)
            pos += int(arr.size)
        return cls(tuple(names), tuple(shapes), tuple(offsets), pos)

    def flatten(self, params: Mapping[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Copy `params` into one float32 vector; raises ValueError naming any mismatch."""
        self.check(params)
        flat = np.empty(self.size, dtype=np.float32) if out is None else out
        for name, shape, offset in zip(self.names, self.shapes, self.offsets):
            n = int(np.prod(shape, dtype=np.int64))
            flat[offset : offset + n] = np.asarray(params[name], dtype=np.float32).reshape(-1)
        return flat

    def unflatten(self, flat: np.ndarray) -> Params:
        """Views (no copy) of `flat` shaped as the parameters."""
        if flat.shape != (self.size,):
            raise ValueError(f"flat parameter vector has shape {flat.shape}, expected ({self.size},)")
        out: Params = {}
        for name, shape, offset in zip(self.names, self.shapes, self.offsets):
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = flat[offset : offset + n].reshape(shape)
        return out

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


def all_finite(params: Mapping[str, np.ndarray]) -> bool:
    """True when no parameter holds NaN or Inf."""
    return all(bool(np.isfinite(np.asarray(v)).all()) for v in params.values())
