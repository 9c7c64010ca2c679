"""`hpcfed data import-messages` options: column mapping, time from snowflake ids, events from paths."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpcfed.cli.commands import main as cli_main
from hpcfed.cli.data import import_messages_main as main
from hpcfed.data.messages import read_messages
from hpcfed.data.root import DataError

# HumAID-like TSV: tweet_id, tweet_text, class_label (no time, no event column)
HUMAID_TSV = "tweet_id\ttweet_text\tclass_label\n{a}\tfire near the highway\tcaution\n{b}\tevacuate now\trescue\n"
ID_2016 = "726453000000000000"  # a snowflake id of 2016-04-30
ID_2017 = "905000000000000000"


def _humaid(root: Path) -> Path:
    for event, (a, b) in {"canada_wildfires_2016": (ID_2016, "726453000000000001"),
                          "hurricane_irma_2017": (ID_2017, "905000000000000001")}.items():
        (root / event).mkdir(parents=True)
        (root / event / f"{event}_train.tsv").write_text(HUMAID_TSV.format(a=a, b=b))
    return root


def test_folder_of_event_folders_with_mapped_columns_and_snowflake_time(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    src = _humaid(tmp_path / "humaid")
    out = tmp_path / "humaid.parquet"
    assert main([str(src), "--event-from", "folder", "--columns", "id=tweet_id,text=tweet_text",
                 "--time-from-id", "snowflake", "--out", str(out)]) == 0
    assert "kept 4 of 4 rows; 2 events" in capsys.readouterr().out
    msgs, _ = read_messages(out)
    assert sorted(set(msgs.events)) == ["canada_wildfires_2016", "hurricane_irma_2017"]
    first = msgs.ids.index(ID_2016)
    assert msgs.texts[first] == "fire near the highway"
    assert str(msgs.times[first]).startswith("2016-04-30")
    assert str(msgs.times[msgs.ids.index(ID_2017)]).startswith("2017-09-05")


def test_event_from_file_names_and_a_time_column(tmp_path: Path) -> None:
    folder = tmp_path / "by_file"
    folder.mkdir()
    (folder / "flood.csv").write_text("msg,body,when\n1,water rising,2013-06-21T10:00:00Z\n")
    (folder / "quake.csv").write_text("msg,body,when\n2,the ground shook,2013-10-15T08:00:00Z\n")
    (folder / "notes.md").write_text("not a message file")
    out = tmp_path / "out.jsonl"
    main([str(folder), "--event-from", "file", "--columns", "id=msg,text=body,time=when", "--out", str(out)])
    msgs, _ = read_messages(out)
    assert msgs.ids == ["1", "2"] and msgs.events == ["flood", "quake"]
    assert msgs.times[1] == np.datetime64("2013-10-15T08:00:00")


def test_tsv_with_mapped_names_holding_spaces(tmp_path: Path) -> None:
    src = tmp_path / "t.tsv"
    src.write_text("Tweet ID\tTweet Text\tDisaster\n5\tstorm, then flood\tsandy\n")
    out = tmp_path / "t.parquet"
    with pytest.raises(DataError, match=r"missing required column\(s\) \['time'\].*--time-from-id snowflake"):
        main([str(src), "--columns", "id=Tweet ID,text=Tweet Text,event=Disaster", "--out", str(out)])
    src.write_text("Tweet ID\tTweet Text\tDisaster\tAt\n5\tstorm, then flood\tsandy\t1351500000\n")
    main([str(src), "--columns", "id=Tweet ID,text=Tweet Text,event=Disaster,time=At", "--out", str(out)])
    msgs, _ = read_messages(out)
    assert msgs.texts == ["storm, then flood"] and msgs.events == ["sandy"]


def test_a_mapped_column_missing_from_the_file_is_named(tmp_path: Path) -> None:
    src = _humaid(tmp_path / "humaid")
    with pytest.raises(DataError, match=r"_train.tsv: --columns text=tweet_txt: the file has no column 'tweet_txt' "
                                        r"\(its columns: tweet_id, tweet_text, class_label\)"):
        main([str(src), "--event-from", "folder", "--columns", "id=tweet_id,text=tweet_txt",
              "--time-from-id", "snowflake", "--out", str(tmp_path / "x.parquet")])


def test_a_bad_snowflake_names_file_row_and_id(tmp_path: Path) -> None:
    src = tmp_path / "m.csv"
    src.write_text(f"id,text,event\n'{ID_2016}',ok,e\nabc,not a number,e\n12345,sequential id,e\n")
    with pytest.raises(DataError, match=r"m.csv: row 3: time: id 'abc' is not a Twitter snowflake id"):
        main([str(src), "--time-from-id", "snowflake", "--out", str(tmp_path / "x.parquet")])
    out = tmp_path / "x.parquet"
    main([str(src), "--time-from-id", "snowflake", "--skip-bad", "--out", str(out)])
    msgs, _ = read_messages(out)
    assert msgs.ids == [ID_2016]


def test_conflicting_options_and_a_folder_without_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _humaid(tmp_path / "humaid")
    out = str(tmp_path / "x.parquet")
    with pytest.raises(DataError, match="leave event= out of --columns"):
        main([str(src), "--event-from", "folder", "--columns", "event=class_label", "--out", out])
    with pytest.raises(DataError, match="leave time= out of --columns"):
        main([str(src), "--time-from-id", "snowflake", "--columns", "time=x", "--out", out])
    with pytest.raises(DataError, match=r"no .* files in the layout INPUT/<event>.csv"):
        main([str(src), "--event-from", "file", "--out", out])  # the files lie one level down
    # through the CLI: one plain line, exit code 2
    assert cli_main(["data", "import-messages", str(src / "canada_wildfires_2016" / "canada_wildfires_2016_train.tsv"),
                     "--out", out]) == 2
    assert "missing required column(s)" in capsys.readouterr().err
