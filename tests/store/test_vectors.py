"""Streaming an export in blocks: the same digest and tag check as `sealed.read`, every vector handed
over once in order, and hostile files refused before their data is read."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from hpcfed.store import sealed
from hpcfed.store.embeddings import ExportError, seal_export, write_export
from hpcfed.store.vectors import read_header, stream_export

KEY = sealed.FileAuth.from_psk(b"k" * 32, "embeddings")


def _export(path: Path, n: int = 3000, d: int = 24, sealed_with: sealed.FileAuth | None = KEY) -> np.ndarray:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(n, d)).astype(np.float32)
    write_export(path, vectors, [f"d{i}" for i in range(n)], np.arange(n) % 4, entity="doc", model="m", site=3)
    write_export(path, rng.normal(size=(500, d)), [f"p{i}" for i in range(500)], entity="public", model="m",
                 site=3, append=True)
    if sealed_with is not None:
        seal_export(path, sealed_with)
    return vectors


def test_stream_matches_sealed_read_block_by_block(tmp_path: Path) -> None:
    path = tmp_path / "site3.h5"
    vectors = _export(path)
    blocks: list[tuple[int, np.ndarray]] = []
    rows: list[int] = []
    got = stream_export(path, "doc", KEY, lambda i, b: blocks.append((i, b.copy())), block_bytes=24 * 4 * 700,
                        progress=rows.append)
    assert got.verified and got.digest == sealed.read(path, KEY).digest.hex()
    assert len(blocks) > 1 and [i for i, _ in blocks] == list(np.cumsum([0] + [len(b) for _, b in blocks])[:-1])
    assert np.array_equal(np.concatenate([b for _, b in blocks]), vectors) and sum(rows) == 3000
    assert got.ids[:2] == ["d0", "d1"] and got.labels is not None and got.labels[:5].tolist() == [0, 1, 2, 3, 0]
    header = read_header(path)
    assert (header.entity, header.num_rows, header.dim, header.site) == ("doc", 3000, 24, "3")
    assert header.recorded_digest == got.digest
    public = stream_export(path, "public", None, lambda i, b: None)
    assert public.digest == got.digest and not public.verified and len(public.ids) == 500


def test_wrong_key_and_corruption_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "site3.h5"
    _export(path)
    with pytest.raises(ExportError, match="authentication failed"):
        stream_export(path, None, sealed.FileAuth.from_psk(b"z" * 32, "embeddings"), lambda i, b: None)
    with h5py.File(path, "r+") as f:
        f["doc/vectors"][5, 3] += 1.0
    with pytest.raises(ExportError, match="checksum mismatch"):
        stream_export(path, None, None, lambda i, b: None)
    unsealed = tmp_path / "plain.h5"
    _export(unsealed, sealed_with=None)
    assert not stream_export(unsealed, None, KEY, lambda i, b: None).verified  # no tag: says so


def test_hostile_layouts_are_refused(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.h5"
    _export(bomb, n=100, sealed_with=None)
    with h5py.File(bomb, "r+") as f:
        del f["doc/vectors"]
        f.create_dataset("doc/vectors", shape=(100, 24), dtype="f4", chunks=(10, 24))  # declared, never stored
        f.create_dataset("public/huge", shape=(1 << 26, 64), dtype="f4", chunks=(1024, 64))
    with pytest.raises(ExportError, match="refusing it"):
        stream_export(bomb, "doc", None, lambda i, b: None)
    linked = tmp_path / "linked.h5"
    _export(linked, n=100, sealed_with=None)
    with h5py.File(linked, "r+") as f:
        f["doc/extra"] = h5py.SoftLink("/public/vectors")
    with pytest.raises(ExportError, match="links are not allowed"):
        stream_export(linked, "doc", None, lambda i, b: None)
    with pytest.raises(ExportError, match="has no entity 'node'"):
        read_header(linked, "node")
    (tmp_path / "junk.h5").write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(ExportError, match="not a readable HDF5 file"):
        read_header(tmp_path / "junk.h5")
