"""Bonawitz et al. 2017's consistency check, with real keys, in-process at protocol level: a server
that lies about who dropped cannot unmask one site, and every bad survivor set or consistency
signature it relays is refused naming the site.

The attack (found with real crypto, and run here): at K = 16 with the default degree, the server
tells the target's neighbours "target alive", collecting shares of its self-mask seed, and tells
each of those neighbours' other neighbours "that neighbour dropped", collecting shares of their mask
keys; each honest site checks only its own request, so every mask of the target's input comes off.
In psk mode (no per-site keys, hence no signatures) it still works, which README and docs/threats.md
say; in keys mode each site refuses, because too few of its neighbours signed the set it was given."""

from __future__ import annotations

import re

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hpcfed.config import load
from hpcfed.errors import ConfigError
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy import shamir
from hpcfed.privacy.masking import agree, apply_masks
from hpcfed.privacy.secagg import Advert, ProtocolError, SiteState, consistency_bytes, round_graph, threshold_for
from hpcfed.privacy.secagg_server import ServerState

K, RND, SIZE, TARGET = 16, 1, 5, 3


def _masked_round(keys_mode: bool, k: int = K, rnd: int = RND):
    """K honest sites on round `rnd`'s default graph, real keys, up to their masked inputs."""
    graph = round_graph(k, rnd)
    ids = {u: Ed25519PrivateKey.generate() for u in range(k)} if keys_mode else {}
    pubs = {u: key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, key in ids.items()} or None
    sites = {u: SiteState(u, graph, SIZE, ids.get(u), pubs, rnd) for u in range(k)}
    server = ServerState(graph, SIZE, rnd)
    for u, s in sites.items():
        server.take_advert(u, s.advertise())
    for u, s in sites.items():
        server.take_shares(u, s.share_keys(server.adverts_for(u)))
    rng = np.random.default_rng(1)
    codes = {u: rng.integers(0, 2**32, SIZE, dtype=np.uint64).astype(np.uint32) for u in range(k)}
    for u, s in sites.items():
        server.take_masked(u, s.masked_input(server.shares_for(u), codes[u]))
    return graph, sites, server, codes, pubs


def _lies(graph: dict[int, set[int]], target: int) -> dict[int, set[int]]:
    """Per site, whom the lying server calls dropped: for each neighbour v of the target, enough of
    v's other neighbours are told "v dropped" to rebuild v's mask key, while each of them keeps its
    threshold of its own neighbourhood called alive (so that it answers at all)."""
    t = {w: threshold_for(len(graph[w])) for w in graph}
    dropped: dict[int, set[int]] = {w: set() for w in graph}
    for v in sorted(graph[target]):
        told = 0
        for w in sorted(graph[v] - {target}, key=lambda w: len(dropped[w])):
            if len((graph[w] | {w}) - dropped[w] - {v}) >= t[w]:
                dropped[w].add(v)
                told += 1
            if told >= t[v]:
                break
    return dropped


def _strip(graph, server, answers, target: int) -> np.ndarray | None:
    """The target's input, if the answers rebuild its seed and all its neighbours' mask keys."""
    def rebuild(peer: int, kind: str) -> bytes:
        shares = [(x, y) for a in answers.values() for p, (k, x, y) in a.items() if p == peer and k == kind]
        return shamir.combine(shares, threshold_for(len(graph[peer])))

    try:
        masks = [(rebuild(target, "seed"), b"self", -1)]
        for v in graph[target]:
            s_v = X25519PrivateKey.from_private_bytes(rebuild(v, "key"))
            masks.append((agree(s_v, server.adverts[target].s_public, v, target, b"mask"),
                          b"pair", -1 if v > target else 1))
    except ValueError:  # too few shares of some secret
        return None
    x = server.masked[target].copy()
    apply_masks(x, masks)
    return x


def _lying_server(graph, sites, server, forward_all: bool):
    """Each site is sent its own survivor set; its answers, or its refusal."""
    everyone, lies = set(graph), _lies(graph, TARGET)
    told = {w: everyone - lies[w] for w in graph}
    signed = {w: sites[w].sign_survivors(told[w]) for w in graph}
    answers, refusals = {}, {}
    for w in graph:
        relayed = {v: signed[v] for v in graph[w]}
        if not forward_all:  # a cleverer server forwards only the signatures that verify for w's set
            relayed = {v: sig for v, sig in relayed.items() if told[v] == told[w]}
        try:
            answers[w] = sites[w].unmask(told[w], lies[w], relayed)
        except ProtocolError as exc:
            refusals[w] = str(exc)
    return answers, refusals


