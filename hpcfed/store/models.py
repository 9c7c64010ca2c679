"""Model files in HDF5: what a site keeps of a trained model (a gensim model for inference of new
text, a search mapper), written atomically and read back bounded, never with pickle.

Layout: the file attribute ``format`` names the kind (``hpcfed-gensim``, ``hpcfed-mapper``); other
file attributes are scalars (settings); datasets are arrays, or UTF-8 strings (a vocabulary).
Reading goes through `hpcfed.store.sealed`, as embedding exports do: links, external or virtual
storage and declared sizes the file does not hold are refused before anything is allocated, and a
tag, when the file carries one, must check out.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcfed.store import atomic, sealed

AttrValue = str | int | float | bool


class ModelFileError(ValueError):
    """A model file is missing, corrupt, hostile or not of the kind asked for; the message names it."""


@dataclass(frozen=True)
class ModelFile:
    """A model file read back: its scalar attributes and its arrays by dataset name."""

    attrs: dict[str, AttrValue]
    arrays: dict[str, np.ndarray]
    verified: bool  # it carried a tag that checked out against the key given


def write_model_file(path: str | Path, fmt: str, attrs: Mapping[str, AttrValue], arrays: Mapping[str, np.ndarray],
                     *, strings: Mapping[str, Sequence[str]] | None = None,
                     compress: Collection[str] = ()) -> Path:
    """Write a model file of kind `fmt` atomically: scalar `attrs`, numeric `arrays` (gzip for the
    names in `compress`) and UTF-8 string datasets `strings`."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = fmt
        for key, value in attrs.items():
            f.attrs[key] = value
        for name, words in (strings or {}).items():
            f.create_dataset(name, data=np.array(list(words), dtype=object), dtype=h5py.string_dtype("utf-8"))
        for name, array in arrays.items():
            f.create_dataset(name, data=array, compression="gzip" if name in compress else None)
    return path


def read_model_file(path: str | Path, fmt: str, *, what: str, missing_hint: str, required: Collection[str] = (),
                    auth: sealed.FileAuth | None = None) -> ModelFile:
    """Read a model file of kind `fmt`, bounded; `what` names the kind in errors ("model file"),
    `missing_hint` says where such a file comes from, `required` lists the datasets it must hold."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{what} {path} does not exist; {missing_hint}")
    try:
        tree = sealed.read(path, auth, require_auth=False)
    except sealed.SealError as exc:
        raise ModelFileError(f"{exc}; write the {what} again") from None
    attrs = {key: _scalar(value, path, key) for key, value in tree.attrs.get("", {}).items()}
    if attrs.get("format") != fmt:
        raise ModelFileError(f"{path} is not an hpcfed {what} (attribute format={attrs.get('format')!r}, "
                             f"expected {fmt!r})")
    missing = sorted(set(required) - set(tree.datasets))
    if missing:
        raise ModelFileError(f"{path}: dataset /{missing[0]} is missing; write the {what} again")
    return ModelFile(attrs=attrs, arrays=dict(tree.datasets), verified=tree.verified)


def _scalar(value: object, path: Path, key: str) -> AttrValue:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (str, int, float, bool)):
        return value
    raise ModelFileError(f"{path}: attribute {key!r} is not a single value; write the file again")
