"""A group-testing round at protocol level, real keys, in process: each group is its own SecAgg
instance on `group_graph` (no edge between groups), so rank 0 unmasks each group's sum and nothing
finer; and `judge_sum` refuses a sum holding garbage in the weight coordinate only or in the
vector only, while sums of honest inputs always pass."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.client.attacks import GARBAGE_ATTACKS, garbage_input
from hpcfed.privacy.secagg import ProtocolError, SiteState, group_graph
from hpcfed.privacy.secagg_server import ServerState
from hpcfed.privacy.site_input import encode_update, input_spec, judge_sum

SIZE, RND = 9, 3
GROUPS = [frozenset({0, 3, 5}), frozenset({1, 2}), frozenset({4, 6, 7})]


def _group_round(codes: dict[int, np.ndarray]):
    graph = group_graph(GROUPS, RND)
    sites = {u: SiteState(u, graph, codes[u].size, rnd=RND) for u in graph}
    server = ServerState(graph, codes[0].size, RND)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    for u, s in sites.items():
        server.take_shares(u, s.share_keys(server.adverts_for(u)))
    for u, s in sites.items():
        server.take_masked(u, s.masked_input(server.shares_for(u), codes[u]))
    alive, dropped = server.unmask_request()
    for u in sorted(alive):
        server.take_signature(u, sites[u].sign_survivors(set(server.survivor_set())), None)
    for u in sorted(alive):
        server.take_unmask(u, sites[u].unmask(alive, dropped))
    return graph, server


def test_each_group_is_its_own_instance_and_its_sum_is_exact():
    rng = np.random.default_rng(0)
    codes = {u: rng.integers(0, 2**20, SIZE, dtype=np.uint32) for u in range(8)}
    graph, server = _group_round(codes)
    for g in GROUPS:
        assert all(graph[u] <= g - {u} for u in g)  # no edge leaves a group
        want = np.sum([codes[u] for u in g], axis=0, dtype=np.uint64).astype(np.uint32)
        assert np.array_equal(server.sum_of(g), want)
        assert not np.array_equal(server.masked[min(g)], codes[min(g)])  # each input still masked
    with pytest.raises(ProtocolError, match="not whole"):
        server.sum_of(frozenset({0, 3}))  # part of a group: its masks with site 5 would not cancel
    with pytest.raises(ProtocolError, match="not whole"):
        server.sum_of(frozenset({0, 1, 2, 3, 5}) - {5})
    assert group_graph(GROUPS, RND) == graph and group_graph(GROUPS, RND + 1) is not None


@pytest.mark.parametrize("attack", ["garbage", "garbage_weight", "garbage_vector"])
def test_a_sum_with_one_garbage_input_is_refused_and_honest_sums_pass(attack):
    spec = input_spec(4, 1.0, 100)
    rng = np.random.default_rng(1)
    honest = [encode_update(rng.normal(0, 1, SIZE), int(rng.integers(0, 101)), spec)[0] for _ in range(3)]
    for trial in range(20):
        total = np.sum(honest, axis=0, dtype=np.uint64).astype(np.uint32)
        weighted, examples = judge_sum(total, 3, spec)
        assert examples == sum(int(h[-1]) for h in honest) and np.isfinite(weighted).all()
        bad = garbage_input(attack, encode_update(rng.normal(0, 1, SIZE), 50, spec)[0], trial * 2)
        with pytest.raises(ValueError, match=r"outside the encoding|norm"):
            judge_sum((total.astype(np.uint64) + bad).astype(np.uint32), 4, spec)


def test_intermittent_garbage_behaves_in_its_off_rounds():
    codes = np.arange(5, dtype=np.uint32)
    assert np.array_equal(garbage_input("garbage_once", codes, 1), codes)
    assert np.array_equal(garbage_input("garbage_alternate", codes, 3), codes)
    assert not np.array_equal(garbage_input("garbage_alternate", codes, 2), codes)
    assert set(GARBAGE_ATTACKS) == {"garbage", "garbage_weight", "garbage_vector", "garbage_once", "garbage_alternate"}
    weight_only = garbage_input("garbage_weight", codes, 0)
    assert np.array_equal(weight_only[:-1], codes[:-1])
