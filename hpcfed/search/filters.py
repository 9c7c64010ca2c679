"""Filters of a search: which documents may be answered (``--where KEY=VALUE``, ``"where": {...}``).

    site=S                 only site S's documents
    label=L                label L: an integer, or a label's name (an event, a class)
    label_name=NAME        the same, by name only
    time=FROM..TO          FROM <= time < TO; ISO 8601 dates/times (UTC) or seconds since the epoch;
                           either end may be left open ("2012-10-29.." or "..1351728000")
    NAME=VALUE             any per-row attribute an export carries (`hpcfed.search.columns`)

A key given twice matches either value (``label=flood --where label=fire``); different keys must all
match. A filter becomes one boolean mask per site over its rows, and the site's index searches only
the rows it keeps (`hpcfed.search.ann.AnnIndex.hits`: a FAISS ID selector, with the cells probed
scaled by the share of rows kept), so a filter that keeps 1 % of a collection still gets its full k.

Bad input is refused naming it: an attribute no export carries, a label no site has, a time range
that holds no instant, a value that is not of the attribute's type.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import numpy as np

from hpcfed.search.columns import TIME

BUILT_IN = ("site", "label", "label_name")
MAX_TERMS = 16
MAX_VALUES = 1000
MAX_VALUE_CHARS = 1000
CACHED_MASKS = 32  # (site, filter) masks kept for the next query: a filter is often asked many times


class FilterError(ValueError):
    """A filter names an unknown attribute, a value nothing has, or an empty range."""


@dataclass(frozen=True)
class Where:
    """A checked filter: per key the allowed values (labels as names or ints; time as [lo, hi))."""

    sites: frozenset[str] | None
    labels: tuple[int | str, ...] | None
    time: tuple[float, float] | None
    columns: tuple[tuple[str, tuple[Any, ...]], ...]

    @property
    def key(self) -> str:
        """A canonical text of the filter (what the mask cache is keyed by)."""
        return repr((sorted(self.sites) if self.sites is not None else None, self.labels, self.time, self.columns))


def parse_cli(items: Sequence[str]) -> dict[str, list[str]]:
    """``--where KEY=VALUE`` options as ``{key: [values]}`` (one-line errors naming the option)."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FilterError(f"--where {item!r}: write KEY=VALUE (e.g. --where site=0, --where time=2012-10-29..)")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def parse_json(raw: object) -> dict[str, list[Any]]:
    """A request's ``"where"`` object as ``{key: [values]}``; values are strings, numbers or lists of them."""
    if not isinstance(raw, dict):
        raise FilterError('"where" must be an object such as {"site": "0", "label": ["flood", "fire"]}')
    if len(raw) > MAX_TERMS:
        raise FilterError(f'"where" has {len(raw)} keys; at most {MAX_TERMS}')
    out: dict[str, list[Any]] = {}
    for key, value in raw.items():
        values = value if isinstance(value, list) else [value]
        if not values or len(values) > MAX_VALUES or not all(
                isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in values):
            raise FilterError(f"where.{str(key)[:100]} must be a string or number, or a list of 1 to {MAX_VALUES}")
        out[str(key)] = values
    return out


def compile_where(raw: Mapping[str, list[Any]], indexes: Mapping[str, Any],
                  names: Mapping[str, list[str]], present: Mapping[str, frozenset[int]] | None = None) -> Where | None:
    """Check a parsed filter against the sites (`indexes`: site -> its searcher; `names`: its label
    names; `present`: the labels each site's rows carry, `present_labels`, when the caller keeps
    them: else worked out here, a pass over every row); None when it filters nothing."""
    if not raw:
        return None
    carried = _carried(indexes)
    sites: frozenset[str] | None = None
    labels: list[int | str] = []
    time: tuple[float, float] | None = None
    columns: list[tuple[str, tuple[Any, ...]]] = []
    for key, values in raw.items():
        if any(isinstance(v, str) and len(v) > MAX_VALUE_CHARS for v in values):
            raise FilterError(f"where {key[:100]}: a value longer than {MAX_VALUE_CHARS} characters")
        if key == "site":
            sites = frozenset(_sites(values, indexes))
        elif key in ("label", "label_name"):
            labels += _labels(key, values, present if present is not None else present_labels(indexes), names)
        elif key == TIME and TIME in carried and carried[TIME] != "O":
            if len(values) != 1:
                raise FilterError("where time: give one range FROM..TO")
            time = parse_range(str(values[0]))
        elif key in carried:
            columns.append((key, _column_values(key, values, carried[key])))
        else:
            known = ", ".join([*BUILT_IN, *sorted(carried)])
            raise FilterError(f"where {key[:100]!r}: no site's export carries that attribute (filters: {known})")
    return Where(sites, tuple(dict.fromkeys(labels)) if labels else None, time, tuple(sorted(columns)))


def _carried(indexes: Mapping[str, Any]) -> dict[str, str]:
    """The columns any site carries, with their kind ("O" text, "i"/"f" numbers)."""
    out: dict[str, str] = {}
    for index in indexes.values():
        for name, values in getattr(index, "columns", {}).items():
            out.setdefault(name, values.dtype.kind)
    return out


