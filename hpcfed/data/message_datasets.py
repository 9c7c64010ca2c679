"""The shared research datasets of social messages, and the site selector a config names.

`load_site` reads a built-in dataset (`LOADERS`: ``events/...`` under the data root, see its README)
or a message file in the format of `hpcfed.data.messages`, then applies the selectors of
`hpcfed.data.message_selection` (``NAME:I/K``, ``NAME~PATTERN``, ``NAME%I/K``). Apart from the format
and its readers because these loaders know each dataset's own layout, and the format does not.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hpcfed.data.local_pickle import load_object_npy
from hpcfed.data.message_selection import event_part, event_subset, message_share
from hpcfed.data.messages import LoadReport, Messages, from_records, read_messages, snowflake_time
from hpcfed.data.root import DataError, dataset_dir


def load_crisislext26(data_root: str | Path | None = None, *, on_error: str = "skip") -> tuple[Messages, LoadReport]:
    """CrisisLexT26: one folder per event; time from the entire-period file, else from the snowflake id."""
    import pandas as pd

    root = dataset_dir("events/crisislext26", data_root)
    records: list[dict[str, Any]] = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        labeled = list(folder.glob("*-tweets_labeled.csv"))
        if not labeled:
            raise DataError(f"{folder}: no *-tweets_labeled.csv; is this a CrisisLexT26 event folder?")
        frame = pd.read_csv(labeled[0], skipinitialspace=True, dtype=str, keep_default_na=False)
        times: dict[str, str] = {}
        period = list(folder.glob("*-tweetids_entire_period.csv"))
        if period:
            tf = pd.read_csv(period[0], skipinitialspace=True, dtype=str, keep_default_na=False)
            times = dict(zip(tf.iloc[:, 1].str.strip("'\" "), tf.iloc[:, 0]))
        for row, rec in enumerate(frame.itertuples(index=False), start=2):
            tid = str(rec[0]).strip("'\" ")
            when: Any = times.get(tid)
            if when is None and tid.isdigit():
                when = int(snowflake_time(tid).astype("int64"))
            records.append({"id": tid, "text": rec[1], "time": when, "event": folder.name,
                            "__where__": f"{labeled[0]}: row {row}"})
    return from_records(records, str(root), on_error=on_error, first_row=1)


def load_crisislext6(data_root: str | Path | None = None, *, on_error: str = "skip") -> tuple[Messages, LoadReport]:
    """CrisisLexT6, on-topic rows only (off-topic rows are not events); time from the snowflake id."""
    import pandas as pd

    root = dataset_dir("events/crisislext6", data_root)
    records: list[dict[str, Any]] = []
    off_topic = 0
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = list(folder.glob("*-ontopic_offtopic.csv"))
        if not files:
            raise DataError(f"{folder}: no *-ontopic_offtopic.csv; is this a CrisisLexT6 event folder?")
        frame = pd.read_csv(files[0], skipinitialspace=True, dtype=str, keep_default_na=False)
        for row, rec in enumerate(frame.itertuples(index=False), start=2):
            if str(rec[2]).strip() != "on-topic":
                off_topic += 1
                continue
            tid = str(rec[0]).strip("'\" ")
            when = int(snowflake_time(tid).astype("int64")) if tid.isdigit() else None
            records.append({"id": tid, "text": rec[1], "time": when, "event": folder.name,
                            "__where__": f"{files[0]}: row {row}"})
    msgs, report = from_records(records, str(root), on_error=on_error, first_row=1)
    # off-topic rows are left out by design (they belong to no event), not skipped as bad; say how many
    report.source += f" (on-topic rows only; {off_topic} off-topic rows left out)"
    return msgs, report


_ARABIC_GLOBALS = frozenset({("pandas._libs.tslibs.timestamps", "_unpickle_timestamp")})


def load_arabic(data_root: str | Path | None = None, *, on_error: str = "skip") -> tuple[Messages, LoadReport]:
    """Arabic crisis tweets (Kawarith subset), `Arabic_100.npy`: users, mentions, hashtags, entities given."""
    root = dataset_dir("events/arabic", data_root)
    path = root / "Arabic_100.npy"
    if not path.is_file():
        raise DataError(f"{path} not found; the events/arabic folder should hold Arabic_100.npy")
    # shipped as a numpy object array of strings, lists and pandas Timestamps: read with an allow-list
    table = load_object_npy(path, _ARABIC_GLOBALS, "the Arabic event set")
    if table.ndim != 2 or table.shape[1] != 13:
        raise DataError(f"{path}: expected a (n, 13) object array, got shape {table.shape}")
    records = [{"id": row[0], "user": row[1], "text": row[2], "time": row[9], "event": row[4],
                "mentions": [m.lstrip("@") for m in (row[5] or [])],
                "hashtags": [h.lstrip("#") for h in (row[6] or [])],
                "entities": [str(e) for e in (row[11] or [])]} for row in table]
    return from_records(records, str(path), on_error=on_error, first_row=0)


LOADERS = {
    "crisislext26": load_crisislext26,
    "crisislext6": load_crisislext6,
    "arabic": load_arabic,
}


_PART = re.compile(r"^(?P<base>.+):(?P<part>\d+)/(?P<parts>\d+)$")
# NAME%I/K; at most 6 digits each, so that a hostile selector cannot ask int() for a huge number
_SHARE = re.compile(r"^(?P<base>.+)%(?P<part>\d{1,6})/(?P<parts>\d{1,6})$")


def load_site(name: str, data_root: str | Path | None = None) -> tuple[Messages, LoadReport]:
    """A built-in dataset name (`LOADERS`) or a path to a message file in the documented format.

    ``NAME:I/K`` (e.g. ``crisislext26:2/4``) is the I-th of K groups of NAME's events in time order
    (`event_part`): one dataset split into K sites with distinct events. ``NAME~PATTERN`` (e.g.
    ``crisislext26~quake``) keeps the events whose label matches PATTERN (`event_subset`). ``NAME%I/K``
    (e.g. ``crisislext26~flood%1/2``) is the I-th of K disjoint random parts of NAME's messages, every
    event spread over all K (`message_share`): K sites that share their events. ``%`` is read first, so
    it applies to what ``~`` or ``:`` selected.
    """
    m = _SHARE.match(name)
    if m:
        msgs, report = load_site(m["base"], data_root)
        msgs = message_share(msgs, int(m["part"]), int(m["parts"]), name)
        report.source += (f" (message share {m['part']}/{m['parts']}: {len(set(msgs.events))} events, "
                          f"{len(msgs)} messages)")
        return msgs, report
    base, _, pattern = name.rpartition("~")
    if base and "/" not in pattern:  # NAME~PATTERN: the events whose label matches PATTERN (not ~/a.csv)
        msgs, report = load_site(base, data_root)
        msgs = event_subset(msgs, pattern, name)
        report.source += f" (events matching {pattern!r}: {len(set(msgs.events))} events, {len(msgs)} messages)"
        return msgs, report
    m = _PART.match(name)
    if m:
        msgs, report = load_site(m["base"], data_root)
        msgs = event_part(msgs, int(m["part"]), int(m["parts"]))
        report.source += (f" (events part {m['part']}/{m['parts']}: {len(set(msgs.events))} events, "
                          f"{len(msgs)} messages)")
        return msgs, report
    if name in LOADERS:
        return LOADERS[name](data_root)
    path = Path(name).expanduser()
    if path.suffix.lower() in (".csv", ".tsv", ".jsonl", ".ndjson", ".json", ".parquet"):
        return read_messages(path)
    raise DataError(f"unknown message dataset {name!r}; use one of {', '.join(LOADERS)} or a .csv/.jsonl/.parquet path")
