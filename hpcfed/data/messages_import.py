"""``hpcfed data import-messages``: validate a message table and write it in the documented format.

    hpcfed data import-messages INPUT [--format csv|tsv|jsonl|parquet] --out OUT.parquet|OUT.jsonl
                                [--columns id=tweet_id,text=tweet_text,...] [--time-from-id snowflake]
                                [--event-from folder|file] [--skip-bad]

``INPUT`` is one file, or with ``--event-from`` a folder of per-event files: ``folder`` takes each
message's event from the name of the sub-folder its file lies in (``INPUT/<event>/*.tsv``, the
HumAID and CrisisLex layouts), ``file`` from the file's name without its suffix
(``INPUT/<event>.csv``). ``--columns`` maps the documented column names to the file's own
(``id=tweet_id,text=tweet_text,event=class_label``; unmapped columns keep their names).
``--time-from-id snowflake`` reads each message's time from its Twitter id (tweets from Nov 2010 on)
when the file has no time column. An id in single quotes (``'2625...'``, how CrisisLex guards ids
from spreadsheet rounding) loses the quotes.

Without ``--skip-bad`` the first bad row stops the import with a message naming the file, row and
field; with it, bad rows are skipped, counted and listed (the first 20) on stderr. The output can be
named in ``task.sites`` of an ``events`` config. Built-in datasets can be exported the same way:
``INPUT`` may be ``crisislext26``, ``crisislext6`` or ``arabic`` (read from the data root).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hpcfed.data.messages import (
    LoadReport,
    Messages,
    from_records,
    read_records,
)
from hpcfed.data.root import DataError

SUFFIXES = (".csv", ".tsv", ".jsonl", ".ndjson", ".parquet")
EVENT_FROM = ("folder", "file")


def rename(records: Iterable[dict[str, Any]], columns: dict[str, str], where: str) -> Iterator[dict[str, Any]]:
    """Each record with the file's columns renamed to ours; the first record must have every mapped column."""
    for n, rec in enumerate(records):
        if n == 0:
            absent = [(ours, theirs) for ours, theirs in columns.items() if theirs not in rec]
            if absent:
                ours, theirs = absent[0]
                found = ", ".join(k for k in rec if not k.startswith("__")) or "none"
                raise DataError(f"{where}: --columns {ours}={theirs}: the file has no column {theirs!r} "
                                f"(its columns: {found})")
        out = {k: v for k, v in rec.items() if k not in columns.values()}
        out.update({ours: rec[theirs] for ours, theirs in columns.items() if theirs in rec})
        mid = out.get("id")
        if isinstance(mid, str) and len(mid) > 2 and mid[0] == mid[-1] == "'":
            out["id"] = mid[1:-1]  # '262596552399396864': a spreadsheet's guard against rounding (CrisisLex)
        yield out


def event_files(folder: Path, event_from: str) -> list[tuple[Path, str]]:
    """(file, event) for every message file of a per-event folder."""
    if not folder.is_dir():
        raise DataError(f"--event-from {event_from}: {folder} is not a folder of per-event files")
    if event_from == "folder":
        found = [(p, p.parent.name) for sub in sorted(folder.iterdir()) if sub.is_dir()
                 for p in sorted(sub.iterdir()) if p.suffix.lower() in SUFFIXES]
        layout = "INPUT/<event>/<file>.tsv"
    else:
        found = [(p, p.stem) for p in sorted(folder.iterdir()) if p.suffix.lower() in SUFFIXES]
        layout = "INPUT/<event>.csv"
    if not found:
        raise DataError(f"{folder}: no {'/'.join(SUFFIXES)} files in the layout {layout} "
                        f"(--event-from {event_from})")
    return found


def read_input(path: Path, *, fmt: str | None, columns: dict[str, str], time_from_id: bool,
               event_from: str | None, on_error: str) -> tuple[Messages, LoadReport]:
    """A user's message file, or folder of per-event files, as validated `Messages`."""
    if event_from is not None and "event" in columns:
        raise DataError(f"--event-from {event_from} takes the event from the path; leave event= out of --columns")
    if time_from_id and "time" in columns:
        raise DataError("--time-from-id snowflake reads the time from the id; leave time= out of --columns")
    files = event_files(path, event_from) if event_from else [(path, None)]

    def records() -> Iterator[dict[str, Any]]:
        for file, event in files:
            rows, first_row = read_records(file, fmt=fmt, on_error=on_error)
            for n, rec in enumerate(rename(rows, columns, str(file))):
                rec["__where__"] = f"{file}: row {first_row + n}"
                if event is not None:
                    rec["event"] = event
                yield rec

    return from_records(records(), str(path), on_error=on_error, first_row=1, time_from_id=time_from_id)
