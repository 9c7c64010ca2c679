"""Frames a hostile rank can build with its own session keys: the inputs of the channel's
rejection tests (in-process and live under mpiexec). Not a test module."""

from __future__ import annotations

import os

from hpcfed.comm import crypto, wire
from hpcfed.comm.channel import SecureChannel
from hpcfed.comm.frame import F_DATA, FRAME, HDR, TAG, VERSION


def seal(ch: SecureChannel, dest: int, payload: bytes, *, kind: int = 9, seq: int | None = None,
         src: int | None = None, dst: int | None = None, msg_id: int | None = None, index: int = 0,
         count: int = 1, offset: int = 0, total: int | None = None,
         sealer: crypto.Sealer | None = None) -> bytes:
    """One encrypted frame from `ch`'s rank to `dest`, with any header field overridden.
    Draws the next sequence number of the real session unless `seq` is given."""
    peer = ch._session.peers[dest]
    if seq is None:
        peer.send_seq += 1
        seq = peer.send_seq
    if msg_id is None:
        msg_id = peer.next_msg_id
        peer.next_msg_id += 1
    total = len(payload) if total is None else total
    hdr = FRAME.pack(VERSION, F_DATA, kind, 0, ch.rank if src is None else src, dest if dst is None else dst,
                     len(payload), seq, msg_id, index, count, offset, total)
    out = bytearray(HDR + len(payload) + TAG)
    out[:HDR] = hdr
    (sealer or peer.tx).seal_into(seq, payload, ch._session.jd + hdr, memoryview(out)[HDR:])
    return bytes(out)


ANY = "*"


def bundle(text: str) -> bytes:
    return wire.encode({"text": text}, {})


def random_sealer() -> crypto.Sealer:
    return crypto.Sealer(os.urandom(32), crypto.DIR_INITIATOR_TO_RESPONDER)


def attacks(ch: SecureChannel, dest: int) -> list[tuple[str, bytes, str | None]]:
    """(name, frame, expected rejection reason; None for a legitimate frame, ANY for any reason)."""
    out: list[tuple[str, bytes, str | None]] = []
    good = seal(ch, dest, bundle("legit 1"))
    out.append(("legit", good, None))
    out.append(("replayed", good, "replayed or reordered frame"))
    tampered = bytearray(seal(ch, dest, bundle("tampered")))
    tampered[HDR + 3] ^= 0x40
    out.append(("tampered", bytes(tampered), "authentication failed"))
    hdr_tampered = bytearray(seal(ch, dest, bundle("kind changed")))
    hdr_tampered[2] ^= 1  # message kind, bound in the associated data
    out.append(("header tampered", bytes(hdr_tampered), "authentication failed"))
    early = seal(ch, dest, bundle("sealed first, sent last"))
    late = seal(ch, dest, bundle("legit 2"))
    out.append(("legit", late, None))
    out.append(("reordered", early, "replayed or reordered frame"))
    full = seal(ch, dest, bundle("truncated"))
    out.append(("truncated", full[:-5], "truncated frame"))
    out.append(("truncated header", full[:HDR - 1], "truncated frame"))
    other = next((r for r in range(ch.size) if r not in (dest, ch.rank)), ch.size + 5)
    out.append(("misrouted (destination)", seal(ch, dest, bundle("for someone else"), dst=other), "misrouted frame"))
    out.append(("misrouted (claimed source)", seal(ch, dest, bundle("pretends"), src=other), "misrouted frame"))
    out.append(("wrong key", seal(ch, dest, bundle("wrong key"), sealer=random_sealer()), "authentication failed"))
    out.append(("garbage", b"\x01" + os.urandom(HDR + 40), ANY))
    out.append(("chunk without its start", seal(ch, dest, b"x" * 4096, index=1, count=3, offset=4096,
                                                           total=3 * 4096),
                "chunk out of sequence"))
    out.append(("not a bundle", seal(ch, dest, b"definitely not a bundle"), "malformed bundle"))
    out.append(("legit", seal(ch, dest, bundle("legit 3")), None))
    return out
