"""Secure aggregation of asynchronous buffers on long-lived keys, the pure part: a key epoch's signed
advert, and one buffer's state at a site (`BufferSite`) and on rank 0 (`BufferServer`). The runtime
is `hpcfed.client.secagg_buffer` and `hpcfed.server.secagg_buffer`; the invitation's checks and the
staleness weight are `hpcfed.privacy.buffered`.

The stages are SecAgg's (Bonawitz et al., CCS 2017) on SecAgg+'s neighbourhoods (Bell et al., CCS 2020),
with the key set-up moved out of the buffer:

- **Key epoch.** A site makes two X25519 keys (c: to seal shares, s: to agree masks) once per
  process, numbers the epoch by its creation time in µs (a restarted or rejoining site's keys are
  newer than any it had) and signs (epoch, site, c, s) with its Ed25519 identity in keys mode
  (`EpochAdvert`). It sends the advert with every SA_READY; the server relays the members' adverts
  with the buffer's invitation. A site accepts a peer's advert only when it verifies, is not older
  than the epoch it already holds for that peer (a replayed advert) and, in the same epoch, has the
  same keys (`PeerBook`).
- **Per-buffer masks from the epoch's secrets.** For buffer b with context c_b (its number, version
  and members, hashed: `buffer_context`), the pair (u, v) masks with
  ``m_uv = HKDF(X25519(s_u, s_v), c_b, both epochs)``, so no two buffers share a mask, and u adds
  ``PRG(b_u) ± Σ PRG(m_uv)``; the self-mask seed b_u is fresh random per buffer.
- **One upload.** The masked input carries t-of-(|N(u)|+1) Shamir shares of b_u, each sealed to one
  neighbour with AES-GCM under ``HKDF(X25519(c_u, c_v))``, the buffer's context and both epochs as
  associated data: a share is opened only in its buffer and only under the epochs it was made in.
- **The unmasking.** The survivors S are the members whose masked input rank 0 holds and that are
  still live; the others are dropped, even one that uploaded and then died (its upload is left out).
  Rank 0 relays the seed shares sent to each survivor with S. When no member dropped (S = all
  members) the survivors reveal at once, each a seed share per neighbour; otherwise the consistency
  check runs first (each survivor signs (c_b, its epoch keys, S) once; a site reveals only when at
  least t of its neighbours, all in S, signed exactly its S), then each reveals, per neighbour, its
  seed share when the neighbour is in S, its pair mask seed m_uv of this buffer when it dropped:
  never both for one peer, and once per buffer.

Why the long-lived keys keep SecAgg's guarantees: rank 0 never rebuilds a site's private key (what
SecAgg's dropout recovery does), only one buffer's pair seeds, which are HKDF outputs that say
nothing of the epoch secret or of another buffer's seeds; so no key has to be rotated after a
dropout, and a buffer's secrets are its own. To learn x_u, rank 0 needs b_u (t seed shares, from
neighbours that answered with u in S) and every m_uw (from w, told u dropped, or from u, told w
dropped). Each site answers once per buffer, so a neighbour cannot give both; and u reveals m_uw only
once t neighbours signed its S, which w's answer with u dropped (a set without u, signed by w)
cannot be. The fast answer (no one dropped) reveals seed shares only and commits the site to S = all
members, as a signature would: it answers, and signs, nothing else in that buffer. The cost against
SecAgg's recovery: a dropped site's pair masks need every one of its surviving neighbours to answer
(not any t), so a second loss in the same neighbourhood during the unmasking loses the buffer.
LightSecAgg (So et al., 2022), whose encoded masks let the server rebuild the aggregate mask of any
subset in one shot, is the alternative this design did not take.
"""

from __future__ import annotations

import secrets as _secrets
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from hpcfed.privacy import shamir
from hpcfed.privacy.masking import apply_masks
from hpcfed.privacy.secagg import Advert, ProtocolError, buffer_consistency_bytes, signature_verifies, threshold_for

_RAW = serialization.Encoding.Raw, serialization.PublicFormat.Raw
SEALED_BYTES = 12 + 4 + shamir.SHARE_BYTES + 16  # nonce || AES-GCM(x || seed share) || tag


