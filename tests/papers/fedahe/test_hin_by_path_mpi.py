"""A HeCo folder by path with the shipped configs (issue 40): `configs/fedahe_hin.yaml` runs FedDWA,
Local and Centralized on a dblp-like folder made here (labelled authors, no splits), and the configs
tuned for ACM and AMiner fail with one line that names the folder's own meta-paths and the override."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli

pytestmark = pytest.mark.mpi

SMALL = ["task.dim=16", "task.pref_dim=4", "task.num_sample=10", "task.lr=0.01", "checkpoint_every=0"]


def dblp_like(folder: Path, seed: int = 0) -> Path:
    """90 labelled authors in 3 classes; each paper has two authors of one class, a conference and a
    term of that class (mostly): the HeCo dblp layout (pa, pc, pt), no feature or split files."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    labels = np.repeat(np.arange(3), 30)
    pa, pc, pt = [], [], []
    for p in range(180):
        c = p % 3
        for a in rng.choice(np.flatnonzero(labels == c), 2, replace=False):
            pa.append((p, a))
        pc.append((p, c if rng.random() < 0.9 else rng.integers(3)))
        pt.append((p, 2 * c + rng.integers(2)))
    for name, rows in (("pa", pa), ("pc", pc), ("pt", pt)):
        np.savetxt(folder / f"{name}.txt", rows, fmt="%d")
    np.save(folder / "labels.npy", labels.astype(np.float64))
    return folder


@pytest.mark.parametrize("method, np_ranks, rounds", [("feddwa", 4, 3), ("local", 4, 2), ("centralized", None, 2)])
def test_any_heco_folder_runs_with_the_generic_config(tmp_path: Path, method: str, np_ranks: int | None,
                                                      rounds: int) -> None:
    folder = dblp_like(tmp_path / "dblp")
    out = tmp_path / "run"
    run_cli(["run", "configs/fedahe_hin.yaml", f"task.dataset={folder}", f"method={method}", f"rounds={rounds}",
             "--out", str(out), *SMALL, *(["--np", str(np_ranks)] if np_ranks else [])], timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    sites = summary["clients"]
    assert len(sites) == (1 if method == "centralized" else 3)
    for site in sites.values():
        assert 0.0 <= site["micro_f1"] <= 1.0
        assert set(k for k in site if k.startswith("instances_")) == {"instances_APA", "instances_APCPA",
                                                                     "instances_APTPA"}


def test_a_tuned_config_by_path_names_the_folders_own_metapaths_and_the_override(tmp_path: Path) -> None:
    folder = dblp_like(tmp_path / "dblp")
    proc = run_cli(["run", "configs/fedahe_acm.yaml", f"task.dataset={folder}", "method=centralized", "rounds=1",
                    "--out", str(tmp_path / "a"), *SMALL], timeout=120, check=False)
    assert proc.returncode != 0
    assert "its own meta-paths are APA, APCPA, APTPA: set task.metapaths=null" in proc.stderr
    assert "configs/fedahe_hin.yaml" in proc.stderr
    proc = run_cli(["run", "configs/fedahe_acm.yaml", f"task.dataset={folder}", "task.metapaths=null",
                    "--np", "3", "rounds=1", "--out", str(tmp_path / "b"), *SMALL], timeout=120, check=False)
    assert proc.returncode != 0
    assert "partition=by_type needs partition_type" in proc.stderr and "task.partition=random" in proc.stderr
