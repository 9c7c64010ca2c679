"""Selecting a site's messages from a dataset: by events in time order (``NAME:I/K``), by event
label (``NAME~PATTERN``), or as one of K disjoint random shares of every event (``NAME%I/K``); see
`hpcfed.data.message_datasets.load_site`, which reads those selectors."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol, TypeVar

import numpy as np

from hpcfed.data.root import DataError

T = TypeVar("T", bound="MessageTable")


class MessageTable(Protocol):
    """What selecting reads of a message table (`hpcfed.data.messages.Messages`, which imports this
    module: typed by its shape, the two import each other neither way back)."""

    times: np.ndarray
    events: list[str]

    def __len__(self) -> int:
        """The number of messages."""
        ...

    def take(self: T, index: Iterable[int]) -> T:
        """The rows at `index`, in that order."""
        ...

SHARE_SEED = 26  # message_share's shuffle: fixed, so that the K parts of one dataset are disjoint at every site


def event_part(messages: T, part: int, parts: int) -> T:
    """The messages of the `part`-th (1-based) of `parts` groups of events, events ordered by time.

    Events are ordered by their first message's time (ties by name) and cut into `parts` contiguous
    groups of nearly equal event counts (``np.array_split``); e.g. 26 events in 4 parts: 7, 7, 6, 6.
    Each part is a site with its own, distinct events, as an archive of one period would be.
    """
    if not 1 <= part <= parts:
        raise DataError(f"site part {part}/{parts}: the part must be between 1 and {parts}")
    events = np.asarray(messages.events)
    names = np.unique(events)
    if parts > len(names):
        raise DataError(f"site part {part}/{parts}: only {len(names)} events to split; use at most {len(names)} parts")
    first = {e: messages.times[events == e].min() for e in names}
    ordered = sorted(names, key=lambda e: (first[e], e))
    keep = set(np.array_split(np.asarray(ordered, dtype=object), parts)[part - 1].tolist())
    return messages.take(np.flatnonzero(np.isin(events, list(keep))).tolist())


def message_share(messages: T, part: int, parts: int, site: str = "") -> T:
    """The `part`-th (1-based) of `parts` disjoint random parts of the messages, each event dealt evenly.

    Every event's messages are shuffled (seed `SHARE_SEED`, the same at every site, so the parts are
    disjoint and together are all the messages) and cut into `parts` nearly equal runs
    (``np.array_split``); part I takes the I-th run of every event. So K sites built from one dataset
    share all its events, each holding about 1/K of every event's messages: the split in which pooling
    other sites' training should help a site (issue 26). Events with fewer than K messages are missing
    from some parts. The messages keep their file order.
    """
    where = f"site {site!r}: " if site else ""
    if parts < 1:
        raise DataError(f"{where}message share {part}/{parts}: the number of parts must be at least 1, e.g. NAME%1/3")
    if not 1 <= part <= parts:
        raise DataError(f"{where}message share {part}/{parts}: the part must be between 1 and {parts}, e.g. NAME%1/3")
    if parts > len(messages):
        raise DataError(f"{where}message share {part}/{parts}: only {len(messages)} messages to share; "
                        f"use at most {len(messages)} parts")
    events = np.asarray(messages.events)
    rng = np.random.default_rng(SHARE_SEED)
    keep: list[int] = []
    for name in np.unique(events).tolist():
        members = rng.permutation(np.flatnonzero(events == name))
        keep += np.array_split(members, parts)[part - 1].tolist()
    return messages.take(sorted(keep))


def event_subset(messages: T, pattern: str, site: str = "") -> T:
    """The messages of the events whose label matches `pattern` (a regular expression, case-insensitive,
    searched anywhere in the label), e.g. ``quake|flood``: one site per disaster type."""
    where = f"site {site!r}: " if site else ""
    if not pattern or len(pattern) > 200:
        raise DataError(f"{where}event pattern must be 1 to 200 characters, e.g. crisislext26~quake")
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as exc:
        raise DataError(f"{where}event pattern {pattern!r} is not a regular expression ({exc}); "
                        "write it like quake|flood") from None
    events = np.asarray(messages.events)
    names = np.unique(events)
    keep = [e for e in names.tolist() if regex.search(str(e))]
    if not keep:
        raise DataError(f"{where}no event label matches {pattern!r}; the labels are: {', '.join(map(str, names))}")
    return messages.take(np.flatnonzero(np.isin(events, keep)).tolist())
