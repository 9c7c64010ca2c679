"""Secure aggregation: SecAgg (Bonawitz et al., CCS 2017) with SecAgg+ neighbourhoods (Bell et al.,
CCS 2020), as pure state machines; the runtime drives them over the channel (`hpcfed.server.secagg_round`,
`hpcfed.client.secagg`; the wire forms are `hpcfed.privacy.secagg_wire`).

Rounds, each site `u` with neighbours N(u) (an O(log K) random graph from a public seed):
0. advertise: two X25519 public keys, c (to encrypt shares) and s (to agree masks), signed with the
   site's Ed25519 identity key in keys mode, so a server cannot substitute its own keys.
1. share keys: t-of-|N(u)|+1 Shamir shares of a fresh self-mask seed b_u and of s_u's private key,
   each sealed (AES-GCM, key from c-agreement) to one neighbour and relayed by the server.
2. masked input: y_u = x_u + PRG(b_u) + Σ_{v∈N(u), v>u} PRG(k_uv) - Σ_{v<u} PRG(k_uv) mod 2^32.
3. consistency check (Bonawitz et al. 2017, Round 3 "ConsistencyCheck"; Bell et al. 2020 keep it per
   neighbourhood): the server sends every survivor (a site whose y it will sum) the survivor set S;
   each site signs (round, its own agreement keys of the round, sorted S) with its identity key in
   keys mode, once per round: the fresh keys make a signature of another job useless here too.
4. unmask: given S, who dropped (shared, sent no y) and its neighbours' signatures over S, a site
   reveals only when at least t of its neighbours, all in S, validly signed exactly the S it signed;
   then, once, the seed share of each neighbour in S and the key share of each dropped one: never
   both for a peer. The server rebuilds b_u of the alive and s_v of the dropped, removes their
   masks, and learns Σ x_u of the alive sites only.
   Why the signatures: without them each site checks only its own request, so a server could tell
   the target's neighbours "target alive" (its seed shares) and each of those neighbours' other
   neighbours "that neighbour dropped" (their mask keys), and strip every mask of the target's
   input (`tests/privacy/test_secagg_consistency.py` runs that attack). An honest site signs one S
   per round, and t is over half a neighbourhood, so a site's neighbours cannot be split between
   two survivor sets both signed by t of them.
Every message from another party is checked and a bad one refused with `ProtocolError` naming the site.

Keys set up a round ahead. Stages 0 and 1 need nothing of the round's model: the runtime may run
round r+1's with round r's messages (its adverts with the masked inputs, the relayed adverts with
the unmask request, its shares with the unmask answers), so a round costs the masked input, the
consistency check and the unmasking only. What keeps SecAgg's guarantees (Bonawitz et al. 2017, §4;
Bell et al. 2020, §3): each `SiteState` is one round's, with fresh X25519 keys and a fresh self-mask
seed, used for that round only; signatures bind the keys to their round (`Advert.signed_bytes`), so
an advert of another round,
whose key a server may have rebuilt from a dropout's shares, cannot be replayed; the shares of round
r+1 are sealed to the neighbours and cannot be opened by the server whenever they travel; and the
unmask rule of round r (a seed share or a key share per peer, never both) is untouched, each state
signing one survivor set and answering once for its own round (the consistency signature binds
the round too, so one of round r cannot vouch for a set in round r+1).
"""

from __future__ import annotations

import math
import random
import secrets as _secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from hpcfed.privacy import shamir
from hpcfed.privacy.masking import agree, apply_masks

_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw


class ProtocolError(ValueError):
    """A secure aggregation message was refused; the text names the site and what was wrong."""


