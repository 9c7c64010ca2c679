"""`data_manifest.yaml`: where each dataset comes from, its terms, and how to check a local copy.

``hpcfed data verify [NAME ...]`` recomputes each dataset's tree digest under the data root (SHA-256
over the sorted list of ``relative path + file SHA-256``) and compares it with the manifest.
``hpcfed data fetch NAME`` downloads a dataset that has a direct ``download`` URL (where the internet
is reachable) into the data root and verifies it. Datasets are never copied into the repository.
"""

from __future__ import annotations

import hashlib
import tarfile
import urllib.request
from pathlib import Path
from typing import Any

from hpcfed.config import load_yaml
from hpcfed.data.root import DataError, data_root

MANIFEST = Path(__file__).resolve().parents[2] / "data_manifest.yaml"


def load_manifest(path: Path = MANIFEST) -> dict[str, dict[str, Any]]:
    """The `datasets:` mapping of data_manifest.yaml (name -> entry); DataError if absent or malformed."""
    if not path.is_file():
        raise DataError(f"{path} not found; it ships with the hpcfed source tree")
    data = load_yaml(path.read_text(), str(path)) or {}
    datasets = data.get("datasets")
    if not isinstance(datasets, dict):
        raise DataError(f"{path}: expected a top-level 'datasets:' mapping")
    return datasets


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_digest(folder: Path) -> tuple[str, int]:
    """SHA-256 over every file's relative path and content hash, in sorted order; and the file count."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.relative_to(folder).as_posix()}\0{file_sha256(p)}\n".encode())
    return h.hexdigest(), len(files)


def verify(names: list[str] | None = None, root: Path | None = None) -> dict[str, str]:
    """Check local copies; returns name -> 'ok' | 'missing' | 'MISMATCH ...'."""
    manifest = load_manifest()
    root = root or data_root()
    out = {}
    for name in names or sorted(manifest):
        if name not in manifest:
            raise DataError(f"unknown dataset {name!r}; data_manifest.yaml lists: {', '.join(sorted(manifest))}")
        entry = manifest[name]
        folder = root / entry["path"]
        if not folder.exists():
            out[name] = "missing"
            continue
        digest, count = tree_digest(folder)
        if digest == entry["digest"] and count == entry["files"]:
            out[name] = "ok"
        else:
            out[name] = (f"MISMATCH ({count} files, digest {digest[:12]}..., "
                         f"expected {entry['files']} files, {entry['digest'][:12]}...)")
    return out


def fetch(name: str, root: Path | None = None) -> Path:
    """Download dataset `name` into the data root (unpacking a tarball); returns its folder."""
    manifest = load_manifest()
    if name not in manifest:
        raise DataError(f"unknown dataset {name!r}; data_manifest.yaml lists: {', '.join(sorted(manifest))}")
    entry = manifest[name]
    url = entry.get("download")
    if not url:
        raise DataError(f"{name} has no direct download; get it from {entry.get('source')} "
                        f"(terms: {entry.get('terms')}) and place it at <data root>/{entry['path']}")
    folder: Path = (root or data_root()) / entry["path"]
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / Path(url).name
    urllib.request.urlretrieve(url, target)
    if entry.get("unpack") and tarfile.is_tarfile(target):
        with tarfile.open(target) as tar:
            tar.extractall(folder, filter="data")
    return folder
