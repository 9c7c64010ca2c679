import numpy as np
import pytest

from hpcfed.store import checkpoint as ck
from hpcfed.store.embeddings import ExportError, read_export, write_export
from hpcfed.store.inspect import inspect_file
from hpcfed.store.sealed import FileAuth

KEY = FileAuth.from_psk(bytes(32), "checkpoint")  # the tests' job PSK (tests/conftest.py)


def _ckpt(r: int) -> ck.Checkpoint:
    return ck.Checkpoint(round=r, version=r + 1, config={"name": "t", "seed": 0},
                         strategy=({"version": r + 1}, {"global": np.arange(5, dtype=np.float32) * r}),
                         sites={0: {"digest": "ab" * 32, "path": "/node/local/sites/0/shard-000001.h5"}},
                         meta={"elapsed": 1.5})


def test_roundtrip_and_prune(tmp_path):
    for r in range(5):
        ck.save(tmp_path, _ckpt(r), keep=2, auth=KEY)
    files = ck.list_checkpoints(tmp_path)
    assert [p.name for p in files] == ["ckpt-000004.h5", "ckpt-000003.h5"]
    got = ck.load(files[0])
    assert got.round == 4 and got.version == 5
    np.testing.assert_array_equal(got.strategy[1]["global"], np.arange(5, dtype=np.float32) * 4)
    assert got.sites == {0: {"digest": "ab" * 32, "path": "/node/local/sites/0/shard-000001.h5"}}
    assert not list(tmp_path.glob(".ckpt-*"))


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    ck.save(tmp_path, _ckpt(1), keep=3, auth=KEY)
    newest = ck.save(tmp_path, _ckpt(2), keep=3, auth=KEY)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2 :] = b"\0" * (len(data) - len(data) // 2)  # half-written file
    newest.write_bytes(bytes(data))
    warnings = []
    got = ck.latest_valid(tmp_path, warn=warnings.append)
    assert got is not None and got.round == 1
    assert warnings and "ckpt-000002.h5" in warnings[0]


def test_bit_flip_is_detected_by_checksum(tmp_path):
    import h5py

    path = ck.save(tmp_path, _ckpt(3), auth=KEY)
    with h5py.File(path, "r+") as f:
        f["strategy/global"][0] = 42.0
    with pytest.raises(ck.CheckpointError, match="checksum mismatch"):
        ck.load(path)


def test_not_a_checkpoint(tmp_path):
    p = tmp_path / "ckpt-000001.h5"
    p.write_bytes(b"garbage")
    with pytest.raises(ck.CheckpointError, match="unreadable checkpoint"):
        ck.load(p)
    assert ck.latest_valid(tmp_path, warn=lambda m: None) is None


def test_embedding_export_roundtrip_and_inspect(tmp_path):
    vec = np.random.default_rng(0).normal(size=(7, 3)).astype(np.float32)
    path = write_export(tmp_path / "site0.h5", vec, [f"n{i}" for i in range(7)], np.arange(7), model="m", site=0,
                        config_hash="abc", version=2)
    emb = read_export(path)
    np.testing.assert_array_equal(emb.vectors, vec)
    assert emb.ids[3] == "n3" and emb.attrs["dim"] == 3 and emb.attrs["metric"] == "cosine"
    text = inspect_file(path)
    assert "7 x 3" in text and "hpcfed embedding export" in text
    assert "checksum OK" in inspect_file(ck.save(tmp_path / "c", _ckpt(1), auth=KEY))
    with pytest.raises(ExportError, match="ids for"):
        write_export(tmp_path / "bad.h5", vec, ["a"], model="m", site=0)


def test_a_dropped_sites_older_shard_keeps_its_round(tmp_path):
    ckpt = _ckpt(7)
    ckpt.sites[1] = {"digest": "cd" * 32, "path": "/node/local/sites/1/shard-000003.h5", "round": 3}
    ck.save(tmp_path, ckpt, keep=2, auth=KEY)
    got = ck.load(ck.list_checkpoints(tmp_path)[0], KEY)
    assert got.sites[1] == {"digest": "cd" * 32, "path": "/node/local/sites/1/shard-000003.h5", "round": 3}
    assert "round" not in got.sites[0]  # a shard of the checkpoint's own round carries none


def test_a_negative_shard_round_is_refused(tmp_path):
    ckpt = _ckpt(2)
    ckpt.sites[1] = {"digest": "cd" * 32, "path": "/node/local/sites/1/shard-000001.h5", "round": -1}
    path = ck.save(tmp_path, ckpt, keep=2, auth=KEY)
    with pytest.raises(ck.CheckpointError, match="negative"):
        ck.load(path, KEY)
