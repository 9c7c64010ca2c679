"""The threads that seal and open the chunks of big messages (AES-GCM releases the GIL).

With `crypto_threads` > 1 a message's chunks are sealed in parallel, and every chunk after the first
is opened on a pool thread while the next one is received (the first is opened at once, so nothing
large is reserved for a frame that does not authenticate). Received big frames land in `threads + 1`
rotating buffers; a buffer is reused once the chunk it held has been opened.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

import numpy as np

from hpcfed.comm import crypto


def default_crypto_threads() -> int:
    """The cores this process may run on, at most 8 (sealing threads beyond that buy nothing),
    shared among the ranks the MPI launcher placed on this node (MPICH's MPI_LOCALNRANKS, Open
    MPI's OMPI_COMM_WORLD_LOCAL_SIZE): ranks that share two cores gain nothing from more threads."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or "1"
    if local.isdigit() and int(local) > 1 and cores > 1:
        cores = max(1, cores // int(local))
    return max(1, min(8, cores))


def seal_timed(sealer: crypto.Sealer, seq: int, data: memoryview | bytes, aad: bytes, out: memoryview) -> float:
    """Seal one chunk (on a pool thread); return the seconds it took."""
    t0 = time.perf_counter()
    sealer.seal_into(seq, data, aad, out)
    return time.perf_counter() - t0


def open_timed(opener: crypto.Sealer, seq: int, data: memoryview, aad: bytes, out: memoryview) -> float:
    """Open one chunk (on a pool thread); the seconds it took, or -1 when it does not authenticate."""
    t0 = time.perf_counter()
    if not opener.open_into(seq, data, aad, out):
        return -1.0
    return time.perf_counter() - t0


def check_threads(threads: int | None) -> int:
    """`threads` validated (None: `default_crypto_threads()`)."""
    if threads is None:
        threads = default_crypto_threads()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
        raise ValueError(f"comm.crypto_threads={threads!r}: use an integer in 1..64 "
                         f"(or leave it out for the cores available, at most 8)")
    return threads


class CryptoPool:
    """`threads` sealing/opening threads, started on first use, and the receive buffers they open from."""

    def __init__(self, threads: int | None, rank: int) -> None:
        self.rank = rank
        self.threads = check_threads(threads)
        self.executor: ThreadPoolExecutor | None = None
        self._rx_bigs: list[np.ndarray] = []
        self._rx_opening: list[Future[float] | None] = []
        self._rx_turn = 0

    def set_threads(self, threads: int | None) -> None:
        """Use this many threads from now on; joins the current ones (chunks being opened finish,
        their results stay readable)."""
        threads = check_threads(threads)
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        self._rx_bigs.clear()
        self._rx_opening.clear()
        self._rx_turn = 0
        self.threads = threads

    def pool(self) -> ThreadPoolExecutor:
        """The executor (started here on first use)."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix=f"hpcfed-crypto{self.rank}")
        return self.executor

    def rx_buffer(self, n: int, max_frame: int) -> memoryview:
        """The next of `threads + 1` big receive buffers (n bytes of it), once the chunk it held is opened."""
        self._rx_turn = (self._rx_turn + 1) % (self.threads + 1)
        while len(self._rx_bigs) <= self._rx_turn:
            self._rx_bigs.append(np.empty(max_frame, dtype=np.uint8))
            self._rx_opening.append(None)
        pending = self._rx_opening[self._rx_turn]
        if pending is not None:
            wait_futures([pending])
            self._rx_opening[self._rx_turn] = None
        return self._rx_bigs[self._rx_turn].data[:n]

    def retire_rx_buffers(self) -> None:
        """Fresh receive buffers from now on (MPI may still write into one of the current ones;
        the chunks being opened keep theirs alive until they are done)."""
        self._rx_bigs.clear()
        self._rx_opening.clear()
        self._rx_turn = 0

    def open_later(self, opener: crypto.Sealer, seq: int, ciphertext: memoryview, aad: bytes,
                   out: memoryview) -> Future[float]:
        """Open the chunk in the current receive buffer on a pool thread; the buffer waits for it."""
        job = self.pool().submit(open_timed, opener, seq, ciphertext, aad, out)
        self._rx_opening[self._rx_turn] = job
        return job

    def close(self) -> None:
        """Join the threads (queued work is cancelled) and drop the buffers."""
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)
            self.executor = None
        self._rx_bigs.clear()
        self._rx_opening.clear()
