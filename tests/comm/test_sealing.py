"""The sealing pool on its own: sealed chunks open with the same key, a chunk that does not
authenticate reports -1, a rotating receive buffer is handed out again only after the chunk opened
from it is done, and the threads are validated, started on first use and joined."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hpcfed.comm import crypto
from hpcfed.comm.sealing import CryptoPool, check_threads, open_timed, seal_timed

KEY = bytes(range(32))


def _sealer() -> crypto.Sealer:
    return crypto.Sealer(KEY, crypto.DIR_INITIATOR_TO_RESPONDER)


def test_seal_and_open_on_the_pool_report_their_time_or_failure():
    pool = CryptoPool(2, rank=3)
    assert pool.executor is None  # nothing started until needed
    data = np.arange(1000, dtype=np.uint8)
    out = np.empty(1000 + crypto.TAG_BYTES, np.uint8)
    assert pool.pool().submit(seal_timed, _sealer(), 7, data.data, b"aad", out.data).result() >= 0
    back = np.empty(1000, np.uint8)
    assert open_timed(_sealer(), 7, out.data, b"aad", back.data) >= 0 and np.array_equal(back, data)
    assert open_timed(_sealer(), 8, out.data, b"aad", back.data) == -1.0  # another sequence number
    out[5] ^= 1
    assert open_timed(_sealer(), 7, out.data, b"aad", back.data) == -1.0
    assert all(t.name.startswith("hpcfed-crypto3") for t in pool.executor._threads)  # type: ignore[union-attr]
    threads = list(pool.executor._threads)  # type: ignore[union-attr]
    pool.close()
    assert pool.executor is None and not any(t.is_alive() for t in threads)


def test_a_receive_buffer_is_reused_only_after_its_chunk_is_opened():
    pool = CryptoPool(2, rank=0)
    bufs = [pool.rx_buffer(100, 4096) for _ in range(3)]  # threads + 1 buffers in turn
    assert len({id(b.obj) for b in bufs}) == 3
    release = threading.Event()
    done = threading.Event()

    def slow_open() -> float:
        release.wait(10)
        done.set()
        return 0.0

    pool._rx_opening[pool._rx_turn] = pool.pool().submit(slow_open)  # the chunk in the current buffer
    got: list[memoryview] = []

    def take_turns() -> None:  # the third turn comes back to the buffer being opened
        got.extend(pool.rx_buffer(100, 4096) for _ in range(3))

    waiter = threading.Thread(target=take_turns)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not done.is_set()  # it waits for the opening to finish
    release.set()
    waiter.join(10)
    assert done.is_set() and len(got) == 3 and got[2].obj is bufs[2].obj
    pool.close()


@pytest.mark.parametrize("bad", [0, -1, 65, 2.5, True, "4"])
def test_thread_counts_are_checked(bad):
    with pytest.raises(ValueError, match=r"comm\.crypto_threads"):
        check_threads(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"comm\.crypto_threads"):
        CryptoPool(bad, rank=0)  # type: ignore[arg-type]


def test_set_threads_joins_the_old_pool():
    pool = CryptoPool(None, rank=0)
    assert 1 <= pool.threads <= 8
    pool.pool()
    old = list(pool.executor._threads)  # type: ignore[union-attr]
    pool.set_threads(3)
    assert pool.threads == 3 and pool.executor is None and not any(t.is_alive() for t in old)
