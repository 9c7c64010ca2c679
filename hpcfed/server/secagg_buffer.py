"""Secure aggregation of one asynchronous buffer, rank 0's side: FedBuff's buffer (Nguyen et al. 2022)
summed with SecAgg+ (Bonawitz et al. 2017; Bell et al. 2020) among the buffer's members only. The
loop that forms buffers is `hpcfed.server.buffered`; a site's side is `hpcfed.client.secagg_buffer`;
the invitation's checks and the weight's encoding are `hpcfed.privacy.buffered`.

```
rank 0                                                    member k of buffer b (trained from version v_k)
  |<-------------------------------------- SA_READY (v_k)
  |-- SA_BUFFER (round b, members, version t, staleness t - v_k) ->|  checks t and τ against what it saw
  |<-- SA_ADVERT / SA_KEYS / SA_SHARES / SA_SHARES_FOR: keys set up among the members (graph of b) -->|
  |<-------------------------------------- SA_MASKED (s(τ_k)·clip(δ_k), q_k = s(τ_k)·M masked)
  |-- SA_CHECK / SA_SIGNED / SA_UNMASK / SA_REVEAL: the consistency check and the unmasking ----------|
  |   Σ s_k δ_k and Σ q_k of the survivors: all rank 0 learns of the buffer
  |-- PARAMS (version t + 1, answer) --------------------------->|
```
A buffer is a secure aggregation round among its members: the stages, their deadlines, the
consistency check, the dropout recovery and the loss of an unrecoverable sum are the synchronous
round's (`hpcfed.server.secagg_round.SecAggCollector`), on the buffer's own graph (`group_graph`)
and with the buffer's context as the number every signature binds. The sum is judged as a round's
(in the encoding, norm within C·Σ s_k), and its weight coordinate must be exactly Σ q(τ_k) of the
survivors, which rank 0 knows (it told each its staleness): a site that claims another weight is
caught there. A refused sum folds nothing (the buffer is lost; the members are answered all the same).
"""

from __future__ import annotations

import logging

from hpcfed import protocol as P
from hpcfed.comm.api import Message
from hpcfed.errors import FederationError
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.buffered import StalenessRule, buffer_context, judge_buffer
from hpcfed.privacy.secagg import ProtocolError, group_graph
from hpcfed.privacy.secagg_server import ServerState
from hpcfed.server.collect import RoundUploads
from hpcfed.server.core import ServerCore
from hpcfed.server.secagg_round import SecAggCollector
from hpcfed.strategies.base import AsyncStrategy

log = logging.getLogger("hpcfed.server")


class BufferLost(FederationError):
    """Too few of a buffer's members took part in one of its stages: the buffer is lost, not the run."""


class BufferExchange(SecAggCollector):
    """SecAgg+ among one buffer's members (see the module's docstring)."""

    def __init__(self, core: ServerCore, strategy: AsyncStrategy, rule: StalenessRule) -> None:
        # The collector only reads the strategy's declaration (WEIGHTED_SUM, checked there) and calls its fold_sum.
        super().__init__(core, strategy)  # type: ignore[arg-type]  # an async strategy with fold_sum (FedBuff)
        self.async_strategy, self.rule = strategy, rule

    def buffer(self, b: int, members: set[int], version: int, staleness: dict[int, int]) -> RoundUploads:
        """Run buffer `b` among `members` at server `version` (each member's `staleness` told to it) and
        fold its sum: the members whose inputs are in it (their metrics), or `lost` when nothing was folded."""
        core, taken = self.core, RoundUploads(b)
        for cid in sorted(members):
            core.send_to(cid, P.SA_BUFFER, {"round": b, "members": sorted(members), "version": version,
                                            "staleness": staleness[cid]})
        graph = group_graph([sorted(members)], b, self._degree())
        state = ServerState(graph, self.size, buffer_context(b, version, members))
        try:
            state = self._setup(b, taken, state)
            alive, dropped = self._masked_inputs(b, state, False, taken, None)
            short = state.shortfall()
            if short is not None:
                raise BufferLost(short.describe())
            answering = self._check(b, state, alive)
            short = state.shortfall(answering)
            if short is not None:
                raise BufferLost(f"{short.describe()} (after the consistency check)")
            for cid in sorted(answering):
                core.send_to(cid, P.SA_UNMASK, {"round": b, "alive": sorted(alive), "dropped": sorted(dropped),
                                                "signatures": W.signatures_fields(state.signatures_for(cid))})
            self._gather(b, P.SA_REVEAL, answering, lambda cid, msg: state.take_unmask(
                cid, _answers(cid, msg, self.num_sites)))
            self._judge_and_fold(b, state, staleness)
        except (BufferLost, ValueError) as exc:  # ProtocolError included: a site left or went silent while unmasking
            self._lose(b, str(exc), set(members), set(state.masked), state.shared - set(state.masked))
            return _only(taken, set(state.masked) & core.live, lost=True)
        return _only(taken, set(state.masked), lost=False)

    def _judge_and_fold(self, b: int, state: ServerState, staleness: dict[int, int]) -> None:
        """Unmask, judge (`judge_sum`: in the encoding, norm within C·Σ q) and check the weight
        coordinate against Σ q(τ_k) of the survivors; fold Σ s_k·δ_k and Σ s_k into the strategy."""
        total, alive = state.result()
        weighted, weight = judge_buffer(total, staleness, alive, self.rule, self.spec)
        self.async_strategy.fold_sum(weighted, weight, len(alive))
        self.core.metrics.log(b, None, "secagg_buffer_weight", weight)

    def _quorum(self, rnd: int, sites: set[int], what: str) -> None:
        """A buffer's stage needs 2 of its members: fewer lose the buffer (the run goes on)."""
        if len(sites) < 2:
            raise BufferLost(f"only {len(sites)} member(s) {what} within the stage deadline "
                             f"({self.core.config.deadlines.round_deadline_s:g} s); a buffer's sum needs 2")

    def _lose(self, rnd: int, why: str, started: set[int], alive: set[int], dropped: set[int]) -> None:
        """Buffer `rnd`'s sum cannot be unmasked, or was refused: with federation.on_client_failure=continue
        the buffer is lost, not the run (nothing of it folded; the next buffer sets up fresh keys)."""
        core = self.core
        if core.config.roster.on_client_failure != "continue":
            raise FederationError(f"buffer {rnd}: secure aggregation folds nothing of it: {why} (with "
                                  f"federation.on_client_failure=continue the buffer would be lost, not the run); "
                                  f"last checkpoint: {core.last_checkpoint or 'none'}")
        core.check_departures()
        log.warning("buffer %d (sites %s) lost: %s; nothing of it is folded, its members are answered with the model "
                    "as it was and the next buffer sets up fresh keys", rnd, ", ".join(map(str, sorted(started))), why)
        core.metrics.log(rnd, None, "secagg_round_lost", 1)
        core.lost_rounds.append(rnd)


def _answers(cid: int, msg: Message, num_sites: int) -> dict[int, tuple[str, int, bytes]]:
    """A member's unmask answers; shares for a next buffer are never asked for (nothing is set up ahead)."""
    if msg.tensors or "next_to" in msg.header:
        raise ProtocolError(f"site {cid}: shares for a next buffer, which is never set up ahead")
    return W.parse_answers(cid, msg.header.get("answers"), num_sites)


def _only(taken: RoundUploads, sites: set[int], lost: bool) -> RoundUploads:
    kept = RoundUploads(taken.round, sat_out=taken.sat_out, lost=lost)
    for cid in sorted(sites & set(taken.updates)):
        kept.add(taken.updates[cid], taken.shards[cid])
    return kept
