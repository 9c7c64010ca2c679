"""SecureChannel on the in-process transport: handshakes, chunking, and every kind of bad frame
rejected, counted by reason and rank, while honest traffic goes on."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from comm_attacks import ANY, attacks, seal

from hpcfed.comm import crypto, polling, wire
from hpcfed.comm.api import ChannelError
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.frame import HDR
from hpcfed.comm.transport import InProcTransport

PSK = bytes(range(32))


def _psk(key: bytes = PSK) -> Credentials:
    return Credentials(mode="psk", psk=key)


def _job(creds: list[Credentials], tap=None, job_ids=None, **kw) -> list[SecureChannel]:
    ts = InProcTransport.group(len(creds), tap=tap)
    logs: list[str] = []
    chans = [SecureChannel(t, c, (job_ids or {}).get(r, b"job-1"), log=logs.append, **kw)
             for r, (t, c) in enumerate(zip(ts, creds))]
    for ch in chans:
        ch.test_log = logs  # type: ignore[attr-defined]
    return chans


def _connect(chans: list[SecureChannel], timeout: float = 5.0, **kw) -> dict[int, BaseException]:
    """Connect clients (threads) and the server; returns the exceptions raised, by rank."""
    errors: dict[int, BaseException] = {}

    def client(r: int) -> None:
        try:
            chans[r].connect([0], timeout=timeout)
        except BaseException as exc:
            errors[r] = exc

    threads = [threading.Thread(target=client, args=(r,)) for r in range(1, len(chans))]
    for t in threads:
        t.start()
    try:
        chans[0].connect(range(1, len(chans)), timeout=timeout, **kw)
    except ChannelError as exc:
        errors[0] = exc
    # the server has answered every client it will answer; let clients see their confirmation
    deadline = time.monotonic() + timeout
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        chans[0].poll()
        time.sleep(0.001)
    for t in threads:
        t.join()
    return errors


def _keys_job(n_clients: int, authorized: list[int] | None = None, pinned=None):
    ids = [crypto.new_identity() for _ in range(n_clients + 1)]
    allowed = [ids[r].public_key() for r in (authorized or range(1, n_clients + 1))]
    creds = [Credentials(mode="keys", identity=ids[0], authorized=allowed)]
    creds += [Credentials(mode="keys", identity=ids[r], server_public=(pinned or ids[0]).public_key())
              for r in range(1, n_clients + 1)]
    return creds


def _echo(chans: list[SecureChannel], r: int, tensors=None, kind: int = 4) -> None:
    chans[r].send(0, kind, {"from": r}, tensors or {"x": np.full(3, r, np.float32)})
    msg = chans[0].recv(source=r, timeout=5)
    assert msg is not None and msg.header == {"from": r} and msg.kind == kind


def test_psk_handshake_and_messages_both_ways():
    chans = _job([_psk()] * 3)
    assert _connect(chans) == {}
    assert chans[0].peers == [1, 2] and chans[1].peers == [0]
    big = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    chans[1].send(0, 4, {"round": 1}, {"params": big, "n": np.array(7)})
    chans[2].send(0, 4, {"round": 1}, {"params": -big})
    got = {m.source: m for m in (chans[0].recv(timeout=5), chans[0].recv(timeout=5))}
    np.testing.assert_array_equal(got[1].tensors["params"], big)
    np.testing.assert_array_equal(got[2].tensors["params"], -big)
    assert int(got[1].tensors["n"]) == 7 and got[1].nbytes > big.nbytes
    chans[0].send(2, 3, {"reply": True}, {"params": big})
    m = chans[2].recv(source=0, timeout=5)
    np.testing.assert_array_equal(m.tensors["params"], big)
    for ch in chans:
        assert ch.stats.rejected == {}
        ch.close()


def test_keys_handshake_authorized_sites_only():
    chans = _job(_keys_job(2))
    assert _connect(chans) == {}
    _echo(chans, 1)
    _echo(chans, 2)


def test_unauthorized_identity_is_refused_and_named():
    chans = _job(_keys_job(2, authorized=[1]))
    errors = _connect(chans)
    assert "rank 2" in str(errors[0]) and "not in the authorized keys" in str(errors[0])
    assert "refused" in str(errors[2])
    assert 1 not in errors and chans[0].peers == [1]
    assert chans[0].stats.rejected_by_rank == {2: 1}
    _echo(chans, 1)  # the authorized site still works


def _bound_keys_job(presented: dict[int, int]) -> list[Credentials]:
    """Keys mode with the server's keys bound to ranks; rank r presents site presented[r]'s key."""
    ids = [crypto.new_identity() for _ in range(3)]
    creds = [Credentials(mode="keys", identity=ids[0], authorized={1: ids[1].public_key(), 2: ids[2].public_key()})]
    creds += [Credentials(mode="keys", identity=ids[presented.get(r, r)], server_public=ids[0].public_key())
              for r in (1, 2)]
    return creds


def test_a_site_key_is_accepted_from_its_own_rank_only():
    chans = _job(_bound_keys_job({}))
    assert _connect(chans) == {}
    assert chans[0].identity(1).startswith("SHA256:") and chans[0].identity(1) != chans[0].identity(2)
    _echo(chans, 2)
    chans = _job(_bound_keys_job({2: 1}))  # rank 2 poses as site 1
    errors = _connect(chans)
    assert "rank 2 presented the identity of rank 1" in str(errors[0]), errors
    assert 1 not in errors and chans[0].peers == [1] and chans[0].stats.rejected_by_rank == {2: 1}
    _echo(chans, 1)


def test_one_key_presented_by_two_ranks_is_refused_the_second_time():
    """Without a rank binding (a plain list of keys), the same key still cannot be two sites."""
    ids = [crypto.new_identity() for _ in range(2)]
    creds = [Credentials(mode="keys", identity=ids[0], authorized=[ids[1].public_key()])]
    creds += [Credentials(mode="keys", identity=ids[1], server_public=ids[0].public_key())] * 2
    chans = _job(creds)
    errors = _connect(chans)
    assert "which rank" in str(errors[0]) and "already holds" in str(errors[0]), errors
    assert len(chans[0].peers) == 1


def test_server_may_continue_without_a_refused_site():
    chans = _job(_keys_job(2, authorized=[2]))
    errors = _connect(chans, require_all=False)
    assert 0 not in errors and chans[0].peers == [2] and 1 in errors
    _echo(chans, 2)


def test_client_refuses_a_server_with_the_wrong_key():
    creds = _keys_job(1, pinned=crypto.new_identity())
    errors = _connect(_job(creds))
    assert "not the pinned server key" in str(errors[1])
    assert "rank 1" in str(errors[0])


def test_wrong_psk_fails_the_handshake_on_both_sides():
    errors = _connect(_job([_psk(), _psk(os.urandom(32))]))
    assert "pre-shared key" in str(errors[1]) and "rank 1" in str(errors[0])


def test_mode_mismatch_is_explained():
    errors = _connect(_job([_psk(), _keys_job(1)[1]]))
    assert "security mode" in str(errors[0]) + str(errors.get(1, ""))


def test_a_handshake_from_another_job_fails():
    errors = _connect(_job([_psk(), _psk()], job_ids={1: b"job-2"}))
    assert errors  # the transcript binds the job id


def test_silent_peer_times_out_naming_the_rank():
    chans = _job([_psk()] * 3)
    t = threading.Thread(target=chans[1].connect, args=([0], 5))
    t.start()
    with pytest.raises(ChannelError, match=r"rank\(s\) 2 did not complete"):
        chans[0].connect([1, 2], timeout=0.5)
    t.join()
    assert chans[0].peers == [1]


@pytest.mark.parametrize("mode", ["psk", "keys"])
def test_every_hostile_frame_is_rejected_counted_and_honest_traffic_continues(mode):
    creds = [_psk()] * 3 if mode == "psk" else _keys_job(2)
    chans = _job(creds)
    assert _connect(chans) == {}
    hostile = chans[2]
    plan = attacks(hostile, 0)
    for _name, frame, _reason in plan:
        hostile.transport.inject(0, frame)
        _echo(chans, 1)  # honest traffic interleaved with every attack
    msgs = []
    while (m := chans[0].poll()) is not None:
        msgs.append(m)
    assert [m.header["text"] for m in msgs] == ["legit 1", "legit 2", "legit 3"]
    assert all(m.source == 2 for m in msgs)
    st = chans[0].stats
    bad = [(n, r) for n, _, r in plan if r is not None]
    assert st.rejected_by_rank == {2: len(bad)}
    for name, reason in bad:
        if reason != ANY:
            assert st.rejected.get(reason, 0) >= 1, (name, st.rejected)
    assert sum(st.rejected.values()) == len(bad)
    assert any("rejected message from rank 2" in line for line in chans[0].test_log)
    # the hostile rank's own session still works for honest messages after its attacks
    _echo(chans, 2)


def test_in_transit_tampering_of_a_chunk_drops_only_that_message():
    victim = {"armed": True}

    def tap(src: int, dst: int, frame: bytes) -> list[bytes]:
        if src == 1 and dst == 0 and victim["armed"] and len(frame) > 8000 and frame[32] == 1:  # chunk index 1
            victim["armed"] = False
            return [frame[:HDR + 100] + bytes([frame[HDR + 100] ^ 1]) + frame[HDR + 101:]]
        return [frame]

    chans = _job([_psk()] * 2, tap=tap, chunk_bytes=8192)
    assert _connect(chans) == {}
    big = np.arange(10_000, dtype=np.float64)
    chans[1].send(0, 4, {"n": 1}, {"p": big})  # chunk 1 of 10 is corrupted on the way
    chans[1].send(0, 4, {"n": 2}, {"p": big})
    m = chans[0].recv(timeout=5)
    assert m.header == {"n": 2}
    np.testing.assert_array_equal(m.tensors["p"], big)
    st = chans[0].stats.rejected
    assert st["authentication failed"] == 1
    assert st["chunk out of sequence"] >= 1 and st["incomplete message abandoned"] == 1


def _recorder() -> tuple[list[bytes], Any]:
    """A tap that records every frame rank 1 sends rank 0 (and passes it on)."""
    recorded: list[bytes] = []

    def tap(src, dst, frame):
        if src == 1 and dst == 0:
            recorded.append(frame)
        return [frame]

    return recorded, tap


def test_replay_of_a_whole_recorded_session_is_rejected():
    recorded, tap = _recorder()
    chans = _job([_psk()] * 2, tap=tap, chunk_bytes=4096)
    assert _connect(chans) == {}
    _echo(chans, 1, {"p": np.arange(3000, dtype=np.float32)})
    n = len(recorded)
    for frame in recorded:
        chans[1].transport.inject(0, frame)
    assert chans[0].recv(timeout=0.2) is None
    assert sum(chans[0].stats.rejected.values()) == n
    assert chans[0].stats.rejected_by_rank == {1: n}


def test_a_forgotten_peer_comes_back_with_a_fresh_session_and_its_old_one_cannot_be_replayed():
    recorded, tap = _recorder()
    chans = _job([_psk()] * 2, tap=tap)
    assert _connect(chans) == {}
    _echo(chans, 1)
    chans[0].peer_gone(1)  # its job ended
    chans[1].send(0, 4, {"unread": 1}, {})  # waiting in the inbox when the site comes back: dropped
    while chans[0].poll() is not None:
        pass
    old = list(recorded)
    chans[0].forget(1)
    assert chans[0].peers == []
    chans[1] = SecureChannel(chans[1].transport, _psk(), b"job-1")  # the site's new job, same rank and key
    assert _connect(chans) == {} and chans[0].peers == [1]
    for frame in old:  # the old session's frames, replayed into the new one
        chans[1].transport.inject(0, frame)
    assert chans[0].recv(timeout=0.2) is None and chans[0].stats.rejected_by_rank[1] == len(old)
    _echo(chans, 1)  # and the new session carries messages


def test_oversize_frames_and_messages_are_rejected():
    chans = _job([_psk()] * 2, chunk_bytes=4096, max_message_bytes=20_000)
    assert _connect(chans) == {}
    chans[1].transport.inject(0, bytes(HDR + 5000 + 16))
    chans[1].transport.inject(0, seal(chans[1], 0, b"x" * 100, count=10, total=50_000))
    assert chans[0].recv(timeout=0.1) is None
    assert chans[0].stats.rejected == {"oversize frame": 1, "malformed frame": 1}
    with pytest.raises(ValueError, match="max_message_bytes"):
        chans[1].send(0, 4, {}, {"p": np.zeros(10_000)})


def test_peer_is_cut_off_after_max_rejects():
    chans = _job([_psk()] * 3, max_rejects=5)
    assert _connect(chans) == {}
    for _ in range(8):
        chans[2].transport.inject(0, b"\x01" * 10)
    _echo(chans, 1)
    assert chans[0].recv(timeout=0.05) is None
    assert chans[0].stats.rejected_by_rank == {2: 5}
    assert chans[0].stats.rejected["from a cut-off rank"] == 3
    assert any("cut off" in line for line in chans[0].test_log)
    with pytest.raises(ChannelError, match="rank 2 was cut off"):
        chans[0].recv(source=2, timeout=0.05)


def test_kinds_and_sources_filter_without_losing_messages():
    chans = _job([_psk()] * 3)
    assert _connect(chans) == {}
    chans[1].send(0, 7, {"i": 1})
    chans[2].send(0, 8, {"i": 2})
    chans[1].send(0, 8, {"i": 3})
    assert chans[0].recv(kinds={8}, source=1, timeout=5).header == {"i": 3}
    assert chans[0].recv(kinds={9}, timeout=0.05) is None
    assert chans[0].recv(timeout=5).header == {"i": 1}
    assert chans[0].recv(timeout=5).header == {"i": 2}
    assert chans[0].poll() is None


def test_send_checks_its_arguments():
    chans = _job([_psk()] * 3)
    assert _connect(chans) == {}
    with pytest.raises(ValueError, match="kind"):
        chans[1].send(0, 256, {})
    with pytest.raises(ChannelError, match="no secure session with rank 2"):
        chans[1].send(2, 1, {})
    with pytest.raises(ValueError, match="chunk_bytes"):
        SecureChannel(chans[0].transport, _psk(), b"j", chunk_bytes=10)


def test_idle_receive_backs_off_instead_of_spinning():
    """Behaviour, not CPU figures (issue 16): an idle 2 s receive enters its back-off sleeps and
    polls a bounded number of times. A loop spinning at 100 % would poll hundreds of thousands of
    times (an in-process Iprobe costs about a microsecond); a loaded machine only polls less."""
    chans = _job([_psk()] * 2)
    assert _connect(chans) == {}
    polls0, sleeps0 = chans[0].stats.polls, chans[0].stats.idle_sleeps
    assert chans[0].recv(timeout=2.0) is None
    polls, sleeps = chans[0].stats.polls - polls0, chans[0].stats.idle_sleeps - sleeps0
    # at most: a 0.5 ms spin, 50 ms of conversation-paced polling, then one poll per 5 ms sleep
    assert polls <= 5000, f"idle recv polled {polls} times in 2 s: the back-off is not sleeping"
    assert sleeps >= 20 and polls <= 2 * sleeps + 2000, (polls, sleeps)
    assert chans[0].stats.as_dict()["idle_sleeps"] == chans[0].stats.idle_sleeps


def _served(chans: list[SecureChannel], r: int = 1) -> None:
    """Honest traffic still goes through after an attack."""
    chans[r].send(0, 4, {"ok": r}, {"x": np.arange(5, dtype=np.float32)})
    msg = chans[0].recv(source=r, kinds={4}, timeout=5)
    assert msg is not None and msg.header == {"ok": r}


def test_unsolicited_kinds_are_dropped_on_arrival_and_counted():
    chans = _job([_psk()] * 3, chunk_bytes=64 << 10)
    assert _connect(chans) == {}
    chans[0].expect({1: {4}, 2: {4, 8}})
    for _ in range(3):
        chans[1].send(0, 99, {"junk": True}, {"x": np.zeros(300_000, np.uint8)})  # 5 chunks each
    chans[1].send(0, 8, {"not from rank 1": True})
    chans[2].send(0, 8, {"failed": True})
    _served(chans, 1)
    got = chans[0].recv(source=2, timeout=5)
    assert got is not None and got.kind == 8
    st = chans[0].stats
    assert st.rejected == {"unsolicited kind": 4} and st.rejected_by_rank == {1: 4}
    assert st.dropped_chunks == 3 * 4  # the later chunks of the refused messages, never decrypted
    assert chans[0].poll() is None and not chans[0]._rx.payloads.bufs  # nothing buffered for the junk
    assert any("message kind 99, which this rank does not take from rank 1" in line for line in chans[0].test_log)
    chans[0].expect([4])  # one set for every peer
    chans[2].send(0, 8, {})
    _served(chans, 2)
    assert chans[0].stats.rejected_by_rank == {1: 4, 2: 1}


def test_a_refused_kind_is_reported_against_its_peer_only_once_a_first_chunk_of_it_authenticates(monkeypatch):
    """Kind 99 is refused at its first chunk, before any buffer. The peer's first such chunk is
    opened, since its kind is in the authenticated header: a forged one (a byte flipped on the way)
    is unauthenticated bytes nobody can be blamed for; an authentic one is the peer's own protocol
    violation, reported to the owner (the server evicts on it). Later ones are dropped unread."""
    forged = {"armed": True}

    def tap(src: int, dst: int, frame: bytes) -> list[bytes]:
        if src == 1 and dst == 0 and frame[2] == 99 and forged["armed"]:
            forged["armed"] = False
            return [frame[:HDR + 5] + bytes([frame[HDR + 5] ^ 1]) + frame[HDR + 6:]]
        return [frame]

    chans = _job([_psk()] * 2, tap=tap, chunk_bytes=64 << 10)
    assert _connect(chans) == {}
    chans[0].expect({1: {4}})
    reported: list[tuple[int, str]] = []
    chans[0].on_reject = lambda rank, reason, detail: reported.append((rank, reason))
    opened = []
    real_open = crypto.Sealer.open_into
    monkeypatch.setattr(crypto.Sealer, "open_into", lambda *a: opened.append(len(a[2])) or real_open(*a))
    for _ in range(4):
        chans[1].send(0, 99, {"junk": True}, {"x": np.zeros(300_000, np.uint8)})  # 5 chunks each
    _served(chans, 1)
    assert reported == [(1, "authentication failed"), (1, "unsolicited kind"), (1, "unsolicited kind"),
                        (1, "unsolicited kind")]
    # of the 64 KiB first chunks of kind 99, only the forged one and the first authentic one were opened
    assert sum(1 for n in opened if n > 60_000) == 2, opened
    assert chans[0].stats.dropped_chunks == 4 * 4 and not chans[0]._rx.payloads.bufs


def test_a_declared_size_beyond_the_kind_bound_reserves_nothing():
    chans = _job([_psk()] * 2, chunk_bytes=64 << 10)
    assert _connect(chans) == {}
    chans[0].expect([4, 5], {4: 4096, 5: 1 << 20})
    chans[1].send(0, 4, {}, {"x": np.zeros(1 << 20, np.uint8)})  # 17 chunks, far over 4 KiB
    chans[1].send(0, 5, {"fits": True}, {"x": np.ones(200_000, np.uint8)})
    msg = chans[0].recv(source=1, kinds={5}, timeout=5)
    assert msg is not None and msg.header == {"fits": True} and int(msg.tensors["x"].sum()) == 200_000
    assert chans[0].stats.rejected == {"message too large for its kind": 1}
    assert chans[0].stats.dropped_chunks == 16
    assert all(len(buf) < (1 << 20) for buf in chans[0]._rx.payloads.bufs)  # only the message that fitted
    with pytest.raises(ValueError, match="positive"):
        chans[0].expect([4], {4: 0})


def test_the_inbox_of_each_peer_is_bounded_in_count_and_bytes():
    chans = _job([_psk()] * 3, inbox_max_messages=3)
    assert _connect(chans) == {}
    for i in range(5):
        chans[1].send(0, 4, {"i": i})
    chans[2].send(0, 4, {"i": 100})
    for _ in range(10):
        chans[0].poll() if False else chans[0]._pump()
    assert chans[0].stats.rejected == {"inbox full": 2} and chans[0].stats.rejected_by_rank == {1: 2}
    got = [chans[0].recv(source=1, timeout=5).header["i"] for _ in range(3)]
    assert got == [0, 1, 2] and chans[0].recv(source=2, timeout=5).header == {"i": 100}
    chans[0].expect(None, inbox_max_bytes=2000)
    chans[1].send(0, 4, {}, {"x": np.zeros(1500, np.uint8)})
    chans[1].send(0, 4, {}, {"x": np.zeros(1500, np.uint8)})
    for _ in range(10):
        chans[0]._pump()
    assert chans[0].stats.rejected["inbox full"] == 3
    assert chans[0].recv(source=1, timeout=5) is not None  # reading makes room again
    _served(chans, 1)


def test_any_exception_while_opening_a_peers_message_is_contained(monkeypatch):
    chans = _job([_psk()] * 3, max_rejects=3)
    assert _connect(chans) == {}
    real = wire.decode

    def fragile(buf, limits):
        header, tensors = real(buf, limits)
        if header.get("boom"):
            raise OverflowError("int too large to convert")  # a bound the decoder missed
        return header, tensors

    monkeypatch.setattr(wire, "decode", fragile)
    for _ in range(4):
        chans[2].send(0, 4, {"boom": True})
    _served(chans, 1)
    st = chans[0].stats
    assert st.rejected == {"malformed bundle": 3, "from a cut-off rank": 1} and st.rejected_by_rank == {2: 3}
    assert any("OverflowError" not in line and "int too large" in line for line in chans[0].test_log)
    assert any("rank 2 cut off after 3 rejected messages" in line for line in chans[0].test_log)


def _receive_in_thread(ch: SecureChannel, n: int) -> tuple[threading.Thread, list]:
    """Receive n messages on another thread (a ring sender waits for the receiver's credits)."""
    got: list = []

    def run() -> None:
        for _ in range(n):
            m = ch.recv(timeout=10)
            got.append(None if m is None else (m.header, {k: np.array(v) for k, v in m.tensors.items()}))

    t = threading.Thread(target=run)
    t.start()
    return t, got


def _drain(ch: SecureChannel, thread: threading.Thread) -> None:
    while thread.is_alive():
        ch.poll()  # take ring answers and slot credits
        time.sleep(0.001)
    thread.join()
    ch.poll()


def test_big_messages_move_through_shared_memory_after_the_offer():
    chans = _job([_psk()] * 2, chunk_bytes=8192, send_timeout_s=20)
    assert _connect(chans) == {}
    big = np.random.default_rng(3).standard_normal(20_000)
    t, got = _receive_in_thread(chans[0], 3)
    for i in range(3):  # the first goes through the transport while the ring is offered
        chans[1].send(0, 4, {"i": i}, {"p": big * i})
        deadline = time.monotonic() + 5
        while i == 0 and chans[1]._rings.tx[0].state != "ready" and time.monotonic() < deadline:
            chans[1].poll()
    _drain(chans[1], t)
    assert [g[0] for g in got] == [{"i": 0}, {"i": 1}, {"i": 2}]
    for i, (_, tensors) in enumerate(got):
        np.testing.assert_array_equal(tensors["p"], big * i)
    assert chans[1]._rings.tx[0].state == "ready" and 1 in chans[0]._rings.rx
    assert chans[1].stats.bytes_sent > 2 * big.nbytes
    assert chans[0].stats.rejected == {} and chans[1].stats.rejected == {}


def test_tampering_inside_shared_memory_is_rejected():
    state = {"armed": False}

    def tap(src, dst, frame):
        if frame[1] == 9 and state["armed"]:  # an F_SHM_DATA header: corrupt the slot it points at
            state["armed"] = False
            ring = state["chan"]._rings.tx[0]
            slot = int.from_bytes(frame[HDR:HDR + 4], "little")
            ring.buf[slot * ring.slot_bytes + 10] ^= 0xFF
        return [frame]

    chans = _job([_psk()] * 2, tap=tap, chunk_bytes=8192, send_timeout_s=20)
    state["chan"] = chans[1]
    assert _connect(chans) == {}
    big = np.arange(30_000, dtype=np.float32)
    t, got = _receive_in_thread(chans[0], 2)
    chans[1].send(0, 4, {"i": 0}, {"p": big})
    deadline = time.monotonic() + 5
    while chans[1]._rings.tx[0].state != "ready" and time.monotonic() < deadline:
        chans[1].poll()
    state["armed"] = True
    chans[1].send(0, 4, {"i": 1}, {"p": big})  # its first chunk is corrupted in shared memory
    chans[1].send(0, 4, {"i": 2}, {"p": big})
    _drain(chans[1], t)
    assert [g[0] for g in got] == [{"i": 0}, {"i": 2}]
    np.testing.assert_array_equal(got[1][1]["p"], big)
    rejected = chans[0].stats.rejected
    assert rejected["authentication failed"] == 1 and set(chans[0].stats.rejected_by_rank) == {1}


def test_a_rank_in_conversation_sleeps_briefly_and_an_idle_one_backs_off_fully(monkeypatch) -> None:
    """Right after a frame arrives the next one is likely close behind: the wait must not sink into
    the long idle sleeps (two ranks that did so could stay ~100x slow); later it backs off fully."""
    server, client = _job([_psk(), _psk()], backoff_max_s=0.005)
    assert not _connect([server, client])
    client.send(0, 7, {"n": 1})
    assert server.recv(source=1, timeout=5.0).header == {"n": 1}
    sleeps: list[float] = []
    monkeypatch.setattr(polling.time, "sleep", sleeps.append)  # a wait that never sleeps
    assert server.recv(source=1, timeout=0.02) is None  # just after a frame: a conversation
    assert sleeps and max(sleeps) <= polling.CONVERSATION_SLEEP_S
    sleeps.clear()
    server._rx.last_frame_at -= polling.CONVERSATION_S  # that frame is long past
    assert server.recv(source=1, timeout=0.02) is None
    assert max(sleeps) == 0.005  # the idle schedule doubles up to backoff_max_s


@pytest.mark.parametrize("window, most", [(1, 1), (1 << 30, 2)])
def test_part_received_messages_are_finished_before_another_senders_begins(window, most):
    """Two clients upload multi-chunk messages at once and the transport offers their chunks in
    turn (as MPI may): with a small window the server finishes one message before taking the
    other's first chunk, so it holds one part-received message, not one per client."""
    chans = _job([_psk()] * 3, chunk_bytes=4096, max_assembling_bytes=window)
    assert not _connect(chans)
    big = {r: np.full(5000, r, np.float32) for r in (1, 2)}  # 20 KB: 5 chunks each
    for r in (1, 2):
        chans[r].send(0, 4, {"from": r}, {"x": big[r]})
    server = chans[0]
    inner, turn, held = server.transport.iprobe, [0], [0]

    def alternating(source=None):  # offer the two senders' frames in turn when any source will do
        held[0] = max(held[0], sum(p.asm is not None for p in server._session.peers.values()))
        if source is not None:
            return inner(source)
        turn[0] ^= 1
        return inner(1 + turn[0]) or inner()

    server.transport.iprobe = alternating
    got = {m.source: m for m in (server.recv(timeout=5), server.recv(timeout=5))}
    assert set(got) == {1, 2} and all(np.array_equal(got[r].tensors["x"], big[r]) for r in (1, 2))
    assert held[0] == most


def test_on_message_consumes_what_it_takes_and_queues_the_rest():
    chans = _job([_psk()] * 2)
    assert not _connect(chans)
    taken = []
    chans[0].on_message = lambda m: m.kind == 4 and not taken.append(m.header["i"])
    for i, kind in enumerate((4, 5, 4)):
        chans[1].send(0, kind, {"i": i}, {"x": np.zeros(3, np.float32)})
    msg = chans[0].recv(timeout=5)
    assert msg is not None and msg.kind == 5 and msg.header == {"i": 1}
    assert chans[0].recv(timeout=0.2) is None  # the kind-4 messages never reached the inbox
    assert taken == [0, 2] and chans[0].stats.messages_received == 3


class _NeverTaken:
    """A send the peer never takes (it has died mid-message)."""

    def test(self) -> bool:
        return False

    def cancel(self) -> None:
        pass


class _DeadPeer:
    """Rank 0's transport, with rank 2 dead: what is sent to it is never taken."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def isend(self, frame, dest):
        return _NeverTaken() if dest == 2 else self._inner.isend(frame, dest)


def test_a_send_to_a_peer_that_ended_fails_at_once_not_at_its_timeout():
    chans = _job([_psk()] * 3, send_timeout_s=60)
    assert _connect(chans) == {}
    chans[0].transport = _DeadPeer(chans[0].transport)
    looked = []

    def look() -> None:  # the owner learns that rank 2 ended (the server: hydra's SIGUSR1 and its records)
        looked.append(1)
        if len(looked) >= 2:
            chans[0].peer_gone(2)

    chans[0].watch_peers(look)
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="rank 2 has ended"):
        chans[0].send(2, 4, {}, {"x": np.zeros(1000, np.float32)})
    assert time.monotonic() - t0 < 5 and len(looked) >= 2
    with pytest.raises(ChannelError, match="rank 2 has ended"):  # nothing more is sent to it
        chans[0].post(2, 4, {})
    _echo(chans, 1)  # the others are untouched


class _NeverArrives:
    """A receive matched to a frame whose rest never comes (its sender died past MPI's eager limit)."""

    def __init__(self) -> None:
        self.cancelled = False

    def test(self) -> bool:
        return False

    def cancel(self) -> None:
        self.cancelled = True


def _stall_frames_from(ch: SecureChannel, src: int) -> list[_NeverArrives]:
    """From now on every frame from `src` is announced to `ch` but never arrives."""
    transport, stalled = ch._session.transport, []

    def irecv_into(source: int, out: memoryview):
        if source != src:
            return type(transport).irecv_into(transport, source, out)
        transport.discard(source)  # matched: MPI no longer offers it to a probe
        stalled.append(_NeverArrives())
        return stalled[-1]

    transport.irecv_into = irecv_into  # type: ignore[method-assign]
    return stalled


@pytest.mark.parametrize("how", ["its sender ended", "it did not arrive within"])
def test_a_frame_whose_sender_dies_before_it_arrives_is_given_up_not_waited_for(how):
    kw = {"send_timeout_s": 0.5} if how.startswith("it did not") else {}
    chans = _job([_psk()] * 3, **kw)
    assert not _connect(chans)
    stalled = _stall_frames_from(chans[0], 1)
    if how == "its sender ended":  # its lifeline closed (`hpcfed serve`) or SIGUSR1 (one job)
        chans[0].watch_peers(lambda: chans[0].peer_gone(1))
    buffers = chans[0]._rx._rx_small
    chans[1].send(0, 4, {"from": 1}, {"x": np.ones(3, np.float32)})
    t0 = time.monotonic()
    assert chans[0].recv(source=1, timeout=1.5) is None
    assert time.monotonic() - t0 < 2.5  # the caller's wait, not send_timeout_s (600 s by default)
    assert len(stalled) == 1 and stalled[0].cancelled
    assert chans[0].stats.abandoned_frames == 1 and chans[0].stats.as_dict()["abandoned_frames"] == 1
    assert chans[0]._rx._rx_small is not buffers  # MPI may still write into the old one
    assert any(how in line and "rank 1" in line for line in chans[0].test_log)
    _echo(chans, 2)  # the other site is served as before
