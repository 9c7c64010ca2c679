"""``hpcfed data import-docs``: documents and their labels into the corpus file ``task.dataset: file`` reads.

    hpcfed data import-docs INPUT --out OUT.jsonl [--format csv|tsv|jsonl|parquet]
                            [--columns id=doc_id,text=body,label=topic] [--skip-bad]
    hpcfed data import-docs --texts TEXTS --labels LABELS --out OUT.jsonl [--columns text=body,label=topic]

``INPUT`` is one CSV/TSV/JSONL/Parquet table with a text column and optional id and label columns
(``--columns`` maps ``id``, ``text`` and ``label`` to the file's own names; unmapped, the columns are
called ``id``, ``text``, ``label``), or ``20newsgroups[:train|test|all]`` (read from the data root).
``--texts``/``--labels`` are two parallel files, row n of one belonging to row n of the other: each is
a table (its column named by ``text=`` and ``label=`` of ``--columns``; ``id=`` names an id column of
the texts table) or, with any other suffix (``.txt``), one value per line. Without an id column a
document's id is its 0-based row number, as for a plain-text corpus.

Labels are kept as they are written: a class name stays a name (the corpus numbers names in sorted
order and keeps them in the export, so ``hpcfed search`` and ``hpcfed eval`` show and compare names);
an integer of a JSONL or Parquet file stays an integer. An empty label leaves the document unlabelled.
Without ``--skip-bad`` the first bad row stops the import with one line naming the file, the row and
the field; with it, bad rows are skipped, counted and listed (the first 20) on stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcfed.data.messages import LoadReport, read_records
from hpcfed.data.root import DataError

COLUMNS = ("id", "text", "label")
TABLES = ("csv", "tsv", "jsonl", "ndjson", "json", "parquet")
NEWSGROUPS_PREFIX = "20newsgroups"


@dataclass
class Row:
    """One row as read: where it is (``FILE: row N``), and its id, text and label cells."""

    where: str
    id: Any = None
    text: Any = None
    label: Any = None


@dataclass
class Corpus:
    """The documents kept, as the JSON objects of the corpus file, and what was skipped."""

    docs: list[dict[str, Any]] = field(default_factory=list)
    report: LoadReport = field(default_factory=lambda: LoadReport(""))

    def num_labels(self) -> int:
        """How many distinct labels the kept documents carry."""
        return len({str(d["label"]) for d in self.docs if "label" in d})


def _is_table(path: Path, fmt: str | None) -> bool:
    return (fmt or path.suffix.lstrip(".")).lower() in TABLES


def _missing(value: Any) -> bool:
    """An empty cell: None, NaN (pandas' missing value), or a blank string."""
    return value is None or (isinstance(value, float) and math.isnan(value)) or (
        isinstance(value, str) and not value.strip())


def table_rows(path: Path, fmt: str | None, names: dict[str, str], required: tuple[str, ...],
               on_error: str) -> Iterator[Row]:
    """The rows of a CSV/TSV/JSONL/Parquet table, ``names`` mapping our fields (id, text, label) to its
    columns. The first row must hold the `required` ones; with no id column, the id is the row's 0-based
    number."""
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    records, first_row = read_records(path, fmt=fmt, on_error=on_error)
    has_id = True
    for n, rec in enumerate(records):
        if n == 0:
            absent = [ours for ours in required if names[ours] not in rec]
            if absent:
                found = ", ".join(k for k in rec if not k.startswith("__")) or "none"
                raise DataError(f"{path}: no column {names[absent[0]]!r} for the {absent[0]} (its columns: "
                                f"{found}); name it with --columns {absent[0]}=COLUMN")
            has_id = "id" in names and names["id"] in rec
        cells = {ours: rec.get(theirs) for ours, theirs in names.items()}
        yield Row(f"{path}: row {first_row + n}", cells.get("id") if has_id else str(n), cells.get("text"),
                  cells.get("label"))


def names_of(columns: dict[str, str], fields: tuple[str, ...]) -> tuple[dict[str, str], tuple[str, ...]]:
    """Our fields' column names (mapped, else the field's own name), and the fields that must be there:
    the text, and whatever --columns named."""
    return ({f: columns.get(f, f) for f in fields},
            tuple(f for f in fields if f == "text" or f in columns))


def line_values(path: Path) -> Iterator[tuple[str, str]]:
    """(``FILE: line N``, the line without its newline) for each line of a plain-text file."""
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            yield f"{path}: line {n}", line.rstrip("\r\n")


def parallel_rows(texts: Path, labels: Path, fmt: str | None, columns: dict[str, str],
                  on_error: str) -> Iterator[Row]:
    """Rows joined from a texts file and a labels file, row n with row n; their lengths must agree."""
    if _is_table(texts, fmt):
        text_rows: Iterable[Row] = table_rows(texts, fmt, *names_of(columns, ("id", "text")), on_error)
    else:
        if "id" in columns:
            raise DataError(f"--columns id={columns['id']}: {texts} is plain text (one document per line), "
                            "it has no columns; the id is the line's 0-based number")
        text_rows = (Row(where, None, line) for where, line in line_values(texts))
    if _is_table(labels, fmt):
        label_rows: Iterable[tuple[str, Any]] = (
            (r.where, r.label) for r in table_rows(labels, fmt, {"label": columns.get("label", "label")}, ("label",),
                                                   on_error))
    else:
        label_rows = line_values(labels)
    text_it, label_it = iter(text_rows), iter(label_rows)
    for n in range(sys.maxsize):
        row, label = next(text_it, None), next(label_it, None)
        if row is None or label is None:
            if row is not None or label is not None:
                longer, shorter = (texts, labels) if row is not None else (labels, texts)
                raise DataError(f"{longer} has more rows than {shorter} ({n} there): --texts and --labels must "
                                "be parallel, one label per text, in the same order")
            return
        yield Row(f"{row.where} / {label[0]}", row.id if row.id is not None else str(n), row.text, label[1])


def newsgroups_rows(spec: str, data_root: str | None) -> Iterator[Row]:
    """20 Newsgroups' posts (``20newsgroups[:train|test|all]``) as rows, labelled by newsgroup name."""
    from hpcfed.data.corpus import load_20newsgroups

    _, _, subset = spec.partition(":")
    for d in load_20newsgroups(data_root, subset=subset or "all"):
        yield Row(d.id, d.id, d.text, d.group)


def check_row(row: Row, seen: set[str]) -> tuple[str | None, dict[str, Any]]:
    """(field at fault, why) for a bad row, or (None, the corpus file's object) for a good one."""
    doc_id, text, label = row.id, row.text, row.label
    if isinstance(doc_id, float) and doc_id.is_integer():
        doc_id = int(doc_id)  # a Parquet id column with a missing value is read as floats
    if _missing(doc_id) or isinstance(doc_id, bool) or not isinstance(doc_id, (str, int)):
        return "id", {"why": f"id {doc_id!r} is not a non-empty string or integer"}
    doc_id = str(doc_id).strip()
    if doc_id in seen:
        return "id", {"why": f"duplicate id {doc_id!r}; ids must be unique"}
    if not isinstance(text, str) or not text.strip():
        return "text", {"why": "the text is empty" if _missing(text) else f"the text is no string ({text!r})"}
    obj: dict[str, Any] = {"id": doc_id, "text": text}
    if isinstance(label, float) and label.is_integer():
        label = int(label)  # an integer label column with a missing value is read as floats
    if not _missing(label):
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            return "label", {"why": f"label {label!r} is not a class name or an integer"}
        obj["label"] = label.strip() if isinstance(label, str) else label
    seen.add(doc_id)
    return None, obj


def build_corpus(rows: Iterable[Row], source: str, on_error: str) -> Corpus:
    """Check every row; the first bad one raises DataError unless `on_error` is ``"skip"``."""
    corpus = Corpus(report=LoadReport(source))
    seen: set[str] = set()
    for row in rows:
        corpus.report.num_rows += 1
        bad, obj = check_row(row, seen)
        if bad is None:
            corpus.docs.append(obj)
            continue
        if on_error != "skip":
            raise DataError(f"{row.where}: {bad}: {obj['why']}; fix the row or pass --skip-bad")
        corpus.report.skipped.append(f"{row.where}: {bad}: {obj['why']}")
        corpus.report.reasons[bad] += 1
    corpus.report.num_kept = len(corpus.docs)
    if any(isinstance(d.get("label"), str) for d in corpus.docs):  # names: then every label is one, as written
        for d in corpus.docs:
            if "label" in d:
                d["label"] = str(d["label"])
    return corpus


def write_corpus(corpus: Corpus, out: Path) -> None:
    """The corpus file (JSONL, one ``{"id", "text", "label"?}`` per line), whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for d in corpus.docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, out)
