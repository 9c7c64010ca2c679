"""Where datasets live: the data root.

Order: an explicit path (config ``data_root`` or ``--data-root``), then ``$HPCFED_DATA``, then
``~/.cache/hpcfed/data``. On this project's machines the shared copies sit in ``../shared/data``;
point ``HPCFED_DATA`` there. Datasets are never copied into the repository.
"""

from __future__ import annotations

import os
from pathlib import Path


class DataError(ValueError):
    """A dataset is missing or malformed; the message names the file, row or column."""


def data_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The data root: `explicit`, else $HPCFED_DATA, else ~/.cache/hpcfed/data."""
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get("HPCFED_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hpcfed" / "data"


def dataset_dir(name: str, explicit: str | os.PathLike[str] | None = None) -> Path:
    """Folder of dataset `name` (e.g. ``hin/acm``) under the data root, or a DataError saying how to get it."""
    path = data_root(explicit) / name
    if not path.exists():
        raise DataError(
            f"dataset {name!r} not found at {path}; set HPCFED_DATA (or data_root in the config) "
            f"to the folder that holds it (see data_manifest.yaml for sources)"
        )
    return path
