"""Files that appear whole or not at all.

A reader (a resumed job, the launcher watching for results, a user's script) must never see half
a file, and a crash mid-write must leave the previous version intact: write to a temporary file in
the same folder, flush it to disk, then `os.replace` it over the target (atomic on POSIX).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np


@contextmanager
def atomic_path(path: str | Path, *, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `path`; once the block succeeds it replaces `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all (see `atomic_path`)."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (best effort: some filesystems refuse it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def header_json(header: dict[str, Any]) -> str:
    """A header attribute as canonical JSON (numpy scalars and arrays as plain numbers and lists)."""
    return json.dumps(header, sort_keys=True, default=_json_default)


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)
