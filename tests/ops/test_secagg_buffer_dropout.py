"""Secure buffered async aggregation loses two members of one buffer to SIGKILL: under `hpcfed run`
(`federation.on_client_failure=continue`, each rank under `hpcfed.launch.rank_guard`), K = 6 sites,
buffers of 6. In buffer 1 site 4 kills itself once invited (its epoch keys relayed to the others),
before masking; site 1 just after it sent its masked input. Rank 0 learns of both from hydra's SIGUSR1
(`hpcfed.server.departures`) before it asks for the unmasking: the buffer completes with the four
survivors (its step is their staleness-weighted mean, checked against what each fed the protocol:
tests/privacy/buffer_spy.py), and the run goes on with buffers of the four."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import NUMPY_SITES, REPO
from ops_helpers import events, finish, spy_launcher, start

from hpcfed.privacy.buffered import StalenessRule

pytestmark = pytest.mark.mpi

SPY = REPO / "tests" / "privacy" / "buffer_spy.py"
K, BEFORE, AFTER = 6, 4, 1


def test_a_buffer_that_loses_a_member_before_and_one_after_masking_completes_and_the_run_goes_on(tmp_path):
    out, spy = tmp_path / "run", tmp_path / "spy"
    proc = start(out, [NUMPY_SITES, "rounds=3", "checkpoint_every=0", "eval_every=0", "privacy.secure_aggregation=true",
                       "influence.enabled=false", "federation.on_client_failure=continue",
                       f"federation.buffer_size={K}", "federation.round_deadline_s=60"], np_=K + 1,
                 config="configs/quickstart_fedbuff.yaml",
                 launcher=str(spy_launcher(tmp_path, [str(SPY), str(spy)])),
                 extra_env={"SPY_KILL": f"{BEFORE}:before,{AFTER}:after", "SPY_KILL_BUFFER": "1", "SPY_HOLD_S": "3"})
    finish(proc, out, timeout=240)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dropped_clients"] == [AFTER, BEFORE], summary["dropped"]
    assert summary["evicted"] == [] and summary["privacy"]["secure_aggregation"] is True
    buffers = [(e["round"], e["value"]) for e in events(out) if e["name"] == "num_updates"]
    assert buffers[0] == (K, K) and buffers[1] == (K + 4, 4)  # buffer 1 folded the four survivors
    assert len(buffers) >= 3 and all(n == 4 for _, n in buffers[1:])  # and the run went on with them
    assert not [e for e in events(out) if e["name"] == "secagg_round_lost"]

    fed = {c: dict(np.load(spy / f"site{c}-b1.npz")) for c in range(K)}
    survivors = [c for c in range(K) if c not in (AFTER, BEFORE)]
    rule = StalenessRule()

    def step(who: list[int]) -> np.ndarray:
        q = np.array([rule.units(int(fed[c]["staleness"]), 65536) for c in who], dtype=np.float64)
        return (q[:, None] * np.stack([fed[c]["delta"] for c in who])).sum(0) / q.sum()

    after = np.load(spy / f"site{survivors[0]}-b2.npz")["sent"]  # the model the survivors got after buffer 1
    assert np.abs(after - fed[0]["sent"] - step(survivors)).max() < 1e-5
    assert np.abs(after - fed[0]["sent"] - step([*survivors, AFTER])).max() > 1e-4  # site 1's input is not in it
