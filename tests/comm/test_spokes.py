"""SpokeTransport: K links presented as one star; nothing is ever sent to a lost peer."""

from __future__ import annotations

import pytest

from hpcfed.comm.spokes import SpokeTransport
from hpcfed.comm.transport import InProcTransport


def _star(k: int) -> tuple[SpokeTransport, list[SpokeTransport]]:
    """The server's spoke transport and each site's, every link a pair of in-process ranks."""
    pairs = [InProcTransport.group(2) for _ in range(k)]  # [server end, site end] per site
    hub = SpokeTransport(0, k + 1, {})
    for i, (srv, _) in enumerate(pairs):
        hub.add_link(i + 1, _Link(srv, 1))
    sites = [SpokeTransport(i + 1, k + 1, {0: _Link(site, 0)}) for i, (_, site) in enumerate(pairs)]
    return hub, sites


class _Link:
    """One end of an in-process pair, its peer addressed as rank 0 (as the remote rank of an
    intercommunicator is)."""

    def __init__(self, t: InProcTransport, peer: int) -> None:
        self.t, self.peer = t, peer

    def isend(self, frame, dest):
        assert dest == 0
        return self.t.isend(frame, self.peer)

    def iprobe(self, source=None):
        found = self.t.iprobe(self.peer)
        return None if found is None else (0, found[1])

    def irecv_into(self, source, out):
        return self.t.irecv_into(self.peer, out)

    def discard(self, source):
        return self.t.discard(self.peer)


def _get(t: SpokeTransport, source: int) -> bytes:
    found = t.iprobe(source)
    assert found is not None and found[0] == source
    buf = bytearray(found[1])
    assert t.irecv_into(source, memoryview(buf)).test()
    return bytes(buf)


def test_frames_reach_the_right_site_and_come_back_named_by_rank():
    hub, sites = _star(3)
    for rank in (1, 2, 3):
        hub.isend(memoryview(f"to {rank}".encode()), rank)
    assert [_get(s, 0) for s in sites] == [b"to 1", b"to 2", b"to 3"]
    sites[2].isend(memoryview(b"from 3"), 0)
    sites[0].isend(memoryview(b"from 1"), 0)
    assert hub.iprobe(2) is None and hub.iprobe()[0] in {1, 3}
    assert _get(hub, 3) == b"from 3" and _get(hub, 1) == b"from 1" and hub.iprobe() is None


def test_any_source_probes_take_turns():
    hub, sites = _star(2)
    for _ in range(2):
        sites[0].isend(memoryview(b"a"), 0)
        sites[1].isend(memoryview(b"b"), 0)
    order = []
    for _ in range(4):
        src, _n = hub.iprobe()
        order.append(src)
        _get(hub, src)
    assert order == [1, 2, 1, 2]  # a busy site never starves the other


def test_a_lost_site_is_never_sent_to_but_what_it_sent_is_still_read():
    hub, sites = _star(2)
    sites[1].isend(memoryview(b"last words"), 0)
    hub.mark_lost(2)
    req = hub.isend(memoryview(b"x" * 100), 2)
    assert req.test() and sites[1].iprobe(0) is None and hub.dropped_frames == {2: 1}
    assert _get(hub, 2) == b"last words" and hub.lost() == {2}
    hub.isend(memoryview(b"still here"), 1)
    assert _get(sites[0], 0) == b"still here"


def test_a_lost_site_back_as_a_new_job_is_reached_on_its_new_link_only_and_a_live_one_cannot_be_replaced():
    hub, sites = _star(2)
    srv, site = InProcTransport.group(2)  # the new job's intercommunicator
    with pytest.raises(ValueError, match="not lost"):
        hub.replace_link(2, _Link(srv, 1))  # alive: nobody takes its place
    hub.mark_lost(2)
    hub.replace_link(2, _Link(srv, 1))
    back = SpokeTransport(2, 3, {0: _Link(site, 0)})
    hub.isend(memoryview(b"welcome back"), 2)
    assert hub.lost() == set() and _get(back, 0) == b"welcome back" and sites[1].iprobe(0) is None


def test_ranks_outside_the_star_are_refused():
    hub, _ = _star(2)
    with pytest.raises(ValueError, match="not a peer"):
        hub.isend(memoryview(b"x"), 5)
    with pytest.raises(ValueError, match="taken or out of range"):
        hub.add_link(1, _Link(InProcTransport.group(2)[0], 1))
    with pytest.raises(ValueError, match="not peers of rank 0"):
        SpokeTransport(0, 2, {0: InProcTransport.group(2)[0]})
    with pytest.raises(RuntimeError, match="no collective across sites"):
        hub.bcast_bytes(None, 16)
