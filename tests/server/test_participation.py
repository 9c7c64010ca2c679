"""Late uploads of a synchronous round are counted, once per earlier round, and never taken for a
copy; participation is reported per site and survives a checkpoint."""

from __future__ import annotations

from hpcfed.server.participation import MAX_GAPS, Participation


def test_a_late_upload_is_one_per_earlier_round_newer_than_the_last():
    p = Participation(3)
    p.on_time(1, 4)
    assert p.take_late(1, 6, 8, first_round=0)  # sent round 6, arrived in round 8
    assert not p.take_late(1, 6, 8, first_round=0)  # the same round again: a copy, refused by the caller
    assert not p.take_late(1, 5, 8, first_round=0)  # older than one already taken: a replay
    assert not p.take_late(1, 8, 8, first_round=0)  # the current round is not late
    assert not p.take_late(1, 9, 8, first_round=0)  # nor a future one
    assert p.take_late(1, 7, 8, first_round=0)
    assert not p.take_late(2, 2, 8, first_round=3)  # before this run's first round (resumed at 3)


def test_hostile_round_values_are_not_late():
    p = Participation(2)
    for claimed in (None, "3", 2.0, True, [1], -1, 2**70):
        assert not p.take_late(0, claimed, 5, first_round=0), claimed
    assert p.late == {0: 0, 1: 0}


def test_report_and_state_round_trip():
    p = Participation(3)
    for _ in range(4):
        p.folded([0, 2])
    p.folded([1])
    p.take_late(1, 0, 2, first_round=0)
    report = p.report(5)
    p.gap(2, 1, 3)
    report = p.report(5)
    none = {"rejoins": 0, "gaps": []}
    assert report == {"0": {"contributed": 4, "share": 0.8, "late": 0, **none},
                      "1": {"contributed": 1, "share": 0.2, "late": 1, **none},
                      "2": {"contributed": 4, "share": 0.8, "late": 0, "rejoins": 1, "gaps": [[1, 3]]}}
    again = Participation(3)
    again.load_state(p.state())
    assert again.report(5) == report
    for bad in ({"contributed": [1, 2]}, {"late": [1, -1, 0]}, "x", {"contributed": [1, "2", 3]}):
        fresh = Participation(3)
        fresh.load_state(bad)
        assert fresh.contributed == {0: 0, 1: 0, 2: 0}, bad


def test_a_second_upload_for_a_round_is_a_repeat_and_a_first_late_one_is_not():
    from hpcfed.server.participation import Participation

    part = Participation(2)
    part.on_time(0, 3)
    assert part.repeated(0, 3) and part.repeated(0, 1)  # an honest site uploads once per round
    assert not part.repeated(0, 4) and not part.repeated(1, 3) and not part.repeated(0, "3")
    assert part.take_late(1, 2, 4, 0) and part.repeated(1, 2)  # its late upload, then a copy of it


def test_a_flapping_sites_gaps_stay_bounded_and_a_hostile_state_is_not_loaded():
    p = Participation(2)
    for r in range(3 * MAX_GAPS):
        p.gap(0, 2 * r, 2 * r + 1)
    assert len(p.report(9)["0"]["gaps"]) == MAX_GAPS and p.rejoins[0] == 3 * MAX_GAPS
    again = Participation(2)
    again.load_state({"gaps": {"0": [[1, 2], ["x", 3], [1], "no"], "1": "no"}, "rejoins": [1, "x"]})
    assert again.gaps == {0: [[1, 2]]} and again.rejoins == {0: 0, 1: 0}
