"""Secure aggregation in a synchronous round, rank 0's side: SecAgg (Bonawitz et al., CCS 2017) with
SecAgg+ neighbourhoods (Bell et al., CCS 2020), driven over the channel. The protocol's state
machines are `hpcfed.privacy.secagg`, its wire forms `hpcfed.privacy.secagg_wire`.

```
rank 0                                                        site k
  |-- PARAMS (round r, model; secagg_prepared) ------------------>|
  |<-------------------------- SA_ADVERT (c, s public keys; signed for round r in keys mode)    } not when
  |-- SA_KEYS (its neighbours' adverts, relayed) ---------------->|  checks the signatures   } set up
  |<-------------------------- SA_SHARES (Shamir shares of b_k and s_k, sealed to each neighbour) } ahead
  |-- SA_SHARES_FOR (the shares sealed to k) -------------------->|  fit, clip, fixed point, mask
  |<-------------------------- SA_MASKED (y_k mod 2^32; metrics, shard; next_advert: round r+1's keys)
  |-- SA_CHECK (survivors: the sites whose y is summed) --------->|
  |<-------------------------- SA_SIGNED (its signature over (round, survivors); null in psk mode)
  |-- SA_UNMASK (alive = survivors; dropped: shared, sent no y; its neighbours' signatures;
  |              next_adverts) ---------------------------------->|  >= t neighbours signed this set?
  |<-------------------------- SA_REVEAL (per neighbour: a seed share or a key share, never both;
  |                                       next_to + shares: round r+1's, sealed to its neighbours)
  |   Σ y - masks = Σ_k w_k·δ_k and Σ n_k of the alive sites: all rank 0 learns of the round
```
Round r+1 is set up ahead, with round r's messages, when every live site sent its masked input and
its next keys and shares (`hpcfed.privacy.secagg`, "Keys set up a round ahead", says why this keeps
SecAgg's guarantees): PARAMS then says `secagg_prepared` and SA_SHARES_FOR follows at once, so
the round costs three exchanges, as plain FedAvg's one plus the consistency check and the unmasking.
The consistency check (SA_CHECK, SA_SIGNED) is what stops a server that lies about who dropped from
unmasking one site (`hpcfed.privacy.secagg`, round 3, says how); rank 0 checks each signature on
arrival in keys mode, so that one site's bad signature costs that site, not its honest neighbours.
The first round, and any round after one that some live site missed, sets its keys up within the round.

Each stage waits for the sites still in for at most `federation.round_deadline_s`; a site that stays silent is left
out of the round (after it shared its keys: its pairwise masks are removed with its rebuilt key),
and the round needs the quorum's count of masked inputs. A message refused by the protocol counts
against its site like a malformed upload. What replaces the bounded-influence guard, which needs
each site's update: sites clip before masking, the fixed-point range bounds each coordinate, and
the server checks the norm of the sum (`site_input.judge_sum`); a refused sum starts group testing
(`hpcfed.server.secagg_groups`): disjoint groups, each summed securely, until a site is proven; the
refused round itself is retried at once in groups on the inputs the sites already sent.

A round whose sum cannot be unmasked (fewer than a site's threshold of alive neighbours hold shares
of its seed, or of a dropped site's key: too many of one neighbourhood died) is found before any
site is asked for a share (`ServerState.shortfall`) and, with federation.on_client_failure=continue,
is lost, not the run (`_lose`): nothing folded, the dead dropped, the next round on fresh keys. The
graph is drawn from the round number over the sites present (PARAMS names them when some are away,
and each site checks the list), so a survivor short of live neighbours sits a round out.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np

from hpcfed import protocol as P
from hpcfed.comm.api import Message
from hpcfed.errors import FederationError
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.secagg import ProtocolError, members_graph
from hpcfed.privacy.secagg_server import ServerState
from hpcfed.privacy.site_input import sites_needed, spec_for
from hpcfed.server import joining
from hpcfed.server import validation as V
from hpcfed.server.collect import RoundUploads
from hpcfed.server.core import ServerCore
from hpcfed.server.secagg_groups import GroupTesting
from hpcfed.strategies.base import WEIGHTED_SUM, SyncStrategy, Update

log = logging.getLogger("hpcfed.server")

_KINDS = set(P.SECAGG_CLIENT_KINDS | {P.UPDATE, P.FAILED})


class RoundShort(Exception):
    """A secure round has too few sites to go on, and sites may come back (`hpcfed serve`): the round is lost."""


class SecAggCollector:
    """Rank 0's side of secure aggregation, one round at a time: a collector (`hpcfed.server.collect`)
    that folds each round's unmasked sum into a strategy that declares a weighted mean."""

    def __init__(self, core: ServerCore, strategy: SyncStrategy) -> None:
        declared = strategy.aggregates_with(strategy.config)
        if declared != WEIGHTED_SUM and not strategy.folds_buffers:  # hpcfed.privacy.requirements refuses first
            raise TypeError(f"strategy {strategy.name!r} declares aggregates={declared!r}: it cannot take the secure "
                            f"sum (it needs {WEIGHTED_SUM!r})")
        self.core, self.strategy = core, strategy
        config = core.config
        self.num_sites = core.num_clients
        self.size = core.layout.size + 1  # the weighted delta and the weight
        self.spec = spec_for(config.privacy, self.num_sites, config.roster.quorum)
        self.dp = config.privacy.dp is not None
        self.prepared: ServerState | None = None  # the next round's keys and shares, exchanged in this one
        # the sites' identity keys, to check their consistency signatures on arrival (keys mode; psk: none)
        self.identities: dict[int, bytes] | None = None
        if config.security.mode == "keys":
            self.identities = core.keys.secagg_identities()[1]
        self.testing = GroupTesting(core, self.spec)  # after a refused sum: disjoint groups find the site
        if config.influence.enabled:
            log.warning("influence.enabled is set, but under secure aggregation rank 0 never sees one site's update: "
                        "the guard is replaced by each site's clip to %g before masking, the fixed-point range and "
                        "a check of the sum's norm (README, 'What the server sees')", self.spec.clip_norm)

    def collect(self, rnd: int, want_state: bool) -> RoundUploads:
        """Run round `rnd`'s protocol and fold the sum into the strategy (`hpcfed.server.collect.Collector`):
        the sites whose inputs are in it (their metrics, no vector), the live ones that sat the round
        out, and whether the round was lost (its sum could not be unmasked: nothing of it is folded).

        Under `hpcfed serve` sites come and go: a round with too few sites present for a secure sum
        first waits for sites to (re)join (up to ``federation.setup_timeout_s``), and a round that
        falls short mid-way is lost, not the run (the next one waits for sites again). A round whose
        whole sum is refused is retried at once in groups on the inputs the sites already sent
        (`retry`), so that the honest groups' sums still move the model in that round."""
        joining.await_members(self.core, rnd, lambda: max(self._needed(), self.core.config.privacy.secagg.min_group))
        try:
            taken = self._attempt(rnd, want_state, self.testing.start(rnd), retry=False)
            if taken.lost or not self.testing.retry_due(rnd):
                return taken
            groups = self.testing.start(rnd)  # None: no partition keeps the rules; the round stays lost
            if groups is None:
                return taken
            log.warning("round %d is retried in groups on the inputs its sites already sent (no training): the "
                        "honest groups' sums are folded as the round's update", rnd)
            self.core.metrics.log(rnd, None, "secagg_retried", 1)
            return self._attempt(rnd, want_state, groups, retry=True)
        except RoundShort as exc:
            log.warning("round %d lost: %s; the next round waits for sites to rejoin", rnd, exc)
            self.core.metrics.log(rnd, None, "secagg_round_lost", 1)
            self.core.lost_rounds.append(rnd)
            self.prepared = None
            return RoundUploads(rnd, sat_out=set(self.core.live), lost=True)  # no one is a straggler

    def _attempt(self, rnd: int, want_state: bool, groups: list[list[int]] | None, retry: bool) -> RoundUploads:
        """One run of round `rnd`'s protocol: over the sites present or, `groups`, group by group
        (`retry`: the sites mask the inputs they sent in the round's first attempt)."""
        core = self.core
        self._quorum(rnd, set(core.live), "present at the round's start")  # a graph needs two sites
        started, taken = set(core.live), RoundUploads(rnd)
        state, self.prepared = self.prepared, None
        if state is not None and (state.rnd != rnd or set(state.shared) != core.live or groups is not None):
            state = None  # prepared for another round, or a site has joined the live ones since: set up anew
        # Sites away (late, lost): the round's graph is over the members present, which the sites check.
        members = {"secagg_members": sorted(core.live)} if groups is None and len(core.live) < self.num_sites else {}
        for cid in sorted(core.live):
            core.send_to(cid, P.PARAMS, {"round": rnd, "version": core.strategy.version, "checkpoint": want_state,
                                         "secagg_prepared": state is not None, **members,
                                         **({"secagg_groups": groups} if groups is not None else {}),
                                         **({"secagg_retry": True} if retry else {})},
                         core.model_tensors(core.strategy.model_for(cid)))
            if state is not None:  # its keys and shares came in the last round: nothing to wait for
                self._relay_shares(rnd, cid, state)
        if state is None:
            state = self._setup(rnd, taken)
        ahead_ok = rnd + 1 < core.config.run.rounds and groups is None and not self.testing.isolation.active \
            and len(core.live) >= 2  # (sites lost meanwhile: the next round sets up among those there then)
        nxt = ServerState(members_graph(core.live, self.num_sites, rnd + 1, self._degree()), self.size, rnd + 1) \
            if ahead_ok else None
        alive, dropped = self._masked_inputs(rnd, state, want_state, taken, nxt)
        short = state.shortfall()
        why = self.testing.missing(alive) or (short.describe() if short is not None else None)
        if why is not None:  # decided before any site is asked for a share: none is revealed in vain
            self._lose(rnd, why, started, alive, dropped)
            return _kept(taken, alive & core.live, lost=True)
        answering = self._check(rnd, state, alive)
        short = state.shortfall(answering)
        if short is not None:  # too few signed: the sites that cannot answer are not asked, none reveals in vain
            self._lose(rnd, f"{short.describe()} (after the consistency check: signed by "
                            f"{', '.join(map(str, sorted(state.signatures))) or 'none'})", started, alive, dropped)
            return _kept(taken, alive & core.live, lost=True)
        # The next round is set up alongside this one's unmasking only when every live site is in both.
        # (Not when a site would be short of advertised neighbours in it: it sits that round out, set up in it.)
        ahead = nxt is not None and answering == alive == core.live == set(nxt.adverts) and not nxt.leave_out_short()
        for cid in sorted(answering):
            header = {"round": rnd, "alive": sorted(alive), "dropped": sorted(dropped),
                      "signatures": W.signatures_fields(state.signatures_for(cid))}
            if ahead and nxt is not None:
                header["next_adverts"] = [W.advert_fields(a) for a in nxt.adverts_for(cid).values()]
            core.send_to(cid, P.SA_UNMASK, header)
        n = self.num_sites

        def reveal(cid: int, msg: Message) -> None:
            answers = W.parse_answers(cid, msg.header.get("answers"), n)
            shares = None
            if ahead and nxt is not None:
                shares = W.parse_shares(cid, msg.header.get("next_to"), msg.tensors, n, cid, by_sender=False)
            elif msg.tensors or "next_to" in msg.header:
                raise ProtocolError(f"site {cid}: shares for round {rnd + 1} that were not asked for")
            if shares is not None and nxt is not None:
                nxt.take_shares(cid, shares)
            state.take_unmask(cid, answers)

        self._gather(rnd, P.SA_REVEAL, answering, reveal)
        self.testing.answered(alive)  # the sites count these sums as revealed from now on, unmasked or not
        if ahead and nxt is not None and set(nxt.shared) == core.live:
            self.prepared = nxt
        try:  # judged whole, or group by group; a refused sum is evidence (hpcfed.server.secagg_groups)
            self.testing.conclude(rnd, state, alive, self._fold)
        except ValueError as exc:  # ProtocolError included: a site left or went silent while unmasking
            silent = ", ".join(map(str, sorted(answering - set(state.answers))))
            self._lose(rnd, f"{exc}; no unmask answer from site(s) {silent or 'none'}", started, alive, dropped)
            return _kept(taken, alive & core.live, lost=True)
        if set(core.live) != started:
            self.prepared = None  # a site was evicted: the next round sets up fresh keys without it
        return _kept(taken, alive, lost=False)

    def _masked_inputs(self, rnd: int, state: ServerState, want_state: bool, taken: RoundUploads,
                       nxt: ServerState | None) -> tuple[set[int], set[int]]:
        """The masked inputs of the sites that shared (the stage's deadline), less those evicted since
        (they count as dropped): (alive, dropped), once the quorum of masked inputs holds."""
        self._gather(rnd, P.SA_MASKED, set(state.shared), lambda cid, msg: self._take_masked(
            rnd, cid, msg, want_state, state, taken, nxt))
        for cid in set(state.masked) - self.core.live:  # evicted since: its input stays out, as a dropped site's
            state.withdraw(cid)
        alive, dropped = state.unmask_request()
        self._quorum(rnd, alive, "sent masked inputs")
        return alive, dropped

    def _check(self, rnd: int, state: ServerState, alive: set[int]) -> set[int]:
        """The consistency check: each survivor signs the survivor set; the survivors that hold their
        threshold of neighbours' signatures, the only ones asked to unmask."""
        survivors = sorted(state.survivor_set())
        for cid in sorted(alive):
            self.core.send_to(cid, P.SA_CHECK, {"round": rnd, "survivors": survivors})
        keys_mode = self.identities is not None

        def signed(cid: int, msg: Message) -> None:
            state.take_signature(cid, W.parse_signature(cid, msg.header.get("signature"), keys_mode), self.identities)

        self._gather(rnd, P.SA_SIGNED, alive, signed)
        return state.answering() & self.core.live

    def _degree(self) -> int | None:
        return self.core.config.privacy.secagg.degree

    def _setup(self, rnd: int, uploads: RoundUploads, state: ServerState | None = None) -> ServerState:
        """Round `rnd`'s key advertisement and share exchange, in the round (the first one, or after a
        round some live site missed): two more exchanges before the sites can mask. A live site short
        of advertised neighbours sits the round out (`uploads.sat_out`). `state`: the exchange's own
        (a buffer's, among its members: `hpcfed.server.secagg_buffer`), else the round's over all sites."""
        core, n = self.core, self.num_sites
        if state is None:  # the round's own exchange, over the sites present
            self._quorum(rnd, set(core.live), "present when the keys are set up")  # sites lost while PARAMS went out
            state = ServerState(self.testing.graph(rnd, self._degree()), self.size, rnd)

        def advert(cid: int, msg: Message) -> None:
            state.take_advert(cid, W.parse_advert(cid, msg.header.get("advert"), n))

        advertised = self._gather(rnd, P.SA_ADVERT, set(core.live) & set(state.graph), advert)
        if short := state.leave_out_short():
            advertised -= short
            uploads.sat_out = short
            log.warning("round %d: site(s) %s sit this round out: fewer of their neighbours advertised keys than "
                        "the Shamir threshold needs (the others ended or are silent); a larger "
                        "privacy.secagg.degree tolerates more losses in one neighbourhood", rnd,
                        ", ".join(map(str, sorted(short))))
            core.metrics.log(rnd, None, "secagg_sat_out", len(short))
        self._quorum(rnd, advertised, "advertised keys" + (" with enough advertised neighbours" if short else ""))
        for cid in sorted(advertised):
            relayed = [W.advert_fields(a) for a in state.adverts_for(cid).values()]
            core.send_to(cid, P.SA_KEYS, {"round": rnd, "adverts": relayed})

        def shares(cid: int, msg: Message) -> None:
            state.take_shares(cid, W.parse_shares(cid, msg.header.get("to"), msg.tensors, n, cid, by_sender=False))

        shared = self._gather(rnd, P.SA_SHARES, advertised, shares)
        self._quorum(rnd, shared, "shared keys")
        for cid in sorted(shared):
            self._relay_shares(rnd, cid, state)
        return state

    def _relay_shares(self, rnd: int, cid: int, state: ServerState) -> None:
        ids, blob = W.shares_message(state.shares_for(cid), by_sender=True)
        self.core.send_to(cid, P.SA_SHARES_FOR, {"round": rnd, "from": ids}, {W.SHARES_TENSOR: blob})

    # -- stages -----------------------------------------------------------------------------------------
    def _gather(self, rnd: int, kind: int, waiting: set[int], take: Callable[[int, Message], None]) -> set[int]:
        """One `kind` message of round `rnd` from each site `waiting`, for at most the round deadline
        (each stage has its own: a stage that waited for a silent site leaves the next its time);
        the sites whose message was taken (and are still members)."""
        core, done = self.core, set[int]()
        deadline = time.monotonic() + core.config.deadlines.round_deadline_s
        while pending := (waiting & core.live) - done:
            msg = core.recv_until(deadline, _KINDS, f"round {rnd} ({P.NAMES[kind]})", waiting_for=pending,
                                  fatal=False)
            if msg is None:
                break
            core.contained(msg.source, self._take, rnd, kind, pending, msg, take, done)
        return done & core.live

    def _take(self, rnd: int, kind: int, pending: set[int], msg: Message, take: Callable[[int, Message], None],
              done: set[int]) -> None:
        core, cid = self.core, msg.source - 1
        name = P.NAMES.get(msg.kind, str(msg.kind))
        if msg.header.get("round") != rnd:  # a straggler's message of an earlier round: not evidence
            core.reject(msg.source, "stale update", f"{name} for round {V.short(msg.header.get('round'), 40)} "
                                                    f"during round {rnd}")
            return
        if msg.kind != kind or cid not in pending:
            core.reject(msg.source, "unrequested update", f"{name} while round {rnd} waits for {P.NAMES[kind]} "
                                                          f"(from sites {sorted(pending)})")
            return
        try:
            take(cid, msg)
        except ProtocolError as exc:
            core.reject(msg.source, "secure aggregation message", f"round {rnd}: {exc}")
            return
        done.add(cid)

    def _take_masked(self, rnd: int, cid: int, msg: Message, want_state: bool, state: ServerState,
                     taken: RoundUploads, nxt: ServerState | None) -> None:
        y = W.parse_masked(cid, msg.tensors, self.size)
        advert = None  # the site's keys for the next round, advertised with this round's input
        if nxt is not None and msg.header.get("next_advert") is not None:
            advert = W.parse_advert(cid, msg.header.get("next_advert"), self.num_sites)
        metrics, shard = msg.header.get("metrics", {}), V.shard_ref(msg.header.get("shard"))
        if not V.metrics_ok(metrics):
            raise ProtocolError(f"site {cid}: masked input's metrics are not at most {V.MAX_METRICS} named numbers")
        if want_state and (shard is None or shard["round"] != rnd):
            raise ProtocolError(f"site {cid}: masked input of checkpoint round {rnd} without a valid shard")
        state.take_masked(cid, y)
        if advert is not None and nxt is not None:
            nxt.take_advert(cid, advert)
        upd = Update(client_id=cid, flat=None, num_examples=0,
                     metrics={k: (float(v) if v is not None else math.nan) for k, v in metrics.items()})
        taken.add(upd, shard if want_state else None)

    def _quorum(self, rnd: int, sites: set[int], what: str) -> None:
        """Enough sites to go on: the quorum of the live ones (under DP, of all K: the noise counts on it)."""
        core, needed = self.core, self._needed()
        if len(sites) < needed:
            silent = ", ".join(f"client {c} (rank {c + 1})" for c in sorted(core.live - sites)) or "none"
            text = (f"only {len(sites)} site(s) {what} within the stage deadline "
                    f"({core.config.deadlines.round_deadline_s:g} s), secure aggregation needs {needed}; "
                    f"silent or refused: {silent}")
            if self._sites_come_back():
                raise RoundShort(text)
            raise FederationError(f"round {rnd}: {text}; last checkpoint: {core.last_checkpoint or 'none'}")

    def _sites_come_back(self) -> bool:
        """Whether a round short of sites is lost rather than the run: sites may rejoin (`hpcfed serve`)."""
        return self.core.joiners is not None and self.core.config.roster.on_client_failure == "continue"

    def _lose(self, rnd: int, why: str, started: set[int], alive: set[int], dropped: set[int]) -> None:
        """Round `rnd`'s sum cannot be unmasked (too many sites of one neighbourhood left): with
        federation.on_client_failure=continue the round is lost, not the run. Nothing of it is folded
        (rank 0 never learns a partial sum), the sites that ended are dropped, and the next round sets
        up fresh keys with the survivors; with the default abort, or too few survivors, the run ends."""
        core = self.core
        if core.config.roster.on_client_failure != "continue":
            raise FederationError(f"round {rnd}: secure aggregation cannot unmask the sum: {why} (with "
                                  f"federation.on_client_failure=continue the round would be lost, not the run); "
                                  f"last checkpoint: {core.last_checkpoint or 'none'}")
        core.check_departures()  # the sites that ended are dropped now, so that the record names them
        survivors = alive & core.live
        gone, missed = sorted(started - core.live), sorted(dropped & core.live)
        names = ", ".join(f"client {c} (rank {c + 1})" for c in gone) or "none"  # ended, or evicted
        needed = self._needed()
        if len(survivors) < needed and not self._sites_come_back():  # the quorum of every stage, for the rounds to come
            raise FederationError(
                f"round {rnd}: secure aggregation cannot unmask the sum ({why}), and only {len(survivors)} site(s) "
                f"survive it ({', '.join(map(str, sorted(survivors))) or 'none'}), fewer than the {needed} secure "
                f"aggregation needs; ended: {names}; last checkpoint: {core.last_checkpoint or 'none'}")
        late = f"; in the round but without a masked input: sites {', '.join(map(str, missed))}" if missed else ""
        log.warning("round %d lost: secure aggregation cannot unmask its sum: %s; ended: %s%s. Nothing of the round "
                    "is folded (the model stays as it was) and the next round sets up fresh keys with the %d "
                    "survivors (sites %s); a larger privacy.secagg.degree tolerates more losses in one neighbourhood",
                    rnd, why, names, late, len(survivors), ", ".join(map(str, sorted(survivors))))
        core.metrics.log(rnd, None, "secagg_round_lost", 1)
        core.lost_rounds.append(rnd)
        self.prepared = None

    def _needed(self) -> int:
        base = self.num_sites if self.dp else len(self.core.live)
        return max(2, sites_needed(base, self.core.config.roster.quorum))

    def _fold(self, weighted_sum: np.ndarray, examples: int, count: int) -> None:
        """Hand a judged sum (`site_input.judge_sum`: in the encoding, its norm within the clips) of
        `count` sites to the strategy (it declares WEIGHTED_SUM: checked when built)."""
        self.strategy.fold_sum(weighted_sum, examples, count)


def _kept(taken: RoundUploads, sites: set[int], lost: bool) -> RoundUploads:
    """The round's uploads of `sites` only (those whose inputs are in its sum, or would have been)."""
    kept = RoundUploads(taken.round, sat_out=taken.sat_out, lost=lost)
    for cid in sorted(sites):
        kept.add(taken.updates[cid], taken.shards[cid])
    return kept
