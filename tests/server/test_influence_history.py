"""Bounded influence judges a refusal against the site's own history too, and only a bound no honest
step comes near counts toward eviction: a site that jumps beyond ten times the model's own scale
after an accepted upload does; one beyond the typical and its own steps is refused, never counted."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.config import InfluenceConfig
from hpcfed.server.influence import InfluenceGuard, Refused

REF = np.zeros(4, dtype=np.float32)


def _step(length: float) -> np.ndarray:
    return np.array([length, 0, 0, 0], dtype=np.float32)


def _round(guard: InfluenceGuard, lengths: dict[int, float]) -> dict[int, str]:
    """One round of uploads of the given lengths: per site "ok" or the refusal (evidence or not)."""
    guard.begin_round(set(lengths))
    out = {}
    for cid, length in lengths.items():
        try:
            guard.bound(cid, _step(length), REF)
            out[cid] = "ok"
        except Refused as exc:
            out[cid] = "evidence" if exc.evidence else "refused"
    guard.settle()
    return out


def test_an_honest_site_whose_steps_stay_large_while_the_others_converge_is_never_refused():
    """The quickstart's client 2 asked 1.53 against a typical 0.078 (20 x) at round 118 of 300 and
    was evicted; judged against its own last steps it is in range."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=3)
    for rnd in range(300):
        converged = 1.0 * 0.98 ** rnd
        assert _round(guard, {0: converged, 1: converged * 1.1, 2: 1.0 + 0.5 * np.sin(rnd / 7)}) == dict.fromkeys(
            range(3), "ok")
    assert guard.peak_ratio < 2


def test_a_jump_beyond_its_own_and_the_typical_steps_is_refused_but_only_one_beyond_the_model_counts():
    guard = InfluenceGuard(InfluenceConfig(), num_clients=3)
    for _ in range(3):
        _round(guard, {0: 1.0, 1: 1.0, 2: 1.0})
    # 11 x the typical step: a statistic (an honest async site's step jumped to 144 x), refused, not counted
    assert _round(guard, {0: 1.0, 1: 1.0, 2: 11.0}) == {0: "ok", 1: "ok", 2: "refused"}
    # beyond 10 x the model's own scale (REF is all zeros: sqrt(P) = 2): no training step, evidence
    assert _round(guard, {0: 1.0, 1: 1.0, 2: 21.0}) == {0: "ok", 1: "ok", 2: "evidence"}
    assert _round(guard, {0: 1.0, 1: 1.0, 2: 1e30}) == {0: "ok", 1: "ok", 2: "evidence"}  # refused again
    assert _round(guard, {0: 1.0, 1: 1.0, 2: 9.0}) == dict.fromkeys(range(3), "ok")  # clipped, in range


def test_an_honest_step_that_jumps_late_in_a_long_run_is_never_counted_against():
    """The async cells of tools/false_positives.py at 1,000 rounds: the steps converge (they shrink
    to 1/1000), and now and then one site's jumps back to full size, again and again."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=3)
    ref = np.full(4, 3.0, dtype=np.float32)  # a model of norm 6: its own scale is 6
    outcomes = []
    for rnd in range(1000):
        small = 2.0 * 0.993**rnd
        lengths = {0: small, 1: small * 1.1, 2: 2.0 if rnd % 50 == 0 else small}
        guard.begin_round(set(lengths))
        for cid, length in lengths.items():
            try:
                guard.bound(cid, ref + _step(length), ref)
            except Refused as exc:
                outcomes.append(exc.evidence)
        guard.settle()
    assert outcomes and not any(outcomes)  # refused, never evidence
    assert guard.peak_ratio > 10


def test_a_site_with_no_accepted_upload_is_refused_but_it_is_not_evidence():
    guard = InfluenceGuard(InfluenceConfig(calibrate_first_round=False), num_clients=3)
    assert _round(guard, {0: 1.0, 1: 1.0, 2: 1e30}) == {0: "ok", 1: "ok", 2: "refused"}
    assert _round(guard, {0: 1.0, 1: 1.0, 2: 1e30})[2] == "refused"


def test_the_history_of_accepted_steps_survives_a_resume_and_an_evicted_site_is_forgotten():
    guard = InfluenceGuard(InfluenceConfig(), num_clients=3)
    _round(guard, {0: 1.0, 1: 1.0, 2: 1.0})  # no typical step yet: no history of its own either
    assert guard.accepted == {}
    _round(guard, {0: 1.0, 1: 2.0, 2: 3.0})
    twin = InfluenceGuard(InfluenceConfig(), num_clients=3)
    twin.load_state(guard.state())
    assert twin.state() == guard.state() and twin.accepted[2][-1] == pytest.approx(3.0)
    twin.forget(2)
    assert 2 not in twin.accepted and 2 not in twin.distances


def test_a_fast_site_with_more_distances_than_the_slow_ones_holds_no_more_of_the_median():
    """Async: a fast site's last two (refused flips of 25) are in while the slow sites have one
    each. Pooled whole, the median of (2, 2, 25, 25) was 13.5: its next flip was accepted and kept
    as its own history, and so every later one. The same share from each: (2, 2, 25), median 2."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=4)
    assert _round(guard, {0: 2.0, 1: 2.0, 3: 2.0}) == dict.fromkeys((0, 1, 3), "ok")  # the first uploads
    for _ in range(3):
        assert _round(guard, {3: 25.0}) == {3: "refused"}  # beyond 10 x the typical 2
    assert 3 not in guard.accepted