@dataclass(frozen=True)
class EpochAdvert:
    """A site's long-lived public keys of one epoch, signed by its identity in keys mode."""

    site: int
    epoch: int
    c_public: bytes
    s_public: bytes
    signature: bytes | None = None

    def signed_bytes(self) -> bytes:
        """What the site signs: its keys bound to itself and to the epoch (never to a buffer)."""
        return (b"hpcfed-secagg-epoch" + self.epoch.to_bytes(8, "big") + self.site.to_bytes(4, "big")
                + self.c_public + self.s_public)

    def keys(self) -> Advert:
        """As the consistency check binds a signer's keys (`buffer_consistency_bytes`)."""
        return Advert(self.site, self.c_public, self.s_public)


class EpochKeys:
    """A site's keys of one epoch, and the agreements with its peers' epochs (computed once each)."""

    def __init__(self, site: int, identity: Ed25519PrivateKey | None, epoch: int | None = None) -> None:
        self.site, self.identity = site, identity
        self.epoch = epoch if epoch is not None else time.time_ns() // 1000
        self.c_key, self.s_key = X25519PrivateKey.generate(), X25519PrivateKey.generate()
        self._agreed: dict[tuple[bytes, bytes], bytes] = {}

    def advert(self) -> EpochAdvert:
        """My public keys of this epoch, signed in keys mode."""
        adv = EpochAdvert(self.site, self.epoch, self.c_key.public_key().public_bytes(*_RAW),
                          self.s_key.public_key().public_bytes(*_RAW))
        if self.identity is None:
            return adv
        return EpochAdvert(adv.site, adv.epoch, adv.c_public, adv.s_public, self.identity.sign(adv.signed_bytes()))

    def derive(self, peer: EpochAdvert, purpose: bytes, context: bytes) -> bytes:
        """32 bytes this site and `peer` share for `purpose` in `context` (symmetric in the two)."""
        own, theirs = (self.c_key, peer.c_public) if purpose == b"seal" else (self.s_key, peer.s_public)
        cache = (purpose, theirs)
        if cache not in self._agreed:
            self._agreed[cache] = own.exchange(X25519PublicKey.from_public_bytes(theirs))
        (lo, lo_epoch), (hi, hi_epoch) = sorted([(self.site, self.epoch), (peer.site, peer.epoch)])
        info = (b"hpcfed-secagg-epoch/" + purpose + lo.to_bytes(4, "big") + lo_epoch.to_bytes(8, "big")
                + hi.to_bytes(4, "big") + hi_epoch.to_bytes(8, "big") + context)
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(self._agreed[cache])


class PeerBook:
    """The epoch adverts a party accepted, per site: a replayed (older) advert, or other keys under
    an epoch already accepted, are refused; a newer epoch replaces the old one."""

    def __init__(self, identities: Mapping[int, bytes] | None) -> None:
        self.identities, self.adverts = identities, dict[int, EpochAdvert]()

    def accept(self, adv: EpochAdvert) -> EpochAdvert:
        if self.identities is not None:
            public = self.identities.get(adv.site)
            try:
                if public is None or adv.signature is None:
                    raise InvalidSignature
                Ed25519PublicKey.from_public_bytes(public).verify(adv.signature, adv.signed_bytes())
            except InvalidSignature:
                raise ProtocolError(f"site {adv.site}: its epoch keys carry no valid signature of its identity "
                                    f"(forged or substituted)") from None
        known = self.adverts.get(adv.site)
        if known is not None and adv.epoch < known.epoch:
            raise ProtocolError(f"site {adv.site}: epoch advert {adv.epoch} is older than its epoch {known.epoch} "
                                f"already accepted (a replayed epoch advertisement): refused")
        if known is not None and adv.epoch == known.epoch and adv.keys() != known.keys():
            raise ProtocolError(f"site {adv.site}: other keys under its epoch {adv.epoch}: refused")
        self.adverts[adv.site] = adv
        return adv


def _aad(context: bytes, sender: EpochAdvert | EpochKeys, receiver: EpochAdvert | EpochKeys) -> bytes:
    return (context + sender.site.to_bytes(4, "big") + sender.epoch.to_bytes(8, "big")
            + receiver.site.to_bytes(4, "big") + receiver.epoch.to_bytes(8, "big"))


