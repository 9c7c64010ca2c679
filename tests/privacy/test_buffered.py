"""Secure buffered async aggregation, hostile parties (hpcfed.privacy.buffered): a server that lies
about a site's staleness or version, or reuses a buffer, is refused by the site; a site that claims a
weight other than its staleness gives it, or replays its masked input of an earlier buffer, makes the
buffer's sum refused. The buffers run the real SecAgg+ state machines in process."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.privacy import masking
from hpcfed.privacy.buffered import StalenessRule, buffer_context, check_invite, judge_buffer
from hpcfed.privacy.secagg import ProtocolError, group_graph
from hpcfed.privacy.secagg_epoch import BufferServer, BufferSite, EpochKeys
from hpcfed.privacy.site_input import input_spec

K, P = 4, 64
SPEC = input_spec(K, clip_norm=1.0, max_examples=65536)
RULE = StalenessRule()  # FedBuff's 1/√(1+τ)
HONEST = {"round": 5, "members": [0, 2], "version": 4, "staleness": 2}


def _invite(**changes):
    return check_invite({**HONEST, **changes}, me=0, num_sites=K, trained_from=2, last_buffer=3, newest_seen=3)


def test_an_honest_invitation_is_taken():
    invite = _invite()
    assert (invite.buffer, invite.version, invite.staleness, invite.members) == (5, 4, 2, frozenset({0, 2}))
    assert invite.context == buffer_context(5, 4, [2, 0]) != buffer_context(5, 5, [0, 2])


@pytest.mark.parametrize(("changes", "says"), [
    ({"staleness": 0}, "staleness is 0, but it trained from version 2"),  # a lie: weigh this site up
    ({"staleness": 9, "version": 11}, "at most version 6"),  # a version no buffer count allows
    ({"version": 2, "staleness": 0}, "sent site 0 version 3 already"),  # older than what it was sent
    ({"round": 3}, "took part in buffer 3 already"),  # a replayed or reused buffer
    ({"members": [0]}, "fewer than 2 sites"),  # a sum over one site is its input
    ({"members": [1, 2]}, "leaves site 0 out"),
    ({"members": [0, 0, 2]}, "repeats a site"),
    ({"staleness": "2"}, "not an integer"),
])
def test_a_server_that_lies_about_staleness_or_buffers_is_refused(changes, says):
    with pytest.raises(ProtocolError, match=says):
        _invite(**changes)


def _deltas(seed: int) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.normal(0, 0.05, P) for k in range(K)}


EPOCH = [EpochKeys(k, None) for k in range(K)]  # long-lived: the same keys in every buffer of these tests


def _buffer(b: int, members: list[int], codes: dict[int, np.ndarray],
            replay: dict[int, np.ndarray] | None = None) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """One buffer among `members` on the epoch keys (psk mode), in process: the unmasked sum and each
    masked input; `replay`: masked inputs a site sends in place of its own (from an earlier buffer)."""
    graph = group_graph([members], b, None)
    ctx = buffer_context(b, 1, members)
    adverts = {k: EPOCH[k].advert() for k in members}
    sites = {k: BufferSite(EPOCH[k], graph, {v: adverts[v] for v in graph[k]}, P + 1, ctx) for k in members}
    server = BufferServer(graph, P + 1, ctx, adverts)
    masked = {}
    for k, s in sites.items():
        masked[k], to, blob = s.masked_input(codes[k])
        server.take_masked(k, (replay or {}).get(k, masked[k]), to, blob)
    alive, _ = server.fix_survivors(members)
    for k in alive:
        sites[k].open_shares(server.shares_for(k), set(alive))
        server.take_unmask(k, sites[k].unmask(set(alive), set(), None, fast=True))
    return server.result()[0], masked


def _codes(deltas: dict[int, np.ndarray], staleness: dict[int, int], claims: dict[int, int] | None = None):
    weights = {k: (claims or {}).get(k, RULE.units(t, SPEC.max_examples)) for k, t in staleness.items()}
    return {k: masking.encode(deltas[k], w, SPEC.max_examples, SPEC.value_range, SPEC.levels)
            for k, w in weights.items()}


def test_the_buffers_unmasked_sum_is_the_staleness_weighted_sum():
    deltas, staleness = _deltas(0), {0: 0, 1: 3, 2: 1}
    total, _ = _buffer(0, [0, 1, 2], _codes(deltas, staleness))
    weighted, weight = judge_buffer(total, staleness, {0, 1, 2}, RULE, SPEC)
    s = {k: RULE.units(t, SPEC.max_examples) / SPEC.max_examples for k, t in staleness.items()}
    np.testing.assert_allclose(weighted, sum(s[k] * deltas[k] for k in s), atol=1e-6)
    assert weight == pytest.approx(1 + 0.5 + 1 / np.sqrt(2), abs=1e-4)


@pytest.mark.parametrize("claim", [65536 * 4, 65536, 1])  # beyond the range; stale but claims fresh; near nothing
def test_a_site_that_claims_a_weight_other_than_its_staleness_gives_makes_the_sum_refused(claim):
    deltas, staleness = _deltas(1), {0: 0, 1: 3}  # site 1 is 3 versions stale: q = M/2
    codes = _codes(deltas, {0: 0, 1: 0}) if claim > 65536 else _codes(deltas, staleness, {1: claim})
    if claim > 65536:  # outside the encoding: an honest encoder refuses it, a hostile one writes it anyway
        with pytest.raises(ValueError, match="outside"):
            masking.encode(deltas[1], claim, SPEC.max_examples, SPEC.value_range, SPEC.levels)
        codes[1][-1] = claim
    total, _ = _buffer(0, [0, 1], codes)
    with pytest.raises(ValueError, match=r"weights sum to|outside"):
        judge_buffer(total, staleness, {0, 1}, RULE, SPEC)


def test_a_masked_input_replayed_from_an_earlier_buffer_makes_the_sum_refused():
    deltas, staleness = _deltas(2), {0: 0, 1: 0, 2: 0}
    _, earlier = _buffer(0, [0, 1, 2], _codes(deltas, staleness))
    total, _ = _buffer(1, [0, 1, 2], _codes(_deltas(3), staleness), replay={1: earlier[1]})
    with pytest.raises(ValueError):  # buffer 0's masks do not cancel in buffer 1: the sum is noise
        judge_buffer(total, staleness, {0, 1, 2}, RULE, SPEC)
