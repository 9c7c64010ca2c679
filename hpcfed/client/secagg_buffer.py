"""Secure buffered asynchronous aggregation, a site's side (rank 0's is `hpcfed.server.secagg_buffer`;
the protocol is `hpcfed.privacy.secagg_epoch`, the checks and the weight's encoding `hpcfed.privacy.buffered`).

The site makes its epoch keys once (`EpochKeys`) and sends their signed advert with every SA_READY.
It trains on the model it was answered with, takes its delta and clips it (the stages upstream),
then says SA_READY and waits for a buffer. The server's SA_BUFFER names the buffer, its members, the
server's version, this site's staleness and its neighbours' epoch adverts; the site checks them (a
lie about the staleness or the version, a forged or replayed advert are refused, naming it), scales
its clipped delta by the strategy's weight s(τ), puts the weight in the masked coordinate and sends
one SA_MASKED: the input masked with this buffer's masks and its fresh self-mask seed's shares,
sealed to its neighbours. Then SA_CHECK (the survivors, their shares for it): when no member dropped
it reveals at once; otherwise it signs the survivors, and reveals once the unmask request carries
enough of its neighbours' signatures. A CHECKPOINT, the end, or an eviction while it waits ends
the upload (`Superseded`): the server answers it again afterwards.
"""

from __future__ import annotations

from hpcfed import protocol as P
from hpcfed.client import attacks
from hpcfed.client.secagg import SecAggSite
from hpcfed.client.upload import RoundStart, Superseded, Upload, Upstream
from hpcfed.comm.api import Channel, Message
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.privacy import buffered as B
from hpcfed.privacy import masking
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.buffered import Invite, StalenessRule, check_invite
from hpcfed.privacy.secagg import ProtocolError, group_graph
from hpcfed.privacy.secagg_epoch import BufferSite, EpochKeys, PeerBook
from hpcfed.privacy.site_input import InputSpec

_INTERRUPTING = frozenset({P.PARAMS, P.FINAL, P.STOP, P.EVICTED, P.CHECKPOINT})


class BufferedSecAggSite(SecAggSite):
    """The upload stage of a secure buffered federation: wait for a buffer, weigh, mask, unmask."""

    def __init__(self, channel: Channel, size: int, *, keys: RankKeys, degree: int | None, timeout_s: float,
                 spec: InputSpec, rule: StalenessRule, garbage: str | None = None) -> None:
        super().__init__(channel, size, keys=keys, degree=degree, min_group=2, timeout_s=timeout_s)
        self.spec, self.rule = spec, rule
        self.garbage = garbage  # a hostile site's ``garbage*`` attack (`attacks.garbage_input`, per buffer)
        self.last_buffer = -1  # the last buffer this site took part in: numbers must rise
        self.newest_seen = 0  # the newest server version this site was sent
        self.epoch = EpochKeys(self.site, self.identity)  # this process's long-lived keys (one epoch)
        self.book = PeerBook(self.peer_keys)  # the peers' epoch adverts accepted so far

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        upload = upstream(start)  # train, delta, clip
        assert upload.delta is not None, "BufferedSecAggSite runs downstream of Delta and Clip"
        trained_from = start.header.get("version")
        if not isinstance(trained_from, int) or isinstance(trained_from, bool):
            raise FederationError(f"client {self.site}: the server's model carries no version ({trained_from!r})")
        self.newest_seen = max(self.newest_seen, trained_from)
        self._send(P.SA_READY, {"version": trained_from, "epoch_advert": B.advert_fields(self.epoch.advert())})
        msg = self._invitation()
        try:
            invite = check_invite(msg.header, me=self.site, num_sites=self.num_sites, trained_from=trained_from,
                                  last_buffer=self.last_buffer, newest_seen=self.newest_seen)
            self.last_buffer, self.newest_seen = invite.buffer, invite.version
            self._buffer(invite, upload, msg.header.get("adverts"))
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

    def _buffer(self, invite: Invite, upload: Upload, adverts: object) -> None:
        """Weigh and encode the clipped delta, mask it for this buffer, then the unmasking."""
        me, b, spec, n = self.site, invite.buffer, self.spec, self.num_sites
        assert upload.delta is not None
        graph = group_graph([sorted(invite.members)], b, self.degree)
        if not isinstance(adverts, list) or len(adverts) != len(graph[me]):
            raise ProtocolError(f"the server relays {str(adverts)[:20]} as epoch adverts, not one per neighbour in "
                                f"the buffer")
        peers = {}
        for value in adverts:
            adv = B.parse_advert(value, n, "a relayed epoch advert")
            if adv.site not in graph[me] or adv.site in peers:
                raise ProtocolError(f"site {adv.site}: epoch advert relayed twice, or not a neighbour in the buffer")
            peers[adv.site] = self.book.accept(adv)
        state = BufferSite(self.epoch, graph, peers, self.size, invite.context, self.peer_keys)
        weight = self.rule.units(invite.staleness, spec.max_examples)
        codes = masking.encode(upload.delta, weight, spec.max_examples, spec.value_range, spec.levels, upload.scale)
        if self.garbage is not None:  # a hostile site: random field elements in place of its input
            codes = attacks.garbage_input(self.garbage, codes, b)
        metrics = dict(upload.header.get("metrics", {}))
        metrics["secagg_clipped"] = 0.0 if upload.within else 1.0
        metrics["staleness"] = float(invite.staleness)
        y, to, sealed = state.masked_input(codes)
        for _ in range(upload.copies):
            self._send(P.SA_MASKED, {"round": b, "metrics": metrics, "to": to},
                       {W.MASKED_TENSOR: y, W.SHARES_TENSOR: sealed})
        check = self._wait(b, P.SA_CHECK)
        survivors = set(W.site_ids(check.header.get("survivors"), n, "the server's survivor set", me))
        state.open_shares(B.parse_relayed(check.header.get("from"), check.tensors, n, me), survivors)
        fast = check.header.get("fast")
        if type(fast) is not bool:
            raise ProtocolError(f"the server's fast flag is {str(fast)[:20]}, not true or false")
        if fast:
            answers = state.unmask(survivors, set(), None, fast=True)
        else:
            signature = state.sign_survivors(survivors)
            self._send(P.SA_SIGNED, {"round": b, "signature": signature.hex() if signature is not None else None})
            request = self._wait(b, P.SA_UNMASK)
            alive = set(W.site_ids(request.header.get("alive"), n, "the server's alive list", me))
            dropped = set(W.site_ids(request.header.get("dropped"), n, "the server's dropped list", me))
            answers = state.unmask(alive, dropped, W.parse_signatures(request.header.get("signatures"), n, me), False)
        self._send(P.SA_REVEAL, {"round": b, "answers": W.answers_fields(answers)})
