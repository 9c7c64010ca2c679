"""Group testing under secure aggregation, real mpiexec at K = 6 (quickstart, 8 rounds, the last
site hostile; docs/threats.md, "Finding a site that breaks the encoding"):

- a site sending random field elements every round is isolated by disjoint group sums and evicted
  on that proof, the run completes, and the honest sites end within 0.05 of the run without it;
  no sum rank 0 sees covers fewer than privacy.secagg.min_group sites; round 0, whose whole sum is
  refused, is retried in groups on the same inputs (its honest groups' sums folded);
- a site that sends garbage once costs its group's share of that one round and is not evicted;
- a rank 0 that asks for a group smaller than min_group, or for overlapping groups, is refused by
  the sites, naming the rule (tests/privacy/hostile_groups.py plays that rank 0)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import NUMPY_SITES, REPO, mpiexec, run_cli

pytestmark = pytest.mark.mpi
K, HOSTILE = 6, 5
HONEST = [str(c) for c in range(K - 1)]
ARGS = ["rounds=8", "privacy.secure_aggregation=true", "influence.enabled=false", "federation.round_deadline_s=60"]


def _run(folder, *extra):
    proc = run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES,
                    "--out", str(folder), *ARGS, *extra], np=K + 1, timeout=500)
    events = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return json.loads((folder / "summary.json").read_text()), events, proc


def _honest_mean(summary):
    return sum(summary["clients"][c]["accuracy"] for c in HONEST) / len(HONEST)


def _named(events, name):
    return [(e["round"], e["value"]) for e in events if e["name"] == name]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    summary, _, _ = _run(tmp_path_factory.mktemp("clean") / "run", f"federation.exclude_sites=[{HOSTILE}]")
    return summary


def test_a_site_sending_garbage_every_round_is_isolated_and_evicted_on_proof(tmp_path, clean):
    summary, events, proc = _run(tmp_path / "run", "attack=garbage")
    (ev,) = summary["evicted"]
    assert (ev["client"], ev["rank"]) == (HOSTILE, HOSTILE + 1)
    assert ev["reason"].startswith("secure sum refused: group sums of rounds 0")
    assert f"isolate site {HOSTILE}" in ev["reason"] and ev["round"] <= 3  # ceil(log2 6) + 2 rounds: 0..4
    assert ev["first_evidence"].startswith("round 0: the secure sum of sites [0, 1, 2, 3, 4, 5] was refused")
    assert sorted(summary["clients"]) == HONEST and not summary["dropped_clients"]
    assert abs(_honest_mean(summary) - _honest_mean(clean)) <= 0.05
    assert min(v for _, v in _named(events, "secagg_smallest_sum")) >= 2
    assert _named(events, "secagg_retried") == [(0, 1)] and _named(events, "secagg_groups")[0][0] == 0
    assert all(r <= ev["round"] for r, _ in _named(events, "secagg_sum_refused"))  # none after the eviction
    assert "group request refused" not in proc.stdout + proc.stderr  # an honest server is never refused


def test_a_site_that_sends_garbage_once_costs_one_round_and_is_not_evicted(tmp_path, clean):
    summary, events, _ = _run(tmp_path / "run", "attack=garbage_once")
    assert summary["evicted"] == [] and sorted(summary["clients"]) == [*HONEST, str(HOSTILE)]
    assert _named(events, "secagg_sum_refused") == [(0, 1), (0, 1)]  # the whole sum, then its group's in the retry
    assert [r for r, _ in _named(events, "secagg_groups")] == [0, 1, 2]  # the retry, two quiet group rounds
    assert min(v for _, v in _named(events, "secagg_smallest_sum")) >= 2


@pytest.mark.parametrize("groups, rule", [
    ([[0], [1, 2, 3, 4, 5]], "(rule 'min_group'): group [0] has 1 site(s), fewer than privacy.secagg.min_group=2"),
    ([[0, 1, 2], [2, 3, 4, 5]], "(rule 'partition'): groups overlap: site 2 is named twice"),
])
def test_a_server_asking_for_a_small_or_overlapping_group_is_refused_naming_the_rule(tmp_path, groups, rule):
    cmd = [mpiexec(), "-n", str(K + 1), sys.executable, str(REPO / "tests" / "privacy" / "hostile_groups.py"),
           json.dumps(groups), "run", "configs/quickstart.yaml", NUMPY_SITES, "--out", str(tmp_path / "run"), *ARGS,
           "rounds=3", "attack=garbage", "federation.on_client_failure=continue"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HPCFED_PSK": "00" * 32}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    # each rank's own log too: the first site to refuse leaves, and mpiexec may end the job before
    # its console line (or any other's) is forwarded
    logs = "".join(p.read_text() for p in sorted((tmp_path / "run" / "logs").glob("rank*.log")))
    out = proc.stdout + proc.stderr + logs
    refusals = [line for line in out.splitlines() if "secure aggregation refused in round 0: group request refused "
                + rule in line]  # round 0's retry in groups, after its whole sum was refused
    assert refusals, out[-5000:]
    assert "the secure sum of group" not in out and "round 1: the securely" not in out  # nothing unmasked


def test_a_min_group_above_the_number_of_sites_is_refused_in_one_line_naming_the_key(tmp_path):
    proc = run_cli(["run", "configs/quickstart.yaml", NUMPY_SITES, "--out", str(tmp_path / "run"), "rounds=1",
                    "privacy.secure_aggregation=true", "influence.enabled=false", "privacy.secagg.min_group=3"],
                   np=3, timeout=300, check=False)
    assert proc.returncode != 0
    assert ("privacy.secagg.min_group=3 is above the 2 sites of this run: no sum could be revealed; set it to 2..2"
            in proc.stdout + proc.stderr)
