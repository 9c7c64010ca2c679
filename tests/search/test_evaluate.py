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


def _colliding_sites(tmp_path: Path, names_1: list[str]) -> Path:
    """Two sites whose documents pair up (site 1's doc i lies next to site 0's doc i) and whose label
    numbers are equal pair by pair, each site numbering its own events from 0 (as DAMe's sites do)."""
    rng = np.random.default_rng(1)
    base = rng.normal(size=(12, 8)).astype(np.float32)
    numbers = np.arange(12) % 2
    write_export(export_path(tmp_path, 0), base, [f"a{i}" for i in range(12)], numbers, entity="message",
                 model="t", site=0, extra={"label_names": json.dumps(["quake", "flood"])})
    write_export(export_path(tmp_path, 1), base + np.float32(1e-3), [f"b{i}" for i in range(12)], numbers,
                 entity="message", model="t", site=1, extra={"label_names": json.dumps(names_1)})
    return tmp_path


def test_cross_site_label_figures_compare_names_not_numbers(tmp_path: Path) -> None:
    """Issue 40: sites sharing no event scored 0.12 cross-site precision because label 0 at one site was
    compared with label 0 at another. Names decide: no shared name, 0; the same events numbered the
    other way round, 1."""
    apart = score(None, _colliding_sites(tmp_path / "apart", ["fire", "haze"]), mode="nomapping", k=1,
                  write_summary=False)
    assert apart["cross_site_label_precision_at_1"] == 0.0
    assert apart["label_precision_at_1"] == 0.0  # the nearest answer is the other site's twin
    swapped = _colliding_sites(tmp_path / "swapped", ["flood", "quake"])  # numbers differ, names agree...
    rng = np.random.default_rng(1)
    base = rng.normal(size=(12, 8)).astype(np.float32)
    write_export(export_path(swapped, 1), base + np.float32(1e-3), [f"b{i}" for i in range(12)],
                 1 - np.arange(12) % 2, entity="message", model="t", site=1,
                 extra={"label_names": json.dumps(["flood", "quake"])})  # ...once site 1 numbers them its way
    same = score(None, swapped, mode="nomapping", k=1, write_summary=False)
    assert same["cross_site_label_precision_at_1"] == 1.0 and same["label_precision_at_1"] == 1.0


@pytest.mark.usefixtures("own_keys")
def test_search_query_picks_the_mode_and_index_says_how_to_verify(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 40: `search query` on a DAMe run refused the joint default, naming --mode nomapping; it now
    picks it as `hpcfed eval` does. `search index` printed "export_verified": false with no hint."""
    from hpcfed.credentials import job_key_path

    _, fed = _runs(tmp_path, model="dame-gat")
    assert cli_main(["search", "query", str(fed), "--id", "d0", "--k", "3", "--compact"]) == 0
    assert json.loads(capsys.readouterr().out)["queries"][0]["mode"] == "nomapping"
    assert cli_main(["search", "index", str(fed), "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["indexes"][0]["export_verified"] is False and "HPCFED_STATE_KEY" in out["hint"]
    key = job_key_path(fed)
    key.parent.mkdir(parents=True, exist_ok=True)
    key.write_text("ab" * 32)
    assert cli_main(["search", "index", str(fed), "--quiet", "--force"]) == 0
    assert f"export HPCFED_STATE_KEY=$(cat {key})" in json.loads(capsys.readouterr().out)["hint"]
