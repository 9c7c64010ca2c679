"""One malicious site among three under the DEFAULT config, real mpiexec: the honest sites' test
accuracy stays within 0.05 of the no-attack run and no honest site is blamed
(the full table, with the async flood: tools/insider_attacks.py). The enormous update (`attack=scale`)
is tested in test_eviction_mpi.py: refused every round, never evicted, honest accuracy kept.

The quickstart as it is (8 rounds): the first round, with no history of typical distances, is
bounded by its own median distance (its uploads are parked until it is in), every later round by
the recent uploads'."""

from __future__ import annotations

import json
import re

import pytest
from conftest import REPO, run_cli

pytestmark = pytest.mark.mpi
HONEST = ("0", "1")
HOSTILE = 2  # the last client turns malicious (`attack=`), at rank 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("insider")
    out = {}
    for attack in (None, "claim_examples", "sign_flip"):
        folder = root / (attack or "baseline")
        run_cli(["run", "configs/quickstart.yaml", "--out", str(folder),
                 *([f"attack={attack}"] if attack else [])], np=4, timeout=400)
        out[attack] = json.loads((folder / "summary.json").read_text())
    return out


def _honest_mean(summary: dict) -> float:
    return sum(summary["clients"][c]["accuracy"] for c in HONEST) / len(HONEST)


@pytest.mark.parametrize("attack", ["claim_examples", "sign_flip"])
def test_one_malicious_site_costs_the_honest_ones_at_most_005(runs, attack):
    base, hit = runs[None], runs[attack]
    assert _honest_mean(base) > 0.5  # the federation learns at all
    assert _honest_mean(base) - _honest_mean(hit) <= 0.05, (_honest_mean(base), _honest_mean(hit))
    assert not hit["dropped_clients"] and not hit["missing_clients"]


@pytest.fixture(scope="module")
def fast_attacker_runs(tmp_path_factory):
    """Async FedAsync with the honest sites 4x slower than the last site, honest and then a sign
    flip x10: unbounded, it made most of the uploads and took the honest mean from 0.58 to 0.12."""
    root = tmp_path_factory.mktemp("fast_attacker")
    config = root / "quickstart_async.yaml"
    config.write_text((REPO / "configs" / "quickstart.yaml").read_text().replace("  weighting: num_examples\n", ""))
    out = {}
    for attack in (None, "sign_flip"):
        folder = root / (attack or "baseline")
        run_cli(["run", str(config), "--out", str(folder), "federation.mode=async", "strategy.name=fedasync",
                 "federation.slowdown={0: 4, 1: 4}", *([f"attack={attack}"] if attack else [])],
                np=4, timeout=400)
        refused = re.findall(r"rejected message from rank (\d+)", (folder / "logs" / "rank0.log").read_text())
        out[attack] = json.loads((folder / "summary.json").read_text()), refused
    return out


def test_a_fast_async_attacker_is_measured_from_what_it_was_sent_and_bounded(fast_attacker_runs):
    (base, base_refused), (hit, refused) = fast_attacker_runs[None], fast_attacker_runs["sign_flip"]
    assert _honest_mean(base) > 0.5
    # async runs are not repeatable (arrival order): measured drops -0.04 +- 0.03 over 4 pairs
    assert _honest_mean(base) - _honest_mean(hit) <= 0.1, (_honest_mean(base), _honest_mean(hit))
    assert not base_refused and refused and set(refused) == {"3"}  # only the attacker's
    assert not hit["dropped_clients"] and not hit["missing_clients"]


def test_no_honest_site_is_blamed(runs):
    assert not runs[None]["evicted"]  # an honest site is never evicted; a refused attacker may be
    assert all(e["client"] == HOSTILE for a in ("claim_examples", "sign_flip") for e in runs[a]["evicted"])
    assert runs[None]["rejected"]["runtime"].get("update out of range", 0) == 0
