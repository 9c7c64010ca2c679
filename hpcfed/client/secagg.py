"""Secure aggregation in a synchronous round, a site's side (the server's is
`hpcfed.server.secagg_round`, which draws the exchange; the protocol is `hpcfed.privacy.secagg`).

After PARAMS the site advertises two fresh X25519 keys (signed with its identity key in keys mode),
checks its neighbours' adverts the server relays, shares its self-mask seed and mask key with them,
trains, clips its delta, encodes it in fixed point with its weight, masks it and sends it; then it
signs the survivor set the server sends (the consistency check) and, told who dropped and given its
neighbours' signatures over the same set, reveals once, per neighbour, a seed share or a key share.
Whatever the server relays is hostile: a bad advert (a forged signature), share, survivor set,
consistency signature or unmask request makes the site refuse the round and leave, naming what was
wrong; it never reveals both shares of one peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcfed import protocol as P
from hpcfed.client import attacks
from hpcfed.comm.api import Channel, Message
from hpcfed.config import Config
from hpcfed.errors import FederationError
from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.group_rules import SiteRules
from hpcfed.privacy.secagg import ProtocolError, SiteState, group_graph, round_graph
from hpcfed.privacy.site_input import encode_update, spec_for

log = logging.getLogger("hpcfed.client")

# What ends a stage early: the server moved on (a newer round, the end), or evicted this site.
_SUPERSEDING = frozenset({P.PARAMS, P.FINAL, P.STOP, P.EVICTED})
# fit: () -> (the trained model as the float32 aggregation vector, num_examples, the upload header)
Fit = Callable[[], tuple[np.ndarray, int, dict[str, Any]]]


class Superseded(Exception):
    """The server sent something else while a stage waited: the round is over for this site."""

    def __init__(self, msg: Message) -> None:
        super().__init__(f"{P.NAMES.get(msg.kind, msg.kind)} arrived during secure aggregation")
        self.msg = msg


class SecAggSite:
    """One site's side of secure aggregation, one round at a time."""

    def __init__(self, cfg: Config, channel: Channel, size: int, attack: str | None = None) -> None:
        from hpcfed.credentials import secagg_identities

        self.cfg, self.channel = cfg, channel
        self.site, self.num_sites = channel.rank - 1, channel.size - 1
        self.size = size + 1  # the weighted delta and the weight
        self.identity, self.peer_keys = secagg_identities(cfg.security, channel.rank)
        self.spec = spec_for(cfg.privacy, self.num_sites, cfg.federation.quorum)
        self.uniform = cfg.strategy.options.get("weighting", "num_examples") == "uniform"
        self.attack = attack  # a runtime attack (hpcfed.client.attacks) this malicious site plays on its input
        self.next: SiteState | None = None  # the next round's keys, shared ahead with this round's unmasking
        # the sums this site let be revealed, and its rules on a group request (hpcfed.privacy.group_rules)
        self.rules = SiteRules(self.site, self.num_sites, cfg.privacy.secagg.min_group)
        self.groups: tuple[int, list[frozenset[int]]] | None = None  # (round, its groups) of a group round

    def round(self, rnd: int, sent: np.ndarray, fit: Fit, prepared: bool = False, groups: object = None) -> None:
        """Take part in round `rnd` whose model was `sent` (float32 aggregation vector); `prepared`: the
        server says this round's keys and shares were exchanged in the last one; `groups` (hostile,
        as sent): the disjoint groups a group-testing round sums, checked against this site's rules.
        Raises `Superseded` when the server moves on without this site, FederationError when it refuses."""
        try:
            self.groups = None
            if groups is not None:
                self.rules.accept(rnd, groups)  # GroupRefused names the rule it would break
                self.groups = (rnd, self.rules.groups[rnd])
                if prepared:
                    raise ProtocolError(f"round {rnd} sums groups, whose keys are set up in the round, yet the "
                                        f"server says they were exchanged in round {rnd - 1}")
            self._round(rnd, sent, fit, prepared)
        except ProtocolError as exc:
            raise FederationError(f"client {self.site} (rank {self.site + 1}): secure aggregation refused in "
                                  f"round {rnd}: {exc}") from None

    def _round(self, rnd: int, sent: np.ndarray, fit: Fit, prepared: bool = False) -> None:
        me, n = self.site, self.num_sites
        state, self.next = self.next, None
        if not prepared:
            state = self._setup(rnd)
        elif state is None or state.rnd != rnd or not state.adverts:
            raise ProtocolError(f"the server says round {rnd}'s keys were exchanged in round {rnd - 1}, but site "
                                f"{me} shared none for it")
        relayed = self._wait(rnd, P.SA_SHARES_FOR)
        shares = W.parse_shares(me, relayed.header.get("from"), relayed.tensors, n, me, by_sender=True)
        trained, num_examples, header = fit()
        delta = np.subtract(trained, sent, dtype=np.float64)  # one pass, no float64 copies of the two
        codes, within = self._input(delta, num_examples)
        if self.attack in attacks.GARBAGE_ATTACKS:
            codes = attacks.garbage_input(self.attack, codes, rnd)
        # The example count travels masked only: the header keeps the metrics and the checkpoint shard.
        clear: dict[str, Any] = {k: header[k] for k in ("metrics", "shard") if k in header}
        clear["metrics"]["secagg_clipped"] = 0.0 if within else 1.0
        nxt = self._state(rnd + 1)  # fresh keys for the next round, advertised with this round's input
        masked = {"round": rnd, **clear, "next_advert": W.advert_fields(nxt.advertise())}
        y = state.masked_input(shares, codes)
        for _ in range(attacks.FLOOD_COPIES if self.attack == "flood" else 1):
            self._send(P.SA_MASKED, masked, {W.MASKED_TENSOR: y})
        self._reveal(rnd, state, nxt)

    def _reveal(self, rnd: int, state: SiteState, nxt: SiteState) -> None:
        """Answer the unmask request of round `rnd`, and share `nxt`'s keys when it relays them."""
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
            adverts = W.parse_adverts(request.header["next_adverts"], nxt.peers, n, me)
            reveal["next_to"], blob = W.shares_message(nxt.share_keys(adverts), by_sender=False)
            tensors, self.next = {W.SHARES_TENSOR: blob}, nxt
        self._send(P.SA_REVEAL, reveal, tensors)
        if self.next is not None:
            self.next.premask()  # while the server unmasks and sends the next model: off the round's path

    def _input(self, delta: np.ndarray, num_examples: int) -> tuple[np.ndarray, bool]:
        """The fixed-point input to mask and whether the delta was within C (a malicious site's
        `attack` skips the clip and the count's bound: `attacks.unbounded_input`)."""
        weight = 1 if self.uniform or self.spec.noise_std > 0 else num_examples
        if self.attack in attacks.RUNTIME_ATTACKS:
            return attacks.unbounded_input(delta, weight, self.spec), False
        if not 0 <= weight <= self.spec.max_examples:
            raise FederationError(f"client {self.site}: {num_examples} training examples, outside 0.."
                                  f"privacy.secagg.max_examples={self.spec.max_examples}; raise it on every rank")
        return encode_update(delta, weight, self.spec)

    def _state(self, rnd: int) -> SiteState:
        degree = self.cfg.privacy.secagg.degree
        graph = group_graph(self.groups[1], rnd, degree) if self.groups is not None and self.groups[0] == rnd \
            else round_graph(self.num_sites, rnd, degree)
        return SiteState(self.site, graph, self.size, self.identity, self.peer_keys, rnd)

    def _setup(self, rnd: int) -> SiteState:
        """Round `rnd`'s keys advertised and shared within the round (the server asked for it)."""
        state = self._state(rnd)
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
        timeout = self.cfg.federation.client_timeout_s
        while True:
            msg = self.channel.recv(source=0, kinds=_SUPERSEDING | {kind}, timeout=timeout)
            if msg is None:
                raise FederationError(f"client {self.site} (rank {self.site + 1}): the server (rank 0) sent no "
                                      f"{P.NAMES[kind]} for {timeout:g} s (federation.client_timeout_s); leaving")
            if msg.kind != kind:
                raise Superseded(msg)
            if msg.header.get("round") == rnd:
                return msg
            log.warning("client %d: %s for round %r during round %d, ignored", self.site, P.NAMES[kind],
                        str(msg.header.get("round"))[:20], rnd)
