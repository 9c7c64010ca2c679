"""Secure aggregation in a synchronous round, rank 0's side: SecAgg (Bonawitz et al., CCS 2017) with
SecAgg+ neighbourhoods (Bell et al., CCS 2020), driven over the channel. The protocol's state
machines are `hpcfed.privacy.secagg`, its wire forms `hpcfed.privacy.secagg_wire`.

```
rank 0                                                        site k
  |-- PARAMS (round r, model) ----------------------------------->|
  |<-------------------------- SA_ADVERT (c, s public keys; signed in keys mode)
  |-- SA_KEYS (its neighbours' adverts, relayed) ---------------->|  checks the signatures
  |<-------------------------- SA_SHARES (Shamir shares of b_k and s_k, sealed to each neighbour)
  |-- SA_SHARES_FOR (the shares sealed to k) -------------------->|  fit, clip, fixed point, mask
  |<-------------------------- SA_MASKED (y_k mod 2^32; metrics, shard)
  |-- SA_UNMASK (alive: sent y; dropped: shared, sent no y) ----->|
  |<-------------------------- SA_REVEAL (per neighbour: a seed share or a key share, never both)
  |   Σ y - masks = Σ_k w_k·δ_k and Σ n_k of the alive sites: all rank 0 learns of the round
```

Each stage waits for the sites still in for at most `federation.round_deadline_s`; a site that stays silent is left
out of the round (after it shared its keys: its pairwise masks are removed with its rebuilt key),
and the round needs the quorum's count of masked inputs. A message refused by the protocol counts
against its site like a malformed upload. What replaces the bounded-influence guard, which needs
each site's update: sites clip before masking, the fixed-point range bounds each coordinate, and
the server checks the norm of the sum (`_sum_ok`).
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
from hpcfed.privacy.secagg import ProtocolError, ServerState, round_graph
from hpcfed.privacy.site_input import decode_sum, sites_needed, spec_for
from hpcfed.server import validation as V
from hpcfed.server.core import ServerCore
from hpcfed.strategies.base import Update
from hpcfed.strategies.fedavg import FedAvg

log = logging.getLogger("hpcfed.server")

_KINDS = set(P.SECAGG_CLIENT_KINDS | {P.UPDATE, P.FAILED})
Taken = dict[int, tuple[Update, V.ShardRef | None]]  # site -> its metrics (no vector) and shard


class SecAggRound:
    """Rank 0's side of secure aggregation, one round at a time."""

    def __init__(self, core: ServerCore) -> None:
        self.core = core
        cfg = core.cfg
        self.num_sites = core.num_clients
        self.size = core.layout.size + 1  # the weighted delta and the weight
        self.spec = spec_for(cfg.privacy, self.num_sites, cfg.federation.quorum)
        self.dp = cfg.privacy.dp is not None
        if cfg.influence.enabled:
            log.warning("influence.enabled is set, but under secure aggregation rank 0 never sees one site's update: "
                        "the guard is replaced by each site's clip to %g before masking, the fixed-point range and "
                        "a check of the sum's norm (README, 'What the server sees')", self.spec.clip_norm)

    def collect(self, rnd: int, want_state: bool) -> Taken:
        """Run round `rnd`'s protocol and fold the sum into the strategy; the sites whose inputs are in it."""
        core = self.core
        state = ServerState(round_graph(self.num_sites, rnd, core.cfg.privacy.secagg.degree), self.size)
        for cid in sorted(core.live):
            core.send_to(cid, P.PARAMS, {"round": rnd, "version": core.strategy.version, "checkpoint": want_state},
                         core.model_tensors(core.strategy.model_for(cid)))
        n = self.num_sites

        def advert(cid: int, msg: Message) -> None:
            state.take_advert(cid, W.parse_advert(cid, msg.header.get("advert"), n))

        advertised = self._gather(rnd, P.SA_ADVERT, set(core.live), advert)
        self._quorum(rnd, advertised, "advertised keys")
        for cid in sorted(advertised):
            relayed = [W.advert_fields(a) for a in state.adverts_for(cid).values()]
            core.send_to(cid, P.SA_KEYS, {"round": rnd, "adverts": relayed})

        def shares(cid: int, msg: Message) -> None:
            state.take_shares(cid, W.parse_shares(cid, msg.header.get("to"), msg.tensors, n, cid, by_sender=False))

        shared = self._gather(rnd, P.SA_SHARES, advertised, shares)
        self._quorum(rnd, shared, "shared keys")
        for cid in sorted(shared):
            ids, blob = W.shares_message(state.shares_for(cid), by_sender=True)
            core.send_to(cid, P.SA_SHARES_FOR, {"round": rnd, "from": ids}, {W.SHARES_TENSOR: blob})
        taken: Taken = {}
        self._gather(rnd, P.SA_MASKED, shared, lambda cid, msg: self._take_masked(
            rnd, cid, msg, want_state, state, taken))
        for cid in set(state.masked) - core.live:  # evicted since: its input stays out, as a dropped site's
            del state.masked[cid]
        alive, dropped = state.unmask_request()
        self._quorum(rnd, alive, "sent masked inputs")
        for cid in sorted(alive):
            core.send_to(cid, P.SA_UNMASK, {"round": rnd, "alive": sorted(alive), "dropped": sorted(dropped)})

        def reveal(cid: int, msg: Message) -> None:
            state.take_unmask(cid, W.parse_answers(cid, msg.header.get("answers"), n))

        self._gather(rnd, P.SA_REVEAL, alive, reveal)
        self._fold(rnd, state)
        return {cid: taken[cid] for cid in alive}

    # -- stages -----------------------------------------------------------------------------------------
    def _gather(self, rnd: int, kind: int, waiting: set[int], take: Callable[[int, Message], None]) -> set[int]:
        """One `kind` message of round `rnd` from each site `waiting`, for at most the round deadline
        (each stage has its own: a stage that waited for a silent site leaves the next its time);
        the sites whose message was taken (and are still members)."""
        core, done = self.core, set[int]()
        deadline = time.monotonic() + core.cfg.federation.round_deadline_s
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
                     taken: Taken) -> None:
        y = W.parse_masked(cid, msg.tensors, self.size)
        metrics, shard = msg.header.get("metrics", {}), V.shard_ref(msg.header.get("shard"))
        if not V.metrics_ok(metrics):
            raise ProtocolError(f"site {cid}: masked input's metrics are not at most {V.MAX_METRICS} named numbers")
        if want_state and (shard is None or shard["round"] != rnd):
            raise ProtocolError(f"site {cid}: masked input of checkpoint round {rnd} without a valid shard")
        state.take_masked(cid, y)
        upd = Update(client_id=cid, flat=None, num_examples=0,
                     metrics={k: (float(v) if v is not None else math.nan) for k, v in metrics.items()})
        taken[cid] = (upd, shard if want_state else None)

    def _quorum(self, rnd: int, sites: set[int], what: str) -> None:
        """Enough sites to go on: the quorum of the live ones (under DP, of all K: the noise counts on it)."""
        core = self.core
        base = self.num_sites if self.dp else len(core.live)
        needed = max(2, sites_needed(base, core.cfg.federation.quorum))
        if len(sites) < needed:
            silent = ", ".join(f"client {c} (rank {c + 1})" for c in sorted(core.live - sites)) or "none"
            raise FederationError(f"round {rnd}: only {len(sites)} site(s) {what} within the stage deadline "
                                  f"({core.cfg.federation.round_deadline_s:g} s), secure aggregation needs {needed}; "
                                  f"silent or refused: {silent}; last checkpoint: {core.last_checkpoint or 'none'}")

    def _fold(self, rnd: int, state: ServerState) -> None:
        """Unmask the sum and hand it to the strategy, unless its norm says a site cheated its clip."""
        core = self.core
        try:
            total, alive = state.result()
            weighted_sum, examples = decode_sum(total, len(alive), self.spec)
        except ValueError as exc:  # ProtocolError included: too few answers to rebuild a mask
            raise FederationError(f"round {rnd}: secure aggregation could not unmask the sum ({exc}); "
                                  f"last checkpoint: {core.last_checkpoint or 'none'}") from None
        if not self._sum_ok(rnd, weighted_sum, examples, len(alive)):
            return
        if not isinstance(core.strategy, FedAvg):  # registry.check_secure_aggregation allows only FedAvg
            raise TypeError(f"strategy {core.strategy.name!r} cannot take a secure sum")
        core.strategy.fold_secure_sum(weighted_sum, examples, len(alive))

    def _sum_ok(self, rnd: int, weighted_sum: np.ndarray, examples: int, count: int) -> bool:
        """Honest sites clipped to C: ‖Σ n_k δ_k‖ ≤ C·Σ n_k (plus the noise's 4 stds under DP). Beyond
        it some site sent an input outside the encoding; the round's sum is refused, the model stays."""
        spec, norm = self.spec, float(np.linalg.norm(weighted_sum))
        bound = spec.clip_norm * examples + 4 * spec.noise_std * math.sqrt(count * weighted_sum.size)
        if math.isfinite(norm) and norm <= bound:
            return True
        log.warning("round %d: the securely aggregated sum has norm %.4g, above what %d sites clipped to %g can "
                    "make (%.4g): a site sent an input outside the encoding; the round's sum is refused",
                    rnd, norm, count, spec.clip_norm, bound)
        self.core.metrics.log(rnd, None, "secagg_sum_refused", 1)
        return False
