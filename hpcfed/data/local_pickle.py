"""Reading the few research files that only exist as pickles, without letting them run code.

Planetoid Cora (``ind.cora.*``) and the Arabic event set (``Arabic_100.npy``, a numpy object array)
are shipped as pickles. They are read from the data folder, never from the network, and even so
only through an unpickler that can build the handful of types each file holds: any other global
(``os.system``, ``builtins.eval`` ...) is refused with a `DataError` naming the file, so a tampered
file cannot run code.
"""

from __future__ import annotations

import pickle
from collections.abc import Collection
from pathlib import Path
from typing import IO, Any

import numpy as np

from hpcfed.data.root import DataError

# numpy arrays, as numpy 1 and numpy 2 pickle them
NUMPY_ARRAYS = frozenset({
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
})


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: Collection[tuple[str, str]]) -> None:
        super().__init__(file, encoding="latin1")  # latin1: Python-2 pickles of numpy arrays
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refusing {module}.{name}: not a type this file may hold")
        return super().find_class(module, name)


def _load(fh: IO[bytes], path: Path, allowed: Collection[tuple[str, str]], what: str) -> Any:
    try:
        return _AllowListUnpickler(fh, allowed).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: cannot be read as {what} ({exc})") from None


def load_pickle(path: Path, allowed: Collection[tuple[str, str]], what: str) -> Any:
    """The object pickled in `path`, built only from the `allowed` (module, name) globals."""
    with path.open("rb") as fh:
        return _load(fh, path, allowed, what)


def load_object_npy(path: Path, allowed: Collection[tuple[str, str]], what: str) -> np.ndarray:
    """A ``.npy`` file of dtype object (what ``np.load(allow_pickle=True)`` reads), with the same
    allow-list; plain numeric ``.npy`` files need no pickle and should use ``np.load``."""
    with path.open("rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            shape, _, dtype = (np.lib.format.read_array_header_1_0(fh) if version == (1, 0)
                               else np.lib.format.read_array_header_2_0(fh))
        except ValueError as exc:
            raise DataError(f"{path}: not a .npy file ({exc})") from None
        if dtype != np.dtype(object):
            raise DataError(f"{path}: expected an object array, found dtype {dtype}")
        array = _load(fh, path, set(allowed) | NUMPY_ARRAYS, what)  # numpy pickles the whole array
    if not isinstance(array, np.ndarray) or array.shape != tuple(shape):
        raise DataError(f"{path}: the header says shape {tuple(shape)}, the data does not match")
    return array
