"""The evidence ledger: what a rejection holds against a site, and when it is evicted."""

from __future__ import annotations

import pytest

from hpcfed import protocol as P
from hpcfed.server.eviction import ChannelRefusals, Ledger, describe


def test_a_malformed_update_evicts_at_once_naming_what_was_wrong():
    ledger = Ledger("evict", max_refused=3)
    ev = ledger.note(2, "malformed bundle", "header integer 18446744073709551616 is outside int64", 0)
    assert ev is not None and ev.client == 2 and ev.rank == 3 and ev.round == 0
    assert ev.reason == "malformed update (header integer beyond int64)"
    assert ev.first_evidence.startswith("round 0: malformed bundle: header integer")


@pytest.mark.parametrize("category", ["malformed header", "wrong dtype or shape", "non-finite parameters",
                                      "unknown tensor name", "unhandled input", "unrequested update",
                                      "duplicate update"])
def test_every_class_of_positive_evidence_evicts(category):
    assert Ledger("evict", 3).note(0, category, "detail", 4) is not None


@pytest.mark.parametrize("category", ["stale update", "not a member", "inbox full"])
def test_lateness_and_what_a_site_cannot_help_are_no_evidence(category):
    ledger = Ledger("evict", 0)
    assert all(ledger.note(1, category, "x", r) is None for r in range(100))


def test_bounded_influence_refusals_evict_only_past_the_configured_count():
    ledger = Ledger("evict", max_refused=3)
    assert [ledger.note(1, "update out of range", f"distance {r}", r) for r in range(3)] == [None] * 3
    ev = ledger.note(1, "update out of range", "distance 3", 3)
    assert ev is not None and ev.reason.startswith("refused by bounded influence 4 times")
    assert ev.first_evidence.startswith("round 0: update out of range: distance 0")


def test_ignore_counts_nothing_and_an_evicted_site_is_not_evicted_twice():
    assert Ledger("ignore", 0).note(0, "malformed header", "x", 0) is None
    ledger = Ledger("evict", 0)
    ev = ledger.note(0, "malformed header", "x", 0)
    assert ev is not None
    ledger.record(ev)
    assert ledger.note(0, "malformed header", "x", 1) is None


def test_evictions_survive_a_checkpoint_and_a_record_naming_no_site_of_this_run_is_skipped():
    ledger = Ledger("evict", 3)
    ev = ledger.note(1, "malformed header", "x", 2)
    assert ev is not None
    ledger.record(ev)
    ledger.exclude(2, 5)
    state = ledger.state()
    again = Ledger("evict", 3)
    again.load_state([*state, {"client": 99, "round": 1}, "junk", {"client": True, "round": 1}], num_clients=4)
    assert again.state() == state and set(again.evicted) == {1, 2}
    assert again.evicted[2].reason == "excluded (federation.exclude_sites)"


def test_the_shape_and_count_descriptions():
    assert describe("malformed bundle", "tensor 'params': shape (0, 18446744073709551615) has more elements "
                                        "than the 8-byte limit allows") == "tensor of shape (0, 18446744073709551615)"
    assert describe("malformed header", "UPDATE num_examples") == "malformed header: UPDATE num_examples"


def test_channel_refusals_keep_the_first_authenticated_one_per_rank():
    refusals = ChannelRefusals()
    for i in range(10_000):  # a flood holds one entry, not 10,000
        refusals(3, "malformed bundle", f"header integer {i} is outside int64")
    refusals(2, "inbox full", "16 messages are waiting unread")  # a busy server's bound, not the site's fault
    refusals(1, "authentication failed", "frame 7 does not authenticate")  # anyone could have sent it
    refusals(4, "unsolicited kind", "message kind 99")  # reported once a first chunk of it authenticated
    assert refusals.take() == [(3, "malformed bundle", "header integer 0 is outside int64"),
                               (4, "unsolicited kind", "message kind 99")]
    assert refusals.take() == []


def test_an_evicted_site_may_send_nothing_and_the_others_are_unchanged():
    kinds, _, _ = P.server_bounds(100, 4, evicted={2})
    assert kinds[3] == frozenset() and kinds[1] == P.CLIENT_KINDS - {P.SETUP}
    assert P.EVICTED in P.SERVER_KINDS
