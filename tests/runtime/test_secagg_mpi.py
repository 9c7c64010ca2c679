"""Secure aggregation under `mpiexec -n 5` (4 sites), with a test-side spy (tests/privacy/secagg_spy.py)
recording everything rank 0 decrypts and what each site fed the protocol; site 3 goes silent in
round 0 after it shared its keys (a dropout after share submission).

- Rank 0 never receives an UPDATE; no vector it received is correlated with any site's plaintext
  update or fixed-point input, and no masked input agrees with its site's codes beyond chance.
- The aggregate equals plain FedAvg (the example-weighted mean of the clipped deltas) of the sites
  whose inputs are in the round, within quantisation: round 0 without site 3, round 1 with all four.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from conftest import REPO, mpiexec

from hpcfed.store import checkpoint as ck

pytestmark = pytest.mark.mpi

SPY = REPO / "tests" / "privacy" / "secagg_spy.py"
DEADLINE_S = 4


def _run(out: Path, spy: Path) -> subprocess.CompletedProcess:
    cmd = [mpiexec(), "-n", "5", sys.executable, str(SPY), str(spy), "3", "run", "configs/quickstart.yaml",
           "--out", str(out), "rounds=2", "checkpoint_every=1", "privacy.secure_aggregation=true",
           "influence.enabled=false", "federation.quorum=0.75", f"federation.round_deadline_s={DEADLINE_S}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HPCFED_PSK": "00" * 32, "SPY_SILENT_S": str(DEADLINE_S + 2)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    return abs(float(np.corrcoef(a.astype(np.float64), b.astype(np.float64))[0, 1]))


def test_rank0_sees_only_masked_inputs_and_the_sum_equals_fedavg_of_the_survivors(tmp_path):
    out, spy = tmp_path / "run", tmp_path / "spy"
    _run(out, spy)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["privacy"]["secure_aggregation"] is True and summary["evicted"] == []
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(e["round"], e["client"]) for e in events if e["name"] == "straggler"] == [(0, 3)]

    sites = {(c, r): np.load(spy / f"site{c}-r{r}.npz") for c in range(4) for r in range(2)}
    size = sites[0, 0]["sent"].size
    received = [(json.loads(p.with_suffix(".json").read_text()), np.load(p))
                for p in sorted((spy / "rank0").glob("*.npz"))]
    kinds = [h["kind"] for h, _ in received]
    assert 4 not in kinds  # no UPDATE: no site's model crossed in the clear
    masked = [(h, t["masked"]) for h, t in received if h["kind"] == 16]
    assert len(masked) == 8  # 4 sites x 2 rounds (site 3's round-0 input came late, refused as stale)
    for header, y in masked:
        site, rnd = header["source"] - 1, header["header"]["round"]
        assert "num_examples" not in header["header"]  # the weight travels masked only
        assert np.mean(y == sites[site, rnd]["codes"]) < 0.01
    vectors = [v for _, t in received for v in t.values() if v.size >= size]
    assert len(vectors) >= 8
    for v in vectors:  # every vector rank 0 decrypted, against every site's plaintext of every round
        for s in sites.values():
            assert _corr(v.ravel()[:size], s["delta"]) < 0.15 and _corr(v.ravel()[:size + 1], s["codes"]) < 0.15

    def fedavg(rnd: int, who: list[int]) -> np.ndarray:
        w = np.array([float(sites[c, rnd]["weight"]) for c in who])
        deltas = np.stack([sites[c, rnd]["delta"] for c in who])
        return sites[who[0], rnd]["sent"] + (w[:, None] * deltas).sum(0) / w.sum()

    after0 = sites[0, 1]["sent"]  # the model every site received for round 1
    assert all(np.array_equal(after0, sites[c, 1]["sent"]) for c in range(4))
    assert np.abs(after0 - fedavg(0, [0, 1, 2])).max() < 1e-5
    assert np.abs(after0 - fedavg(0, [0, 1, 2, 3])).max() > 1e-4  # site 3's late input is not in it
    with h5py.File(ck.list_checkpoints(out / "checkpoints")[0], "r") as f:  # the newest: round 1's
        final = f["strategy/global"][()]
    assert np.abs(final - fedavg(1, [0, 1, 2, 3])).max() < 1e-5
