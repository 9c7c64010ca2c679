"""Group testing under secure aggregation, pure: the sites' rules on a requested partition (each
refusal names its rule), an adversarial server that picks any groups it likes and still never gets
a combination of fewer than min_group sites, and the inference rule across a matrix of attackers
(every round, alternating, once, two colluders): no honest site is ever proven hostile, and one
hostile site sending garbage every round is evicted within ceil(log2 K) + 2 rounds."""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

from hpcfed.config import DPConfig, PrivacyConfig
from hpcfed.privacy.group_rules import GroupRefused, SiteRules, parse_partition, small_combinations
from hpcfed.privacy.group_testing import (
    Isolation,
    Verdict,
    explanations,
    group_noise_multiplier,
    narrowing,
    partition,
    proven,
    suspects,
)
from hpcfed.privacy.site_input import noised, sites_needed, spec_for

_SPEC = importlib.util.spec_from_file_location(
    "group_testing_costs", Path(__file__).resolve().parents[2] / "tools" / "group_testing_costs.py")
assert _SPEC is not None and _SPEC.loader is not None
_COSTS = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_COSTS)

F6 = frozenset(range(6))


def _site(site: int = 0, k: int = 6, m: int = 2, history: list[frozenset[int]] | None = None) -> SiteRules:
    rules = SiteRules(site, k, m)
    for rnd, s in enumerate(history or []):
        rules.revealed(rnd, s)
    return rules


@pytest.mark.parametrize("groups, rule, words", [
    ([[0, 1, 2], [2, 3, 4, 5]], "partition", "site 2 is named twice"),
    ([[0, 0, 1], [2, 3, 4, 5]], "partition", "site 0 is named twice"),
    ([[0, 1, 2], [3, 4, 9]], "partition", "site ids in 0..5"),
    ([[1, 2, 3], [4, 5]], "partition", "site 0 is in none"),
    ("0,1,2", "partition", "must be a list"),
    ([[0, 1, True]], "partition", "site ids"),
    ([list(range(6)) * 1000], "partition", "site ids"),  # bounded before any work on it
    ([[0, 1]] * 7, "partition", "1..6 lists"),
    ([[0], [1, 2, 3, 4, 5]], "min_group", "group [0] has 1 site(s), fewer than privacy.secagg.min_group=2"),
])
def test_a_malformed_or_small_request_is_refused_naming_the_rule(groups, rule, words):
    with pytest.raises(GroupRefused, match=re.escape(words)) as err:
        _site().accept(1, groups)
    assert err.value.rule == rule and f"rule {rule!r}" in str(err.value)


@pytest.mark.parametrize("m, history, groups, leaked", [
    (2, [F6], [[0, 1, 2, 3, 4], [5]], None),  # (min_group first)
    (2, [frozenset({0, 1, 2, 3})], [[0, 1, 2], [3, 4, 5]], "site 3's input"),  # G, then G less site 3
    (3, [frozenset({0, 1, 2})], [[0, 1, 3], [2, 4, 5]], "sites [2, 3]"),  # differ by one site each side
    (2, [F6], [[0, 1, 2], [3, 4]], "site 5's input"),  # union: the full sum less the groups
    (3, [F6, frozenset({0, 1, 2}), frozenset({3, 4, 5})], [[0, 1, 3], [2, 4, 5]], "sites [2, 3]"),
])
def test_a_request_whose_sums_would_combine_to_fewer_than_min_group_sites_is_refused(m, history, groups, leaked):
    rules = _site(m=m, history=history)
    if leaked is None:
        with pytest.raises(GroupRefused, match="min_group"):
            rules.accept(len(history), groups)
        return
    with pytest.raises(GroupRefused, match=r"rule 'small combination'.*" + leaked.replace("[", r"\[").replace(
            "]", r"\]")) as err:
        rules.accept(len(history), groups)
    assert f"privacy.secagg.min_group={m}" in str(err.value)
    if m == 3:  # two inputs' difference is a combination of 2 sites: allowed when min_group is 2
        _site(m=2, history=history).accept(len(history), groups)


