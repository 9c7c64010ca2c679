"""Synchronous rounds: post every live site the round's model, take the uploads until all are in or
the deadline passes (a quorum must answer; stragglers are reported, never waited on forever), fold
them into the strategy, and on a checkpoint round commit the manifest of the shards the sites wrote.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from hpcfed import protocol as P
from hpcfed.comm.api import Message, Outgoing
from hpcfed.errors import FederationError
from hpcfed.server import joining
from hpcfed.server.bounding import Bounding
from hpcfed.server.core import ServerCore
from hpcfed.server.progress import Progress
from hpcfed.server.scratch import Parking
from hpcfed.server.secagg_round import SecAggRound
from hpcfed.server.validation import ShardRef
from hpcfed.strategies.base import SyncStrategy, Update

log = logging.getLogger("hpcfed.server")

# How long a round waits for a site to take its model before it serves the next site (the model
# stays posted to the slow one): seconds, far above a transfer, far below a round's deadline.
TAKE_PATIENCE_S = 2.0

Uploads = dict[int, tuple[Update, ShardRef | None]]  # client id -> its upload and the shard it wrote


class SyncRounds:
    """The rounds of a synchronous federation, given the server's core."""

    def __init__(self, core: ServerCore, start_round: int = 0) -> None:
        if not isinstance(core.strategy, SyncStrategy):
            raise TypeError(f"strategy {core.strategy.name!r} is asynchronous: the async loop runs it, not rounds")
        self.core = core
        self.strategy: SyncStrategy = core.strategy
        self.start_round = start_round
        # A strategy may allow fewer rounds than configured (DP-FedAvg's ε budget): the run ends after them.
        self.end = min(core.cfg.rounds, self.strategy.round_limit(core.cfg.rounds))
        if self.end < core.cfg.rounds:
            log.warning("strategy %s allows %d of the %d configured rounds (privacy budget): the run ends after "
                        "round %d", self.strategy.name, self.end, core.cfg.rounds, self.end - 1)
        self.progress = core.progress = Progress(self.end, min(start_round, self.end), "rounds")
        # A round's upload is measured from the model the strategy sent: it holds still until the round ends.
        self.bounding = Bounding(core, lambda cid: core.strategy.model_for(cid))
        self.parking: Parking | None = None  # the first round's uploads wait here for their bounds
        # Models are posted, never sent (see `dispatch`); once a late upload arrives its site is
        # posted the current model at once.
        self.posted: dict[int, Outgoing] = {}  # the model last posted to each of them
        self.sent_round: dict[int, int] = {}  # client id -> the round whose model it was last given
        self.owed: set[int] = set()  # late sites owed the current round's model
        self.checkpointed = False  # whether the last round ended with a checkpoint
        self.budgets_spent = False  # every site that answered the last round had stopped (privacy.record_dp)
        # privacy.secure_aggregation: rank 0 learns each round's sum only (hpcfed.server.secagg_round)
        self.secagg = SecAggRound(core) if core.cfg.privacy.secure_aggregation else None

    def run(self) -> int | None:
        """Run the rounds from `start_round`; the round after which it halted (`halt_after_round`,
        SIGUSR2, OUT/HALT) to be resumed later, or None when every round is done."""
        cfg = self.core.cfg
        for rnd in range(self.start_round, self.end):
            self.round(rnd)
            if self.budgets_spent:
                log.warning("round %d: every site has spent its record-level DP budget (privacy.record_dp) and "
                            "stopped training: the run ends here", rnd)
                return None
            # A halt asked for during a round without a checkpoint waits for the next round's.
            halt = cfg.halt_after_round == rnd or (self.core.halt_requested and self.checkpointed)
            if halt and rnd < self.end - 1:
                return rnd
        return None

    def round(self, rnd: int) -> None:
        """One round: dispatch, collect, aggregate, log, and checkpoint when one is due."""
        core, fed = self.core, self.core.cfg.federation
        core.round = rnd
        joining.admit(core, rnd)  # sites that joined late (`hpcfed serve`) take part from this round
        t0 = time.monotonic()
        want_state = self.checkpoint_due(rnd)
        self.strategy.begin_round(rnd)
        core.influence.begin_round(core.live)
        got: Uploads = {}
        refused: set[int] = set()  # answered, but out of range: counted as an answer, not aggregated
        lost = False  # secure aggregation could not unmask the round's sum: nothing of it is folded
        if self.secagg is not None:
            taken, lost = self.secagg.collect(rnd, want_state)
            got.update(taken)
        else:
            self.collect_uploads(rnd, t0, want_state, got, refused)
        self.drop_departed(sorted(core.live - set(got)))
        # (Sites that sat a secure aggregation round out, short of neighbours, are not late: they were not asked.)
        missing = sorted(core.live - set(got) - (self.secagg.sat_out if self.secagg is not None else set()))
        self.checkpointed = want_state
        if missing:
            needed = max(1, math.ceil(fed.quorum * len(core.live)))
            who = ", ".join(f"client {c} (rank {c + 1})" for c in missing)
            if len(got) < needed:
                raise FederationError(
                    f"round {rnd}: only {len(got)} of {len(core.live)} clients answered within "
                    f"{fed.round_deadline_s:g} s (quorum {needed}); silent: {who}; "
                    f"last checkpoint: {core.last_checkpoint or 'none'}")
            log.warning("round %d: straggler(s) past the %g s deadline, aggregated without them: %s",
                        rnd, fed.round_deadline_s, who)
            for c in missing:
                core.metrics.log(rnd, c, "straggler", 1)
        updates = [] if lost else [got[c][0] for c in sorted(got) if c not in refused]
        # privacy.record_dp: a site that would pass its ε stops training and says so in its metrics
        self.budgets_spent = bool(updates) and all(u.metrics.get("record_dp_stopped") == 1.0 for u in updates)
        core.participation.folded([u.client_id for u in updates])
        self.strategy.end_round(rnd)  # a lost round folded nothing: the model stays (DP still counts the round)
        core.influence.settle()
        if not lost:
            core.strategy.version += 1
        core.updates_accepted += len(updates)
        for upd in updates:
            core.metrics.log_many(rnd, upd.client_id, upd.metrics)
        core.metrics.log_many(rnd, None, {"round_time_s": time.monotonic() - t0, "num_updates": len(updates),
                                          **core.strategy.metrics()})
        if want_state:
            core.commit_checkpoint(rnd, {c: got[c][1] for c in sorted(got)})  # phase 2: the manifest
        # Rounds are numbered from 0 everywhere (console, metrics.jsonl, checkpoints, report).
        self.progress.advance_to(rnd + 1)
        saved = f", saved {core.last_checkpoint.name}" if want_state and core.last_checkpoint else ""
        log.info("round %d of 0..%d %s in %.2f s (%d updates)%s%s [%s]", rnd, self.end - 1,
                 "lost" if lost else "done", time.monotonic() - t0, len(updates), _metric_brief(updates), saved,
                 self.progress.describe())
        core.maybe_status()

    def collect_uploads(self, rnd: int, t0: float, want_state: bool, got: Uploads, refused: set[int]) -> None:
        """Post round `rnd`'s models and take the uploads until all are in or the deadline passes."""
        core = self.core
        # The first round, with no history to bound it, bounds itself: uploads wait on disk, measured.
        self.parking = self.bounding.open_parking()

        try:
            core.check_departures()  # a site known to have ended is sent nothing
            deadline = t0 + core.cfg.federation.round_deadline_s
            for cid in sorted(core.live):
                posted = self.dispatch(cid, rnd, want_state)
                if posted is not None:
                    # One sealed model in flight at a time keeps rank 0 at one copy, whatever K; a site that
                    # takes nothing for a while (paused, still busy) keeps its copy and the next is served.
                    self.take_uploads(rnd, min(deadline, time.monotonic() + TAKE_PATIENCE_S), want_state, got,
                                      refused, until=posted.done)
            self.take_uploads(rnd, deadline, want_state, got, refused)
            if self.parking is not None:
                parking, self.parking = self.parking, None
                refused |= self.bounding.fold_parked(parking, {cid: got[cid][0] for cid in got},
                                                     self.strategy.fold)
        finally:
            if self.parking is not None:  # the round failed while parking: free the disk
                self.parking.close()
                self.parking = None

    def take_uploads(self, rnd: int, deadline: float, want_state: bool, got: Uploads, refused: set[int],
                     until: Callable[[], bool] | None = None) -> None:
        """Fold uploads as they arrive until every live site has answered, `until()` holds, or `deadline`."""
        core = self.core
        while core.live - set(got):  # an evicted site is waited for no more
            if until is not None and until():
                return
            self.pay_owed(rnd, want_state)
            # waiting on `until`, look at it every millisecond; otherwise wait for the next upload
            wake = deadline if until is None else min(deadline, time.monotonic() + 0.001)
            msg = core.recv_until(wake, {P.UPDATE, P.FAILED}, f"round {rnd}",
                                  waiting_for=core.live - set(got), fatal=False)
            if msg is None:
                if time.monotonic() >= deadline:
                    return
                continue
            core.contained(msg.source, self.take_update, rnd, msg, got, want_state, refused)
            msg = None  # the upload is folded: let its buffers go before the next one arrives

    def dispatch(self, cid: int, rnd: int, want_state: bool) -> Outgoing | None:
        """Post site `cid` round `rnd`'s model and go on at once. Never a blocking send: a site
        busy with an earlier round, or paused (SIGSTOP, a preempted node) between its upload and
        this model, takes nothing for a while, and must not hold up the others or be taken for a
        hung one; a site that never answers is a straggler at the round's deadline. One model at
        a time per site: while the last one posted waits, the current one follows its late upload.
        The model posted now, if one was."""
        core = self.core
        if cid in self.posted and not self.posted[cid].done():
            return None
        header = {"round": rnd, "version": core.strategy.version, "checkpoint": want_state}
        posted = core.post_to(cid, P.PARAMS, header, core.model_tensors(core.strategy.model_for(cid)))
        if posted is not None:
            self.posted[cid] = posted
            self.sent_round[cid] = rnd
        return posted

    def pay_owed(self, rnd: int, want_state: bool) -> None:
        """Post the current round's model to the late sites that have not had it."""
        owed, self.owed = self.owed, set()
        for cid in sorted(owed & self.core.live):
            if self.sent_round.get(cid) != rnd:
                self.posted.pop(cid, None)  # it answered: the model posted before has been taken
                self.dispatch(cid, rnd, want_state)

    def take_update(self, rnd: int, msg: Message, got: Uploads, want_state: bool, refused: set[int]) -> None:
        """Validate one upload of round `rnd` and fold it into the strategy at once: a streaming
        strategy (FedAvg's mean) adds it to its running sum and drops it, so rank 0 never holds the
        K updates of a round together. (In a calibrating first round it is parked on disk instead.)"""
        core = self.core
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
        if msg.source - 1 in got:
            core.reject(msg.source, "duplicate update", f"a second update for round {rnd}")
            return
        parsed = core.parse_update(msg, allow_state=want_state)
        if parsed is not None and want_state and (parsed[1] is None or parsed[1]["round"] != rnd):
            core.reject(msg.source, "malformed header", f"UPDATE of checkpoint round {rnd} without a valid shard")
            return
        if parsed is None:
            return
        upd = parsed[0]
        got[upd.client_id] = parsed
        core.participation.on_time(upd.client_id, rnd)
        if self.parking is not None:
            if not self.bounding.park(self.parking, msg.source, upd):
                refused.add(upd.client_id)
        elif self.bounding.bound(msg.source, upd):
            self.strategy.fold(upd)
        else:
            refused.add(upd.client_id)

    def drop_departed(self, silent: list[int]) -> None:
        """Past the deadline (or after SIGUSR1): drop the silent sites that have ended
        (federation.on_client_failure=continue); the others are stragglers."""
        core = self.core
        core.check_departures()
        if core.cfg.federation.on_client_failure != "continue":
            return
        for cid in silent:
            cause = core.departures.cause_of_silence(cid)
            if cause is not None and cid in core.live:
                core.client_failed(cid, cause)

    def checkpoint_due(self, rnd: int) -> bool:
        """Whether round `rnd` ends with a checkpoint (every `checkpoint_every`, the last, or a halt's)."""
        cfg = self.core.cfg
        if rnd == cfg.halt_after_round or self.core.halt_requested:
            return True
        every = cfg.checkpoint_every
        return every > 0 and ((rnd + 1) % every == 0 or rnd == self.end - 1)


def _metric_brief(updates: list[Update]) -> str:
    """The first two headline metrics the clients reported with this round's updates (``val_*``:
    on each site's validation split; ``loss``: training loss)."""
    if not updates:  # a lost round: nothing to average
        return ""
    names = [n for n in ("loss", "accuracy", "val_accuracy", "micro_f1", "nmi") if all(n in u.metrics for u in updates)]
    return "".join(f", mean {n} {np.mean([u.metrics[n] for u in updates]):.4f}" for n in names[:2])
