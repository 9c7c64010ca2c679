"""One way to gather a synchronous round: a collector posts the round's model, takes what the sites
send back, folds it into the strategy, and hands the sync loop one `RoundUploads`, whoever collected
it (the typed exchange object, in the style of NVIDIA FLARE's ``FLModel``). The loop never knows
which collector it has:

- `PlainCollector`: each site's upload, validated, bounded (`hpcfed.server.bounding`) and folded as
  it arrives (`SyncStrategy.fold`);
- `hpcfed.server.secagg_round.SecAggCollector` (``privacy.secure_aggregation``): the masked inputs,
  unmasked into one sum and folded once (`SyncStrategy.fold_sum`); rank 0 never sees one upload.

`collector_for` picks one from the config; a new way to gather a round (FedBuff's buffered secure
sums, for instance) is one more class with a `collect` method (docs/architecture.md, "Collectors").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from hpcfed import protocol as P
from hpcfed.comm.api import Message, Outgoing
from hpcfed.server.bounding import Bounding
from hpcfed.server.core import ServerCore
from hpcfed.server.scratch import Parking
from hpcfed.server.validation import ShardRef
from hpcfed.strategies.base import SyncStrategy, Update

log = logging.getLogger("hpcfed.server")

# How long a round waits for a site to take its model before it serves the next site (the model
# stays posted to the slow one): seconds, far above a transfer, far below a round's deadline.
TAKE_PATIENCE_S = 2.0


@dataclass
class RoundUploads:
    """What one synchronous round hands the loop, whoever collected it.

    `updates` holds every site that answered in time (its `Update`: after folding, or under secure
    aggregation, its metrics without a vector), `shards` the shard each wrote on a checkpoint round.
    A site in `refused` answered but was out of range: an answer, not folded. `sat_out` names the
    live sites the round did not ask (secure aggregation, short of neighbours): not stragglers.
    `lost`: the round's sum could not be recovered, so nothing of it was folded.

    Example: ``RoundUploads(3, updates={0: u0, 1: u1}, shards={0: None, 1: None}, refused={1})``
    folded ``[u0]``; ``answered == {0, 1}``.
    """

    round: int
    updates: dict[int, Update] = field(default_factory=dict)
    shards: dict[int, ShardRef | None] = field(default_factory=dict)
    refused: set[int] = field(default_factory=set)
    sat_out: set[int] = field(default_factory=set)
    lost: bool = False

    def add(self, update: Update, shard: ShardRef | None) -> None:
        """Site `update.client_id` answered this round."""
        self.updates[update.client_id] = update
        self.shards[update.client_id] = shard

    @property
    def answered(self) -> set[int]:
        """The sites that answered in time (refused ones included)."""
        return set(self.updates)

    def folded(self) -> list[Update]:
        """The updates folded into the strategy, by client id: none when the round was lost."""
        if self.lost:
            return []
        return [self.updates[c] for c in sorted(self.updates) if c not in self.refused]


class Collector(Protocol):
    """Gathers a synchronous round and folds it into the strategy (between the strategy's
    `begin_round` and `end_round`, which the loop calls)."""

    def collect(self, rnd: int, want_state: bool) -> RoundUploads:
        """Post round `rnd`'s model to every live site (asking for a shard when `want_state`), take
        what comes until every site answered or the deadline, fold it; what the round got.

        Example: ``uploads = collector.collect(4, want_state=False)``; then
        ``core.live - uploads.answered - uploads.sat_out`` are the round's stragglers."""
        ...


