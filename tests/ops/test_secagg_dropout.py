"""Secure aggregation loses two sites to SIGKILL in one round (issue 22, "Dropout"): under `hpcfed
run` (`federation.on_client_failure=continue`, each rank under `hpcfed.launch.rank_guard`), K = 8 sites,
round 1's keys set up ahead in round 0. In round 1 site 5 kills itself after sharing its keys, before
masking; site 2 just after it sent its masked input. Rank 0 learns of both from hydra's SIGUSR1
(`hpcfed.server.departures`) before it asks for the unmasking: both count as dropped, their pairwise
masks are removed with their rebuilt keys, and the round's sum is the six survivors' inputs, checked
against the plaintext each site fed the protocol (tests/privacy/secagg_spy.py).

And a round lost, not the run: K = 6 sites, SecAgg+ degree 3, in round 1 two of site 1's three
neighbours (sites 0 and 4) die after sharing their keys. Only site 5 holds a share of site 1's self-mask
seed, the Shamir threshold is 2: the sum cannot be unmasked. Rank 0 sees it before asking anyone for a
share (or, when the two die as they are asked for their shares, once the answers fail to rebuild the
seed), folds nothing (the model stays), drops the dead, and round 2 runs with the four survivors on
fresh keys and round 2's graph, where every mask can be rebuilt."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from conftest import REPO
from ops_helpers import events, finish, kill_all, output, spy_launcher, start

from hpcfed import protocol as P
from hpcfed.store import checkpoint as ck

pytestmark = pytest.mark.mpi

SPY = REPO / "tests" / "privacy" / "secagg_spy.py"
K, BEFORE, AFTER = 8, 5, 2


def test_two_sites_killed_before_and_after_masking_leave_the_survivors_sum(tmp_path):
    out, spy = tmp_path / "run", tmp_path / "spy"
    t0 = time.monotonic()
    proc = start(out, ["rounds=3", "checkpoint_every=0", "privacy.secure_aggregation=true", "influence.enabled=false",
                       "federation.on_client_failure=continue", "federation.quorum=0.5",
                       "federation.round_deadline_s=60"], np_=K + 1,
                 launcher=str(spy_launcher(tmp_path, [str(SPY), str(spy), "-1"])),
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


# Rank 0 finds the loss before it asks for a share ("before": the two die before masking), or only
# when the shares do not rebuild the seed ("reveal": they die when asked for their shares).
LOST = {"before": ("site 1's self-mask seed needs 2 shares, but only 1 alive neighbour(s) hold one (5); its "
                   "neighbourhood: sites 0, 4, 5", set()),
        "reveal": ("site 1: its seed cannot be rebuilt (1 shares cannot rebuild a secret of threshold 2); no unmask "
                   "answer from site(s) 0, 4", {1, 2, 3, 5})}


@pytest.mark.parametrize("stage", sorted(LOST))
def test_a_neighbourhood_that_loses_too_many_sites_loses_its_round_not_the_run(tmp_path, stage):
    out, spy = tmp_path / "run", tmp_path / "spy"
    why, revealed_in_lost_round = LOST[stage]
    k, dead, survivors = 6, [0, 4], [1, 2, 3, 5]
    t0 = time.monotonic()
    proc = start(out, ["rounds=3", "checkpoint_every=2", "privacy.secure_aggregation=true", "privacy.secagg.degree=3",
                       "influence.enabled=false", "federation.on_client_failure=continue", "federation.quorum=0.5",
                       "federation.round_deadline_s=60"], np_=k + 1,
                 launcher=str(spy_launcher(tmp_path, [str(SPY), str(spy), "-1"])),
                 extra_env={"SPY_KILL": ",".join(f"{c}:{stage}" for c in dead), "SPY_KILL_ROUND": "1",
                            "SPY_HOLD_S": "3" if stage == "before" else "0"})
    text = finish(proc, out, timeout=120)
    took = time.monotonic() - t0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_rounds"] == [1] and summary["dropped_clients"] == dead, summary["dropped"]
    assert all(d["round"] == 1 and "killed or crashed" in d["cause"] for d in summary["dropped"]), summary["dropped"]
    assert summary["server_version"] == 3  # rounds 0 and 2 folded; round 1 folded nothing
    assert f"round 1 lost: secure aggregation cannot unmask its sum: {why}; ended: client 0 (rank 1), client 4 " \
           f"(rank 5)" in text, text[-3000:]
    rows = events(out)
    assert [(e["round"], e["value"]) for e in rows if e["name"] == "secagg_round_lost"] == [(1, 1)]
    assert {e["round"]: e["value"] for e in rows if e["name"] == "num_updates"} == {0: k, 1: 0, 2: len(survivors)}
    assert max(e["value"] for e in rows if e["name"] == "round_time_s") < 30, took

    received = [json.loads(p.read_text()) for p in sorted((spy / "rank0").glob("*.json"))]
    revealed = {r: {h["source"] - 1 for h in received if h["kind"] == P.SA_REVEAL and h["header"]["round"] == r}
                for r in (1, 2)}
    assert revealed == {1: revealed_in_lost_round, 2: set(survivors)}  # "before": no share asked for

    sites = {(c, r): np.load(spy / f"site{c}-r{r}.npz") for c in survivors for r in (1, 2)}
    sent1, sent2 = sites[survivors[0], 1]["sent"], sites[survivors[0], 2]["sent"]
    assert np.array_equal(sent2, sent1)  # the lost round left the model as it was
    assert all(np.array_equal(sites[c, 2]["sent"], sent2) for c in survivors)
    w = np.array([float(sites[c, 2]["weight"]) for c in survivors])
    want = sent2 + (w[:, None] * np.stack([sites[c, 2]["delta"] for c in survivors])).sum(0) / w.sum()
    final = ck.load(ck.checkpoint_path(out / "checkpoints", 2)).strategy[1]["global"]
    assert np.abs(final - want).max() < 1e-5  # round 2: the survivors' FedAvg, within fixed point
    lost = ck.load(ck.checkpoint_path(out / "checkpoints", 1))
    assert np.array_equal(lost.strategy[1]["global"], sent1) and sorted(lost.sites) == survivors
    assert list(lost.meta["lost_rounds"]) == [1]  # a --resume keeps the count
    times = [round(e["value"], 1) for e in rows if e["name"] == "round_time_s"]
    print(f"K={k}, round 1 lost to two deaths ({stage}) in one neighbourhood: run took {took:.1f} s, rounds {times} s")
