"""The server's HDF5 checkpoints (the manifests of coordinated checkpoints); survive kill -9 and requeue.

One file per checkpoint, ``checkpoints/ckpt-<round>.h5``::

    attrs:  format="hpcfed-checkpoint", format_version, round, version, created, config (JSON),
            auth (JSON: alg, purpose, digest, tag; see `hpcfed.store.sealed`)
    /strategy            arrays of Strategy.state_dict(); attr "header" = its JSON scalars
    /sites/<id>          attrs digest, path: the site's own shard of this round (see store.site_state);
                         attr round when the shard is of an earlier round (a site the federation
                         went on without keeps its last one); no site state is ever in this file
    /meta                attr "header" = JSON (metrics so far, rejected counts, wall time)

Written to a temporary file, fsynced, then ``os.replace``d and the folder fsynced: a kill at any
moment leaves either the old or the new file, never half of one. Every file is authenticated with
the job's key (`hpcfed.store.sealed`: HMAC from the PSK or an Ed25519 signature) and read with every
declared size bounded; `latest_valid` falls back to the previous checkpoint when the newest is
corrupt, truncated, forged or hostile.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.store import atomic, sealed

FORMAT = "hpcfed-checkpoint"
FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{6,})\.h5$")

Arrays = dict[str, np.ndarray]


class CheckpointError(ValueError):
    """A checkpoint file is corrupt, truncated or not an hpcfed checkpoint."""


@dataclass
class Checkpoint:
    """rank 0's resumable state after a round: the strategy's state, the config it ran under, and the
    digest and path of each site's shard of the same round."""

    round: int
    version: int
    config: dict[str, Any]
    strategy: tuple[dict[str, Any], Arrays]
    # client id -> {"digest": hex, "path": str}: each site's shard of this round (kept by the site)
    sites: dict[int, dict[str, Any]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    verified: bool = False  # the tag checked out against the job key


def checkpoint_path(directory: str | Path, round: int) -> Path:
    """The file of round `round`'s checkpoint; zero-padded so that names sort in round order."""
    return Path(directory) / f"ckpt-{round:06d}.h5"


def save(directory: str | Path, ckpt: Checkpoint, keep: int = 3, auth: sealed.FileAuth | None = None) -> Path:
    """Write `ckpt` atomically, tagged with `auth`, and keep only the newest `keep` checkpoints."""
    import h5py

    if auth is None:
        raise CheckpointError("a checkpoint needs a key to be authenticated (security.psk_env / psk_file / keys)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, ckpt.round)
    with atomic.atomic_path(final) as tmp:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"] = FORMAT
            f.attrs["format_version"] = FORMAT_VERSION
            f.attrs["round"] = ckpt.round
            f.attrs["version"] = ckpt.version
            f.attrs["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            f.attrs["config"] = json.dumps(ckpt.config, sort_keys=True, default=str)
            _write_group(f.create_group("strategy"), *ckpt.strategy)
            sites = f.create_group("sites")
            for cid in sorted(ckpt.sites):
                g = sites.create_group(str(cid))
                g.attrs["digest"] = str(ckpt.sites[cid]["digest"])
                g.attrs["path"] = str(ckpt.sites[cid]["path"])
                if "round" in ckpt.sites[cid]:
                    g.attrs["round"] = int(ckpt.sites[cid]["round"])
            _write_group(f.create_group("meta"), ckpt.meta, {})
        sealed.seal(tmp, auth)
    atomic.fsync_dir(directory)
    _prune(directory, keep)
    ckpt.path = final
    return final


def load(path: str | Path, auth: sealed.FileAuth | None = None) -> Checkpoint:
    """Read, bound and verify one checkpoint; raises CheckpointError naming the file and the problem.

    With `auth` the tag must verify (a forged or foreign file is refused); without it only
    corruption is detected (`hpcfed inspect` without the job key)."""
    path = Path(path)
    try:
        tree = sealed.read(path, auth, require_auth=auth is not None)
        root = tree.attrs.get("", {})
        if root.get("format") != FORMAT:
            raise CheckpointError(f"{path} is not an hpcfed checkpoint (format={root.get('format')!r})")
        strategy = _read_group(tree, "strategy")
        sites = {int(k): _site_ref(tree.attrs[f"sites/{k}"]) for k in tree.children("sites")}
        meta = _read_group(tree, "meta")[0]
        ck = Checkpoint(round=int(root["round"]), version=int(root["version"]),
                        config=json.loads(root["config"]), strategy=strategy, sites=sites,
                        meta=meta, path=path)
        ck.verified = tree.verified
        return ck
    except CheckpointError:
        raise
    except sealed.SealError as exc:
        raise CheckpointError(str(exc).replace(" is not a readable HDF5 file", ": unreadable checkpoint")) from None
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {exc})") from None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files, newest round first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def latest_valid(directory: str | Path, warn: Callable[[str], None] = print,
                 auth: sealed.FileAuth | None = None) -> Checkpoint | None:
    """The newest checkpoint that verifies; corrupt, forged or hostile ones are reported and skipped."""
    for path in list_checkpoints(directory):
        try:
            return load(path, auth)
        except CheckpointError as exc:
            warn(f"skipping checkpoint: {exc}")
    return None


# ----------------------------------------------------------------------------------------------


def _write_group(group: Any, header: dict[str, Any], arrays: Arrays) -> None:
    group.attrs["header"] = atomic.header_json(header)
    for name, value in arrays.items():
        arr = np.ascontiguousarray(value)
        # Names may contain '/', which h5py would read as nested groups; escape it.
        group.create_dataset(name.replace("/", "|"), data=arr)


def _read_group(tree: sealed.Tree, group: str) -> tuple[dict[str, Any], Arrays]:
    if group not in tree.groups:
        raise CheckpointError(f"{tree.path}: group /{group} is missing")
    header = json.loads(tree.attrs.get(group, {}).get("header", "{}"))
    if not isinstance(header, dict):
        raise CheckpointError(f"{tree.path}: /{group} header is not a mapping")
    arrays = {name.replace("|", "/"): tree.datasets[f"{group}/{name}"] for name in tree.children(group)
              if f"{group}/{name}" in tree.datasets}
    return header, arrays


def _site_ref(attrs: dict[str, Any]) -> dict[str, Any]:
    """One site's entry of the manifest: digest, path, and the round of a shard older than the checkpoint."""
    ref: dict[str, Any] = {"digest": str(attrs["digest"]), "path": str(attrs["path"])}
    if "round" in attrs:
        rnd = int(attrs["round"])  # a file that verified, but bound it all the same
        if rnd < 0:
            raise ValueError(f"site shard round {rnd} is negative")
        ref["round"] = rnd
    return ref


def _prune(directory: Path, keep: int) -> None:
    for old in list_checkpoints(directory)[max(1, keep):]:
        with contextlib.suppress(OSError):
            old.unlink()
    for stale in directory.glob(".ckpt-*.tmp*"):
        with contextlib.suppress(OSError):
            stale.unlink()
