"""Secure aggregation of one asynchronous buffer, rank 0's side: FedBuff's buffer (Nguyen et al. 2022)
summed among its members on long-lived epoch keys (`hpcfed.privacy.secagg_epoch`, which says why
this keeps SecAgg's guarantees; Bonawitz et al. 2017, Bell et al. 2020). The loop that forms buffers
is `hpcfed.server.buffered`; a site's side is `hpcfed.client.secagg_buffer`; the invitation's checks
and the weight's encoding are `hpcfed.privacy.buffered`.

```
rank 0                                                    member k of buffer b (trained from version v_k)
  |<------------------------- SA_READY (v_k; its signed epoch advert: sent with every READY)
  |-- SA_BUFFER (round b, members, version t, staleness t - v_k, its neighbours' epoch adverts) ->|
  |                                                  checks t, τ, the adverts (signed, not replayed)
  |<------------------------- SA_MASKED (s(τ_k)·clip(δ_k), q_k = s(τ_k)·M, masked with b's masks;
  |                                      its fresh self-mask seed's shares, sealed to its neighbours)
  |-- SA_CHECK (survivors S, the shares sealed to k; fast: no member dropped) ------------------->|
  |   fast:      <------------------------ SA_REVEAL (a seed share per neighbour)
  |   otherwise: <-- SA_SIGNED (S) --  -- SA_UNMASK (S, dropped, its neighbours' signatures) -->
  |              <------------------------ SA_REVEAL (seed share per surviving neighbour, b's pair
  |                                                   seed per dropped one)
  |   Σ s_k δ_k and Σ q_k of the survivors: all rank 0 learns of the buffer
  |-- PARAMS (version t + 1, answer) --------------------------->|
```
No key is set up within a buffer: a buffer is one upload and one unmask exchange when no member
drops (the consistency check's exchange is added when one does). The stages' deadlines, the loss
of an unrecoverable sum (found before any site is asked to reveal) and the sum's judgement are the
synchronous round's (`hpcfed.server.secagg_round.SecAggCollector`, whose `_gather` runs each stage).
The sum is judged as a round's (in the encoding, norm within C·Σ s_k), and its weight coordinate
must be exactly Σ q(τ_k) of the survivors, which rank 0 knows (it told each its staleness): a site
that claims another weight is caught there. A refused sum folds nothing (the buffer is lost; the
members are answered all the same) and is evidence: the refused buffers' member sets, which differ
from buffer to buffer, narrow down the hostile member as group testing does for rounds, and one they
prove hostile is evicted (`hpcfed.server.secagg_groups.GroupTesting.buffer_refused`). A refused sum
never ends the run (federation.on_client_failure is for members lost, not for inputs refused).
"""

from __future__ import annotations

import logging
import math

import numpy as np

from hpcfed import protocol as P
from hpcfed.comm.api import Message
from hpcfed.errors import FederationError
from hpcfed.privacy import buffered as B
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.buffered import StalenessRule, buffer_context, judge_buffer
from hpcfed.privacy.secagg import ProtocolError, group_graph
from hpcfed.privacy.secagg_epoch import SEALED_BYTES, BufferServer, PeerBook
from hpcfed.server import validation as V
from hpcfed.server.collect import RoundUploads
from hpcfed.server.core import ServerCore
from hpcfed.server.secagg_round import SecAggCollector
from hpcfed.strategies.base import AsyncStrategy, Update

log = logging.getLogger("hpcfed.server")


class BufferLost(FederationError):
    """Too few of a buffer's members took part in one of its stages: the buffer is lost, not the run."""