def test_halving_after_a_full_sum_is_accepted_and_a_second_halving_too():
    rules = _site(history=[F6])
    assert rules.accept(1, [[0, 1, 2], [3, 4, 5]]) == frozenset({0, 1, 2})
    rules.revealed(1, F6)
    assert rules.history == [F6, frozenset({0, 1, 2}), frozenset({3, 4, 5})]
    rules.accept(2, [[0, 3, 4], [1, 2, 5]])  # cells of 1 and 2: every combination spans >= 2 sites


def test_a_group_round_sums_whole_groups_only():
    rules = _site()
    rules.accept(4, [[0, 1, 2], [3, 4, 5]])
    rules.check_survivors(4, range(6))
    with pytest.raises(GroupRefused, match=r"rule 'whole groups'.*leaves out site 4"):
        rules.check_survivors(4, [0, 1, 2, 3, 5])
    with pytest.raises(GroupRefused, match="adds site 7"):
        rules.check_survivors(4, [*range(6), 7])
    rules.check_survivors(5, [0, 1, 2])  # not a group round: plain secure aggregation's dropouts
    assert not small_combinations([F6, frozenset({0, 1, 2}), frozenset({3, 4, 5})], 6, 2)


def test_an_already_leaked_combination_does_not_block_group_testing():
    """Two full sums that differ by a dropout (plain secure aggregation) are history; group testing
    is refused only what it would add."""
    rules = _site(history=[F6, frozenset(range(5))])
    assert small_combinations(rules.history, 6, 2) == {frozenset({5})}
    rules.accept(2, [[0, 1, 2], [3, 4, 5]])


def _by_rank(sets: list[frozenset[int]], k: int, m: int) -> set[frozenset[int]]:
    """small_combinations by its definition: T leaks iff removing T's columns lowers the rank."""
    mat = np.zeros((len(sets), k))
    for i, s in enumerate(sets):
        mat[i, sorted(s)] = 1.0
    full, found = np.linalg.matrix_rank(mat), set()
    for size in range(1, m):
        for t in itertools.combinations(sorted(set().union(*sets)), size):
            if not any(f <= set(t) for f in found) and np.linalg.matrix_rank(np.delete(mat, t, axis=1)) < full:
                found.add(frozenset(t))
    return found


@pytest.mark.parametrize("k, m", [(6, 2), (8, 3), (16, 2), (12, 4)])
def test_the_null_space_check_equals_the_rank_definition(k, m):
    """The one-SVD check (null-space rows of T dependent) finds exactly the sets the rank definition
    does, on random histories of sums: sparse ones that leak and dense ones that do not."""
    rng = random.Random(k * 100 + m)
    leaking = 0
    for _ in range(60):
        sets = [frozenset(rng.sample(range(k), rng.randint(1, k))) for _ in range(rng.randint(1, 2 * k))]
        assert small_combinations(sets, k, m) == _by_rank(sets, k, m), sets
        leaking += bool(_by_rank(sets, k, m))
    assert 5 < leaking < 60  # both kinds were drawn


def _adversary_groups(rng: random.Random, k: int) -> list[list[int]]:
    """Whatever a hostile server may ask: random groups of random sizes, sometimes overlapping."""
    sites = list(range(k))
    rng.shuffle(sites)
    cuts = sorted(rng.sample(range(1, k), rng.randint(1, min(4, k - 1))))
    groups = [sites[a:b] for a, b in zip([0, *cuts], [*cuts, k])]
    if rng.random() < 0.2:
        groups[0] = groups[0] + [groups[-1][0]]
    if rng.random() < 0.2:
        groups = groups[:-1]  # leave some sites out of the round
    return groups


@pytest.mark.parametrize("k, m", [(6, 2), (8, 2), (8, 3)])
def test_an_adversarial_server_that_picks_the_groups_never_gets_a_sum_of_fewer_than_min_group(k, m):
    """Many runs of a server that asks for any groups it likes, round after round, after a full sum:
    a group's sum is revealed only when every member accepted; every refusal names its rule; over
    all the sums it ever got, no combination of fewer than min_group sites' inputs."""
    rules_seen: set[str] = set()
    for seed in range(12):
        rng = random.Random(seed)
        sites = {s: _site(s, k, m, history=[frozenset(range(k))]) for s in range(k)}
        revealed = [frozenset(range(k))]
        for rnd in range(1, 7):
            groups = _adversary_groups(rng, k)
            accepted = set()
            for s in range(k):
                try:
                    sites[s].accept(rnd, groups)
                    accepted.add(s)
                except GroupRefused as exc:
                    rules_seen.add(exc.rule)
            got = [frozenset(g) for g in groups if set(g) <= accepted]
            assert all(len(g) >= m for g in got)
            for s in accepted:
                sites[s].revealed(rnd, [])
            revealed += got
            assert not small_combinations(revealed, k, m), (seed, rnd, revealed)
    assert rules_seen == {"partition", "min_group", "small combination"}


