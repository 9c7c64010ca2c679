"""The frame: the 56-byte header every chunk and handshake step travels under, and its checks.

Every frame is::

    offset  size  field (little-endian)
    0       1     protocol version (1)
    1       1     frame type: 1 DATA, 2 HELLO, 3 REPLY, 4 FINISH, 5 CONFIRM, 6 REFUSE,
                  7 SHM_OFFER, 8 SHM_ACCEPT, 9 SHM_DATA, 10 SHM_FREE
    2       1     message kind (0..255; 0 for handshake frames)
    3       1     flags (0)
    4       4     source rank
    8       4     destination rank
    12      4     length: ciphertext bytes in this frame (plaintext bytes for handshake frames)
    16      8     sequence number (per direction, strictly increasing; 0 for plaintext frames)
    24      8     message id (per direction)
    32      4     chunk index
    36      4     chunk count
    40      8     offset of this chunk in the message
    48      8     total message length
    56      ...   AES-256-GCM ciphertext (length bytes) + 16-byte tag   | handshake body

The associated data of every sealed frame is ``job_digest (16 bytes) | the 56 header bytes``, and
the nonce is ``direction | sequence number`` (see `crypto`). An SHM_DATA frame carries only the
header and a 4-byte slot number: its ciphertext sits in that slot of the sender's shared-memory
ring (`ring`). An SHM_FREE frame (plaintext) gives a slot back.

`check` parses a frame as it arrives and refuses, by reason, what needs no session to refuse.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from hpcfed.comm import crypto

VERSION = crypto.PROTOCOL_VERSION
FRAME = struct.Struct("<BBBBIIIQQIIQQ")
HDR = FRAME.size  # 56
TAG = crypto.TAG_BYTES
F_DATA, F_HELLO, F_REPLY, F_FINISH, F_CONFIRM, F_REFUSE = 1, 2, 3, 4, 5, 6
F_SHM_OFFER, F_SHM_ACCEPT, F_SHM_DATA, F_SHM_FREE = 7, 8, 9, 10
HANDSHAKE_TYPES = frozenset({F_HELLO, F_REPLY, F_FINISH, F_REFUSE})
SEALED_TYPES = frozenset({F_DATA, F_CONFIRM, F_SHM_OFFER, F_SHM_ACCEPT, F_SHM_DATA})
SLOT = struct.Struct("<I")  # the ring slot an SHM_DATA or SHM_FREE frame names
OFFER = struct.Struct("<II")  # slots, bytes per slot; then the segment name
MAX_PLAIN_FRAME = 1024  # handshake bodies and refusal texts
SMALL_FRAME = 64 << 10  # frames this small are received into one small buffer kept for them

Refusal = tuple[str, str]  # (reason counted in the stats, detail for the log)


class Header(NamedTuple):
    """The fields of a frame header, in wire order."""

    version: int
    ftype: int
    kind: int
    flags: int
    src: int
    dst: int
    length: int
    seq: int
    msg_id: int
    chunk: int  # chunk index (`index` and `count` would shadow tuple methods)
    chunks: int  # chunk count
    offset: int
    total: int


_new_header = tuple.__new__  # Header._make without its Python frame: this runs for every frame


def pack(ftype: int, kind: int, src: int, dst: int, length: int, seq: int, msg_id: int, index: int,
         count: int, offset: int, total: int) -> bytes:
    """The 56 header bytes of a frame of this protocol version (flags 0)."""
    return FRAME.pack(VERSION, ftype, kind, 0, src, dst, length, seq, msg_id, index, count, offset, total)


def plain(ftype: int, src: int, dst: int, body: bytes) -> bytes:
    """A whole plaintext frame (handshake step, refusal, slot credit): header + body."""
    return FRAME.pack(VERSION, ftype, 0, 0, src, dst, len(body), 0, 0, 0, 1, 0, len(body)) + body


def slot_credit(src: int, dst: int, slot: int) -> bytes:
    """The SHM_FREE frame that gives ring slot `slot` back to its sender."""
    return plain(F_SHM_FREE, src, dst, SLOT.pack(slot))


def slot_of(view: memoryview) -> int:
    """The slot number an SHM_DATA / SHM_FREE frame carries, or -1 when the frame has no room for one."""
    return int(SLOT.unpack_from(view, HDR)[0]) if len(view) == HDR + SLOT.size else -1


def check(view: memoryview, src: int, rank: int) -> Header | Refusal:
    """The header of a frame rank `rank` received from rank `src`, or why it is refused before any
    session is looked at: too short, another protocol version, misrouted, a handshake body of the
    wrong size, an unknown type or flags, or a sealed frame whose length is not what it declares."""
    n = len(view)
    if n < HDR:
        return "truncated frame", f"{n}-byte frame is shorter than the {HDR}-byte frame header"
    h = _new_header(Header, FRAME.unpack_from(view, 0))
    if h.version != VERSION:
        return "unsupported protocol version", f"frame protocol version {h.version}, expected {VERSION}"
    if h.src != src or h.dst != rank:
        return "misrouted frame", f"frame says rank {h.src} -> rank {h.dst}, but came from rank {src} to rank {rank}"
    if h.ftype in HANDSHAKE_TYPES:
        if n != HDR + h.length or h.length > MAX_PLAIN_FRAME or h.flags:
            return "malformed frame", f"handshake frame of {n} bytes declares {h.length} body bytes"
        return h
    if h.ftype == F_SHM_FREE:
        return h  # its slot is checked against the ring it names
    if h.ftype not in SEALED_TYPES or h.flags:
        return "malformed frame", f"unknown frame type {h.ftype} / flags {h.flags}"
    if h.ftype != F_SHM_DATA and n != HDR + h.length + TAG:
        return "truncated frame", (f"{n}-byte frame should be {HDR + h.length + TAG} "
                                   f"({h.length} ciphertext bytes + header + tag)")
    return h
