"""A site's side of secure aggregation (hpcfed.client.secagg) against a hostile server, over a real
sealed channel on the in-process transport: the test plays rank 0 and two honest peers (protocol
state machines with their own Ed25519 identities, keys mode), the site under test runs in a thread,
its upload pipeline as `hpcfed.client.assemble` builds it under secure aggregation (delta, clip,
encode, mask and send).

- The next round's agreement keys, relayed with this round's unmask request, one with a bad
  signature: the site refuses, naming the peer whose key it is, and shares nothing for that round.
- A peer's consistency signature over another survivor set than the one the site signed: refused
  naming the peer, nothing revealed.
- A server that says a round's keys were exchanged ahead when this site shared none: refused.
- A retry of a round in groups (after its whole sum was refused): refused without groups, or for a
  round whose whole sum the site did not just let be revealed; an advert of the round's first
  attempt does not verify in its retry (the retry's keys are signed as the retry's).
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hpcfed import protocol as P
from hpcfed.client.privacy_stages import Clip, Delta, Encode
from hpcfed.client.secagg import SecAggSite
from hpcfed.client.upload import Pipeline, RoundStart, Upload
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.transport import InProcTransport
from hpcfed.config import PrivacyConfig, SecurityConfig
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.params import ParamLayout
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.secagg import Advert, ProtocolError, SiteState, consistency_bytes, round_graph
from hpcfed.privacy.secagg_server import ServerState
from hpcfed.privacy.site_input import spec_for

K, SIZE = 3, 5  # three sites: site 0 is the one under test, 1 and 2 are played by the test
PSK = bytes(range(32))


def _channels() -> tuple[SecureChannel, SecureChannel]:
    """Rank 0 (the test's server) and rank 1 (site 0), connected, in a job of K + 1 ranks."""
    ts = InProcTransport.group(K + 1)
    chans = [SecureChannel(t, Credentials(mode="psk", psk=PSK), b"job-secagg", log=lambda *_: None) for t in ts[:2]]
    site = threading.Thread(target=chans[1].connect, args=([0],), kwargs={"timeout": 10})
    site.start()
    chans[0].connect([1], timeout=10)
    site.join()
    for ch in chans:
        ch.expect(None)
    return chans[0], chans[1]


def _site(channel: SecureChannel, ids: dict[int, Ed25519PrivateKey]) -> SecAggSite:
    site = SecAggSite(channel, SIZE, keys=RankKeys(SecurityConfig(), channel.rank), degree=None,
                      min_group=2, timeout_s=20)
    site.identity = ids[0]  # keys mode, as `RankKeys.secagg_identities` loads it from the key files
    site.peer_keys = {u: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, k in ids.items()}
    return site


def _round(site: SecAggSite, rnd: int, sent: np.ndarray, trained: np.ndarray, num_examples: int,
           prepared: bool = False, **header: Any) -> None:
    """One round of the site's upload pipeline: `trained` from `sent`, then delta, clip, encode, mask, send."""
    layout = ParamLayout.of({"w": sent})
    spec = spec_for(PrivacyConfig(secure_aggregation=True), K, 1.0)
    pipeline = Pipeline(lambda start: Upload(round=rnd, params={"w": trained}, num_examples=num_examples,
                                             header={"metrics": {}}),
                        [Delta(layout), Clip(spec.clip_norm), Encode(spec, False, 0), site])
    pipeline(RoundStart(round=rnd, header={"secagg_prepared": prepared, **header}, received={"w": sent},
                        current_model=lambda: {"w": sent}))


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test, which asserts on it
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def _recv(server: SecureChannel, kind: int) -> Any:
    msg = server.recv(source=1, kinds={kind}, timeout=20)
    assert msg is not None, f"site 0 sent no {P.NAMES[kind]}"
    return msg


@pytest.mark.parametrize("lie", ["next-round key", "consistency signature"])
def test_a_bad_signature_relayed_with_the_unmask_request_is_refused_naming_the_site(lie):
    server, channel = _channels()
    ids = {u: Ed25519PrivateKey.generate() for u in range(K)}
    pubs = {u: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, k in ids.items()}
    site = _site(channel, ids)
    sent = np.zeros(SIZE, np.float32)
    thread, errors = _in_thread(lambda: _round(site, 0, sent, sent + 0.01, 10))
    graph = round_graph(K, 0)
    state = ServerState(graph, SIZE + 1, 0)
    peers = {u: SiteState(u, graph, SIZE + 1, ids[u], pubs, 0) for u in (1, 2)}
    state.take_advert(0, W.parse_advert(0, _recv(server, P.SA_ADVERT).header["advert"], K))
    for u, peer in peers.items():
        state.take_advert(u, peer.advertise())
    server.send(1, P.SA_KEYS, {"round": 0, "adverts": [W.advert_fields(a) for a in state.adverts_for(0).values()]})
    msg = _recv(server, P.SA_SHARES)
    state.take_shares(0, W.parse_shares(0, msg.header["to"], msg.tensors, K, 0, by_sender=False))
    for u, peer in peers.items():
        state.take_shares(u, peer.share_keys(state.adverts_for(u)))
    ids_for, blob = W.shares_message(state.shares_for(0), by_sender=True)
    server.send(1, P.SA_SHARES_FOR, {"round": 0, "from": ids_for}, {W.SHARES_TENSOR: blob})
    masked = _recv(server, P.SA_MASKED)
    nxt = W.parse_advert(0, masked.header["next_advert"], K)  # its round-1 keys, signed for round 1
    assert nxt.signature is not None and nxt.c_public != state.adverts[0].c_public
    for u, peer in peers.items():
        peer.masked_input(state.shares_for(u), np.zeros(SIZE + 1, np.uint32))
    # The consistency check: the site signs the survivor set, its peers too.
    server.send(1, P.SA_CHECK, {"round": 0, "survivors": [0, 1, 2]})
    signed = W.parse_signature(0, _recv(server, P.SA_SIGNED).header["signature"], keys_mode=True)
    assert signed is not None
    sigs = {u: peer.sign_survivors({0, 1, 2}) for u, peer in peers.items()}
    following = {u: SiteState(u, round_graph(K, 1), SIZE + 1, ids[u], pubs, 1).advertise() for u in (1, 2)}
    if lie == "next-round key":
        bad = bytes([following[2].signature[0] ^ 1]) + following[2].signature[1:]  # type: ignore[index]
        following[2] = Advert(2, following[2].c_public, following[2].s_public, bad)
        want = "site 2: forged agreement key for round 1"
    else:  # site 2's signature over a set without site 1: the server telling site 0 another story
        sigs[2] = ids[2].sign(consistency_bytes(0, {0, 2}, state.adverts[2]))
        want = "site 2: its consistency signature relayed to site 0 does not verify for round 0"
    server.send(1, P.SA_UNMASK, {"round": 0, "alive": [0, 1, 2], "dropped": [],
                                 "signatures": W.signatures_fields(sigs),
                                 "next_adverts": [W.advert_fields(a) for a in following.values()]})
    thread.join(30)
    assert not thread.is_alive() and len(errors) == 1 and isinstance(errors[0], FederationError), errors
    assert f"client 0 (rank 1): secure aggregation refused in round 0: {want}" in str(errors[0])
    assert server.recv(source=1, kinds={P.SA_REVEAL}, timeout=0.5) is None  # it reveals and shares nothing
    assert site.next is None


def test_a_server_that_claims_the_keys_were_exchanged_ahead_when_they_were_not_is_refused():
    server, channel = _channels()
    site = _site(channel, {u: Ed25519PrivateKey.generate() for u in range(K)})
    sent = np.zeros(SIZE, np.float32)
    with pytest.raises(FederationError, match=r"round 3: the server says round 3's keys were exchanged in round 2, "
                                              r"but site 0 shared none for it"):
        _round(site, 3, sent, sent, 1, prepared=True)
    assert server.recv(source=1, timeout=0.2) is None  # nothing was sent


@pytest.mark.parametrize("header, words", [
    ({"secagg_retry": True}, "the server retries round 0 without groups: a retry sums groups only"),
    ({"secagg_retry": True, "secagg_groups": [[0, 1, 2]]},
     "the server retries round 0, but round 0's whole sum was not revealed by this site just before"),
    ({"secagg_retry": "yes", "secagg_groups": [[0, 1, 2]]}, "secagg_retry must be true or false, got yes"),
])
def test_a_retry_without_groups_or_of_a_round_the_site_did_not_sum_is_refused(header, words):
    server, channel = _channels()
    site = _site(channel, {u: Ed25519PrivateKey.generate() for u in range(K)})
    sent = np.zeros(SIZE, np.float32)
    with pytest.raises(FederationError, match=re.escape(f"refused in round 0: {words}")):
        _round(site, 0, sent, sent, 1, **header)
    assert server.recv(source=1, timeout=0.2) is None  # nothing was sent


def test_an_advert_of_a_rounds_first_attempt_does_not_verify_in_its_retry():
    ids = {u: Ed25519PrivateKey.generate() for u in range(K)}
    pubs = {u: k.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for u, k in ids.items()}
    graph = round_graph(K, 0)
    first = SiteState(1, graph, SIZE + 1, ids[1], pubs, 0).advertise()  # its key may be rebuilt since
    retried = {u: SiteState(u, graph, SIZE + 1, ids[u], pubs, 0, retry=True) for u in range(K)}
    retried[0].share_keys({u: retried[u].advertise() for u in (1, 2)})  # the retry's own adverts verify
    with pytest.raises(ProtocolError, match=r"site 1: forged agreement key for round 0 .*another round or attempt"):
        retried[2].share_keys({1: first, 0: retried[0].advertise()})
