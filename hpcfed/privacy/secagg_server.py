"""Secure aggregation on rank 0 (the protocol is in `hpcfed.privacy.secagg`): it relays the sites'
adverts and sealed shares, sums their masked inputs, runs the consistency check, and rebuilds from
the unmask answers only the masks it needs, so it learns the sum of the alive sites' inputs only."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from hpcfed.privacy import shamir
from hpcfed.privacy.masking import agree, apply_masks
from hpcfed.privacy.secagg import (
    Advert,
    ProtocolError,
    SealedShare,
    consistency_verifies,
    threshold_for,
)


@dataclass(frozen=True)
class Shortfall:
    """A mask the alive sites cannot rebuild: the round's sum cannot be unmasked (`ServerState.shortfall`)."""

    site: int
    kind: str  # "seed": an alive site's self mask; "key": a dropped site's mask key
    threshold: int
    holders: frozenset[int]  # the alive sites holding a share of it
    neighbourhood: frozenset[int]  # the site's neighbours in the round's graph

    def describe(self) -> str:
        what = "self-mask seed" if self.kind == "seed" else "mask key (it dropped after sharing it)"
        held = ", ".join(map(str, sorted(self.holders))) or "none"
        return (f"site {self.site}'s {what} needs {self.threshold} shares, but only {len(self.holders)} alive "
                f"neighbour(s) hold one ({held}); its neighbourhood: sites "
                f"{', '.join(map(str, sorted(self.neighbourhood)))}")