class PlainCollector:
    """Each site's upload, validated, bounded and folded into the strategy as it arrives."""

    def __init__(self, core: ServerCore, strategy: SyncStrategy, start_round: int) -> None:
        self.core, self.strategy, self.start_round = core, strategy, start_round
        # A round's upload is measured from the model the strategy sent: it holds still until the round ends.
        self.bounding = Bounding(core, lambda cid: strategy.model_for(cid))
        self.parking: Parking | None = None  # the first round's uploads wait here for their bounds
        # Models are posted, never sent (see `dispatch`); once a late upload arrives its site is
        # posted the current model at once.
        self.posted: dict[int, Outgoing] = {}  # the model last posted to each of them
        self.sent_round: dict[int, int] = {}  # client id -> the round whose model it was last given
        self.owed: set[int] = set()  # late sites owed the current round's model
        self.uploads = RoundUploads(-1)  # the round being gathered
        self.want_state = False

    def collect(self, rnd: int, want_state: bool) -> RoundUploads:
        """Post round `rnd`'s models and take the uploads until all are in or the deadline passes."""
        core = self.core
        self.uploads, self.want_state = RoundUploads(rnd), want_state
        # The first round, with no history to bound it, bounds itself: uploads wait on disk, measured.
        self.parking = self.bounding.open_parking()
        try:
            core.check_departures()  # a site known to have ended is sent nothing
            deadline = time.monotonic() + core.config.deadlines.round_deadline_s
            for cid in sorted(core.live):
                posted = self.dispatch(cid, rnd)
                if posted is not None:
                    # One sealed model in flight at a time keeps rank 0 at one copy, whatever K; a site that
                    # takes nothing for a while (paused, still busy) keeps its copy and the next is served.
                    self.take_uploads(min(deadline, time.monotonic() + TAKE_PATIENCE_S), until=posted.done)
            self.take_uploads(deadline)
            if self.parking is not None:
                parking, self.parking = self.parking, None
                self.uploads.refused |= self.bounding.fold_parked(parking, dict(self.uploads.updates),
                                                                  self.strategy.fold)
        finally:
            if self.parking is not None:  # the round failed while parking: free the disk
                self.parking.close()
                self.parking = None
        return self.uploads

    def take_uploads(self, deadline: float, until: Callable[[], bool] | None = None) -> None:
        """Fold uploads as they arrive until every live site has answered, `until()` holds, or `deadline`."""
        core, rnd = self.core, self.uploads.round
        while core.live - self.uploads.answered:  # an evicted site is waited for no more
            if until is not None and until():
                return
            self.pay_owed()
            # waiting on `until`, look at it every millisecond; otherwise wait for the next upload
            wake = deadline if until is None else min(deadline, time.monotonic() + 0.001)
            msg = core.recv_until(wake, {P.UPDATE, P.FAILED}, f"round {rnd}",
                                  waiting_for=core.live - self.uploads.answered, fatal=False)
            if msg is None:
                if time.monotonic() >= deadline:
                    return
                continue
            core.contained(msg.source, self.take_update, msg)
            msg = None  # the upload is folded: let its buffers go before the next one arrives

    def dispatch(self, cid: int, rnd: int) -> Outgoing | None:
        """Post site `cid` round `rnd`'s model and go on at once. Never a blocking send: a site
        busy with an earlier round, or paused (SIGSTOP, a preempted node) between its upload and
        this model, takes nothing for a while, and must not hold up the others or be taken for a
        hung one; a site that never answers is a straggler at the round's deadline. One model at
        a time per site: while the last one posted waits, the current one follows its late upload.
        The model posted now, if one was."""
        core = self.core
        if cid in self.posted and not self.posted[cid].done():
            return None
        header = {"round": rnd, "version": core.strategy.version, "checkpoint": self.want_state}
        posted = core.post_to(cid, P.PARAMS, header, core.model_tensors(self.strategy.model_for(cid)))
        if posted is not None:
            self.posted[cid] = posted
            self.sent_round[cid] = rnd
        return posted

    def pay_owed(self) -> None:
        """Post the current round's model to the late sites that have not had it."""
        rnd = self.uploads.round
        owed, self.owed = self.owed, set()
        for cid in sorted(owed & self.core.live):
            if self.sent_round.get(cid) != rnd:
                self.posted.pop(cid, None)  # it answered: the model posted before has been taken
                self.dispatch(cid, rnd)

    def take_update(self, msg: Message) -> None:
        """Validate one upload of the round and fold it into the strategy at once: a streaming
        strategy (FedAvg's mean) adds it to its running sum and drops it, so rank 0 never holds the
        K updates of a round together. (In a calibrating first round it is parked on disk instead.)"""
        core, uploads, rnd = self.core, self.uploads, self.uploads.round
        claimed = msg.header.get("round")
        if claimed != rnd:
            if core.participation.take_late(msg.source - 1, claimed, rnd, self.start_round):
                # the site trained on an earlier round's model: dropped, unmeasured, not held against it
                core.metrics.log(rnd, msg.source - 1, "late_update", claimed)
                log.info("round %d: late update of round %s from client %d (rank %d) dropped; it gets the current "
                         "model at once", rnd, claimed, msg.source - 1, msg.source)
                self.owed.add(msg.source - 1)  # posted from the receive loop (not here: inside a send)
                return
            repeat = core.participation.repeated(msg.source - 1, claimed)  # a second upload for a round: proof
            core.reject(msg.source, "duplicate update" if repeat else "stale update",
                        f"for round {claimed!r} during round {rnd}")
            return
        if msg.source - 1 in uploads.updates:
            core.reject(msg.source, "duplicate update", f"a second update for round {rnd}")
            return
        parsed = core.parse_update(msg, allow_state=self.want_state)
        if parsed is not None and self.want_state and (parsed[1] is None or parsed[1]["round"] != rnd):
            core.reject(msg.source, "malformed header", f"UPDATE of checkpoint round {rnd} without a valid shard")
            return
        if parsed is None:
            return
        upd = parsed[0]
        uploads.add(*parsed)
        core.participation.on_time(upd.client_id, rnd)
        if self.parking is not None:
            if not self.bounding.park(self.parking, msg.source, upd):
                uploads.refused.add(upd.client_id)
        elif self.bounding.bound(msg.source, upd):
            self.strategy.fold(upd)
        else:
            uploads.refused.add(upd.client_id)
