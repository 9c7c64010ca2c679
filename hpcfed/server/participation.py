"""Which sites the model was built from: per site, the rounds (sync) or updates (async) it
contributed to, and its late uploads.

A synchronous round closes at its deadline with the uploads it has (`federation.quorum` of the
live sites at least). An upload that arrives after its round closed is a *late update of that
round*: counted here and dropped, never measured by bounded influence and never held against the
site (lateness is not evidence). Dropped rather than folded into the next round with a staleness
weight: a round's FedAvg mean is defined over models trained from the same global model, and one
trained from an older model pulls the mean back toward it, with no staleness term in the
synchronous strategies to discount it (asynchronous mode is the one built for stale updates). The
site loses little: the next round's model is already waiting for it (sent when that round began),
so it trains on the current model at once and takes part in the next round.

Each site's share of the rounds is in summary.json (``participation``): with equal sites and
``quorum < 1`` the shares should be equal; a site that is late again and again shows up there,
instead of silently contributing nothing. A site that left and came back (`hpcfed serve`, a rejoin)
has its ``gaps`` there: [dropped at round r, back at round s], the newest `MAX_GAPS` of them (s null
while it is away), and ``rejoins``, how many times it came back.
"""

from __future__ import annotations

from typing import Any

from hpcfed.server.validation import is_int

MAX_GAPS = 50  # per site, the newest gaps kept (a flapping site's record stays bounded)


class Participation:
    """Per site: contributions, late uploads, and the newest round it uploaded for."""

    def __init__(self, num_clients: int) -> None:
        self.contributed = dict.fromkeys(range(num_clients), 0)
        self.late = dict.fromkeys(range(num_clients), 0)
        self._newest: dict[int, int] = {}  # client id -> the newest round it has uploaded for
        self.gaps: dict[int, list[list[int]]] = {}  # client id -> its newest [left, back] rounds
        self.rejoins = dict.fromkeys(range(num_clients), 0)

    def on_time(self, cid: int, rnd: int) -> None:
        """Client `cid` uploaded for the round now running, `rnd`."""
        self._newest[cid] = rnd

    def newest_round(self, cid: int) -> int | None:
        """The newest round `cid` has uploaded for (None before its first upload)."""
        return self._newest.get(cid)

    def take_late(self, cid: int, claimed: object, rnd: int, first_round: int) -> bool:
        """Whether an upload of client `cid` for round `claimed`, arriving during round `rnd`, is a
        late update (counted here; the caller drops it). One per earlier round of this run, newer
        than anything the site uploaded before: a copy or a replay is not late but refused."""
        if not is_int(claimed) or not first_round <= claimed < rnd or claimed <= self._newest.get(cid, -1):
            return False
        self._newest[cid] = claimed
        self.late[cid] += 1
        return True

    def repeated(self, cid: int, claimed: object) -> bool:
        """Whether an upload of client `cid` for round `claimed` repeats one it made already: an
        honest site uploads once per round, so a second one is a duplicate (proof), not lateness."""
        return is_int(claimed) and 0 <= claimed <= self._newest.get(cid, -1)

    def gap(self, cid: int, left: int, back: int) -> None:
        """Site `cid`, dropped at round `left`, is back from round `back` (a rejoin)."""
        kept = self.gaps.setdefault(cid, [])
        kept.append([left, back])
        del kept[:-MAX_GAPS]
        self.rejoins[cid] += 1

    def folded(self, cids: list[int]) -> None:
        """These sites' uploads went into the model (a round's aggregate, or one async update each)."""
        for cid in cids:
            self.contributed[cid] += 1

    def state(self) -> dict[str, Any]:
        """The counts as plain data (a checkpoint's meta)."""
        return {"contributed": [self.contributed[c] for c in sorted(self.contributed)],
                "late": [self.late[c] for c in sorted(self.late)],
                "rejoins": [self.rejoins[c] for c in sorted(self.rejoins)],
                "gaps": {str(c): g for c, g in sorted(self.gaps.items())}}

    def load_state(self, state: object) -> None:
        """The counts of the checkpoint resumed from (anything malformed or of another size: start from zero)."""
        if not isinstance(state, dict):
            return
        for name, counts in (("contributed", self.contributed), ("late", self.late), ("rejoins", self.rejoins)):
            saved = state.get(name)
            if isinstance(saved, list) and len(saved) == len(counts) and all(is_int(n) and n >= 0 for n in saved):
                counts.update(enumerate(saved))
        gaps = state.get("gaps")
        if isinstance(gaps, dict):
            for cid in self.contributed:
                saved = gaps.get(str(cid))
                if isinstance(saved, list):
                    self.gaps[cid] = [[g[0], g[1]] for g in saved[-MAX_GAPS:]
                                      if isinstance(g, list) and len(g) == 2 and is_int(g[0]) and is_int(g[1])]

    def report(self, steps: int, open_gaps: dict[int, int] | None = None) -> dict[str, dict[str, Any]]:
        """summary.json's ``participation``: per site its contributions, their share of the `steps`
        (rounds run, or updates accepted in async mode), its late uploads, and its gaps (`open_gaps`:
        the sites away now, with the round they left at)."""
        away = open_gaps or {}
        return {str(cid): {"contributed": n, "share": round(n / steps, 4) if steps else None, "late": self.late[cid],
                           "rejoins": self.rejoins[cid],
                           "gaps": [*self.gaps.get(cid, []), *([[away[cid], None]] if cid in away else [])]}
                for cid, n in sorted(self.contributed.items())}
