"""Secure aggregation's messages as they cross the channel, and their bounded parsing.

Both sides use these: a site parses what the server relays (its neighbours' keys and shares, the
unmask request), the server parses what each site sends. Every value is hostile: hex strings have
their exact length, site ids lie in 0..K-1, lists are no longer than the sites there are, and a
bad one raises `ProtocolError` naming the site it came from (or was relayed for) and what was wrong.
Everything is JSON or one uint8 tensor: nothing is unpickled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from hpcfed.privacy import shamir
from hpcfed.privacy.secagg import Advert, ProtocolError, SealedShare

KEY_HEX = 64  # an X25519 public key, 32 bytes
SIG_HEX = 128  # an Ed25519 signature, 64 bytes
SHARE_HEX = 2 * shamir.SHARE_BYTES
# nonce || AES-GCM(x (4 bytes) || seed share || key share) || tag
SHARE_BLOB = 12 + 4 + 2 * shamir.SHARE_BYTES + 16
SHARES_TENSOR = "shares"
MASKED_TENSOR = "masked"
_HEX = frozenset("0123456789abcdef")


def _hex(value: object, length: int, what: str, site: int) -> bytes:
    if not isinstance(value, str) or len(value) != length or not _HEX.issuperset(value):
        raise ProtocolError(f"site {site}: {what} is not {length} lowercase hex digits")
    return bytes.fromhex(value)


def _site_id(value: object, num_sites: int, what: str, site: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < num_sites:
        raise ProtocolError(f"site {site}: {what} {str(value)[:40]!r} is not a site id in 0..{num_sites - 1}")
    return value


def site_ids(value: object, num_sites: int, what: str, site: int) -> list[int]:
    """A list of distinct site ids, at most `num_sites` long."""
    if not isinstance(value, list) or len(value) > num_sites:
        raise ProtocolError(f"site {site}: {what} is not a list of at most {num_sites} site ids")
    ids = [_site_id(v, num_sites, what, site) for v in value]
    if len(set(ids)) != len(ids):
        raise ProtocolError(f"site {site}: {what} names a site twice")
    return ids


# -- round 0: adverts -------------------------------------------------------------------------------
def advert_fields(adv: Advert) -> list[Any]:
    """[site, c, s, signature or null] as JSON."""
    return [adv.site, adv.c_public.hex(), adv.s_public.hex(), adv.signature.hex() if adv.signature else None]


def parse_advert(site: int, value: object, num_sites: int) -> Advert:
    """An advert from (or relayed for) `site`: it must name `site` itself."""
    if not isinstance(value, list) or len(value) != 4:
        raise ProtocolError(f"site {site}: advert is not [site, c, s, signature]")
    claimed = _site_id(value[0], num_sites, "advert's site", site)
    if claimed != site:
        raise ProtocolError(f"site {site}: advert claims to come from site {claimed}")
    signature = None if value[3] is None else _hex(value[3], SIG_HEX, "advert signature", site)
    return Advert(site, _hex(value[1], KEY_HEX, "advert key c", site), _hex(value[2], KEY_HEX, "advert key s", site),
                  signature)


def parse_adverts(value: object, allowed: set[int], num_sites: int, me: int) -> dict[int, Advert]:
    """The adverts the server relays to site `me`: each from one of its neighbours (`allowed`), once."""
    if not isinstance(value, list) or len(value) > len(allowed):
        raise ProtocolError(f"site {me}: the server relayed more adverts than it has neighbours ({len(allowed)})")
    out: dict[int, Advert] = {}
    for item in value:
        peer = item[0] if isinstance(item, list) and item else None
        peer = _site_id(peer, num_sites, "relayed advert's site", me)
        if peer not in allowed or peer in out:
            raise ProtocolError(f"site {peer}: advert relayed to site {me}, which is not its neighbour, or twice")
        out[peer] = parse_advert(peer, item, num_sites)
    return out


# -- round 1: sealed shares --------------------------------------------------------------------------
def shares_message(shares: list[SealedShare], by_sender: bool) -> tuple[list[int], np.ndarray]:
    """The ids (receivers, or senders when `by_sender`) and one (m, SHARE_BLOB) uint8 tensor."""
    ids = [sh.sender if by_sender else sh.receiver for sh in shares]
    blob = np.frombuffer(b"".join(sh.blob for sh in shares), dtype=np.uint8).reshape(len(shares), SHARE_BLOB)
    return ids, blob


def parse_shares(site: int, ids: object, tensors: Mapping[str, np.ndarray], num_sites: int,
                 me: int, by_sender: bool) -> list[SealedShare]:
    """Shares sent by `site` to the ids listed (server side: `me` is the sender), or relayed to `me`
    from the ids listed (site side, `by_sender`)."""
    listed = site_ids(ids, num_sites, "share ids", site)
    if set(tensors) != {SHARES_TENSOR}:
        raise ProtocolError(f"site {site}: share message carries tensors {sorted(tensors)[:3]}, not only "
                            f"{SHARES_TENSOR!r}")
    blob = tensors[SHARES_TENSOR]
    if blob.dtype != np.uint8 or blob.shape != (len(listed), SHARE_BLOB):
        raise ProtocolError(f"site {site}: shares of shape {blob.shape} {blob.dtype}, expected "
                            f"({len(listed)}, {SHARE_BLOB}) uint8")
    if by_sender:
        return [SealedShare(peer, me, blob[i].tobytes()) for i, peer in enumerate(listed)]
    return [SealedShare(me, peer, blob[i].tobytes()) for i, peer in enumerate(listed)]


# -- round 2: the masked input -------------------------------------------------------------------------
def parse_masked(site: int, tensors: Mapping[str, np.ndarray], size: int) -> np.ndarray:
    """A site's masked input: uint32 (size,) and nothing else."""
    if set(tensors) != {MASKED_TENSOR}:
        raise ProtocolError(f"site {site}: masked input carries tensors {sorted(tensors)[:3]}, not only "
                            f"{MASKED_TENSOR!r}")
    y = tensors[MASKED_TENSOR]
    if y.dtype != np.uint32 or y.shape != (size,):
        raise ProtocolError(f"site {site}: masked input of shape {y.shape} {y.dtype}, expected ({size},) uint32")
    return y