def _play(k: int, hostile: set[int], garbles, f: int = 1, m: int = 2, rounds: int = 12, seed: int = 0):
    """The server's group testing against `hostile` sites, every honest site checking each request
    (tools/group_testing_costs.py `play`); (evictions, rounds with a refused sum, smallest sum)."""
    return _COSTS.play(k, hostile, garbles, f, m, rounds, seed)


@pytest.mark.parametrize("k", [8, 16])
def test_one_site_sending_garbage_every_round_is_evicted_within_log2_k_plus_2_rounds(k):
    for seed in range(2 if k == 16 else 4):
        evicted, _, smallest = _play(k, {3}, lambda r, h, g: True, seed=seed, rounds=math.ceil(math.log2(k)) + 2)
        assert [(v.site, v.rounds[0]) for v in evicted] == [(3, 0)]
        assert smallest >= 2


ATTACKERS = {
    "every round": ({5}, lambda r, h, g: True, 1),
    "alternating rounds": ({5}, lambda r, h, g: r % 2 == 0, 1),
    "every third round": ({2}, lambda r, h, g: r % 3 == 0, 1),
    "two colluders, both every round": ({4, 5}, lambda r, h, g: True, 2),
    "two colluders, taking turns": ({1, 6}, lambda r, h, g: (r + h) % 2 == 0, 2),
    "two colluders, each in a group with the other's last": ({0, 7}, lambda r, h, g: len(g) > 2 or r == 0, 2),
}


@pytest.mark.parametrize("name", sorted(ATTACKERS))
def test_no_honest_site_is_evicted_across_the_attacker_matrix(name):
    hostile, garbles, f = ATTACKERS[name]
    for seed in range(3):
        evicted, _, _ = _play(8, hostile, garbles, f=f, seed=seed, rounds=12)
        assert {v.site for v in evicted} <= hostile, (name, seed, evicted)
    if name in ("every round", "alternating rounds", "two colluders, both every round"):
        assert {v.site for v in evicted} == hostile


def test_random_colluders_never_frame_an_honest_site_within_the_bound():
    """Two hostile sites that garble at random, under max_hostile = 2, over many runs."""
    for seed in range(6):
        coin = random.Random(seed).random
        evicted, _, _ = _play(8, {2, 5}, lambda r, h, g, coin=coin: coin() < 0.5, f=2, seed=seed, rounds=10)
        assert {v.site for v in evicted} <= {2, 5}


def test_a_site_that_sends_one_bad_input_costs_one_round_and_is_not_evicted():
    evicted, refused_rounds, _ = _play(8, {7}, lambda r, h, g: r == 1, rounds=10)
    assert evicted == [] and refused_rounds == [1]


def test_beyond_the_bound_colluders_can_frame_an_honest_site():
    """Why max_hostile must be an upper bound: hostile 0 and 2 refuse {0, 1} and {1, 2}; with f = 1
    the only explanation is the honest site 1; with f = 2, {0, 2} explains it too and no one is proven."""
    refused = [frozenset({0, 1}), frozenset({1, 2})]
    assert proven(refused, 1) == {1}
    assert proven(refused, 2) == set() and frozenset({0, 2}) in explanations(refused, 2)
    assert suspects(refused, 1) == {1} and suspects(refused, 2) == {0, 1, 2}
    assert proven([frozenset({0, 1}), frozenset({2, 3})], 1) == set()  # no explanation fits: nothing proven


def test_the_proof_names_the_rounds_and_the_site():
    assert Verdict(2, 5, (3, 4, 5)).proof(1) == ("group sums of rounds 3, 4 and 5 isolate site 2 (every set of at "
                                                 "most 1 site(s) that meets each refused sum holds it)")
    assert Verdict(2, 3, (3,)).proof(1).startswith("group sums of rounds 3 isolate site 2")