class BufferSite:
    """One site's side of one buffer: mask (with its sealed seed shares), sign, reveal once."""

    def __init__(self, keys: EpochKeys, graph: dict[int, set[int]], peers: Mapping[int, EpochAdvert], size: int,
                 context: bytes, peer_identities: Mapping[int, bytes] | None = None) -> None:
        self.keys, self.site, self.size, self.context = keys, keys.site, size, context
        self.members = frozenset(graph)
        self.neighbours = graph[self.site]
        if set(peers) != self.neighbours:
            raise ProtocolError(f"site {self.site}: epoch adverts relayed for sites {sorted(peers)}, not its "
                                f"neighbours {sorted(self.neighbours)} in the buffer")
        self.peers, self.peer_identities = dict(peers), peer_identities
        self.threshold = threshold_for(len(self.neighbours))
        self.seed = _secrets.token_bytes(32)  # b_u: fresh for this buffer
        self.held: dict[int, tuple[int, bytes]] = {}  # sender -> (x, its seed share)
        self.signed: frozenset[int] | None = None
        self.answered = False

    def pair_seed(self, peer: int) -> bytes:
        """m_uv of this buffer."""
        return self.keys.derive(self.peers[peer], b"mask", self.context)

    def masked_input(self, codes: np.ndarray) -> tuple[np.ndarray, list[int], np.ndarray]:
        """y = codes + PRG(b_u) ± Σ PRG(m_uv) mod 2^32, and the seed's shares sealed to each neighbour
        (their ids and one (m, SEALED_BYTES) uint8 tensor)."""
        if codes.shape != (self.size,) or codes.dtype != np.uint32:
            raise ValueError(f"site {self.site}: input must be uint32 ({self.size},), got {codes.dtype} {codes.shape}")
        y = codes.copy()
        masks = [(self.seed, b"self", 1)]
        masks += [(self.pair_seed(v), b"pair", 1 if v > self.site else -1) for v in sorted(self.neighbours)]
        apply_masks(y, masks)
        holders = sorted(self.neighbours)
        blobs = []
        for peer, (x, share) in zip(holders, shamir.split(self.seed, self.threshold, len(holders))):
            adv, nonce = self.peers[peer], _secrets.token_bytes(12)
            sealed = AESGCM(self.keys.derive(adv, b"seal", self.context)).encrypt(
                nonce, x.to_bytes(4, "big") + share, _aad(self.context, self.keys, adv))
            blobs.append(np.frombuffer(nonce + sealed, dtype=np.uint8))
        return y, holders, np.stack(blobs)

    def open_shares(self, relayed: Mapping[int, tuple[int, bytes]], survivors: set[int]) -> None:
        """The seed shares of the survivors among my neighbours (sender -> (its epoch, sealed)), relayed
        with the survivor set: one from each, under the epoch I accepted for it in this buffer."""
        if not survivors <= self.members or self.site not in survivors:
            raise ProtocolError(f"site {self.site}: the survivor set {sorted(survivors)} names a site outside the "
                                f"buffer {sorted(self.members)}, or leaves this site out: refused")
        if set(relayed) != self.neighbours & survivors:
            odd = min(set(relayed) ^ (self.neighbours & survivors))
            raise ProtocolError(f"site {self.site}: the server relays seed shares that do not match its survivor set "
                                f"(site {odd}: a survivor without a share, or a share from a site not a surviving "
                                f"neighbour): refused")
        for sender, (epoch, blob) in relayed.items():
            adv = self.peers[sender]
            if epoch != adv.epoch:
                raise ProtocolError(f"site {sender}: seed share for epoch {epoch}, not its epoch {adv.epoch} "
                                    f"in this buffer (an unknown epoch): refused")
            try:
                plain = AESGCM(self.keys.derive(adv, b"seal", self.context)).decrypt(
                    blob[:12], blob[12:], _aad(self.context, adv, self.keys))
            except Exception:
                raise ProtocolError(f"site {sender}: its seed share to site {self.site} does not open in this "
                                    f"buffer (made for another buffer, epoch or site)") from None
            self.held[sender] = (int.from_bytes(plain[:4], "big"), plain[4:])

    def sign_survivors(self, survivors: set[int]) -> bytes | None:
        """The consistency check: sign (this buffer, my epoch keys, S) once (None in psk mode)."""
        if self.signed is not None or self.answered:
            raise ProtocolError(f"site {self.site}: asked to sign a second survivor set in one buffer: refused")
        if len(survivors & (self.neighbours | {self.site})) < self.threshold:
            raise ProtocolError(f"site {self.site}: fewer than {self.threshold} of its neighbourhood survive: "
                                f"refuses to sign")
        self.signed = frozenset(survivors)
        if self.keys.identity is None:
            return None
        return self.keys.identity.sign(buffer_consistency_bytes(self.context, self.signed, self.keys.advert().keys()))

    def unmask(self, alive: set[int], dropped: set[int], signatures: Mapping[int, bytes] | None,
               fast: bool) -> dict[int, tuple[str, int, bytes]]:
        """Per neighbour: its seed share when in `alive`, our pair seed of this buffer when `dropped`;
        once. `fast`: no one dropped, and no check ran (alive must be every member)."""
        if self.answered:
            raise ProtocolError(f"site {self.site}: asked to unmask a second time in one buffer: refused")
        if alive & dropped or alive | dropped != self.members:
            raise ProtocolError(f"site {self.site}: the survivor set {sorted(alive)} and the dropped {sorted(dropped)} "
                                f"overlap or do not make up the buffer {sorted(self.members)}: refused")
        if fast:
            if dropped or self.signed is not None:
                raise ProtocolError(f"site {self.site}: an unchecked unmask request with sites dropped, or after "
                                    f"this site signed a survivor set: refused")
            self.signed = frozenset(alive)  # committed to S = all members, as if signed
        elif self.signed != alive:
            raise ProtocolError(f"site {self.site}: unmask request for a survivor set other than the one it signed: "
                                f"refused")
        elif self.peer_identities is not None:
            self._check_consistency(signatures or {})
        if set(self.held) != self.neighbours & alive:
            raise ProtocolError(f"site {self.site}: asked to unmask before holding every surviving neighbour's share")
        self.answered = True
        out: dict[int, tuple[str, int, bytes]] = {p: ("seed", x, share) for p, (x, share) in self.held.items()}
        out.update({p: ("pair", 0, self.pair_seed(p)) for p in self.neighbours & dropped})
        return out

    def _check_consistency(self, signatures: Mapping[int, bytes]) -> None:
        assert self.peer_identities is not None and self.signed is not None
        for peer, signature in sorted(signatures.items()):
            if peer not in self.neighbours or peer not in self.signed or not signature_verifies(
                    self.peer_identities.get(peer), signature,
                    buffer_consistency_bytes(self.context, self.signed, self.peers[peer].keys())):
                raise ProtocolError(f"site {peer}: its consistency signature relayed to site {self.site} is not a "
                                    f"surviving neighbour's over the set this site signed in this buffer: refused")
        if len(signatures) < self.threshold:
            raise ProtocolError(f"site {self.site}: only {len(signatures)} of its neighbours signed the survivor set, "
                                f"fewer than the threshold {self.threshold}: refuses to unmask")


