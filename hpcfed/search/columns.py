"""Per-row attributes of a site's documents: what the search filters on and shows beside a hit.

An export may carry ``/<entity>/columns/<name>``: one number or UTF-8 string per row (DAMe's
messages: ``time``, seconds since the epoch, and ``text``). `checked` takes them from an export as
untrusted arrays (name, length, type bounded); the index (`hpcfed.search.ann`) keeps them in its
own tagged file, numbers as one dataset and strings as one UTF-8 blob with offsets, so that a loaded
index answers filters and shows texts without opening the export again.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import numpy as np

COLUMN_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
RESERVED = ("site", "id", "score", "label", "label_name")  # answered from the hit itself
MAX_COLUMNS = 32
TIME = "time"  # seconds since the epoch, UTC; shown as ISO 8601
Columns = dict[str, np.ndarray]  # numbers (int64/float64) or an object array of str


class ColumnError(ValueError):
    """A column an export or index carries is malformed."""


def checked(raw: Mapping[str, Any], n: int, where: str) -> Columns:
    """The columns of an export as arrays of n numbers or n strings; malformed ones refused by name."""
    if len(raw) > MAX_COLUMNS:
        raise ColumnError(f"{where}: {len(raw)} columns, at most {MAX_COLUMNS}")
    out: Columns = {}
    for name, values in sorted(raw.items()):
        if not COLUMN_NAME.fullmatch(name) or name in RESERVED:
            raise ColumnError(f"{where}: column name {name!r} is not a plain lower-case name (or is reserved)")
        arr = np.asarray(values)
        if arr.shape != (n,):
            raise ColumnError(f"{where}: column {name!r} has shape {arr.shape}, the export {n} rows")
        if arr.dtype.kind in "iub":
            out[name] = arr.astype(np.int64)
        elif arr.dtype.kind == "f":
            out[name] = arr.astype(np.float64)
        elif arr.dtype.kind in "OSU":
            out[name] = np.array([v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in arr],
                                 dtype=object)
        else:
            raise ColumnError(f"{where}: column {name!r} holds {arr.dtype}, not numbers or text")
    return out


def concat(parts: list[Columns], sizes: list[int], where: str) -> Columns:
    """Columns of segments laid end to end; a column one segment lacks is blank (NaN / "") there."""
    names = sorted({name for part in parts for name in part})
    out: Columns = {}
    for name in names:
        kinds = {part[name].dtype.kind for part in parts if name in part}
        if len(kinds) > 1 and "O" in kinds:
            raise ColumnError(f"{where}: column {name!r} is text in one export and numbers in another")
        blank: Any = "" if "O" in kinds else (np.nan if "f" in kinds else -1)
        pieces = [part[name] if name in part else np.full(size, blank, dtype=object if blank == "" else None)
                  for part, size in zip(parts, sizes)]
        out[name] = np.concatenate(pieces) if pieces else np.zeros(0)
        if "O" not in kinds and "f" in kinds:
            out[name] = out[name].astype(np.float64)
    return out


def write(f: Any, columns: Columns) -> None:
    """Columns into an (index) HDF5 file: ``columns/<name>/values`` or ``columns/<name>/utf8`` + offsets."""
    for name, values in columns.items():
        if values.dtype.kind == "O":
            encoded = [str(v).encode("utf-8") for v in values]
            offsets = np.zeros(len(encoded) + 1, np.int64)
            np.cumsum([len(e) for e in encoded], out=offsets[1:])
            f.create_dataset(f"columns/{name}/utf8", data=np.frombuffer(b"".join(encoded), np.uint8))
            f.create_dataset(f"columns/{name}/offsets", data=offsets)
        else:
            f.create_dataset(f"columns/{name}/values", data=values)


def read(datasets: Mapping[str, np.ndarray], n: int, where: str) -> Columns:
    """The columns `write` stored, every bound checked (the file's tag verified before this)."""
    names = sorted({key.split("/")[1] for key in datasets if key.startswith("columns/") and key.count("/") == 2})
    raw: dict[str, Any] = {}
    for name in names:
        if f"columns/{name}/values" in datasets:
            raw[name] = datasets[f"columns/{name}/values"]
            continue
        blob, offsets = datasets.get(f"columns/{name}/utf8"), datasets.get(f"columns/{name}/offsets")
        if blob is None or offsets is None or blob.dtype != np.uint8 or offsets.shape != (n + 1,):
            raise ColumnError(f"{where}: /columns/{name} is malformed")
        ends = offsets.astype(np.int64)
        if ends[0] != 0 or ends[-1] != len(blob) or np.any(np.diff(ends) < 0):
            raise ColumnError(f"{where}: /columns/{name}/offsets do not partition its text")
        data = blob.tobytes()
        raw[name] = np.array([data[a:b].decode("utf-8", "replace") for a, b in zip(ends[:-1].tolist(),
                                                                                  ends[1:].tolist())], dtype=object)
    return checked(raw, n, where)


def shown(columns: Columns, row: int) -> dict[str, Any]:
    """A row's attributes as JSON values (``time`` as ISO 8601, UTC)."""
    out: dict[str, Any] = {}
    for name, values in columns.items():
        value = values[row]
        if name == TIME and values.dtype.kind in "if" and np.isfinite(value):
            out[name] = datetime.fromtimestamp(float(value), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        elif values.dtype.kind == "O":
            out[name] = str(value)
        elif values.dtype.kind == "f":
            out[name] = float(value) if np.isfinite(value) else None
        else:
            out[name] = int(value)
    return out