def test_partition_splits_the_suspects_and_gives_up_when_no_groups_keep_the_rules():
    rng = random.Random(0)
    groups = partition(range(8), {0, 1, 2, 3}, [frozenset(range(8))], 8, 2, rng)
    assert groups is not None and frozenset().union(*groups) == frozenset(range(8))
    assert max(len(g & {0, 1, 2, 3}) for g in groups) == 1
    assert partition(range(6), set(range(6)), [F6], 6, 3, rng) is not None  # two halves
    assert partition(range(5), set(range(5)), [], 5, 3, rng) is None  # one group of 5 is all there is


def test_isolation_ends_after_quiet_group_rounds_and_keeps_its_evidence():
    iso = Isolation(6, 2, 1)
    assert iso.groups_for(0, range(6)) is None
    iso.record(0, [F6], [F6], grouped=False)
    for rnd in (1, 2):
        groups = iso.groups_for(rnd, range(6))
        assert groups is not None
        assert iso.record(rnd, groups, [], grouped=True) == []
    assert iso.groups_for(3, range(6)) is None and iso.refused == [(0, F6)]


def test_parse_partition_accepts_a_plain_partition():
    assert parse_partition([[2, 0], [1, 3]], 4, 1) == [frozenset({0, 2}), frozenset({1, 3})]


@pytest.mark.parametrize("k, quorum, g", [(8, 1.0, 2), (16, 1.0, 4), (10, 0.6, 3)])
def test_a_group_sum_carries_only_its_members_dp_noise(k, quorum, g):
    """The sites' real noise (`site_input.noised`, each its share z·C/√m): the sum over m sites has
    std z·C, a group sum over g sites z·C·√(g/m), the multiplier the server warns of."""
    z, clip = 1.1, 0.5
    spec = spec_for(PrivacyConfig(secure_aggregation=True, dp=DPConfig(noise_multiplier=z, clip_norm=clip)), k, quorum)
    m = sites_needed(k, quorum)
    shares = np.stack([noised(np.zeros(20_000), 1.0, spec.noise_std) for _ in range(m)])
    assert shares.sum(0).std() == pytest.approx(z * clip, rel=0.03)
    assert shares[:g].sum(0).std() == pytest.approx(group_noise_multiplier(z, g, m) * clip, rel=0.03)
    assert group_noise_multiplier(z, g, m) < z / 1.4  # well under the run's z: what threats.md says


def test_an_asynchronous_buffer_holds_at_most_one_suspected_site_while_evidence_is_pending():
    ready = [2, 3, 0, 1]
    assert narrowing(ready, 2, set()) == [2, 3]  # nothing pending: the first B ready
    assert narrowing(ready, 2, {2, 3}) == [2, 0]  # 3 waits for a buffer without 2
    assert narrowing([3, 2], 2, {2, 3}) is None  # only suspects ready: wait for others
    assert narrowing([3, 2, 1], 3, {2, 3}) is None
    assert narrowing([1, 3, 2, 0], 3, {2, 3}) == [1, 3, 0]


@pytest.mark.parametrize("hostile", range(4))
def test_buffers_formed_by_narrowing_prove_the_hostile_member_and_never_an_honest_one(hostile):
    """Buffers of 2 of 4 sites, every buffer with the hostile member refused: whatever order the sites
    become ready in, it is proven within two refusals of the first, and only it."""
    rng = random.Random(hostile)
    for _ in range(50):
        iso = Isolation(4, 2, 1, what="the refused sums of buffers")
        ready, verdicts, refusals = [], [], 0
        while not verdicts and refusals < 10:
            ready += rng.sample([s for s in range(4) if s not in ready], 4 - len(ready))
            picked = narrowing(ready, 2, iso.suspected()) or ready[:2]
            ready = [s for s in ready if s not in picked]
            if hostile in picked:
                refusals += 1
                verdicts = iso.record(refusals, [frozenset(picked)], [frozenset(picked)], False)
        assert [v.site for v in verdicts] == [hostile] and refusals == 2
        assert verdicts[0].proof(1).startswith("the refused sums of buffers 1 and 2 isolate site")
