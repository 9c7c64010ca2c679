"""Rank 0: the parameter server's event loop.

The server never sees raw data. It runs the setup exchange, then either synchronous rounds (quorum +
per-round deadline; stragglers are reported, never waited on forever) or an asynchronous loop
(every accepted upload goes through `Strategy.on_update`), writes metrics and checkpoints, and ends
with a final evaluation round whose results become ``summary.json``.

Every message is validated before use (`_as_update`): unknown tensor names, wrong dtypes or shapes,
and NaN/Inf parameters are rejected, counted and logged with the rank, and the server keeps serving.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.config import Config, build, check_resume_compatible
from hpcfed.cost import brief as cost_brief
from hpcfed.cost import parse_cost, rank_cost
from hpcfed.errors import FederationError
from hpcfed.params import ParamLayout
from hpcfed.registry import strategy_class, task_class
from hpcfed.server.influence import InfluenceGuard, Refused
from hpcfed.server.metrics import MetricsLog
from hpcfed.server.outbox import ModelOutbox
from hpcfed.server.progress import Progress
from hpcfed.server.scratch import DiskArray, Parking, Scratch
from hpcfed.store import atomic
from hpcfed.store import checkpoint as ckpt_store
from hpcfed.strategies.base import Strategy, StrategyContext, Update

log = logging.getLogger("hpcfed.server")

_OWED_POLL_S = 0.01  # how soon an async server looks again when a busy client is owed a model


class Server:
    def __init__(self, cfg: Config, channel: Any, out_dir: Path, resume: bool = False) -> None:
        self.cfg = cfg
        self.channel = channel
        self.out_dir = out_dir
        self.resume = resume
        self.num_clients = channel.size - 1
        self.live: set[int] = set(range(self.num_clients))
        self.task_cls = task_class(cfg.task.name, cfg.source)
        self.task_config = build(self.task_cls.Config, cfg.task.options, where=cfg.source, prefix="task.")
        strategy_cls = strategy_class(cfg.strategy.name, cfg.source)
        self.strategy: Strategy = strategy_cls(
            build(strategy_cls.Config, cfg.strategy.options, where=cfg.source, prefix="strategy."),
            StrategyContext(num_clients=self.num_clients, seed=cfg.seed, task_cls=self.task_cls,
                            task_config=self.task_config, log=log.info),
        )
        if strategy_cls.synchronous != (cfg.federation.mode == "sync"):
            raise ValueError(
                f"{cfg.source}: strategy {cfg.strategy.name!r} is {'synchronous' if strategy_cls.synchronous else 'asynchronous'}"
                f" but federation.mode={cfg.federation.mode}; set federation.mode="
                f"{'sync' if strategy_cls.synchronous else 'async'}")
        self.layout: ParamLayout | None = None
        self.rejected: dict[str, int] = {}
        self.rejected_by_rank: dict[int, int] = {}
        self.influence = InfluenceGuard(cfg.influence, self.num_clients)
        # async, one update in flight per site: client id -> the version of the model it was last
        # answered with; its next upload must be trained from that model or a newer one
        self._requested: dict[int, int] = {}
        self._deferred: deque[Any] = deque()  # async: uploads that arrived during a checkpoint
        self._parking: Parking | None = None  # uploads waiting for their bounds (see `hpcfed.server.scratch`)
        self._held: dict[int, Update] = {}  # async: the parked uploads (their arrays are on disk)
        self._sent: Scratch | None = None  # async: the model each site was last answered with
        self.updates_accepted = 0
        self.round = -1
        self.last_checkpoint: Path | None = None
        self.metrics: MetricsLog | None = None
        self.missing_results: list[int] = []
        self.halt_requested = False  # set by SIGUSR1 (see launcher): checkpoint after this round and stop
        self._last_status = time.monotonic()
        self._cpu0 = time.process_time()
        self._outbox: ModelOutbox | None = None  # async mode
        self.client_costs: dict[int, dict[str, Any] | None] = {}
        self._progress: Progress | None = None  # console progress: rounds (sync) or accepted updates (async)
        from hpcfed.credentials import state_file_auth

        # Checkpoints are tagged with a key derived from the job's credentials, never kept in out_dir.
        self.file_auth = state_file_auth(cfg.security, 0, "checkpoint")

    # ------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        fed = self.cfg.federation
        start_round, resumed = self._setup()
        self.metrics.log(None, None, "num_clients", self.num_clients)
        if fed.mode == "sync":
            self._progress = Progress(self.cfg.rounds, start_round, "rounds")
            for rnd in range(start_round, self.cfg.rounds):
                self._sync_round(rnd)
                if (self.cfg.halt_after_round == rnd or self.halt_requested) and rnd < self.cfg.rounds - 1:
                    return self._halt(rnd)
        elif self._async_loop(resumed):
            if self._outbox is not None:
                self._outbox.forget()  # STOP supersedes every model still owed
            return self._halt(self.updates_accepted)
        summary = self._finish()
        return summary

    # -- setup ---------------------------------------------------------------------------------
    def _setup(self) -> tuple[int, ckpt_store.Checkpoint | None]:
        fed = self.cfg.federation
        payloads: dict[int, tuple[dict, dict]] = {}
        held: dict[int, set[tuple[int, str]]] = {}  # --resume: the intact shards each site reports
        initial = None
        deadline = time.monotonic() + fed.setup_timeout_s
        while len(payloads) < self.num_clients:
            msg = self._recv_until(deadline, {P.SETUP, P.FAILED}, "the setup exchange",
                                   waiting_for=set(range(self.num_clients)) - set(payloads))
            cid = msg.source - 1
            header = msg.header.get("task", {})
            if not isinstance(header, dict):
                self._reject(msg.source, "malformed header", "SETUP task header is not a mapping")
                continue
            payloads[cid] = (header, P.split_prefixed(msg.tensors, P.SETUP_PREFIX))
            held[cid] = _held_shards(msg.header.get("shards"))
            if cid == 0:
                initial = {k: np.array(v) for k, v in P.split_prefixed(msg.tensors, P.INIT_PREFIX).items()}
        replies, server_init = self.task_cls.server_setup(self.task_config, payloads)
        init = server_init if server_init is not None else initial
        if not init:
            raise FederationError("client 0 (rank 1) sent no initial model and the task's server_setup built none")
        self.strategy.initialize(init)
        self.layout = self.strategy.layout
        resumed = self._load_checkpoint(held) if self.resume else None
        start_round = resumed.round + 1 if resumed else 0
        self.metrics = MetricsLog(self.out_dir / "metrics.jsonl", resume_round=resumed.round if resumed else None,
                                  time_offset=float(resumed.meta.get("elapsed", 0.0)) if resumed else 0.0)
        layout_header = self.layout.describe()
        for cid in range(self.num_clients):
            reply_header, reply_tensors = replies.get(cid, ({}, {}))
            tensors = P.prefixed(reply_tensors, P.SETUP_PREFIX)
            shard = None  # which of its own shards the site loads (it verifies it against this digest)
            if resumed and cid in resumed.sites:
                shard = {"round": resumed.round, "digest": resumed.sites[cid]["digest"]}
            self.channel.send(cid + 1, P.SETUP_REPLY, {
                "task": reply_header, "layout": layout_header, "start_round": start_round,
                "shard": shard, "resumed": bool(resumed),
            }, tensors)
        log.info("setup done: %d clients, %d parameters%s", self.num_clients, self.layout.size,
                 f", resumed from {resumed.path} (round {resumed.round})" if resumed else "")
        self._bound_inbox()
        return start_round, resumed

    def _bound_inbox(self) -> None:
        """From now on take only the kinds the server reads, each bounded by the model's size."""
        kinds, max_bytes, inbox_bytes = P.server_bounds(self.layout.size, self.num_clients)
        self.channel.expect(kinds, max_bytes, inbox_max_messages=16, inbox_max_bytes=inbox_bytes)

    def _load_checkpoint(self, held: dict[int, set[tuple[int, str]]]) -> ckpt_store.Checkpoint | None:
        folder = self.out_dir / "checkpoints"
        ckpt = self._newest_held(folder, held)
        if ckpt is None:
            found = ckpt_store.list_checkpoints(folder)
            if found:  # starting from round 0 would overwrite the run they belong to
                raise FederationError(f"--resume: none of the {len(found)} checkpoints in {folder} verifies (see above); "
                                      f"nothing was changed; move them away and rerun with --force to start over")
            if (self.out_dir / "summary.json").exists():
                raise FederationError(f"--resume: {self.out_dir} holds a finished run but no checkpoint to continue it "
                                      f"from; rerun with --force to start over, or choose another --out")
            log.warning("--resume: no checkpoint in %s yet; starting from round 0", folder)
            return None
        check_resume_compatible(ckpt.config, self.cfg, where=str(ckpt.path))
        header, arrays = ckpt.strategy
        self.strategy.load_state_dict((header, arrays))
        self.updates_accepted = int(ckpt.meta.get("updates_accepted", 0))
        self.influence.load_state(ckpt.meta.get("influence"))
        self.last_checkpoint = ckpt.path
        self.round = ckpt.round
        return ckpt

    def _newest_held(self, folder: Path, held: dict[int, set[tuple[int, str]]]) -> ckpt_store.Checkpoint | None:
        """The newest verified manifest whose every site shard its site holds intact.

        A manifest whose shard is gone or corrupt at some site is skipped (named in the log); if
        valid manifests exist but none is held by every site, the federation stops naming the site."""
        first_gap = None
        for path in ckpt_store.list_checkpoints(folder):
            try:
                ckpt = ckpt_store.load(path, self.file_auth)
            except ckpt_store.CheckpointError as exc:
                log.warning("skipping checkpoint: %s", exc)
                continue
            gaps = [(cid, ref) for cid, ref in sorted(ckpt.sites.items())
                    if (ckpt.round, ref["digest"]) not in held.get(cid, set())]
            if not gaps:
                return ckpt
            cid, ref = gaps[0]
            gap = f"client {cid} (rank {cid + 1}) does not hold its shard {ref['path']} intact"
            log.warning("skipping checkpoint %s: %s", path.name, gap)
            first_gap = first_gap or f"{gap} (checkpoint {path.name})"
        if first_gap:
            raise FederationError(f"--resume: no checkpoint is held intact by every site: {first_gap}; "
                                  f"restore that site's shards, or rerun with --force to start over")
        return None

    # -- synchronous rounds ----------------------------------------------------------------------
    def _sync_round(self, rnd: int) -> None:
        fed = self.cfg.federation
        self.round = rnd
        t0 = time.monotonic()
        want_state = self._checkpoint_due(rnd)
        self.strategy.begin_round(rnd)
        self.influence.begin_round(self.live)
        got: dict[int, tuple[Update, dict | None]] = {}
        refused: set[int] = set()  # answered, but out of range: counted as an answer, not aggregated
        self._collect_uploads(rnd, t0, want_state, got, refused)
        missing = sorted(self.live - set(got))
        if missing:
            needed = max(1, math.ceil(fed.quorum * len(self.live)))
            who = ", ".join(f"client {c} (rank {c + 1})" for c in missing)
            if len(got) < needed:
                raise FederationError(
                    f"round {rnd}: only {len(got)} of {len(self.live)} clients answered within "
                    f"{fed.round_deadline_s:g} s (quorum {needed}); silent: {who}; "
                    f"last checkpoint: {self.last_checkpoint or 'none'}")
            log.warning("round %d: straggler(s) past the %g s deadline, aggregated without them: %s",
                        rnd, fed.round_deadline_s, who)
            for c in missing:
                self.metrics.log(rnd, c, "straggler", 1)
        updates = [got[c][0] for c in sorted(got) if c not in refused]
        self.strategy.end_round(rnd)
        self.influence.settle()
        self.strategy.version += 1
        self.updates_accepted += len(updates)
        for upd in updates:
            self.metrics.log_many(rnd, upd.client_id, upd.metrics)
        self.metrics.log_many(rnd, None, {"round_time_s": time.monotonic() - t0, "num_updates": len(updates),
                                          **self.strategy.metrics()})
        if want_state:
            self._checkpoint(rnd, {c: got[c][1] for c in sorted(got)})  # phase 2: the manifest
        # Rounds are numbered from 0 everywhere (console, metrics.jsonl, checkpoints, report).
        self._progress.advance_to(rnd + 1)
        saved = f", saved {self.last_checkpoint.name}" if want_state and self.last_checkpoint else ""
        log.info("round %d of 0..%d done in %.2f s (%d updates)%s%s [%s]", rnd, self.cfg.rounds - 1,
                 time.monotonic() - t0, len(updates), _metric_brief(updates), saved, self._progress.describe())
        self._maybe_status()

    def _collect_uploads(self, rnd: int, t0: float, want_state: bool,
                         got: dict[int, tuple[Update, dict | None]], refused: set[int]) -> None:
        """Send round `rnd`'s models and take the uploads until all are in or the deadline passes."""
        fed = self.cfg.federation
        # The first round, with no history to bound it, bounds itself: uploads wait on disk, measured.
        self._parking = self._open_parking()

        def fold_early(msg: Any) -> bool:
            # An upload that completes while the server is still sending the round's models is
            # folded at once, inside the send, instead of waiting in the channel's inbox.
            if msg.kind != P.UPDATE:
                return False
            self._contained(msg.source, self._take_update, rnd, msg, got, want_state, refused)
            return True

        try:
            self.channel.on_message = fold_early
            try:
                for cid in sorted(self.live):
                    self._send_to(cid, P.PARAMS, {"round": rnd, "version": self.strategy.version,
                                                  "checkpoint": want_state},
                                  self._model_tensors(self.strategy.model_for(cid)))
            finally:
                self.channel.on_message = None
            deadline = t0 + fed.round_deadline_s
            while len(got) < len(self.live):
                msg = self._recv_until(deadline, {P.UPDATE, P.FAILED}, f"round {rnd}",
                                       waiting_for=self.live - set(got), fatal=False)
                if msg is None:
                    break
                self._contained(msg.source, self._take_update, rnd, msg, got, want_state, refused)
                msg = None
            if self._parking is not None:
                refused |= self._fold_parked({cid: got[cid][0] for cid in got}, self.strategy.fold)
        finally:
            if self._parking is not None:  # the round failed while parking: free the disk
                self._parking.close()
                self._parking = None

    def _take_update(self, rnd: int, msg: Any, got: dict[int, tuple[Update, dict | None]],
                     want_state: bool, refused: set[int]) -> None:
        """Validate one upload of round `rnd` and fold it into the strategy at once: a streaming
        strategy (FedAvg's mean) adds it to its running sum and drops it, so rank 0 never holds the
        K updates of a round together. (In a calibrating first round it is parked on disk instead.)"""
        if msg.header.get("round") != rnd:
            self._reject(msg.source, "stale update", f"for round {msg.header.get('round')!r} during round {rnd}")
            return
        if msg.source - 1 in got:
            self._reject(msg.source, "duplicate update", f"a second update for round {rnd}")
            return
        parsed = self._as_update(msg, allow_state=want_state)
        if parsed is not None and want_state and (parsed[1] is None or parsed[1]["round"] != rnd):
            self._reject(msg.source, "malformed header", f"UPDATE of checkpoint round {rnd} without a valid shard")
            return
        if parsed is None:
            return
        got[parsed[0].client_id] = parsed
        if self._parking is not None:
            if not self._park(msg.source, parsed[0]):
                refused.add(parsed[0].client_id)
        elif self._bounded(msg.source, parsed[0]):
            self.strategy.fold(parsed[0])
        else:
            refused.add(parsed[0].client_id)

    def _bounds_apply(self) -> bool:
        """Nothing to bound where no site's upload reaches another's model: local-only training,
        or a centralized baseline's one site."""
        return self.strategy.shares_updates and self.num_clients >= 2

    def _bounded(self, rank: int, upd: Update, distance: float | None = None) -> bool:
        """Apply bounded influence (`hpcfed.server.influence`) to one upload, in place; False when it
        is out of range (rejected and counted; the site is answered as usual)."""
        if not self._bounds_apply():
            return True
        if distance is None:  # a parked upload was weighed when it came
            upd.num_examples = self.influence.weight(upd.client_id, upd.num_examples)
        try:
            self.influence.bound(upd.client_id, upd.flat, self._reference(upd.client_id), distance)
        except Refused as exc:
            self._reject(rank, "update out of range", str(exc))
            return False
        return True

    def _reference(self, cid: int) -> np.ndarray | DiskArray:
        """What client `cid`'s upload is measured from: the model it was sent. In a synchronous
        round that is the strategy's model for it until the round ends; an asynchronous site's
        was kept on disk when it was answered, since the global model has moved on since."""
        sent = self._sent.view(cid) if self._sent is not None else None
        return sent if sent is not None else self.strategy.model_for(cid)

    def _open_parking(self) -> Parking | None:
        """Parking for uploads with no history to bound them (see `hpcfed.server.scratch`)."""
        if self._bounds_apply() and self.influence.calibrating:
            return Parking(self.out_dir / "scratch" / "parked")
        return None

    def _park(self, rank: int, upd: Update) -> bool:
        """No bounds yet: weigh and measure the upload now, bound and fold it once they are known
        (`_fold_parked`). False when it is refused already (counted, and answered as usual)."""
        upd.num_examples = self.influence.weight(upd.client_id, upd.num_examples)
        try:
            distance = self.influence.measure(upd.client_id, upd.flat, self._reference(upd.client_id))
        except Refused as exc:
            self._reject(rank, "update out of range", str(exc))
            return False
        self._parking.park(upd.client_id, upd.flat, distance)
        upd.flat = None
        return True

    def _fold_parked(self, updates: dict[int, Update], fold: Callable[[Update], Any]) -> set[int]:
        """The bounds' first sites are in: take the median of their distances as the typical one,
        then bound each parked upload by it and `fold` it, in client order (a resumed run folds as
        the uninterrupted one did). Returns the clients whose upload was refused."""
        parking, self._parking = self._parking, None
        refused: set[int] = set()
        try:
            self.influence.calibrate()
            for cid in parking.clients():
                upd = updates[cid]
                upd.flat, distance = parking.take_measured(cid)  # a disk fault is rank 0's own: it ends the run
                if not self._contained(cid + 1, self._fold_bounded, cid + 1, upd, distance, fold):
                    refused.add(cid)
        finally:
            parking.close()
        return refused

    def _fold_bounded(self, rank: int, upd: Update, distance: float, fold: Callable[[Update], Any]) -> bool:
        if not self._bounded(rank, upd, distance):
            return False
        fold(upd)
        return True

    def _contained(self, rank: int, handle: Any, *args: Any) -> Any:
        """Run `handle(*args)` for one message of the peer at `rank`: any fault in it rejects that
        message, counted against the peer, and never ends the federation (only the runtime's own
        verdicts do)."""
        try:
            return handle(*args)
        except FederationError:
            raise
        except Exception as exc:
            self._reject(rank, "unhandled input", f"{type(exc).__name__}: {_short(str(exc))}")
            return None

    def _checkpoint_due(self, rnd: int) -> bool:
        every = self.cfg.checkpoint_every
        if rnd == self.cfg.halt_after_round or self.halt_requested:
            return True
        return every > 0 and ((rnd + 1) % every == 0 or rnd == self.cfg.rounds - 1)

    # -- asynchronous loop ---------------------------------------------------------------------
    def _async_loop(self, resumed: ckpt_store.Checkpoint | None) -> bool:
        """Accept uploads until the budget is spent; True when it stopped early to halt (SIGUSR1, or
        `halt_after_round` = this many accepted updates) after a checkpoint."""
        fed = self.cfg.federation
        max_updates = fed.max_updates or self.cfg.rounds * self.num_clients
        self._progress = Progress(max_updates, self.updates_accepted, "accepted updates")
        try:
            last_seen = self._async_begin()
            while self.updates_accepted < max_updates:
                if not self.live:
                    raise FederationError(f"every client has failed; last checkpoint: {self.last_checkpoint or 'none'}")
                accepted = self._async_step(last_seen)
                for upd, targets in accepted:
                    self._accepted(upd, targets)
                if accepted and self._after_accepting(len(accepted), max_updates, last_seen):
                    return True
        finally:
            self._async_end()
        log.info("async: %d updates accepted, server version %d", self.updates_accepted, self.strategy.version)
        if self.cfg.checkpoint_every > 0:
            self._async_checkpoint(last_seen)
        return False

    def _async_begin(self) -> dict[int, float]:
        """Open the mailbox and the scratch disk, and send every site its first model; returns
        when each site was last heard from (now)."""
        self._outbox = ModelOutbox(self.channel, self._model_message)
        if self._bounds_apply() and self.cfg.influence.enabled:
            self._sent = Scratch(self.out_dir / "scratch" / "sent", "last model (what its upload is measured from)",
                                 "set influence.enabled=false")
        self.influence.begin_round(self.live)
        self._parking = self._open_parking()  # no history yet: the first uploads wait for min(3, K) sites
        for cid in sorted(self.live):
            self._outbox.owe(cid, answer=True)
        return {cid: time.monotonic() for cid in self.live}

    def _async_end(self) -> None:
        for scratch in (self._parking, self._sent):
            if scratch is not None:
                scratch.close()
        self._parking = self._sent = None

    def _async_step(self, last_seen: dict[int, float]) -> list[tuple[Update, set[int]]]:
        """Take the next message (or notice silence): the uploads it lets through, each with the
        clients to send the new model to."""
        # While a model is owed to a busy client, look back soon to post it once it is free.
        wait = _OWED_POLL_S if self._outbox.waiting() else min(1.0, self.cfg.federation.status_every_s)
        msg = self._deferred.popleft() if self._deferred else self.channel.recv(kinds={P.UPDATE, P.FAILED},
                                                                               timeout=wait)
        self._outbox.flush()
        if msg is not None and msg.kind == P.UPDATE:
            return self._contained(msg.source, self._async_update, msg, last_seen) or []
        if msg is None:
            self._check_silent(last_seen)
            self._maybe_status()
        else:
            self._client_failed(msg.source - 1, _error_text(msg.header))
        return self._release_parked(last_seen)  # a site gone may complete the parked quorum

    def _accepted(self, upd: Update, targets: set[int]) -> None:
        """Count one folded async upload, log it and answer it."""
        self.updates_accepted += 1
        self.round = self.updates_accepted
        self._progress.advance_to(self.updates_accepted)
        self.metrics.log_many(self.updates_accepted, upd.client_id, upd.metrics)
        self.metrics.log(self.updates_accepted, None, "broadcast", int(len(targets) > 1))
        for name, value in self.strategy.metrics().items():
            self.metrics.log(self.updates_accepted, None, name, value)
        for cid in sorted(targets & self.live):
            self._outbox.owe(cid, answer=cid == upd.client_id)

    def _after_accepting(self, count: int, max_updates: int, last_seen: dict[int, float]) -> bool:
        """`count` uploads were just accepted (several when parked ones are released together):
        checkpoint when one fell due among them; True to halt now."""
        done, before = self.updates_accepted, self.updates_accepted - count
        every = self.cfg.checkpoint_every * self.num_clients  # 0: no checkpoint but a halt's
        halt_at = self.cfg.halt_after_round
        halt = (self.halt_requested or (halt_at is not None and before < halt_at <= done)) and done < max_updates
        if halt or (every > 0 and done // every > before // every):
            self._async_checkpoint(last_seen)
        if not halt:
            self._maybe_status()
        return halt

    def _async_update(self, msg: Any, last_seen: dict[int, float]) -> list[tuple[Update, set[int]]]:
        """One async upload: the uploads it lets through (itself, or the parked ones it completes
        the quorum of), each with the clients to send the new model to."""
        cid = msg.source - 1
        base = msg.header.get("version")
        if cid not in self._requested or not _is_int(base) or base < self._requested[cid]:
            # not asked for, or a copy trained before our last answer: a flood gains nothing
            self._reject(msg.source, "unrequested update", "an upload the server did not ask for")
            return []
        parsed = self._as_update(msg, allow_state=False)
        if parsed is None:
            return []
        upd = parsed[0]
        del self._requested[cid]
        last_seen[cid] = time.monotonic()
        self.influence.begin_round(self.live)
        if self._parking is not None:
            if self._park(msg.source, upd):
                self._held[cid] = upd  # answered once the quorum is in: a fast site cannot fill it
            else:
                self._outbox.owe(cid, answer=True)
            return self._release_parked(last_seen)
        bounded = self._bounded(msg.source, upd)
        self.influence.settle()
        if not bounded:
            self._outbox.owe(cid, answer=True)  # answered all the same: the site goes on
            return []
        return [(upd, set(self.strategy.on_update(upd)) | {cid})]

    def _release_parked(self, last_seen: dict[int, float]) -> list[tuple[Update, set[int]]]:
        """Once min(3, K) live sites have an upload parked (each waits for its answer meanwhile,
        so no site can be more than one of them), bound them all by their median distance and fold
        them; the sites are answered from now on."""
        if self._parking is None or len(self._held) < min(self.influence.quorum, max(1, len(self.live))):
            return []
        held, self._held = self._held, {}
        released: list[tuple[Update, set[int]]] = []
        refused = self._fold_parked(held, lambda upd: released.append(
            (upd, set(self.strategy.on_update(upd)) | {upd.client_id})))
        self.influence.settle()
        now = time.monotonic()
        for cid in sorted(held):
            last_seen[cid] = now  # it waited on the server, not the other way round
            if cid in refused and cid in self.live:
                self._outbox.owe(cid, answer=True)
        return released

    def _model_message(self, cid: int, answer: bool) -> tuple[int, dict, dict]:
        flat = self.strategy.model_for(cid)
        if answer:
            self._requested[cid] = self.strategy.version
            if self._sent is not None:
                self._sent.put(cid, flat)  # its next upload is measured from this
        # answer=False marks a broadcast the client did not ask for: it replaces the client's model
        # but does not start a training step while the client's own upload is unanswered.
        return P.PARAMS, {"round": self.updates_accepted, "version": self.strategy.version,
                          "checkpoint": False, "answer": answer}, self._model_tensors(flat)

    def _check_silent(self, last_seen: dict[int, float]) -> None:
        limit = self.cfg.federation.round_deadline_s
        now = time.monotonic()
        for cid in sorted(self.live - set(self._held)):  # a parked site waits for the server
            if now - last_seen[cid] > limit:
                self._client_failed(cid, f"sent no update for {limit:g} s (federation.round_deadline_s)")

    def _client_failed(self, cid: int, why: str) -> None:
        text = f"client {cid} (rank {cid + 1}) {why}"
        if self.cfg.federation.on_client_failure == "continue" and self.cfg.federation.mode == "async":
            log.error("%s; continuing without it (federation.on_client_failure=continue)", text)
            self.live.discard(cid)
            if self._outbox is not None:
                self._outbox.forget(cid)
            self.metrics.log(self.round, cid, "client_failed", 1)
            return
        raise FederationError(f"{text}; last checkpoint: {self.last_checkpoint or 'none'}")

    # -- validation ------------------------------------------------------------------------------
    def _as_update(self, msg: Any, allow_state: bool) -> tuple[Update, dict | None] | None:
        """Check an UPDATE against the model layout; return it, or count and log a rejection."""
        if msg.kind == P.FAILED:
            self._client_failed(msg.source - 1, f"failed: {_error_text(msg.header)}")
            return None
        cid = msg.source - 1
        if cid not in self.live:
            self._reject(msg.source, "not a member", "update from a client that is not part of the federation")
            return None
        h, tensors = msg.header, msg.tensors
        keys = {P.params_key(name) for name in self.layout.groups}
        unknown = [k for k in tensors if k not in keys]  # site state never crosses the wire
        if unknown:
            self._reject(msg.source, "unknown tensor name", f"{unknown[:3]}")
            return None
        groups = P.params_groups(tensors, self.layout.groups)
        wrong = self.layout.check_packed(groups)
        if wrong:  # e.g. bf16 where the layout says float32, or a truncated buffer
            self._reject(msg.source, "wrong dtype or shape", f"parameters: {wrong}")
            return None
        if not self.layout.packed_finite(groups):
            self._reject(msg.source, "non-finite parameters", "parameters contain NaN or Inf")
            return None
        flat = self.layout.unpack_flat(groups)
        num = h.get("num_examples")
        metrics = h.get("metrics", {})
        if not _is_int(num) or num < 0 or not _metrics_ok(metrics):
            self._reject(msg.source, "malformed header", "UPDATE num_examples/metrics")
            return None
        upd = Update(client_id=cid, flat=flat, num_examples=int(num),
                     base_version=int(h.get("version", 0)) if _is_int(h.get("version", 0)) else 0,
                     client_version=int(h.get("client_version", 0)) if _is_int(h.get("client_version", 0)) else 0,
                     metrics={k: (float(v) if v is not None else math.nan) for k, v in metrics.items()})
        return upd, _shard_ref(h.get("shard")) if allow_state else None

    def _model_tensors(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The float32 model as the wire carries it: one buffer per dtype group, in each parameter's dtype."""
        return P.params_tensors(self.layout.pack_flat(flat))

    def _reject(self, rank: int, category: str, detail: str) -> None:
        """Count a rejected message under a fixed category; the detail goes to the log only."""
        self.rejected[category] = self.rejected.get(category, 0) + 1
        self.rejected_by_rank[rank] = self.rejected_by_rank.get(rank, 0) + 1
        log.warning("rejected message from rank %d: %s: %s", rank, category, detail)
        limit = self.cfg.security.max_rejects
        if self.rejected_by_rank[rank] == limit + 1 and rank - 1 in self.live:
            self._client_failed(rank - 1, f"was cut off after {limit} rejected messages (security.max_rejects)")

    # -- sending and waiting -------------------------------------------------------------------------
    def _send_to(self, cid: int, kind: int, header: dict, tensors: dict | None = None) -> None:
        """Send to a client; one that takes nothing within the deadline has failed (hung or dead)."""
        from hpcfed.comm.channel import ChannelError

        try:
            self.channel.send(cid + 1, kind, header, tensors)
        except ChannelError as exc:
            self._client_failed(cid, f"did not take a {P.NAMES.get(kind, kind)} message within the deadline ({exc})")

    def _stop_all(self, reason: str) -> None:
        """Best effort: tell every client to leave (a dead one cannot hear it; its timeout ends it)."""
        from hpcfed.comm.channel import ChannelError

        for cid in range(self.num_clients):
            try:
                self.channel.send(cid + 1, P.STOP, {"reason": reason})
            except ChannelError as exc:
                log.warning("could not tell client %d (rank %d) to stop: %s", cid, cid + 1, exc)

    def _recv_until(self, deadline: float, kinds: set[int], what: str, waiting_for: set[int],
                    fatal: bool = True) -> Any:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not fatal:
                    return None
                who = ", ".join(f"client {c} (rank {c + 1})" for c in sorted(waiting_for))
                raise FederationError(f"no answer during {what} from {who}; "
                                      f"last checkpoint: {self.last_checkpoint or 'none'}")
            msg = self.channel.recv(kinds=kinds, timeout=min(remaining, 1.0))
            if msg is None:
                self._maybe_status()
                continue
            if msg.kind == P.FAILED:
                self._client_failed(msg.source - 1, f"failed: {_error_text(msg.header)}")
                continue
            return msg

    # -- checkpoints, status, finish ---------------------------------------------------------------
    def _checkpoint(self, rnd: int, sites: dict[int, dict | None]) -> None:
        """Phase 2: every site has written its shard and sent its digest; commit the manifest.
        Until this file is renamed into place the checkpoint does not exist."""
        if os.environ.get("HPCFED_FAULT_KILL_BEFORE_MANIFEST") == str(rnd):
            log.error("fault injection: killing rank 0 after the sites wrote round %d, before the manifest", rnd)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        meta = {"elapsed": self.metrics.elapsed(), "updates_accepted": self.updates_accepted,
                "rejected": self.rejected, "influence": self.influence.state()}
        refs = {cid: {"digest": ref["digest"], "path": ref["path"]} for cid, ref in sites.items() if ref}
        header, arrays = self.strategy.state_dict()
        ck = ckpt_store.Checkpoint(round=rnd, version=self.strategy.version, config=self.cfg.to_dict(),
                                   strategy=(header, arrays), sites=refs, meta=meta)
        self.last_checkpoint = ckpt_store.save(self.out_dir / "checkpoints", ck, keep=self.cfg.keep_checkpoints,
                                               auth=self.file_auth)
        self.metrics.log(rnd, None, "checkpoint", str(self.last_checkpoint.name))

    def _async_checkpoint(self, last_seen: dict[int, float]) -> None:
        """Async: the consistent point is this moment of the server (its state after the uploads
        accepted so far) and each site's state when it handles CHECKPOINT, i.e. after its last
        finished training step; uploads arriving meanwhile are held (one per site: the one it was
        asked for; any other is refused at once, so a flood cannot fill the site's inbox and crowd
        out its own answer) and handled after the manifest. At most one in-flight step per site is
        replayed on resume."""
        rnd = self.updates_accepted
        for cid in sorted(self.live):
            self._send_to(cid, P.CHECKPOINT, {"round": rnd})
        sites: dict[int, dict | None] = {}
        deadline = time.monotonic() + self.cfg.federation.round_deadline_s
        while len(sites) < len(self.live):
            msg = self._recv_until(deadline, {P.CHECKPOINT_DONE, P.FAILED, P.UPDATE}, f"checkpoint {rnd}",
                                   waiting_for=self.live - set(sites), fatal=False)
            if msg is not None and msg.kind == P.UPDATE:
                if msg.source - 1 in self._requested and all(m.source != msg.source for m in self._deferred):
                    self._deferred.append(msg)
                else:
                    self._reject(msg.source, "unrequested update", "an upload the server did not ask for")
                continue
            if msg is None:  # a silent site has failed (dropped with on_client_failure=continue)
                for cid in sorted(self.live - set(sites)):
                    self._client_failed(cid, f"wrote no checkpoint shard within {self.cfg.federation.round_deadline_s:g} s")
                break
            cid = msg.source - 1
            ref = _shard_ref(msg.header)
            if cid not in self.live or ref is None or ref["round"] != rnd:
                self._reject(msg.source, "malformed header", f"CHECKPOINT_DONE for checkpoint {rnd}")
                continue
            sites[cid] = ref
            last_seen[cid] = time.monotonic()
        self._checkpoint(rnd, sites)

    def _maybe_status(self) -> None:
        now = time.monotonic()
        every = self.cfg.federation.status_every_s
        if now - self._last_status < every:
            return
        stats = self.channel.stats
        dt = now - self._last_status
        self._last_status = now
        rejected = sum(self.rejected.values()) + sum(stats.rejected.values())
        where = self._progress.describe() if self._progress else "setting up"
        log.info("status: %s, version %d, %.1f msg/s, %.2f MB/s in, rejected %d; %s", where, self.strategy.version,
                 (stats.messages_received - getattr(self, "_last_msgs", 0)) / dt,
                 (stats.bytes_received - getattr(self, "_last_bytes", 0)) / dt / 1e6, rejected,
                 cost_brief(rank_cost(stats)))
        self._last_msgs, self._last_bytes = stats.messages_received, stats.bytes_received

    def request_halt(self) -> None:
        """Finish the current sync round (async: the update being handled), checkpoint, and stop (Slurm pre-emption)."""
        self.halt_requested = True
        log.warning("halt requested: the federation stops after this round's checkpoint; resume with --resume")

    def _halt(self, rnd: int) -> dict[str, Any]:
        """Stop every rank cleanly after round `rnd` (halt_after_round); resume with --resume."""
        self._stop_all(f"halted after round {rnd}")
        log.info("halted after round %d as configured (halt_after_round); checkpoint %s", rnd, self.last_checkpoint)
        self.metrics.close()
        return {"halted_after_round": rnd, "last_checkpoint": str(self.last_checkpoint)}

    def _finish(self) -> dict[str, Any]:
        fed = self.cfg.federation
        if self._outbox is not None:
            self._outbox.forget()  # FINAL supersedes every model still owed
        for cid in sorted(self.live):
            self._send_to(cid, P.FINAL, {"round": self.round, "version": self.strategy.version},
                          self._model_tensors(self.strategy.final_model_for(cid)))
        results: dict[int, dict[str, float]] = {}
        deadline = time.monotonic() + fed.round_deadline_s
        while len(results) < len(self.live):
            msg = self._recv_until(deadline, {P.RESULT, P.UPDATE, P.FAILED}, "the final evaluation",
                                   waiting_for=self.live - set(results), fatal=not results)
            if msg is None:  # a straggler missed the final deadline: report it, keep the others' results
                late = sorted(self.live - set(results))
                log.warning("final evaluation: no result within %g s from %s", fed.round_deadline_s,
                            ", ".join(f"client {c} (rank {c + 1})" for c in late))
                self.missing_results = late
                break
            if msg.kind == P.UPDATE:
                continue  # an async client's last upload, overtaken by the stop
            metrics = msg.header.get("metrics", {})
            if msg.source - 1 not in self.live:
                self._reject(msg.source, "not a member", "RESULT from a client that is not part of the federation")
                continue
            if not _metrics_ok(metrics):
                self._reject(msg.source, "malformed header", f"RESULT metrics are not at most {MAX_METRICS} named numbers")
                continue
            cost = parse_cost(msg.header["cost"]) if "cost" in msg.header else None
            if "cost" in msg.header and cost is None:
                self._reject(msg.source, "malformed header", "RESULT cost is not bounded counters and seconds")
                continue
            results[msg.source - 1] = {k: float(v) for k, v in metrics.items() if _is_number(v)}
            self.client_costs[msg.source - 1] = cost
        for cid in sorted(results):
            self.metrics.log_many(self.round, cid, {f"final_{k}": v for k, v in results[cid].items()})
        self._stop_all("done")
        summary = self._summary(results)
        atomic.write_text(self.out_dir / "summary.json", json.dumps(summary, indent=2, default=str))
        self.metrics.close()
        return summary

    def _summary(self, results: dict[int, dict[str, float]]) -> dict[str, Any]:
        names = sorted({k for r in results.values() for k in r})
        mean = {}
        for k in names:
            vals = [r[k] for r in results.values() if k in r and math.isfinite(r[k])]
            mean[k] = float(np.mean(vals)) if vals else None
        return {
            **mean,
            "mean": mean,
            "clients": {str(c): results[c] for c in sorted(results)},
            "missing_clients": self.missing_results,
            "dropped_clients": sorted(set(range(self.num_clients)) - self.live),
            "rounds": self.cfg.rounds,
            "updates_accepted": self.updates_accepted,
            "server_version": self.strategy.version,
            "wall_time_s": self.metrics.elapsed(),
            "server_cpu_s": time.process_time() - self._cpu0,
            # per rank ("0" is the server): peak RSS, channel bytes, seconds in AES-GCM; null for a
            # client whose RESULT carried none
            "cost": {"0": rank_cost(self.channel.stats),
                     **{str(c + 1): self.client_costs.get(c) for c in range(self.num_clients)}},
            "rejected": {"runtime": self.rejected, "channel": dict(self.channel.stats.rejected)},
            "clipped_updates": self.influence.clipped,
            "channel": self.channel.stats.as_dict(),  # the server's traffic: bytes per run, per round
            "last_checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
            "config": self.cfg.to_dict(),
            "config_hash": self.cfg.hash(),
        }


def _shard_ref(value: Any) -> dict[str, Any] | None:
    """A site's report of the shard it wrote: {round, digest (64 hex), path}, or None if malformed."""
    if not isinstance(value, dict):
        return None
    rnd, digest, path = value.get("round"), value.get("digest"), value.get("path")
    if not _is_int(rnd) or rnd < 0 or not isinstance(digest, str) or len(digest) != 64 \
            or any(c not in "0123456789abcdef" for c in digest) or not isinstance(path, str) or len(path) > 4096:
        return None
    return {"round": rnd, "digest": digest, "path": path}


def _held_shards(value: Any) -> set[tuple[int, str]]:
    """A site's --resume report [[round, digest], ...], bounded; anything malformed counts as not held."""
    if not isinstance(value, list):
        return set()
    out = set()
    for item in value[:64]:
        if isinstance(item, list) and len(item) == 2:
            ref = _shard_ref({"round": item[0], "digest": item[1], "path": ""})
            if ref:
                out.add((ref["round"], ref["digest"]))
    return out


# A client's header values are bounded before any arithmetic: a JSON integer such as 10**400 would
# otherwise raise OverflowError in float() and end the server. 2**53 is the largest exactly-representable
# integer in a float64, far above any legitimate count, version or round.
HEADER_INT_MAX = 2**53
MAX_METRICS = 64


def _error_text(header: dict) -> str:
    """A FAILED message's error, as at most 500 characters of text (it goes into logs and summary.json)."""
    error = header.get("error")
    return " ".join(error[:500].split()) if isinstance(error, str) else "unknown error"


_MAX_NAME = 128


def _metrics_ok(metrics: Any) -> bool:
    """At most `MAX_METRICS` short names, each a number (the wire bounds it: int64, finite) or null."""
    return isinstance(metrics, dict) and len(metrics) <= MAX_METRICS and all(
        isinstance(k, str) and len(k) <= _MAX_NAME and (_is_number(v) or v is None) for k, v in metrics.items())


def _short(text: str, limit: int = 300) -> str:
    """A peer's text as it may appear in our logs and errors: one line, bounded."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -HEADER_INT_MAX <= v <= HEADER_INT_MAX


def _is_number(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return _is_int(v)


def _metric_brief(updates: list[Update]) -> str:
    """The first two headline metrics the clients reported with this round's updates (``val_*``:
    on each site's validation split; ``loss``: training loss)."""
    names = [n for n in ("loss", "accuracy", "val_accuracy", "micro_f1", "nmi") if all(n in u.metrics for u in updates)]
    return "".join(f", mean {n} {np.mean([u.metrics[n] for u in updates]):.4f}" for n in names[:2])
