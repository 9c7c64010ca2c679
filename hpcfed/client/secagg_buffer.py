"""Secure buffered asynchronous aggregation, a site's side (rank 0's is `hpcfed.server.secagg_buffer`;
the checks and the weight's encoding are `hpcfed.privacy.buffered`).

The site trains on the model it was answered with, takes its delta and clips it (the stages
upstream), then says SA_READY and waits for a buffer. The server's SA_BUFFER names the buffer, its
members, the server's version and this site's staleness; the site checks them against the versions
it saw (a lie is refused, naming it), scales its clipped delta by the strategy's weight s(τ), puts
the weight in the masked coordinate, and runs SecAgg+ with the buffer's members only (keys set up
within the buffer, the consistency check, the unmasking). A CHECKPOINT, the end, or an eviction
while it waits ends the upload (`Superseded`): the server answers it again afterwards.
"""

from __future__ import annotations

from typing import Any

from hpcfed import protocol as P
from hpcfed.client.secagg import SecAggSite
from hpcfed.client.upload import RoundStart, Superseded, Upload, Upstream
from hpcfed.comm.api import Channel, Message
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.privacy import masking
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.buffered import Invite, StalenessRule, check_invite
from hpcfed.privacy.secagg import ProtocolError, SiteState, group_graph
from hpcfed.privacy.site_input import InputSpec

_INTERRUPTING = frozenset({P.PARAMS, P.FINAL, P.STOP, P.EVICTED, P.CHECKPOINT})


class BufferedSecAggSite(SecAggSite):
    """The upload stage of a secure buffered federation: wait for a buffer, weigh, mask, unmask."""

    def __init__(self, channel: Channel, size: int, *, keys: RankKeys, degree: int | None, timeout_s: float,
                 spec: InputSpec, rule: StalenessRule) -> None:
        super().__init__(channel, size, keys=keys, degree=degree, min_group=2, timeout_s=timeout_s)
        self.spec, self.rule = spec, rule
        self.last_buffer = -1  # the last buffer this site took part in: numbers must rise
        self.newest_seen = 0  # the newest server version this site was sent

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)  # train, delta, clip
        assert upload.delta is not None, "BufferedSecAggSite runs downstream of Delta and Clip"
        trained_from = start.header.get("version")
        if not isinstance(trained_from, int) or isinstance(trained_from, bool):
            raise FederationError(f"client {self.site}: the server's model carries no version ({trained_from!r})")
        self.newest_seen = max(self.newest_seen, trained_from)
        self._send(P.SA_READY, {"version": trained_from})
        msg = self._invitation()
        try:
            invite = check_invite(msg.header, me=self.site, num_sites=self.num_sites, trained_from=trained_from,
                                  last_buffer=self.last_buffer, newest_seen=self.newest_seen)
            self.last_buffer, self.newest_seen = invite.buffer, invite.version
            self._buffer(invite, upload)
        except ProtocolError as exc:
            raise FederationError(f"client {self.site} (rank {self.site + 1}): secure aggregation refused in "
                                  f"buffer {str(msg.header.get('round'))[:20]}: {exc}") from None
        return upload

    def _invitation(self) -> Message:
        """The server's SA_BUFFER; anything else that ends the wait supersedes this upload."""
        msg = self.channel.recv(source=0, kinds=_INTERRUPTING | {P.SA_BUFFER}, timeout=self.timeout_s)
        if msg is None:
            raise FederationError(f"client {self.site} (rank {self.site + 1}): the server (rank 0) put this site in "
                                  f"no buffer for {self.timeout_s:g} s (federation.client_timeout_s); leaving")
        if msg.kind != P.SA_BUFFER:
            raise Superseded(msg, "the wait for a buffer")
        return msg

    def _buffer(self, invite: Invite, upload: Upload) -> None:
        """Weigh and encode the clipped delta, then SecAgg+ among the buffer's members."""
        me, b, spec = self.site, invite.buffer, self.spec
        assert upload.delta is not None
        weight = self.rule.units(invite.staleness, spec.max_examples)
        codes = masking.encode(upload.delta, weight, spec.max_examples, spec.value_range, spec.levels, upload.scale)
        graph = group_graph([sorted(invite.members)], b, self.degree)
        state = self._setup(b, SiteState(me, graph, self.size, self.identity, self.peer_keys, invite.context))
        relayed = self._wait(b, P.SA_SHARES_FOR)
        shares = W.parse_shares(me, relayed.header.get("from"), relayed.tensors, self.num_sites, me, by_sender=True)
        metrics = dict(upload.header.get("metrics", {}))
        metrics["secagg_clipped"] = 0.0 if upload.within else 1.0
        metrics["staleness"] = float(invite.staleness)
        masked: dict[str, Any] = {"round": b, "metrics": metrics}
        y = state.masked_input(shares, codes)
        for _ in range(upload.copies):
            self._send(P.SA_MASKED, masked, {W.MASKED_TENSOR: y})
        self._reveal(b, state, None)
