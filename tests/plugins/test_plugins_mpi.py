"""Under real mpiexec: a federation of a plugin task (import path) and a plugin strategy (entry point of
an "installed" package), and its resumed twin, which must end with the same bits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import h5py
import pytest
from conftest import run_cli

from hpcfed.store import checkpoint as ck
from hpcfed.store import site_state
from hpcfed.store.embeddings import read_export
from hpcfed.store.sealed import FileAuth

# The `plugin_root` / `plugin_path` fixtures: pytest loads them from the helper module by name (a
# conftest.py here would displace tests/conftest.py, which test modules import as `conftest`).
pytest_plugins = ["plugin_source"]

pytestmark = pytest.mark.mpi

CONFIG = """\
name: plugins
seed: 5
rounds: 3
checkpoint_every: 1
device: auto
federation: {mode: sync, round_deadline_s: 120, client_timeout_s: 300}
strategy: {name: myfedavgm, momentum: 0.5}
task: {name: "myplug.task:BlobTask", lr: 0.01, classes: 3, samples: 64}
"""


def _env(plugin_root: Path) -> dict:
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(plugin_root), os.environ.get("PYTHONPATH", "")) if p),
            "OMP_NUM_THREADS": "1"}


def _final(out: Path) -> tuple[bytes, bytes, dict]:
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:
        arrays = (f["strategy/global"][()].tobytes(), f["strategy/velocity"][()].tobytes())
    return (*arrays, json.loads((out / "summary.json").read_text())["clients"])


@pytest.fixture(scope="module")
def runs(plugin_root, tmp_path_factory) -> dict:
    """A plugin federation run through, then taken back to round 0 (its newer checkpoints deleted) and
    resumed: the outputs are the resumed run's, its final state is compared with the first's."""
    base = tmp_path_factory.mktemp("pluginruns")
    config = base / "plugins.yaml"
    config.write_text(CONFIG)
    env = _env(plugin_root)
    out = base / "run"
    run_cli(["run", str(config), "--out", str(out)], np=3, timeout=300, env=env)
    uninterrupted = _final(out)
    for newer in ck.list_checkpoints(out / "checkpoints")[:-1]:  # newest first: all but round 0
        newer.unlink()
    (out / "summary.json").unlink()
    assert ck.latest_valid(out / "checkpoints").round == 0
    run_cli(["run", str(config), "--out", str(out), "--resume"], np=3, timeout=300, env=env)
    return {"out": out, "uninterrupted": uninterrupted, "config": config}


def test_plugin_federation_runs_and_writes_its_outputs(runs):
    out = runs["out"]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["clients"]) == {"0", "1"}
    for site in ("0", "1"):
        assert 0.0 <= summary["clients"][site]["accuracy"] <= 1.0
    newest = ck.latest_valid(out / "checkpoints")
    # only the trainable tensors travel: the frozen first-layer weight (16 x 8) is not in the global model
    assert newest.strategy[1]["global"].size == 16 + 16 * 16 + 16 + 16 + 16 + 3 * 16 + 3
    assert newest.strategy[1]["velocity"].shape == newest.strategy[1]["global"].shape
    shard = site_state.load_shard(out / "sites" / "0", newest.round, newest.sites[0]["digest"], 0,
                                  FileAuth.from_psk(bytes(32), "site-shard"))
    assert any(k.startswith("local/") for k in shard[1])  # the personal part stays at its site
    emb = read_export(out / "embeddings" / "site1.h5")
    assert emb.vectors.shape == (64, 16)


def test_resumed_plugin_run_matches_uninterrupted_bit_for_bit(runs):
    assert _final(runs["out"]) == runs["uninterrupted"]


def test_unknown_plugin_option_is_one_line_before_launch(runs, plugin_root):
    proc = run_cli(["run", str(runs["config"]), "--np", "3", "task.colour=red"], env=_env(plugin_root), check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "task.colour: unknown key" in lines[0], proc.stderr
