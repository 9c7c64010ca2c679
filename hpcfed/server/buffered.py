"""The asynchronous loop under secure aggregation: FedBuff's buffers (Nguyen et al. 2022), each summed
securely among its members (`hpcfed.server.secagg_buffer`), so rank 0 learns each buffer's sum only.

Every site trains on the model it was last answered with and says SA_READY when done; the next B
ready sites (``federation.buffer_size``, or all live sites when fewer are left, at least 2) form a
buffer, in the order they became ready. Rank 0 tells each member its staleness (its version now
minus the one the member trained from), runs the buffer's protocol, folds its sum, and answers the
members with the new model, in the order they became ready. No site waits for a slow one beyond the
buffer it lands in: the buffer is formed from whoever is ready, and a slow site lands in a later one.
The answers' order matters because each send waits for its site, so the first answered starts
training first and tends to land in the next buffer as its fresh, full-weight member: answered in id
order, the same sites kept that role and weighed more than their share (quickstart FedBuff, K = 3,
buffers of 2: secure below plain in 7 of 8 seeds; docs/benchmarks.md).

A refused buffer's sum is evidence against its members (`hpcfed.server.secagg_buffer`): until it is
explained, a buffer holds at most one suspected site (the others wait for a buffer of their own),
so that the next refusal narrows it down to the hostile member, which is then evicted on that proof.

A checkpoint is taken between buffers: rank 0 asks every site for its shard; a site waiting for a
buffer, or finishing its step meanwhile, drops its upload and writes its shard; afterwards every
site is answered with the current model. So an interrupted buffer is lost, never the run, and the
resumed run's sites make fresh epoch keys (each process has its own: `hpcfed.privacy.secagg_epoch`).
"""

from __future__ import annotations

import logging
import time

from hpcfed import protocol as P
from hpcfed.comm.api import Message
from hpcfed.errors import FederationError
from hpcfed.privacy.buffered import StalenessRule
from hpcfed.privacy.group_testing import narrowing
from hpcfed.server import between_uploads, joining
from hpcfed.server import validation as V
from hpcfed.server.core import ServerCore
from hpcfed.server.progress import Progress
from hpcfed.server.secagg_buffer import BufferExchange
from hpcfed.strategies.base import AsyncStrategy

log = logging.getLogger("hpcfed.server")


