"""Buffers on long-lived epoch keys (`hpcfed.privacy.secagg_epoch`): the sum of the survivors comes
back with and without a dropped member, masks differ per buffer, and what a hostile server (or site)
relays is refused: a replayed epoch advertisement, shares for an unknown epoch, a survivor list that
names a dropped site, a self-mask revealed for a buffer the site is not in."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hpcfed.privacy import buffered as B
from hpcfed.privacy.secagg import ProtocolError, buffer_consistency_bytes, group_graph
from hpcfed.privacy.secagg_epoch import BufferServer, BufferSite, EpochKeys, PeerBook

SIZE = 50


def _federation(k: int):
    ids = [Ed25519PrivateKey.generate() for _ in range(k)]
    public = {i: key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw) for i, key in enumerate(ids)}
    keys = [EpochKeys(i, ids[i]) for i in range(k)]
    return keys, public


def _buffer(keys, public, members, b=1):
    graph = group_graph([sorted(members)], b, None)
    ctx = B.buffer_context(b, b + 1, members)
    adverts = {i: keys[i].advert() for i in members}
    sites = {}
    for i in members:
        book = PeerBook(public)
        sites[i] = BufferSite(keys[i], graph, {v: book.accept(adverts[v]) for v in graph[i]}, SIZE, ctx, public)
    return sites, BufferServer(graph, SIZE, ctx, adverts), graph


def _uploaded(keys, public, members):
    """A buffer whose members all sent rank 0 their masked (zero) inputs."""
    sites, server, _ = _buffer(keys, public, members)
    for i, site in sites.items():
        server.take_masked(i, *site.masked_input(np.zeros(SIZE, dtype=np.uint32)))
    return sites, server


def _run(sites, server, graph, public, inputs, live):
    for i, site in sites.items():
        y, to, blob = site.masked_input(inputs[i])
        if i in live:
            server.take_masked(i, y, to, blob)
    alive, dropped = server.fix_survivors(live)
    for i in alive:
        sites[i].open_shares(server.shares_for(i), set(alive))
    if not dropped:
        for i in alive:
            server.take_unmask(i, sites[i].unmask(set(alive), set(), None, fast=True))
    else:
        for i in alive:
            server.take_signature(i, sites[i].sign_survivors(set(alive)), public)
        for i in server.answering(True):
            sigs = {v: server.signatures[v] for v in graph[i] if v in server.signatures}
            server.take_unmask(i, sites[i].unmask(set(alive), set(dropped), sigs, fast=False))
    return server.result()


@pytest.mark.parametrize("drop", [None, 2])
def test_the_sum_of_the_survivors_comes_back_with_and_without_a_dropped_member(drop):
    keys, public = _federation(6)
    members = {0, 2, 3, 5}
    rng = np.random.default_rng(0)
    inputs = {i: rng.integers(0, 1000, SIZE, dtype=np.uint32) for i in members}
    sites, server, graph = _buffer(keys, public, members)
    live = members - {drop} if drop is not None else members
    total, alive = _run(sites, server, graph, public, inputs, live)
    assert alive == live
    assert np.array_equal(total, sum(inputs[i].astype(np.uint64) for i in live).astype(np.uint32))


def test_a_masked_input_hides_the_input_and_masks_differ_from_buffer_to_buffer():
    keys, public = _federation(4)
    zeros = np.zeros(SIZE, dtype=np.uint32)
    y1 = _buffer(keys, public, {0, 1, 2}, b=1)[0][0].masked_input(zeros)[0]
    y2 = _buffer(keys, public, {0, 1, 2}, b=2)[0][0].masked_input(zeros)[0]
    assert np.count_nonzero(y1) > SIZE - 3 and np.count_nonzero(y1 == y2) < 3


def test_a_replayed_or_substituted_epoch_advertisement_is_refused():
    keys, public = _federation(3)
    old = keys[1].advert()
    book = PeerBook(public)
    book.accept(old)
    newer = EpochKeys(1, None, epoch=old.epoch + 1)  # a restarted site: newer epoch (signed below)
    signer = Ed25519PrivateKey.generate()
    with pytest.raises(ProtocolError, match="no valid signature"):
        book.accept(newer.advert())  # unsigned: refused in keys mode
    public[1] = signer.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    newer.identity = signer
    book = PeerBook(public)
    book.accept(newer.advert())
    old_resigned = EpochKeys(1, signer, epoch=old.epoch).advert()
    with pytest.raises(ProtocolError, match="replayed epoch advertisement"):
        book.accept(old_resigned)
    other = EpochKeys(1, signer, epoch=newer.epoch).advert()
    with pytest.raises(ProtocolError, match="other keys under its epoch"):
        book.accept(other)


def test_shares_for_an_unknown_epoch_or_another_buffer_are_refused():
    keys, public = _federation(3)
    members = {0, 1, 2}
    sites, server = _uploaded(keys, public, members)
    alive, _ = server.fix_survivors(members)
    relayed = server.shares_for(0)
    wrong_epoch = {v: (epoch + 1, blob) for v, (epoch, blob) in relayed.items()}
    with pytest.raises(ProtocolError, match="unknown epoch"):
        sites[0].open_shares(wrong_epoch, set(alive))
    other, _, _ = _buffer(keys, public, members, b=7)  # the same sites' states of another buffer
    with pytest.raises(ProtocolError, match="does not open"):
        other[0].open_shares(relayed, set(alive))


def test_a_survivor_list_that_names_a_dropped_site_is_refused():
    keys, public = _federation(4)
    members = {0, 1, 2, 3}
    sites, server, _ = _buffer(keys, public, members)
    for i in (0, 1, 2):
        server.take_masked(i, *sites[i].masked_input(np.zeros(SIZE, dtype=np.uint32)))
    server.fix_survivors({0, 1, 2})
    with pytest.raises(ProtocolError, match="a survivor without a share"):
        sites[0].open_shares(server.shares_for(0), {0, 1, 2, 3})  # site 3 sent nothing, yet named a survivor
    sites[0].open_shares(server.shares_for(0), {0, 1, 2})
    with pytest.raises(ProtocolError, match="unchecked unmask request with sites dropped"):
        sites[0].unmask({0, 1, 2}, {3}, None, fast=True)
    sites[0].sign_survivors({0, 1, 2})
    with pytest.raises(ProtocolError, match="overlap"):
        sites[0].unmask({0, 1, 2}, {2, 3}, {}, fast=False)
    with pytest.raises(ProtocolError, match="other than the one it signed"):
        sites[0].unmask({0, 1, 2, 3}, set(), {}, fast=False)


def test_a_self_mask_revealed_for_a_buffer_the_site_is_not_in_is_refused():
    keys, public = _federation(5)
    members = {0, 1, 2}
    sites, server = _uploaded(keys, public, members)
    server.fix_survivors(members)
    with pytest.raises(ProtocolError, match="not a survivor of this buffer"):
        server.take_unmask(4, {0: ("seed", 1, bytes(66))})
    with pytest.raises(ProtocolError, match="expected seed"):
        server.take_unmask(0, {1: ("pair", 0, bytes(32))})  # a pair seed for a survivor: never asked
    sites[1].open_shares(server.shares_for(1), set(members))
    sites[1].unmask(set(members), set(), None, fast=True)
    with pytest.raises(ProtocolError, match="second"):
        sites[1].sign_survivors(set(members))  # answered: it signs nothing else in this buffer


def test_a_consistency_signature_binds_the_whole_buffer_context_not_a_prefix():
    """Epoch keys sign in many buffers, so only the context tells them apart: a server that found two
    buffers whose contexts share a prefix (2^28 hashes for the 56 bits once signed) must still not be
    able to replay one buffer's signature in the other. Here the contexts differ in the last byte only."""
    keys, public = _federation(4)
    members = {0, 1, 2, 3}
    sites, server, graph = _buffer(keys, public, members)
    context = sites[1].context
    assert len(context) == 32
    twin = BufferServer(graph, SIZE, context[:-1] + bytes([context[-1] ^ 1]), {i: keys[i].advert() for i in members})
    for i, site in sites.items():
        upload = site.masked_input(np.zeros(SIZE, dtype=np.uint32))
        server.take_masked(i, *upload)
        twin.take_masked(i, *upload)
    alive, _ = server.fix_survivors(members - {3})
    twin.fix_survivors(members - {3})
    for i in alive:
        sites[i].open_shares(server.shares_for(i), set(alive))
    signature = sites[1].sign_survivors(set(alive))
    with pytest.raises(ProtocolError, match="does not verify"):
        twin.take_signature(1, signature, public)
    server.take_signature(1, signature, public)  # in its own buffer it verifies
    with pytest.raises(ValueError, match="32 bytes"):
        buffer_consistency_bytes(context[:7], alive, keys[1].advert().keys())
