"""Social messages for event detection: one documented table format, readers, and dataset loaders.

Message table (one row per message; CSV with a header row, JSON Lines, or Parquet):

=============  ========  =====================================================================
column         required  meaning
=============  ========  =====================================================================
``id``         yes       message id, unique within the file (string; digits kept exactly)
``text``       yes       message text (UTF-8, may be empty only if attributes link it)
``time``       yes       creation time: ISO 8601 (``2012-10-11T07:19:34Z``; no zone = UTC) or
                         Unix seconds
``event``      yes       event label (any string or integer; the ground truth for clustering)
``user``       no        author id; empty = unknown
``mentions``   no        user ids mentioned; list (JSONL/Parquet) or, in CSV, a JSON list
                         (``["a","b"]``) or ``|``-separated string (``a|b``)
``hashtags``   no        hashtags without ``#``; same list encodings
``entities``   no        named entities; same list encodings
=============  ========  =====================================================================

A missing optional column is filled from the text by `hpcfed.data.message_graph` (mentions, hashtags,
entities). Rows that cannot be used (empty id, duplicate id, unparsable time, missing event) raise a
`DataError` naming the file, row and field, or, with ``on_error="skip"``, are skipped and counted in
the returned `LoadReport` -- never dropped silently.

The loaders of the shared research datasets (``events/...`` under the data root) and the site
selector a config names (`load_site`) are in `hpcfed.data.message_datasets`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed.data.root import DataError

COLUMNS = ("id", "text", "time", "user", "mentions", "hashtags", "entities", "event")
REQUIRED = ("id", "text", "time", "event")
LIST_COLUMNS = ("mentions", "hashtags", "entities")
TWITTER_EPOCH_MS = 1288834974657  # snowflake ids: time_ms = (id >> 22) + this
# Ids below one day after the snowflake epoch are the sequential ids of older tweets: they hold no time.
SNOWFLAKE_MIN = (86_400_000 << 22)


@dataclass
class LoadReport:
    """What a reader kept and skipped, with one reason per skipped row (file:row: field: why)."""

    source: str
    num_rows: int = 0
    num_kept: int = 0
    skipped: list[str] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)  # field name -> skipped rows

    @property
    def num_skipped(self) -> int:
        """How many rows were skipped."""
        return len(self.skipped)

    def summary(self) -> str:
        """One line: rows kept of rows read, and the skipped rows counted by the field at fault."""
        text = f"{self.source}: kept {self.num_kept} of {self.num_rows} rows"
        if self.skipped:
            reasons = ", ".join(f"bad {k}: {v}" for k, v in self.reasons.most_common())
            text += f", skipped {self.num_skipped} ({reasons})"
        return text


@dataclass
class Messages:
    """A validated message table as parallel columns, in file order (`sort_by_time` orders by time)."""

    ids: list[str]
    texts: list[str]
    times: np.ndarray  # datetime64[s], UTC
    events: list[str]
    users: list[str]  # "" = unknown
    mentions: list[list[str]]
    hashtags: list[list[str]]
    entities: list[list[str]]
    has: dict[str, bool] = field(default_factory=dict)  # which optional columns the source had
    source: str = ""

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, index: Iterable[int]) -> Messages:
        """The messages at positions `index`, in that order, as a new Messages."""
        idx = list(index)
        return Messages([self.ids[i] for i in idx], [self.texts[i] for i in idx], self.times[idx],
                        [self.events[i] for i in idx], [self.users[i] for i in idx],
                        [self.mentions[i] for i in idx], [self.hashtags[i] for i in idx],
                        [self.entities[i] for i in idx], dict(self.has), self.source)

    def sort_by_time(self) -> Messages:
        """Stable sort by creation time (spec 1.1 step 1: the graph and features follow this order)."""
        return self.take(np.argsort(self.times, kind="stable").tolist())

    def to_frame(self) -> Any:
        """The messages as a pandas DataFrame, one row each (times as datetime64[s])."""
        import pandas as pd

        return pd.DataFrame({"id": self.ids, "text": self.texts, "time": self.times.astype("datetime64[s]"),
                             "user": self.users, "mentions": self.mentions, "hashtags": self.hashtags,
                             "entities": self.entities, "event": self.events})


# ----------------------------------------------------------------------------------------------
# parsing helpers


def _is_missing(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, float) and np.isnan(value):
        return True
    return isinstance(value, str) and value.strip() == ""


def parse_list(value: Any) -> list[str]:
    """A list cell: list/array, JSON list text, ``a|b`` text, or empty -> list of non-empty strings."""
    if _is_missing(value):
        return []
    if isinstance(value, (list, tuple, np.ndarray)):
        return [str(v).strip() for v in value if not _is_missing(v) and str(v).strip()]
    text = str(value).strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            raise ValueError(f"not a JSON list: {text[:60]!r}") from None
        if not isinstance(items, list):
            raise ValueError(f"not a JSON list: {text[:60]!r}")
        return [str(v).strip() for v in items if str(v).strip()]
    return [v.strip() for v in text.split("|") if v.strip()]


def parse_time(value: Any) -> np.datetime64:
    """ISO 8601 text (no zone = UTC), Unix seconds, datetime or pandas Timestamp -> datetime64[s] UTC."""
    if _is_missing(value):
        raise ValueError("empty")
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return np.datetime64(int(value), "s")
    if isinstance(value, str) and re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", value):
        return np.datetime64(int(float(value)), "s")
    import pandas as pd

    try:
        ts = pd.Timestamp(value)
    except (ValueError, TypeError):
        raise ValueError(f"cannot parse {str(value)[:40]!r} as ISO 8601 time or Unix seconds") from None
    if ts is pd.NaT:
        raise ValueError("empty")
    if ts.tzinfo is not None:
        ts = ts.tz_convert("UTC").tz_localize(None)
    return np.datetime64(ts.to_pydatetime().replace(microsecond=0), "s")


def snowflake_time(tweet_id: int | str) -> np.datetime64:
    """Creation time encoded in a Twitter snowflake id (ids after Nov 2010)."""
    ms = (int(tweet_id) >> 22) + TWITTER_EPOCH_MS
    return np.datetime64(ms // 1000, "s")


def parse_snowflake(tweet_id: str) -> np.datetime64:
    """`snowflake_time` of an id that is one; ValueError naming the id for any other."""
    if not tweet_id.isdigit() or not SNOWFLAKE_MIN <= int(tweet_id) < 2**63:
        raise ValueError(f"id {tweet_id[:40]!r} is not a Twitter snowflake id (a positive integer of 15-19 digits, "
                         f"from Nov 2010 on); give the file a time column instead of --time-from-id snowflake")
    return snowflake_time(tweet_id)


def from_records(records: Iterable[dict[str, Any]], source: str, *, on_error: str = "raise",
                 first_row: int = 2, time_from_id: bool = False) -> tuple[Messages, LoadReport]:
    """Validate rows (dicts keyed by `COLUMNS`) into `Messages`.

    `first_row` is the file row number of the first record (2 for a CSV with a header) so that
    messages name the row a user sees in an editor. ``on_error`` is ``raise`` or ``skip``.
    `time_from_id`: the time is read from each id as a Twitter snowflake (`snowflake_time`), and a
    ``time`` column is neither needed nor read.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error={on_error!r}; choose raise or skip")
    report = LoadReport(source)
    cols: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    seen: set[str] = set()
    has: dict[str, bool] = {}
    for n, rec in enumerate(records):
        row = first_row + n
        report.num_rows += 1
        if n == 0:
            missing = [c for c in REQUIRED if c not in rec and not (c == "time" and time_from_id)]
            if missing:
                raise DataError(f"{source}: missing required column(s) {missing}; a message table needs "
                                f"{', '.join(REQUIRED)} (optional: user, mentions, hashtags, entities); "
                                f"`hpcfed data import-messages --columns event=YOURS` maps other names, "
                                f"--time-from-id snowflake reads tweet times from the ids")
            has = {c: c in rec for c in ("user", *LIST_COLUMNS)}
        try:
            mid = rec.get("id")
            if _is_missing(mid):
                raise _RowError("id", "empty id")
            mid = str(mid).strip()
            if isinstance(rec.get("id"), float):
                raise _RowError("id", f"id {rec['id']!r} is a float; write ids as strings or integers")
            if mid in seen:
                raise _RowError("id", f"duplicate id {mid}")
            if _is_missing(rec.get("event")):
                raise _RowError("event", "missing event label")
            try:
                t = parse_snowflake(mid) if time_from_id else parse_time(rec.get("time"))
            except ValueError as exc:
                raise _RowError("time", str(exc)) from None
            text = rec.get("text")
            text = "" if _is_missing(text) else str(text)
            lists = {}
            for c in LIST_COLUMNS:
                try:
                    lists[c] = parse_list(rec.get(c))
                except ValueError as exc:
                    raise _RowError(c, str(exc)) from None
            user = rec.get("user")
            event = rec["event"]
            if isinstance(event, float) and event.is_integer():
                event = int(event)
        except _RowError as exc:
            where = rec.get("__where__") or f"{source}: row {row}"  # loaders name the file and its row
            msg = f"{where}: {exc.field}: {exc}"
            if on_error == "raise":
                raise DataError(msg + " (fix the row, or import with --skip-bad to skip and count such rows)") from None
            report.skipped.append(msg)
            report.reasons[exc.field] += 1
            continue
        seen.add(mid)
        cols["id"].append(mid)
        cols["text"].append(text)
        cols["time"].append(t)
        cols["event"].append(str(event).strip())
        cols["user"].append("" if _is_missing(user) else str(user).strip())
        for c in LIST_COLUMNS:
            cols[c].append(lists[c])
    report.num_kept = len(cols["id"])
    msgs = Messages(cols["id"], cols["text"], np.array(cols["time"], dtype="datetime64[s]"), cols["event"],
                    cols["user"], cols["mentions"], cols["hashtags"], cols["entities"], has, source)
    return msgs, report


