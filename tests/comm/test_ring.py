"""Shared-memory rings: an offer is mapped only when sound and within budget, an answer to no offer
and a credit or chunk naming a slot not in use are refused, and nothing is left behind."""

from __future__ import annotations

import pytest

from hpcfed.comm import frame
from hpcfed.comm.frame import F_SHM_DATA, OFFER, SLOT, TAG
from hpcfed.comm.options import ChannelOptions
from hpcfed.comm.ring import RING_SLOTS, Rings
from hpcfed.comm.session import Session
from hpcfed.comm.transport import InProcTransport

CHUNK = 8192


def _pair(**opts: object) -> tuple[Rings, Rings, Session, Session]:
    """Rings of rank 0 (the receiver here) and rank 1 (the sender), on one in-process node."""
    ts = InProcTransport.group(2)
    ss = [Session(t, b"job", ChannelOptions(chunk_bytes=CHUNK, **opts), None) for t in ts]  # type: ignore[arg-type]
    return Rings(ss[0]), Rings(ss[1]), ss[0], ss[1]


def _chunk_frame(slot: int, length: int = 100) -> memoryview:
    return memoryview(frame.pack(F_SHM_DATA, 4, 1, 0, length, 1, 0, 0, 1, 0, length) + SLOT.pack(slot))


def _ready() -> tuple[Rings, Rings, Session, Session]:
    rx, tx, s0, s1 = _pair()
    offer = tx.offer(0)
    assert offer is not None
    answer = rx.on_offer(1, offer)
    assert answer is not None and answer[:1] == b"\x01"
    tx.on_answer(0, answer)
    return rx, tx, s0, s1


def test_an_offer_accepted_makes_a_ready_ring_and_no_segment_is_left():
    rx, tx, s0, s1 = _ready()
    ring = tx.tx[0]
    assert ring.state == "ready" and ring.nslots == RING_SLOTS and ring.slot_bytes >= CHUNK + TAG
    assert ring.slot_bytes % 64 == 0 and 1 in rx.rx
    assert s0.transport._hub.shm == {}  # type: ignore[attr-defined]  # unlinked once both sides mapped it
    assert s0.stats.rejected == {} and s1.stats.rejected == {}
    assert rx.mapped_bytes() == tx.mapped_bytes() == RING_SLOTS * ring.slot_bytes
    assert tx.route(0) == rx.route(1) == "ring"  # what summary.json's `transport` reports


def test_a_chunk_names_its_slot_and_a_credit_gives_it_back():
    rx, tx, _, s1 = _ready()
    ring = tx.tx[0]
    slot = ring.free.popleft()
    ring.owner[slot] = object()
    ring.buf[slot * ring.slot_bytes: slot * ring.slot_bytes + 3] = [1, 2, 3]  # type: ignore[index]
    got = rx.chunk(1, _chunk_frame(slot, 100), 100)
    assert got is not None and got[1] == slot and len(got[0]) == 100 + TAG and bytes(got[0][:3]) == b"\x01\x02\x03"
    tx.on_free(0, memoryview(frame.slot_credit(0, 1, slot)))
    assert slot in ring.free and ring.owner[slot] is None and s1.stats.rejected == {}


@pytest.mark.parametrize("slot, length", [(RING_SLOTS, 100), (-1, 100), (0, CHUNK + 64)])
def test_a_chunk_outside_the_ring_is_refused(slot, length):
    rx, _, s0, _ = _ready()
    view = _chunk_frame(slot, length) if slot >= 0 else _chunk_frame(0, length)[:-1]
    assert rx.chunk(1, view, length) is None
    assert s0.stats.rejected == {"malformed frame": 1}


def test_a_chunk_without_a_ring_is_refused():
    rx, _, s0, _ = _pair()
    assert rx.chunk(1, _chunk_frame(0), 100) is None
    assert s0.stats.rejected == {"malformed frame": 1}