class ServerState:
    """The relay and the unmasking on rank 0: it learns the sum of the alive sites' inputs only."""

    def __init__(self, graph: dict[int, set[int]], size: int, rnd: int = 0) -> None:
        self.graph, self.size, self.rnd = graph, size, rnd
        self.adverts: dict[int, Advert] = {}
        self.shares: dict[int, list[SealedShare]] = {}  # receiver -> shares for it
        self.shared: set[int] = set()
        self.masked: dict[int, np.ndarray] = {}
        self.total = np.zeros(size, dtype=np.uint32)  # Σ masked inputs so far
        self.answers: dict[int, dict[int, tuple[str, int, bytes]]] = {}
        self.survivors: frozenset[int] | None = None  # the set the sites are asked to sign; fixed once sent
        self.signatures: dict[int, bytes | None] = {}  # site -> its signature over `survivors` (None: psk mode)

    def take_advert(self, site: int, adv: Advert) -> None:
        if site not in self.graph or adv.site != site or site in self.adverts:
            raise ProtocolError(f"site {site}: advert refused (unknown, claims site {adv.site}, or a second one)")
        self.adverts[site] = adv

    def leave_out_short(self) -> set[int]:
        """Before relaying the adverts: leave out of the round every site fewer than its threshold of
        whose neighbours advertised (they ended, or are silent), until none is left short: such a
        site could not share its keys (each share goes to one advertised neighbour), and would have
        to refuse the round. It sits this round out, with nothing shared; the sites left out."""
        out: set[int] = set()
        while short := {u for u in self.adverts
                        if len(self.graph[u] & set(self.adverts)) < threshold_for(len(self.graph[u]))}:
            for u in short:
                del self.adverts[u]
            out |= short
        return out

    def adverts_for(self, site: int) -> dict[int, Advert]:
        return {v: self.adverts[v] for v in self.graph[site] if v in self.adverts}

    def take_shares(self, site: int, shares: list[SealedShare]) -> None:
        expected = {v for v in self.graph[site] if v in self.adverts}
        if site in self.shared:
            raise ProtocolError(f"site {site}: a second set of shares")
        if len(shares) != len(expected):
            raise ProtocolError(f"site {site}: sent {len(shares)} shares, {len(expected)} neighbours advertised")
        if {sh.receiver for sh in shares} != expected or any(sh.sender != site for sh in shares):
            raise ProtocolError(f"site {site}: shares addressed to sites that are not its advertised neighbours")
        self.shared.add(site)
        for sh in shares:
            self.shares.setdefault(sh.receiver, []).append(sh)

    def shares_for(self, site: int) -> list[SealedShare]:
        return [sh for sh in self.shares.get(site, []) if sh.sender in self.shared]

    def take_masked(self, site: int, y: np.ndarray) -> None:
        if site not in self.shared:
            raise ProtocolError(f"site {site}: masked input from a site that shared no keys")
        if site in self.masked or y.shape != (self.size,) or y.dtype != np.uint32:
            raise ProtocolError(f"site {site}: masked input refused (a second one, or not uint32 ({self.size},))")
        self.masked[site] = y
        np.add(self.total, y, out=self.total)  # summed on arrival (uint32: mod 2^32), off the unmasking's path

    def withdraw(self, site: int) -> None:
        """Leave `site`'s masked input out of the sum (it was evicted since): it counts as dropped."""
        y = self.masked.pop(site)
        np.subtract(self.total, y, out=self.total)

    def survivor_set(self) -> frozenset[int]:
        """The consistency check's set: the sites whose masked input is summed. Fixed from now on."""
        if self.survivors is None:
            self.survivors = frozenset(self.masked)
        return self.survivors

    def take_signature(self, site: int, signature: bytes | None, identities: dict[int, bytes] | None) -> None:
        """A survivor's signature over the survivor set, checked against its identity key (keys
        mode), so that a site's bad signature costs that site, never the honest neighbours it is
        forwarded to (they would refuse the round)."""
        survivors = self.survivor_set()
        if site not in survivors or site in self.signatures:
            raise ProtocolError(f"site {site}: consistency signature from a site outside the survivor set, or a "
                                f"second one")
        if identities is not None and not consistency_verifies(identities.get(site), signature, self.rnd,
                                                                 survivors, self.adverts.get(site)):
            raise ProtocolError(f"site {site}: its consistency signature does not verify over round {self.rnd}'s "
                                f"survivor set")
        self.signatures[site] = signature

    def signatures_for(self, site: int) -> dict[int, bytes | None]:
        """The signatures of `site`'s neighbours, forwarded to it with the unmask request."""
        return {v: self.signatures[v] for v in sorted(self.graph[site]) if v in self.signatures}

    def answering(self) -> set[int]:
        """The survivors that signed and hold at least their threshold of neighbours' signatures: the
        only sites that will answer the unmask request (the others refuse, as they must)."""
        return {u for u in self.signatures
                if len(self.graph[u] & set(self.signatures)) >= threshold_for(len(self.graph[u]))}

    def unmask_request(self) -> tuple[set[int], set[int]]:
        """Alive: sent a masked input; dropped: shared keys, sent no masked input."""
        return set(self.masked), self.shared - set(self.masked)

    def take_unmask(self, site: int, answers: dict[int, tuple[str, int, bytes]]) -> None:
        alive, dropped = self.unmask_request()
        if site not in alive or site in self.answers or (self.survivors is not None and site not in self.signatures):
            raise ProtocolError(f"site {site}: unmask answer from a site that is not alive, did not sign the "
                                f"survivor set, or a second one")
        for peer, (kind, _, _) in answers.items():
            want = "seed" if peer in alive else "key" if peer in dropped else None
            if peer not in self.graph[site] or kind != want:
                raise ProtocolError(f"site {site}: {kind} share for site {peer}, expected {want}")
        self.answers[site] = answers

    def holders(self) -> dict[int, set[int]]:
        """Per site that shared: the alive sites holding its shares, the only ones that will answer for it."""
        alive = set(self.masked)
        out: dict[int, set[int]] = {v: set() for v in self.shared}
        for h in alive:
            for v in self._peers_of(h):
                out.setdefault(v, set()).add(h)
        return out

    def shortfall(self, answering: set[int] | None = None) -> Shortfall | None:
        """Before the unmasking: the first site whose self-mask seed (alive) or mask key (dropped, its
        masks in some alive input) fewer than its threshold of the sites that will answer (`answering`,
        default: all alive) hold a share of; then the sum cannot be unmasked and asking for the shares
        would only reveal some for nothing. None when every mask can be rebuilt, provided they answer."""
        alive, dropped = self.unmask_request()
        holders = self.holders()
        for site in sorted(alive | dropped):
            held = holders.get(site, set())
            if site in dropped and not held:
                continue  # no alive site masked with it: nothing of it to remove
            if answering is not None:
                held = held & answering
            t = threshold_for(len(self.graph[site]))
            if len(held) < t:
                return Shortfall(site, "seed" if site in alive else "key", t, frozenset(held),
                                 frozenset(self.graph[site]))
        return None

    def result(self) -> tuple[np.ndarray, set[int]]:
        """The unwrapped uint32 sum of the alive sites' inputs, and who they are."""
        alive, dropped = self.unmask_request()
        masks = [(self._rebuild(u, "seed"), b"self", -1) for u in alive]
        holders = self.holders()
        for v in dropped:
            if not holders.get(v):
                continue  # its shares went to no alive site, so its masks are in no alive input
            s_v = X25519PrivateKey.from_private_bytes(self._rebuild(v, "key"))
            for u in self.graph[v] & alive:
                if v not in self._peers_of(u):
                    continue
                # undo what u added for its pair with v: u added the mask when v > u, subtracted it otherwise
                masks.append((agree(s_v, self.adverts[u].s_public, v, u, b"mask"), b"pair", -1 if v > u else 1))
        total = self.total.copy()
        apply_masks(total, masks)
        return total, alive

    def sum_of(self, group: frozenset[int]) -> np.ndarray:
        """The unwrapped uint32 sum of one group's inputs in a group-testing round (`group_graph`:
        no edge leaves the group, so its pairwise masks cancel in its own sum; no dropout in it)."""
        if not group <= set(self.masked) or any(self.graph[u] - group for u in group):
            raise ProtocolError(f"group {sorted(group)} is not whole in round {self.rnd}, or its masks leave it")
        total = np.zeros(self.size, dtype=np.uint32)
        for u in group:
            np.add(total, self.masked[u], out=total)
        apply_masks(total, [(self._rebuild(u, "seed"), b"self", -1) for u in group])
        return total

    def _peers_of(self, u: int) -> set[int]:
        return {sh.sender for sh in self.shares_for(u)}

    def _rebuild(self, peer: int, kind: str) -> bytes:
        shares = [(x, y) for ans in self.answers.values() for p, (k, x, y) in ans.items() if p == peer and k == kind]
        t = threshold_for(len(self.graph[peer]))
        try:
            return shamir.combine(shares, t)
        except ValueError as exc:
            raise ProtocolError(f"site {peer}: its {kind} cannot be rebuilt ({exc})") from None
