"""Secure buffered asynchronous aggregation, the pure part: what a buffer's invitation says, how a
site checks it, and how its staleness weight travels masked (the runtime is
`hpcfed.server.secagg_buffer` and `hpcfed.client.secagg_buffer`; docs/guides/secure-aggregation.md,
"Asynchronous federations", draws the exchange).

FedBuff (Nguyen et al., AISTATS 2022) applies a buffer of B uploads at once; SecAgg with SecAgg+
neighbourhoods (Bonawitz et al. 2017; Bell et al. 2020) runs once per buffer among its members, so
rank 0 learns each buffer's sum only. A site applies its staleness weight s(τ) itself, before
masking, and sends the weight too, masked, as an integer ``q = round(s(τ) · max_examples)`` in the
coordinate that carries the example count in synchronous rounds (`hpcfed.privacy.masking.encode`).

Rank 0 told each member its staleness, so it knows what the unmasked weight coordinate must be:
``Σ q(τ_k)`` over the survivors, exactly. A site that claims another weight (outside the rule's
range, or only not its own) moves that coordinate, and the buffer's sum is refused
(`expected_weight`); the norm of the weighted sum is then bounded by C·Σ s_k as in rounds.

A site checks what the server tells it (`check_invite`): the buffer numbers it takes part in rise
strictly (a replayed invitation, or masked inputs of an earlier buffer, belong to a number it has
passed); the server's version is no older than any version it already sent this site and no newer
than one per buffer so far (version = 1 + buffers applied); the staleness is exactly that version
minus the version this site trained from. The invitation's buffer, version and member list are
bound into every signature of the buffer (`buffer_context`, a whole SHA-256 digest, is what SecAgg signs), so a
server that tells two members different versions or different member lists makes their signatures
fail: the members refuse the buffer in keys mode.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from hpcfed.privacy import secagg_wire as W
from hpcfed.privacy.secagg import ProtocolError
from hpcfed.privacy.secagg_epoch import SEALED_BYTES, EpochAdvert
from hpcfed.privacy.site_input import InputSpec, judge_sum


@dataclass(frozen=True)
class StalenessRule:
    """s(τ) of FedAsync / FedBuff: ``constant`` 1, ``polynomial`` (τ + 1)^(−a) (a = 0.5: FedBuff's
    1/√(1+τ)), ``hinge`` 1 up to b versions, then 1 / (a (τ − b) + 1)."""

    kind: str = "polynomial"
    a: float = 0.5
    b: int = 4

    def weight(self, staleness: int) -> float:
        s = max(0, int(staleness))
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((s + 1.0) ** (-self.a))
        if self.kind == "hinge":
            return 1.0 if s <= self.b else 1.0 / (self.a * (s - self.b) + 1.0)
        raise ValueError(f"unknown staleness function {self.kind!r}; choose constant, polynomial or hinge")

    def units(self, staleness: int, max_examples: int) -> int:
        """The masked weight coordinate: s(τ) in integer units of 1 / max_examples, at least 1."""
        return max(1, min(max_examples, round(self.weight(staleness) * max_examples)))


@dataclass(frozen=True)
class Invite:
    """A buffer's invitation as one member reads it (`check_invite` made it)."""

    buffer: int
    members: frozenset[int]
    version: int  # the server's version now (the buffer is applied on it)
    staleness: int  # version − the version this site trained from

    @property
    def context(self) -> bytes:
        return buffer_context(self.buffer, self.version, self.members)


def buffer_context(buffer: int, version: int, members: Iterable[int]) -> bytes:
    """What SecAgg binds for this buffer (masks, sealed shares, the consistency check): its buffer,
    version and members hashed, so that a member told another version or member list does not verify.
    The whole 32-byte digest: a shorter prefix would let a server search for two buffers that share it
    (2^28 hashes for 56 bits) and replay one buffer's consistency signatures in the other."""
    ids = sorted(members)
    return hashlib.sha256(b"hpcfed-secagg-buffer" + buffer.to_bytes(8, "big") + version.to_bytes(8, "big")
                          + len(ids).to_bytes(4, "big") + b"".join(i.to_bytes(4, "big") for i in ids)).digest()


