"""An authenticated site with hostile content: the server's bounds, containment and bounded influence.

The fuzz test drives the real path a malicious site's message takes: sealed by a real SecureChannel
on the in-process transport, opened and decoded by the server's channel, then the server's own
validation, bounded influence and the FedAvg strategy.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpcfed import protocol as P
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.crypto import Credentials
from hpcfed.comm.transport import InProcTransport
from hpcfed.config import InfluenceConfig, from_mapping
from hpcfed.server.async_loop import AsyncLoop
from hpcfed.server.bounding import Bounding
from hpcfed.server.collect import PlainCollector, RoundUploads
from hpcfed.server.core import ServerCore
from hpcfed.server.influence import InfluenceGuard, Refused
from hpcfed.server.metrics import MetricsLog
from hpcfed.server.server import Server
from hpcfed.server.validation import metrics_ok, short

INT64 = 2**63 - 1


# -- bounded influence, by hand -----------------------------------------------------------------
def test_weights_are_equal_until_every_site_claimed_then_capped_at_the_median():
    guard = InfluenceGuard(InfluenceConfig(), num_clients=4)
    guard.begin_round({0, 1, 2, 3})
    assert [guard.weight(c, n) for c, n in enumerate([100, 120, 80, 10**12])] == [1, 1, 1, 1]
    guard.begin_round({0, 1, 2, 3})
    # median of the first claims (80, 100, 120, 1e12) is 110: the liar weighs as a typical site
    assert [guard.weight(c, n) for c, n in enumerate([100, 120, 80, 10**12])] == [100, 110, 80, 110]


def test_an_upload_is_clipped_to_the_typical_distance_and_refused_far_beyond_it():
    guard = InfluenceGuard(InfluenceConfig(clip_factor=1.0, reject_factor=10.0), num_clients=2)
    ref = np.zeros(4, dtype=np.float32)
    guard.begin_round({0, 1})
    for cid in range(2):
        guard.bound(cid, np.array([1, 0, 0, 0], dtype=np.float32), ref)  # typical distance 1
    guard.settle()
    guard.begin_round({0, 1})
    far = np.array([0, 3, 4, 0], dtype=np.float32)  # distance 5: clipped to 1, same direction
    assert guard.bound(0, far, ref) == pytest.approx(5.0)
    np.testing.assert_allclose(far, [0, 0.6, 0.8, 0], rtol=1e-6)
    with pytest.raises(Refused, match="away"):
        guard.bound(1, np.full(4, 1e30, dtype=np.float32), ref)


def test_growing_honest_steps_are_followed_not_ratcheted_away():
    """The bound follows the honest majority: steps that double every round (a learning-rate warm-up,
    a summed update) are clipped at most, never refused; clipped distances used to shrink the
    bound until every honest upload was refused."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=3)
    ref = np.zeros(64, dtype=np.float32)
    for rnd in range(12):
        guard.begin_round({0, 1, 2})
        uploads = []
        for cid in range(3):
            upload = ref.copy()
            upload[cid] += 2.0 ** rnd * (1 + 0.1 * cid)
            guard.bound(cid, upload, ref)  # raises Refused if refused
            uploads.append(upload)
        guard.settle()
        ref = np.mean(uploads, axis=0)  # the model follows the steps (FedAvg of the clipped uploads)
    assert guard.clipped < 3 * 12


def test_a_model_initialised_near_zero_may_learn_in_its_first_round():
    """gensim starts its vectors at +-0.5/dim: an honest first step is many times the model's own
    norm. The first round clips it to that norm (no site moves the first aggregate by more than
    1/K of the model) but refuses only beyond 10 x sqrt(P); from the second round on the history
    says such steps are typical."""
    rng = np.random.default_rng(0)
    ref = rng.uniform(-0.01, 0.01, 10_000).astype(np.float32)  # norm ~0.58
    step = rng.normal(0, 0.2, ref.size).astype(np.float32)  # moves ~20, 35 x the norm
    guard = InfluenceGuard(InfluenceConfig(), num_clients=2)
    for rnd in range(2):
        guard.begin_round({0, 1})
        for cid in range(2):
            trained = ref + step
            assert guard.bound(cid, trained, ref) == pytest.approx(np.linalg.norm(step), rel=1e-4)
            moved = float(np.linalg.norm(trained - ref))
            if rnd == 0:
                assert moved == pytest.approx(np.linalg.norm(ref), rel=1e-4)  # clipped to the model's norm
            else:
                np.testing.assert_array_equal(trained, ref + step)  # typical now: untouched
        guard.settle()


