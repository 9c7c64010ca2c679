"""How the server learns which site ended (after hydra's SIGUSR1), and the manifest that keeps a
dropped site's last shard. Real processes and the files `run_rank` writes."""

from __future__ import annotations

import socket
import subprocess
import sys

from hpcfed.server import departures as D
from hpcfed.store import rank_records


def _rank(log_dir, rank: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (log_dir / f"rank{rank}.pid").write_text(f"{proc.pid} {socket.gethostname()}")
    return proc


def test_a_signal_finds_the_site_that_ended_and_marks_it_gone(tmp_path):
    ranks = {r: _rank(tmp_path, r) for r in (1, 2, 3)}
    gone: list[int] = []
    dep = D.Departures(tmp_path, 3, gone.append)
    try:
        dep.probe()
        assert dep.ended({0, 1, 2}) == {} and gone == []  # no signal: nothing looked for
        ranks[2].kill()
        ranks[2].wait()
        dep.notify()
        assert gone == [2]
        assert dep.ended({0, 1, 2}) == {1: "ended without a word (killed or crashed)"}
        assert dep.ended({0, 1, 2}) == {} and not dep.unexplained
        rank_records.write_exit(tmp_path, 3, 1, "client 2 failed: bad data")
        dep.notify()
        assert dep.ended({0, 2}) == {2: "exited with status 1: client 2 failed: bad data"}
    finally:
        for proc in ranks.values():
            proc.kill()
            proc.wait()


def test_a_signal_with_no_site_ended_here_points_at_another_node(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "_EXPLAIN_S", 0.0)
    local = _rank(tmp_path, 1)
    (tmp_path / "rank2.pid").write_text("4242 node2")  # a rank on another node: its pid means nothing here
    dep = D.Departures(tmp_path, 2)
    try:
        assert dep.cause_of_silence(1) is None  # silent, but nothing says it ended: a straggler
        dep.notify()
        assert dep.ended({0, 1}) == {} and dep.unexplained
        assert dep.cause_of_silence(0) is None  # on this node, and alive
        assert "another node" in dep.cause_of_silence(1)
    finally:
        local.kill()
        local.wait()


def test_two_sites_found_at_the_first_signal_explain_the_second(tmp_path, monkeypatch):
    """Two sites killed moments apart: the first SIGUSR1 finds both ended; the second is theirs, not
    a sign that a rank on another node ended (which would drop a slow remote site at its deadline)."""
    monkeypatch.setattr(D, "_EXPLAIN_S", 0.0)
    ranks = {r: _rank(tmp_path, r) for r in (1, 2, 3)}
    dep = D.Departures(tmp_path, 3)
    try:
        for r in (1, 3):
            ranks[r].kill()
            ranks[r].wait()
        dep.notify()
        assert set(dep.ended({0, 1, 2})) == {0, 2}
        dep.notify()  # the second rank's signal
        assert dep.ended({1}) == {} and not dep.unexplained
        dep.notify()  # a third signal, and no third site ended here: one on another node did
        assert dep.ended({1}) == {} and dep.unexplained
    finally:
        for proc in ranks.values():
            proc.kill()
            proc.wait()


def test_the_manifest_keeps_a_dropped_sites_last_shard_with_its_round(tmp_path):
    dep = D.Departures(tmp_path, 3)
    ref = {i: {"digest": f"{i}" * 64, "path": f"/s/{i}"} for i in range(3)}
    assert dep.manifest(1, ref) == ref
    dep.record(1, 2, "ended without a word")
    dep.record(1, 9, "again")  # the first record stands
    fresh = {0: {"digest": "a" * 64, "path": "/s/0b"}, 2: {"digest": "b" * 64, "path": "/s/2b"}}
    assert dep.manifest(3, fresh) == {**fresh, 1: {**ref[1], "round": 1}}
    assert dep.state() == [{"client": 1, "rank": 2, "round": 2, "cause": "ended without a word"}]
    # a live site that missed a checkpoint is left out (it may have pruned its older shard since)
    dep2 = D.Departures(tmp_path, 3)
    dep2.load_shards(5, {0: ref[0], 1: {**ref[1], "round": 2}})
    assert dep2.manifest(6, {0: fresh[0]}) == {0: fresh[0]}


def test_a_site_reported_lost_by_another_watcher_is_dropped_once_without_any_signal(tmp_path):
    gone: list[int] = []
    dep = D.Departures(tmp_path, 3, gone.append)  # no pid files: the records know nothing of these sites
    dep.report(1, "its job ended (its lifeline closed)")  # from the lifelines' thread of `hpcfed serve`
    assert gone == [2]  # a send waiting on it fails at once
    assert dep.cause_of_silence(1) == "its job ended (its lifeline closed)" and dep.cause_of_silence(0) is None
    assert dep.ended({0, 1, 2}) == {1: "its job ended (its lifeline closed)"}
    dep.report(1, "again")
    assert dep.ended({0, 1, 2}) == {} and not dep.unexplained
