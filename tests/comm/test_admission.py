"""What a rank takes: kinds per peer, declared size per kind, and an inbox bounded per peer; a
malformed bundle is refused, never raised."""

from __future__ import annotations

import numpy as np
import pytest

from hpcfed.comm import wire
from hpcfed.comm.admission import Admission
from hpcfed.comm.options import ChannelOptions
from hpcfed.comm.reassembly import PayloadPool
from hpcfed.comm.session import Session
from hpcfed.comm.transport import InProcTransport


def _admission(**opts: int) -> tuple[Admission, Session]:
    s = Session(InProcTransport.group(4)[0], b"job", ChannelOptions(**opts), None)  # type: ignore[arg-type]
    return Admission(s, PayloadPool(4096)), s


def _payload(header: dict, nbytes: int = 0) -> np.ndarray:
    return np.frombuffer(wire.encode(header, {"x": np.zeros(nbytes, np.uint8)} if nbytes else {}), np.uint8).copy()


def test_everything_is_taken_until_expect_says_otherwise():
    adm, _ = _admission()
    assert adm.refusal(1, 200, 1 << 40) is None
    adm.expect([4, 5])
    assert adm.refusal(3, 4, 10) is None
    reason, detail = adm.refusal(3, 6, 10)  # type: ignore[misc]
    assert reason == "unsolicited kind" and "kind 6" in detail and "rank 3" in detail


def test_kinds_per_peer_and_sizes_per_kind():
    adm, _ = _admission()
    adm.expect({1: [4], 2: {4, 8}}, {4: 100})
    assert adm.refusal(2, 8, 1 << 30) is None
    assert adm.refusal(1, 8, 10) is not None and adm.refusal(3, 4, 10) is not None  # rank 3 may send nothing
    assert adm.refusal(1, 4, 100) is None
    assert adm.refusal(1, 4, 101) == ("message too large for its kind",
                                      "kind 4 declares 101 bytes; at most 100 expected")
    with pytest.raises(ValueError, match="positive"):
        adm.expect(None, {4: 0})


def test_the_inbox_is_bounded_per_peer_and_reading_makes_room():
    adm, s = _admission(inbox_max_messages=2)
    for i in range(3):
        adm.deliver(1, 4, _payload({"i": i}))
    adm.deliver(2, 4, _payload({"i": 9}))
    assert s.stats.rejected == {"inbox full": 1} and s.stats.rejected_by_rank == {1: 1}
    assert s.stats.messages_received == 3 and s.peers[1].queued == 2
    m = adm.take(1, None)
    assert m is not None and m.header == {"i": 0} and s.peers[1].queued == 1
    adm.deliver(1, 4, _payload({"i": 3}))
    assert [adm.take(None, {4}).header for _ in range(3)] == [{"i": 1}, {"i": 9}, {"i": 3}]  # type: ignore[union-attr]
    assert adm.take(None, None) is None and s.peers[1].queued == s.peers[1].queued_bytes == 0


def test_the_inbox_bytes_bound_counts_bundle_bytes():
    adm, s = _admission()
    adm.expect(None, inbox_max_bytes=3000)
    adm.deliver(1, 4, _payload({}, 1500))
    adm.deliver(1, 4, _payload({}, 1500))
    assert s.stats.rejected == {"inbox full": 1}


def test_take_keeps_what_does_not_match():
    adm, _ = _admission()
    adm.deliver(1, 4, _payload({"a": 1}))
    adm.deliver(2, 5, _payload({"b": 2}))
    assert adm.take(3, None) is None and adm.take(None, {9}) is None
    assert adm.take(2, {5}).header == {"b": 2}  # type: ignore[union-attr]
    assert adm.take(None, None).header == {"a": 1}  # type: ignore[union-attr]


@pytest.mark.parametrize("payload", [np.zeros(0, np.uint8), np.frombuffer(b"HPCW" + bytes(60), np.uint8).copy(),
                                     np.frombuffer(np.random.default_rng(0).bytes(500), np.uint8).copy()])
def test_a_malformed_bundle_is_refused(payload):
    adm, s = _admission()
    adm.deliver(1, 4, payload)
    assert s.stats.rejected == {"malformed bundle": 1} and adm.take(None, None) is None


def test_on_message_takes_what_it_consumes():
    adm, s = _admission()
    taken: list[int] = []
    adm.on_message = lambda m: m.kind == 4 and not taken.append(m.header["i"])
    adm.deliver(1, 4, _payload({"i": 0}))
    adm.deliver(1, 5, _payload({"i": 1}))
    assert taken == [0] and s.stats.messages_received == 2
    assert adm.take(None, None).header == {"i": 1} and adm.take(None, None) is None  # type: ignore[union-attr]
