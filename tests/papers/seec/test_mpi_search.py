"""End to end under mpiexec: a doc2vec federation on gensim's corpus, then live search over
`mpiexec -n 3` (each site rank serves its own export over the secure channel) checked against the
offline search, and a mapping run with trained mappers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from tests.conftest import REPO, mpiexec, run_cli

pytestmark = pytest.mark.mpi

SMALL = ["task.dataset=gensim", "task.max_docs=80", "task.vector_size=16", "task.sample=0", "rounds=2",
         "task.total_epochs=2", "checkpoint_every=0"]


@pytest.fixture(scope="module")
def joint_run(tmp_path_factory) -> Path:
    """A small joint doc2vec federation under mpiexec (3 ranks), run once per module."""
    out = tmp_path_factory.mktemp("seec") / "joint"
    run_cli(["run", "configs/seec_20ng_joint.yaml", *SMALL, "--np", "3", "--out", str(out)], timeout=240)
    return out


def _live(args: list[str], np: int = 3, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HPCFED_PSK": "ab" * 32, "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [mpiexec(), "-n", str(np), sys.executable, "-m", "hpcfed", "search", "live", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)


def test_joint_run_writes_exports_and_models(joint_run: Path) -> None:
    summary = json.loads((joint_run / "summary.json").read_text())
    assert summary["clients"]["0"]["num_docs"] + summary["clients"]["1"]["num_docs"] == 80
    for k in (0, 1):
        with h5py.File(joint_run / "embeddings" / f"site{k}.h5", "r") as f:
            assert f["doc/vectors"].shape == (40, 16)
        assert (joint_run / "models" / f"site{k}.h5").is_file()
    # Joint learning really is joint: every round averaged both sites' uploads under the default
    # bounded influence (which used to refuse doc2vec's first steps, so each site trained alone).
    events = [json.loads(line) for line in (joint_run / "metrics.jsonl").read_text().splitlines()]
    assert [e["value"] for e in events if e["name"] == "num_updates"] == [2, 2]
    assert summary["rejected"]["runtime"] == {}


def test_live_search_matches_offline(joint_run: Path) -> None:
    query = ["--id", "3", "--text", "the bank and the government", "--home", "1", "--k", "4", "--compact"]
    live = _live([str(joint_run), *query])
    assert live.returncode == 0, live.stderr[-3000:]
    offline = run_cli(["search", "query", str(joint_run), *query])
    got, want = json.loads(live.stdout), json.loads(offline.stdout)
    assert got["queries"] == want["queries"]
    by_id, by_text = got["queries"]
    assert by_id["home"] == "1" and len(by_id["results"]) == 4
    assert "3" not in [r["id"] for r in by_id["results"]]  # the query itself is excluded
    assert {r["site"] for r in by_id["results"]} <= {"0", "1"}
    scores = [r["score"] for r in by_text["results"]]
    assert scores == sorted(scores, reverse=True)


def test_live_search_unknown_id_fails_cleanly(joint_run: Path) -> None:
    proc = _live([str(joint_run), "--id", "no-such-doc", "--timeout", "30"])
    assert proc.returncode != 0 and "no site holds id 'no-such-doc'" in proc.stderr


def test_live_search_uses_each_sites_index(joint_run: Path, tmp_path: Path) -> None:
    """With `hpcfed search index` run, every site rank searches through its index: the same answers
    as the offline search (and, for a flat index, as exact search); a foreign index stops the job."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(joint_run, run)
    env = {"HPCFED_KEYS_DIR": str(tmp_path / "keys")}
    run_cli(["search", "index", str(run), "--kind", "flat", "--quiet"], env=env)
    query = ["--id", "3", "--text", "the bank and the government", "--home", "1", "--k", "4", "--compact"]
    live = _live([str(run), *query], env=env)
    assert live.returncode == 0, live.stderr[-3000:]
    got = json.loads(live.stdout)["queries"]
    assert got == json.loads(run_cli(["search", "query", str(run), *query], env=env).stdout)["queries"]
    exact = json.loads(run_cli(["search", "query", str(run), *query, "--exact"], env=env).stdout)["queries"]
    assert [[r["id"] for r in q["results"]] for q in got] == [[r["id"] for r in q["results"]] for q in exact]
    shutil.copyfile(run / "embeddings" / "site1.doc.ann", run / "embeddings" / "site0.doc.ann")
    forged = _live([str(run), *query, "--timeout", "30"], env=env)
    assert forged.returncode != 0 and "built from another export" in forged.stderr


def test_mapping_run_and_mappers(tmp_path: Path) -> None:
    out = tmp_path / "mapping"
    run_cli(["run", "configs/seec_20ng_mapping.yaml", *SMALL, "task.public_corpus=gensim:lee.cor",
             "task.infer_epochs=5", "--np", "3", "--out", str(out)], timeout=240)
    with h5py.File(out / "embeddings" / "site0.h5", "r") as f:
        assert f["public/vectors"].shape[1] == 16 and f["public/vectors"].shape[0] > 0
    trained = json.loads(run_cli(["search", "train-mappers", str(out), "--epochs", "3", "--lr", "1e-3",
                                  "--hidden", "32"]).stdout)
    assert set(trained["mappers"]) == {"0->1", "1->0"}
    # sites in two vector spaces: each site standardizes its own scores before the merge
    query = ["--id", "5", "--mode", "mapping", "--k", "3", "--merge", "zscore"]
    live = _live([str(out), *query, "--compact"])
    assert live.returncode == 0, live.stderr[-3000:]
    res = json.loads(live.stdout)["queries"][0]["results"]
    offline = json.loads(run_cli(["search", "query", str(out), *query]).stdout)
    assert res == offline["queries"][0]["results"]
    assert res[0]["score"] > 0  # a z-score: the best of 40 documents lies above their mean