def test_without_signatures_psk_mode_a_server_lying_about_who_dropped_unmasks_one_site():
    # The attack is real: psk mode has no per-site key to sign the survivor set with (README,
    # "What the server sees"), and honest answers strip every mask of the target's input.
    graph, sites, server, codes, _ = _masked_round(keys_mode=False)
    assert len(graph[TARGET]) == 8 and threshold_for(8) == 5  # the default degree 2*ceil(log2 16)
    answers, refusals = _lying_server(graph, sites, server, forward_all=True)
    assert refusals == {}
    x = _strip(graph, server, answers, TARGET)
    assert x is not None and x.tolist() == codes[TARGET].tolist()


@pytest.mark.parametrize("forward_all", [True, False])
def test_with_the_consistency_check_the_lie_is_refused_and_the_target_stays_masked(forward_all):
    graph, sites, server, _, _ = _masked_round(keys_mode=True)
    answers, refusals = _lying_server(graph, sites, server, forward_all)
    lied_to = {w for w, d in _lies(graph, TARGET).items() if d}
    assert lied_to and lied_to <= set(refusals)  # every site told a lie refuses ...
    for w in lied_to:
        if forward_all:  # ... naming the neighbour whose signature is over another set
            assert re.fullmatch(rf"site \d+: (its consistency signature relayed to site {w} does not verify .*|"
                                rf"consistency signature relayed to site {w}, but site \d+ is not in the survivor "
                                rf"set: refused)", refusals[w]), refusals[w]
        else:  # ... or saying too few of its neighbours signed its set
            assert f"site {w}: only " in refusals[w] and "fewer than the threshold 5" in refusals[w]
    assert _strip(graph, server, answers, TARGET) is None
    # whoever did answer answered for one survivor set only: no peer has both a seed and a key share
    kinds: dict[int, set[str]] = {}
    for a in answers.values():
        for peer, (kind, _, _) in a.items():
            kinds.setdefault(peer, set()).add(kind)
    assert all(len(k) == 1 for k in kinds.values())


def test_an_honest_round_in_keys_mode_passes_the_check_and_sums_exactly():
    _, sites, server, codes, pubs = _masked_round(keys_mode=True, k=6)
    survivors = set(server.survivor_set())
    for u in sorted(survivors):
        sig = sites[u].sign_survivors(survivors)
        server.take_signature(u, W.parse_signature(u, sig.hex() if sig else None, keys_mode=True), pubs)
    assert server.answering() == survivors
    for u in sorted(survivors):
        relayed = W.parse_signatures(W.signatures_fields(server.signatures_for(u)), 6, u)
        server.take_unmask(u, sites[u].unmask(survivors, set(), relayed))
    total, who = server.result()
    assert who == survivors and total.tolist() == (sum(c.astype(np.uint64) for c in codes.values()) % 2**32).tolist()


def _signed(keys_mode: bool = True, k: int = 6):
    """Six sites (at K = 6 each neighbours the 5 others, threshold 3), all alive, each signed the set."""
    graph, sites, server, _, pubs = _masked_round(keys_mode, k=k)
    survivors = set(server.survivor_set())
    sigs = {u: sites[u].sign_survivors(survivors) for u in sorted(survivors)}
    return graph, sites, survivors, sigs, pubs