def _sites(values: list[Any], indexes: Mapping[str, Any]) -> list[str]:
    for v in values:
        if str(v) not in indexes:
            raise FilterError(f"where site={str(v)[:100]!r}: no such site (sites: {', '.join(indexes)})")
    return [str(v) for v in values]


def present_labels(indexes: Mapping[str, Any]) -> dict[str, frozenset[int]]:
    """The labels each site's rows carry (a service works them out once, not per request)."""
    return {site: frozenset(np.unique(index.labels).tolist()) for site, index in indexes.items()}


def _labels(key: str, values: list[Any], present: Mapping[str, frozenset[int]],
            names: Mapping[str, list[str]]) -> list[int | str]:
    """Each value as an int label (label=3) or a name; one that no site has is refused by name."""
    out: list[int | str] = []
    for v in values:
        text = str(v).strip()
        if key == "label" and (isinstance(v, int) or text.lstrip("-").isdigit()):
            label = int(text)
            if not any(label in labels for labels in present.values()):
                raise FilterError(f"where label={label}: no site has a document with that label")
            out.append(label)
        elif any(text in site_names for site_names in names.values()):
            out.append(text)
        else:
            raise FilterError(f"where {key}={text[:100]!r}: no site names a label so (label names come from the "
                              f"exports' label_names, e.g. DAMe's events)")
    return out


def _column_values(key: str, values: list[Any], kind: str) -> tuple[Any, ...]:
    if kind == "O":
        return tuple(sorted({str(v) for v in values}))
    try:
        return tuple(sorted({float(v) for v in values}))
    except ValueError:
        raise FilterError(f"where {key}: {values[0]!r} is not a number, and {key} holds numbers") from None


def parse_range(text: str) -> tuple[float, float]:
    """``FROM..TO`` as [lo, hi) in seconds since the epoch; an open end is ±inf; empty ranges refused."""
    lo_text, sep, hi_text = text.partition("..")
    if not sep:
        raise FilterError(f"where time={text[:100]!r}: write FROM..TO (ISO dates or epoch seconds; an end may be open)")
    lo = parse_instant(lo_text) if lo_text.strip() else -math.inf
    hi = parse_instant(hi_text) if hi_text.strip() else math.inf
    if not lo < hi:
        raise FilterError(f"where time={text[:100]!r}: the range is empty (FROM must come before TO; TO is excluded)")
    return lo, hi


def parse_instant(text: str) -> float:
    """An ISO 8601 date or date-time (UTC unless it says otherwise) or seconds since the epoch."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise FilterError(f"where time: {text[:100]!r} is neither an ISO 8601 date/time nor epoch seconds") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


def site_mask(where: Where, site: str, index: Any, names: list[str]) -> np.ndarray | None:
    """The rows of `site` the filter keeps (None: all of them)."""
    n = len(index.ids)
    if where.sites is not None and site not in where.sites:
        return np.zeros(n, bool)
    keep: np.ndarray | None = None

    def both(mask: np.ndarray) -> None:
        nonlocal keep
        keep = mask if keep is None else keep & mask

    if where.labels is not None:
        wanted = [v if isinstance(v, int) else i for v in where.labels for i in
                  ([v] if isinstance(v, int) else [j for j, name in enumerate(names) if name == v])]
        both(np.isin(index.labels, np.asarray(wanted, np.int64)))
    columns = getattr(index, "columns", {})
    if where.time is not None:
        values = columns.get(TIME)
        both(np.zeros(n, bool) if values is None or values.dtype.kind == "O"
             else (values >= where.time[0]) & (values < where.time[1]))
    for name, allowed in where.columns:
        values = columns.get(name)
        if values is None or (values.dtype.kind == "O") != isinstance(allowed[0], str):
            both(np.zeros(n, bool))  # a site without the attribute has no row that matches it
        else:
            both(np.isin(values, np.asarray(allowed, dtype=object if values.dtype.kind == "O" else np.float64)))
    return keep


class MaskCache:
    """The last `CACHED_MASKS` (site, filter) masks: a filter asked again costs no pass over the rows."""

    def __init__(self) -> None:
        self._masks: OrderedDict[tuple[str, str], tuple[np.ndarray | None, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, where: Where, site: str, index: Any, names: list[str]) -> np.ndarray | None:
        """The rows of `site` the filter keeps (None: all of them)."""
        return self.counted(where, site, index, names)[0]

    def counted(self, where: Where, site: str, index: Any, names: list[str]) -> tuple[np.ndarray | None, int]:
        """The mask and how many rows it keeps (None and every row when it keeps them all)."""
        key = (site, where.key)
        with self._lock:
            if key in self._masks:
                self._masks.move_to_end(key)
                return self._masks[key]
        mask = site_mask(where, site, index, names)
        found = mask, len(index.ids) if mask is None else int(np.count_nonzero(mask))
        with self._lock:
            self._masks[key] = found
            while len(self._masks) > CACHED_MASKS:
                self._masks.popitem(last=False)
        return found