def test_one_site_of_four_cannot_move_the_bound():
    """A site that asks for a million-fold step every round holds 1/4 of the history: the median
    stays at the honest sites' distance, and the liar is refused every round."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=4)
    ref = np.zeros(16, dtype=np.float32)
    for _ in range(10):
        guard.begin_round({0, 1, 2, 3})
        for cid in range(3):
            guard.bound(cid, np.full(16, 0.25, dtype=np.float32), ref)  # distance 1
        with pytest.raises(Refused, match="away"):  # 1e6 away: beyond 10 x sqrt(P) at first, then 10 x 1
            guard.bound(3, np.full(16, 0.25e6, dtype=np.float32), ref)
        guard.settle()
    assert guard._typical == pytest.approx(1.0)


def test_a_site_that_uploads_ten_times_as_often_holds_two_entries_of_the_history():
    """Async: a fast site uploads many times between two honest uploads. A shared "last 2K
    uploads" history filled with its distance 5 (here: 10 uploads against 3 x 2) and let it move
    the model 5 x an honest step unclipped; per site it holds two entries, and the median stays
    at the honest sites' 1. Nor does any one site set the bound before three sites have spoken."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=4)
    ref = np.zeros(16, dtype=np.float32)

    def upload(cid: int, distance: float) -> np.ndarray:  # one async upload: its own "round"
        guard.begin_round({0, 1, 2, 3})
        flat = np.full(16, distance / 4, dtype=np.float32)
        guard.bound(cid, flat, ref)
        guard.settle()
        return flat

    upload(3, 5.0)
    upload(3, 5.0)
    guard.begin_round({0, 1, 2, 3})
    assert guard._typical is None  # one site's word is not the typical step
    for _ in range(2):
        for cid in range(3):
            upload(cid, 1.0)
        for _ in range(5):
            fast = upload(3, 5.0)
    # clipped to 2 x the honest median: its own accepted steps (5) are larger than the typical one,
    # and a site is clipped to its own steps up to _OWN_CLIP = 2 x the typical (an honest site whose
    # data differ is not clipped round after round); 5 x unclipped before the history was per site
    assert np.linalg.norm(fast) == pytest.approx(2.0, rel=1e-6)
    assert guard._typical == pytest.approx(1.0)
    assert [len(guard.distances[c]) for c in range(4)] == [2, 2, 2, 2]


