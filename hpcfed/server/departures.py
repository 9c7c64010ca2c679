"""Sites that ended mid-run (`federation.on_client_failure: continue`): how the server learns of
it, the record of each site dropped, and the last checkpoint shard of every site.

Under ``hpcfed run`` (hydra, ``-disable-auto-cleanup``, `hpcfed.launch.rank_guard`) every surviving rank
gets SIGUSR1 when one ends. The signal does not say which, so the server then looks at each live
site's records (`hpcfed.store.rank_records.rank_ended`: its exit record, or its process gone from this host)
and drops the ones that ended at once: nothing more is sent to them and no round or checkpoint
waits for them. A site on another node cannot be seen from here: once the signal came and no site
on this node had ended, a remote site that stays silent past a deadline is dropped as well (alive
and merely slow, it would still be there; its rank is gone).

A dropped site's last checkpoint shard stays in every later manifest (with its round), so a later
``--resume`` with the site back finds the state it had, and so does the site itself when it rejoins
the running server (`hpcfed serve`, `hpcfed.server.joining`).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hpcfed.site_layout import SiteLayout
from hpcfed.store import rank_records

log = logging.getLogger("hpcfed.server")

_EXPLAIN_S = 3.0  # how long after a SIGUSR1 the server looks for the rank that ended on this node


@dataclass(frozen=True)
class Dropped:
    """One site the federation went on without, as summary.json and the checkpoint record it."""

    client: int
    rank: int
    round: int  # the round (sync) or accepted updates (async) at which it was dropped
    cause: str  # e.g. "ended without a word (killed or crashed)"


class Departures:
    """Which sites ended, and each site's newest checkpoint shard. `notify` and `probe` only read
    small files and set flags: they may run in a signal handler and inside a channel's wait."""

    def __init__(self, log_dir: Path, num_clients: int, mark_gone: Callable[[int], None] = lambda rank: None,
                 layout: SiteLayout | None = None) -> None:
        self.log_dir, self.num_clients, self.mark_gone = log_dir, num_clients, mark_gone
        # a site of many ranks (federation.ranks_per_site) has ended when any of its ranks has
        self.layout = layout or SiteLayout((1,) * num_clients)
        self.dropped: dict[int, Dropped] = {}
        self.unexplained = False  # a rank ended and none on this node: one on another node did
        self._signalled_at: float | None = None  # the last SIGUSR1 not yet explained
        self._signals = 0  # SIGUSR1s so far, one a rank that ended (two within one handler call merge: rare)
        self._ended: dict[int, str] = {}  # client id -> how it ended, found but not yet handed out
        self._known: set[int] = set()  # every client found ended
        self._lost: dict[int, str] = {}  # sites another watcher saw end (`report`), with how
        self._shards: dict[int, dict[str, Any]] = {}  # client id -> its newest shard {digest, path, round}

    def notify(self) -> None:
        """A rank of the job has ended (SIGUSR1 from hydra): find which, now and for a moment after."""
        self._signalled_at = time.monotonic()
        self._signals += 1
        self.probe()

    def report(self, cid: int, cause: str) -> None:
        """Site `cid` is known to have ended (its lifeline closed: `hpcfed serve`): a send waiting
        on it fails at once, and it is dropped at the server's next chance. Safe from any thread."""
        self._lost.setdefault(cid, cause)
        self.mark_gone(cid + 1)

    def probe(self) -> None:
        """After a SIGUSR1: look for sites that have ended, and tell the channel (`mark_gone`). The
        signal may come while the rank is still being torn down; looked for again until
        `_EXPLAIN_S` has passed, after which the rank that ended is taken to be on another node."""
        for cid, how in list(self._lost.items()):  # (list(): one step, while `report` may add)
            if cid not in self._known:
                self._known.add(cid)
                self._ended[cid] = how
        if self._signalled_at is None:
            return
        for cid in range(self.num_clients):
            if cid not in self._known and (cause := self._site_ended(cid)):
                self._known.add(cid)
                self._ended[cid] = cause
                self.mark_gone(cid + 1)
        if len(self._known) >= self._signals:
            # explained: every signal has a rank found ended (two sites killed at once may both be
            # found at the first signal; the second is theirs, not a remote rank's)
            self._signalled_at = None
        if self._signalled_at is not None and time.monotonic() - self._signalled_at > _EXPLAIN_S:
            self._signalled_at = None
            if not self.unexplained:
                self.unexplained = True
                log.warning("MPI reports that a rank of this job ended, and none on this node did: a site on "
                            "another node that stays silent past its deadline is dropped")

    def ended(self, live: AbstractSet[int]) -> dict[int, str]:
        """The live sites found ended since the last call, with how."""
        self.probe()
        found = {cid: self._ended.pop(cid) for cid in sorted(self._ended) if cid in live}
        self._ended.clear()
        return found

    def cause_of_silence(self, cid: int) -> str | None:
        """Why site `cid`, silent past a deadline, is gone (None: it may be merely slow)."""
        cause = self._lost.get(cid) or self._site_ended(cid)
        if cause is None and self.unexplained and not self._on_this_host(cid):
            cause = "silent past the deadline after MPI reported a rank ended on another node"
        if cause is not None:
            self.mark_gone(cid + 1)
        return cause

    def _site_ended(self, cid: int) -> str | None:
        """How site `cid` ended (its first rank found ended, named when it is not the leader), or None."""
        for rank in self.layout.world_ranks(cid) if cid < self.layout.num_sites else [cid + 1]:
            if cause := rank_records.rank_ended(self.log_dir, rank):
                return cause if rank == self.layout.leader(cid) else f"its {self.layout.describe(rank)} {cause}"
        return None

    def _on_this_host(self, cid: int) -> bool:
        leader = self.layout.leader(cid) if cid < self.layout.num_sites else cid + 1
        try:
            return (self.log_dir / f"rank{leader}.pid").read_text().split()[1] == socket.gethostname()
        except (OSError, IndexError):
            return False

    def record(self, cid: int, rnd: int, cause: str) -> None:
        """Site `cid` is dropped at round `rnd`."""
        rank = self.layout.leader(cid) if cid < self.layout.num_sites else cid + 1
        self.dropped.setdefault(cid, Dropped(client=cid, rank=rank, round=rnd, cause=" ".join(cause.split())[:300]))

    def coming_back(self, cid: int) -> None:
        """Site `cid`, lost, has connected again as a new job: how its old job ended is forgotten,
        so that the new one's end is seen (its drop record stays until it is present: `returned`)."""
        self._lost.pop(cid, None)
        self._known.discard(cid)
        self._ended.pop(cid, None)

    def returned(self, cid: int) -> Dropped | None:
        """Site `cid` is present again: its drop record, taken out (None: it was never dropped)."""
        self.coming_back(cid)
        return self.dropped.pop(cid, None)

    def state(self) -> list[dict[str, object]]:
        """The dropped sites as plain data (summary.json)."""
        return [asdict(self.dropped[c]) for c in sorted(self.dropped)]

    # -- checkpoint shards -------------------------------------------------------------------------
    def load_shards(self, rnd: int, sites: dict[int, dict[str, Any]]) -> None:
        """The shards of the checkpoint resumed from (round `rnd`)."""
        self._shards = {cid: {**ref, "round": int(ref.get("round", rnd))} for cid, ref in sites.items()}

    def newest_shard(self, cid: int) -> dict[str, Any] | None:
        """Site `cid`'s newest shard in a committed checkpoint ({digest, path, round}; None: none)."""
        ref = self._shards.get(cid)
        return dict(ref) if ref is not None else None

    def manifest(self, rnd: int, fresh: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """The sites of checkpoint `rnd`: the shards written for it, and for each dropped site its
        newest earlier one, marked with its round. (A live site that missed this checkpoint is left
        out as before: it resumes from its own start, not from a shard it may have pruned since.)"""
        for cid, ref in fresh.items():
            self._shards[cid] = {"digest": ref["digest"], "path": ref["path"], "round": rnd}
        sites = {cid: {"digest": ref["digest"], "path": ref["path"]} for cid, ref in fresh.items()}
        for cid in self.dropped.keys() & self._shards.keys() - fresh.keys():
            sites[cid] = dict(self._shards[cid])
        return dict(sorted(sites.items()))
