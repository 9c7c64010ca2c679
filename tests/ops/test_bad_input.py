"""Malformed configs, keys, metrics and HDF5 files: each gets an error naming the file, key or row."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, run_cli

from hpcfed.config import ConfigError, load
from hpcfed.store import checkpoint as ck
from hpcfed.store.embeddings import ExportError, read_export, write_export
from hpcfed.store.sealed import FileAuth

QUICKSTART = REPO / "configs" / "quickstart.yaml"


# -- configs ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, match", [
    ("rounds: [1\n", r"bad\.yaml: not valid YAML"),
    ("- 1\n- 2\n", r"bad\.yaml: the top level must be a mapping"),
    ("roundz: 3\n", r"bad\.yaml: roundz: unknown key; allowed keys here: .*rounds"),
    ("federation:\n  quorum: most\n", r"bad\.yaml: federation\.quorum must be a number, got 'most'"),
    ("federation:\n  mode: fast\n", r"bad\.yaml: federation\.mode = 'fast' is not allowed; choose one of: sync, async"),
    ("federation:\n  slowdown: {x: 2}\n", r"bad\.yaml: federation\.slowdown\.x must be an integer"),
    ("security: psk\n", r"bad\.yaml: security\.? must be a mapping"),
    ("eval_every: true\n", r"bad\.yaml: eval_every must be an integer, got True"),
])
def test_malformed_config_names_file_and_key(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load(path)


def test_bad_overrides_name_the_key():
    with pytest.raises(ConfigError, match=r"federation\.quorom: unknown key"):
        load(QUICKSTART, ["federation.quorom=1"])
    with pytest.raises(ConfigError, match=r"override 'rounds' must look like key=value"):
        load(QUICKSTART, ["rounds"])
    with pytest.raises(ConfigError, match=r"rounds must be an integer, got 'abc'"):
        load(QUICKSTART, ["rounds=abc"])


def test_cli_config_errors_are_one_line_with_exit_code_2(tmp_path):
    missing = run_cli(["run", str(tmp_path / "nope.yaml"), "--np", "3", "--out", str(tmp_path / "o")],
                      check=False, timeout=120)
    assert missing.returncode == 2 and "nope.yaml does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = run_cli(["run", str(QUICKSTART), "federation.mode=fast", "--np", "3", "--out", str(tmp_path / "o")],
                  check=False, timeout=120)
    # the bad value came from the command line, not from quickstart.yaml
    assert bad.returncode == 2 and "command line (federation.mode=fast): federation.mode = 'fast' is not allowed" \
        in bad.stderr
    assert not (tmp_path / "o").exists()  # rejected before anything was launched


@pytest.mark.mpi
def test_unknown_task_option_is_named_even_inside_mpi(tmp_path):
    proc = run_cli(["run", str(QUICKSTART), "task.lrr=0.1", "--np", "3", "--out", str(tmp_path / "o")],
                   check=False, timeout=180)
    assert proc.returncode != 0
    assert "task.lrr: unknown key" in proc.stderr, proc.stderr[-2000:]


def test_bad_pre_shared_key_names_the_variable(tmp_path):
    from hpcfed.config import SecurityConfig
    from hpcfed.credentials import RankKeys

    def load_credentials(sec, rank):
        return RankKeys(sec, rank).credentials()

    os.environ.pop("HPCFED_TEST_PSK", None)
    with pytest.raises(ConfigError, match=r"no pre-shared key: set HPCFED_TEST_PSK"):
        load_credentials(SecurityConfig(psk_env="HPCFED_TEST_PSK"), 0)
    (tmp_path / "psk").write_text("not-hex\n")
    (tmp_path / "psk").chmod(0o644)
    with pytest.raises(ConfigError, match=rf"psk_file {tmp_path / 'psk'} is readable by others \(mode 0644\); "
                                          rf"run `chmod 600 {tmp_path / 'psk'}`"):
        load_credentials(SecurityConfig(psk_file=str(tmp_path / "psk")), 0)
    (tmp_path / "psk").chmod(0o640)
    with pytest.raises(ConfigError, match=r"readable by others \(mode 0640\)"):
        load_credentials(SecurityConfig(psk_file=str(tmp_path / "psk")), 0)
    (tmp_path / "psk").chmod(0o600)
    with pytest.raises(ConfigError, match=rf"security\.psk_file {tmp_path / 'psk'} is not hex"):
        load_credentials(SecurityConfig(psk_file=str(tmp_path / "psk")), 0)
    (tmp_path / "psk").write_text("ab" * 32)
    assert load_credentials(SecurityConfig(psk_file=str(tmp_path / "psk")), 0).psk == b"\xab" * 32


def test_malformed_authorized_keys_names_file_and_line(tmp_path):
    from hpcfed.comm.keys import load_public_keys

    path = tmp_path / "authorized_keys"
    path.write_text("# sites\nssh-ed25519 AAAA comment\n")
    with pytest.raises(ValueError, match=rf"{path}:2: expected 'hpcfed-ed25519 <base64 key>"):
        load_public_keys(path)


# -- checkpoints ----------------------------------------------------------------------------------------
KEY = FileAuth.from_psk(bytes(32), "checkpoint")  # the tests' job PSK (tests/conftest.py)


def _checkpoint(directory: Path, rnd: int) -> Path:
    state = ({"name": "fedavg"}, {"global": np.full(10, rnd, np.float32)})
    sites = {0: {"digest": "00" * 32, "path": "sites/0/shard.h5"}}
    return ck.save(directory, ck.Checkpoint(round=rnd, version=rnd + 1, config={"rounds": 9}, strategy=state,
                                            sites=sites, meta={"elapsed": 1.0}), keep=5, auth=KEY)


def _flip_dataset_value(path: Path) -> None:
    with h5py.File(path, "r+") as f:
        f["strategy/global"][0] = 123.0  # a silent bit rot: the file is still valid HDF5


def test_corrupt_checkpoints_are_named_and_skipped_for_the_previous_one(tmp_path):
    d = tmp_path / "checkpoints"
    good = _checkpoint(d, 1)
    rotten = _checkpoint(d, 2)
    truncated = _checkpoint(d, 3)
    garbage = _checkpoint(d, 4)
    _flip_dataset_value(rotten)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])  # a half-written file (no atomic rename)
    garbage.write_bytes(os.urandom(4096))
    for path, match in [(rotten, "checksum mismatch"), (truncated, "unreadable checkpoint"),
                        (garbage, "unreadable checkpoint")]:
        with pytest.raises(ck.CheckpointError, match=rf"{path}: {match}"):
            ck.load(path)
    warnings: list[str] = []
    newest = ck.latest_valid(d, warn=warnings.append)
    assert newest is not None and newest.path == good and newest.round == 1
    assert [w.split(": ")[1].split("/")[-1] for w in warnings] == [garbage.name, truncated.name, rotten.name]
    assert float(newest.strategy[1]["global"][0]) == 1.0


def test_non_checkpoint_hdf5_is_named(tmp_path):
    path = tmp_path / "ckpt-000001.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(ck.CheckpointError, match=rf"{path} is not an hpcfed checkpoint"):
        ck.load(path)


def test_cli_inspect_of_a_corrupt_checkpoint_names_it(tmp_path):
    path = _checkpoint(tmp_path, 5)
    path.write_bytes(path.read_bytes()[:200])
    proc = run_cli(["inspect", str(path)], check=False, timeout=120)
    assert proc.returncode == 2 and str(path) in proc.stderr and "Traceback" not in proc.stderr


# -- embedding exports ------------------------------------------------------------------------------------
def _export(path: Path) -> Path:
    return write_export(path, np.eye(4, 3, dtype=np.float32), ["a", "b", "c", "d"], np.arange(4), model="t", site=0)


def test_corrupt_embedding_exports_are_named(tmp_path):
    good = _export(tmp_path / "site0.h5")
    assert read_export(good).vectors.shape == (4, 3)
    garbage = tmp_path / "garbage.h5"
    garbage.write_bytes(os.urandom(2048))
    half = tmp_path / "half.h5"
    half.write_bytes(good.read_bytes()[: good.stat().st_size // 3])
    for path in (garbage, half):
        with pytest.raises(ExportError, match=rf"{path} is not a readable HDF5 file"):
            read_export(path)
    no_ids = tmp_path / "no_ids.h5"
    shutil.copyfile(good, no_ids)
    with h5py.File(no_ids, "r+") as f:
        del f["node/ids"]
    with pytest.raises(ExportError, match=rf"{no_ids}: /node/ids is missing"):
        read_export(no_ids)
    mismatch = tmp_path / "mismatch.h5"
    shutil.copyfile(good, mismatch)
    with h5py.File(mismatch, "r+") as f:
        del f["node/ids"]
        f["node/ids"] = np.array([b"a", b"b"])
    with pytest.raises(ExportError, match=r"vectors shape \(4, 3\) does not match 2 ids"):
        read_export(mismatch)
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as f:
        f["node/vectors"] = np.zeros((2, 2), np.float32)
    with pytest.raises(ExportError, match=rf"{foreign} is not an hpcfed embedding export"):
        read_export(foreign)


# -- metrics --------------------------------------------------------------------------------------------------
def test_metrics_file_with_bad_rows_names_the_row(tmp_path):
    from hpcfed.report import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"round": 0, "client": 0, "name": "loss", "value": 1.0, "time": 0.1}) + "\n"
                    + json.dumps({"round": 1, "client": "zero", "name": "loss", "value": 1.0, "time": 0.2}) + "\n"
                    + "garbage\n")
    m = read_metrics(path)
    assert m.num_records == 1
    assert m.skipped[0] == (2, "key 'client' must be an integer or null, got 'zero'")
    assert m.skipped[1][0] == 3 and m.skipped[1][1].startswith("not JSON")