def test_forged_absent_foreign_and_stale_signatures_are_refused_naming_the_peer():
    graph, sites, survivors, sigs, _ = _signed()
    me = 0
    peers = sorted(graph[me])
    assert len(peers) == 5 and sites[me].threshold == 3
    good = {v: sigs[v] for v in peers}
    p = peers[0]
    forger = Ed25519PrivateKey.generate()
    mine = sites[me].adverts[p]  # p's agreement keys of this round, as site 0 got them
    # the same identity key in another job (or round) has other fresh agreement keys
    elsewhere = SiteState(p, graph, SIZE, _key(sites, p), sites[me].peer_identities, RND).advertise()

    def by_p(survivor_set: set[int], rnd: int = RND, keys: Advert = mine) -> bytes:
        return _key(sites, p).sign(consistency_bytes(rnd, survivor_set, keys))

    cases = {
        "forged": ({**good, p: forger.sign(consistency_bytes(RND, survivors, mine))},
                   rf"site {p}: its consistency signature relayed to site {me} does not verify"),
        "garbage": ({**good, p: bytes(64)}, rf"site {p}: its consistency signature relayed to site {me} does not"),
        "another set": ({**good, p: by_p(survivors - {peers[1]})}, rf"site {p}: its consistency signature .* does not "
                                                                   rf"verify"),
        "another round": ({**good, p: by_p(survivors, RND + 1)},
                          rf"site {p}: its consistency signature .* does not verify for round {RND}"),
        "another job": ({**good, p: by_p(survivors, keys=elsewhere)}, rf"site {p}: its consistency signature .* does "
                                                                      rf"not verify"),
        "absent, under the threshold": ({v: good[v] for v in peers[:2]},
                                        rf"site {me}: only 2 of its neighbours signed .* fewer than the threshold 3; "
                                        rf"unsigned neighbours in the set: {peers[2]}, {peers[3]}, {peers[4]}"),
        "not a neighbour": ({**good, me: sigs[me]}, rf"site {me}: consistency signature relayed to site {me}, "
                                                    rf"which is not its neighbour"),
    }
    for name, (relayed, match) in cases.items():
        with pytest.raises(ProtocolError, match=match):
            sites[me].unmask(survivors, set(), relayed)
        assert not sites[me].answered, name  # a refusal reveals nothing and leaves nothing spent
    sites[me].unmask(survivors, set(), {v: good[v] for v in peers[:3]})  # exactly the threshold: it answers


def test_a_duplicated_signature_on_the_wire_is_refused_naming_the_peer():
    graph, _, _, sigs, _ = _signed()
    p = min(graph[0])
    fields = W.signatures_fields({p: sigs[p]})
    with pytest.raises(ProtocolError, match=rf"site {p}: consistency signature forwarded to site 0 twice"):
        W.parse_signatures(fields + fields, 6, 0)
    with pytest.raises(ProtocolError, match=rf"site {p}: forwarded consistency signature is not 128"):
        W.parse_signatures([[p, "ab"]], 6, 0)
    with pytest.raises(ProtocolError, match="site 2: no consistency signature"):
        W.parse_signature(2, None, keys_mode=True)


def test_a_site_signs_one_survivor_set_only_containing_itself_and_unmasks_for_that_set_only():
    graph, sites, survivors, sigs, _ = _signed()
    with pytest.raises(ProtocolError, match="server asked site 0 to sign a second survivor set"):
        sites[0].sign_survivors(survivors - {1})
    other = sorted(graph[0])[0]
    relayed = {v: sigs[v] for v in graph[0]}
    with pytest.raises(ProtocolError, match=rf"site 0 to unmask with a survivor set other than the one it signed "
                                            rf"\(site {other} is in one"):
        sites[0].unmask(survivors - {other}, {other}, relayed)  # the set it signed, then "other dropped"
    sites = _masked_round(True, k=6)[1]  # fresh sites, none signed yet
    with pytest.raises(ProtocolError, match="survivor set without it"):
        sites[0].sign_survivors(set(range(1, 6)))
    with pytest.raises(ProtocolError, match="to unmask before it signed the survivor set"):
        sites[1].unmask(set(range(6)), set(), {})


def test_the_server_checks_each_signature_on_arrival_so_a_bad_one_costs_its_own_site():
    _, sites, server, _, pubs = _masked_round(keys_mode=True, k=6)
    survivors = set(server.survivor_set())
    with pytest.raises(ProtocolError, match="site 2: its consistency signature does not verify"):
        server.take_signature(2, bytes(64), pubs)
    with pytest.raises(ProtocolError, match="site 2: its consistency signature does not verify"):
        server.take_signature(2, None, pubs)
    server.take_signature(2, sites[2].sign_survivors(survivors), pubs)
    with pytest.raises(ProtocolError, match="site 2: consistency signature from a site outside the survivor set, "
                                            "or a second one"):
        server.take_signature(2, sites[2].identity.sign(b"x"), pubs)  # type: ignore[union-attr]
    # only site 2 signed: nobody holds its threshold of signatures, so nobody is asked to unmask
    assert server.answering() == set() and server.shortfall(server.answering()) is not None


def test_a_degree_under_two_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"degree.*threshold of 1, so one neighbour .* set it to 2 or more"):
        load("configs/quickstart.yaml", ["privacy.secure_aggregation=true", "privacy.secagg.degree=1"])
    assert load("configs/quickstart.yaml", ["privacy.secagg.degree=2"]).privacy.secagg.degree == 2


def _key(sites: dict[int, SiteState], u: int) -> Ed25519PrivateKey:
    key = sites[u].identity
    assert key is not None
    return key