def neighbours(num_sites: int, seed: bytes, degree: int | None = None) -> dict[int, set[int]]:
    """SecAgg+'s graph: sites on a ring in a public random order, each joined to the `degree` nearest
    (default 2⌈log2 K⌉, all when K is small). Deterministic from `seed`; symmetric."""
    if num_sites < 2:
        raise ValueError(f"secure aggregation needs >= 2 sites, got {num_sites}")
    if degree is None:
        degree = 2 * math.ceil(math.log2(num_sites))
    degree = min(num_sites - 1, degree)
    order = list(range(num_sites))
    random.Random(seed).shuffle(order)  # public: the graph hides nothing, it only has to be agreed
    graph: dict[int, set[int]] = {u: set() for u in order}
    for i, u in enumerate(order):
        for step in range(1, degree // 2 + 1 + degree % 2):
            v = order[(i + step) % num_sites]
            if v != u and len(graph[u]) < degree:
                graph[u].add(v)
                graph[v].add(u)
    return graph


def round_graph(num_sites: int, rnd: int, degree: int | None = None) -> dict[int, set[int]]:
    """The neighbour graph of round `rnd`: public, and computed alike by every rank from the round
    number, so no message carries it and the server cannot pick a graph for one site."""
    return neighbours(num_sites, b"hpcfed-secagg-graph/" + rnd.to_bytes(8, "big"), degree)


def members_graph(members: Iterable[int] | None, num_sites: int, rnd: int,
                  degree: int | None = None) -> dict[int, set[int]]:
    """The graph of round `rnd` among its `members` (None, or all `num_sites`: `round_graph`).

    A federation whose sites come and go (`hpcfed serve`: late, lost, back) sums the sites present
    at the round's start: a graph over all K would leave a present site short of neighbours for as
    long as some of its neighbours are away (with K = 3, for the whole time one site is away). The
    graph is SecAgg+'s over the members, public from the round number and the member list, which
    the server sends and every site checks (this site in it, at least ``min_group`` sites)."""
    chosen = sorted(set(members)) if members is not None else list(range(num_sites))
    if len(chosen) == num_sites:
        return round_graph(num_sites, rnd, degree)
    return group_graph([chosen], rnd, degree)


def group_graph(groups: Iterable[Iterable[int]], rnd: int, degree: int | None = None) -> dict[int, set[int]]:
    """The graph of a group-testing round (`hpcfed.privacy.group_testing`): SecAgg+'s graph within
    each group, no edge between groups, so each group's masks cancel in its own sum. Public from the
    round number and the groups, which every site checks (`hpcfed.privacy.group_rules`)."""
    graph: dict[int, set[int]] = {}
    for members in sorted(sorted(g) for g in groups):
        seed = b"hpcfed-secagg-group/" + rnd.to_bytes(8, "big") + members[0].to_bytes(4, "big")
        for a, peers in neighbours(len(members), seed, degree).items():
            graph[members[a]] = {members[b] for b in peers}
    return graph


def threshold_for(degree: int) -> int:
    """Shares needed of a site's |N(u)| + 1: over half, so two disjoint sets cannot both rebuild."""
    return degree // 2 + 1


CONTEXT_BYTES = 32  # an asynchronous buffer's context: a whole SHA-256 digest (`buffer_consistency_bytes`)

@dataclass(frozen=True)
class Advert:
    """A site's two public keys for one round of secure aggregation (for pairwise masks and for sealing
    shares), signed by its identity key when the run authenticates sites."""

    site: int
    c_public: bytes
    s_public: bytes
    signature: bytes | None = None

    def signed_bytes(self, rnd: int, retry: bool = False) -> bytes:
        """What the site signs: its keys bound to itself and to round `rnd` (and to its retry, when a
        refused round is summed again in groups: `hpcfed.server.secagg_round`), so that a server cannot
        replay an earlier round's or attempt's advert (whose key it may have rebuilt from the shares of
        a dropout)."""
        tag = b"hpcfed-secagg-advert-retry" if retry else b"hpcfed-secagg-advert"
        return tag + rnd.to_bytes(8, "big") + self.site.to_bytes(4, "big") + self.c_public + self.s_public


def consistency_bytes(rnd: int, survivors: Iterable[int], signer: Advert) -> bytes:
    """What a site signs in the consistency check: the round's survivor set, bound to the round and
    to the signer's own fresh agreement keys of this round (its advert), so that a signature of
    another round, or of another job run with the same identity keys, or over another set, does not
    verify (a round number alone repeats from job to job, and rank 0 draws the job id)."""
    return _consistency(b"hpcfed-secagg-consistency", rnd.to_bytes(8, "big"), survivors, signer)


def buffer_consistency_bytes(context: bytes, survivors: Iterable[int], signer: Advert) -> bytes:
    """What a site signs in an asynchronous buffer's consistency check: as `consistency_bytes`, but
    bound to the buffer's whole 32-byte context digest (`hpcfed.privacy.buffered.buffer_context`).
    The signer's epoch keys live across many buffers, so the context alone tells buffers apart: all
    256 bits of it are signed, and a server cannot find two buffers whose signatures interchange."""
    if len(context) != CONTEXT_BYTES:
        raise ValueError(f"a buffer context is {CONTEXT_BYTES} bytes, not {len(context)}")
    return _consistency(b"hpcfed-secagg-buffer-consistency", context, survivors, signer)


def _consistency(tag: bytes, scope: bytes, survivors: Iterable[int], signer: Advert) -> bytes:
    ids = sorted(survivors)
    return (tag + scope + signer.site.to_bytes(4, "big") + signer.c_public + signer.s_public
            + len(ids).to_bytes(4, "big") + b"".join(i.to_bytes(4, "big") for i in ids))


def consistency_verifies(public: bytes | None, signature: bytes | None, rnd: int, survivors: Iterable[int],
                         signer: Advert | None) -> bool:
    """Whether `signature` is `signer`'s identity key (`public`) over round `rnd`'s survivor set
    (`consistency_bytes`); anything missing does not verify."""
    return signer is not None and signature_verifies(public, signature, consistency_bytes(rnd, survivors, signer))


def signature_verifies(public: bytes | None, signature: bytes | None, message: bytes) -> bool:
    """Whether `signature` is the Ed25519 key `public`'s over `message`; anything missing does not."""
    if public is None or signature is None:
        return False
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(signature, message)
    except (InvalidSignature, ValueError):
        return False
    return True


@dataclass(frozen=True)
class SealedShare:
    """One site's secret shares for another, sealed so that the relaying server cannot read them."""

    sender: int
    receiver: int
    blob: bytes  # AES-GCM(nonce || ciphertext) of x || seed share || key share


def _sealing_key(private: X25519PrivateKey, peer_public: bytes, a: int, b: int) -> AESGCM:
    return AESGCM(agree(private, peer_public, a, b, b"share"))


def _aad(sender: int, receiver: int) -> bytes:
    return sender.to_bytes(4, "big") + receiver.to_bytes(4, "big")


class SiteState:
    """One site's side of a secure aggregation round."""

    def __init__(self, site: int, graph: dict[int, set[int]], size: int,
                 identity: Ed25519PrivateKey | None = None, peer_identities: dict[int, bytes] | None = None,
                 rnd: int = 0, retry: bool = False) -> None:
        self.site, self.size, self.rnd, self.retry = site, size, rnd, retry
        self.peers = graph[site]
        self.threshold = threshold_for(len(self.peers))
        self.identity, self.peer_identities = identity, peer_identities
        self.c_key, self.s_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        self.adverts: dict[int, Advert] = {}
        self.held: dict[int, tuple[int, bytes, bytes]] = {}  # sender -> (x, seed share, key share)
        self.seed = b""
        self.answered = False
        self.signed: frozenset[int] | None = None  # the one survivor set this site signed this round
        self._premask: tuple[frozenset[int], np.ndarray] | None = None  # (peers, Σ masks) summed ahead

    def advertise(self) -> Advert:
        """Round 0: my public keys, signed in keys mode."""
        keys = self._keys()
        if self.identity is None:
            return keys
        signature = self.identity.sign(keys.signed_bytes(self.rnd, self.retry))
        return Advert(self.site, keys.c_public, keys.s_public, signature)

    def _keys(self) -> Advert:
        """My public keys of this round, unsigned."""
        c, s = self.c_key.public_key().public_bytes(*_RAW), self.s_key.public_key().public_bytes(*_RAW)
        return Advert(self.site, c, s)

    def share_keys(self, adverts: dict[int, Advert]) -> list[SealedShare]:
        """Round 1: check the neighbours' keys, share my self-mask seed and mask key, sealed to each."""
        for peer, adv in adverts.items():
            if peer not in self.peers or adv.site != peer:
                raise ProtocolError(f"site {self.site}: advert of site {adv.site} relayed as {peer}, not a neighbour")
            self._check_signature(adv)
        if len(adverts) < self.threshold:  # one share per advertised neighbour: fewer cannot rebuild the secrets
            raise ProtocolError(f"site {self.site}: only {len(adverts)} neighbours advertised, "
                                f"fewer than the threshold {self.threshold} needs")
        self.adverts = dict(adverts)
        self.seed = _secrets.token_bytes(32)
        key_raw = self.s_key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
        holders = sorted(self.adverts)
        seed_shares = shamir.split(self.seed, self.threshold, len(holders))
        key_shares = shamir.split(key_raw, self.threshold, len(holders))
        out = []
        for peer, (x, ys), (_, yk) in zip(holders, seed_shares, key_shares):
            nonce = _secrets.token_bytes(12)
            sealed = _sealing_key(self.c_key, self.adverts[peer].c_public, self.site, peer).encrypt(
                nonce, x.to_bytes(4, "big") + ys + yk, _aad(self.site, peer))
            out.append(SealedShare(self.site, peer, nonce + sealed))
        return out

    def _check_signature(self, adv: Advert) -> None:
        if self.peer_identities is None:
            return
        public = self.peer_identities.get(adv.site)
        if public is None or adv.signature is None:
            raise ProtocolError(f"site {adv.site}: its agreement keys carry no signature from a known identity")
        try:
            Ed25519PublicKey.from_public_bytes(public).verify(adv.signature, adv.signed_bytes(self.rnd, self.retry))
        except InvalidSignature:
            raise ProtocolError(f"site {adv.site}: forged agreement key for round {self.rnd} (signature does not "
                                f"verify: substituted, or replayed from another round or attempt)") from None

    def masked_input(self, shares: list[SealedShare], codes: np.ndarray) -> np.ndarray:
        """Round 2: open the shares sent to me, then my fixed-point `codes` masked mod 2^32."""
        for sh in shares:
            if sh.receiver != self.site:
                raise ProtocolError(f"site {sh.sender}: share addressed to site {sh.receiver} was sent to {self.site}")
            if sh.sender not in self.adverts or sh.sender in self.held:
                raise ProtocolError(f"site {sh.sender}: share from a site that did not advertise to {self.site}, "
                                    f"or a second one")
            try:
                plain = _sealing_key(self.c_key, self.adverts[sh.sender].c_public, self.site, sh.sender).decrypt(
                    sh.blob[:12], sh.blob[12:], _aad(sh.sender, self.site))
            except Exception:
                raise ProtocolError(f"site {sh.sender}: its share to site {self.site} does not open") from None
            if len(plain) != 4 + 2 * shamir.SHARE_BYTES:
                raise ProtocolError(f"site {sh.sender}: share of {len(plain)} bytes")
            n = shamir.SHARE_BYTES
            self.held[sh.sender] = (int.from_bytes(plain[:4], "big"), plain[4:4 + n], plain[4 + n:])
        if len(self.held) + 1 < self.threshold:
            raise ProtocolError(f"site {self.site}: shares from only {len(self.held)} neighbours, under the threshold")
        if codes.shape != (self.size,) or codes.dtype != np.uint32:
            raise ValueError(f"site {self.site}: input must be uint32 ({self.size},), got {codes.dtype} {codes.shape}")
        premasked, self._premask = self._premask, None
        if premasked is not None and premasked[0] == frozenset(self.held):
            y = premasked[1]  # the masks were summed while the site waited: one addition left
            np.add(y, codes, out=y)
            return y
        y = codes.copy()
        apply_masks(y, self._masks(self.held))  # only neighbours whose shares came: the others are dropped
        return y

    def premask(self) -> None:
        """Sum my masks ahead (after share_keys, while the site waits for its round to start), for the
        case that every advertised neighbour's shares come; `masked_input` then only adds the input.
        Masks depend on keys alone, never on the input: computing them early reveals nothing."""
        if not self.seed:
            raise ProtocolError(f"site {self.site}: masks summed before the keys were shared")
        total = np.zeros(self.size, dtype=np.uint32)
        apply_masks(total, self._masks(self.adverts))
        self._premask = (frozenset(self.adverts), total)

    def _masks(self, peers: Iterable[int]) -> list[tuple[bytes, bytes, int]]:
        """(key, label, sign) of my self mask and my pairwise masks with `peers`."""
        masks = [(self.seed, b"self", 1)]
        for peer in peers:
            k = agree(self.s_key, self.adverts[peer].s_public, self.site, peer, b"mask")
            masks.append((k, b"pair", 1 if peer > self.site else -1))
        return masks

    def sign_survivors(self, survivors: set[int]) -> bytes | None:
        """Round 3, the consistency check: sign the survivor set the server will sum (keys mode; psk
        mode has no per-site key and returns None, remembering the set all the same). Once per round,
        and only a set that holds this site and enough of its neighbours to unmask at all."""
        if self.signed is not None:
            raise ProtocolError(f"server asked site {self.site} to sign a second survivor set in round {self.rnd}; "
                                f"a site signs one per round: refused")
        if not self.seed:
            raise ProtocolError(f"site {self.site}: asked to sign a survivor set before it shared its keys")
        if self.site not in survivors:
            raise ProtocolError(f"server sent site {self.site} a survivor set without it, yet asks it to sign: "
                                f"refused")
        if len(survivors & (set(self.held) | {self.site})) < self.threshold:
            raise ProtocolError(f"site {self.site}: fewer than {self.threshold} of its neighbourhood survive: "
                                f"unmasking would reveal too much; refuses to sign")
        self.signed = frozenset(survivors)
        if self.identity is None:
            return None
        return self.identity.sign(consistency_bytes(self.rnd, self.signed, self._keys()))

    def unmask(self, alive: set[int], dropped: set[int],
               signatures: Mapping[int, bytes | None] | None = None) -> dict[int, tuple[str, int, bytes]]:
        """Round 4: for each neighbour that shared, its seed share if alive, its key share if dropped;
        once, and only for the survivor set `alive` this site signed, when (keys mode) at least its
        threshold of neighbours, all in it, signed the same set (`signatures`, relayed by the server)."""
        if self.answered:
            raise ProtocolError(f"site {self.site}: asked to unmask a second time; a site answers once")
        both = alive & dropped
        if both:
            raise ProtocolError(f"server asked site {self.site} to unmask site {min(both)}, which it calls alive "
                                f"and dropped: refused")
        if self.site not in alive:
            raise ProtocolError(f"server says site {self.site} dropped, yet asks it to unmask: refused")
        if self.signed is None:
            raise ProtocolError(f"server asked site {self.site} to unmask before it signed the survivor set: refused")
        if alive != self.signed:
            odd = min(alive ^ self.signed)
            raise ProtocolError(f"server asked site {self.site} to unmask with a survivor set other than the one it "
                                f"signed (site {odd} is in one and not the other): refused")
        if len(alive & (set(self.held) | {self.site})) < self.threshold:
            raise ProtocolError(f"site {self.site}: fewer than {self.threshold} alive: unmasking would reveal too much")
        if self.peer_identities is not None:
            self._check_consistency(signatures or {})
        self.answered = True
        out = {}
        for peer, (x, seed_share, key_share) in self.held.items():
            if peer in alive:
                out[peer] = ("seed", x, seed_share)
            elif peer in dropped:
                out[peer] = ("key", x, key_share)
        return out

    def _check_consistency(self, signatures: Mapping[int, bytes | None]) -> None:
        """At least `threshold` neighbours, each in the signed set, signed exactly it for this round.
        Any signature that does not verify is refused, naming its site: an honest server checks each
        on arrival and forwards only good ones, so a bad one here is the server's doing."""
        assert self.peer_identities is not None and self.signed is not None
        for peer, signature in sorted(signatures.items()):
            if peer not in self.peers:
                raise ProtocolError(f"site {peer}: consistency signature relayed to site {self.site}, which is not "
                                    f"its neighbour: refused")
            if peer not in self.signed:
                raise ProtocolError(f"site {peer}: consistency signature relayed to site {self.site}, but site {peer} "
                                    f"is not in the survivor set: refused")
            if not consistency_verifies(self.peer_identities.get(peer), signature, self.rnd, self.signed,
                                        self.adverts.get(peer)):
                raise ProtocolError(f"site {peer}: its consistency signature relayed to site {self.site} does not "
                                    f"verify for round {self.rnd} over the survivor set site {self.site} signed "
                                    f"(forged, or over another set or round): refused")
        if len(signatures) < self.threshold:
            missing = ", ".join(map(str, sorted(self.peers & self.signed - set(signatures)))) or "none"
            raise ProtocolError(f"site {self.site}: only {len(signatures)} of its neighbours signed the survivor set, "
                                f"fewer than the threshold {self.threshold}; unsigned neighbours in the set: "
                                f"{missing}: refuses to unmask")
