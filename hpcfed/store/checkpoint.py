"""HDF5 checkpoints that survive kill -9 and Slurm requeue.

One file per checkpoint, ``checkpoints/ckpt-<round>.h5``::

    attrs:  format="hpcfed-checkpoint", format_version, round, version, created, config (JSON),
            checksum (SHA-256 over every dataset's name, dtype, shape and bytes, in sorted order)
    /strategy            arrays of Strategy.state_dict(); attr "header" = its JSON scalars
    /clients/<id>        arrays of Task.state_dict() (optimizer, RNG); attr "header" = JSON
    /meta                attr "header" = JSON (metrics so far, rejected counts, wall time)

Written to a temporary file, fsynced, then ``os.replace``d and the folder fsynced: a kill at any
moment leaves either the old or the new file, never half of one. `latest_valid` verifies the
checksum and falls back to the previous checkpoint when the newest is corrupt or truncated.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from hpcfed.store import atomic

FORMAT = "hpcfed-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{6,})\.h5$")

Arrays = dict[str, np.ndarray]


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, truncated or not an hpcfed checkpoint."""


@dataclass
class Checkpoint:
    round: int
    version: int
    config: dict[str, Any]
    strategy: tuple[dict[str, Any], Arrays]
    clients: dict[int, tuple[dict[str, Any], Arrays]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def checkpoint_path(directory: str | Path, round: int) -> Path:
    return Path(directory) / f"ckpt-{round:06d}.h5"


def save(directory: str | Path, ckpt: Checkpoint, keep: int = 3) -> Path:
    """Write `ckpt` atomically and keep only the newest `keep` checkpoints."""
    import h5py

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, ckpt.round)
    digest = hashlib.sha256()
    with atomic.atomic_path(final) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = FORMAT
        f.attrs["format_version"] = FORMAT_VERSION
        f.attrs["round"] = ckpt.round
        f.attrs["version"] = ckpt.version
        f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        f.attrs["config"] = json.dumps(ckpt.config, sort_keys=True, default=str)
        _write_group(f.create_group("strategy"), *ckpt.strategy)
        clients = f.create_group("clients")
        for cid in sorted(ckpt.clients):
            _write_group(clients.create_group(str(cid)), *ckpt.clients[cid])
        _write_group(f.create_group("meta"), ckpt.meta, {})
        _digest_file(f, digest)
        f.attrs["checksum"] = digest.hexdigest()
    _fsync_dir(directory)
    _prune(directory, keep)
    ckpt.path = final
    return final


def load(path: str | Path) -> Checkpoint:
    """Read and verify one checkpoint; raises CheckpointError naming the file and the problem."""
    import h5py

    path = Path(path)
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not an hpcfed checkpoint (format={f.attrs.get('format')!r})")
            digest = hashlib.sha256()
            _digest_file(f, digest)
            if digest.hexdigest() != f.attrs.get("checksum"):
                raise CheckpointError(f"{path}: checksum mismatch (the file is corrupt or was modified)")
            strategy = _read_group(f["strategy"])
            clients = {int(k): _read_group(g) for k, g in f["clients"].items()}
            meta = _read_group(f["meta"])[0]
            return Checkpoint(round=int(f.attrs["round"]), version=int(f.attrs["version"]),
                              config=json.loads(f.attrs["config"]), strategy=strategy, clients=clients,
                              meta=meta, path=path)
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files, newest round first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_valid(directory: str | Path, warn: Callable[[str], None] = print) -> Checkpoint | None:
    """The newest checkpoint that verifies; corrupt ones are reported and skipped."""
    for path in list_checkpoints(directory):
        try:
            return load(path)
        except CheckpointError as exc:
            warn(f"skipping checkpoint: {exc}")
    return None


# ----------------------------------------------------------------------------------------------


def _write_group(group: Any, header: dict[str, Any], arrays: Arrays) -> None:
    group.attrs["header"] = json.dumps(header, sort_keys=True, default=_json_default)
    for name, value in arrays.items():
        arr = np.ascontiguousarray(value)
        # Names may contain '/', which h5py would read as nested groups; escape it.
        group.create_dataset(name.replace("/", "|"), data=arr)


def _read_group(group: Any) -> tuple[dict[str, Any], Arrays]:
    header = json.loads(group.attrs.get("header", "{}"))
    arrays = {name.replace("|", "/"): np.asarray(ds[()]) for name, ds in group.items()}
    return header, arrays


def _digest_file(f: Any, digest: "hashlib._Hash") -> None:
    import h5py

    items: list[tuple[str, Any]] = []
    f.visititems(lambda name, obj: items.append((name, obj)))
    for name, obj in sorted(items, key=lambda kv: kv[0]):
        if isinstance(obj, h5py.Dataset):
            data = np.ascontiguousarray(obj[()])
            digest.update(f"{name}|{data.dtype.str}|{data.shape}".encode())
            digest.update(data.tobytes())
        if "header" in obj.attrs:
            digest.update(f"{name}#header".encode() + str(obj.attrs["header"]).encode())
    for key in ("round", "version", "config"):
        digest.update(f"@{key}={f.attrs.get(key)}".encode())


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[max(1, keep):]:
        try:
            old.unlink()
        except OSError:
            pass
    for stale in directory.glob(".ckpt-*.tmp*"):
        try:
            stale.unlink()
        except OSError:
            pass
