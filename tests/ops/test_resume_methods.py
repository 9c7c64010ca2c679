"""Every method resumes from its site-local checkpoints under real mpiexec (issue 13): a synchronous
run taken back to round 1 (its newer checkpoint deleted, as an operator rolls a federation back)
and resumed with `--resume` ends with the same final metrics as the uninterrupted run, for DAMe
(SEGA on the server, BOLA/GLECC and the local model on each site), Ditto (a personal model per site)
and federated doc2vec (gensim's model and vocabulary on each site); asynchronous FedDWA halts,
resumes and completes its update budget. (A run halted after round 1 resumes the same way:
tests/runtime/test_federation_mpi.py; rolling back saves the third launch: the uninterrupted run
is also the one resumed.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli

from hpcfed.store import checkpoint as ck

pytestmark = pytest.mark.mpi

DAME = ["configs/dame_crisis.yaml", "seed=0", "federation.round_deadline_s=300", "federation.client_timeout_s=600",
        "strategy.probe_nodes=60", "strategy.probe_edge_prob=0.1",
        'task.sites=["synthetic:0","synthetic:2"]',
        "task.text_model=hashing:32", "task.text_dim=32", "task.hidden=8", "task.heads=2", "task.out_dim=8",
        "task.fanouts=[5,10]", "task.batch_size=100", "task.bola_calls=3", "task.bola_init=2",
        "task.feature_cache=false"]
DOC2VEC = ["configs/seec_20ng_joint.yaml", "task.dataset=gensim", "task.max_docs=80", "task.vector_size=16",
           "task.sample=0", "task.total_epochs=3"]
# Two sites for DAMe and Ditto (3 ranks, not 4, on CI's 2 cores: a quarter less work per run, and
# the tests ran 3 runs each): every piece of state a site or the server resumes (SEGA's, BOLA's,
# GLECC's, the local and the personal models) exists with two sites as with three, and the two
# sites' data differ (keyword blocks shifted by 2), so a site restoring the other's shard shows too.
SYNC = {"dame": ([*DAME, "method=dame"], 3), "ditto": ([*DAME, "method=ditto"], 3), "doc2vec": (DOC2VEC, 3)}


def _run(args: list[str], out: Path, np_: int, *extra: str) -> None:
    run_cli(["run", args[0], "--out", str(out), *args[1:], "rounds=3", "checkpoint_every=1", *extra], np=np_,
            timeout=420, env={"OMP_NUM_THREADS": "1"})


def _final(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    return {cid: {k: v for k, v in site.items() if "time" not in k} for cid, site in summary["clients"].items()}


@pytest.mark.parametrize("method", sorted(SYNC))
def test_sync_method_rolled_back_to_round_1_and_resumed_ends_like_the_uninterrupted_run(method, tmp_path):
    args, np_ = SYNC[method]
    out = tmp_path / "run"
    _run(args, out, np_)
    uninterrupted = _final(out)
    shards = sorted(p.relative_to(out).as_posix() for p in (out / "sites").rglob("*.h5"))
    assert len(shards) >= np_ - 1, shards  # each site's own state, beside the run, not in rank 0's files
    # Back to round 1: every site still holds its round-1 shard (keep_checkpoints = 3), and the
    # server names the one each must load; nothing newer may leak into the resumed state.
    (out / "checkpoints" / "ckpt-000002.h5").unlink()
    (out / "summary.json").unlink()
    assert ck.latest_valid(out / "checkpoints").round == 1
    _run(args, out, np_, "--resume")
    assert _final(out) == uninterrupted
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if r["name"] == "round_time_s"] == [0, 1, 2]  # round 2 once, rerun


def test_async_feddwa_resumes_and_completes_its_budget(tmp_path):
    out = tmp_path / "dwa"
    small = ["configs/fedahe_synthetic.yaml", "method=feddwa", "task.dim=16", "task.pref_dim=4",
             "task.synthetic={papers_per_class: 30, authors_per_class: 15, train_per_class: 6, val_per_class: 6}"]
    _run(small, out, 4, "halt_after_round=2")
    halted = ck.latest_valid(out / "checkpoints").round
    # The first three uploads wait for their bounds and are accepted together (0 -> 3): the halt
    # comes after the batch, with every folded upload counted in the checkpoint.
    assert halted == 3 and not (out / "summary.json").exists()
    _run(small, out, 4, "--resume")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["updates_accepted"] == 9 and sorted(summary["clients"]) == ["0", "1", "2"]
