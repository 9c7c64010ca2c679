"""Secure aggregation's library on small hand-checkable cases: Shamir, masks, fixed point, a whole
protocol round in-process with dropouts, and hostile messages refused naming the site."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hpcfed.privacy import masking, shamir
from hpcfed.privacy.secagg import (
    Advert,
    ProtocolError,
    SealedShare,
    SiteState,
    members_graph,
    neighbours,
    round_graph,
)
from hpcfed.privacy.secagg_server import ServerState


def test_shamir_any_threshold_rebuilds_and_a_hand_case_interpolates():
    s = secrets.token_bytes(32)
    shares = shamir.split(s, 3, 5)
    assert shamir.combine([shares[4], shares[0], shares[2]], 3) == s
    # f(x) = 7 + 2x: shares (1, 9), (2, 11) rebuild 7
    assert shamir.combine([(1, (9).to_bytes(66, "big")), (2, (11).to_bytes(66, "big"))], 2) == (7).to_bytes(32, "big")
    with pytest.raises(ValueError):
        shamir.combine(shares[:2], 3)


def test_pairwise_masks_cancel_and_keystream_is_keyed_by_all_32_bytes():
    a, b = masking.X25519PrivateKey.generate(), masking.X25519PrivateKey.generate()
    pub = lambda k: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    kab, kba = masking.agree(a, pub(b), 1, 2, b"mask"), masking.agree(b, pub(a), 2, 1, b"mask")
    assert kab == kba
    x1, x2 = np.array([5, 7], np.uint32), np.array([1, 2**32 - 1], np.uint32)
    m = masking.expand(kab, 2)
    assert ((x1 + m) + (x2 - m)).tolist() == (x1 + x2).tolist()
    assert not np.array_equal(masking.expand(bytes(31) + b"\1", 8), masking.expand(bytes(32), 8))


def test_quantisation_round_trip_within_one_step():
    levels = masking.levels_for(4)
    x = np.array([-2.0, -0.5, 0.0, 0.3, 5.0])
    codes = [masking.quantise(x, 1.0, levels) for _ in range(4)]
    total = sum(c.astype(np.uint64) for c in codes).astype(np.uint32)  # fits in 32 bits by construction
    back = masking.dequantise_sum(total, 4, 1.0, levels) / 4
    assert back == pytest.approx(np.clip(x, -1, 1), abs=2.0 / levels)


def answer(server: ServerState, sites: dict[int, SiteState], alive: set[int], dropped: set[int],
           identities: dict[int, bytes] | None = None) -> None:
    """The consistency check, then the unmasking, as an honest server runs them (`SecAggCollector`)."""
    survivors = set(server.survivor_set())
    for u in sorted(alive):
        server.take_signature(u, sites[u].sign_survivors(survivors), identities)
    for u in sorted(alive):
        server.take_unmask(u, sites[u].unmask(alive, dropped, server.signatures_for(u)))


def _advertised(k: int, seed: bytes) -> tuple[dict[int, SiteState], ServerState]:
    """K sites (threshold 3) on the neighbour graph of `seed`, their keys advertised to the server."""
    graph = neighbours(k, seed)
    sites = {u: SiteState(u, graph, 3) for u in range(k)}
    server = ServerState(graph, 3)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    return sites, server


def _run(k: int, drop_before_masking: set[int], identity: bool = False):
    graph = neighbours(k, b"public-seed")
    ids = {u: Ed25519PrivateKey.generate() for u in range(k)} if identity else {}
    pubs = {u: key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, key in ids.items()} or None
    size, levels = 6, masking.levels_for(k)
    sites = {u: SiteState(u, graph, size + 1, ids.get(u), pubs) for u in range(k)}
    server = ServerState(graph, size + 1)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    for u, s in sites.items():
        server.take_shares(u, s.share_keys(server.adverts_for(u)))
    rng = np.random.default_rng(0)
    updates = {u: rng.normal(0, 0.3, size) for u in range(k)}
    for u, s in sites.items():
        y = s.masked_input(server.shares_for(u), masking.encode(updates[u], 10 + u, 100, 1.0, levels))
        if u not in drop_before_masking:
            server.take_masked(u, y)
    alive, dropped = server.unmask_request()
    assert server.shortfall() is None  # every mask can be rebuilt: the unmasking goes ahead
    answer(server, sites, alive, dropped, pubs)
    total, who = server.result()
    return updates, total, who, levels, sites, server


def test_dropout_after_sharing_recovers_the_survivors_sum_exactly():
    updates, total, who, levels, _, _ = _run(8, drop_before_masking={3, 6})
    assert who == set(range(8)) - {3, 6}
    mean, examples = masking.decode(total, len(who), 100, 1.0, levels)
    want = sum((10 + u) * updates[u] for u in who) / sum(10 + u for u in who)
    assert examples == sum(10 + u for u in who)
    assert mean == pytest.approx(want, abs=1e-6)


def test_secagg_plus_graph_is_logarithmic_symmetric_and_public():
    g = neighbours(64, b"s")
    assert all(len(p) <= 12 for p in g.values()) and all(u in g[v] for u in g for v in g[u])
    assert g == neighbours(64, b"s")


def test_a_round_with_sites_away_masks_among_its_members_only():
    assert members_graph(None, 6, 4) == members_graph(range(6), 6, 4) == round_graph(6, 4)  # all there: unchanged
    graph = members_graph([0, 2, 5], 6, 4)  # sites 1, 3 and 4 away (late, lost)
    assert set(graph) == {0, 2, 5} and all(peers == set(graph) - {u} for u, peers in graph.items())
    many = members_graph(range(16), 20, 4)  # a larger federation: SecAgg+'s sparse graph among the members
    assert set(many) == set(range(16)) and max(map(len, many.values())) < 15 and many != members_graph(range(16), 20, 5)


def test_keys_mode_refuses_a_forged_agreement_key_naming_the_site():
    graph = neighbours(3, b"x")
    ids = {u: Ed25519PrivateKey.generate() for u in range(3)}
    pubs = {u: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, k in ids.items()}
    sites = [SiteState(u, graph, 4, ids[u], pubs) for u in range(3)]
    adv = sites[1].advertise()
    forged = Advert(1, adv.c_public, masking.X25519PrivateKey.generate().public_key().public_bytes(
        Encoding.Raw, PublicFormat.Raw), adv.signature)
    with pytest.raises(ProtocolError, match="site 1: forged agreement key"):
        sites[0].share_keys({1: forged, 2: sites[2].advertise()})
    _run(3, set(), identity=True)  # honest keys mode goes through


def test_hostile_share_messages_are_refused_naming_the_site():
    sites, server = _advertised(4, b"y")
    shares = sites[0].share_keys(server.adverts_for(0))
    with pytest.raises(ProtocolError, match="site 0: sent 2 shares"):
        server.take_shares(0, shares[:2])  # wrong share count
    misrouted = [SealedShare(0, 0 if sh.receiver == shares[0].receiver else sh.receiver, sh.blob) for sh in shares]
    with pytest.raises(ProtocolError, match="site 0: shares addressed"):
        server.take_shares(0, misrouted)
    server.take_shares(0, shares)
    for u in (1, 2, 3):
        server.take_shares(u, sites[u].share_keys(server.adverts_for(u)))
    wrong = [SealedShare(sh.sender, 1, sh.blob) for sh in server.shares_for(2)]
    with pytest.raises(ProtocolError, match="addressed to site 1 was sent to 2"):
        sites[2].masked_input(wrong, np.zeros(3, np.uint32))
    with pytest.raises(ProtocolError, match="site 9: masked input from a site that shared no keys"):
        server.take_masked(9, np.zeros(3, np.uint32))


def test_a_site_that_shared_but_sent_no_masked_input_is_dropped_by_name_and_never_unmasked_twice():
    _, _, who, _, sites, server = _run(4, drop_before_masking={2})
    assert server.unmask_request() == (who, {2})
    with pytest.raises(ProtocolError, match="site 0: asked to unmask a second time"):
        sites[0].unmask(who, {2})


def test_a_site_refuses_to_unmask_a_peer_the_server_calls_alive():
    sites, server = _advertised(4, b"z")
    for u, s in sites.items():
        server.take_shares(u, s.share_keys(server.adverts_for(u)))
    sites[0].masked_input(server.shares_for(0), np.zeros(3, np.uint32))
    with pytest.raises(ProtocolError, match="unmask site 1, which it calls alive and dropped"):
        sites[0].unmask({0, 1, 2, 3}, {1})
    with pytest.raises(ProtocolError, match="says site 0 dropped"):
        sites[0].unmask({1, 2, 3}, {0})


def test_masks_applied_a_block_at_a_time_equal_the_whole_keystreams_mod_2_32(monkeypatch):
    monkeypatch.setattr(masking, "BLOCK_WORDS", 7)  # 3 blocks, the last one short
    size = 17
    k1, k2 = secrets.token_bytes(32), secrets.token_bytes(32)
    x = np.arange(size, dtype=np.uint32) * np.uint32(0x9E3779B9)
    y = x.copy()
    masking.apply_masks(y, [(k1, b"self", 1), (k2, b"pair", -1)])
    want = (x.astype(np.uint64) + masking.expand(k1, size, b"self") + (1 << 32) - masking.expand(k2, size, b"pair"))
    assert y.tolist() == (want % (1 << 32)).astype(np.uint32).tolist()
    masking.apply_masks(y, [(k2, b"pair", 1), (k1, b"self", -1)])
    assert y.tolist() == x.tolist()  # the same streams taken off again: exact
    # a hand case: the first AES-256-CTR block of an all-zero key encrypts the label's nonce
    assert masking.expand(bytes(32), 4, b"self").tolist() == np.frombuffer(masking._cipher(bytes(32), b"self").update(
        bytes(16)), "<u4").tolist()


def test_fixed_point_with_a_folded_factor_equals_scaling_first():
    levels = masking.levels_for(3)
    x = np.array([-3.0, -0.25, 0.0, 0.4, 0.99, 7.0])
    assert masking.quantise(x, 1.0, levels, factor=0.5).tolist() == masking.quantise(0.5 * x, 1.0, levels).tolist()
    codes = masking.encode(x, 30, 100, 1.0, levels, factor=0.5)
    assert codes[-1] == 30 and codes[:-1].tolist() == masking.quantise(0.15 * x, 1.0, levels).tolist()
    assert masking.quantise(np.array([0.0]), 1.0, 10).tolist() == [5]  # (0 + R)·levels/2R


@pytest.mark.parametrize("silent", [None, 3])
def test_masks_summed_ahead_give_the_same_sum_and_are_dropped_when_a_neighbour_shares_nothing(silent):
    k, size = 4, 6
    graph = neighbours(k, b"ahead")
    sites = {u: SiteState(u, graph, size + 1) for u in range(k)}
    server = ServerState(graph, size + 1)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    for u, s in sites.items():
        shares = s.share_keys(server.adverts_for(u))
        s.premask()  # summed over every advertised neighbour
        if u != silent:  # site 3 advertised, then shared nothing: the others' premasks do not apply
            server.take_shares(u, shares)
    levels = masking.levels_for(k)
    codes = {u: masking.encode(np.full(size, 0.1 * u), 10, 100, 1.0, levels) for u in range(k)}
    for u in sorted(server.shared):
        server.take_masked(u, sites[u].masked_input(server.shares_for(u), codes[u]))
    alive, dropped = server.unmask_request()
    answer(server, sites, alive, dropped)
    total, who = server.result()
    want = sum(codes[u].astype(np.uint64) for u in who) % (1 << 32)
    assert who == set(server.shared) and total.tolist() == want.tolist()
    with pytest.raises(ProtocolError, match="site 0: masks summed before the keys were shared"):
        SiteState(0, graph, 3).premask()


def _graph_round(k: int, rnd: int, degree: int, dead: set[int], gone_before: set[int]):
    """Round `rnd` of K sites on its public graph, real keys: the sites of `gone_before` ended in an
    earlier round (they advertise nothing), those of `dead` end after sharing, before masking. The
    server's state once the masked inputs are in, the sites, and each live site's fixed-point codes."""
    graph, size = round_graph(k, rnd, degree), 4
    levels = masking.levels_for(k)
    sites = {u: SiteState(u, graph, size + 1, rnd=rnd) for u in range(k) if u not in gone_before}
    server = ServerState(graph, size + 1, rnd)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    assert server.leave_out_short() == set()
    for u, s in sites.items():
        server.take_shares(u, s.share_keys(server.adverts_for(u)))
    codes = {u: masking.encode(np.full(size, 0.01 * (u + 1)), 10 + u, 100, 1.0, levels) for u in sites}
    for u, s in sites.items():
        y = s.masked_input(server.shares_for(u), codes[u])
        if u not in dead:
            server.take_masked(u, y)
    return server, sites, codes


def test_a_neighbourhood_that_loses_too_many_sites_is_found_before_any_share_is_asked_for_and_the_next_round_works():
    # K = 6, degree 3 (threshold 2 of 3 neighbours, 3 of 4): in round 1 sites 0 and 4, two of site
    # 1's three neighbours, end after sharing their keys: site 5 alone holds a share of 1's seed.
    k, degree, dead = 6, 3, {0, 4}
    server, sites, _ = _graph_round(k, 1, degree, dead, set())
    alive, dropped = server.unmask_request()
    assert (alive, dropped) == ({1, 2, 3, 5}, dead)
    short = server.shortfall()
    assert short is not None and (short.site, short.kind, short.threshold, short.holders) == (1, "seed", 2, {5})
    assert short.describe() == ("site 1's self-mask seed needs 2 shares, but only 1 alive neighbour(s) hold one (5); "
                                "its neighbourhood: sites 0, 4, 5")
    # Not over-cautious: had the server asked, the honest answers could not rebuild the seed.
    answer(server, sites, alive, dropped)
    with pytest.raises(ProtocolError, match="site 1: its seed cannot be rebuilt"):
        server.result()
    # Round 2, fresh keys on round 2's graph, the two sites gone: every mask can be rebuilt, and
    # the sum is exactly the four survivors' inputs.
    server, sites, codes = _graph_round(k, 2, degree, set(), dead)
    alive, dropped = server.unmask_request()
    assert (alive, dropped) == ({1, 2, 3, 5}, set()) and server.shortfall() is None
    answer(server, sites, alive, dropped)
    total, who = server.result()
    assert who == alive and total.tolist() == (sum(codes[u].astype(np.uint64) for u in alive) % (1 << 32)).tolist()


def test_sites_with_too_few_advertised_neighbours_sit_the_round_out_and_a_site_refuses_to_share_with_fewer():
    # Round 3 of the same run: site 1 has four neighbours (threshold 3), of which 0 and 4 are gone;
    # leaving it out leaves 2 and 3 short in turn, then 5: nobody can share, nobody is asked to.
    graph = round_graph(6, 3, 3)
    sites = {u: SiteState(u, graph, 3, rnd=3) for u in (1, 2, 3, 5)}
    server = ServerState(graph, 3, 3)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    adverts_of_1 = server.adverts_for(1)
    assert server.leave_out_short() == {1, 2, 3, 5} and server.adverts == {}
    # A site handed fewer adverts than its threshold (a server withholding them) refuses, by name.
    with pytest.raises(ProtocolError, match="site 1: only 2 neighbours advertised, fewer than the threshold 3"):
        sites[1].share_keys(adverts_of_1)

def test_a_dropped_site_whose_shares_no_alive_site_holds_needs_no_rebuilding():
    # Sites 3 and 4 shared, then dropped; every holder of site 3's shares is itself gone, so its
    # masks are in no alive input: the sum is the alive sites' without rebuilding site 3's key.
    graph = {0: {1, 2, 4}, 1: {0, 2, 4}, 2: {0, 1, 4}, 3: {4}, 4: {0, 1, 2, 3}}
    size, levels = 3, masking.levels_for(5)
    sites = {u: SiteState(u, graph, size + 1) for u in graph}
    server = ServerState(graph, size + 1)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    for u, s in sites.items():
        server.take_shares(u, s.share_keys(server.adverts_for(u)))
    codes = {u: masking.encode(np.full(size, 0.1), 5, 100, 1.0, levels) for u in graph}
    for u in (0, 1, 2):
        server.take_masked(u, sites[u].masked_input(server.shares_for(u), codes[u]))
    alive, dropped = server.unmask_request()
    assert dropped == {3, 4} and server.shortfall() is None
    answer(server, sites, alive, dropped)
    total, who = server.result()
    assert who == {0, 1, 2} and total.tolist() == (sum(codes[u].astype(np.uint64) for u in who) % (1 << 32)).tolist()