def test_a_skewed_round_does_not_turn_the_honest_majority_away():
    """No direction rule: after a round one site pulled its way, the honest sites' corrections
    (pointing against that step) are taken, clipped at most, never refused."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=4)
    ref = np.zeros(8, dtype=np.float32)
    guard.begin_round({0, 1, 2, 3})
    for cid in range(4):
        guard.bound(cid, np.full(8, 1.0 if cid == 3 else 0.1, dtype=np.float32), ref)
    guard.settle()
    guard.begin_round({0, 1, 2, 3})
    for cid in range(3):
        correction = np.full(8, -0.1, dtype=np.float32)
        guard.bound(cid, correction, ref)
        np.testing.assert_array_equal(correction, np.full(8, -0.1, dtype=np.float32))


def test_the_first_round_is_bounded_by_its_own_median():
    """With no history, the round's uploads are measured first and the median of their distances
    bounds them: honest first steps many times the model's norm are taken whole, a sign flip x10
    is clipped to the honest median (not to the model's norm), and x100 is refused."""
    ref = np.full(64, 0.01, dtype=np.float32)  # norm 0.08: every honest first step is ~15 x that
    honest = [ref + np.full(64, 0.15 + 0.01 * c, dtype=np.float32) for c in range(3)]  # distances 1.2, 1.28, 1.36
    guard = InfluenceGuard(InfluenceConfig(), num_clients=5)
    guard.begin_round(set(range(5)))
    assert guard.calibrating
    flipped, wild = ref - 10 * (honest[0] - ref), ref - 100 * (honest[0] - ref)  # 12 and 120 away
    uploads = [*honest, flipped, wild]
    distances = {}
    for cid, flat in enumerate(uploads[:4]):
        distances[cid] = guard.measure(cid, flat, ref)
    with pytest.raises(Refused):  # 120 > 10 x max(norm, sqrt(64)) = 80: refused as it comes
        guard.measure(4, wild, ref)
    guard.calibrate()
    median = float(np.median([*distances.values(), 120.0]))  # 1.36: refused uploads count too
    assert guard._typical == pytest.approx(median, rel=1e-5)
    for cid in range(3):
        before = uploads[cid].copy()
        guard.bound(cid, uploads[cid], ref, distances[cid])
        np.testing.assert_array_equal(uploads[cid], before)
    guard.bound(3, flipped, ref, distances[3])
    assert np.linalg.norm(flipped - ref) == pytest.approx(median, rel=1e-5)
    guard.settle()
    assert not InfluenceGuard(InfluenceConfig(calibrate_first_round=False), 2).calibrating


def test_a_site_refused_again_and_again_has_one_say_in_the_first_median():
    """Async, before the bounds calibrate, a refused site is answered and may upload again: six
    tries just past the limit, then one just under it, must not make the typical distance its own
    (the last would then be folded nearly whole, 9.9 x sqrt(P) away, instead of refused)."""
    guard = InfluenceGuard(InfluenceConfig(), num_clients=3)
    guard.begin_round({0, 1, 2})
    ref = np.zeros(100, dtype=np.float32)
    limit = 10 * math.sqrt(ref.size)  # 10 x max(norm, sqrt(P)), the model being all zeros
    for _ in range(6):
        with pytest.raises(Refused):
            guard.measure(0, np.full(100, 1.01 * limit / 10, dtype=np.float32), ref)
    near = np.full(100, 0.99 * limit / 10, dtype=np.float32)
    distances = {0: guard.measure(0, near, ref)}
    for cid, scale in ((1, 0.1), (2, 0.12)):
        distances[cid] = guard.measure(cid, np.full(100, scale, dtype=np.float32), ref)
    guard.calibrate()  # the median of 9.9, 1 and 1.2, not of the tries as well (10.1)
    with pytest.raises(Refused, match=r"10 x the typical 1\.2 is the limit"):
        guard.bound(0, near, ref, distances[0])
    guard.bound(1, np.full(100, 0.1, dtype=np.float32), ref, distances[1])


def test_the_server_parks_the_first_round_on_disk_and_bounds_it_by_its_median(tmp_path):
    """The real path: four sealed uploads of round 0, one a sign flip x10. The server weighs and
    measures each as it comes, parks it under out/scratch/parked, and once the round is in folds the
    honest ones whole and the flip clipped to the honest median; the scratch is gone after."""
    server, chans = _in_process_federation(tmp_path, 5)
    collector = PlainCollector(server, server.strategy, 0)
    try:
        step = np.full(SIZE, 0.5, dtype=np.float32)
        uploads = {1: -10 * step, 2: step, 3: 1.1 * step, 4: 1.2 * step}
        for rank, flat in uploads.items():
            chans[rank].send(0, P.UPDATE, {"round": 0, "num_examples": 10, "metrics": {}}, {"params": flat})
        server.strategy.begin_round(0)
        server.influence.begin_round(server.live)
        parked_during_round = []
        take = collector.take_update

        def watching_take(*args):
            take(*args)
            parked_during_round.append(sorted(p.name for p in (tmp_path / "scratch" / "parked").glob("*")))

        collector.take_update = watching_take
        got = collector.collect(0, False)
        server.strategy.end_round(0)
        assert got.answered == {0, 1, 2, 3} and not got.refused
        assert len(parked_during_round[-1]) == 4  # all four were on disk before any was folded
        assert not (tmp_path / "scratch").exists()
        median = float(np.median([np.linalg.norm(f) for f in uploads.values()]))  # 1.41: honest scale
        # clip_factor 1: whatever asked for more than the median moves the median (the flip, and
        # the largest honest step, 1.47)
        clipped = [f * min(1.0, median / np.linalg.norm(f)) for f in uploads.values()]
        np.testing.assert_allclose(server.strategy.global_flat, np.mean(clipped, axis=0), rtol=1e-5)
        assert server.influence.clipped == 2
    finally:
        server.metrics.close()


def test_hostile_first_round_uploads_are_refused_before_they_are_parked(tmp_path):
    """While round 0 calibrates, what a hostile site sends is refused as it comes and never
    reaches the disk or the median's say: x1e30 parameters (beyond 10 x sqrt(P)), a second
    upload for the round, one for another round; the honest three are folded whole. (Counted
    only: with the default security.on_misbehaviour=evict the duplicate evicts the site, below.)"""
    server, chans = _in_process_federation(tmp_path, 5, security={"on_misbehaviour": "ignore"})
    try:
        step = np.full(SIZE, 0.5, dtype=np.float32)
        head = {"num_examples": 10, "metrics": {}}
        sends = [(1, {"round": 0, **head}, step * np.float32(1e30)), (1, {"round": 0, **head}, step),
                 (1, {"round": 7, **head}, step), (2, {"round": 0, **head}, step),
                 (3, {"round": 0, **head}, step), (4, {"round": 0, **head}, step)]
        for rank, header, flat in sends:
            chans[rank].send(0, P.UPDATE, header, {"params": flat})
        server.strategy.begin_round(0)
        server.influence.begin_round(server.live)
        got = PlainCollector(server, server.strategy, 0).collect(0, False)
        server.strategy.end_round(0)
        assert got.refused == {0}
        assert server.rejected_by_rank.get(1, 0) == 3
        assert {"update out of range", "duplicate update", "stale update"} <= set(server.rejected)
        np.testing.assert_array_equal(server.strategy.global_flat, step)
        assert not (tmp_path / "scratch").exists()
    finally:
        server.metrics.close()


def test_a_duplicate_upload_evicts_its_site_and_the_round_closes_with_the_others(tmp_path):
    """The default policy: the second upload of a round is evidence; the site is told EVICTED, what
    it sends next is dropped by the channel unread, and the round closes once the others are in."""
    server, chans = _in_process_federation(tmp_path, 5)
    try:
        step = np.full(SIZE, 0.5, dtype=np.float32)
        head = {"num_examples": 10, "metrics": {}}
        for rank, header in [(1, {"round": 0, **head}), (1, {"round": 0, **head}), (2, {"round": 0, **head}),
                             (3, {"round": 0, **head}), (4, {"round": 0, **head})]:
            chans[rank].send(0, P.UPDATE, header, {"params": step})
        server.strategy.begin_round(0)
        server.influence.begin_round(server.live)
        t0 = time.monotonic()
        PlainCollector(server, server.strategy, 0).collect(0, False)
        assert time.monotonic() - t0 < server.config.deadlines.round_deadline_s
        assert server.live == {1, 2, 3} and [e["reason"] for e in server.ledger.state()] == [
            "unrequested update (duplicate update: a second update for round 0)"]
        msg = chans[1].recv(kinds={P.EVICTED}, timeout=5)
        assert msg is not None and "duplicate update" in msg.header["reason"]
        chans[1].send(0, P.UPDATE, {"round": 0, **head}, {"params": step})
        assert server.channel.recv(timeout=0.5) is None
        assert server.channel.stats.rejected.get("unsolicited kind") == 1
    finally:
        server.metrics.close()


def test_async_uploads_wait_for_three_sites_then_each_is_measured_from_the_model_it_was_sent(tmp_path):
    """Async, the real sealed path. A fast attacker's sign flip x10 is parked, unanswered, until
    three sites have uploaded (so it can neither fill the history nor move the model alone first),
    then clipped to their median. A site answered before those folds, whose upload is far from
    the model as it is now, is measured from the model it was sent and folded whole."""
    # the unrequested copy below is only counted here (by default it evicts: test_eviction*.py)
    server, chans = _in_process_federation(tmp_path, 5, strategy={"name": "fedasync"},
                                           security={"on_misbehaviour": "ignore"})
    loop = AsyncLoop(server)
    try:
        loop.begin()
        first = [chans[rank].recv(kinds={P.PARAMS}, timeout=5).header for rank in range(1, 5)]
        assert all(h["answer"] for h in first)  # every site's first model
        version = first[0]["version"]

        def upload(rank: int, flat: np.ndarray) -> list:
            chans[rank].send(0, P.UPDATE, {"version": version, "num_examples": 10, "metrics": {}}, {"params": flat})
            return loop.update(server.channel.recv(kinds={P.UPDATE}, timeout=5))

        unit = np.eye(SIZE, dtype=np.float32)
        flip, steps = -10 * unit[5], {2: unit[0], 3: 1.1 * unit[1], 4: 1.05 * unit[2]}
        assert upload(1, flip) == []
        assert upload(1, flip) == []  # a second copy, not asked for: refused
        assert server.rejected == {"unrequested update": 1}
        loop.last_seen[0] -= 10_000  # parked, it waits on the server: not silent
        loop.check_silent()
        assert 0 in server.live
        assert sorted(p.name for p in (tmp_path / "scratch" / "parked").iterdir()) == ["client0.bin"]
        assert upload(2, steps[2]) == []
        assert chans[1].recv(kinds={P.PARAMS}, timeout=0.2) is None  # no answer while parked
        released = upload(3, steps[3])
        assert [u.client_id for u, _ in released] == [0, 1, 2]  # folded in client order
        assert not (tmp_path / "scratch" / "parked").exists()

        median = 1.1  # of the distances 10, 1, 1.1: the flip moves no farther than the honest 1.1
        expected = np.zeros(SIZE, dtype=np.float32)
        for staleness, w in enumerate([flip * (median / 10), steps[2], steps[3]]):
            alpha = 0.6 * (staleness + 1) ** -0.5  # FedAsync, polynomial staleness a = 0.5
            expected = (1 - alpha) * expected + alpha * w
        np.testing.assert_allclose(server.strategy.global_flat, expected, rtol=1e-5)
        assert server.influence.clipped == 1
        # Site 4 trained from the first model (zeros): 1.05 from it, under the median, so whole,
        # though 1.23 from the model as it is now (clipped to 1.1, had it been measured from that).
        assert np.linalg.norm(steps[4] - server.strategy.global_flat) > median
        [(folded, _)] = upload(4, steps[4])
        assert folded.client_id == 3
        assert server.influence.clipped == 1
        alpha = 0.6 * 4 ** -0.5  # three versions stale
        np.testing.assert_allclose(server.strategy.global_flat, (1 - alpha) * expected + alpha * steps[4], rtol=1e-5)
        assert sorted(p.name for p in (tmp_path / "scratch" / "sent").iterdir()) == [f"client{c}.bin" for c in range(4)]
    finally:
        loop.end()
        server.metrics.close()
    assert not (tmp_path / "scratch").exists()


def test_hostile_async_uploads_while_the_bounds_calibrate_are_refused_answered_and_never_parked(tmp_path):
    """Before three sites are in, what one async site sends with hostile content is refused as it
    comes: NaN, x1e30 (answered: the site goes on), a version older than its answer (header
    values beyond int64 and the like: the fuzz test below). Nothing reaches the disk or the median,
    and the honest three are then folded whole."""
    # refusal mechanics only: by default the first refusal of a malformed upload evicts (test_eviction*.py)
    server, chans = _in_process_federation(tmp_path, 5, strategy={"name": "fedasync"},
                                           security={"on_misbehaviour": "ignore"})
    loop = AsyncLoop(server)
    try:
        loop.begin()
        first = [chans[r].recv(kinds={P.PARAMS}, timeout=5).header for r in range(1, 5)]  # every site's
        version = first[0]["version"]
        step = np.full(SIZE, 0.5, dtype=np.float32)

        def send(rank: int, flat: np.ndarray, **header) -> list:
            chans[rank].send(0, P.UPDATE, {"version": version, "num_examples": 10, "metrics": {}, **header},
                             {"params": flat})
            msg = server.channel.recv(kinds={P.UPDATE}, timeout=2)
            return [] if msg is None else server.contained(msg.source, loop.update, msg) or []

        assert send(1, np.full(SIZE, np.nan, dtype=np.float32)) == []  # malformed: its request stands
        assert send(1, step * np.float32(1e30)) == []  # well-formed, out of range: refused, answered
        assert chans[1].recv(kinds={P.PARAMS}, timeout=5).header["answer"] is True
        assert send(1, step, version=version - 1) == []  # trained from a model it was not sent
        assert not list((tmp_path / "scratch" / "parked").iterdir())
        assert server.rejected_by_rank.get(1, 0) >= 3 and server.rejected["update out of range"] == 1
        assert send(2, step) == [] and send(3, step) == []
        released = send(4, step)
        assert [u.client_id for u, _ in released] == [1, 2, 3]
        expected = np.zeros(SIZE, dtype=np.float32)
        for staleness in range(3):  # each folded whole, FedAsync's polynomial staleness a = 0.5
            alpha = 0.6 * (staleness + 1) ** -0.5
            expected = (1 - alpha) * expected + alpha * step
        np.testing.assert_allclose(server.strategy.global_flat, expected, rtol=1e-5)
        assert server.influence.clipped == 0
    finally:
        loop.end()
        server.metrics.close()


def test_influence_state_round_trips_for_resume():
    guard = InfluenceGuard(InfluenceConfig(), num_clients=2)
    guard.begin_round({0, 1})
    guard.weight(0, 7), guard.weight(1, 9)
    guard.bound(0, np.ones(3, np.float32), np.zeros(3, np.float32))
    guard.settle()
    twin = InfluenceGuard(InfluenceConfig(), num_clients=2)
    twin.load_state(guard.state())
    assert twin.state() == guard.state()
    twin.load_state({**guard.state(), "distances": {"0": [float("nan"), 1.0], "1": [float("inf")], "2": [-3.0]}})
    assert {k: list(v) for k, v in twin.distances.items()} == {0: [1.0]}  # a NaN would disable every bound
    twin.load_state({**guard.state(), "distances": [1.0, 2.0]})  # an older checkpoint's list: calibrate again
    assert twin.distances == {}


def test_influence_config_is_validated():
    with pytest.raises(Exception, match=r"influence\.clip_factor"):
        from_mapping({"influence": {"clip_factor": 0.5}})
    with pytest.raises(Exception, match=r"influence\.reject_factor"):
        from_mapping({"influence": {"reject_factor": 1.0}})


# -- the real decode -> validate -> strategy path, fuzzed ------------------------------------------
PSK = bytes(range(32))
SIZE = 6


def _in_process_federation(out: Path, ranks: int, **config: Any) -> tuple[ServerCore, list[SecureChannel]]:
    """The core of a server on rank 0 with its real channel, past its setup exchange, and sealed
    channels for ranks 1.. (the sites). The mode follows from the strategy alone."""
    ts = InProcTransport.group(ranks)
    chans = [SecureChannel(t, Credentials(mode="psk", psk=PSK), b"job-fuzz", log=lambda *_: None) for t in ts]
    threads = [threading.Thread(target=chans[r].connect, args=([0],), kwargs={"timeout": 10}) for r in range(1, ranks)]
    for t in threads:
        t.start()
    chans[0].connect(list(range(1, ranks)), timeout=10)
    for t in threads:
        t.join()
    cfg = from_mapping({"rounds": 1, "task": {"name": "synthetic"}, **config})
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HPCFED_PSK", PSK.hex())
        core = Server(cfg, chans[0], out).core
    core.strategy.initialize({"w": np.zeros(SIZE, dtype=np.float32)})
    assert core.strategy.layout is not None
    core.start(core.strategy.layout, MetricsLog(out / "metrics.jsonl"))
    return core, chans


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """The server, and the sealed channels of the hostile rank 1 and the honest rank 2. The fuzz
    sends rank 1's hostile messages one after another: they are only counted here (by default the
    first would evict rank 1, and the channel would drop the rest unread: test_eviction*.py)."""
    server, chans = _in_process_federation(Path(tmp_path_factory.mktemp("fuzz")), 3,
                                           security={"on_misbehaviour": "ignore"})
    yield server, chans[1], chans[2]
    server.metrics.close()


def _send_and_take(server: ServerCore, sender: SecureChannel, header: dict, tensors: dict,
                   collector: PlainCollector) -> None:
    try:
        sender.send(0, P.UPDATE, header, tensors)
    except ValueError:  # our own encoder refuses it (e.g. a lone surrogate): nothing is sent
        return
    msg = server.channel.recv(kinds={P.UPDATE}, timeout=5)
    if msg is not None:  # a message the channel itself refused never reaches the server
        server.contained(msg.source, collector.take_update, msg)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-INT64, max_value=INT64)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)
