"""`hpcfed data import-docs`: tables and parallel files into the corpus file `task.dataset: file` reads."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from hpcfed.cli import main as cli_main
from hpcfed.cli.data import import_docs_main as main
from hpcfed.data.corpus import label_names, load_corpus_file
from hpcfed.data.root import DataError


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_table_with_its_own_column_names_keeps_string_labels_as_names(tmp_path, capsys):
    src = tmp_path / "reuters.tsv"
    src.write_text("doc_id\tbody\ttopic\nr1\toil prices rose\tcrude\nr2\tprofit up\tearn\n"
                   "r3\tshares bought\tacq\nr4\tunlabelled text\t\n")
    out = tmp_path / "corpus.jsonl"
    assert main([str(src), "--columns", "id=doc_id,text=body,label=topic", "--out", str(out)]) == 0
    assert "kept 4 of 4 rows; 3 labels" in capsys.readouterr().out
    assert _read(out)[0] == {"id": "r1", "text": "oil prices rose", "label": "crude"}
    assert "label" not in _read(out)[3]  # an empty label: unlabelled
    docs = load_corpus_file(out)  # what task.dataset=file reads
    assert [d.group for d in docs] == ["crude", "earn", "acq", ""]
    assert label_names(docs) == ["acq", "crude", "earn"] and docs[3].label == -1


def test_bad_rows_name_file_and_row_or_are_skipped_and_counted(tmp_path, capsys):
    src = tmp_path / "docs.csv"
    src.write_text("id,text,label\na,first text,x\nb,,y\na,duplicate id,x\nc,fine,z\n")
    out = tmp_path / "c.jsonl"
    with pytest.raises(DataError, match=r"docs\.csv: row 3: text: the text is empty; fix the row or pass --skip-bad"):
        main([str(src), "--out", str(out)])
    assert not out.exists()  # nothing half written
    assert main([str(src), "--out", str(out), "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "kept 2 of 4 rows, skipped 2 (bad text: 1, bad id: 1); 2 labels" in captured.out
    assert "docs.csv: row 4: id: duplicate id 'a'" in captured.err
    assert [d["id"] for d in _read(out)] == ["a", "c"]
    # the same through `hpcfed data import-docs`: one line, exit 2, no traceback
    assert cli_main(["data", "import-docs", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "row 3: text" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_parallel_texts_and_labels_files(tmp_path, capsys):
    texts, labels = tmp_path / "texts.txt", tmp_path / "labels.txt"
    texts.write_text("oil prices rose\nprofit up\n\nshares bought\n")
    labels.write_text("crude\nearn\nearn\nacq\n")
    out = tmp_path / "c.jsonl"
    with pytest.raises(DataError, match=r"texts\.txt: line 3 / .*labels\.txt: line 3: text: the text is empty"):
        main(["--texts", str(texts), "--labels", str(labels), "--out", str(out)])
    assert main(["--texts", str(texts), "--labels", str(labels), "--out", str(out), "--skip-bad"]) == 0
    assert "kept 3 of 4 rows, skipped 1 (bad text: 1); 3 labels" in capsys.readouterr().out
    assert _read(out)[2] == {"id": "3", "text": "shares bought", "label": "acq"}  # id: the 0-based row
    labels.write_text("crude\nearn\n")
    with pytest.raises(DataError, match=r"texts\.txt has more rows than .*labels\.txt \(2 there\)"):
        main(["--texts", str(texts), "--labels", str(labels), "--out", str(out), "--skip-bad"])
    # each file a table: a column spec for each (text= in the texts file, label= in the labels file)
    pd.DataFrame({"key": ["k1", "k2"], "body": ["a text", "another"]}).to_parquet(tmp_path / "t.parquet")
    (tmp_path / "l.csv").write_text("cls\nsport\npolitics\n")
    assert main(["--texts", str(tmp_path / "t.parquet"), "--labels", str(tmp_path / "l.csv"),
                 "--columns", "id=key,text=body,label=cls", "--out", str(out)]) == 0
    assert _read(out) == [{"id": "k1", "text": "a text", "label": "sport"},
                          {"id": "k2", "text": "another", "label": "politics"}]
    with pytest.raises(DataError, match=r"l\.csv: no column 'topic' for the label .* --columns label=COLUMN"):
        main(["--texts", str(tmp_path / "t.parquet"), "--labels", str(tmp_path / "l.csv"),
              "--columns", "id=key,text=body,label=topic", "--out", str(out)])


def test_integer_labels_stay_integers_and_hostile_cells_are_refused(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_text('{"id": 1, "text": "a", "label": 2}\n{"id": 2, "text": "b", "label": 0}\n')
    out = tmp_path / "c.jsonl"
    assert main([str(src), "--out", str(out)]) == 0
    assert [d["label"] for d in _read(out)] == [2, 0] and load_corpus_file(out)[0].label == 2
    for line, what in (('{"id": true, "text": "a"}', "row 1: id"), ('{"id": "x", "text": 5}', "row 1: text"),
                       ('{"id": "x", "text": "t", "label": [1]}', "row 1: label"), ("[1, 2]", "not a JSON object")):
        src.write_text(line + "\n")
        with pytest.raises(DataError, match=what):
            main([str(src), "--out", str(out)])
    src.write_text('{"id": 1, "text": "a"}\n')
    with pytest.raises(DataError, match="no column 'body' for the text"):
        main([str(src), "--columns", "text=body", "--out", str(out)])
    with pytest.raises(DataError, match="either INPUT"):
        main(["--out", str(out)])
    with pytest.raises(DataError, match="go together"):
        main(["--texts", str(src), "--out", str(out)])
    with pytest.raises(DataError, match=r"write a \.jsonl"):
        main([str(src), "--out", str(tmp_path / "c.csv")])
