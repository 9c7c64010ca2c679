"""Secure aggregation in a synchronous round, a site's side (the server's is
`hpcfed.server.secagg_round`, which draws the exchange; the protocol is `hpcfed.privacy.secagg`).

After PARAMS the site advertises two fresh X25519 keys (signed with its identity key in keys mode),
checks its neighbours' adverts the server relays, shares its self-mask seed and mask key with them,
trains (the stages upstream of this one clip its delta and encode it in fixed point with its weight:
`hpcfed.client.privacy_stages`), masks that input and sends it; then it signs the survivor set the
server sends (the consistency check) and, told who dropped and given its neighbours' signatures over
the same set, reveals once, per neighbour, a seed share or a key share.
Whatever the server relays is hostile: a bad advert (a forged signature), share, survivor set,
consistency signature or unmask request makes the site refuse the round and leave, naming what was
wrong; it never reveals both shares of one peer. In a group-testing round (PARAMS's
``secagg_groups``) the site checks the groups against its rules (`hpcfed.privacy.group_rules`:
no sum, alone or combined with those it let be revealed before, covers fewer than
``privacy.secagg.min_group`` sites) and masks on its group's graph only. When a round's whole sum
was refused, the server may retry that round in groups (PARAMS's ``secagg_retry``): the site masks
the input it already sent, kept for that one retry, under fresh keys signed as the retry's, without
training again (so the honest groups' sums still move the model in that round).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.client.upload import RoundStart, Stage, Superseded, Upload, Upstream
from hpcfed.comm.api import Channel, Message
from hpcfed.credentials import RankKeys
from hpcfed.errors import FederationError
from hpcfed.privacy import audit
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.group_rules import SiteRules
from hpcfed.privacy.secagg import ProtocolError, SiteState, group_graph, members_graph

log = logging.getLogger("hpcfed.client")

# What ends a stage early: the server moved on (a newer round, the end), or evicted this site.
_SUPERSEDING = frozenset({P.PARAMS, P.FINAL, P.STOP, P.EVICTED})


class SecAggSite(Stage):
    """One site's side of secure aggregation, one round at a time: the upload stage that masks the
    fixed-point input its upstream stages encoded (`hpcfed.client.privacy_stages`) and sends it in
    place of UPDATE. Its keys are exchanged before the site trains (it calls `upstream` after them);
    raises `Superseded` when the server moves on without this site, FederationError when it refuses."""

    def __init__(self, channel: Channel, size: int, *, keys: RankKeys, degree: int | None, min_group: int,
                 timeout_s: float) -> None:
        self.channel, self.timeout_s, self.degree = channel, timeout_s, degree
        self.site, self.num_sites = channel.rank - 1, channel.size - 1
        self.size = size + 1  # the weighted delta and the weight
        self.identity, self.peer_keys = keys.secagg_identities()
        self.next: SiteState | None = None  # the next round's keys, shared ahead with this round's unmasking
        # the sums this site let be revealed, and its rules on a group request (hpcfed.privacy.group_rules)
        self.rules = SiteRules(self.site, self.num_sites, min_group)
        self.groups: tuple[int, list[frozenset[int]]] | None = None  # (round, its groups) of a group round
        self.members: frozenset[int] | None = None  # the round's sites when some are away (None: all)
        self.kept: Upload | None = None  # the last whole-federation round's input, for its one retry in groups

    def __call__(self, start: RoundStart, upstream: Upstream) -> Upload:
        """Take part in round `start.round`; PARAMS's ``secagg_prepared`` says this round's keys and shares
        were exchanged in the last one, its ``secagg_groups`` (hostile, as sent) the disjoint groups a
        group-testing round sums, checked against this site's rules."""
        try:
            retry = self._groups(start)
            return self._round(start, upstream, retry)
        except ProtocolError as exc:
            raise FederationError(f"client {self.site} (rank {self.site + 1}): secure aggregation refused in "
                                  f"round {start.round}: {exc}") from None

    def _groups(self, start: RoundStart) -> bool:
        """Check the round's groups (if any) against the rules; whether the round is a retry."""
        rnd, groups, retry = start.round, start.header.get("secagg_groups"), start.header.get("secagg_retry", False)
        self.groups, kept, self.kept = None, self.kept, None  # a kept input serves one retry of its round at most
        if type(retry) is not bool:
            raise ProtocolError(f"secagg_retry must be true or false, got {str(retry)[:40]}")
        self._members(start)
        if groups is None:
            if retry:  # the same input summed whole twice, less a dropout, would give that site's input
                raise ProtocolError(f"the server retries round {rnd} without groups: a retry sums groups only")
            return False
        if retry and (kept is None or kept.round != rnd):
            raise ProtocolError(f"the server retries round {rnd}, but round {rnd}'s whole sum was not revealed "
                                f"by this site just before (or it was retried already)")
        self.rules.accept(rnd, groups)  # GroupRefused names the rule it would break
        self.groups = (rnd, self.rules.groups[rnd])
        if start.header.get("secagg_prepared") is True:
            raise ProtocolError(f"round {rnd} sums groups, whose keys are set up in the round, yet the server says "
                                f"they were exchanged in round {rnd - 1}")
        self.kept = kept if retry else None
        return retry

    def _members(self, start: RoundStart) -> None:
        """The sites of round `start.round` when some are away (``secagg_members``, hostile, as sent;
        absent: all): this site among them, and at least ``min_group`` of them (a smaller sum would
        tell the server too much). Keys set up ahead were set up among the last round's members."""
        sent = start.header.get("secagg_members")
        members = None if sent is None else frozenset(W.site_ids(sent, self.num_sites, "the server's member list",
                                                                 self.site))
        if members is not None and self.site not in members:
            raise ProtocolError(f"the server's member list for round {start.round} leaves this site out")
        if members is not None and len(members) < self.rules.min_group:
            raise ProtocolError(f"the server's member list for round {start.round} ({sorted(members)}) is smaller "
                                f"than privacy.secagg.min_group={self.rules.min_group}")
        if start.header.get("secagg_prepared") is True and members != self.members:
            raise ProtocolError(f"round {start.round}'s keys were exchanged among the last round's members, "
                                f"yet the server names other members")
        self.members = members

    def _round(self, start: RoundStart, upstream: Upstream, retry: bool) -> Upload:
        rnd, me, n = start.round, self.site, self.num_sites
        state, self.next = self.next, None
        if start.header.get("secagg_prepared") is not True:
            state = self._setup(rnd, retry=retry)
        elif state is None or state.rnd != rnd or not state.adverts:
            raise ProtocolError(f"the server says round {rnd}'s keys were exchanged in round {rnd - 1}, but site "
                                f"{me} shared none for it")
        relayed = self._wait(rnd, P.SA_SHARES_FOR)
        shares = W.parse_shares(me, relayed.header.get("from"), relayed.tensors, n, me, by_sender=True)
        # train, [attack], delta, clip, [noise], encode; a retry masks the input it sent before, no training
        upload = self.kept if retry and self.kept is not None else upstream(start)
        self.kept = None
        assert upload.codes is not None, "SecAggSite runs downstream of an encoding stage"
        # The example count travels masked only: the header keeps the metrics and the checkpoint shard.
        clear: dict[str, Any] = {k: upload.header[k] for k in ("metrics", "shard") if k in upload.header}
        clear["metrics"]["secagg_clipped"] = 0.0 if upload.within else 1.0
        nxt = self._state(rnd + 1)  # fresh keys for the next round, advertised with this round's input
        masked = {"round": rnd, **clear, "next_advert": W.advert_fields(nxt.advertise())}
        y = state.masked_input(shares, upload.codes)
        audit.site_input(me, rnd, upload.codes)  # the chaos soak's record (off by default)
        for _ in range(upload.copies):
            self._send(P.SA_MASKED, masked, {W.MASKED_TENSOR: y})
        self._reveal(rnd, state, nxt)
        if self.groups is None and not retry:
            self.kept = upload  # the server may retry this round in groups if its whole sum is refused
        return upload

    def _reveal(self, rnd: int, state: SiteState, nxt: SiteState | None) -> None:
        """Answer the unmask request of round `rnd`, and share `nxt`'s keys when it relays them (`nxt`
        None: this exchange sets nothing up ahead, and refuses adverts relayed for it)."""
        me, n = self.site, self.num_sites
        check = self._wait(rnd, P.SA_CHECK)
        survivors = set(W.site_ids(check.header.get("survivors"), n, "the server's survivor set", me))
        self.rules.check_survivors(rnd, survivors)  # a group round sums whole groups only
        signature = state.sign_survivors(survivors)
        self._send(P.SA_SIGNED, {"round": rnd, "signature": signature.hex() if signature is not None else None})
        request = self._wait(rnd, P.SA_UNMASK)
        alive = set(W.site_ids(request.header.get("alive"), n, "the server's alive list", me))
        dropped = set(W.site_ids(request.header.get("dropped"), n, "the server's dropped list", me))
        signatures = W.parse_signatures(request.header.get("signatures"), n, me)
        reveal: dict[str, Any] = {"round": rnd, "answers": W.answers_fields(state.unmask(alive, dropped, signatures))}
        self.rules.revealed(rnd, alive)  # the sums the server may now hold: checked against in group rounds
        tensors = None
        if request.header.get("next_adverts") is not None:  # the next round is set up now, off its path
            if nxt is None:
                raise ProtocolError(f"the server relays next adverts with round {rnd}'s unmask request, which sets "
                                    f"nothing up ahead")
            adverts = W.parse_adverts(request.header["next_adverts"], nxt.peers, n, me)
            reveal["next_to"], blob = W.shares_message(nxt.share_keys(adverts), by_sender=False)
            tensors, self.next = {W.SHARES_TENSOR: blob}, nxt
        self._send(P.SA_REVEAL, reveal, tensors)
        if self.next is not None:
            self.next.premask()  # while the server unmasks and sends the next model: off the round's path

    def _state(self, rnd: int, retry: bool = False) -> SiteState:
        graph = group_graph(self.groups[1], rnd, self.degree) if self.groups is not None and self.groups[0] == rnd \
            else members_graph(self.members, self.num_sites, rnd, self.degree)
        return SiteState(self.site, graph, self.size, self.identity, self.peer_keys, rnd, retry)

    def _setup(self, rnd: int, state: SiteState | None = None, retry: bool = False) -> SiteState:
        """Round `rnd`'s keys advertised and shared within the round (the server asked for it); `state`:
        the round's own (a buffer's, `hpcfed.client.secagg_buffer`), else one on the round's graph,
        signed as its retry's when `retry`."""
        state = state or self._state(rnd, retry)
        self._send(P.SA_ADVERT, {"round": rnd, "advert": W.advert_fields(state.advertise())})
        keys = self._wait(rnd, P.SA_KEYS)
        sealed = state.share_keys(W.parse_adverts(keys.header.get("adverts"), state.peers, self.num_sites, self.site))
        ids, blob = W.shares_message(sealed, by_sender=False)
        self._send(P.SA_SHARES, {"round": rnd, "to": ids}, {W.SHARES_TENSOR: blob})
        return state

    def _send(self, kind: int, header: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> None:
        self.channel.send(0, kind, header, tensors)

    def _wait(self, rnd: int, kind: int) -> Message:
        """The server's `kind` message of round `rnd` (one of an earlier round is left unread)."""
        timeout = self.timeout_s
        while True:
            msg = self.channel.recv(source=0, kinds=_SUPERSEDING | {kind}, timeout=timeout)
            if msg is None:
                raise FederationError(f"client {self.site} (rank {self.site + 1}): the server (rank 0) sent no "
                                      f"{P.NAMES[kind]} for {timeout:g} s (federation.client_timeout_s); leaving")
            if msg.kind != kind:
                raise Superseded(msg, "secure aggregation")
            if msg.header.get("round") == rnd:
                return msg
            log.warning("client %d: %s for round %r during round %d, ignored", self.site, P.NAMES[kind],
                        str(msg.header.get("round"))[:20], rnd)
