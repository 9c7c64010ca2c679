"""Who is in the federation: the one owner of membership on rank 0.

Each site is in one state: *present* (live: asked for uploads, waited for, counted in quorums),
*late* (not there at the start of `hpcfed serve`; it may join), *rejoining* (a late site, or a
dropped one back with `hpcfed join`, connected and with its setup exchange under way), *dropped*
(ended or failed mid-run, `federation.on_client_failure: continue`; silence is not evidence; under
`hpcfed serve` it may come back), *evicted* (misbehaved: `hpcfed.server.eviction`) or *excluded*
(left out by the operator, `federation.exclude_sites`, or evicted in an earlier attempt of the run).
Every change of membership goes through here and the rest of the server asks it: the live set, the
quorum a round needs, the reasons, and summary.json's ``dropped``, ``evicted`` and ``participation``.
The records themselves are kept by their specialists: the evidence and evictions by the `Ledger`
(checkpointed), the departures and their shards by `Departures`, contributions by `Participation`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal

from hpcfed.server.departures import Departures
from hpcfed.server.eviction import Eviction, Ledger
from hpcfed.server.participation import Participation

State = Literal["present", "late", "rejoining", "dropped", "evicted", "excluded"]


class Roster:
    """The sites of a federation of `num_clients` and the state each is in."""

    def __init__(self, num_clients: int, ledger: Ledger, departures: Departures) -> None:
        self.num_clients = num_clients
        self.ledger, self.departures = ledger, departures
        self.participation = Participation(num_clients)  # who the model was built from, who was late
        self._live: set[int] = set(range(num_clients))
        self._late: set[int] = set()
        self.rejoining: dict[int, float] = {}  # late sites connected: client id -> deadline for its SETUP

    # -- asking ---------------------------------------------------------------------------------
    @property
    def live(self) -> frozenset[int]:
        """The present sites (a copy: change it through the methods below)."""
        return frozenset(self._live)

    @property
    def late(self) -> frozenset[int]:
        """The sites that were not there at the start and have not joined yet."""
        return frozenset(self._late)

    def state(self, cid: int) -> State:
        """The state site `cid` is in."""
        if cid in self._live:
            return "present"
        if cid in self.ledger.evicted:
            return "excluded" if self.ledger.evicted[cid].reason.startswith("excluded") else "evicted"
        if cid in self.rejoining:
            return "rejoining"
        return "dropped" if cid in self.departures.dropped else "late"

    def may_join(self, cid: int) -> bool:
        """Whether site `cid` may be let in now: late, or dropped and back (never evicted or present)."""
        return cid not in self._live and cid not in self.ledger.evicted and (
            cid in self._late or cid in self.departures.dropped)

    @property
    def awaiting_setup(self) -> frozenset[int]:
        """The sites whose SETUP may still come: late ones, and those connected to (re)join."""
        return frozenset(self._late | set(self.rejoining))

    def gone(self, cid: int) -> bool:
        """Whether site `cid` is to be sent nothing more (evicted, dropped, or never there)."""
        return cid in self.ledger.evicted or cid in self.departures.dropped or cid in self._late

    def needed(self, quorum: float) -> int:
        """How many uploads a round needs: `quorum` of the present sites, at least one."""
        return max(1, math.ceil(quorum * len(self._live)))

    # -- changing -------------------------------------------------------------------------------
    def start_late(self, cids: Iterable[int]) -> None:
        """These sites are not there at the start (`hpcfed serve`): late until they join."""
        self._late |= set(cids)
        self._live -= self._late

    def join(self, cids: Iterable[int], rnd: int) -> None:
        """These late or returning sites have done their setup: present from round `rnd` on (a
        returning site's gap, from its drop to `rnd`, goes to its participation)."""
        joined = set(cids)
        for cid in joined:
            gone = self.departures.returned(cid)
            if gone is not None:
                self.participation.gap(cid, gone.round, rnd)
        self._late -= joined
        self._live |= joined

    def leave_out(self) -> None:
        """The sites the ledger holds evicted or excluded (at the start, or on --resume) are not present."""
        self._live -= set(self.ledger.evicted)

    def evict(self, eviction: Eviction) -> None:
        """Site `eviction.client` is out for the rest of the run (and a resumed one)."""
        self.ledger.record(eviction)
        self._live.discard(eviction.client)

    def drop(self, cid: int, rnd: int, why: str) -> None:
        """Site `cid` ended or failed at round `rnd`: the federation goes on without it."""
        self._live.discard(cid)
        self.departures.record(cid, rnd, why)

    # -- reporting ------------------------------------------------------------------------------
    def report(self, steps: int) -> dict[str, Any]:
        """summary.json's membership: dropped and evicted sites with their reasons, and each
        site's participation over `steps` (rounds run, or updates accepted in async mode)."""
        return {
            "dropped_clients": sorted(set(range(self.num_clients)) - self._live - set(self.ledger.evicted)),
            # sites that ended mid-run (federation.on_client_failure=continue): round and cause
            "dropped": self.departures.state(),
            # per site: rounds (async: accepted updates) it contributed to, their share, late uploads
            "participation": self.participation.report(steps, open_gaps={
                cid: d.round for cid, d in self.departures.dropped.items()}),
            # sites evicted for misbehaviour (security.on_misbehaviour) or left out (federation.exclude_sites)
            "evicted": self.ledger.state(),
        }
