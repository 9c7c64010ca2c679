"""Evidence against a site, and the verdict: evict it, abort the job, or only count it.

Evidence is positive: an authenticated message from the site that is malformed, out of range or
unrequested, or of a kind or size the protocol never lets it send (kind 99), or uploads that bounded
influence refused more than `security.max_refused_updates`
times. Silence is never evidence (a slow honest site is a straggler, not a suspect), and neither is
an upload that arrives for an earlier round. The ledger is pure: the server's core asks it what a
rejection means and carries the eviction out (`ServerCore.evict`).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Literal, TypeGuard

# rejection category (hpcfed.server.validation, the loops, the channel) -> evidence class
_AT_ONCE = {
    "malformed header": "malformed update",
    "unknown tensor name": "malformed update",
    "wrong dtype or shape": "malformed update",
    "non-finite parameters": "malformed update",
    "unhandled input": "malformed update",
    "malformed bundle": "malformed update",  # decoded after authentication, by the channel
    "unrequested update": "unrequested update",
    "duplicate update": "unrequested update",
    "secure aggregation message": "malformed secure aggregation message",  # hpcfed.server.secagg_round
    # refused at the first chunk by the channel, whose first such chunk from a rank it authenticates
    # (`hpcfed.comm.receiver`): the peer sealed a kind or a size the protocol never lets it send
    "unsolicited kind": "protocol violation",
    "message too large for its kind": "protocol violation",
}
_COUNTED = {"update out of range": "refused by bounded influence"}
MAX_DETAIL = 200  # characters of a rejection's detail kept in a reason

Policy = Literal["evict", "abort", "ignore"]


@dataclass(frozen=True)
class Eviction:
    """One evicted site, as summary.json and the checkpoint record it."""

    client: int
    rank: int
    reason: str  # e.g. "malformed update (header integer beyond int64)"
    first_evidence: str  # the first message held against it: "round 0: malformed bundle: ..."
    round: int  # the round (sync) or accepted updates (async) it was evicted at


class Ledger:
    """Each site's evidence; `note` says when a rejection makes a site's eviction due."""

    def __init__(self, policy: Policy, max_refused: int) -> None:
        self.policy, self.max_refused = policy, max_refused
        self.evicted: dict[int, Eviction] = {}
        self._first: dict[int, str] = {}  # client -> its first piece of evidence
        self._refused: dict[int, int] = {}  # client -> uploads refused by bounded influence

    def note(self, client: int, category: str, detail: str, rnd: int) -> Eviction | None:
        """A message of `client` was rejected under `category`: the eviction it makes due, or None
        (not evidence, not enough of it yet, already evicted, or the policy is to ignore)."""
        if self.policy == "ignore" or client in self.evicted:
            return None
        evidence = _AT_ONCE.get(category)
        if evidence is None and category in _COUNTED:
            self._refused[client] = self._refused.get(client, 0) + 1
            if self._refused[client] > self.max_refused:
                evidence = f"{_COUNTED[category]} {self._refused[client]} times"
        if evidence is None and category not in _COUNTED:
            return None
        self._first.setdefault(client, f"round {rnd}: {category}: {_cut(detail)}")
        if evidence is None:
            return None
        return Eviction(client=client, rank=client + 1, reason=f"{evidence} ({describe(category, detail)})",
                        first_evidence=self._first[client], round=rnd)

    def record(self, eviction: Eviction) -> None:
        """The eviction was carried out: the site is out for the rest of the run (and a resumed one)."""
        self.evicted[eviction.client] = eviction

    def exclude(self, client: int, rnd: int) -> None:
        """Leave `client` out of this run by the operator's choice (`federation.exclude_sites`)."""
        if client not in self.evicted:
            self.record(Eviction(client=client, rank=client + 1, reason="excluded (federation.exclude_sites)",
                                 first_evidence="none: excluded by the operator", round=rnd))

    def state(self) -> list[dict[str, object]]:
        """The evictions as plain data (summary.json, the checkpoint's meta)."""
        return [asdict(self.evicted[c]) for c in sorted(self.evicted)]

    def load_state(self, state: object, num_clients: int) -> None:
        """Remember the evictions a checkpoint recorded (malformed entries are skipped: the checkpoint
        is authenticated, but a record of another run's size must not name a rank we lack)."""
        if not isinstance(state, list):
            return
        for item in state:
            if not isinstance(item, dict):
                continue
            cid, rnd = item.get("client"), item.get("round")
            if _plain_int(cid) and 0 <= cid < num_clients and _plain_int(rnd):
                self.record(Eviction(client=cid, rank=cid + 1, reason=_cut(str(item.get("reason", ""))),
                                     first_evidence=_cut(str(item.get("first_evidence", ""))), round=rnd))


def describe(category: str, detail: str) -> str:
    """A rejection in a few plain words for the console: what was wrong with the message."""
    if category == "malformed bundle":
        ints = re.search(r"header integer (?:at (\S+) )?.*(?:outside int64|fit int64)", detail)
        if ints:
            field = (ints.group(1) or "").rstrip(":;,")
            return "num_examples beyond int64" if field.endswith("num_examples") else "header integer beyond int64"
        shape = re.search(r"shape (\([0-9, ]*\))", detail)
        if shape:
            return f"tensor of shape {shape.group(1)}"
    return _cut(f"{category}: {detail}" if category not in detail else detail, 120)


def _plain_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _cut(text: str, limit: int = MAX_DETAIL) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[:limit] + "..."



class ChannelRefusals:
    """The channel's refusals of authenticated messages, by rank, as it reports them.

    The channel refuses a bundle that fails to decode after authenticating (a header integer
    beyond int64, a tensor of shape (0, 2**64-1)), or an authenticated first chunk of a kind the
    server never takes from the rank (kind 99) or larger than its kind's bound, before the server
    sees it, and calls its
    `on_reject` hook; this keeps the first such refusal of each rank until the core takes them
    after a receive (the hook must not call the channel, so it only records). At most one entry
    per rank: memory stays bounded by the number of sites, whatever a rank sends."""

    # refused after the AEAD tag verified: the sender wrote it (a kind or size refusal is reported
    # for a rank only after one of its such chunks authenticated: `hpcfed.comm.receiver`)
    EVIDENCE = frozenset({"malformed bundle", "unsolicited kind", "message too large for its kind"})

    def __init__(self) -> None:
        self.pending: dict[int, tuple[str, str]] = {}

    def __call__(self, rank: int, reason: str, detail: str) -> None:
        """The channel's hook: keep an authenticated refusal (the first per rank until taken)."""
        if reason in self.EVIDENCE:
            self.pending.setdefault(rank, (reason, detail))

    def take(self) -> list[tuple[int, str, str]]:
        """The refusals reported since the last call: (rank, category, detail), by rank."""
        out = [(rank, reason, detail) for rank, (reason, detail) in sorted(self.pending.items())]
        self.pending.clear()
        return out
