"""Secure aggregation's messages on the wire: one honest round through the wire forms, and each
hostile message refused naming the site (wrong share counts, shares for the wrong site, a forged
agreement key, replays, a site speaking for another, shares but no masked input, a server asking
to unmask a peer it calls alive), with what the runtime's fixed-point input decodes to."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.secagg import ProtocolError, SiteState, round_graph
from hpcfed.privacy.secagg_server import ServerState
from hpcfed.privacy.site_input import decode_sum, encode_update, input_spec

K, SIZE = 4, 5


def _sites(identity: bool = False) -> tuple[dict[int, SiteState], ServerState]:
    graph = round_graph(K, 7)
    ids = {u: Ed25519PrivateKey.generate() for u in range(K)} if identity else {}
    pubs = {u: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, k in ids.items()} or None
    return {u: SiteState(u, graph, SIZE + 1, ids.get(u), pubs) for u in range(K)}, ServerState(graph, SIZE + 1)


def _advertise(sites, server) -> None:
    for u, s in sites.items():  # through the wire form, as the channel carries it
        server.take_advert(u, W.parse_advert(u, W.advert_fields(s.advertise()), K))


def _relay_adverts(server, u: int, sites) -> dict:
    fields = [W.advert_fields(a) for a in server.adverts_for(u).values()]
    return W.parse_adverts(fields, sites[u].peers, K, u)


def _share(sites, server) -> None:
    for u, s in sites.items():
        ids, blob = W.shares_message(s.share_keys(_relay_adverts(server, u, sites)), by_sender=False)
        server.take_shares(u, W.parse_shares(u, ids, {W.SHARES_TENSOR: blob}, K, u, by_sender=False))


def _relayed_shares(server, u: int):
    ids, blob = W.shares_message(server.shares_for(u), by_sender=True)
    return W.parse_shares(u, ids, {W.SHARES_TENSOR: blob}, K, u, by_sender=True)


def _check(sites, server, alive: set[int]) -> None:
    """The consistency check through the wire forms; the server checks the signatures in keys mode."""
    survivors = set(W.site_ids(sorted(server.survivor_set()), K, "survivors", 0))
    for u in sorted(alive):
        sig, identities = sites[u].sign_survivors(survivors), sites[u].peer_identities
        server.take_signature(u, W.parse_signature(u, sig.hex() if sig else None, identities is not None), identities)


def test_a_round_through_the_wire_sums_the_weighted_deltas_of_the_alive_sites():
    sites, server = _sites(identity=True)
    spec = input_spec(K, clip_norm=1.0, max_examples=1000)
    _advertise(sites, server)
    _share(sites, server)
    rng = np.random.default_rng(3)
    deltas = {u: rng.normal(0, 0.1, SIZE) for u in range(K)}
    for u in (0, 1, 3):  # site 2 shared its keys, then dropped
        codes, within = encode_update(deltas[u], 100 + u, spec)
        y = sites[u].masked_input(_relayed_shares(server, u), codes)
        server.take_masked(u, W.parse_masked(u, {W.MASKED_TENSOR: y}, SIZE + 1))
        assert within
    alive, dropped = server.unmask_request()
    assert (alive, dropped) == ({0, 1, 3}, {2})
    _check(sites, server, alive)
    for u in alive:
        relayed = W.parse_signatures(W.signatures_fields(server.signatures_for(u)), K, u)
        server.take_unmask(u, W.parse_answers(u, W.answers_fields(sites[u].unmask(alive, dropped, relayed)), K))
    weighted, examples = decode_sum(*server.result()[:1], 3, spec)
    assert examples == 100 + 101 + 103
    want = sum((100 + u) * deltas[u] for u in alive)
    assert weighted == pytest.approx(want, abs=3 * 1000 * spec.step)  # quantisation: a step per site, x max_examples
    # the dropped site's self-mask seed was never revealed: no one answered a seed share for it
    assert all(kind == "key" for ans in server.answers.values() for p, (kind, _, _) in ans.items() if p == 2)


def test_adverts_refused_forged_for_another_site_replayed_or_relayed_to_a_stranger():
    sites, server = _sites(identity=True)
    fields = W.advert_fields(sites[1].advertise())
    with pytest.raises(ProtocolError, match="site 2: advert claims to come from site 1"):
        W.parse_advert(2, fields, K)  # site 2 speaks for site 1
    with pytest.raises(ProtocolError, match="site 1: advert key s is not 64"):
        W.parse_advert(1, [1, fields[1], fields[2][:-2], fields[3]], K)
    with pytest.raises(ProtocolError, match="not a site id"):
        W.parse_advert(1, [10**400, *fields[1:]], K)
    server.take_advert(1, W.parse_advert(1, fields, K))
    with pytest.raises(ProtocolError, match=r"site 1: advert refused .* a second one"):
        server.take_advert(1, W.parse_advert(1, fields, K))  # replay
    stranger = next(u for u in range(K) if u != 1 and u not in sites[1].peers) if len(sites[1].peers) < K - 1 else None
    if stranger is not None:
        with pytest.raises(ProtocolError, match="not its neighbour"):
            W.parse_adverts([fields], sites[stranger].peers, K, stranger)
    with pytest.raises(ProtocolError, match="more adverts than it has neighbours"):
        W.parse_adverts([fields] * K, sites[0].peers, K, 0)
    # a server that swaps in its own mask key: the signature no longer verifies
    peer = min(sites[0].peers)
    honest = W.advert_fields(sites[peer].advertise())
    forged = [peer, honest[1], W.advert_fields(sites[0].advertise())[2], honest[3]]
    relayed = W.parse_adverts([forged], sites[0].peers, K, 0)
    with pytest.raises(ProtocolError, match=f"site {peer}: forged agreement key"):
        sites[0].share_keys(relayed)


def test_share_messages_of_the_wrong_count_size_or_addressee_are_refused_naming_the_site():
    sites, server = _sites()
    _advertise(sites, server)
    ids, blob = W.shares_message(sites[0].share_keys(_relay_adverts(server, 0, sites)), by_sender=False)
    with pytest.raises(ProtocolError, match=r"site 0: shares of shape \(2, 164\)"):
        W.parse_shares(0, ids, {W.SHARES_TENSOR: blob[:2]}, K, 0, by_sender=False)  # wrong share count
    with pytest.raises(ProtocolError, match="uint8"):
        W.parse_shares(0, ids, {W.SHARES_TENSOR: blob.astype(np.uint16)}, K, 0, by_sender=False)
    with pytest.raises(ProtocolError, match="names a site twice"):
        W.parse_shares(0, [ids[0]] * len(ids), {W.SHARES_TENSOR: blob}, K, 0, by_sender=False)
    with pytest.raises(ProtocolError, match="not only 'shares'"):
        W.parse_shares(0, ids, {W.SHARES_TENSOR: blob, "params": blob}, K, 0, by_sender=False)
    to_self = [0 if i == ids[0] else i for i in ids]  # addressed to the wrong site (itself)
    with pytest.raises(ProtocolError, match="site 0: shares addressed to sites that are not its advertised"):
        server.take_shares(0, W.parse_shares(0, to_self, {W.SHARES_TENSOR: blob}, K, 0, by_sender=False))
    server.take_shares(0, W.parse_shares(0, ids, {W.SHARES_TENSOR: blob}, K, 0, by_sender=False))
    with pytest.raises(ProtocolError, match="site 0: a second set of shares"):
        server.take_shares(0, W.parse_shares(0, ids, {W.SHARES_TENSOR: blob}, K, 0, by_sender=False))
    # a share relayed to the wrong site does not open there (its AEAD binds sender and receiver)
    for u in (1, 2, 3):
        i, b = W.shares_message(sites[u].share_keys(_relay_adverts(server, u, sites)), by_sender=False)
        server.take_shares(u, W.parse_shares(u, i, {W.SHARES_TENSOR: b}, K, u, by_sender=False))
    meant_for_1 = [sh for sh in server.shares_for(1) if sh.sender in sites[2].peers][:1]
    misrouted = W.shares_message(meant_for_1, by_sender=True)
    with pytest.raises(ProtocolError, match="does not open"):
        sites[2].masked_input(W.parse_shares(2, misrouted[0], {W.SHARES_TENSOR: misrouted[1]}, K, 2, by_sender=True),
                              np.zeros(SIZE + 1, np.uint32))


def test_masked_inputs_and_unmask_answers_are_bounded_and_a_site_never_unmasks_a_live_peer():
    sites, server = _sites()
    _advertise(sites, server)
    _share(sites, server)
    with pytest.raises(ProtocolError, match=r"site 3: masked input of shape \(5,\) uint32"):
        W.parse_masked(3, {W.MASKED_TENSOR: np.zeros(SIZE, np.uint32)}, SIZE + 1)
    with pytest.raises(ProtocolError, match="float32"):
        W.parse_masked(3, {W.MASKED_TENSOR: np.zeros(SIZE + 1, np.float32)}, SIZE + 1)
    for u in (0, 1, 2):  # site 3 sent its shares but no masked input
        y = sites[u].masked_input(_relayed_shares(server, u), np.zeros(SIZE + 1, np.uint32))
        server.take_masked(u, y)
    with pytest.raises(ProtocolError, match=r"site 0: masked input refused \(a second one"):
        server.take_masked(0, y)
    alive, dropped = server.unmask_request()
    assert dropped == {3}
    with pytest.raises(ProtocolError, match="server asked site 0 to unmask site 1, which it calls alive and dropped"):
        sites[0].unmask(alive, dropped | {1})  # the server asks for the key of a peer it calls alive
    _check(sites, server, {0})
    answers = W.answers_fields(sites[0].unmask(alive, dropped))
    with pytest.raises(ProtocolError, match="site 0: unmask answer for site"):
        W.parse_answers(0, answers + answers[:1], K)  # both (or twice) for one peer
    with pytest.raises(ProtocolError, match=r"seed|key"):
        W.parse_answers(0, [[1, "both", 1, answers[0][3]]], K)
    with pytest.raises(ProtocolError, match="unmask share is not 132"):
        W.parse_answers(0, [[answers[0][0], answers[0][1], answers[0][2], "00"]], K)
    flipped = [[p, "key" if kind == "seed" else "seed", x, h] for p, kind, x, h in answers]
    with pytest.raises(ProtocolError, match="site 0: key share for site"):
        server.take_unmask(0, W.parse_answers(0, flipped, K))  # a key share of an alive peer
    server.take_unmask(0, W.parse_answers(0, answers, K))
    with pytest.raises(ProtocolError, match="site 0: unmask answer from a site that is not alive, did not sign"):
        server.take_unmask(0, W.parse_answers(0, answers, K))  # replay
    with pytest.raises(ProtocolError, match="site 3: unmask answer from a site that is not alive"):
        server.take_unmask(3, {})


def test_distributed_dp_widens_the_range_for_the_noise_and_weighs_every_site_alike():
    plain, private = input_spec(8, 0.5, 100), input_spec(8, 0.5, 100, noise_multiplier=2.0, sites_needed=4)
    assert (plain.value_range, plain.noise_std) == (0.5, 0.0)
    assert private.noise_std == pytest.approx(2.0 * 0.5 / 2) and private.max_examples == 1
    assert private.value_range == pytest.approx(0.5 + 10 * 0.5)
    codes, within = encode_update(np.array([3.0, 4.0]), 37, private)  # clipped to 0.5, then noised
    assert not within and codes[-1] == 1  # the weight is 1, whatever the site holds
    total = codes.astype(np.uint32)
    weighted, examples = decode_sum(total, 1, private)
    assert examples == 1 and np.linalg.norm(weighted - [0.3, 0.4]) < 6 * private.noise_std
    with pytest.raises(ValueError, match="masked weights sum to 0"):
        decode_sum(np.zeros(3, np.uint32), 2, plain)


def test_a_relayed_agreement_key_with_a_bad_signature_or_from_another_round_is_refused_naming_the_site():
    ids = {u: Ed25519PrivateKey.generate() for u in range(K)}
    pubs = {u: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, k in ids.items()}
    graph0, graph1 = round_graph(K, 0), round_graph(K, 1)
    old = {u: SiteState(u, graph0, SIZE + 1, ids[u], pubs, 0).advertise() for u in range(K)}
    new = {u: SiteState(u, graph1, SIZE + 1, ids[u], pubs, 1) for u in range(K)}
    me = new[0]
    fields = [W.advert_fields(new[u].advertise()) for u in sorted(me.peers)]
    victim = fields[-1][0]
    fields[-1][3] = ("0" if fields[-1][3][0] != "0" else "1") + fields[-1][3][1:]  # one hex digit of the signature
    with pytest.raises(ProtocolError, match=f"site {victim}: forged agreement key for round 1"):
        me.share_keys(W.parse_adverts(fields, me.peers, K, 0))
    replayed = [W.advert_fields(old[u]) for u in sorted(me.peers)]  # signed, but for round 0
    with pytest.raises(ProtocolError, match=r"forged agreement key for round 1 \(signature does not verify: "
                                            r"substituted, or replayed from another round or attempt\)"):
        me.share_keys(W.parse_adverts(replayed, me.peers, K, 0))
    honest = [W.advert_fields(new[u].advertise()) for u in sorted(me.peers)]
    assert len(me.share_keys(W.parse_adverts(honest, me.peers, K, 0))) == len(me.peers)
