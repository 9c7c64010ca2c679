"""The canonical walk: reading kept datasets slice by slice and sealing in one bounded pass give
exactly `sealed`'s digest, so either side verifies what the other tagged."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcfed.store import sealed, walk

KEY = sealed.FileAuth.from_psk(b"w" * 32, "search-index")


def _state_file(path: Path) -> dict[str, np.ndarray]:
    """Every kind of dataset a state file may hold: big and small, chunked, big-endian, strings, scalars, empty."""
    rng = np.random.default_rng(0)
    arrays = {"blob": rng.integers(0, 255, size=300_000, dtype=np.uint8),
              "grid": rng.normal(size=(700, 33)).astype(">f4"), "empty": np.zeros((0, 4), np.int64),
              "one": np.asarray(7, np.int32)}
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "test"
        for name, value in arrays.items():
            f.create_dataset(name, data=value)
        f.create_dataset("g/chunked", data=rng.normal(size=5000).astype(np.float32), chunks=(512,), compression="gzip")
        f.create_dataset("g/names", data=np.array(["a", "bé"], dtype=object), dtype=h5py.string_dtype())
    return arrays


def test_slice_by_slice_reading_and_streamed_sealing_agree_with_sealed(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f.h5"
    arrays = _state_file(path)
    digest = walk.seal_streamed(path, KEY, block_bytes=64 << 10)  # blob, grid and g/chunked hashed in blocks
    assert sealed.read(path, KEY).digest == digest  # what sealed reads verifies what the walk sealed
    monkeypatch.setattr(walk, "HASH_SLICE_BYTES", 1000)  # many slices per kept dataset
    got = walk.read_verified(path, KEY)
    assert got.verified
    assert np.array_equal(got.datasets["blob"], arrays["blob"]) and got.datasets["grid"].dtype == np.dtype("<f4")
    assert np.array_equal(got.datasets["grid"], arrays["grid"]) and got.datasets["empty"].shape == (0, 4)
    assert int(got.datasets["one"]) == 7 and list(got.datasets["g/names"]) == ["a", "bé"]
    sealed.seal(path, KEY)  # and the other way round: the walk verifies what sealed tagged
    assert walk.read_verified(path, KEY).verified


def test_a_byte_changed_after_streamed_sealing_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "f.h5"
    _state_file(path)
    walk.seal_streamed(path, KEY, block_bytes=64 << 10)
    with h5py.File(path, "r+") as f:
        f["blob"][123_456] ^= 1
    with pytest.raises(sealed.SealError, match="checksum mismatch"):
        walk.read_verified(path, KEY)
    walk.seal_streamed(path, sealed.FileAuth.from_psk(b"x" * 32, "search-index"))
    with pytest.raises(sealed.SealError, match="authentication failed"):
        walk.read_verified(path, KEY)
