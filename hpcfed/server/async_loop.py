"""The asynchronous loop: every accepted upload goes through `Strategy.on_update` at once.

One update is in flight per site: a site's upload is taken only when the server asked for it
(answered it with a model) and was trained from that model or a newer one; a copy, a flood or an
old one is refused. The answer is owed, not sent (`hpcfed.server.outbox`), so a busy site never
holds the others up. Until ``min(3, K)`` sites have uploaded no history bounds an upload: each is
parked on disk, unanswered, and the first ones are bounded by their own median and folded together
(`hpcfed.server.bounding`). Each site's upload is measured from the model it was last answered with,
kept on disk. A checkpoint asks every site for its shard; uploads arriving meanwhile wait.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.comm.api import Message
from hpcfed.errors import FederationError
from hpcfed.server import between_uploads, joining
from hpcfed.server import validation as V
from hpcfed.server.bounding import Bounding
from hpcfed.server.core import ServerCore
from hpcfed.server.outbox import ModelOutbox
from hpcfed.server.progress import Progress
from hpcfed.server.scratch import DiskArray, Parking, Scratch
from hpcfed.strategies.base import AsyncStrategy, Update

log = logging.getLogger("hpcfed.server")

_OWED_POLL_S = 0.01  # how soon the loop looks again when a busy client is owed a model
# The least a parked first upload waits for others before the parked ones are released with what
# there is: seconds, well above the spread of honest sites' first steps on one start.
PARK_PATIENCE_S = 3.0

Accepted = list[tuple[Update, set[int]]]  # folded uploads, each with the clients to send the new model to


class AsyncLoop:
    """The asynchronous federation, given the server's core; its state is its own."""

    def __init__(self, core: ServerCore) -> None:
        if not isinstance(core.strategy, AsyncStrategy):
            raise TypeError(f"strategy {core.strategy.name!r} is synchronous: it runs in rounds, not the async loop")
        self.core = core
        self.strategy: AsyncStrategy = core.strategy
        self.max_updates = core.config.run.max_updates or core.config.run.rounds * core.num_clients
        self.progress = core.progress = Progress(self.max_updates, core.updates_accepted, "accepted updates")
        self.bounding = Bounding(core, self._reference)
        self.outbox = ModelOutbox(core.channel, self._model_message)
        core.on_drop = self.site_out  # owe a site the federation went on without nothing more
        # client id -> the version of the model it was last answered with; its next upload must be
        # trained from that model or a newer one
        self.requested: dict[int, int] = {}
        self.deferred: deque[Message] = deque()  # uploads that arrived during a checkpoint
        self.parking: Parking | None = None  # uploads waiting for their bounds (`hpcfed.server.scratch`)
        self.held: dict[int, Update] = {}  # the parked uploads (their arrays are on disk)
        self.sent: Scratch | None = None  # the model each site was last answered with
        self.last_seen: dict[int, float] = {}  # client id -> when it was last heard from
        self.began = 0.0  # when the loop began (monotonic): the first parked upload's wait is measured from it
        self.first_parked: float | None = None  # when the first upload was parked
        self.unanswered: set[int] = set()  # folded uploads whose answer the strategy deferred (FedBuff's buffer)

    def run(self) -> bool:
        """Accept uploads until the budget is spent; True when it stopped early to halt (SIGUSR2, OUT/HALT, or
        `halt_after_round` = this many accepted updates) after a checkpoint."""
        core = self.core
        try:
            self.begin()
            while core.updates_accepted < self.max_updates:
                for cid in joining.await_floor(core, core.updates_accepted):  # every site away (`hpcfed serve`)
                    self.outbox.owe(cid, answer=True)
                    self.last_seen[cid] = time.monotonic()
                if not core.live:
                    raise FederationError(f"every client has failed; last checkpoint: {core.last_checkpoint or 'none'}")
                accepted = self.step()
                for upd, targets in accepted:
                    self.accepted(upd, targets)
                if accepted and self.after_accepting(len(accepted)):
                    return True
        finally:
            self.end()
        log.info("async: %d updates accepted, server version %d", core.updates_accepted, core.strategy.version)
        if core.config.checkpoints.every > 0:
            self.checkpoint()
        return False

    def begin(self) -> None:
        """Open the scratch disk and send every site its first model; each was heard from now."""
        core = self.core
        if self.bounding.applies() and core.config.influence.enabled:
            self.sent = Scratch(core.out_dir / "scratch" / "sent", "last model (what its upload is measured from)",
                                "set influence.enabled=false")
        core.influence.begin_round(core.live)
        self.parking = self.bounding.open_parking()  # no history yet: the first uploads wait for min(3, K) sites
        for cid in sorted(core.live):
            self.outbox.owe(cid, answer=True)
        self.began = time.monotonic()
        self.last_seen = {cid: self.began for cid in core.live}

    def end(self) -> None:
        """Free the scratch disk (models owed stay owed: `forget_owed`)."""
        for scratch in (self.parking, self.sent):
            if scratch is not None:
                scratch.close()
        self.parking = self.sent = None

    def forget_owed(self) -> None:
        """Owe no site a model any more: a STOP or FINAL supersedes them."""
        self.outbox.forget()

    def step(self) -> Accepted:
        """Take the next message (or notice silence): the uploads it lets through."""
        core = self.core
        # While a model is owed to a busy client, look back soon to post it once it is free.
        wait = _OWED_POLL_S if self.outbox.waiting() else min(1.0, core.config.deadlines.status_every_s)
        msg = self.deferred.popleft() if self.deferred else core.channel.recv(kinds={P.UPDATE, P.FAILED},
                                                                              timeout=wait)
        core.take_channel_evidence()  # a bundle refused after authenticating: evidence at once
        core.check_departures()  # after SIGUSR1: drop the sites that ended
        for cid in joining.admit(core, core.updates_accepted):  # a late site (`hpcfed serve`) gets the model now
            self.outbox.owe(cid, answer=True)
            self.last_seen[cid] = time.monotonic()
        self.outbox.flush()
        if msg is not None and msg.kind == P.UPDATE:
            return core.contained(msg.source, self.update, msg) or []
        if msg is None:
            self.check_silent()
            core.maybe_status()
        else:
            core.client_failed(msg.source - 1, V.error_text(msg.header))
        if self.unanswered and core.live <= self.unanswered:  # sites left: the buffer cannot fill
            self.answer_flushed(self.strategy.flush())
        return self.release_parked()  # a site gone may complete the parked quorum

    def update(self, msg: Message) -> Accepted:
        """One async upload: the uploads it lets through (itself, or the parked ones it completes
        the quorum of)."""
        core = self.core
        cid = msg.source - 1
        base = msg.header.get("version")
        if cid not in self.requested or not V.is_int(base) or base < self.requested[cid]:
            # not asked for, or a copy trained before our last answer: a flood gains nothing
            core.reject(msg.source, "unrequested update", "an upload the server did not ask for")
            return []
        parsed = core.parse_update(msg, allow_state=False)
        if parsed is None:
            return []
        upd = parsed[0]
        del self.requested[cid]
        self.last_seen[cid] = time.monotonic()
        core.influence.begin_round(core.live)
        if self.parking is not None:
            if self.bounding.park(self.parking, msg.source, upd):
                self.held[cid] = upd  # answered once the quorum is in: a fast site cannot fill it
                if self.first_parked is None:
                    self.first_parked = time.monotonic()
            else:
                self.outbox.owe(cid, answer=True)
            return self.release_parked()
        bounded = self.bounding.bound(msg.source, upd)
        core.influence.settle()
        if not bounded:
            self.outbox.owe(cid, answer=True)  # answered all the same: the site goes on
            return []
        return [(upd, self._targets(upd))]

    def _targets(self, upd: Update) -> set[int]:
        """Fold `upd`: the sites to send the model to now (the uploader too, unless the strategy
        answers it later: `AsyncStrategy.defers_answers`, then it waits in `unanswered`)."""
        targets = set(self.strategy.on_update(upd))
        if not self.strategy.defers_answers:
            targets.add(upd.client_id)
        elif upd.client_id not in targets:
            self.unanswered.add(upd.client_id)
        return targets

    def release_parked(self) -> Accepted:
        """Once min(3, K) live sites have an upload parked (each waits for its answer meanwhile,
        so no site can be more than one of them), bound them all by their median distance and fold
        them; the sites are answered from now on."""
        core = self.core
        if self.parking is None or not self.held or not self._parked_enough():
            return []
        held, self.held = self.held, {}
        parking, self.parking = self.parking, None
        log.info("async: the first uploads of client(s) %s are bounded by their own distances and folded "
                 "(%d of %d live sites in)", ", ".join(map(str, sorted(held))), len(held), len(core.live))
        released: Accepted = []
        refused = self.bounding.fold_parked(parking, held, lambda upd: released.append((upd, self._targets(upd))))
        core.influence.settle()
        now = time.monotonic()
        for cid in sorted(held):
            self.last_seen[cid] = now  # it waited on the server, not the other way round
            if cid in refused and cid in core.live:
                self.outbox.owe(cid, answer=True)
        return released

    def _parked_enough(self) -> bool:
        """Whether to release the parked uploads: min(3, K) live sites have one parked, or two
        have and the first has waited as long again as it took to come (at least
        `PARK_PATIENCE_S`, at most the round deadline). A silent or hostile site (no sane upload)
        never holds two others up longer than that; the smaller of two distances is the bound, so
        a hostile site that came first cannot set it. One upload alone is never released on time:
        nothing but the model's own norm would bound it, and a fast hostile site that came first
        (a sign flip x10, while the honest sites' first steps were slow under load) was folded
        moved by the norm and kept that distance as its own history, so every later flip of it was
        accepted (honest mean accuracy 0.149 against 0.70). It waits for a second site's upload,
        or until the others are gone (silent for `round_deadline_s`, or evicted)."""
        core = self.core
        if len(self.held) >= min(core.influence.quorum, max(1, len(core.live))):
            return True
        if self.first_parked is None or len(self.held) < 2:
            return False
        patience = min(max(2 * (self.first_parked - self.began), PARK_PATIENCE_S),
                       core.config.deadlines.round_deadline_s)
        return time.monotonic() - self.first_parked >= patience

    def answer_flushed(self, targets: list[int]) -> None:
        """Answer the sites a flushed buffer held (`AsyncStrategy.flush`)."""
        for cid in sorted(set(targets) & self.core.live):
            self.outbox.owe(cid, answer=True)
        self.unanswered.clear()

    def site_out(self, cid: int) -> None:
        """Site `cid` left the federation (dropped or evicted): owe it nothing, forget what it
        asked for, and fold nothing it had parked."""
        self.outbox.forget(cid)
        self.requested.pop(cid, None)
        self.unanswered.discard(cid)
        if self.held.pop(cid, None) is not None and self.parking is not None:
            self.parking.discard(cid)

    def accepted(self, upd: Update, targets: set[int]) -> None:
        """Count one folded upload, log it and answer it."""
        core = self.core
        core.updates_accepted += 1
        core.round = core.updates_accepted
        self.progress.advance_to(core.updates_accepted)
        core.metrics.log_many(core.updates_accepted, upd.client_id, upd.metrics)
        core.participation.folded([upd.client_id])
        core.metrics.log(core.updates_accepted, None, "broadcast", int(len(targets) > 1))
        for name, value in core.strategy.metrics().items():
            core.metrics.log(core.updates_accepted, None, name, value)
        for cid in sorted(targets & core.live):
            self.outbox.owe(cid, answer=cid == upd.client_id or cid in self.unanswered)
            self.unanswered.discard(cid)

    def after_accepting(self, count: int) -> bool:
        """`count` uploads were just accepted (several when parked ones are released together):
        checkpoint when one fell due among them; True to halt now."""
        halt, checkpoint = between_uploads.due(self.core, count, self.max_updates)
        if checkpoint:
            self.checkpoint()
        if not halt:
            self.core.maybe_status()
        return halt

    def check_silent(self) -> None:
        """A site unheard of for `round_deadline_s` has failed (a parked one waits on the server)."""
        between_uploads.fail_silent(self.core, self.last_seen, set(self.held) | self.unanswered, "sent no update")

    def checkpoint(self) -> None:
        """The consistent point is this moment of the server (its state after the uploads
        accepted so far) and each site's state when it handles CHECKPOINT, i.e. after its last
        finished training step; uploads arriving meanwhile are held (one per site: the one it was
        asked for; any other is refused at once, so a flood cannot fill the site's inbox and crowd
        out its own answer) and handled after the manifest. At most one in-flight step per site is
        replayed on resume."""
        between_uploads.gather_shards(self.core, self.last_seen, P.UPDATE, self._hold)

    def _hold(self, msg: Message) -> None:
        """An upload that arrived during a checkpoint: held for after it, if asked for and the first."""
        if msg.source - 1 in self.requested and all(m.source != msg.source for m in self.deferred):
            self.deferred.append(msg)
        else:
            self.core.reject(msg.source, "unrequested update", "an upload the server did not ask for")

    def _model_message(self, cid: int, answer: bool) -> tuple[int, dict[str, Any], dict[str, np.ndarray]]:
        """The model owed to `cid`, composed as it is posted (`hpcfed.server.outbox`)."""
        core = self.core
        flat = core.strategy.model_for(cid)
        if answer:
            self.requested[cid] = core.strategy.version
            if self.sent is not None:
                self.sent.put(cid, flat)  # its next upload is measured from this
        # answer=False marks a broadcast the client did not ask for: it replaces the client's model
        # but does not start a training step while the client's own upload is unanswered.
        return P.PARAMS, {"round": core.updates_accepted, "version": core.strategy.version,
                          "checkpoint": False, "answer": answer}, core.model_tensors(flat)

    def _reference(self, cid: int) -> np.ndarray | DiskArray:
        """An asynchronous site's upload is measured from the model it was last answered with,
        kept on disk: the global model has moved on since."""
        sent = self.sent.view(cid) if self.sent is not None else None
        return sent if sent is not None else self.core.strategy.model_for(cid)
