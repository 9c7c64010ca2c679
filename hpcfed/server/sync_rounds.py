"""Synchronous rounds: the run's collector (`hpcfed.server.collect`: plain, or secure aggregation's)
posts every live site the round's model and folds what comes back until all are in or the deadline
passes; the loop checks the quorum (stragglers are reported, never waited on forever), ends the
round in the strategy, and on a checkpoint round commits the manifest of the shards the sites wrote.
It does not know which collector it has: both hand it one `RoundUploads`.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from hpcfed.errors import FederationError
from hpcfed.privacy import audit
from hpcfed.server import joining
from hpcfed.server.collect import Collector, PlainCollector, RoundUploads
from hpcfed.server.core import ServerCore
from hpcfed.server.progress import Progress
from hpcfed.server.secagg_round import SecAggCollector
from hpcfed.strategies.base import SyncStrategy, Update

log = logging.getLogger("hpcfed.server")


class SyncRounds:
    """The rounds of a synchronous federation, given the server's core."""

    def __init__(self, core: ServerCore, start_round: int = 0) -> None:
        if not isinstance(core.strategy, SyncStrategy):
            raise TypeError(f"strategy {core.strategy.name!r} is asynchronous: the async loop runs it, not rounds")
        self.core = core
        self.strategy: SyncStrategy = core.strategy
        self.start_round = start_round
        # A strategy may allow fewer rounds than configured (DP-FedAvg's ε budget): the run ends after them.
        self.end = min(core.config.run.rounds, self.strategy.round_limit(core.config.run.rounds))
        if self.end < core.config.run.rounds:
            log.warning("strategy %s allows %d of the %d configured rounds (privacy budget): the run ends after "
                        "round %d", self.strategy.name, self.end, core.config.run.rounds, self.end - 1)
        self.progress = core.progress = Progress(self.end, min(start_round, self.end), "rounds")
        self.checkpointed = False  # whether the last round ended with a checkpoint
        self.budgets_spent = False  # every site that answered the last round had stopped (privacy.record_dp)
        # plain, or privacy.secure_aggregation's (rank 0 learns each round's sum only): the loop does not care
        self.collector = collector_for(core, self.strategy, start_round)

    def run(self) -> int | None:
        """Run the rounds from `start_round`; the round after which it halted (`halt_after_round`,
        SIGUSR2, OUT/HALT) to be resumed later, or None when every round is done."""
        checkpoints = self.core.config.checkpoints
        for rnd in range(self.start_round, self.end):
            self.round(rnd)
            if self.budgets_spent:
                log.warning("round %d: every site has spent its record-level DP budget (privacy.record_dp) and "
                            "stopped training: the run ends here", rnd)
                return None
            # A halt asked for during a round without a checkpoint waits for the next round's.
            halt = checkpoints.halt_after_round == rnd or (self.core.halt_requested and self.checkpointed)
            if halt and rnd < self.end - 1:
                return rnd
        return None

    def round(self, rnd: int) -> None:
        """One round: dispatch, collect, aggregate, log, and checkpoint when one is due."""
        core = self.core
        core.round = rnd
        joining.admit(core, rnd)  # sites that joined late (`hpcfed serve`) take part from this round
        joining.await_floor(core, rnd)  # every site away at once: they may come back (`hpcfed serve`)
        t0 = time.monotonic()
        want_state = self.checkpoint_due(rnd)
        _audit_model(core, rnd, "start")
        self.strategy.begin_round(rnd)
        core.influence.begin_round(core.live)
        uploads = self.collector.collect(rnd, want_state)
        self.drop_departed(sorted(core.live - uploads.answered))
        self.checkpointed = want_state
        self.check_quorum(uploads)
        updates = uploads.folded()
        # privacy.record_dp: a site that would pass its ε stops training and says so in its metrics
        self.budgets_spent = bool(updates) and all(u.metrics.get("record_dp_stopped") == 1.0 for u in updates)
        core.participation.folded([u.client_id for u in updates])
        self.strategy.end_round(rnd)  # a lost round folded nothing: the model stays (DP still counts the round)
        _audit_model(core, rnd, "end")
        core.influence.settle()
        if not uploads.lost:
            core.strategy.version += 1
        core.updates_accepted += len(updates)
        for upd in updates:
            core.metrics.log_many(rnd, upd.client_id, upd.metrics)
        core.metrics.log_many(rnd, None, {"round_time_s": time.monotonic() - t0, "num_updates": len(updates),
                                          **core.strategy.metrics()})
        if want_state:
            core.commit_checkpoint(rnd, dict(sorted(uploads.shards.items())))  # phase 2: the manifest
        # Rounds are numbered from 0 everywhere (console, metrics.jsonl, checkpoints, report).
        self.progress.advance_to(rnd + 1)
        saved = f", saved {core.last_checkpoint.name}" if want_state and core.last_checkpoint else ""
        log.info("round %d of 0..%d %s in %.2f s (%d updates)%s%s [%s]", rnd, self.end - 1,
                 "lost" if uploads.lost else "done", time.monotonic() - t0, len(updates), _metric_brief(updates), saved,
                 self.progress.describe())
        core.maybe_status()

    def check_quorum(self, uploads: RoundUploads) -> None:
        """The live sites that did not answer are stragglers, logged; fewer answers than the quorum end
        the run. (Sites that sat a secure aggregation round out, short of neighbours, are not late:
        they were not asked.)"""
        core, rnd = self.core, uploads.round
        deadline_s, quorum = core.config.deadlines.round_deadline_s, core.config.roster.quorum
        missing = sorted(core.live - uploads.answered - uploads.sat_out)
        if not missing:
            return
        needed = max(1, math.ceil(quorum * len(core.live)))
        who = ", ".join(f"client {c} (rank {c + 1})" for c in missing)
        if len(uploads.answered) < needed:
            raise FederationError(
                f"round {rnd}: only {len(uploads.answered)} of {len(core.live)} clients answered within "
                f"{deadline_s:g} s (quorum {needed}); silent: {who}; "
                f"last checkpoint: {core.last_checkpoint or 'none'}")
        log.warning("round %d: straggler(s) past the %g s deadline, aggregated without them: %s",
                    rnd, deadline_s, who)
        for c in missing:
            core.metrics.log(rnd, c, "straggler", 1)

    def drop_departed(self, silent: list[int]) -> None:
        """Past the deadline (or after SIGUSR1): drop the silent sites that have ended
        (federation.on_client_failure=continue); the others are stragglers."""
        core = self.core
        core.check_departures()
        if core.config.roster.on_client_failure != "continue":
            return
        for cid in silent:
            cause = core.departures.cause_of_silence(cid)
            if cause is not None and cid in core.live:
                core.client_failed(cid, cause)

    def checkpoint_due(self, rnd: int) -> bool:
        """Whether round `rnd` ends with a checkpoint (every `checkpoint_every`, the last, or a halt's)."""
        checkpoints = self.core.config.checkpoints
        if rnd == checkpoints.halt_after_round or self.core.halt_requested:
            return True
        every = checkpoints.every
        return every > 0 and ((rnd + 1) % every == 0 or rnd == self.end - 1)


def _audit_model(core: ServerCore, rnd: int, when: str) -> None:
    """The chaos soak's probe of the global model (`hpcfed.privacy.audit`; off by default)."""
    model = getattr(core.strategy, "global_flat", None)
    if audit.folder() is not None and model is not None:
        core.metrics.log(rnd, None, "audit_model", audit.model_probe(model), at=when)


def _metric_brief(updates: list[Update]) -> str:
    """The first two headline metrics the clients reported with this round's updates (``val_*``:
    on each site's validation split; ``loss``: training loss)."""
    if not updates:  # a lost round: nothing to average
        return ""
    names = [n for n in ("loss", "accuracy", "val_accuracy", "micro_f1", "nmi") if all(n in u.metrics for u in updates)]
    return "".join(f", mean {n} {np.mean([u.metrics[n] for u in updates]):.4f}" for n in names[:2])


def collector_for(core: ServerCore, strategy: SyncStrategy, start_round: int) -> Collector:
    """The run's collector: secure aggregation's when ``privacy.secure_aggregation``, else the plain one."""
    if core.config.privacy.secure_aggregation:
        return SecAggCollector(core, strategy)
    return PlainCollector(core, strategy, start_round)