hostile_headers = st.fixed_dictionaries({}, optional={
    "round": json_values | st.integers(min_value=0, max_value=3),
    "version": json_values, "client_version": json_values,
    "num_examples": json_values | st.integers(min_value=0, max_value=INT64),
    "metrics": json_values | st.dictionaries(st.text(max_size=300), json_values, max_size=300),
    "shard": json_values,
})
hostile_tensors = st.dictionaries(
    st.sampled_from(["params", "params:bfloat16", "params:int8", "state/opt", "x"]),
    st.tuples(st.sampled_from(["float32", "float64", "int8", "uint8", "float16"]),
              st.lists(st.integers(min_value=0, max_value=SIZE + 1), min_size=1, max_size=2),
              st.sampled_from([0.0, 1.0, -1e30, 3e38, 1e-40])),
    max_size=3)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=hostile_headers, layout=hostile_tensors)
def test_no_update_header_or_bundle_ends_the_server_and_honest_updates_still_aggregate(federation, header, layout):
    server, hostile, honest = federation
    with np.errstate(all="ignore"):  # -1e30 as int8 is whatever the cast makes it: hostile either way
        tensors = {name: np.full(shape, fill).astype(dtype) for name, (dtype, shape, fill) in layout.items()}
    rnd = 0
    server.strategy.begin_round(rnd)
    server.influence = InfluenceGuard(InfluenceConfig(enabled=False), num_clients=2)
    collector = PlainCollector(server, server.strategy, 0)
    collector.uploads = got = RoundUploads(rnd)  # the round being gathered (`collect` starts one so)
    _send_and_take(server, hostile, {"round": rnd, **header}, tensors, collector)
    if 0 in got.answered:  # a well-formed hostile update is taken; the honest one must still be exact
        return
    _send_and_take(server, honest, {"round": rnd, "num_examples": 3, "metrics": {"loss": 1.0}},
                   {"params": np.full(SIZE, 2.0, dtype=np.float32)}, collector)
    server.strategy.end_round(rnd)
    assert got.answered == {1}
    np.testing.assert_array_equal(server.strategy.global_flat, np.full(SIZE, 2.0, dtype=np.float32))
    server.strategy.global_flat[:] = 0.0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(metrics=json_values | st.dictionaries(st.text(max_size=300), json_values, max_size=300),
       error=json_values)
