"""Putting a multi-chunk message back together, refusing any chunk that does not fit.

Chunks of one message arrive in order (index 0, 1, ...; each at the offset where the previous one
ended, the last one ending at the declared total). `check_chunk` refuses, before anything is
decrypted, a chunk whose header does not fit its message: out of sequence, overlapping, past the
declared total, a count that does not match the size, or a message over `max_message_bytes`.
The first chunk of a multi-chunk message is opened into scratch (`PayloadPool.scratch0`), so no large
buffer is reserved before a frame authenticates; later chunks are opened straight into their slot
of the message buffer, which `PayloadPool` recycles once no tensor of an earlier message views it.
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import numpy as np

from hpcfed.comm.frame import F_CONFIRM, F_SHM_ACCEPT, F_SHM_OFFER, Refusal
from hpcfed.comm.stats import ChannelStats

MIN_CHUNK = 4096  # the smallest chunk a sender may cut (comm.chunk_bytes >= 4096)
MAX_CONTROL_BYTES = 1024  # a shared-memory offer or answer
STALL_S = 1.0  # a part-received message whose sender has been silent this long no longer holds others back


class Assembly:
    """A message part-way received from one peer."""

    __slots__ = (
        "count",
        "filled",
        "kind",
        "last_at",
        "last_seq",
        "msg_id",
        "next_index",
        "opening",
        "payload",
        "total",
    )

    def __init__(self, msg_id: int, kind: int, total: int, count: int, payload: np.ndarray) -> None:
        self.msg_id, self.kind, self.total, self.count = msg_id, kind, total, count
        self.next_index, self.filled, self.payload, self.last_seq = 0, 0, payload, 0
        self.last_at = time.monotonic()  # when its last chunk came: a stalled sender is not waited on
        self.opening: list[Future[float]] = []  # chunks being opened on the pool (write into payload)

    def took(self, index: int, offset: int, length: int, seq: int) -> bool:
        """Record chunk `index` (bytes offset..offset+length); True when it was the last one."""
        self.next_index = index + 1
        self.filled = offset + length
        self.last_seq = seq
        self.last_at = time.monotonic()
        return self.next_index >= self.count


def check_chunk(asm: Assembly | None, ftype: int, msg_id: int, index: int, count: int, offset: int,
                length: int, total: int, max_message_bytes: int) -> Refusal | None:
    """Why a chunk does not fit (None: it fits), given the message `asm` part-received from its
    sender. The reason is "chunk out of sequence" for a chunk without its predecessors, else
    "malformed frame"."""
    if total > max_message_bytes:
        return "malformed frame", f"message of {total} bytes exceeds comm.max_message_bytes={max_message_bytes}"
    if count < 1 or index >= count or count > max(1, -(-total // MIN_CHUNK)):
        return "malformed frame", f"chunk {index} of {count} for a {total}-byte message"
    last = index == count - 1
    if offset + length > total or (not last and length == 0) or (last and offset + length != total):
        return "malformed frame", f"chunk {index}/{count} covers bytes {offset}..{offset + length} of {total}"
    if ftype == F_CONFIRM and (count != 1 or total != 0):
        return "malformed frame", "a handshake confirmation carries no data"
    if ftype in (F_SHM_OFFER, F_SHM_ACCEPT) and (count != 1 or total > MAX_CONTROL_BYTES):
        return "malformed frame", "a shared-memory offer or answer is one small chunk"
    if index == 0:
        if offset != 0:
            return "malformed frame", f"first chunk at offset {offset}"
        return None
    if asm is None or asm.msg_id != msg_id or asm.count != count or asm.total != total:
        return "chunk out of sequence", f"chunk {index} of message {msg_id} without its earlier chunks"
    # (sequence numbers need not be consecutive: a control frame, e.g. a shared-memory answer,
    # may be sent between two chunks of a message while the sender waits)
    if index != asm.next_index or offset != asm.filled:
        return "chunk out of sequence", f"chunk {index} of message {msg_id} where chunk {asm.next_index} was expected"
    return None


def opened(asm: Assembly, stats: ChannelStats) -> bool:
    """Wait for the chunks of `asm` being opened on the pool; True if every one authenticated."""
    if not asm.opening:
        return True
    wait_futures(asm.opening)
    times = [job.result() if job.exception() is None else -1.0 for job in asm.opening]
    asm.opening = []
    stats.open_s += sum(t for t in times if t > 0)
    return min(times) >= 0


def _free_refs() -> int:
    """References an unused pooled buffer has inside `PayloadPool.buffer`'s loop (interpreter-specific)."""
    for buf in [np.empty(1, dtype=np.uint8)]:
        return sys.getrefcount(buf)
    return 0


_FREE_REFS = _free_refs()


class PayloadPool:
    """Message buffers, recycled when free, and the scratch the first chunk is opened into."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.bufs: list[np.ndarray] = []  # multi-chunk message buffers
        self._plain0: np.ndarray | None = None

    def buffer(self, n: int) -> np.ndarray:
        """A buffer for an n-byte message: a recycled one when the tensors of an earlier message
        of that size are no longer referenced anywhere (big fresh buffers cost page faults that
        are as slow as the decryption itself), else a new one."""
        pool = self.bufs
        for buf in pool:
            # a live view of the tensors holds a reference beyond the pool's and this loop's; a
            # buffer a little larger serves too (K uploads of one model differ by a few header bytes)
            if n <= len(buf) <= n + (n >> 4) and sys.getrefcount(buf) <= _FREE_REFS:
                return buf if len(buf) == n else buf[:n]
        buf = np.empty(n, dtype=np.uint8)
        pool.append(buf)
        if len(pool) > 2:  # a server folding uploads on arrival needs about two of a size
            pool.pop(0)
        return buf

    def release(self, payload: np.ndarray) -> None:
        """Forget a refused message's buffer, so that its memory goes back at once."""
        self.bufs[:] = [buf for buf in self.bufs if buf is not payload and buf is not payload.base]

    def scratch0(self, n: int) -> np.ndarray:
        """Where a first chunk of n bytes is opened before its message has a buffer."""
        if self._plain0 is None or len(self._plain0) < n:
            self._plain0 = np.empty(max(n, self.chunk_bytes), dtype=np.uint8)
        return self._plain0[:n]

    def clear(self) -> None:
        """Drop every buffer (the channel is closing)."""
        self.bufs.clear()
        self._plain0 = None