# -- round 3: the consistency check -------------------------------------------------------------------
def parse_signature(site: int, value: object, keys_mode: bool) -> bytes | None:
    """A site's signature over the survivor set: 64 bytes in keys mode, null in psk mode (no key)."""
    if not keys_mode:
        if value is not None:
            raise ProtocolError(f"site {site}: a consistency signature in psk mode, where sites have no signing key")
        return None
    if value is None:
        raise ProtocolError(f"site {site}: no consistency signature over the survivor set")
    return _hex(value, SIG_HEX, "consistency signature", site)


def signatures_fields(signatures: Mapping[int, bytes | None]) -> list[list[Any]]:
    """[[site, signature hex], ...] as JSON (psk mode's unsigned entries are left out)."""
    return [[peer, sig.hex()] for peer, sig in sorted(signatures.items()) if sig is not None]


def parse_signatures(value: object, num_sites: int, me: int) -> dict[int, bytes]:
    """The consistency signatures the server forwards to site `me`: per site, once."""
    if not isinstance(value, list) or len(value) > num_sites:
        raise ProtocolError(f"site {me}: the server's consistency signatures are not a list of at most {num_sites}")
    out: dict[int, bytes] = {}
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            raise ProtocolError(f"site {me}: a forwarded consistency signature is not [site, signature]")
        peer = _site_id(item[0], num_sites, "forwarded signature's site", me)
        if peer in out:
            raise ProtocolError(f"site {peer}: consistency signature forwarded to site {me} twice: refused")
        out[peer] = _hex(item[1], SIG_HEX, "forwarded consistency signature", peer)
    return out


# -- round 4: unmasking -------------------------------------------------------------------------------
def answers_fields(answers: Mapping[int, tuple[str, int, bytes]]) -> list[list[Any]]:
    """[[peer, kind, x, value hex], ...] as JSON ("seed"|"key" shares; a buffer's "pair" seeds, x 0)."""
    return [[peer, kind, x, share.hex()] for peer, (kind, x, share) in sorted(answers.items())]


SHARE_KINDS = {"seed": SHARE_HEX, "key": SHARE_HEX}  # a round's answers: Shamir shares (x in 1..K)


def parse_answers(site: int, value: object, num_sites: int,
                  kinds: Mapping[str, int] = SHARE_KINDS) -> dict[int, tuple[str, int, bytes]]:
    """A site's unmask answer: per peer, once, one of `kinds` (kind -> its value's hex length): a
    Shamir share (x in 1..K), or a buffer's 32-byte pair seed (``pair``: x 0,
    `hpcfed.privacy.secagg_epoch`)."""
    if not isinstance(value, list) or len(value) > num_sites:
        raise ProtocolError(f"site {site}: unmask answer is not a list of at most {num_sites} items")
    out: dict[int, tuple[str, int, bytes]] = {}
    for item in value:
        if not isinstance(item, list) or len(item) != 4 or item[1] not in kinds:
            raise ProtocolError(f"site {site}: unmask answer item is not [peer, {'|'.join(kinds)}, x, value]")
        peer = _site_id(item[0], num_sites, "unmask answer's peer", site)
        x = item[2]
        low, high = (1, num_sites) if item[1] != "pair" else (0, 0)
        if peer in out or not isinstance(x, int) or isinstance(x, bool) or not low <= x <= high:
            raise ProtocolError(f"site {site}: unmask answer for site {peer} twice, or its x out of {low}..{high}")
        out[peer] = (item[1], x, _hex(item[3], kinds[item[1]], "unmask share", site))
    return out
