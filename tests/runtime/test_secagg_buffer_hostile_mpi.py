"""Group testing across secure asynchronous buffers, real mpiexec: 4 sites in buffers of 2 (secure
FedBuff, quickstart), the last site sending random field elements in place of every input
(``attack=garbage``), under the default federation.on_client_failure=abort.

- Each buffer it lands in is refused and folds nothing, and the run neither halts nor stalls on it:
  a refused sum is evidence, not a failure.
- The refusals narrow to it: while evidence is pending a buffer holds at most one suspected site,
  so its next buffer has another partner; it is evicted on that proof (two refused sums whose only
  common member it is), never on one refused sum, and no honest site is evicted.
- After the eviction every buffer is folded, and the run ends with the honest sites' uploads."""

from __future__ import annotations

import json

import pytest
from conftest import NUMPY_SITES, run_cli

pytestmark = pytest.mark.mpi
K, HOSTILE = 4, 3


def test_a_member_sending_garbage_is_narrowed_down_across_buffers_and_evicted_on_proof(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(["run", "configs/quickstart_fedbuff.yaml", NUMPY_SITES,
                    "--out", str(out), "rounds=3", "checkpoint_every=0",
                    "eval_every=0", "privacy.secure_aggregation=true", "influence.enabled=false",
                    "federation.buffer_size=2", "federation.round_deadline_s=60", "attack=garbage"], np=K + 1,
                   timeout=300)
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    refused = [e["round"] for e in events if e["name"] == "secagg_sum_refused"]
    (ev,) = summary["evicted"]
    assert (ev["client"], ev["rank"]) == (HOSTILE, HOSTILE + 1)
    assert ev["reason"].startswith("secure sum refused: the refused sums of buffers ")
    assert f"isolate site {HOSTILE}" in ev["reason"] and " and " in ev["reason"]  # two refusals at least
    assert ev["first_evidence"].startswith(f"buffer {refused[0]}: the secure sum of sites [")
    assert len(refused) >= 2 and ev["round"] == refused[-1]  # not evicted on the first refusal
    assert f"{HOSTILE}]" in ev["first_evidence"]  # the hostile site was in the first refused sum
    assert summary["lost_rounds"] == refused and not summary["dropped_clients"]
    assert summary["updates_accepted"] == 3 * K  # the honest sites' uploads made the budget
    assert sorted(summary["clients"]) == ["0", "1", "2"]
    text = proc.stdout + proc.stderr
    assert "secure sum of sites" in text and "is refused, and nothing of it is folded" in text
