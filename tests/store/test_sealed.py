"""Authenticated, bounded state files: forged, linked, external, virtual and oversize files are refused
(and `latest_valid` falls back to the older good checkpoint); `inspect`/`search` say so in one line."""

import json

import h5py
import numpy as np
import pytest
from conftest import run_cli

from hpcfed.store import checkpoint as ck
from hpcfed.store import sealed
from hpcfed.store.embeddings import ExportError, read_export, seal_export, write_export
from hpcfed.store.sealed import FileAuth, SealError

PSK = bytes(32)  # the tests' job PSK (tests/conftest.py sets HPCFED_PSK to 64 zeros)
KEY = FileAuth.from_psk(PSK, "checkpoint")


def _save(directory, rnd):
    state = ({"name": "fedavg"}, {"global": np.full(10, rnd, np.float32)})
    return ck.save(directory, ck.Checkpoint(round=rnd, version=rnd + 1, config={"rounds": 9}, strategy=state,
                                            meta={"elapsed": 1.0}), keep=5, auth=KEY)


def _reforge(path):
    """What an attacker with write access to the run directory can do: recompute the digest."""
    with h5py.File(path, "r+") as f:
        info = json.loads(f.attrs[sealed.AUTH_ATTR])
        del f.attrs[sealed.AUTH_ATTR]
    digest = sealed.read(path, None, require_auth=False).digest
    info["digest"] = digest.hex()
    with h5py.File(path, "r+") as f:
        f.attrs[sealed.AUTH_ATTR] = json.dumps(info)


def test_forged_checkpoint_is_refused_and_the_older_one_used(tmp_path):
    good = _save(tmp_path, 1)
    forged = _save(tmp_path, 2)
    assert ck.load(forged, KEY).verified
    with h5py.File(forged, "r+") as f:
        f["strategy/global"][0] = 99.0
    _reforge(forged)
    ck.load(forged)  # without the key only corruption is detectable: the recomputed digest matches
    with pytest.raises(ck.CheckpointError, match="authentication failed"):
        ck.load(forged, KEY)
    warned = []
    got = ck.latest_valid(tmp_path, warn=warned.append, auth=KEY)
    assert got.path == good and got.verified and "ckpt-000002.h5" in warned[0]
    # another job's key, or another purpose's key, does not verify either
    for other in (FileAuth.from_psk(b"\1" * 32, "checkpoint"), FileAuth.from_psk(PSK, "site-shard")):
        with pytest.raises(ck.CheckpointError, match="authentication failed"):
            ck.load(good, other)


def test_attribute_edits_and_untagged_files_are_refused(tmp_path):
    path = _save(tmp_path, 3)
    with h5py.File(path, "r+") as f:
        f.attrs["round"] = 7  # replay as a later round
    _reforge(path)
    with pytest.raises(ck.CheckpointError, match="authentication failed"):
        ck.load(path, KEY)
    with h5py.File(path, "r+") as f:
        del f.attrs[sealed.AUTH_ATTR]
    with pytest.raises(ck.CheckpointError, match="not authenticated"):
        ck.load(path, KEY)


