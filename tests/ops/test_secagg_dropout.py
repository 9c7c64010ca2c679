"""Secure aggregation loses two sites to SIGKILL in one round (issue 22, "Dropout"): under `hpcfed
run` (`federation.on_client_failure=continue`, each rank under `hpcfed.rank_guard`), K = 8 sites,
round 1's keys set up ahead in round 0. In round 1 site 5 kills itself after sharing its keys, before
masking; site 2 just after it sent its masked input. Rank 0 learns of both from hydra's SIGUSR1
(`hpcfed.server.departures`) before it asks for the unmasking: both count as dropped, their pairwise
masks are removed with their rebuilt keys, and the round's sum is the six survivors' inputs, checked
against the plaintext each site fed the protocol (tests/privacy/secagg_spy.py)."""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, mpiexec
from ops_helpers import events, kill_all, output, start

pytestmark = pytest.mark.mpi

SPY = REPO / "tests" / "privacy" / "secagg_spy.py"
K, BEFORE, AFTER = 8, 5, 2


def _spy_launcher(tmp: Path, spy: Path) -> Path:
    """An mpiexec that starts the spy in place of ``python -m hpcfed`` (the rank guard stays)."""
    path = tmp / "mpiexec"
    path.write_text(f"""#!/bin/bash
args=()
while [ $# -gt 0 ]; do
  if [ "$1" = "-m" ] && [ "${{2:-}}" = "hpcfed" ]; then args+=("{SPY}" "{spy}" "-1"); shift 2
  else args+=("$1"); shift; fi
done
exec "{mpiexec()}" "${{args[@]}}"
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_two_sites_killed_before_and_after_masking_leave_the_survivors_sum(tmp_path):
    out, spy = tmp_path / "run", tmp_path / "spy"
    t0 = time.monotonic()
    proc = start(out, ["rounds=3", "checkpoint_every=0", "privacy.secure_aggregation=true", "influence.enabled=false",
                       "federation.on_client_failure=continue", "federation.quorum=0.5",
                       "federation.round_deadline_s=60"], np_=K + 1, launcher=str(_spy_launcher(tmp_path, spy)),
                 extra_env={"SPY_KILL": f"{BEFORE}:before,{AFTER}:after", "SPY_KILL_ROUND": "1", "SPY_HOLD_S": "3"})
    try:
        rc = proc.wait(timeout=150)
    finally:
        kill_all(out, proc)
    took, text = time.monotonic() - t0, output(proc)
    assert rc == 0, text[-4000:]
    assert "none on this node did" not in text, text[-3000:]  # both signals explained by the two local kills
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped_clients"] == [AFTER, BEFORE], summary["dropped"]
    assert all(d["round"] == 1 and "killed or crashed" in d["cause"] for d in summary["dropped"]), summary["dropped"]
    assert summary["evicted"] == [] and summary["privacy"]["secure_aggregation"] is True
    # dropped at once, not at the 60 s deadline
    assert max(e["value"] for e in events(out) if e["name"] == "round_time_s") < 30, took

    received = [json.loads(p.read_text()) for p in sorted((spy / "rank0").glob("*.json"))]
    masked1 = {h["source"] - 1 for h in received if h["kind"] == 16 and h["header"]["round"] == 1}
    assert masked1 == set(range(K)) - {BEFORE}  # site 2's masked input did reach rank 0 before it died
    assert not [h for h in received if h["kind"] in (12, 14) and h["header"]["round"] == 1]  # keys set up ahead

    sites = {(c, r): np.load(spy / f"site{c}-r{r}.npz") for c in range(K) for r in range(2)}
    survivors = [c for c in range(K) if c not in (AFTER, BEFORE)]

    def fedavg(who: list[int]) -> np.ndarray:
        w = np.array([float(sites[c, 1]["weight"]) for c in who])
        return sites[0, 1]["sent"] + (w[:, None] * np.stack([sites[c, 1]["delta"] for c in who])).sum(0) / w.sum()

    after1 = np.load(spy / f"site{survivors[0]}-r2.npz")["sent"]  # the model the survivors got for round 2
    assert np.abs(after1 - fedavg(survivors)).max() < 1e-5
    assert np.abs(after1 - fedavg([*survivors, AFTER])).max() > 1e-4  # site 2's masked input is not in it
    print(f"K={K}, two sites killed in round 1: run took {took:.1f} s")
