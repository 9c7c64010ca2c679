"""Shared-memory rings: big messages to a peer on the same node, without MPI copying the bytes.

The first multi-chunk message to a peer goes through MPI while this rank offers a ring (a sealed
SHM_OFFER: slots, bytes per slot, segment name). A peer that can map it (same node, within its
`shm_budget_bytes`) answers yes (SHM_ACCEPT), and from then on big messages are encrypted straight
into a free slot and only the 56-byte header and the slot number (SHM_DATA) go through MPI; the
receiver decrypts from the slot and gives it back with an SHM_FREE frame. Both sides unlink the
segment as soon as both have it mapped, so a crash leaves nothing behind.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from hpcfed.comm.frame import OFFER, TAG, slot_of
from hpcfed.comm.session import Session

RING_SLOTS = 4
MAX_SLOTS = 64  # the most slots a peer's offer may have


class TxRing:
    """Shared memory this rank encrypts chunks into for one peer on the same node."""

    __slots__ = ("buf", "free", "name", "nslots", "owner", "slot_bytes", "state")

    def __init__(self, name: str, buf: np.ndarray | None, nslots: int, slot_bytes: int, state: str) -> None:
        self.name, self.buf, self.nslots, self.slot_bytes = name, buf, nslots, slot_bytes
        self.free: deque[int] = deque(range(nslots))
        self.owner: list[object | None] = [None] * nslots  # the posted message a slot holds
        self.state = state  # offered | ready | declined


class RxRing:
    """A peer's shared memory that this rank decrypts chunks from."""

    __slots__ = ("buf", "name", "nslots", "slot_bytes")

    def __init__(self, name: str, buf: np.ndarray, nslots: int, slot_bytes: int) -> None:
        self.name, self.buf, self.nslots, self.slot_bytes = name, buf, nslots, slot_bytes


class Rings:
    """The rings of one channel: `tx` by destination rank, `rx` by source rank."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self.tx: dict[int, TxRing] = {}
        self.rx: dict[int, RxRing] = {}

    def mapped_bytes(self) -> int:
        """Bytes of shared-memory rings this rank has mapped or offered."""
        return (sum(r.nslots * r.slot_bytes for r in self.tx.values() if r.buf is not None)
                + sum(r.nslots * r.slot_bytes for r in self.rx.values()))

    def route(self, peer: int) -> str:
        """How big messages go to and from `peer`: "ring" (a shared-memory ring is in use), "declined"
        (a ring was offered and refused or not made: another node, or no room; MPI carries all) or
        "mpi" (none offered yet: no multi-chunk message, or shared memory off)."""
        ring = self.tx.get(peer)
        if (ring is not None and ring.state == "ready") or peer in self.rx:
            return "ring"
        return "declined" if ring is not None and ring.state == "declined" else "mpi"

    def offer(self, dest: int) -> bytes | None:
        """Make a ring for `dest` and return the offer's body; None when there is no shared memory
        here or no room in the budget (the peer is then declined for good: MPI carries all)."""
        opts = self._s.opts
        slot_bytes = (opts.chunk_bytes + TAG + 63) & ~63
        over = self.mapped_bytes() + RING_SLOTS * slot_bytes > opts.shm_budget_bytes
        got = None if over else self._s.transport.shm_create(f"{self._s.rank}to{dest}", RING_SLOTS * slot_bytes)
        if got is None:
            self.tx[dest] = TxRing("", None, 0, 0, "declined")
            return None
        name, view = got
        self.tx[dest] = TxRing(name, np.frombuffer(view, dtype=np.uint8), RING_SLOTS, slot_bytes, "offered")
        return OFFER.pack(RING_SLOTS, slot_bytes) + name.encode()

    def on_offer(self, src: int, body: bytes) -> bytes | None:
        """Map the ring `src` offers if it is sound and fits; the answer's body (yes or no), or None
        when the offer is malformed (refused)."""
        if len(body) <= OFFER.size:
            self._s.reject(src, "malformed frame", "shared-memory offer without a name")
            return None
        nslots, slot_bytes = OFFER.unpack_from(body)
        name = body[OFFER.size:].decode("utf-8", "replace")
        opts, view = self._s.opts, None
        if (opts.shared_memory and 1 <= nslots <= MAX_SLOTS and TAG < slot_bytes <= opts.max_frame + 64
                and self.mapped_bytes() + nslots * slot_bytes <= opts.shm_budget_bytes):
            view = self._s.transport.shm_attach(name, nslots * slot_bytes)
        if view is not None:
            self.rx[src] = RxRing(name, np.frombuffer(view, dtype=np.uint8), nslots, slot_bytes)
            self._s.transport.shm_unlink(name)  # mapped on both sides now; nothing to leak on a crash
        return (b"\x01" if view is not None else b"\x00") + name.encode()

    def on_answer(self, src: int, body: bytes) -> None:
        """`src` answered this rank's offer: the ring is ready, or declined for good."""
        name = body[1:].decode("utf-8", "replace")
        ring = self.tx.get(src)
        if ring is None or ring.state != "offered" or ring.name != name:
            self._s.reject(src, "unexpected handshake frame", "a shared-memory answer to no offer")
            return
        self._s.transport.shm_unlink(name)  # both sides have it mapped (or never will): no file left behind
        if body[:1] == b"\x01":
            ring.state = "ready"
        else:
            ring.state, ring.buf = "declined", None

    def on_free(self, src: int, view: memoryview) -> None:
        """`src` has read a slot of this rank's ring (an SHM_FREE frame): it may be refilled."""
        ring = self.tx.get(src)
        slot = slot_of(view)
        if ring is None or ring.state != "ready" or not 0 <= slot < ring.nslots or slot in ring.free:
            self._s.reject(src, "malformed frame", f"shared-memory credit for slot {slot}, which is not in use")
            return
        ring.owner[slot] = None
        ring.free.append(slot)

    def chunk(self, src: int, view: memoryview, length: int) -> tuple[memoryview, int] | None:
        """The ciphertext (+ tag) an SHM_DATA frame from `src` points at, and its slot; None (refused)
        when the frame names no slot of a ring `src` gave this rank or more bytes than a slot holds."""
        ring = self.rx.get(src)
        slot = slot_of(view)
        if ring is None or not 0 <= slot < ring.nslots or length + TAG > ring.slot_bytes:
            self._s.reject(src, "malformed frame", f"shared-memory chunk in slot {slot} of "
                                                   f"{'no ring' if ring is None else f'a {ring.nslots}-slot ring'}")
            return None
        at = slot * ring.slot_bytes
        return ring.buf.data[at:at + length + TAG], slot

    def close(self) -> None:
        """Unlink the segments offered and never answered; drop every mapping."""
        for ring in self.tx.values():
            if ring.state == "offered":
                self._s.transport.shm_unlink(ring.name)
        self.tx.clear()
        self.rx.clear()
