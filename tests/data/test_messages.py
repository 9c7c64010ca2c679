"""Message format readers, the importer (incl. malformed rows), the message graph, real-data loaders."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from hpcfed.data.message_datasets import load_arabic, load_crisislext6, load_crisislext26, load_site
from hpcfed.data.message_graph import (
    edge_index,
    extract_entities,
    extract_hashtags,
    extract_mentions,
    message_adjacency,
    message_attributes,
)
from hpcfed.data.message_selection import event_part, event_subset, message_share
from hpcfed.data.messages import Messages, read_messages
from hpcfed.data.root import DataError
from hpcfed.data.synthetic_messages import make_messages

GOOD_CSV = """id,text,time,user,mentions,hashtags,entities,event
1,Flooding in #Calgary now @cbc,2013-06-21T10:00:00Z,alice,cbc,calgary,,flood
2,Stay safe,1371808800,bob,"[""alice""]",,,flood
3,Quake hits Bohol,2013-10-15 08:12:00,,,,Bohol,quake
"""


def test_read_csv_with_all_list_encodings(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text(GOOD_CSV)
    msgs, report = read_messages(path)
    assert report.num_kept == 3 and report.num_skipped == 0
    assert msgs.ids == ["1", "2", "3"]
    assert msgs.mentions[1] == ["alice"] and msgs.hashtags[0] == ["calgary"] and msgs.entities[2] == ["Bohol"]
    assert msgs.times[1] == np.datetime64("2013-06-21T10:00:00")
    assert msgs.users[2] == "" and msgs.events == ["flood", "flood", "quake"]


BAD_CSV = """id,text,time,user,mentions,hashtags,entities,event
1,ok,2013-06-21T10:00:00Z,a,,,,flood
,no id,2013-06-21T10:00:00Z,a,,,,flood
1,duplicate,2013-06-21T10:00:00Z,a,,,,flood
4,bad time,yesterday-ish,a,,,,flood
5,no event,2013-06-21T10:00:00Z,a,,,,
6,bad list,2013-06-21T10:00:00Z,a,"[""unclosed",,,flood
7,ok too,2013-06-21T11:00:00Z,a,,,,quake
"""


def test_malformed_rows_raise_with_row_and_field(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(BAD_CSV)
    with pytest.raises(DataError, match=r"bad.csv: row 3: id: empty id"):
        read_messages(path)


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(BAD_CSV)
    msgs, report = read_messages(path, on_error="skip")
    assert msgs.ids == ["1", "7"]
    assert report.num_rows == 7 and report.num_skipped == 5
    assert dict(report.reasons) == {"id": 2, "time": 1, "event": 1, "mentions": 1}
    assert any("row 5: time" in s for s in report.skipped)
    assert "skipped 5" in report.summary()


def test_missing_required_column_and_bad_jsonl(tmp_path):
    path = tmp_path / "nocol.csv"
    path.write_text("id,text,event\n1,x,e\n")
    with pytest.raises(DataError, match="missing required column"):
        read_messages(path)
    jl = tmp_path / "m.jsonl"
    jl.write_text(json.dumps({"id": "1", "text": "a", "time": "2020-01-01", "event": 1}) + "\n{not json\n")
    with pytest.raises(DataError, match="line 2: not valid JSON"):
        read_messages(jl)
    msgs, report = read_messages(jl, on_error="skip")
    assert len(msgs) == 1 and report.num_skipped == 1


def test_importer_cli_round_trip(tmp_path):
    src = tmp_path / "bad.csv"
    src.write_text(BAD_CSV)
    out = tmp_path / "clean.parquet"
    proc = run_cli(["data", "import-messages", str(src), "--out", str(out)], check=False)
    assert proc.returncode == 2 and "row 3: id" in proc.stderr and not out.exists()
    proc = run_cli(["data", "import-messages", str(src), "--out", str(out), "--skip-bad"])
    assert "kept 2 of 7 rows, skipped 5" in proc.stdout and "row 5: time" in proc.stderr
    msgs, report = read_messages(out)
    assert msgs.ids == ["1", "7"] and msgs.events == ["flood", "quake"] and report.num_skipped == 0
    jl = tmp_path / "clean.jsonl"
    run_cli(["data", "import-messages", str(out), "--out", str(jl)])
    again, _ = read_messages(jl)
    assert again.ids == msgs.ids and (again.times == msgs.times).all()


def _msgs(attrs: list[dict]) -> Messages:
    n = len(attrs)
    return Messages([str(i) for i in range(n)], [""] * n, np.zeros(n, "datetime64[s]"), ["e"] * n,
                    [a.get("u", "") for a in attrs], [a.get("m", []) for a in attrs],
                    [a.get("h", []) for a in attrs], [a.get("e", []) for a in attrs],
                    {"user": True, "mentions": True, "hashtags": True, "entities": True})


def test_message_graph_edges_spec_example():
    # m0{u1,h1}, m1{u1}, m2{e1}, m3{h1,e1}, m4{} (spec 1.10.10)
    msgs = _msgs([{"u": "u1", "h": ["h1"]}, {"u": "u1"}, {"e": ["e1"]}, {"h": ["h1"], "e": ["e1"]}, {}])
    a = message_adjacency(message_attributes(msgs)).toarray()
    expected = np.zeros((5, 5), bool)
    for i, j in ((0, 1), (0, 3), (2, 3)):
        expected[i, j] = expected[j, i] = True
    for i in range(4):
        expected[i, i] = True
    assert (a == expected).all()
    assert a[4].sum() == 0  # no attributes, degree 0
    assert edge_index(message_adjacency(message_attributes(msgs))).shape == (2, int(expected.sum()))


def test_namespaces_do_not_collide_and_author_minus_one_is_nobody():
    msgs = _msgs([{"u": "x"}, {"h": ["x"]}, {"u": "-1"}, {"u": "-1"}])
    a = message_adjacency(message_attributes(msgs)).toarray()
    assert not a[0, 1] and not a[2, 3] and a[2].sum() == 0


def test_extraction_from_text():
    text = "RT @CBC: Flooding in Calgary and High River #abflood #YYC http://t.co/x"
    assert extract_mentions(text) == ["cbc"]
    assert extract_hashtags(text) == ["abflood", "yyc"]
    ents = extract_entities(text)
    assert "calgary" in ents and "high river" in ents and not any(e == "rt" for e in ents)
    msgs = Messages(["a", "b"], [text, "more #ABflood news"], np.zeros(2, "datetime64[s]"), ["e", "e"],
                    ["", ""], [[], []], [[], []], [[], []], {})
    a = message_adjacency(message_attributes(msgs)).toarray()
    assert a[0, 1]  # linked through the extracted hashtag


def test_synthetic_generator_plants_events():
    msgs = make_messages(0, 0, num_events=3, per_event=10)
    assert len(msgs) == 30 and sorted(set(msgs.events)) == ["event0", "event1", "event2"]
    shifted = make_messages(0, 1, num_events=3, per_event=10, shift=2)
    assert sorted(set(shifted.events)) == ["event2", "event3", "event4"]


def test_real_loaders(shared_data):
    m26, r26 = load_crisislext26(shared_data)
    assert len(set(m26.events)) == 26 and len(m26) + r26.num_skipped == 27933
    assert r26.reasons["id"] == r26.num_skipped  # only duplicate ids are skipped, and they are counted
    m6, r6 = load_crisislext6(shared_data)
    assert len(set(m6.events)) == 6 and len(m6) + r6.num_skipped == 32462
    ar, ra = load_arabic(shared_data)
    assert len(ar) == 3022 and len(set(ar.events)) == 7 and ra.num_skipped == 0
    assert ar.has["user"] and any(ar.hashtags)
    assert (m26.times > np.datetime64("2012-01-01")).all() and (m6.times > np.datetime64("2012-01-01")).all()
    quarters = [set(event_part(m26, i, 4).events) for i in (1, 2, 3, 4)]  # configs/dame_crisis6.yaml's sites
    assert [len(e) for e in quarters] == [7, 7, 6, 6] and len(set().union(*quarters)) == 26
    assert all(e.startswith("2012_") for e in quarters[0])  # the first quarter is the 2012 events


def _timed(events: list[str], days: list[int]) -> Messages:
    n = len(events)
    times = np.datetime64("2013-01-01", "s") + np.asarray(days) * np.timedelta64(86400, "s")
    return Messages([str(i) for i in range(n)], [""] * n, times, events, [""] * n, [[]] * n, [[]] * n, [[]] * n, {})


def test_event_parts_split_events_in_time_order():
    # first messages: c day 0, a day 1, d day 2 (tie with b, broken by name: b first), b day 2, e day 5
    msgs = _timed(["a", "b", "c", "a", "d", "e", "c"], [1, 2, 0, 9, 2, 5, 8])
    parts = [sorted(set(event_part(msgs, i, 3).events)) for i in (1, 2, 3)]
    assert parts == [["a", "c"], ["b", "d"], ["e"]]  # array_split of [c, a, b, d, e]: 2, 2, 1
    assert sum(len(event_part(msgs, i, 3)) for i in (1, 2, 3)) == len(msgs)  # every message in one part
    with pytest.raises(DataError, match="between 1 and 3"):
        event_part(msgs, 4, 3)
    with pytest.raises(DataError, match="only 5 events"):
        event_part(msgs, 1, 6)


def test_site_parts_of_a_message_file(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text(GOOD_CSV)
    msgs, report = load_site(f"{path}:2/2")  # events flood (June) then quake (October)
    assert msgs.events == ["quake"] and "events part 2/2: 1 events, 1 messages" in report.source


def test_event_subsets_by_pattern(tmp_path):
    msgs = _timed(["2012_Italy_earthquakes", "2013_Alberta_floods", "2013_Bohol_earthquake", "fire"], [0, 1, 2, 3])
    assert event_subset(msgs, "QUAKE").events == ["2012_Italy_earthquakes", "2013_Bohol_earthquake"]
    assert event_subset(msgs, "flood|fire").events == ["2013_Alberta_floods", "fire"]
    with pytest.raises(DataError, match=r"site 'x~storm': no event label matches 'storm'; the labels are: 2012_"):
        event_subset(msgs, "storm", "x~storm")
    with pytest.raises(DataError, match="is not a regular expression"):
        event_subset(msgs, "(quake")
    with pytest.raises(DataError, match="1 to 200 characters"):
        event_subset(msgs, "a" * 201)
    path = tmp_path / "m.csv"
    path.write_text(GOOD_CSV)
    msgs, report = load_site(f"{path}~qua")
    assert msgs.events == ["quake"] and "events matching 'qua': 1 events, 1 messages" in report.source



def test_message_shares_are_disjoint_and_spread_every_event():
    events = ["a"] * 9 + ["b"] * 6 + ["c"] * 2
    msgs = _timed(events, list(range(len(events))))
    parts = [message_share(msgs, i, 3) for i in (1, 2, 3)]
    ids = [set(p.ids) for p in parts]
    assert set().union(*ids) == set(msgs.ids) and sum(len(s) for s in ids) == len(msgs)  # disjoint, complete
    for p in parts:  # every event dealt evenly: 3 of a and 2 of b at each part; c (2 messages) at two parts
        assert p.events.count("a") == 3 and p.events.count("b") == 2
        assert p.ids == sorted(p.ids, key=int)  # file order kept
    assert sorted(p.events.count("c") for p in parts) == [0, 1, 1]
    assert message_share(msgs, 2, 3).ids == parts[1].ids  # the same parts at every site (fixed seed)
    assert message_share(msgs, 1, 1).ids == msgs.ids


@pytest.mark.parametrize("selector, match", [
    ("%0/3", "between 1 and 3"), ("%4/3", "between 1 and 3"), ("%1/0", "at least 1"),
    ("%1/18", "only 17 messages"), ("%1/9999999", "unknown message dataset"), ("%-1/3", "unknown message dataset"),
])
def test_message_share_selector_rejects_bad_parts(tmp_path, selector, match):
    path = tmp_path / "m.csv"
    path.write_text("id,text,time,event\n" + "".join(f"{i},t{i},{1371808800 + i},e{i % 3}\n" for i in range(17)))
    with pytest.raises(DataError, match=match):
        load_site(f"{path}{selector}")


def test_message_share_after_an_event_pattern(tmp_path):
    path = tmp_path / "m.csv"
    path.write_text(GOOD_CSV)
    msgs, report = load_site(f"{path}~flood%2/2")  # % applies to what ~ selected: the two flood messages
    assert msgs.events == ["flood"] and "message share 2/2: 1 events, 1 messages" in report.source
    first, _ = load_site(f"{path}~flood%1/2")
    assert set(first.ids) | set(msgs.ids) == {"1", "2"} and not set(first.ids) & set(msgs.ids)


class _RunsCode:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned",))


def test_arabic_object_array_is_read_with_an_allow_list(tmp_path):
    import pandas as pd

    folder = tmp_path / "events" / "arabic"
    folder.mkdir(parents=True)
    row = [7, "u1", "نص", None, "flood", ["@a"], ["#b"], None, None, pd.Timestamp("2018-01-02 03:04"), None,
           ["x"], None]
    table = np.empty((1, 13), dtype=object)
    table[0] = row
    np.save(folder / "Arabic_100.npy", table, allow_pickle=True)
    msgs, report = load_arabic(tmp_path)  # the shipped layout: strings, lists, pandas Timestamps
    assert report.num_kept == 1 and list(msgs.mentions[0]) == ["a"] and list(msgs.hashtags[0]) == ["b"]
    table[0, 2] = _RunsCode()
    np.save(folder / "Arabic_100.npy", table, allow_pickle=True)
    refused = r"Arabic_100\.npy: cannot be read as the Arabic event set \(refusing posix\.system"
    with pytest.raises(DataError, match=refused):
        load_arabic(tmp_path)