class BufferServer:
    """Rank 0's side of one buffer: it relays, sums the survivors' inputs and removes their masks."""

    def __init__(self, graph: dict[int, set[int]], size: int, context: bytes,
                 adverts: Mapping[int, EpochAdvert]) -> None:
        self.graph, self.size, self.context, self.adverts = graph, size, context, dict(adverts)
        self.members = frozenset(graph)
        self.masked: dict[int, np.ndarray] = {}
        self.sealed: dict[int, dict[int, bytes]] = {}  # receiver -> sender -> sealed seed share
        self.survivors: frozenset[int] | None = None
        self.signatures: dict[int, bytes | None] = {}
        self.answers: dict[int, dict[int, tuple[str, int, bytes]]] = {}

    def take_masked(self, site: int, y: np.ndarray, to: list[int], blob: np.ndarray) -> None:
        if site not in self.members or site in self.masked or self.survivors is not None:
            raise ProtocolError(f"site {site}: masked input from a site not in the buffer, a second one, or late")
        if y.shape != (self.size,) or y.dtype != np.uint32:
            raise ProtocolError(f"site {site}: masked input of shape {y.shape} {y.dtype}, expected ({self.size},) "
                                f"uint32")
        if sorted(to) != sorted(self.graph[site]) or len(to) != len(set(to)) \
                or blob.dtype != np.uint8 or blob.shape != (len(to), SEALED_BYTES):
            raise ProtocolError(f"site {site}: seed shares for sites {to[:8]} ({blob.shape} {blob.dtype}), not one "
                                f"({SEALED_BYTES} bytes) to each of its neighbours {sorted(self.graph[site])}")
        self.masked[site] = y
        for peer, row in zip(to, blob):
            self.sealed.setdefault(peer, {})[site] = row.tobytes()

    def fix_survivors(self, live: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
        """S: the members whose input came and that are still live (a member that uploaded and then
        left is dropped, its input left out); and the dropped."""
        self.survivors = frozenset(set(self.masked) & set(live))
        return self.survivors, self.members - self.survivors

    def shares_for(self, site: int) -> dict[int, tuple[int, bytes]]:
        """The seed shares sent to `site` by the survivors (sender -> (its epoch, sealed))."""
        assert self.survivors is not None
        return {v: (self.adverts[v].epoch, blob) for v, blob in self.sealed.get(site, {}).items()
                if v in self.survivors}

    def take_signature(self, site: int, signature: bytes | None, identities: Mapping[int, bytes] | None) -> None:
        assert self.survivors is not None
        if site not in self.survivors or site in self.signatures:
            raise ProtocolError(f"site {site}: consistency signature from a site outside the survivor set, or twice")
        if identities is not None and not signature_verifies(identities.get(site), signature, buffer_consistency_bytes(
                self.context, self.survivors, self.adverts[site].keys())):
            raise ProtocolError(f"site {site}: its consistency signature does not verify over the buffer's survivors")
        self.signatures[site] = signature

    def answering(self, checked: bool) -> set[int]:
        """The survivors that will answer: all (`checked` False: the fast answer), else those that
        signed and hold their threshold of neighbours' signatures."""
        assert self.survivors is not None
        if not checked:
            return set(self.survivors)
        return {u for u in self.signatures
                if len(self.graph[u] & set(self.signatures)) >= threshold_for(len(self.graph[u]))}

    def shortfall(self, answering: set[int]) -> str | None:
        """Why the sum could not be unmasked if only `answering` answer (None: it can)."""
        assert self.survivors is not None
        for u in sorted(self.survivors):
            t = threshold_for(len(self.graph[u]))
            held = {h for h in answering if u in self.sealed.get(h, {})}
            if len(held) < t:
                return (f"site {u}'s self-mask seed needs {t} shares, but only {len(held)} answering neighbour(s) "
                        f"hold one")
        for v in sorted(self.members - self.survivors):
            if missing := (self.graph[v] & self.survivors) - answering:
                return (f"site {v} dropped, and its pair masks need every surviving neighbour's answer; site(s) "
                        f"{', '.join(map(str, sorted(missing)))} will not answer")
        return None

    def take_unmask(self, site: int, answers: Mapping[int, tuple[str, int, bytes]]) -> None:
        assert self.survivors is not None
        if site not in self.survivors or site in self.answers:
            raise ProtocolError(f"site {site}: unmask answer from a site that is not a survivor of this buffer (a "
                                f"self-mask revealed for a buffer it is not in), or a second one")
        for peer, (kind, _, value) in answers.items():
            want = "seed" if peer in self.survivors else "pair"
            if peer not in self.graph[site] or kind != want or len(value) != (32 if want == "pair"
                                                                              else shamir.SHARE_BYTES):
                raise ProtocolError(f"site {site}: {kind} answer for site {peer}, expected {want} of a neighbour")
        self.answers[site] = dict(answers)

    def result(self) -> tuple[np.ndarray, set[int]]:
        """The unwrapped uint32 sum of the survivors' inputs, and who they are."""
        assert self.survivors is not None
        total = np.zeros(self.size, dtype=np.uint32)
        for u in self.survivors:
            np.add(total, self.masked[u], out=total)
        masks = []
        for u in sorted(self.survivors):
            shares = [(x, y) for ans in self.answers.values() for p, (k, x, y) in ans.items() if p == u and k == "seed"]
            try:
                masks.append((shamir.combine(shares, threshold_for(len(self.graph[u]))), b"self", -1))
            except ValueError as exc:
                raise ProtocolError(f"site {u}: its self-mask seed cannot be rebuilt ({exc})") from None
        for v in sorted(self.members - self.survivors):
            for u in sorted(self.graph[v] & self.survivors):
                seed = self.answers.get(u, {}).get(v)
                if seed is None:
                    raise ProtocolError(f"site {u}: no pair seed for dropped site {v}")
                masks.append((seed[2], b"pair", -1 if v > u else 1))  # undo what u added for its pair with v
        apply_masks(total, masks)
        return total, set(self.survivors)

