"""The channel's counters and their JSON form."""

from __future__ import annotations

import json

from hpcfed.comm.stats import ChannelStats


def test_rejections_are_counted_by_reason_and_by_rank():
    st = ChannelStats()
    st.count_rejection(3, "authentication failed")
    st.count_rejection(3, "truncated frame")
    st.count_rejection(1, "authentication failed")
    assert st.rejected == {"authentication failed": 2, "truncated frame": 1}
    assert st.rejected_by_rank == {3: 2, 1: 1}


def test_as_dict_is_json_with_rank_keys_in_order():
    st = ChannelStats(messages_sent=2, bytes_sent=100)
    st.count_rejection(10, "x")
    st.count_rejection(2, "x")
    d = st.as_dict()
    assert list(d["rejected_by_rank"]) == ["2", "10"]  # type: ignore[call-overload]
    assert json.loads(json.dumps(d))["messages_sent"] == 2
    d["rejected"]["x"] = 0  # type: ignore[index]
    assert st.rejected == {"x": 2}  # a copy, not the live counters