def test_keys_mode_signature(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    ident = Ed25519PrivateKey.generate()
    auth = FileAuth.from_identity(ident, "checkpoint")
    state = ({}, {"global": np.ones(4, np.float32)})
    path = ck.save(tmp_path, ck.Checkpoint(round=0, version=1, config={}, strategy=state), auth=auth)
    assert ck.load(path, FileAuth.from_public_key(ident.public_key(), "checkpoint")).verified
    with pytest.raises(ck.CheckpointError, match="authentication failed"):
        ck.load(path, FileAuth.from_identity(Ed25519PrivateKey.generate(), "checkpoint"))


@pytest.mark.parametrize("kind", ["soft", "external", "hard-cycle", "external-storage", "virtual", "reference"])
def test_links_external_and_virtual_datasets_are_refused(tmp_path, kind):
    good = _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(4, dtype=np.float32)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(4, dtype=np.float32).tobytes())
    with h5py.File(bad, "r+") as f:
        if kind == "soft":
            f["strategy/link"] = h5py.SoftLink("/strategy/global")
        elif kind == "external":
            f["strategy/link"] = h5py.ExternalLink(str(other), "/x")
        elif kind == "hard-cycle":
            f["strategy/loop"] = f["strategy"]  # a second hard link to a group: a cycle
        elif kind == "external-storage":
            f.create_dataset("strategy/ext", shape=(4,), dtype="f4", external=[(str(raw), 0, 16)])
        elif kind == "virtual":
            layout = h5py.VirtualLayout(shape=(4,), dtype="f4")
            layout[:] = h5py.VirtualSource(str(other), "x", shape=(4,))
            f.create_virtual_dataset("strategy/virt", layout)
        else:
            f.create_dataset("strategy/ref", data=[f["strategy"].ref], dtype=h5py.ref_dtype)
    with pytest.raises(ck.CheckpointError, match=str(bad)):
        ck.load(bad, KEY)
    with pytest.raises(ck.CheckpointError):
        ck.load(bad)  # refused even without a key: nothing outside the file is ever read
    assert ck.latest_valid(tmp_path, warn=lambda m: None, auth=KEY).path == good


def test_oversize_declaration_is_refused_before_allocating(tmp_path):
    good = _save(tmp_path, 1)
    bomb = tmp_path / "ckpt-000002.h5"
    for chunks in (None, (1 << 16,)):
        with h5py.File(bomb, "w") as f:
            f.attrs["format"] = ck.FORMAT
            f.create_dataset("strategy/global", shape=(1 << 30,), dtype="f8", chunks=chunks)  # 8 GiB declared
        assert bomb.stat().st_size < 100_000
        with pytest.raises(ck.CheckpointError, match="declares"):
            ck.load(bomb, KEY)
        assert ck.latest_valid(tmp_path, warn=lambda m: None, auth=KEY).path == good
    proc = run_cli(["inspect", str(bomb)], check=False, timeout=120)
    assert proc.returncode == 2 and "declares" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def _export(path):
    vec = np.eye(4, 3, dtype=np.float32)
    write_export(path, vec, ["a", "b", "c", "d"], np.arange(4), model="t", site=0)
    return path


def test_exports_are_tagged_verified_and_bounded(tmp_path, monkeypatch):
    path = _export(tmp_path / "embeddings" / "site0.h5")
    monkeypatch.delenv("HPCFED_STATE_KEY", raising=False)
    assert not read_export(path).verified
    seal_export(path, FileAuth.from_psk(PSK, "embeddings"))
    monkeypatch.setenv("HPCFED_STATE_KEY", PSK.hex())
    assert read_export(path).verified
    assert "authenticated with the job key" in run_cli(["inspect", str(path)], timeout=120).stdout
    with h5py.File(path, "r+") as f:
        f["node/vectors"][0, 0] = 5.0
    _reforge(path)
    with pytest.raises(ExportError, match="authentication failed"):
        read_export(path)
    bomb = tmp_path / "bomb" / "embeddings" / "site0.h5"
    bomb.parent.mkdir(parents=True)
    with h5py.File(bomb, "w") as f:
        f.attrs["format"] = "hpcfed-embeddings"
        f.create_dataset("node/vectors", shape=(1 << 28, 8), dtype="f4", chunks=(1024, 8))
        f.create_dataset("node/ids", data=np.array(["a"], dtype=object), dtype=h5py.string_dtype())
    assert bomb.stat().st_size < 20_000
    for args in (["inspect", str(bomb)], ["search", "query", str(bomb.parent.parent), "--id", "a"]):
        proc = run_cli(args, check=False, timeout=120)
        refused = "declares" in proc.stderr or "does not match ids shape" in proc.stderr  # before any array is read
        assert proc.returncode == 2 and refused and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_declared_sizes_and_object_counts_are_bounded(tmp_path):
    path = tmp_path / "deep.h5"
    with h5py.File(path, "w") as f:
        f.create_group("/".join(["g"] * (sealed.MAX_DEPTH + 2)))
    with pytest.raises(SealError, match="nested deeper"):
        sealed.read(path, None, require_auth=False)