class BufferExchange(SecAggCollector):
    """SecAgg+ among one buffer's members (see the module's docstring)."""

    def __init__(self, core: ServerCore, strategy: AsyncStrategy, rule: StalenessRule) -> None:
        # The collector only reads the strategy's declaration (WEIGHTED_SUM, checked there) and calls its fold_sum.
        super().__init__(core, strategy)  # type: ignore[arg-type]  # an async strategy with fold_sum (FedBuff)
        self.async_strategy, self.rule = strategy, rule
        self.book = PeerBook(self.identities)  # the sites' epoch adverts (with their SA_READY)

    def take_advert(self, cid: int, header: dict[str, object]) -> None:
        """The epoch advert a site sends with its SA_READY (hostile): its own, signed, not replayed."""
        adv = B.parse_advert(header.get("epoch_advert"), self.num_sites, f"site {cid}'s epoch advert")
        if adv.site != cid:
            raise ProtocolError(f"site {cid}: its SA_READY carries site {adv.site}'s epoch advert")
        self.book.accept(adv)

    def buffer(self, b: int, members: set[int], version: int, staleness: dict[int, int]) -> RoundUploads:
        """Run buffer `b` among `members` at server `version` (each member's `staleness` told to it) and
        fold its sum: the members whose inputs are in it (their metrics), or `lost` when nothing was folded."""
        core, taken, n = self.core, RoundUploads(b), self.num_sites
        graph = group_graph([sorted(members)], b, self._degree())
        adverts = {cid: self.book.adverts[cid] for cid in members}
        state = BufferServer(graph, self.size, buffer_context(b, version, members), adverts)
        for cid in sorted(members):
            core.send_to(cid, P.SA_BUFFER, {"round": b, "members": sorted(members), "version": version,
                                            "staleness": staleness[cid],
                                            "adverts": [B.advert_fields(adverts[v]) for v in sorted(graph[cid])]})
        try:
            self._gather(b, P.SA_MASKED, set(members), lambda cid, msg: self._take_masked_input(b, cid, msg, state,
                                                                                               taken))
            alive, dropped = state.fix_survivors(core.live)
            self._quorum(b, set(alive), "sent masked inputs")
            fast = not dropped
            short = state.shortfall(set(alive))
            if short is not None:  # decided before any site is asked to reveal
                raise BufferLost(short)
            for cid in sorted(alive):
                ids, blob = _relayed(state.shares_for(cid))
                core.send_to(cid, P.SA_CHECK, {"round": b, "survivors": sorted(alive), "fast": fast, "from": ids},
                             {W.SHARES_TENSOR: blob})
            if not fast:
                answering = self._signatures(b, state, set(alive))
                short = state.shortfall(answering)
                if short is not None:
                    raise BufferLost(f"{short} (after the consistency check)")
                for cid in sorted(answering):
                    core.send_to(cid, P.SA_UNMASK, {"round": b, "alive": sorted(alive), "dropped": sorted(dropped),
                                                    "signatures": W.signatures_fields(
                                                        {v: state.signatures[v] for v in sorted(graph[cid])
                                                         if v in state.signatures})})
            else:
                answering = set(alive)
            self._gather(b, P.SA_REVEAL, answering, lambda cid, msg: state.take_unmask(
                cid, B.parse_answers(cid, msg.header.get("answers"), n)))
            if not self._judge_and_fold(b, state, staleness):  # refused: evidence, never the run's end
                core.lost_rounds.append(b)
                return _only(taken, set(state.survivors or ()) & core.live, lost=True)
        except (BufferLost, ValueError) as exc:  # ProtocolError included: a site left or went silent while unmasking
            self._lose(b, str(exc), set(members), set(state.masked), set(members) - set(state.masked))
            return _only(taken, set(state.masked) & core.live, lost=True)
        return _only(taken, set(state.survivors or ()), lost=False)

    def _take_masked_input(self, b: int, cid: int, msg: Message, state: BufferServer, taken: RoundUploads) -> None:
        if set(msg.tensors) != {W.MASKED_TENSOR, W.SHARES_TENSOR}:
            raise ProtocolError(f"site {cid}: masked input carries tensors {sorted(msg.tensors)[:3]}, not the masked "
                                f"input and its seed shares")
        to = W.site_ids(msg.header.get("to"), self.num_sites, "seed shares' receivers", cid)
        metrics = msg.header.get("metrics", {})
        if not V.metrics_ok(metrics):
            raise ProtocolError(f"site {cid}: masked input's metrics are not at most {V.MAX_METRICS} named numbers")
        state.take_masked(cid, msg.tensors[W.MASKED_TENSOR], to, msg.tensors[W.SHARES_TENSOR])
        taken.add(Update(client_id=cid, flat=None, num_examples=0,
                         metrics={k: (float(v) if v is not None else math.nan) for k, v in metrics.items()}), None)

    def _signatures(self, b: int, state: BufferServer, alive: set[int]) -> set[int]:
        """The consistency check: each survivor signs S; the survivors that will answer."""
        keys_mode = self.identities is not None

        def signed(cid: int, msg: Message) -> None:
            state.take_signature(cid, W.parse_signature(cid, msg.header.get("signature"), keys_mode), self.identities)

        self._gather(b, P.SA_SIGNED, alive, signed)
        return state.answering(True) & self.core.live

    def _judge_and_fold(self, b: int, state: BufferServer, staleness: dict[int, int]) -> bool:
        """Unmask, judge (`judge_sum`: in the encoding, norm within C·Σ q) and check the weight
        coordinate against Σ q(τ_k) of the survivors; fold Σ s_k·δ_k and Σ s_k into the strategy.
        False when the sum is refused: the buffer is lost, its members are evidence (group testing
        across buffers: `GroupTesting.buffer_refused`), and the run goes on whatever
        federation.on_client_failure says (a refusal is not a failure: one hostile member must not
        end the federation by sending a bad input)."""
        total, alive = state.result()
        try:
            weighted, weight = judge_buffer(total, staleness, alive, self.rule, self.spec)
        except ValueError as exc:
            self.testing.buffer_refused(b, frozenset(alive), str(exc))
            return False
        self.async_strategy.fold_sum(weighted, weight, len(alive))
        self.core.metrics.log(b, None, "secagg_buffer_weight", weight)
        return True

    def _quorum(self, rnd: int, sites: set[int], what: str) -> None:
        """A buffer's stage needs 2 of its members: fewer lose the buffer (the run goes on)."""
        if len(sites) < 2:
            raise BufferLost(f"only {len(sites)} member(s) {what} within the stage deadline "
                             f"({self.core.config.deadlines.round_deadline_s:g} s); a buffer's sum needs 2")

    def _lose(self, rnd: int, why: str, started: set[int], alive: set[int], dropped: set[int]) -> None:
        """Buffer `rnd`'s sum cannot be unmasked, or was refused: with federation.on_client_failure=continue
        the buffer is lost, not the run (nothing of it folded; the next buffer has masks of its own)."""
        core = self.core
        if core.config.roster.on_client_failure != "continue":
            raise FederationError(f"buffer {rnd}: secure aggregation folds nothing of it: {why} (with "
                                  f"federation.on_client_failure=continue the buffer would be lost, not the run); "
                                  f"last checkpoint: {core.last_checkpoint or 'none'}")
        core.check_departures()
        log.warning("buffer %d (sites %s) lost: %s; nothing of it is folded, its members are answered with the model "
                    "as it was (the next buffer has masks of its own)", rnd, ", ".join(map(str, sorted(started))), why)
        core.metrics.log(rnd, None, "secagg_round_lost", 1)
        core.lost_rounds.append(rnd)


def _relayed(shares: dict[int, tuple[int, bytes]]) -> tuple[list[list[int]], np.ndarray]:
    """[[sender, epoch], ...] and the sealed shares as one (m, SEALED_BYTES) uint8 tensor."""
    ids = [[v, epoch] for v, (epoch, _) in sorted(shares.items())]
    blob = np.frombuffer(b"".join(blob for _, (_, blob) in sorted(shares.items())), dtype=np.uint8)
    return ids, blob.reshape(len(ids), SEALED_BYTES)


def _only(taken: RoundUploads, sites: set[int], lost: bool) -> RoundUploads:
    kept = RoundUploads(taken.round, sat_out=taken.sat_out, lost=lost)
    for cid in sorted(sites & set(taken.updates)):
        kept.add(taken.updates[cid], taken.shards[cid])
    return kept