class _RowError(ValueError):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


# ----------------------------------------------------------------------------------------------
# user files


def read_messages(path: str | Path, *, fmt: str | None = None, on_error: str = "raise") -> tuple[Messages, LoadReport]:
    """Read a message table from CSV, TSV, JSONL or Parquet (format from `fmt` or the file suffix)."""
    records, first_row = read_records(path, fmt=fmt, on_error=on_error)
    return from_records(records, str(path), on_error=on_error, first_row=first_row)


def read_records(path: str | Path, *, fmt: str | None = None,
                 on_error: str = "raise") -> tuple[Iterable[dict[str, Any]], int]:
    """The rows of a CSV/TSV/JSONL/Parquet file as dicts, and the file row number of the first one."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"message file {path} does not exist")
    fmt = (fmt or path.suffix.lstrip(".")).lower()
    if fmt in ("csv", "tsv"):
        import csv

        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f, delimiter="\t" if fmt == "tsv" else ",", skipinitialspace=True)
            # headers such as "Tweet ID, Tweet Text" (CrisisLexT26) carry spaces after the commas
            reader.fieldnames = [h.strip() for h in (reader.fieldnames or [])]
            rows = []
            for rec in reader:
                if None in rec:  # more cells than header fields
                    rec = {k: v for k, v in rec.items() if k is not None} | {"__extra__": rec[None]}
                rows.append(rec)
            header = reader.fieldnames
        if not header:
            raise DataError(f"{path}: empty file; expected a header row with {', '.join(REQUIRED)}")
        return _check_extra(rows, path), 2
    if fmt in ("jsonl", "ndjson", "json"):
        def records() -> Iterable[dict[str, Any]]:
            with path.open(encoding="utf-8") as f:
                for line_no, line in enumerate(f, start=1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        rec = {"__bad__": f"line {line_no}: not valid JSON ({exc.msg})"}
                    if not isinstance(rec, dict):
                        rec = {"__bad__": f"line {line_no}: not a JSON object"}
                    yield rec
        return _check_bad(records(), path, on_error), 1
    if fmt == "parquet":
        import pandas as pd

        frame = pd.read_parquet(path)
        return frame.to_dict("records"), 1
    raise DataError(f"{path}: unknown message format {fmt!r}; use .csv, .tsv, .jsonl or .parquet (or --format)")


def _check_extra(rows: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    for n, rec in enumerate(rows, start=2):
        if "__extra__" in rec:
            raise DataError(f"{path}: row {n}: more cells than header columns; quote text that holds commas")
    return rows


def _check_bad(records: Iterable[dict[str, Any]], path: Path, on_error: str) -> Iterable[dict[str, Any]]:
    for rec in records:
        if "__bad__" in rec:
            if on_error == "raise":
                raise DataError(f"{path}: {rec['__bad__']}")
            # a broken line becomes a row with no id, which from_records skips and counts
            yield {"id": None, "text": None, "time": None, "event": None}
            continue
        yield rec


def write_messages(messages: Messages, path: str | Path) -> Path:
    """Write `messages` as Parquet (.parquet) or JSON Lines (.jsonl) in the documented format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frame = messages.to_frame()
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    elif path.suffix in (".jsonl", ".ndjson"):
        frame["time"] = frame["time"].dt.strftime("%Y-%m-%dT%H:%M:%SZ")
        frame.to_json(path, orient="records", lines=True, force_ascii=False)
    else:
        raise DataError(f"{path}: write .parquet or .jsonl")
    return path
