"""Refusals: counted by reason and rank, logged (the first ten of a rank in full, then every
1000th), and a rank cut off once at `max_rejects`."""

from __future__ import annotations

from hpcfed.comm.options import ChannelOptions
from hpcfed.comm.session import Session
from hpcfed.comm.transport import InProcTransport


def _session(max_rejects: int = 10000) -> tuple[Session, list[str], list[int]]:
    logs: list[str] = []
    cut: list[int] = []
    s = Session(InProcTransport.group(3)[0], b"job", ChannelOptions(max_rejects=max_rejects), logs.append)
    s.on_cut_off = cut.append
    return s, logs, cut


def test_every_refusal_is_counted_and_the_first_ones_logged_in_full():
    s, logs, cut = _session()
    for _ in range(2000):
        s.reject(2, "truncated frame", "short")
    assert s.stats.rejected == {"truncated frame": 2000} and s.stats.rejected_by_rank == {2: 2000}
    assert s.peers[2].rejects == 2000 and not s.peers[2].cut_off and cut == []
    assert len(logs) == 12  # 10, then the 1000th and the 2000th
    assert logs[0] == "rejected message from rank 2: truncated frame: short"
    assert logs[-1].endswith("(2000 rejected from this rank so far)")


def test_a_rank_is_cut_off_once_at_max_rejects():
    s, logs, cut = _session(max_rejects=3)
    for _ in range(5):
        s.reject(1, "authentication failed", "bad tag")
    assert s.peers[1].cut_off and cut == [1]
    assert sum("cut off after 3 rejected messages" in line for line in logs) == 1
    s.count_cut_off_frame()
    assert s.stats.rejected["from a cut-off rank"] == 1 and s.stats.rejected_by_rank == {1: 5}


def test_the_job_digest_binds_the_job_id():
    a = Session(InProcTransport.group(2)[0], b"job-a", ChannelOptions(), None)
    b = Session(InProcTransport.group(2)[0], b"job-b", ChannelOptions(), None)
    assert len(a.jd) == 16 and a.jd != b.jd
    assert a.peer_of(1) is a.peer_of(1) and a.peers.keys() == {1}


def test_the_owner_is_told_of_every_refusal_with_its_rank_and_reason():
    s = Session(InProcTransport.group(3)[0], b"job", ChannelOptions(max_rejects=5), None)
    told: list[tuple[int, str, str]] = []
    s.on_reject = lambda rank, reason, detail: told.append((rank, reason, detail))
    for i in range(3):
        s.reject(2, "malformed bundle", f"header integer {i} is outside int64")
    s.reject(1, "bad tag", "authentication failed")
    assert told == [(2, "malformed bundle", "header integer 0 is outside int64"),
                    (2, "malformed bundle", "header integer 1 is outside int64"),
                    (2, "malformed bundle", "header integer 2 is outside int64"),
                    (1, "bad tag", "authentication failed")]