def _int(value: object, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ProtocolError(f"{what} is {str(value)[:40]!r}, not an integer in {low}..{high}")
    return value


def check_invite(header: dict[str, object], *, me: int, num_sites: int, trained_from: int, last_buffer: int,
                 newest_seen: int) -> Invite:
    """Read the server's SA_BUFFER (hostile) for site `me`, which trained from version `trained_from`,
    last took part in buffer `last_buffer` (−1: none) and was sent versions up to `newest_seen`:
    the invitation, or ProtocolError naming what the server got wrong."""
    buffer = _int(header.get("round"), "the server's buffer number", 0, 1 << 48)
    if buffer <= last_buffer:
        raise ProtocolError(f"the server invites site {me} to buffer {buffer}, but it took part in buffer "
                            f"{last_buffer} already (a replayed or reused buffer): refused")
    raw = header.get("members")
    if not isinstance(raw, list) or len(raw) > num_sites:
        raise ProtocolError(f"the server's member list is not a list of at most {num_sites} sites")
    members = frozenset(_int(m, "the server's member", 0, num_sites - 1) for m in raw)
    if me not in members or len(members) < 2 or len(members) != len(raw):
        raise ProtocolError(f"the server's member list {sorted(members)} leaves site {me} out, repeats a site, "
                            f"or has fewer than 2 sites (a sum over one site is its input): refused")
    version = _int(header.get("version"), "the server's version", 1, 1 << 48)
    if version < newest_seen or version > buffer + 1:
        raise ProtocolError(f"the server says its version is {version}, but it sent site {me} version "
                            f"{newest_seen} already, and {buffer} buffers allow at most version {buffer + 1}: refused")
    staleness = _int(header.get("staleness"), "the server's staleness", 0, 1 << 48)
    if staleness != version - trained_from:
        raise ProtocolError(f"the server says site {me}'s staleness is {staleness}, but it trained from version "
                            f"{trained_from} and the server is at {version} (staleness {version - trained_from}): "
                            f"refused")
    return Invite(buffer, members, version, staleness)


def expected_weight(rule: StalenessRule, staleness: dict[int, int], survivors: Iterable[int],
                    max_examples: int) -> int:
    """What the unmasked weight coordinate of a buffer must be: Σ q(τ_k) over `survivors`."""
    return sum(rule.units(staleness[k], max_examples) for k in survivors)


def judge_buffer(total: np.ndarray, staleness: dict[int, int], survivors: set[int], rule: StalenessRule,
                 spec: InputSpec) -> tuple[np.ndarray, float]:
    """(Σ s_k·δ_k, Σ s_k) of a buffer's unmasked sum `total` over `survivors`, each told its
    `staleness`: judged as a round's (`judge_sum`: in the encoding, norm within C·Σ q), and its weight
    coordinate must be exactly Σ q(τ_k). ValueError, saying why, otherwise: a site claimed another weight."""
    weighted, weight = judge_sum(total, len(survivors), spec)
    want = expected_weight(rule, staleness, survivors, spec.max_examples)
    if weight != want:
        raise ValueError(f"its masked weights sum to {weight}, but the staleness the server told sites "
                         f"{sorted(survivors)} makes {want}: a site claimed a weight other than its own")
    weighted /= spec.max_examples  # q = s·M: back to Σ s_k δ_k and Σ s_k
    return weighted, weight / spec.max_examples


# -- wire forms of the epoch keys, the relayed seed shares and the answers (hpcfed.privacy.secagg_epoch) --
def advert_fields(adv: EpochAdvert) -> list[object]:
    """[site, epoch, c, s, signature or null] as JSON."""
    return [adv.site, adv.epoch, adv.c_public.hex(), adv.s_public.hex(), adv.signature.hex() if adv.signature else None]


def parse_advert(value: object, num_sites: int, what: str) -> EpochAdvert:
    """An epoch advert (hostile): its site id, a positive epoch, two 32-byte keys, a signature or null."""
    if not isinstance(value, list) or len(value) != 5:
        raise ProtocolError(f"{what}: an epoch advert is not [site, epoch, c, s, signature]")
    site = _int(value[0], f"{what}'s site", 0, num_sites - 1)
    epoch = _int(value[1], f"{what}'s epoch", 1, (1 << 63) - 1)
    signature = None if value[4] is None else W._hex(value[4], W.SIG_HEX, "epoch advert signature", site)
    return EpochAdvert(site, epoch, W._hex(value[2], W.KEY_HEX, "epoch key c", site),
                       W._hex(value[3], W.KEY_HEX, "epoch key s", site), signature)


def parse_relayed(value: object, tensors: Mapping[str, np.ndarray], num_sites: int,
                  me: int) -> dict[int, tuple[int, bytes]]:
    """The seed shares relayed to site `me` with the survivor set: sender -> (its epoch, sealed share)."""
    if not isinstance(value, list) or len(value) > num_sites:
        raise ProtocolError(f"site {me}: the relayed shares' senders are not a list of at most {num_sites}")
    pairs = [(v[0], v[1]) if isinstance(v, list) and len(v) == 2 else (None, None) for v in value]
    senders = W.site_ids([p[0] for p in pairs], num_sites, "relayed share's sender", me)
    epochs = [_int(p[1], "relayed share's epoch", 1, (1 << 63) - 1) for p in pairs]
    blob = tensors.get(W.SHARES_TENSOR) if set(tensors) <= {W.SHARES_TENSOR} else None
    if senders and (blob is None or blob.dtype != np.uint8 or blob.shape != (len(senders), SEALED_BYTES)):
        raise ProtocolError(f"site {me}: relayed seed shares are not one ({len(senders)}, {SEALED_BYTES}) uint8 tensor")
    return {s: (e, blob[i].tobytes()) for i, (s, e) in enumerate(zip(senders, epochs))} if blob is not None else {}


BUFFER_KINDS = {"seed": W.SHARE_HEX, "pair": 64}  # a buffer's answers: seed shares, pair seeds of this buffer


def parse_answers(site: int, value: object, num_sites: int) -> dict[int, tuple[str, int, bytes]]:
    """A member's unmask answer (hostile): per peer, once, a seed share (x in 1..K) or a 32-byte pair seed."""
    return W.parse_answers(site, value, num_sites, BUFFER_KINDS)