def test_hostile_result_and_failure_headers_are_bounded(federation, metrics, error):
    ok = metrics_ok(metrics)
    if ok:
        assert all(v is None or math.isfinite(float(v)) for v in metrics.values())
    assert len(short(error)) <= 330


def test_local_only_training_is_not_bounded(federation):
    """`local` keeps every site to itself: its uploads are not clipped (a baseline must train as
    the site trained), while a strategy that shares them is bounded."""
    from hpcfed.strategies.base import StrategyContext, Update
    from hpcfed.strategies.local import Local

    server = federation[0]
    shared, guard = server.strategy, server.influence
    local = Local(Local.Config(), StrategyContext(num_clients=2, seed=0))
    local.initialize({"w": np.zeros(SIZE, dtype=np.float32)})
    try:
        server.influence = InfluenceGuard(InfluenceConfig(), num_clients=2)
        server.influence.begin_round({0, 1})
        far = np.full(SIZE, 100.0, dtype=np.float32)  # 245 away from a zero model: beyond 10 x sqrt(P)
        bounding = Bounding(server, lambda cid: server.strategy.model_for(cid))
        server.strategy = local
        assert bounding.bound(1, Update(client_id=0, flat=far.copy(), num_examples=1))
        server.strategy = shared
        assert not bounding.bound(1, Update(client_id=0, flat=far.copy(), num_examples=1))
    finally:
        server.strategy, server.influence = shared, guard