@pytest.mark.parametrize("credit", ["unused slot", "free slot", "out of range", "no slot"])
def test_a_credit_for_a_slot_not_in_use_is_refused(credit):
    _, tx, _, s1 = _ready()
    ring = tx.tx[0]
    if credit == "unused slot":  # slot 0 is free: nothing was sent in it
        view = memoryview(frame.slot_credit(0, 1, 0))
    elif credit == "free slot":
        slot = ring.free.popleft()
        ring.free.append(slot)
        view = memoryview(frame.slot_credit(0, 1, slot))
    elif credit == "out of range":
        view = memoryview(frame.slot_credit(0, 1, 1 << 31))
    else:
        view = memoryview(frame.plain(frame.F_SHM_FREE, 0, 1, b""))
    free_before = list(ring.free)
    tx.on_free(0, view)
    assert s1.stats.rejected == {"malformed frame": 1} and list(ring.free) == free_before


def test_an_answer_to_no_offer_is_refused():
    _, tx, _, s1 = _pair()
    tx.on_answer(0, b"\x01hpcfed-made-up")
    assert s1.stats.rejected == {"unexpected handshake frame": 1}
    _, tx, _, s1 = _ready()
    tx.on_answer(0, b"\x01" + tx.tx[0].name.encode())  # a second answer to an offer already answered
    assert s1.stats.rejected == {"unexpected handshake frame": 1}


@pytest.mark.parametrize("body", [
    OFFER.pack(4, CHUNK + 64),  # no name
    b"",
    OFFER.pack(0, CHUNK + 64) + b"hpcfed-x",  # no slots
    OFFER.pack(65, CHUNK + 64) + b"hpcfed-x",  # too many
    OFFER.pack(4, TAG) + b"hpcfed-x",  # a slot that holds no chunk
    OFFER.pack(4, 1 << 30) + b"hpcfed-x",  # slots far bigger than a frame
    OFFER.pack(4, CHUNK + 64) + b"hpcfed-\xff\xfe",  # a name that is no segment
    OFFER.pack(4, CHUNK + 64) + b"../../etc/passwd",
])
def test_an_unsound_offer_maps_nothing(body):
    rx, _, s0, _ = _pair()
    answer = rx.on_offer(1, body)
    assert rx.rx == {}
    if len(body) <= OFFER.size:
        assert answer is None and s0.stats.rejected == {"malformed frame": 1}
    else:
        assert answer is not None and answer[:1] == b"\x00" and s0.stats.rejected == {}


def test_offers_beyond_the_budget_are_declined_both_ways():
    _, tx, _, _ = _pair(shm_budget_bytes=1000)
    assert tx.route(0) == "mpi"  # nothing offered yet
    assert tx.offer(0) is None and tx.tx[0].state == "declined" and tx.tx[0].buf is None
    assert tx.route(0) == "declined"
    rx2, tx2, _, _ = _pair()
    offer = tx2.offer(0)
    assert offer is not None
    rx2._s.opts.shm_budget_bytes = 1000
    assert rx2.on_offer(1, offer) == b"\x00" + offer[OFFER.size:]


def test_close_unlinks_an_offer_never_answered():
    _, tx, s0, _ = _pair()
    assert tx.offer(0) is not None and len(s0.transport._hub.shm) == 1  # type: ignore[attr-defined]
    tx.close()
    assert s0.transport._hub.shm == {} and tx.tx == {}  # type: ignore[attr-defined]


def test_a_peer_that_answers_no_is_routed_over_mpi():
    """A peer on another node cannot map the segment and says no: the ring is declined for good."""
    _, tx, _, s1 = _pair()
    offer = tx.offer(0)
    assert offer is not None and tx.route(0) == "mpi"  # offered, not yet answered: MPI still carries all
    tx.on_answer(0, b"\x00" + offer[OFFER.size:])
    assert tx.route(0) == "declined" and tx.tx[0].buf is None and s1.stats.rejected == {}
