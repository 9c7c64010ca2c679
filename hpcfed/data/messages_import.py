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

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hpcfed.data.columns import parse_columns
from hpcfed.data.messages import (
    COLUMNS,
    LOADERS,
    LoadReport,
    Messages,
    from_records,
    load_site,
    read_records,
    write_messages,
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


def main(argv: list[str]) -> int:
    """`hpcfed data import-messages INPUT --out FILE`: check messages, write Parquet or JSONL; exit status."""
    p = argparse.ArgumentParser(prog="hpcfed data import-messages",
                                description="Validate social messages (id, text, time, event, user, mentions, "
                                            "hashtags, entities) and write Parquet or JSONL.")
    p.add_argument("input", help="CSV/TSV/JSONL/Parquet file, a folder with --event-from, or a built-in dataset: "
                                 + ", ".join(LOADERS))
    p.add_argument("--out", required=True, help="output file, .parquet or .jsonl")
    p.add_argument("--format", choices=["csv", "tsv", "jsonl", "parquet"], default=None,
                   help="input format (default: from the file suffix)")
    p.add_argument("--columns", default=None,
                   help="the file's names for our columns, e.g. id=tweet_id,text=tweet_text,event=disaster")
    p.add_argument("--time-from-id", choices=["snowflake"], default=None,
                   help="read each message's time from its Twitter (snowflake) id; no time column needed")
    p.add_argument("--event-from", choices=EVENT_FROM, default=None,
                   help="INPUT is a folder: the event is the sub-folder's name (folder) or the file's name (file)")
    p.add_argument("--skip-bad", action="store_true", help="skip and count bad rows instead of stopping")
    p.add_argument("--data-root", default=None, help="data root for built-in datasets (default $HPCFED_DATA)")
    args = p.parse_args(argv)
    if not args.out.endswith((".parquet", ".jsonl")):
        raise DataError(f"--out {args.out}: write a .parquet or .jsonl file")
    columns = parse_columns(args.columns, COLUMNS)
    if args.input in LOADERS:
        messages, report = load_site(args.input, args.data_root)
    else:
        messages, report = read_input(Path(args.input), fmt=args.format, columns=columns,
                                      time_from_id=args.time_from_id == "snowflake", event_from=args.event_from,
                                      on_error="skip" if args.skip_bad else "raise")
    if len(messages) == 0:
        raise DataError(f"{args.input}: no usable rows ({report.summary()})")
    write_messages(messages, args.out)
    for line in report.skipped[:20]:
        print(f"skipped: {line}", file=sys.stderr)
    if report.num_skipped > 20:
        print(f"skipped: ... and {report.num_skipped - 20} more", file=sys.stderr)
    print(f"{report.summary()}; {len(set(messages.events))} events -> {args.out}")
    return 0
