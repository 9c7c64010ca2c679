"""A new user's documents with no code (issue 40): a texts file and a labels file -> `hpcfed data
import-docs` -> SEEC joint and centralized under mpiexec -> `hpcfed eval`, labels compared by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.mpi

TOPICS = {"crude": "oil barrel opec crude refinery pipeline energy", "grain": "wheat corn harvest grain farm crop",
          "ship": "port vessel cargo tanker harbour freight"}
SMALL = ["task.vector_size=16", "task.sample=0", "task.min_count=1", "rounds=2", "task.total_epochs=2",
         "checkpoint_every=0"]


def test_texts_and_labels_files_to_joint_and_central_runs_and_eval(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    texts, labels = [], []
    for n in range(90):
        name = list(TOPICS)[n % 3]
        words = TOPICS[name].split()
        texts.append(" ".join(rng.choice(words, 12)))
        labels.append(name)
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    (tmp_path / "labels.txt").write_text("\n".join(labels) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    proc = run_cli(["data", "import-docs", "--texts", str(tmp_path / "texts.txt"), "--labels",
                    str(tmp_path / "labels.txt"), "--out", str(corpus)])
    assert "kept 90 of 90 rows; 3 labels" in proc.stdout
    data = ["task.dataset=file", f"task.path={corpus}", *SMALL]
    fed, central = tmp_path / "fed", tmp_path / "central"
    run_cli(["run", "configs/seec_20ng_joint.yaml", "--np", "3", "--out", str(fed), *data], timeout=300)
    run_cli(["run", "configs/seec_20ng_joint.yaml", "--np", "2", "method=centralized", "--out", str(central), *data],
            timeout=300)
    out = json.loads(run_cli(["eval", str(fed), "--central", str(central), "--k", "5"]).stdout)
    assert out["mode"] == "joint" and out["num_queries"] == 90
    for figure in ("sim_5", "label_precision_at_5", "cross_site_label_precision_at_5",
                   "central_label_precision_at_5"):
        assert 0.0 <= out[figure] <= 1.0
    summary = json.loads((fed / "summary.json").read_text())
    assert summary["sim_5"] == out["sim_5"]
    query = run_cli(["search", "query", str(fed), "--id", "0", "--k", "3", "--compact"])
    hits = json.loads(query.stdout)["queries"][0]["results"]
    assert {h["label_name"] for h in hits} <= set(TOPICS)  # the labels' names came through