class SecureBufferedLoop:
    """Buffers of ready sites, each aggregated securely (see the module's docstring)."""

    def __init__(self, core: ServerCore) -> None:
        if not isinstance(core.strategy, AsyncStrategy):
            raise TypeError(f"strategy {core.strategy.name!r} is synchronous: it runs in rounds, not buffers")
        self.core, self.strategy = core, core.strategy
        cfg = core.config
        rule = getattr(self.strategy, "rule", None)
        rule = rule if isinstance(rule, StalenessRule) else StalenessRule("constant")
        self.exchange = BufferExchange(core, self.strategy, rule)
        configured = cfg.run.buffer_size
        self.size = configured if configured is not None else getattr(self.strategy, "buffer_size", 2)
        self.max_updates = cfg.run.max_updates or cfg.run.rounds * core.num_clients
        self.progress = core.progress = Progress(self.max_updates, core.updates_accepted, "accepted updates")
        self.sent: dict[int, int] = {}  # site -> the version it was answered with (training from it now)
        self.ready: dict[int, int] = {}  # site -> the version it trained from, in the order they became ready
        self.next_buffer = self.strategy.version - 1  # versions never run ahead of buffers (sites check it)
        self.last_seen: dict[int, float] = {}
        core.on_drop = self.site_out

    def run(self) -> bool:
        """Run buffers until the budget of accepted uploads is spent; True when it stopped early to halt."""
        core = self.core
        for cid in sorted(core.live):
            self.answer(cid)
        while core.updates_accepted < self.max_updates:
            for cid in joining.await_floor(core, core.updates_accepted):  # every site away (`hpcfed serve`)
                self.answer(cid)
            if not core.live:
                raise FederationError(f"every client has failed; last checkpoint: {core.last_checkpoint or 'none'}")
            self.step()
            members = self.next_members()
            if members and self.after_buffer(self.run_buffer(members)):
                return True
        log.info("async (secure buffers of %d): %d updates accepted, server version %d", self.size,
                 core.updates_accepted, self.strategy.version)
        if core.config.checkpoints.every > 0:
            self.checkpoint()
        return False

    def forget_owed(self) -> None:
        """Nothing is owed between buffers: every answer is sent when its buffer ends."""

    def answer(self, cid: int) -> None:
        """Send site `cid` the current model to train from."""
        core = self.core
        version = self.strategy.version
        core.send_to(cid, P.PARAMS, {"round": core.updates_accepted, "version": version, "checkpoint": False,
                                     "answer": True}, core.model_tensors(self.strategy.model_for(cid)))
        self.sent[cid] = version
        self.last_seen[cid] = time.monotonic()

    def step(self) -> None:
        """Take the next SA_READY (or notice silence)."""
        core = self.core
        msg = core.channel.recv(kinds={P.SA_READY, P.FAILED}, timeout=min(1.0, core.config.deadlines.status_every_s))
        core.take_channel_evidence()
        core.check_departures()
        for cid in joining.admit(core, core.updates_accepted):  # a late site (`hpcfed serve`) trains from now
            self.answer(cid)
        if msg is None:
            self.check_silent()
            core.maybe_status()
        elif msg.kind == P.FAILED:
            core.client_failed(msg.source - 1, V.error_text(msg.header))
        else:
            core.contained(msg.source, self.take_ready, msg)

    def take_ready(self, msg: Message) -> None:
        """A site is ready: only one that was answered, for the version it was answered with, once."""
        cid, version = msg.source - 1, msg.header.get("version")
        if self.sent.get(cid) is None or version != self.sent[cid] or cid in self.ready:
            self.core.reject(msg.source, "unrequested update", f"SA_READY for version {V.short(version, 20)}, "
                                                               f"not the one the server asked it to train from")
            return
        self.exchange.take_advert(cid, msg.header)  # ProtocolError: contained, counted against the site
        self.ready[cid] = self.sent.pop(cid)
        self.last_seen[cid] = time.monotonic()

    def next_members(self) -> set[int]:
        """The next buffer's members: the first B ready live sites (fewer when fewer are live, >= 2).
        While a refused buffer's evidence is pending, at most one suspected site per buffer
        (`group_testing.narrowing`), waiting for other sites to be ready unless every live site is."""
        live = self.core.live
        for cid in [c for c in self.ready if c not in live]:
            del self.ready[cid]
        want = min(self.size, len(live))
        if len(live) < 2:
            raise FederationError(f"only {len(live)} site(s) left: secure buffered aggregation needs 2 in a buffer; "
                                  f"last checkpoint: {self.core.last_checkpoint or 'none'}")
        if len(self.ready) < want:
            return set()
        picked = narrowing(list(self.ready), want, self.exchange.testing.isolation.suspected() & live)
        if picked is None and len(self.ready) < len(live):
            return set()  # a buffer of the same suspects would repeat the evidence: wait for other sites
        return set(picked or list(self.ready)[:want])

    def run_buffer(self, members: set[int]) -> int:
        """One buffer: its protocol, its metrics, the members answered; the uploads it folded."""
        core, b, version = self.core, self.next_buffer, self.strategy.version
        self.next_buffer += 1
        order = [cid for cid in self.ready if cid in members]  # the order they became ready
        staleness = {cid: version - self.ready.pop(cid) for cid in order}
        t0 = time.monotonic()
        uploads = self.exchange.buffer(b, members, version, staleness)
        folded = [] if uploads.lost else uploads.folded()
        for upd in folded:
            core.updates_accepted += 1
            core.metrics.log_many(core.updates_accepted, upd.client_id, upd.metrics)
        core.round = core.updates_accepted
        core.participation.folded([u.client_id for u in folded])
        core.metrics.log_many(core.updates_accepted, None, {
            "buffer": b, "buffer_time_s": time.monotonic() - t0, "num_updates": len(folded),
            "mean_staleness": sum(staleness.values()) / len(staleness), **self.strategy.metrics()})
        self.progress.advance_to(core.updates_accepted)
        log.info("buffer %d (sites %s, staleness %s) %s in %.2f s, version %d [%s]", b,
                 ", ".join(map(str, sorted(members))), ", ".join(str(staleness[c]) for c in sorted(members)),
                 "lost" if uploads.lost else "folded", time.monotonic() - t0, self.strategy.version,
                 self.progress.describe())
        for cid in order:  # the one that waited longest first (not by id: see the module's docstring)
            if cid in core.live:
                self.answer(cid)
        return len(folded)

    def after_buffer(self, count: int) -> bool:
        """Checkpoint when one fell due with this buffer's `count` uploads; True to halt now."""
        core = self.core
        halt, checkpoint = between_uploads.due(core, count, self.max_updates)
        if checkpoint:
            self.checkpoint()
            if not halt:
                for cid in sorted(core.live):
                    self.answer(cid)  # every site dropped its upload for the checkpoint: it trains anew
        core.maybe_status()
        return halt

    def site_out(self, cid: int) -> None:
        """Site `cid` left the federation: it is in no buffer to come."""
        self.ready.pop(cid, None)
        self.sent.pop(cid, None)

    def check_silent(self) -> None:
        """A site unheard of for `round_deadline_s` while training has failed (a ready one waits on us)."""
        between_uploads.fail_silent(self.core, self.last_seen, set(self.ready), "was not ready")

    def checkpoint(self) -> None:
        """Between buffers: every site writes its shard (one waiting for a buffer, or finishing its step,
        drops that upload first: its SA_READY is passed over); the manifest is committed with the
        server's state after the buffers so far."""
        self.ready.clear()
        self.sent.clear()
        between_uploads.gather_shards(self.core, self.last_seen, P.SA_READY, lambda msg: None)
