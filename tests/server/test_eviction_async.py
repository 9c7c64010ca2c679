"""Async eviction in process, over the real sealed path: the hostile upload that comes first is
forced to come first, an evicted site's records leave the strategy, and a silent site holds no one up."""

from __future__ import annotations

import numpy as np
from test_insider import SIZE, _in_process_federation

from hpcfed import protocol as P
from hpcfed.server.async_loop import AsyncLoop


def _loop(tmp_path, ranks, **config):
    server, chans = _in_process_federation(tmp_path, ranks, **config)
    loop = AsyncLoop(server)
    loop.begin()
    version = next(iter([chans[r].recv(kinds={P.PARAMS}, timeout=5).header for r in range(1, ranks)]))["version"]

    def upload(rank: int, flat: np.ndarray) -> list:
        chans[rank].send(0, P.UPDATE, {"version": version, "num_examples": 10, "metrics": {}}, {"params": flat})
        msg = server.channel.recv(kinds={P.UPDATE}, timeout=5)
        return server.contained(msg.source, loop.update, msg) or []

    return server, loop, upload, chans


def test_a_hostile_upload_that_comes_first_and_is_evicted_leaves_nothing_in_feddwa(tmp_path):
    """FedDWA, three sites. The hostile site's constant model (all 7.0) reaches rank 0 first,
    then a copy nobody asked for evicts it while it is parked: it is never folded, its distance
    never sets the bound, and S_W is the honest sites' alone."""
    server, loop, upload, _ = _loop(tmp_path, 4, strategy={"name": "feddwa"})
    try:
        assert upload(1, np.full(SIZE, 7.0, dtype=np.float32)) == []  # parked, unanswered
        assert upload(1, np.full(SIZE, 7.0, dtype=np.float32)) == []  # unrequested: evicted at once
        assert [e["client"] for e in server.ledger.state()] == [0] and 0 not in server.live
        assert not (tmp_path / "scratch" / "parked" / "client0.bin").exists()
        steps = {2: np.eye(SIZE, dtype=np.float32)[0], 3: 1.2 * np.eye(SIZE, dtype=np.float32)[1]}
        assert upload(2, steps[2]) == []
        released = upload(3, steps[3])  # the two live sites complete the quorum
        assert [u.client_id for u, _ in released] == [1, 2]
        strategy = server.strategy
        assert not strategy.s_w[0].any() and 0 in strategy.gone
        assert (strategy.global_flat < 1.5).all()  # nothing of the 7.0 model
        # the smaller of the two distances bounds them (one honest site cannot be outvoted by a hostile one)
        assert server.influence.clipped == 1
    finally:
        loop.end()
        server.metrics.close()


def test_an_evicted_sites_accepted_record_is_taken_out_of_feddwa_and_the_model_recomputed(tmp_path):
    server, loop, upload, _ = _loop(tmp_path, 4, strategy={"name": "feddwa"}, influence={"enabled": False})
    try:
        for rank, value in ((1, 7.0), (2, 1.0), (3, 1.0)):
            for upd, targets in upload(rank, np.full(SIZE, value, dtype=np.float32)):
                loop.accepted(upd, targets)
        assert server.strategy.global_flat.max() > 1.5  # the 7.0 model is in
        server.reject(1, "duplicate update", "a second copy")  # proof against client 0 (rank 1)
        assert set(server.ledger.evicted) == {0}
        np.testing.assert_allclose(server.strategy.global_flat, 1.0, rtol=1e-6)  # the honest records alone
    finally:
        loop.end()
        server.metrics.close()


def test_a_silent_site_does_not_hold_the_first_uploads_back(tmp_path):
    """Three sites, one says nothing: the two honest first uploads are parked, and released once
    the first has waited its patience, not the silent site's deadline."""
    server, loop, upload, _ = _loop(tmp_path, 4, strategy={"name": "fedasync"})
    try:
        assert upload(1, np.eye(SIZE, dtype=np.float32)[0]) == []
        assert upload(2, 1.1 * np.eye(SIZE, dtype=np.float32)[1]) == []
        assert loop.release_parked() == []  # not yet: the third site may be on its way
        loop.first_parked -= 3600  # (as if it had waited an hour; the test asserts behaviour, not timings)
        released = loop.release_parked()
        assert [u.client_id for u, _ in released] == [0, 1]
        assert 2 in server.live  # silence is not evidence
    finally:
        loop.end()
        server.metrics.close()


def test_a_fast_hostile_first_upload_is_never_released_alone(tmp_path):
    """Four sites; the fast hostile one's sign flip x10 is parked first, and the honest first steps
    are slow (a loaded host). However long it waits, it is not folded alone (the model's own norm
    would bound it, and its distance would become its own history: every later flip accepted).
    The first honest upload releases both, bounded by the smaller distance, the honest one's."""
    server, loop, upload, _ = _loop(tmp_path, 5, strategy={"name": "fedasync"})
    try:
        unit = np.eye(SIZE, dtype=np.float32)
        assert upload(1, -10 * unit[5]) == []
        loop.first_parked -= 3600  # (as if it had waited an hour; the test asserts behaviour, not timings)
        assert loop.release_parked() == []
        released = upload(2, unit[0])
        assert [u.client_id for u, _ in released] == [0, 1]
        assert server.influence.clipped == 1  # the flip, to the honest distance 1
        assert np.linalg.norm(server.strategy.global_flat) < 1.0
        assert 0 not in server.influence.accepted and list(server.influence.accepted[1]) == [1.0]
    finally:
        loop.end()
        server.metrics.close()


def test_a_lone_first_upload_is_released_once_the_other_sites_are_gone(tmp_path):
    """Three sites, two silent: the one upload waits on the server (not silent itself) until the
    others have said nothing for the round deadline and are dropped; then it is folded."""
    server, loop, upload, _ = _loop(tmp_path, 4, strategy={"name": "fedasync"},
                                 federation={"on_client_failure": "continue", "min_sites": 1})
    try:
        assert upload(1, np.eye(SIZE, dtype=np.float32)[0]) == []
        for cid in (0, 1, 2):
            loop.last_seen[cid] -= 10_000
        loop.check_silent()
        assert server.live == {0}
        assert [u.client_id for u, _ in loop.release_parked()] == [0]
    finally:
        loop.end()
        server.metrics.close()


def test_an_authenticated_kind_99_flood_evicts_its_sender_with_its_first_message(tmp_path):
    """A site seals messages of a kind the server never takes: its first, authenticated at its
    first chunk, is proof (a protocol violation); it is told EVICTED, and the rest is dropped unread."""
    server, loop, _, chans = _loop(tmp_path, 4, strategy={"name": "fedasync"})
    try:
        for _ in range(3):  # 1 MiB each, several chunks
            chans[1].send(0, 99, {"flood": True}, {"x": np.zeros(1 << 20, np.uint8)})
        assert loop.step() == []
        (ev,) = server.ledger.state()
        assert ev["client"] == 0 and ev["reason"].startswith("protocol violation (unsolicited kind")
        assert 0 not in server.live and server.live == {1, 2}
        assert chans[1].recv(kinds={P.EVICTED}, timeout=5) is not None
        loop.step()
        assert server.channel.stats.rejected["unsolicited kind"] == 3 and server.rejected == {}
    finally:
        loop.end()
        server.metrics.close()
