"""The handshake state machine on its own: two ranks' `Handshake`s wired to each other (frames go
straight from one's send to the other's `on_frame`): the steps in turn reach a session, a step out of
turn or a forged one is refused and counted, and one identity may hold one rank."""

from __future__ import annotations

from collections import deque

import pytest

from hpcfed.comm import crypto
from hpcfed.comm.api import ChannelError
from hpcfed.comm.frame import F_FINISH, F_HELLO, F_REFUSE, F_REPLY
from hpcfed.comm.handshake import Handshake
from hpcfed.comm.options import ChannelOptions
from hpcfed.comm.session import Peer, Session
from hpcfed.comm.transport import InProcTransport

PSK = bytes(range(32))


class _Job:
    """Ranks 0..n-1, each with a session and a handshake; `run()` delivers queued frames in order."""

    def __init__(self, creds: list[crypto.Credentials], job_id: bytes = b"job") -> None:
        ts = InProcTransport.group(len(creds))
        self.sessions = [Session(t, job_id, ChannelOptions(), None) for t in ts]
        self.queue: deque[tuple[int, int, int, bytes]] = deque()  # (src, dst, ftype, body)
        self.hs = [Handshake(s, c, self._plain(r), self._confirm(r))
                   for r, (s, c) in enumerate(zip(self.sessions, creds))]

    def _plain(self, src: int):
        return lambda dst, ftype, body: self.queue.append((src, dst, ftype, bytes(body)))

    def _confirm(self, src: int):
        def confirm(peer: Peer) -> None:  # the sealed CONFIRM, authenticated on arrival
            self.queue.append((src, peer.rank, 0, b""))
        return confirm

    def run(self) -> None:
        while self.queue:
            src, dst, ftype, body = self.queue.popleft()
            if ftype == 0:
                self.hs[dst].on_confirm(self.sessions[dst].peers[src], 0)
            else:
                self.hs[dst].on_frame(src, ftype, memoryview(body))


def _psk(n: int = 2) -> _Job:
    return _Job([crypto.Credentials(mode="psk", psk=PSK)] * n)


def test_the_steps_in_turn_give_both_ranks_one_session():
    job = _psk()
    assert [p.rank for p in job.hs[0].start([1])] == [1]
    todo = job.hs[1].start([0])
    job.run()
    a, b = job.sessions[0].peers[1], job.sessions[1].peers[0]
    assert a.state == b.state == "ready" and a.role == "responder" and b.role == "initiator"
    assert a.hs is None and b.hs is None and a.identity == b.identity == "psk"
    sealed = bytearray(20)
    b.tx.seal_into(1, b"four", b"aad", memoryview(sealed))  # type: ignore[union-attr]
    opened = bytearray(4)
    assert a.rx.open_into(1, memoryview(sealed), b"aad", memoryview(opened)) and opened == b"four"  # type: ignore[union-attr]
    assert Handshake.outcome(todo, 1.0, True) == ""
    assert job.hs[1].start([0]) == []  # already connected


def test_steps_out_of_turn_are_refused_and_counted():
    job = _psk()
    job.hs[0].start([1])
    for ftype in (F_REPLY, F_FINISH):  # rank 0 waits for a HELLO
        job.hs[0].on_frame(1, ftype, memoryview(bytes(64)))
    job.hs[0].on_frame(2, F_HELLO, memoryview(bytes(100)))  # no handshake with rank 2 at all
    job.hs[1].on_frame(0, F_REFUSE, memoryview(b"go away"))  # rank 1 never started one
    assert job.sessions[0].stats.rejected == {"unexpected handshake frame": 3}
    assert job.sessions[1].stats.rejected == {"unexpected handshake frame": 1}
    job.hs[1].start([0])
    job.run()  # the real handshake still goes through
    assert job.sessions[0].peers[1].state == job.sessions[1].peers[0].state == "ready"


def test_a_forged_hello_fails_and_is_answered_with_a_refusal():
    job = _psk()
    job.hs[0].start([1])
    job.hs[0].on_frame(1, F_HELLO, memoryview(bytes(100)))
    peer = job.sessions[0].peers[1]
    assert peer.state == "failed" and "rank 1 failed the secure handshake" in peer.error
    assert job.sessions[0].stats.rejected == {"handshake failed": 1}
    src, dst, ftype, body = job.queue.popleft()
    assert (src, dst, ftype) == (0, 1, F_REFUSE) and body
    assert "rank 1 failed" in Handshake.outcome([peer], 1.0, True)
    assert Handshake.outcome([peer], 1.0, False) == ""


def test_a_refusal_ends_the_handshake_with_the_peers_words():
    ids = [crypto.new_identity() for _ in range(3)]
    server = crypto.Credentials(mode="keys", identity=ids[0], authorized=[ids[2].public_key()])
    stranger = crypto.Credentials(mode="keys", identity=ids[1], server_public=ids[0].public_key())
    job = _Job([server, stranger])
    job.hs[0].start([1])
    todo = job.hs[1].start([0])
    job.run()
    assert todo[0].state == "failed" and todo[0].error.startswith("rank 0 refused the handshake: ")
    assert job.sessions[1].peers[0].tx is None and job.sessions[0].peers[1].state == "failed"


def test_a_wrong_key_fails_where_it_is_found():
    job = _Job([crypto.Credentials(mode="psk", psk=PSK), crypto.Credentials(mode="psk", psk=bytes(32))])
    job.hs[0].start([1])
    todo = job.hs[1].start([0])
    job.run()
    assert todo[0].state == "failed" and "different pre-shared key" in todo[0].error
    assert job.sessions[0].peers[1].state == "failed"  # told so by the refusal


def test_a_silent_peer_is_named():
    job = _psk(3)
    todo = job.hs[0].start([1, 2])
    assert "rank(s) 1, 2 did not complete the secure handshake within 2 s" in Handshake.outcome(todo, 2.0, True)


def test_start_checks_the_ranks():
    job = _psk()
    with pytest.raises(ValueError, match="rank 0 is not another rank"):
        job.hs[0].start([0])
    with pytest.raises(ValueError, match="rank 5 is not another rank of this 2-rank job"):
        job.hs[0].start([5])
    job.hs[1].start([0])
    with pytest.raises(ChannelError, match="already under way"):
        job.hs[1].start([0])


def test_one_identity_holds_one_rank():
    ids = [crypto.new_identity() for _ in range(2)]
    server = crypto.Credentials(mode="keys", identity=ids[0], authorized=[ids[1].public_key()])
    twin = crypto.Credentials(mode="keys", identity=ids[1], server_public=ids[0].public_key())
    job = _Job([server, twin, twin])
    job.hs[0].start([1, 2])
    job.hs[1].start([0])
    job.run()
    job.hs[2].start([0])
    job.run()
    assert job.sessions[0].peers[1].state == "ready"
    assert job.sessions[0].peers[2].state == "failed" and "which rank 1 already holds" in job.sessions[0].peers[2].error
