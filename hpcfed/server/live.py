"""OUT/live.json: the federation as an operator sees it, rewritten by rank 0 while it runs.

`hpcfed status OUT` draws it as a table that refreshes (like ``top``) and can serve the same figures
as a Prometheus text endpoint (`hpcfed.ops.live_view`). Rank 0 only writes this small file (a few
hundred bytes per site, atomically, at most once a second), so watching a run costs it nothing and
needs no port on the compute node: the run directory is on the shared file system the operator's
login node sees too.

One object: ``format``, ``format_version``, ``time`` (Unix seconds of the snapshot), ``run``,
``mode``, ``strategy``, ``status`` (``running``, then ``ended`` or ``failed``),
``progress`` (``done``, ``total``, ``unit``, ``eta_s``), ``version`` (the server's model version),
``next_checkpoint`` (round or accepted-update count, or null), ``server`` (its bytes, messages,
refusals, accepted updates, peak RSS) and ``sites``: per site ``client``, ``rank``, ``state`` (the
roster's: ``present``, ``late``, ``rejoining``, ``dropped``, ``evicted``, ``excluded``), ``last_round``
(the newest round it uploaded for), ``last_heard_s`` (seconds since its last message), ``bytes_in``/``bytes_out``
(message bytes from and to it), ``reason`` (why it was dropped or evicted), ``rejoins`` and ``gaps``
(how often it came back, and its newest [left, back] rounds, as in summary.json). The privacy each site
has spent is in metrics.jsonl, where the viewer reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from hpcfed.cost import peak_rss_bytes
from hpcfed.server.progress import Progress

# What the live file reads of rank 0: a `hpcfed.server.core.ServerCore` (not imported here, as the
# core writes this file: the two modules would import each other).
ServerCore = Any

LIVE_FILE = "live.json"
FORMAT = "hpcfed-live"
FORMAT_VERSION = 1


class LiveFile:
    """Writes OUT/live.json at most every `every_s` seconds (and whenever `force`d)."""

    def __init__(self, out_dir: Path, every_s: float = 1.0) -> None:
        self.path = out_dir / LIVE_FILE
        self.every_s = every_s
        self._last = 0.0
        self._heard: dict[int, float] = {}  # rank -> monotonic time its received bytes last grew
        self._seen_bytes: dict[int, int] = {}

    def maybe_write(self, core: ServerCore, status: str = "running", *, force: bool = False) -> None:
        """Rewrite the file if it is due and the federation has started; a full disk or a read-only
        folder never fails the run."""
        now = time.monotonic()
        if not core.started:
            return  # before the setup exchange is over (a refused --resume leaves the old run's file as it was)
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        with contextlib.suppress(OSError):  # the live view is for people: the federation goes on without it
            write_atomically(self.path, json.dumps(self.snapshot(core, status), sort_keys=True))

    def snapshot(self, core: ServerCore, status: str) -> dict[str, Any]:
        """What the file holds now (see the module's docstring)."""
        stats = core.channel.stats
        now = time.monotonic()
        for rank, seen in stats.received_from.items():
            if seen != self._seen_bytes.get(rank):
                self._seen_bytes[rank], self._heard[rank] = seen, now
        progress = core.progress
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "time": time.time(), "status": status,
            "run": core.config.run.name, "mode": core.config.run.mode, "strategy": core.config.run.strategy,
            "progress": None if progress is None else {"done": progress.done, "total": progress.total,
                                                       "unit": progress.unit, "eta_s": progress.eta_s()},
            "version": core.strategy.version,
            "next_checkpoint": next_checkpoint(core),
            "server": {"bytes_in": stats.bytes_received, "bytes_out": stats.bytes_sent,
                       "messages_in": stats.messages_received, "messages_out": stats.messages_sent,
                       "rejected": sum(core.rejected.values()) + sum(stats.rejected.values()),
                       "updates_accepted": core.updates_accepted, "peak_rss_bytes": peak_rss_bytes()},
            "sites": [self._site(core, cid, now) for cid in range(core.num_clients)],
        }

    def _site(self, core: ServerCore, cid: int, now: float) -> dict[str, Any]:
        rank = cid + 1
        stats = core.channel.stats
        state, reason = site_state(core, cid)
        heard = self._heard.get(rank)
        return {"client": cid, "rank": rank, "state": state, "reason": reason,
                "last_round": core.participation.newest_round(cid),
                "last_heard_s": None if heard is None else round(now - heard, 1),
                "bytes_in": stats.received_from.get(rank, 0), "bytes_out": stats.sent_to.get(rank, 0),
                "rejoins": core.participation.rejoins[cid], "gaps": _gaps(core, cid)}


def _gaps(core: ServerCore, cid: int) -> list[list[int | None]]:
    """Site `cid`'s gaps [left, back], the one it is in now as [left, None] (as summary.json's)."""
    away = core.departures.dropped.get(cid) if cid not in core.live else None
    return [*core.participation.gaps.get(cid, []), *([[away.round, None]] if away is not None else [])]


def site_state(core: ServerCore, cid: int) -> tuple[str, str]:
    """(state, reason) of one site, as the roster knows it now."""
    state = core.roster.state(cid)
    if state in ("evicted", "excluded"):
        return state, core.ledger.evicted[cid].reason
    if state == "dropped":
        return state, core.departures.dropped[cid].cause
    return state, ""


def next_checkpoint(core: ServerCore) -> int | None:
    """The round (async: the accepted-update count) after which the next checkpoint is written."""
    progress: Progress | None = core.progress
    every: int = core.config.checkpoints.every
    if progress is None or every <= 0 or progress.done >= progress.total:
        return None
    if progress.unit == "rounds":  # a checkpoint after round r when (r + 1) % every == 0, and after the last
        return min(((progress.done // every) + 1) * every, progress.total) - 1
    step: int = every * core.num_clients
    return min(((progress.done // step) + 1) * step, progress.total)


def write_atomically(path: Path, text: str) -> None:
    """Whole or not at all: a reader never sees a half-written file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(text)
    os.replace(partial, path)
