"""The roster: one owner of membership, each site in one state with its reason."""

from __future__ import annotations

from hpcfed.server.departures import Departures
from hpcfed.server.eviction import Eviction, Ledger
from hpcfed.server.roster import Roster


def _roster(tmp_path, k=5):
    return Roster(k, Ledger("evict", 3), Departures(tmp_path, k))


def test_each_site_is_in_one_state_and_the_live_set_follows(tmp_path):
    roster = _roster(tmp_path)
    roster.start_late([4])
    roster.ledger.exclude(3, 0)
    roster.leave_out()
    roster.evict(Eviction(client=2, rank=3, reason="malformed update (x)", first_evidence="round 1: x", round=1))
    roster.drop(1, 2, "ended without a word")
    roster.rejoining[4] = 0.0
    assert [roster.state(c) for c in range(5)] == ["present", "dropped", "evicted", "excluded", "rejoining"]
    assert roster.live == {0} and roster.gone(1) and roster.gone(2) and not roster.gone(0)
    del roster.rejoining[4]
    roster.join([4], 3)
    assert roster.live == {0, 4} and roster.state(4) == "present" and roster.needed(0.6) == 2
    report = roster.report(steps=4)
    assert report["dropped_clients"] == [1] and [d["cause"] for d in report["dropped"]] == ["ended without a word"]
    assert [e["client"] for e in report["evicted"]] == [2, 3] and set(report["participation"]) == set("01234")


def test_the_live_set_handed_out_cannot_change_membership(tmp_path):
    roster = _roster(tmp_path, 2)
    live = roster.live
    assert not hasattr(live, "discard")  # a frozenset: membership changes only through the roster


def test_a_dropped_site_that_comes_back_is_present_again_with_its_gap_reported(tmp_path):
    roster = _roster(tmp_path, 3)
    roster.evict(Eviction(client=2, rank=3, reason="malformed update (x)", first_evidence="round 1: x", round=1))
    roster.drop(1, 4, "lost: its job ended (its lifeline closed)")
    assert roster.may_join(1) and not roster.may_join(0) and not roster.may_join(2)  # present, evicted: no
    assert roster.report(6)["participation"]["1"]["gaps"] == [[4, None]]  # away now
    roster.rejoining[1] = 0.0
    assert roster.state(1) == "rejoining" and roster.awaiting_setup == {1}
    del roster.rejoining[1]
    roster.join([1], 7)
    report = roster.report(9)
    assert roster.live == {0, 1} and report["dropped"] == [] and report["dropped_clients"] == []
    assert report["participation"]["1"]["gaps"] == [[4, 7]] and report["participation"]["1"]["rejoins"] == 1
    roster.drop(1, 8, "lost again")  # a second departure is recorded anew (the first was taken out)
    assert roster.report(9)["participation"]["1"]["gaps"] == [[4, 7], [8, None]]
