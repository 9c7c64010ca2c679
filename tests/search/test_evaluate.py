"""`hpcfed eval`: sim_k against a central run, label precision, the cross-site view, any run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hpcfed.cli.commands import main as cli_main
from hpcfed.search.evaluate import auto_mode, score
from hpcfed.store.embeddings import export_path, write_export


def _runs(tmp_path: Path, **attrs: object) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(40, 5)).astype(np.float32)
    ids = [f"d{i}" for i in range(40)]
    labels = np.arange(40) % 4
    write_export(export_path(tmp_path / "central", 0), vectors, ids, labels, entity="doc", model="t", site=0)
    for site, rows in ((0, slice(0, 25)), (1, slice(25, 40))):
        write_export(export_path(tmp_path / "fed", site), vectors[rows], ids[rows], labels[rows], entity="doc",
                     model="t", site=site, extra=dict(attrs))
    return tmp_path / "central", tmp_path / "fed"


def test_scores_a_federation_against_the_central_run(tmp_path: Path) -> None:
    central, fed = _runs(tmp_path)
    same = score(central, fed, mode="joint", k=10)
    assert same["sim_10"] == 1.0 and same["num_queries"] == 40
    assert same["label_precision_at_10"] == same["central_label_precision_at_10"]
    # the other site's answers alone agree with the central top-10 among that site's documents
    assert same["cross_site_sim_10"] == 1.0 and 0.0 < same["remote_share_of_results"] < 1.0
    summary = json.loads((fed / "summary.json").read_text())
    assert summary["sim_10"] == 1.0 and summary["sim_k"]["joint"]["k"] == 10
    inter = score(central, fed, mode="joint", k=10, merge="interleave")
    assert inter["remote_share_of_results"] == 0.5  # 5 answers from each site, whatever their scores
    assert 0.0 < inter["sim_10"] < 1.0 and inter["cross_site_sim_10"] == 1.0
    summary = json.loads((fed / "summary.json").read_text())
    assert summary["sim_10"] == 1.0 and summary["sim_10_joint_interleave"] == inter["sim_10"]
    # site 1's space flipped: its answers no longer agree with the central ones
    rng = np.random.default_rng(0)
    flipped_vectors = -rng.normal(size=(40, 5)).astype(np.float32)[25:]
    write_export(export_path(fed, 1), flipped_vectors, [f"d{i}" for i in range(25, 40)], np.arange(25, 40) % 4,
                 entity="doc", model="t", site=1)
    flipped = score(central, fed, mode="joint", k=10)
    assert flipped["sim_10"] < 1.0 and flipped["cross_site_sim_10"] < 1.0


def test_any_run_without_a_central_one_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, fed = _runs(tmp_path)
    assert cli_main(["eval", str(fed), "--no-write", "--k", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "joint" and out["num_queries"] == 40
    assert {"label_precision_at_5", "cross_site_label_precision_at_5", "remote_share_of_results"} <= set(out)
    assert "sim_5" not in out and not (fed / "summary.json").exists()
    assert cli_main(["eval", str(fed), "--central", str(fed)]) == 2  # two sites are no centralized run
    assert "exactly one site" in capsys.readouterr().err


def test_auto_mode_follows_what_the_exports_say(tmp_path: Path) -> None:
    _, fed = _runs(tmp_path / "a", model="dame-gat")
    assert auto_mode(fed, None, None) == "nomapping"
    _, fed = _runs(tmp_path / "b", mode="mapping")
    assert auto_mode(fed, None, None) == "nomapping"  # no mappers trained yet
    (fed / "mappers").mkdir()
    (fed / "mappers" / "m0_1.h5").write_bytes(b"")
    assert auto_mode(fed, None, None) == "mapping"


def test_runs_sharing_no_document(tmp_path: Path) -> None:
    central, fed = _runs(tmp_path)
    write_export(export_path(central, 0), np.ones((2, 5), np.float32), ["x", "y"], None, entity="doc", model="t",
                 site=0)
    with pytest.raises(ValueError, match="share no document id"):
        score(central, fed, k=3, write_summary=False)
