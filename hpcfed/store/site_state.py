"""A site's own training state (optimizer moments, RNG, personal/local models), kept by the site.

The server never sees it: at a checkpoint round each site writes its `Task.state_dict()` to its own
directory (``federation.site_state_dir``, e.g. ``{out}/sites/{client}`` or a node-local path) and
tells the server only the shard's digest; the server's manifest (the checkpoint file) records the
digests, and a checkpoint exists once that manifest is committed. One file per round::

    <site dir>/shard-<round>.h5
        attrs: format="hpcfed-site-shard", format_version, round, client, header (JSON), auth
        /state/<name>   arrays of Task.state_dict() ('/' in names escaped as '|')

Written atomically (temporary file, fsync, ``os.replace``) and tagged with the site's key
(`hpcfed.store.sealed`, purpose "site-shard"); the digest is the canonical SHA-256 of its content.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.store import atomic, sealed

FORMAT = "hpcfed-site-shard"
FORMAT_VERSION = 1
MAX_REPORTED = 64  # shards a site reports on --resume (bounded for the server's sake)
_NAME = re.compile(r"^shard-(\d{6,})\.h5$")

State = tuple[dict[str, Any], dict[str, np.ndarray]]


class ShardError(ValueError):
    """A site's shard is missing, corrupt, forged or not the one the manifest names."""


def site_dir(template: str, *, out: Path, client: int, rank: int) -> Path:
    """Expand ``federation.site_state_dir``: {out}, {client}, {rank}, {job} (``$SLURM_JOB_ID`` or 'local')."""
    job = os.environ.get("SLURM_JOB_ID", "local")
    try:
        text = template.format(out=out, client=client, rank=rank, job=job)
    except (KeyError, IndexError, ValueError) as exc:
        raise ShardError(f"federation.site_state_dir {template!r}: unknown placeholder {exc}; "
                         f"use {{out}}, {{client}}, {{rank}} or {{job}}") from None
    return Path(text).expanduser()


def shard_path(directory: Path, round: int) -> Path:
    """The file of a site's shard for `round`; zero-padded so that names sort in round order."""
    return Path(directory) / f"shard-{round:06d}.h5"


def write_shard(directory: Path, round: int, client: int, state: State, auth: sealed.FileAuth,
                keep: int) -> tuple[Path, str]:
    """Write this site's state for `round`; returns (path, digest hex). Keeps `keep` shards (plus
    the one just written, which no manifest names yet)."""
    import h5py

    header, arrays = state
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = shard_path(directory, round)
    with atomic.atomic_path(final) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["round"] = int(round)
            f.attrs["client"] = int(client)
            f.attrs["header"] = atomic.header_json(header)
            g = f.create_group("state")
            for name, value in arrays.items():
                g.create_dataset(name.replace("/", "|"), data=np.ascontiguousarray(value))
        digest = sealed.seal(tmp, auth)
    atomic.fsync_dir(directory)
    prune(directory, keep + 1)
    return final, digest.hex()


def held_shards(directory: Path, client: int, auth: sealed.FileAuth) -> list[list[Any]]:
    """[[round, digest hex], ...] of the intact shards this site holds, newest first."""
    held: list[list[Any]] = []
    for rnd, path in _listing(Path(directory))[:MAX_REPORTED]:
        try:
            tree = _read(path, client, auth)
        except ShardError:
            continue  # reported as not held; the server falls back to a checkpoint every site holds
        if int(tree.attrs[""].get("round", -1)) == rnd:
            held.append([rnd, tree.digest.hex()])
    return held


def load_shard(directory: Path, round: int, digest: str, client: int, auth: sealed.FileAuth) -> State:
    """The state of `round`, verified against the site's key and the digest the server's manifest holds."""
    path = shard_path(directory, round)
    if not path.is_file():
        raise ShardError(f"{path} is missing")
    tree = _read(path, client, auth)
    if tree.digest.hex() != digest or int(tree.attrs[""].get("round", -1)) != round:
        raise ShardError(f"{path} is not the shard the checkpoint manifest names (digest differs)")
    try:
        header = json.loads(tree.attrs[""].get("header", "{}"))
    except ValueError:
        raise ShardError(f"{path}: malformed header") from None
    arrays = {n.replace("|", "/"): tree.datasets[f"state/{n}"] for n in tree.children("state")
              if f"state/{n}" in tree.datasets}
    return header, arrays


def prune(directory: Path, keep: int) -> None:
    """Keep the newest `keep` shards (at least one) and remove half-written ones left by a crash."""
    for _, old in _listing(Path(directory))[max(1, keep):]:
        old.unlink(missing_ok=True)
    for stale in Path(directory).glob(".shard-*.tmp*"):
        stale.unlink(missing_ok=True)


def _read(path: Path, client: int, auth: sealed.FileAuth) -> sealed.Tree:
    try:
        tree = sealed.read(path, auth)
    except sealed.SealError as exc:
        raise ShardError(str(exc)) from None
    root = tree.attrs.get("", {})
    if root.get("format") != FORMAT or _int(root.get("client")) != client or _int(root.get("round")) is None:
        raise ShardError(f"{path} is not a site shard of client {client}")
    return tree


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def _listing(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)

