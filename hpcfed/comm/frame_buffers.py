"""The sender's reused buffers: frame slots that chunks are sealed into, and gather buffers that join
a chunk spanning several tensors into one contiguous piece.

Reusing them keeps a big message's memory at a few chunks. A send abandoned on a timeout may still
read its slot whenever the peer wakes up, so the sender drops the slots (`drop_slots`) and later
messages are sealed into fresh ones.
"""

from __future__ import annotations

import numpy as np

from hpcfed.comm.options import ChannelOptions


class FrameBuffers:
    """Frame slots by index and gather buffers (one shared, or one per slot of the parallel sealing
    path), grown on demand and never shrunk while in use."""

    def __init__(self, opts: ChannelOptions) -> None:
        self._opts = opts
        self._slots: list[np.ndarray] = []
        self._gather: np.ndarray | None = None
        self._gathers: list[np.ndarray] = []

    def slot(self, i: int, need: int) -> memoryview:
        """Frame slot `i`, at least `need` bytes long."""
        while len(self._slots) <= i:
            self._slots.append(np.empty(0, dtype=np.uint8))
        if len(self._slots[i]) < need:
            self._slots[i] = np.empty(max(need, min(self._opts.max_frame, 1 << 16)), dtype=np.uint8)
        return self._slots[i].data

    def view(self, i: int) -> memoryview:
        """Frame slot `i` as it is now (sealed into by an earlier `slot(i, ...)`)."""
        return self._slots[i].data

    def gathered(self, pieces: list[memoryview], n: int, slot: int = -1) -> memoryview:
        """Copy a chunk that spans several tensors into one buffer (per slot when chunks are
        sealed in parallel, the shared one otherwise)."""
        chunk = self._opts.chunk_bytes
        if slot >= 0:
            while len(self._gathers) <= slot:
                self._gathers.append(np.empty(0, dtype=np.uint8))
            if len(self._gathers[slot]) < n:
                self._gathers[slot] = np.empty(max(n, min(chunk, 1 << 16)), dtype=np.uint8)
            out = self._gathers[slot].data
        else:
            if self._gather is None or len(self._gather) < n:
                self._gather = np.empty(max(n, min(chunk, 1 << 16)), dtype=np.uint8)
            out = self._gather.data
        pos = 0
        for p in pieces:
            out[pos:pos + len(p)] = p
            pos += len(p)
        return out[:n]

    def drop_slots(self) -> None:
        """Forget the frame slots: an abandoned send may still read them."""
        self._slots.clear()

    def clear(self) -> None:
        """Drop every buffer (the channel is closing)."""
        self._slots.clear()
        self._gathers.clear()
        self._gather = None
