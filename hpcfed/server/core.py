"""What every stage of the server shares: send, receive, reject, bound, checkpoint.

`ServerCore` holds the channel, the run's config and strategy, the metrics log, the rejection
counters and the checkpoint manifests. The stages (`hpcfed.server.setup`, `.sync_rounds`,
`.async_loop`, `.summary`) are given it and keep their own state; nothing here knows whether the
rounds are synchronous, except that only an asynchronous federation may go on without a site.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, overload

import numpy as np

from hpcfed import protocol as P
from hpcfed.comm.api import Channel, ChannelError, Message, Outgoing
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.params import ParamLayout
from hpcfed.server import validation as V
from hpcfed.server.config import ServerConfig
from hpcfed.server.departures import Departures
from hpcfed.server.eviction import ChannelRefusals, Eviction, Ledger
from hpcfed.server.influence import InfluenceGuard
from hpcfed.server.live import LiveFile
from hpcfed.server.metrics import MetricsLog
from hpcfed.server.participation import Participation
from hpcfed.server.progress import Progress, StatusLine
from hpcfed.server.roster import Roster
from hpcfed.site_layout import SiteLayout
from hpcfed.store import checkpoint as ckpt_store
from hpcfed.store.rank_records import HALT_FILE
from hpcfed.store.sealed import FileAuth
from hpcfed.strategies.base import Strategy, Update
from hpcfed.tasks.base import Task

log = logging.getLogger("hpcfed.server")

_Args = ParamSpec("_Args")
_R = TypeVar("_R")


class ServerCore:
    """Rank 0's link to its sites and the state every stage of the federation reads."""

    def __init__(self, config: ServerConfig, channel: Channel, out_dir: Path, strategy: Strategy,
                 task_cls: type[Task], task_config: Any, keys: RankKeys) -> None:
        self.config, self.channel, self.out_dir, self.strategy = config, channel, out_dir, strategy
        self.task_cls, self.task_config = task_cls, task_config  # what the setup exchange runs
        self.num_clients = channel.size - 1
        self.influence = InfluenceGuard(config.influence, self.num_clients)
        self.rejected: dict[str, int] = {}  # category -> messages
        self.rejected_by_rank: dict[int, int] = {}
        self.rejects_before: dict[int, int] = {}  # rank -> its rejections before it last came back (a new job)
        self.updates_accepted = 0
        self.lost_rounds: list[int] = []  # secure aggregation rounds whose sum could not be unmasked
        self.round = -1
        self.last_checkpoint: Path | None = None
        self._halt = False  # checkpoint after this round and stop: SIGUSR2 (see launcher) or OUT/HALT
        self._halt_checked = 0.0
        # sites that ended mid-run, and their last shards; a send waiting on one that ended fails at once
        self.departures = Departures(out_dir / "logs", self.num_clients, channel.peer_gone,
                                     SiteLayout.of(config.roster.ranks_per_site, self.num_clients))
        channel.watch_peers(self.departures.probe)
        self.progress: Progress | None = None  # rounds (sync) or accepted updates (async), once they start
        self.status = StatusLine(config.deadlines.status_every_s)
        self.live_file = LiveFile(out_dir)  # OUT/live.json, what `hpcfed status OUT` shows
        self.cpu0 = time.process_time()
        self.loop_cpu_s: float | None = None  # CPU seconds of the rounds or buffers (summary.json's cost)
        self.on_drop: Callable[[int], None] | None = None  # told of a site the federation goes on without
        # What lets sites not there at the start (`hpcfed serve`) in later (`.joining`).
        self.joiners: Callable[[], dict[int, float]] | None = None  # client id -> when its knock came
        self.knocked_at: dict[int, float] = {}  # a site connected, until its setup is done
        self.setup_reply: tuple[dict[str, Any], dict[str, np.ndarray]] = ({}, {})  # a late site's
        # Checkpoints are tagged with a key derived from the job's credentials, never kept in out_dir.
        self.keys = keys
        self.file_auth: FileAuth = keys.file_auth("checkpoint")
        self._layout: ParamLayout | None = None
        self._metrics: MetricsLog | None = None
        # Misbehaviour: the evidence against each site and who is out (`hpcfed.server.eviction`).
        self.ledger = Ledger(config.security.on_misbehaviour, config.security.max_refused_updates)
        # Membership: who is present, late, dropped, evicted or excluded (`hpcfed.server.roster`).
        self.roster = Roster(self.num_clients, self.ledger, self.departures)
        self.channel_refusals = ChannelRefusals()
        channel.on_reject = self.channel_refusals

    # -- membership (`hpcfed.server.roster` changes it; these only read) ---------------------------
    @property
    def live(self) -> frozenset[int]:
        """The present sites."""
        return self.roster.live

    @property
    def absent(self) -> frozenset[int]:
        """The sites not there at the start (`hpcfed serve`) that have not joined yet."""
        return self.roster.late

    @property
    def participation(self) -> Participation:
        """Who the model was built from, who was late."""
        return self.roster.participation

    # -- halting -------------------------------------------------------------------------------------
    @property
    def halt_requested(self) -> bool:
        """Whether to checkpoint after this round (async: this update) and stop: SIGUSR2, or a file
        named HALT in the run's folder (taken away here, so that the resumed run goes on)."""
        now = time.monotonic()
        if not self._halt and now - self._halt_checked >= _HALT_FILE_POLL_S:
            self._halt_checked = now
            path = self.out_dir / HALT_FILE
            try:
                path.unlink()
            except OSError:
                return False  # none there (or not ours to take): no request
            self.request_halt(f"{path} found")
        return self._halt

    def request_halt(self, why: str) -> None:
        """Halt after this round's checkpoint (signal-safe: it only sets a flag and logs)."""
        self._halt = True
        log.warning("halt requested (%s): the federation stops after this round's checkpoint; resume with "
                    "--resume", why)

    # -- after the setup exchange ------------------------------------------------------------------
    def start(self, layout: ParamLayout, metrics: MetricsLog) -> None:
        """The model's layout is known: from now on take only the kinds the server reads, each
        bounded by the model's size."""
        self._layout, self._metrics = layout, metrics
        self._expect()

    def refresh_expect(self) -> None:
        """Take the kinds the server reads from every site not evicted, and nothing from the others."""
        self._expect()

    def _expect(self) -> None:
        """Take the kinds the server reads from every site not evicted, and nothing from the others."""
        kinds, max_bytes, inbox_bytes = P.server_bounds(self.layout.size, self.num_clients, self.ledger.evicted)
        for cid in self.roster.awaiting_setup:  # a site that may still (re)join sends its SETUP first
            kinds[cid + 1] = kinds[cid + 1] | {P.SETUP}
        self.channel.expect(kinds, max_bytes, inbox_max_messages=16, inbox_max_bytes=inbox_bytes)

    @property
    def started(self) -> bool:
        """Whether the setup exchange is over (the sites are in, a resumed checkpoint is loaded)."""
        return self._layout is not None

    @property
    def layout(self) -> ParamLayout:
        """The model's layout (set by `start`, at the end of the setup exchange)."""
        if self._layout is None:
            raise RuntimeError("the model's layout is known only after the setup exchange")
        return self._layout

    @property
    def metrics(self) -> MetricsLog:
        """metrics.jsonl (opened by `start`, at the end of the setup exchange)."""
        if self._metrics is None:
            raise RuntimeError("metrics.jsonl is opened only after the setup exchange")
        return self._metrics

    # -- sending -------------------------------------------------------------------------------------
    def send_to(self, cid: int, kind: int, header: dict[str, Any],
                tensors: dict[str, np.ndarray] | None = None) -> None:
        """Send to a client; one that takes nothing within the deadline has failed (hung or dead).
        An evicted client is sent nothing more."""
        if cid in self.ledger.evicted:
            return
        try:
            self.channel.send(cid + 1, kind, header, tensors)
        except ChannelError as exc:
            ended = self.departures.cause_of_silence(cid)  # a rank that ended is not merely slow
            self.client_failed(cid, ended or f"did not take a {P.NAMES.get(kind, kind)} message within the deadline "
                                             f"({exc})")

    def post_to(self, cid: int, kind: int, header: dict[str, Any],
                tensors: dict[str, np.ndarray] | None = None) -> Outgoing | None:
        """Post to a client without waiting for it to take the message (None: it has failed)."""
        if cid in self.ledger.evicted:
            return None
        try:
            return self.channel.post(cid + 1, kind, header, tensors)
        except ChannelError as exc:
            self.client_failed(cid, f"cannot be sent a {P.NAMES.get(kind, kind)} message ({exc})")
            return None

    def model_tensors(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The float32 model as the wire carries it: one buffer per dtype group, in each parameter's dtype."""
        tensors: dict[str, np.ndarray] = P.params_tensors(self.layout.pack_flat(flat))
        return tensors

    def stop_all(self, reason: str) -> None:
        """Best effort: tell every client to leave (a dead one cannot hear it; its timeout ends it)."""
        for cid in range(self.num_clients):
            if self.roster.gone(cid):
                continue  # told already, gone, or never there
            try:
                self.channel.send(cid + 1, P.STOP, {"reason": reason})
            except ChannelError as exc:
                log.warning("could not tell client %d (rank %d) to stop: %s", cid, cid + 1, exc)

    # -- receiving -----------------------------------------------------------------------------------
    @overload
    def recv_until(self, deadline: float, kinds: set[int], what: str, waiting_for: AbstractSet[int]) -> Message: ...

    @overload
    def recv_until(self, deadline: float, kinds: set[int], what: str, waiting_for: AbstractSet[int],
                   fatal: bool) -> Message | None: ...

    def recv_until(self, deadline: float, kinds: set[int], what: str, waiting_for: AbstractSet[int],
                   fatal: bool = True) -> Message | None:
        """The next message of `kinds` before `deadline` (a FAILED one is handled here); past it,
        None, or with `fatal` a `FederationError` naming the clients `waiting_for`."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if not fatal:
                    return None
                who = ", ".join(f"client {c} (rank {c + 1})" for c in sorted(waiting_for))
                raise FederationError(f"no answer during {what} from {who}; "
                                      f"last checkpoint: {self.last_checkpoint or 'none'}")
            msg = self.channel.recv(kinds=kinds, timeout=min(remaining, 1.0))
            self.take_channel_evidence()
            self.check_departures()
            if not fatal and not waiting_for & self.live:
                return msg  # every site still waited for has been evicted: nothing more to wait for
            if msg is None:
                self.maybe_status()
                continue
            if msg.kind == P.FAILED:
                self.client_failed(msg.source - 1, f"failed: {V.error_text(msg.header)}")
                continue
            return msg

    def parse_update(self, msg: Message, allow_state: bool) -> tuple[Update, V.ShardRef | None] | None:
        """Check an UPDATE from a member against the model layout; return it, or count and log a rejection."""
        if msg.source - 1 not in self.live:
            self.reject(msg.source, "not a member", "update from a client that is not part of the federation")
            return None
        parsed = V.parse_update(msg.source - 1, msg.header, msg.tensors, self.layout, allow_state)
        if isinstance(parsed, V.Rejection):
            self.reject(msg.source, parsed.category, parsed.detail)
            return None
        return parsed

    # -- refusing ------------------------------------------------------------------------------------
    def reject(self, rank: int, category: str, detail: str, evidence: bool = True) -> None:
        """Count a rejected message under a fixed category; the detail goes to the log only. With
        `evidence` False it is not held against the site (an upload refused by bounded influence
        with no accepted upload of the site's own to judge it against)."""
        self.rejected[category] = self.rejected.get(category, 0) + 1
        self.rejected_by_rank[rank] = self.rejected_by_rank.get(rank, 0) + 1
        log.warning("rejected message from rank %d: %s: %s", rank, category, detail)
        if evidence:
            self.misbehaved(rank - 1, category, detail)
        limit = self.config.security.max_rejects
        # counted per job of the site: a site that came back starts from zero (its old job's stale messages)
        if self.rejected_by_rank[rank] - self.rejects_before.get(rank, 0) == limit + 1 and rank - 1 in self.live:
            self.client_failed(rank - 1, f"was cut off after {limit} rejected messages (security.max_rejects)")

    # -- misbehaviour ------------------------------------------------------------------------------------
    def misbehaved(self, cid: int, category: str, detail: str) -> None:
        """Hold a rejected message against its site: evict it (or abort) once the evidence is enough."""
        if self._metrics is None or cid not in self.live:
            return  # before the sites are known, or a site already out: only counted
        eviction = self.ledger.note(cid, category, detail, max(self.round, 0))
        if eviction is None:
            return
        if self.ledger.policy == "abort":
            raise FederationError(f"client {cid} (rank {cid + 1}) misbehaved: {eviction.reason}; first evidence: "
                                  f"{eviction.first_evidence} (security.on_misbehaviour=abort); "
                                  f"last checkpoint: {self.last_checkpoint or 'none'}")
        self.evict(eviction)

    def take_channel_evidence(self) -> None:
        """Hold the authenticated bundles the channel refused (logged as it received) against their sites."""
        for rank, category, detail in self.channel_refusals.take():
            if 1 <= rank <= self.num_clients:
                self.misbehaved(rank - 1, category, detail)

    def evict(self, eviction: Eviction) -> None:
        """Tell the site in one final message, take nothing more from it (the channel drops and counts
        what it sends, unread), and go on without it, unless that leaves fewer than min_sites."""
        cid = eviction.client
        self.roster.evict(eviction)
        log.warning("evicted client %d (rank %d): %s", cid, cid + 1, eviction.reason)
        self.influence.forget(cid)  # its steps no longer set the typical one
        self.strategy.forget(cid)  # nor its records the model (FedDWA's S_W)
        self._expect()
        try:
            self.channel.post(cid + 1, P.EVICTED, {"reason": eviction.reason})
        except ChannelError as exc:
            log.warning("could not tell client %d (rank %d) it is evicted: %s", cid, cid + 1, exc)
        if self.on_drop is not None:
            self.on_drop(cid)
        self.metrics.log(self.round, cid, "evicted", 1)
        floor = self.config.roster.min_sites
        if len(self.live) < floor:
            raise BelowFloor(f"only {len(self.live)} site(s) left after evicting client {cid} (rank {cid + 1}), "
                             f"fewer than federation.min_sites={floor}: the federation stops; continue it with "
                             f"--resume once the sites are fixed; last checkpoint: {self.last_checkpoint or 'none'}")

    def contained(self, rank: int, handle: Callable[_Args, _R], *args: _Args.args, **kwargs: _Args.kwargs) -> _R | None:
        """Run `handle(*args)` for one message of the peer at `rank`: any fault in it rejects that
        message, counted against the peer, and never ends the federation (only the runtime's own
        verdicts do)."""
        try:
            return handle(*args, **kwargs)
        except FederationError:
            raise
        except Exception as exc:
            self.reject(rank, "unhandled input", f"{type(exc).__name__}: {V.short(str(exc))}")
            return None

    def client_failed(self, cid: int, why: str) -> None:
        """Client `cid` failed: go on without it where the federation may, else end it naming the client."""
        text = f"client {cid} (rank {cid + 1}) {why}"
        if self.config.roster.on_client_failure != "continue":
            raise FederationError(f"{text}; last checkpoint: {self.last_checkpoint or 'none'}")
        if cid not in self.live:
            return  # dropped or evicted already
        self.channel.peer_gone(cid + 1)  # sent nothing more, whatever state it is in
        log.error("%s; continuing without it (federation.on_client_failure=continue)", text)
        self.roster.drop(cid, max(self.round, 0) if self._metrics is not None else -1, why)  # -1: during setup
        if self.on_drop is not None:
            self.on_drop(cid)
        if self._metrics is not None:
            self.metrics.log(self.round, cid, "client_failed", 1)
        floor = self.config.roster.min_sites
        if len(self.live) < floor and self.joiners is not None:
            log.warning("only %d site(s) left, fewer than federation.min_sites=%d: the federation waits for sites "
                        "to rejoin (hpcfed serve)", len(self.live), floor)
        elif len(self.live) < floor:
            raise BelowFloor(f"only {len(self.live)} site(s) left after client {cid} (rank {cid + 1}) {why}, fewer "
                             f"than federation.min_sites={floor}: the federation stops; continue it with --resume; "
                             f"last checkpoint: {self.last_checkpoint or 'none'}")

    def peer_ended(self) -> None:
        """A rank of the job has ended (SIGUSR1 from hydra): see which at the next chance (signal-safe)."""
        self.departures.notify()

    def check_departures(self) -> None:
        """Drop every live site that has ended since the last SIGUSR1."""
        for cid, cause in self.departures.ended(self.live).items():
            self.client_failed(cid, cause)

    # -- checkpoints and status ------------------------------------------------------------------------
    def commit_checkpoint(self, rnd: int, sites: dict[int, V.ShardRef | None]) -> None:
        """Phase 2: every site has written its shard and sent its digest; commit the manifest.
        Until this file is renamed into place the checkpoint does not exist."""
        if os.environ.get("HPCFED_FAULT_KILL_BEFORE_MANIFEST") == str(rnd):
            log.error("fault injection: killing rank 0 after the sites wrote round %d, before the manifest", rnd)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)
        meta = {"elapsed": self.metrics.elapsed(), "updates_accepted": self.updates_accepted,
                "rejected": self.rejected, "influence": self.influence.state(), "evicted": self.ledger.state(),
                "participation": self.participation.state(), "lost_rounds": list(self.lost_rounds)}
        refs = self.departures.manifest(rnd, {cid: dict(ref) for cid, ref in sites.items() if ref})
        ck = ckpt_store.Checkpoint(round=rnd, version=self.strategy.version, config=self.config.run.recorded,
                                   strategy=self.strategy.state_dict(), sites=refs, meta=meta)
        self.last_checkpoint = ckpt_store.save(self.out_dir / "checkpoints", ck, keep=self.config.checkpoints.keep,
                                               auth=self.file_auth)
        self.metrics.log(rnd, None, "checkpoint", str(self.last_checkpoint.name))

    def maybe_status(self) -> None:
        """The periodic status line, when it is due."""
        self.status.maybe_log(self.progress, self.strategy.version, sum(self.rejected.values()), self.channel.stats)
        self.live_file.maybe_write(self)


_HALT_FILE_POLL_S = 1.0


class BelowFloor(FederationError):
    """Evictions left fewer sites than `federation.min_sites`: the run stops cleanly, checkpoint kept."""
