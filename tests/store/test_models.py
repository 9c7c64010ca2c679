"""Model files (hpcfed/store/models.py): written atomically, read back bounded; a hostile or foreign
file is refused in one line naming it."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcfed.store import sealed
from hpcfed.store.models import ModelFile, ModelFileError, read_model_file, write_model_file

PSK = bytes(range(32))


def _write(path: Path) -> Path:
    return write_model_file(path, "hpcfed-test", {"site": "1", "settings.dim": 3, "settings.alpha": 0.5},
                            {"w": np.arange(6, dtype=np.float32).reshape(2, 3)},
                            strings={"words": ["a", "ünï", "c"]}, compress=("w",))


def _read(path: Path, **kw) -> ModelFile:
    return read_model_file(path, "hpcfed-test", what="test file", missing_hint="write one first", **kw)


def test_round_trip(tmp_path):
    stored = read_model_file(_write(tmp_path / "sub" / "m.h5"), "hpcfed-test", what="test file",
                             missing_hint="write one first", required=("w", "words"))
    assert stored.attrs == {"format": "hpcfed-test", "site": "1", "settings.dim": 3, "settings.alpha": 0.5}
    assert stored.arrays["w"].tolist() == [[0, 1, 2], [3, 4, 5]] and list(stored.arrays["words"]) == ["a", "ünï", "c"]
    assert not stored.verified


@pytest.mark.parametrize("make, message", [
    (lambda p: None, r"test file .*m\.h5 does not exist; write one first"),
    (lambda p: p.write_bytes(b"not hdf5"), r"m\.h5 is not a readable HDF5 file"),
    (lambda p: write_model_file(p, "hpcfed-other", {}, {}),
     r"is not an hpcfed test file \(attribute format='hpcfed-other'"),
    (lambda p: write_model_file(p, "hpcfed-test", {}, {}), r"dataset /w is missing; write the test file again"),
])
def test_missing_foreign_or_incomplete_files_are_one_line_errors(tmp_path, make, message):
    path = tmp_path / "m.h5"
    make(path)
    with pytest.raises(ModelFileError, match=message) as err:
        _read(path, required=("w",))
    assert "\n" not in str(err.value)


def test_hostile_files_are_refused_before_they_are_read(tmp_path):
    linked = tmp_path / "linked.h5"
    with h5py.File(linked, "w") as f:
        f.attrs["format"] = "hpcfed-test"
        f["w"] = h5py.ExternalLink("/etc/passwd", "/x")
    with pytest.raises(ModelFileError, match="link"):
        _read(linked)
    liar = tmp_path / "liar.h5"
    with h5py.File(liar, "w") as f:
        f.attrs["format"] = "hpcfed-test"
        f.create_dataset("w", shape=(1 << 40,), dtype=np.float32, chunks=(1024,), compression="gzip")
    with pytest.raises(ModelFileError, match=r"declares .* but the file stores"):
        _read(liar)


def test_a_tagged_file_must_check_out(tmp_path):
    path = _write(tmp_path / "m.h5")
    auth = sealed.FileAuth.from_psk(PSK, "models")
    sealed.seal(path, auth)
    assert _read(path, auth=auth).verified
    with h5py.File(path, "r+") as f:
        f["w"][0, 0] = 99.0
    with pytest.raises(ModelFileError, match="checksum mismatch"):
        _read(path)
